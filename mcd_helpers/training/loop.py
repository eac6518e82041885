"""MCD training: pre-training, and fine-tuning with Step A / Step B, in plain PyTorch loops.

The losses of one iteration (Step A, Step B and its strategies) are in :mod:`mcd_helpers.steps`;
this module runs them over the data. How the loops are built (each one reads top to bottom;
``benchmarks/run.py`` measures them against a hand-written loop):

* **Data order** is a pure function of the seed (:class:`~mcd_helpers.training.batches.Batches`):
  a seeded permutation per (seed, stream, pass). A resumed run skips the batches already consumed
  by arithmetic, and the data set can live on the GPU.
* **No host-device synchronisation per step**: the per-step losses stay on the device and are
  read back, and checked for NaN/inf, every ``cfg.checkpoint_every`` steps and at each epoch end
  (one sync each), before any checkpoint is written: a NaN never reaches a checkpoint.
* **Checkpoints** (``checkpoint=``, a :class:`~mcd_helpers.training.checkpoint.RollingCheckpoint`)
  every ``cfg.checkpoint_every`` steps and at each epoch end hold the model, optimizer, scheduler,
  the RNG states, epoch and step, the history and (fine-tuning) the best validation AUROC and its
  weights. ``resume=True`` continues from them exactly. SIGTERM or SIGINT (Ctrl-C) finishes the
  step in progress, saves, and raises :class:`~mcd_helpers.errors.TrainingInterrupted`.
* **Live views**: ``finetune(..., on_epoch=f)`` calls ``f(epoch, history)`` after every epoch
  (a notebook's live plot); the run itself is not restarted or cut into pieces.
* **Fast path** (config fields, all off by default): ``amp="bf16"``, ``channels_last``, ``compile``
  (G only, ``dynamic=False``), ``data_on_device``.
* **torchrun**: both stages train through :func:`~mcd_helpers.training.distributed.wrap_ddp`;
  each rank takes ``batch[rank::world]`` of every single-process batch; validation scores are
  gathered from all ranks; only rank 0 writes checkpoints. In one process nothing changes.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..losses import discrepancy_score, supervised_loss
from ..metrics import ood_metrics
from ..data.nearood import SELECTIONS
from ..steps import check_strategy, step_a_loss, step_b_loss
from .batches import LABELED, PRETRAIN, UNLABELED, Batches
from .checkpoint import RollingCheckpoint, rng_state, set_rng_state
from .distributed import average_buffers, gather_scores, is_main_process, world, wrap_ddp
from .engine import autocast, load_stage_state, place, prepare_model, read_back, stop_on_sigterm, take

__all__ = ["set_seed", "step_a", "pretrain", "finetune", "predict_logits", "FinetuneHistory", "SELECTIONS"]




def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds the CUDA generators too


def step_a(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor,
           optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Official Step A: :func:`step_a_loss`, one backward and optimizer step. Returns the loss (detached)."""
    loss = step_a_loss(model, x_sup, y_sup)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 1000,
                   device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Both heads' logits on ``x`` ``(N, C, H, W)`` in eval mode -> two ``(N, K)`` CPU tensors.

    The model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        outs = [model(x[i:i + batch_size].to(device)) for i in range(0, len(x), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat([o[0] for o in outs]).cpu(), torch.cat([o[1] for o in outs]).cpu()


def _sgd(model: nn.Module, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def _batches(n: int, batch_size: int, seed: int, stream: int, device) -> Batches:
    rank, world_size = world()
    return Batches(n, batch_size, seed, stream, device, rank, world_size)


def _due(cfg, global_step: int) -> bool:
    return cfg.checkpoint_every > 0 and global_step % cfg.checkpoint_every == 0


# ----------------------------------------------------------------------------------------------
# Pre-training
# ----------------------------------------------------------------------------------------------

def pretrain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg, progress: bool = True,
             checkpoint: RollingCheckpoint | None = None, resume: bool = False, key: str = "") -> list[float]:
    """Pre-train both heads with CE(F1) + CE(F2) on labeled ID data, SGD with step decay.

    Args:
        model: a :class:`~mcd_helpers.models.TwoHeadNet` (trained in place, on ``cfg.device``).
        x: ``(N, C, H, W)`` images; y: ``(N,)`` labels.
        cfg: an :class:`~mcd_helpers.experiments.config.MCDConfig` (``pretrain_*`` fields, ``seed``, ``device``,
            ``checkpoint_every`` and the fast-path fields).
        checkpoint: where to keep checkpoints (none when ``None``).
        resume: continue from ``checkpoint``'s last state when there is one.
        key: the settings' hash (:func:`mcd_helpers.experiments.cache.cache_key`), stored in the
            checkpoints; resuming with another key is refused.

    Returns:
        the mean training loss of each epoch (nats).

    Raises:
        NonFiniteLossError: when a loss becomes NaN or inf (names the step; last checkpoint kept).
        TrainingInterrupted: after SIGTERM or SIGINT (only while ``checkpoint`` is given), once saved.
        CheckpointMismatchError: (a ValueError) if ``resume`` finds a checkpoint of other settings.
    """
    device = torch.device(cfg.device)
    net = prepare_model(model, cfg).train()
    model = wrap_ddp(net, cfg.device, cfg.sync_bn)  # ``net`` itself in one process; train through ``model``
    writer = checkpoint if is_main_process() else None  # every rank may read; rank 0 writes
    opt = _sgd(net, cfg.pretrain_lr, cfg.pretrain_momentum, cfg.pretrain_weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(cfg.pretrain_milestones), gamma=0.1)
    x, y = place(x, cfg), place(y, cfg)
    batches = _batches(len(x), cfg.pretrain_batch_size, cfg.seed, PRETRAIN, x.device)
    steps = batches.per_pass
    history, epoch_losses, start_epoch, start_step, pending = [], [], 0, 0, []

    # ---- resume: model, optimizer, scheduler, RNG states, position, losses so far ----
    state = load_stage_state(checkpoint, resume, "pretrain", key)
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_epoch, start_step = state["epoch"], state["step"]
        history, epoch_losses = state["history"], state["epoch_losses"]

    def save(epoch: int, step: int) -> None:
        if writer is None:
            return
        writer.save({"stage": "pretrain", "key": key, "config": cfg.to_dict(), "model": net.state_dict(),
                         "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(),
                         "epoch": epoch, "step": step, "history": history, "epoch_losses": epoch_losses})

    with stop_on_sigterm(checkpoint is not None) as stop:
        for epoch in range(start_epoch, cfg.pretrain_epochs):
            stage = f"pre-training {epoch + 1}/{cfg.pretrain_epochs}"
            for step in tqdm(range(start_step, steps), desc=stage, disable=not progress, leave=False,
                             initial=start_step, total=steps):
                # ---- one step: CE(F1) + CE(F2) on a labeled batch ----
                idx = batches.batch(epoch, step)
                xb, yb = take(x, idx, device, cfg.channels_last), take(y, idx, device)
                with autocast(cfg, device):
                    logits1, logits2 = model(xb)  # (B, K) each
                    loss = supervised_loss(logits1, logits2, yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                pending.append((epoch, step, loss.detach().reshape(1)))
                # ---- every N steps, and at once on SIGTERM: losses read back and checked, checkpoint ----
                if stop.requested or _due(cfg, epoch * steps + step + 1):
                    epoch_losses += [r[0] for r in read_back(pending, ("ce",), "pre-training", checkpoint)]
                    if checkpoint is not None:
                        save(epoch, step + 1)
                    if stop.requested:
                        raise stop.interrupted(f"in {stage} step {step + 1}/{steps}; "
                                               f"saved in {checkpoint.folder}. Resume to continue.")
            start_step = 0
            # ---- epoch end: losses read back and checked, lr decay, checkpoint ----
            epoch_losses += [r[0] for r in read_back(pending, ("ce",), "pre-training", checkpoint)]
            history.append(sum(epoch_losses) / len(epoch_losses))
            epoch_losses = []
            sched.step()
            average_buffers(net)  # per-rank BatchNorm statistics: their mean over the ranks (saved by rank 0)
            if checkpoint is not None:
                save(epoch + 1, 0)
                if stop.requested:
                    raise stop.interrupted(f"at the end of {stage}; saved in {checkpoint.folder}.")
    return history


# ----------------------------------------------------------------------------------------------
# Fine-tuning
# ----------------------------------------------------------------------------------------------

@dataclass
class FinetuneHistory:
    """Per-step losses (nats) and per-epoch validation AUROC of one fine-tuning run."""
    ce: list[float] = field(default_factory=list)  # Step B: CE(F1) + CE(F2) on the labeled batch
    dis: list[float] = field(default_factory=list)  # Step B: discrepancy loss
    gap: list[float] = field(default_factory=list)  # mean H(p1) - H(p2) on the unlabeled batch
    val_auroc: list[float] = field(default_factory=list)
    best_epoch: int = -1
    step_a: list[float] = field(default_factory=list)  # Step A's loss (official schedule only)


def finetune(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, split, cfg, strategy: str,
             progress: bool = True, checkpoint: RollingCheckpoint | None = None, resume: bool = False,
             key: str = "", on_epoch: Callable[[int, "FinetuneHistory"], None] | None = None,
             states_out: dict | None = None) -> FinetuneHistory:
    """Fine-tune with MCD for ``cfg.finetune_epochs`` epochs; select the model by ``cfg.selection``.

    Each iteration draws a labeled batch from ``(x_sup, y_sup)`` and an unlabeled batch from
    ``split.unlabeled()`` (its own endless stream of shuffled passes), then runs Step A
    (``cfg.schedule == "official"``) and Step B with ``strategy`` (:mod:`mcd_helpers.steps`).
    One SGD optimizer runs through all epochs (its momentum carries over). An epoch is one pass
    over the labeled set, capped at ``cfg.steps_per_epoch`` when > 0. After every epoch the
    discrepancy-score AUROC on ``split.val_id_x`` vs ``split.val_ood_x`` is recorded (it never
    changes the training). Model selection (``cfg.selection``) only decides which weights
    ``model`` holds at the end: ``"ood-labels"`` (official) the epoch with the best validation
    AUROC, ``"last-epoch"`` the last epoch (no OOD label chooses anything). The training is the
    same under both, so one run serves both selections (``states_out``).

    Args:
        model: a TwoHeadNet (with per-stream BatchNorm for ``"split-bn"``), trained in place.
        x_sup: ``(N, C, H, W)`` labeled images; y_sup: ``(N,)`` labels.
        split: has ``unlabeled()`` (a TensorDataset of ``(N_u, C, H, W)``), ``val_id_x``, ``val_ood_x``.
        checkpoint: where to keep checkpoints (none when ``None``); resume: continue from it;
        key: the settings' hash stored in the checkpoints;
        on_epoch: called as ``on_epoch(epoch, history)`` after each epoch (e.g. a live plot).
        states_out: when a dict is given, it receives ``"best"`` (the state dict of the epoch with
            the best validation AUROC) and ``"last"`` (the last epoch's), whatever ``cfg.selection``.

    Returns:
        the :class:`FinetuneHistory`: per-step ``ce``, ``dis``, ``gap`` (nats), per-epoch
        ``val_auroc`` (fractions), ``best_epoch`` (the epoch ``model`` holds: the best validation
        AUROC under ``"ood-labels"``, the last epoch under ``"last-epoch"``).

    Raises:
        NonFiniteLossError: when a loss becomes NaN or inf (names the step and the loss parts;
            the last good checkpoint is kept).
        TrainingInterrupted: after SIGTERM or SIGINT (only while ``checkpoint`` is given), once saved.
        ValueError: on an unknown strategy or selection; CheckpointMismatchError (a ValueError)
            on a checkpoint written with other settings.
    """
    check_strategy(strategy)
    selection = getattr(cfg, "selection", "ood-labels")
    if selection not in SELECTIONS:
        raise ConfigError("selection", f"selection must be one of {', '.join(SELECTIONS)}; got {selection!r}.")
    device, official = torch.device(cfg.device), cfg.schedule == "official"
    net = prepare_model(model, cfg).train()
    model = wrap_ddp(net, cfg.device, cfg.sync_bn)  # ``net`` itself in one process; train through ``model``
    writer = checkpoint if is_main_process() else None  # every rank may read; rank 0 writes
    opt = _sgd(net, cfg.finetune_lr, cfg.finetune_momentum, cfg.finetune_weight_decay)
    x_sup, y_sup = place(x_sup, cfg), place(y_sup, cfg)
    x_unsup = place(split.unlabeled().tensors[0], cfg)  # (N_unlabeled, C, H, W)
    sup = _batches(len(x_sup), cfg.batch_size_sup, cfg.seed, LABELED, x_sup.device)
    unsup = _batches(len(x_unsup), cfg.batch_size_unsup, cfg.seed, UNLABELED, x_unsup.device)
    steps = sup.per_pass if cfg.steps_per_epoch <= 0 else min(cfg.steps_per_epoch, sup.per_pass)
    names = ("ce", "dis", "gap") + (("step_a",) if official else ())
    hist, best, best_auroc, start_epoch, start_step, pending = FinetuneHistory(), None, -math.inf, 0, 0, []

    # ---- resume: model, optimizer, RNG states, position, history, best weights so far ----
    state = load_stage_state(checkpoint, resume, f"fine-tuning ({strategy})", key)
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        start_epoch, start_step = state["epoch"], state["step"]
        hist, best, best_auroc = FinetuneHistory(**state["history"]), state["best_model"], state["best_auroc"]

    def save(epoch: int, step: int) -> None:
        if writer is None:
            return
        writer.save({"stage": f"fine-tuning ({strategy})", "key": key, "config": cfg.to_dict(),
                         "model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                         "rng": rng_state(), "epoch": epoch, "step": step, "history": dataclasses.asdict(hist),
                         "best_auroc": best_auroc, "best_model": best})

    def log(rows: list[list[float]]) -> None:
        for name, column in zip(names, zip(*rows)):
            getattr(hist, name).extend(column)

    with stop_on_sigterm(checkpoint is not None) as stop:
        for epoch in range(start_epoch, cfg.finetune_epochs):
            stage = f"fine-tuning ({strategy}) {epoch + 1}/{cfg.finetune_epochs}"
            model.train()
            for step in tqdm(range(start_step, steps), desc=stage, disable=not progress, leave=False,
                             initial=start_step, total=steps):
                g = epoch * steps + step  # global step, also the index of the unlabeled batch
                idx = sup.batch(epoch, step)
                xs, ys = take(x_sup, idx, device, cfg.channels_last), take(y_sup, idx, device)
                xu = take(x_unsup, unsup.batch_at(g), device, cfg.channels_last)
                # ---- Step A: CE, F2 on detached features ----
                if official:
                    with autocast(cfg, device):
                        loss_a = step_a_loss(model, xs, ys)
                    opt.zero_grad(set_to_none=True)
                    loss_a.backward()
                    opt.step()
                # ---- Step B: CE on both heads + discrepancy loss, one backward ----
                with autocast(cfg, device):
                    loss, parts = step_b_loss(model, xs, ys, xu, strategy, cfg.margin)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                record = [parts["ce"], parts["dis"], parts["gap"]] + ([loss_a.detach()] if official else [])
                pending.append((epoch, step, torch.stack(record)))  # stays on the device: no sync
                # ---- every N steps, and at once on SIGTERM: losses read back and checked, checkpoint ----
                if stop.requested or _due(cfg, g + 1):
                    log(read_back(pending, names, f"fine-tuning ({strategy})", checkpoint))
                    if checkpoint is not None:
                        save(epoch, step + 1)
                    if stop.requested:
                        raise stop.interrupted(f"in {stage} step {step + 1}/{steps}; "
                                               f"saved in {checkpoint.folder}. Resume to continue.")
            start_step = 0
            log(read_back(pending, names, f"fine-tuning ({strategy})", checkpoint))
            # ---- validation AUROC (recorded; it chooses the weights under "ood-labels" only) ----
            average_buffers(net)  # every rank scores with the ranks' mean BatchNorm statistics
            scores = [discrepancy_score(*gather_scores(
                lambda t: predict_logits(net, t, cfg.eval_batch_size, device), v))
                for v in (split.val_id_x, split.val_ood_x)]  # the whole validation split, on every rank
            hist.val_auroc.append(ood_metrics(*scores)["auroc"])
            if hist.val_auroc[-1] > best_auroc:
                best_auroc = hist.val_auroc[-1]
                best = {k: v.detach().clone() for k, v in net.state_dict().items()}
            hist.best_epoch = (hist.val_auroc.index(best_auroc) if selection == "ood-labels" else epoch)
            if on_epoch is not None:
                on_epoch(epoch, hist)
            if checkpoint is not None:
                save(epoch + 1, 0)
                if stop.requested:
                    raise stop.interrupted(f"at the end of {stage}; saved in {checkpoint.folder}.")
    last = {k: v.detach().clone() for k, v in net.state_dict().items()}
    if states_out is not None:
        states_out.update(best=best if best is not None else last, last=last)
    if selection == "ood-labels" and best is not None:
        net.load_state_dict(best)
    return hist
