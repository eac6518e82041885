"""Baseline OOD detectors on a pre-trained network: MSP, ODIN and the energy score.

All scores follow the package's convention, **higher score = more OOD**, so they go straight
into :func:`mcd_helpers.metrics.ood_metrics` next to MCD's discrepancy score.

* MSP (Hendrycks & Gimpel, ICLR 2017, arXiv 1610.02136): ``1 - max_k softmax(logits)_k``.
* ODIN (Liang, Li & Srikant, ICLR 2018, arXiv 1706.02690, Eq. 2; official code
  github.com/facebookresearch/odin ``code/calData.py``): temperature scaling and a small input
  perturbation ``x~ = x - eps * sign(-grad_x log S_yhat(x; T))`` that raises the softmax score of
  the predicted class; ID images gain more than OOD images. Score: ``1 - max_k softmax(f(x~)/T)_k``.
* Energy (Liu et al., NeurIPS 2020, arXiv 2010.03759, Eq. 5): ``-T logsumexp(logits / T)``.

The pure score functions on logits live in :mod:`mcd_helpers.losses`; this module runs the model.
For a two-head network the baselines use one head's logits (``head="F1"`` by default: F1 is the
classifier whose cross-entropy trains G in the official Step A).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..losses import energy_score, msp_score
from ..metrics import ood_metrics

__all__ = ["BASELINES", "head_logits", "odin_score", "OdinParams", "tune_odin", "baseline_scores",
           "ODIN_TEMPERATURES", "ODIN_EPSILONS"]

BASELINES = ("msp", "odin", "energy")
# ODIN's search grid (paper Sec. 4.2 / Appendix): T in {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000},
# eps in 21 steps from 0 to 0.004; a coarser grid of the same range keeps the search cheap.
ODIN_TEMPERATURES = (1.0, 10.0, 100.0, 1000.0)
ODIN_EPSILONS = (0.0, 0.0005, 0.001, 0.0014, 0.002, 0.003, 0.004)


def head_logits(outputs, head: str = "F1") -> torch.Tensor:
    """Pick one head's logits from a model's output.

    Args:
        outputs: ``(logits1, logits2)`` of a two-head model, or a single ``(N, K)`` tensor.
        head: ``"F1"`` or ``"F2"`` (ignored for a single tensor).

    Raises:
        ValueError: on a head other than ``"F1"``/``"F2"``.
    """
    if head not in ("F1", "F2"):
        raise ValueError(f"head must be 'F1' or 'F2', got {head!r}.")
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs[0] if head == "F1" else outputs[1]


def _pixel_std(pixel_std, channels: int, dtype, device) -> torch.Tensor:
    std = torch.as_tensor(pixel_std, dtype=dtype, device=device).flatten()
    if std.numel() not in (1, channels) or bool((std <= 0).any()):
        raise ValueError(f"pixel_std must be one positive number or one per channel ({channels}), "
                         f"got {pixel_std!r}.")
    return std.view(1, -1, 1, 1)


def _odin_scores(model: nn.Module, x: torch.Tensor, temperature: float, epsilons: Sequence[float],
                 pixel_std, head: str, batch_size: int, device) -> list[torch.Tensor]:
    """ODIN scores of ``x`` for several epsilons at one temperature: one gradient per batch, reused."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if any(eps < 0 for eps in epsilons):
        raise ValueError(f"epsilon must be >= 0 (pixel units, e.g. 0.0014), got {list(epsilons)}.")
    std = _pixel_std(pixel_std, x.shape[1], x.dtype, device)
    was_training = model.training
    model.eval()
    scores: list[list[torch.Tensor]] = [[] for _ in epsilons]
    try:
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size].to(device).requires_grad_(True)
            with torch.enable_grad():
                logits = head_logits(model(xb), head)  # (B, K)
                # Sum, not mean: in eval mode each sample's gradient is its own term's.
                loss = F.cross_entropy(logits / temperature, logits.argmax(1), reduction="sum")
                (grad,) = torch.autograd.grad(loss, xb)  # (B, C, H, W); parameters untouched
            step = torch.where(grad >= 0, 1.0, -1.0) / std
            with torch.no_grad():
                for j, eps in enumerate(epsilons):
                    x_tilde = xb.detach() - eps * step
                    scores[j].append(msp_score(head_logits(model(x_tilde), head), temperature).cpu())
    finally:
        model.train(was_training)
    return [torch.cat(s) for s in scores]


def odin_score(model: nn.Module, x: torch.Tensor, temperature: float = 1000.0, epsilon: float = 0.0014,
               pixel_std=1.0, head: str = "F1", batch_size: int = 500,
               device: str | torch.device = "cpu") -> torch.Tensor:
    """ODIN's OOD score, running ``model`` in eval mode (its mode is restored afterwards).

    For each batch: ``yhat = argmax f(x)``; ``g = grad_x CE(f(x) / T, yhat)`` (= ``-grad_x log
    S_yhat(x; T)``); ``x~ = x - epsilon * sign(g) / pixel_std`` (ODIN's code takes the sign as
    ``g >= 0 -> +1 else -1`` and divides it by the normalisation's std, so that ``epsilon`` is a
    step in pixel units of [0, 1] images); score ``= 1 - max_k softmax(f(x~) / T)_k``.

    Args:
        model: returns ``(logits1, logits2)`` or ``logits``; its parameters get no gradient.
        x: normalised images ``(N, C, H, W)``.
        temperature: T > 0 (ODIN: 1000).
        epsilon: perturbation size in pixel units (ODIN: 0.0014 for DenseNet on CIFAR-10).
        pixel_std: the std used to normalise ``x`` (one number or one per channel), e.g.
            :data:`mcd_helpers.data.sets.FMNIST_STD` or :data:`mcd_helpers.data.cifar.CIFAR_STD`.
        head: ``"F1"`` or ``"F2"`` for a two-head model.

    Shapes:
        x: ``(N, C, H, W)`` -> ``(N,)`` in [0, 1 - 1/K]; higher = more OOD.

    Raises:
        ValueError: on ``temperature <= 0``, ``epsilon < 0``, a bad ``pixel_std`` or ``head``.
    """
    head_logits(torch.empty(0, 2), head)  # validate the head name before running anything
    return _odin_scores(model, x, temperature, [epsilon], pixel_std, head, batch_size, device)[0]


@dataclass
class OdinParams:
    """ODIN's chosen temperature and epsilon, and the validation AUROC (fraction) of every pair tried."""
    temperature: float
    epsilon: float
    val_auroc: dict  # {(T, eps): AUROC}


def tune_odin(model: nn.Module, val_id_x: torch.Tensor, val_ood_x: torch.Tensor,
              temperatures: Sequence[float] = ODIN_TEMPERATURES, epsilons: Sequence[float] = ODIN_EPSILONS,
              pixel_std=1.0, head: str = "F1", batch_size: int = 500,
              device: str | torch.device = "cpu") -> OdinParams:
    """Choose ODIN's (T, epsilon) by the AUROC on a validation split of ID and OOD images.

    ODIN tunes on OOD validation samples; here on the same validation split MCD uses for its
    model selection (the first 1,000 of each set, :func:`~mcd_helpers.data.sets.transductive_split`),
    so both methods see the same data. Ties go to the first pair in grid order.

    Raises:
        ValueError: on an empty grid (and as :func:`odin_score`).
    """
    if not temperatures or not epsilons:
        raise ValueError("tune_odin needs at least one temperature and one epsilon.")
    grid = {}
    for t in temperatures:  # one input gradient per temperature, shared by every epsilon
        s_id = _odin_scores(model, val_id_x, t, epsilons, pixel_std, head, batch_size, device)
        s_ood = _odin_scores(model, val_ood_x, t, epsilons, pixel_std, head, batch_size, device)
        for eps, a, b in zip(epsilons, s_id, s_ood):
            grid[(t, eps)] = ood_metrics(a, b)["auroc"]
    best = max(grid, key=grid.get)  # max returns the first maximal key
    return OdinParams(temperature=best[0], epsilon=best[1], val_auroc=grid)


@torch.no_grad()
def _logits(model: nn.Module, x: torch.Tensor, head: str, batch_size: int, device) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        return torch.cat([head_logits(model(x[i:i + batch_size].to(device)), head).cpu()
                          for i in range(0, len(x), batch_size)])
    finally:
        model.train(was_training)


def baseline_scores(model: nn.Module, x: torch.Tensor, odin: OdinParams | None = None,
                    methods: Sequence[str] = BASELINES, pixel_std=1.0, head: str = "F1",
                    batch_size: int = 500, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Scores of the baselines on ``x``, each ``(N,)``, higher = more OOD.

    Args:
        odin: ODIN's parameters (from :func:`tune_odin`); ``None`` uses ODIN's published
            defaults T = 1000, epsilon = 0.0014.
        methods: a subset of ``("msp", "odin", "energy")``.

    Raises:
        ValueError: on an unknown method.
    """
    unknown = [m for m in methods if m not in BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}.")
    out = {}
    if "msp" in methods or "energy" in methods:
        logits = _logits(model, x, head, batch_size, device)  # (N, K)
        if "msp" in methods:
            out["msp"] = msp_score(logits)
        if "energy" in methods:
            out["energy"] = energy_score(logits)
    if "odin" in methods:
        t, eps = (1000.0, 0.0014) if odin is None else (odin.temperature, odin.epsilon)
        out["odin"] = odin_score(model, x, t, eps, pixel_std, head, batch_size, device)
    return {m: out[m] for m in methods}
