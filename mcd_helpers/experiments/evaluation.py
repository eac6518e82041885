"""The test split scored and measured: MSP, ODIN and energy on the pre-trained network (F1), MCD's
discrepancy score on each fine-tuned one. Higher = more OOD for every score; the metrics are
:func:`mcd_helpers.metrics.ood_metrics`' (fractions, ID the positive class)."""

import contextlib
import time
from typing import Sequence

import torch
from torch import nn

from ..data import pixel_std
from ..losses import discrepancy_score, energy_score, msp_score
from ..metrics import ood_metrics
from ..models import predict_logits
from ..odin import odin_scores, tune_odin
from ..splits import Split
from . import ddp

# the baselines score the pre-trained network, MCD the tuned
METHODS = ("msp", "odin", "energy", "mcd")
# ODIN's T and epsilon (Liang et al. 2018), used without OOD labels
ODIN_PUBLISHED = (1000.0, 0.0014)


@contextlib.contextmanager
def timed(seconds: dict, stage: str):
    """``with timed(seconds, stage):`` adds the block's wall-clock seconds to ``seconds[stage]`` (a
    profile)."""
    t0 = time.perf_counter()
    yield
    seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - t0, 2)


def test_logits(cfg, model: nn.Module, split: Split) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both heads' logits on the ID and on the OOD test images: ``[(l1, l2) of ID, (l1, l2) of
    OOD]``, each ``(N, K)`` on the CPU; under torchrun each rank scores a shard and all get all.

    The model moves to ``cfg.device`` (NHWC when ``cfg.channels_last``: 1.6x faster on a CPU); its
    weights are not changed.
    """
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = model.to(cfg.device, memory_format=layout)

    def logits(x: torch.Tensor) -> tuple:
        return predict_logits(model, x, cfg.eval_batch_size, cfg.device)

    return [ddp.gather(logits, x) for x in (split.test_id_x, split.test_ood_x)]


def odin_setting(cfg, base: nn.Module, split: Split) -> tuple[float, float]:
    """ODIN's ``(T, epsilon)``: the best validation AUROC over ``cfg``'s grid under the selection
    ``ood-labels``; under ``last-epoch`` (no OOD label) ODIN's published T = 1000, eps = 0.0014."""
    if cfg.selection != "ood-labels":
        return ODIN_PUBLISHED
    kw = dict(
        pixel_std=pixel_std(cfg.id_dataset), batch_size=cfg.eval_batch_size, device=cfg.device
    )
    grid = (cfg.odin_temperatures, cfg.odin_epsilons)
    return tune_odin(base, split.val_id_x, split.val_ood_x, *grid, **kw)[:2]


def _baselines(cfg, base: nn.Module, split: Split, logits: list, methods, seconds: dict) -> dict:
    """``{method: (scores (id, ood), extra row fields)}`` of the baselines among ``methods``."""
    (l1_id, _), (l1_ood, _) = logits
    found = {}
    if "msp" in methods:
        found["msp"] = ((msp_score(l1_id), msp_score(l1_ood)), {})
    if "odin" in methods:
        with timed(seconds, "odin search"):
            t, eps = odin_setting(cfg, base, split)
        kw = dict(
            pixel_std=pixel_std(cfg.id_dataset), batch_size=cfg.eval_batch_size, device=cfg.device
        )
        scores = tuple(
            odin_scores(base, x, t, [eps], **kw)[0] for x in (split.test_id_x, split.test_ood_x)
        )
        found["odin"] = (scores, {"odin_temperature": t, "odin_epsilon": eps})
    if "energy" in methods:
        found["energy"] = ((energy_score(l1_id), energy_score(l1_ood)), {})
    return found


def evaluate(
    cfg,
    base: nn.Module,
    tuned: dict[str, nn.Module],
    split: Split,
    ood: str,
    methods: Sequence[str] = METHODS,
    seconds: dict | None = None,
) -> tuple[list[dict], dict]:
    """Every method's metrics and test scores under ``cfg.selection``.

    MSP, ODIN and energy score F1 of ``base``; MCD the discrepancy of each model in ``tuned``
    (``{strategy: model}``, scores named ``"mcd:<strategy>"``). ``id_accuracy``: F1's accuracy on
    the ID test images. ODIN's search time is added to ``seconds["odin search"]`` when given.

    Returns:
        ``(rows, scores)``: rows in the order msp, odin, energy, then mcd per strategy, metrics as
        fractions; ``{name: (id_scores (N_id,), ood_scores (N_ood,))}``.
    """
    common = {
        "id_dataset": cfg.id_dataset,
        "ood_dataset": ood,
        "class_split": cfg.class_split,
        "protocol": cfg.protocol,
        "selection": cfg.selection,
        "seed": cfg.seed,
    }
    rows, scores = [], {}

    def add(name: str, method: str, strategy, pair: tuple, l1_id: torch.Tensor, **extra) -> None:
        accuracy = float((l1_id.argmax(1) == split.test_id_y).float().mean())
        scores[name] = pair
        row = {**common, "method": method, "strategy": strategy, **ood_metrics(*pair)}
        rows.append({**row, "id_accuracy": accuracy, **extra})

    if any(m != "mcd" for m in methods):  # the baselines score the pre-trained network
        logits = test_logits(cfg, base, split)
        for method, (pair, extra) in _baselines(
            cfg, base, split, logits, methods, {} if seconds is None else seconds
        ).items():
            add(method, method, None, pair, logits[0][0], **extra)
    for strategy, model in tuned.items() if "mcd" in methods else ():
        (l1_id, l2_id), (l1_ood, l2_ood) = test_logits(cfg, model, split)
        pair = (discrepancy_score(l1_id, l2_id), discrepancy_score(l1_ood, l2_ood))
        add(f"mcd:{strategy}", "mcd", strategy, pair, l1_id)
    return rows, scores
