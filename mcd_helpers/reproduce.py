"""The reproduction pipeline behind ``python -m mcd_helpers reproduce``.

1. Load Fashion-MNIST (ID) and pre-train the model, or reuse the cached pre-trained checkpoint
   (``<cache root>/checkpoints/pretrain-<model>-<hash>.pt``, the hash covering every setting
   that shapes it).
2. For each OOD set: the transductive split; the MSP baseline on the pre-trained network; then
   one MCD fine-tuning per strategy, each from the same pre-trained weights and seed.
3. Evaluate on the test split and write ``results.json`` (atomically), ``results.md`` and, per
   OOD set, ``hist_<ood>.png`` (score histograms) and ``roc_<ood>.png`` (ROC curves).

Under ``torchrun --standalone --nproc_per_node=N -m mcd_helpers reproduce ...`` every stage trains
with DDP (:mod:`mcd_helpers.distributed`: settings and why), the test and validation scores are
gathered from all ranks so the metrics use the whole split, and only rank 0 writes the cache,
checkpoints, ``results.json``, ``results.md`` and the plots; every rank returns the same rows.

Every training stage checkpoints into ``<out>/checkpoints/`` (:mod:`mcd_helpers.train`), so an
interrupted run continues with ``resume=True`` (CLI: ``--resume``) and ends with the same numbers.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from .checkpoint import (CorruptCheckpointError, RollingCheckpoint, atomic_write_json, atomic_write_text,
                         load_checkpoint, save_checkpoint)
from .config import MCDConfig
from .distributed import (broadcast_buffers, check_sync_bn, gather_scores, init_distributed, is_main_process,
                          stage_key)
from .data import cache_root, load_id, load_ood, transductive_split
from .losses import discrepancy_score, msp_score
from .metrics import METRIC_KEYS, ood_metrics
from .models import TwoHeadNet, build_model
from .engine import CheckpointMismatchError
from .train import finetune, predict_logits, pretrain, set_seed

__all__ = ["run_reproduction", "pretrained_model", "id_accuracy", "results_markdown", "load_results"]

_ID_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


def id_accuracy(logits1: torch.Tensor, targets: torch.Tensor) -> float:
    """Classification accuracy (fraction) of F1 on ID data.

    F1 is the network's classifier: in the official Step A only F1's cross-entropy reaches G
    (F2 sees detached features), and Step B pushes F2 to be confident on unlabeled data.

    Shapes:
        logits1: ``(N, K)``; targets: ``(N,)``.
    """
    return float((logits1.argmax(1) == targets).float().mean())


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def _fresh_copy(cfg: MCDConfig, model: TwoHeadNet) -> TwoHeadNet:
    """A plain (uncompiled, CPU) model of ``cfg.model`` holding ``model``'s weights and buffers."""
    fresh = build_model(cfg.model, model.in_channels, model.num_classes, cfg.norm)
    fresh.load_state_dict(model.state_dict())
    return fresh


def pretrained_model(cfg: MCDConfig, x: torch.Tensor, y: torch.Tensor, retrain: bool = False,
                     progress: bool = True, quiet: bool = False, checkpoint_dir: Path | None = None,
                     resume: bool = False) -> TwoHeadNet:
    """The pre-trained network for ``cfg``: loaded from the cache if there, else trained and cached.

    The cache file is ``<cache root>/checkpoints/pretrain-<model>-<cfg.pretrain_key()>.pt``.
    While training, checkpoints go to ``checkpoint_dir`` (when given); ``resume=True`` continues
    from them. Returns a plain model on the CPU (not compiled), whatever ``cfg``'s fast path.

    Raises:
        NonFiniteLossError, TrainingInterrupted: from :func:`~mcd_helpers.train.pretrain`.
    """
    path = cache_root() / "checkpoints" / f"pretrain-{cfg.model}-{stage_key(cfg.pretrain_key(), cfg.sync_bn)}.pt"
    in_channels, num_classes = x.shape[1], int(y.max()) + 1
    model = build_model(cfg.model, in_channels, num_classes, cfg.norm)
    if path.exists() and not retrain:
        try:
            model.load_state_dict(load_checkpoint(path, required=("model",))["model"])
            _log(f"reusing the pre-trained network {path}", quiet)
            return model
        except CorruptCheckpointError as err:
            _log(f"{err} Training again.", quiet)
    ckpt = RollingCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    set_seed(cfg.seed)
    model = build_model(cfg.model, in_channels, num_classes, cfg.norm)
    t0 = time.time()
    losses = pretrain(model, x, y, cfg, progress=progress, checkpoint=ckpt, resume=resume)
    _log(f"pre-trained {cfg.model} for {cfg.pretrain_epochs} epochs in {time.time() - t0:.0f} s "
         f"(last epoch's loss {losses[-1]:.3f} nats)", quiet)
    model = _fresh_copy(cfg, model.cpu())
    if not is_main_process():
        return model
    save_checkpoint(path, {"model": model.state_dict(), "config": cfg.to_dict(), "losses": losses})
    if ckpt is not None:
        ckpt.clear()  # the cache file now holds the result
    return model


def results_markdown(rows: list[dict]) -> str:
    """A Markdown table of result rows, metrics in % (the paper's unit)."""
    head = ("| ID | OOD | method | strategy | FPR95 | det. error | AUROC | AUPR-In | AUPR-Out | ID acc. |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|\n")
    lines = [f"| {r['id_dataset']} | {r['ood_dataset']} | {r['method']} | {r['strategy'] or '-'} | "
             + " | ".join(f"{100 * r[k]:.2f}" for k in (*METRIC_KEYS, "id_accuracy")) + " |"
             for r in rows]
    return head + "\n".join(lines) + "\n\nAll numbers in %. FPR95 and detection error: lower is better.\n"


def _row(cfg: MCDConfig, ood: str, method: str, strategy, metrics: dict, acc: float, **extra) -> dict:
    return {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "method": method, "strategy": strategy,
            "seed": cfg.seed, **metrics, "id_accuracy": acc, **extra}


def _finetuned(cfg: MCDConfig, base: TwoHeadNet, x_train, y_train, split, ood: str, strategy: str,
               ckpt_dir: Path, progress: bool, quiet: bool, resume: bool) -> tuple[TwoHeadNet, dict]:
    """One fine-tuning stage: reloaded when a resumed run finished it already, else trained.

    Returns the fine-tuned model (best validation AUROC) and ``{"val_auroc", "seconds"}``.
    """
    final = ckpt_dir / f"mcd-{ood}-{strategy}.pt"
    if resume and final.exists():
        try:
            state = load_checkpoint(final, required=("model", "key", "val_auroc", "seconds"))
            if state["key"] != stage_key(cfg.training_key(), cfg.sync_bn):
                raise CheckpointMismatchError(
                    f"{final} was fine-tuned with other settings ({state['key']}) than this run's "
                    f"({stage_key(cfg.training_key(), cfg.sync_bn)}): the settings changed. Resume with the "
                    "same settings, or run without --resume (or with another --out).")
            model = _fresh_copy(cfg, base)
            model.load_state_dict(state["model"])
            _log(f"{ood:>12} | mcd {strategy:>8} | finished before, reloaded from {final}", quiet)
            return model.to(cfg.device), state
        except CorruptCheckpointError as err:
            _log(f"{err} Fine-tuning again.", quiet)
    stage = RollingCheckpoint(ckpt_dir / f"mcd-{ood}-{strategy}")
    set_seed(cfg.seed)
    model = _fresh_copy(cfg, base)
    t0 = time.time()
    hist = finetune(model, x_train, y_train, split, cfg, strategy, progress=progress, checkpoint=stage,
                    resume=resume)
    info = {"val_auroc": hist.val_auroc, "seconds": round(time.time() - t0, 1)}
    if not is_main_process():
        return model, info
    save_checkpoint(final, {"model": model.state_dict(), "config": cfg.to_dict(),
                            "key": stage_key(cfg.training_key(), cfg.sync_bn), "ood": ood, "strategy": strategy, **info})
    stage.clear()  # the final file now holds the result
    return model, info


def run_reproduction(cfg: MCDConfig, out_dir: Path, retrain: bool = False, progress: bool = True,
                     quiet: bool = False, resume: bool = False) -> list[dict]:
    """Run the whole reproduction for ``cfg`` and write the results into ``out_dir``.

    Checkpoints go to ``out_dir/checkpoints/``: ``pretrain/`` while pre-training (the result goes
    to the cache), ``mcd-<ood>-<strategy>/`` while fine-tuning and ``mcd-<ood>-<strategy>.pt`` once
    a fine-tuning stage is done. ``resume=True`` continues an interrupted run from them: finished
    stages are reloaded, the interrupted one continues from its last checkpoint, exactly (on the
    CPU the results equal those of an uninterrupted run).

    Returns:
        the result rows (also in ``out_dir/results.json``): one ``msp`` row per OOD set and one
        ``mcd`` row per OOD set and strategy, metrics as fractions (see :mod:`mcd_helpers.metrics`).

    Raises:
        DataNotFoundError: when Fashion-MNIST (or ``mnist``) cannot be found.
        ValueError: on an unknown OOD set name, or when ``cfg.device`` is a CUDA device and no GPU
            is available (both checked before any work).
        NonFiniteLossError: when training diverges (the last good checkpoint is kept).
        TrainingInterrupted: on SIGTERM during training, after a checkpoint is saved.
        CheckpointMismatchError: (a ValueError) when resuming with settings that differ from the
            interrupted run's.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import plot_roc_curves, plot_score_histograms

    cfg.check_ood_sets()
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but PyTorch sees no CUDA GPU here (torch.cuda.is_available() "
                         "is False); run with --device cpu (the paper presets default to cuda).")
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    # ---- torchrun: process group, this rank's device; only rank 0 logs and writes ----
    env, device = init_distributed(cfg.device)
    if device != cfg.device:
        cfg = dataclasses.replace(cfg, device=device)
    if cfg.sync_bn and env.distributed:
        check_sync_bn(cfg.device)
    main = is_main_process()
    quiet, progress = quiet or not main, progress and main
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints"
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "config.json", cfg.to_dict())

    def logits(model, x):  # both heads' logits on all of x, scored in shards by all ranks
        return gather_scores(lambda t: predict_logits(model, t, cfg.eval_batch_size, cfg.device), x)

    x_train, y_train = load_id(cfg.id_dataset, train=True)
    if cfg.train_subset > 0:
        x_train, y_train = x_train[:cfg.train_subset], y_train[:cfg.train_subset]
    x_test, y_test = load_id(cfg.id_dataset, train=False)
    if cfg.test_subset > 0:
        x_test, y_test = x_test[:cfg.test_subset], y_test[:cfg.test_subset]
    base = pretrained_model(cfg, x_train, y_train, retrain=retrain, progress=progress, quiet=quiet,
                            checkpoint_dir=ckpt_dir / "pretrain", resume=resume)
    base.to(cfg.device)
    broadcast_buffers(base)  # after DDP pre-training the ranks' BatchNorm statistics differ: use rank 0's
    id_name = _ID_NAMES.get(cfg.id_dataset, cfg.id_dataset)

    rows: list[dict] = []
    for ood in cfg.ood_sets:
        split = transductive_split(x_test, y_test, load_ood(ood, cfg.ood_size, cfg.seed, cfg.id_dataset),
                                   cfg.n_val, cfg.split_seed)
        # ---- MSP baseline on the pre-trained network (F1's softmax) ----
        l1_id, _ = logits(base, split.test_id_x)
        l1_ood, _ = logits(base, split.test_ood_x)
        msp = (msp_score(l1_id), msp_score(l1_ood))
        rows.append(_row(cfg, ood, "msp", None, ood_metrics(*msp), id_accuracy(l1_id, split.test_id_y),
                         world_size=env.world_size))
        panels, curves = {"MSP (pre-trained)": msp}, {"MSP (pre-trained)": msp}
        # ---- MCD fine-tuning, once per strategy, from the same weights and seed ----
        for strategy in cfg.strategies:
            model, info = _finetuned(cfg, base, x_train, y_train, split, ood, strategy, ckpt_dir,
                                     progress, quiet, resume)
            broadcast_buffers(model)
            l1_id, l2_id = logits(model, split.test_id_x)
            l1_ood, l2_ood = logits(model, split.test_ood_x)
            mcd = (discrepancy_score(l1_id, l2_id), discrepancy_score(l1_ood, l2_ood))
            m = ood_metrics(*mcd)
            rows.append(_row(cfg, ood, "mcd", strategy, m, id_accuracy(l1_id, split.test_id_y),
                             best_val_auroc=max(info["val_auroc"]), finetune_seconds=info["seconds"],
                             world_size=env.world_size))
            panels[f"MCD ({strategy})"] = curves[f"MCD ({strategy})"] = mcd
            _log(f"{ood:>12} | mcd {strategy:>8} | AUROC {100 * m['auroc']:6.2f}% | FPR95 "
                 f"{100 * m['fpr95']:5.2f}% | ID acc. {100 * rows[-1]['id_accuracy']:.2f}% | "
                 f"{info['seconds']:.0f} s", quiet)
        if not main:
            continue
        for name, fig in ((f"hist_{ood}.png", plot_score_histograms(panels, f"{id_name} (ID) vs {ood} (OOD)")),
                          (f"roc_{ood}.png", plot_roc_curves(curves, f"{id_name} vs {ood}"))):
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
    if main:
        atomic_write_json(out_dir / "results.json", rows)
        atomic_write_text(out_dir / "results.md", results_markdown(rows))
    return rows


def load_results(out_dir: Path) -> list[dict]:
    """Read ``out_dir/results.json``."""
    return json.loads((Path(out_dir) / "results.json").read_text())
