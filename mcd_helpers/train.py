"""MCD training: pre-training, and fine-tuning with Step A / Step B, in plain PyTorch loops.

Official fine-tuning (github.com/YU1ut/UOOD-MCD ``solver.py``), each iteration:

* **Step A**: CE on a labeled batch; F2 sees G's features detached, so only CE(F1) reaches G.
* **Step B**: CE(F1) + CE(F2) on the labeled batch + the discrepancy loss on an unlabeled batch;
  one backward, one optimizer step.

Step B needs the labeled and the unlabeled batch in the same step. ``strategy`` says how they go
through the model:

* ``"separate"``: two forwards, ``model(x_sup)`` and ``model(x_unsup)`` (the official code).
* ``"concat"``: one forward of ``torch.cat([x_sup, x_unsup])``, outputs split by rows.

Both give the same loss and gradients when every layer treats each sample on its own; with
train-mode BatchNorm they do not (batch statistics couple the samples; see notebook 02).
"""
from __future__ import annotations

import copy
import itertools
import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from .data import infinite_loader
from .losses import discrepancy_loss, discrepancy_score, entropy, supervised_loss
from .metrics import ood_metrics

__all__ = ["set_seed", "step_b_loss", "step_a", "pretrain", "finetune", "predict_logits",
           "FinetuneHistory", "NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the message names the step and the loss parts."""


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's generators (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _check_finite(loss: torch.Tensor, parts: dict, where: str) -> None:
    if not torch.isfinite(loss):
        detail = ", ".join(f"{k}={float(v):.4g}" for k, v in parts.items())
        raise NonFiniteLossError(f"non-finite loss at {where}: loss={float(loss)} ({detail}). "
                                 "Lower the learning rate or check the inputs for NaN.")


def step_b_loss(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                strategy: str = "separate", margin: float = 1.2) -> tuple[torch.Tensor, dict]:
    """The Step B loss: CE(F1) + CE(F2) on ``x_sup`` + discrepancy loss on ``x_unsup`` (nats).

    Args:
        model: any module whose ``forward`` returns ``(logits1, logits2)``.
        x_sup: labeled batch ``(N_sup, C, H, W)``; y_sup: its labels ``(N_sup,)`` in ``[0, K)``.
        x_unsup: unlabeled batch ``(N_unsup, C, H, W)``.
        strategy: ``"separate"`` (two forwards) or ``"concat"`` (one forward, outputs split).
        margin: the discrepancy loss's margin m, in nats.

    Returns:
        ``(loss, parts)``: the scalar loss, and detached parts ``ce`` (CE1 + CE2), ``dis``
        (discrepancy loss) and ``gap`` (mean H(p1) - H(p2) on ``x_unsup``, nats).

    Raises:
        ValueError: on an unknown strategy, or (from the losses) bad shapes or labels.
    """
    if strategy == "separate":
        logits1_sup, logits2_sup = model(x_sup)  # (N_sup, K) each
        logits1_unsup, logits2_unsup = model(x_unsup)  # (N_unsup, K) each
    elif strategy == "concat":
        n_sup = x_sup.shape[0]
        logits1, logits2 = model(torch.cat([x_sup, x_unsup]))  # (N_sup + N_unsup, K) each
        logits1_sup, logits1_unsup = logits1[:n_sup], logits1[n_sup:]
        logits2_sup, logits2_unsup = logits2[:n_sup], logits2[n_sup:]
    else:
        raise ValueError(f"strategy must be 'separate' or 'concat', got {strategy!r}.")
    ce = supervised_loss(logits1_sup, logits2_sup, y_sup)
    dis = discrepancy_loss(logits1_unsup, logits2_unsup, margin)
    with torch.no_grad():
        gap = (entropy(logits1_unsup) - entropy(logits2_unsup)).mean()
    return ce + dis, {"ce": ce.detach(), "dis": dis.detach(), "gap": gap}


def step_a(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor,
           optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Official Step A: CE(F1(G(x))) + CE(F2(G(x).detach())), one backward and step. Returns the loss."""
    feat = model.features(x_sup)  # (N, D)
    loss = supervised_loss(model.F1(feat), model.F2(feat.detach()), y_sup)
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


def _loader(tensors: tuple, batch_size: int, seed: int, drop_last: bool = True) -> DataLoader:
    # An explicit generator makes the shuffling order a function of the seed alone.
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# Pre-training
# ----------------------------------------------------------------------------------------------

def pretrain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg, progress: bool = True) -> list[float]:
    """Pre-train both heads with CE(F1) + CE(F2) on labeled ID data, SGD with step decay.

    Args:
        model: a :class:`~mcd_helpers.models.TwoHeadNet` (trained in place).
        x: ``(N, C, H, W)`` images; y: ``(N,)`` labels.
        cfg: an :class:`~mcd_helpers.config.MCDConfig` (``pretrain_*`` fields, ``seed``, ``device``).

    Returns:
        the mean training loss of each epoch (nats).
    """
    device = torch.device(cfg.device)
    model.to(device).train()
    opt = _sgd(model, cfg.pretrain_lr, cfg.pretrain_momentum, cfg.pretrain_weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(cfg.pretrain_milestones), gamma=0.1)
    loader = _loader((x, y), cfg.pretrain_batch_size, cfg.seed)
    history = []
    for epoch in range(cfg.pretrain_epochs):
        total, bar = 0.0, tqdm(loader, desc=f"pre-training {epoch + 1}/{cfg.pretrain_epochs}",
                               disable=not progress, leave=False)
        for step, (xb, yb) in enumerate(bar):
            logits1, logits2 = model(xb.to(device))
            loss = supervised_loss(logits1, logits2, yb.to(device))
            _check_finite(loss, {"ce": loss}, f"pre-training epoch {epoch + 1} step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
        sched.step()
        history.append(total / len(loader))
    return history


# ----------------------------------------------------------------------------------------------
# Fine-tuning
# ----------------------------------------------------------------------------------------------

@dataclass
class FinetuneHistory:
    """Per-step losses (nats) and per-epoch validation AUROC of one fine-tuning run."""
    ce: list[float] = field(default_factory=list)
    dis: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)  # mean H(p1) - H(p2) on the unlabeled batch
    val_auroc: list[float] = field(default_factory=list)
    best_epoch: int = -1


def finetune(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, split, cfg, strategy: str,
             progress: bool = True) -> FinetuneHistory:
    """Fine-tune with MCD; keep the weights with the best validation AUROC (loaded into ``model``).

    Each iteration draws a labeled batch from ``(x_sup, y_sup)`` and an unlabeled batch from
    ``split.unlabeled()`` (via :func:`~mcd_helpers.data.infinite_loader`), then runs Step A
    (``cfg.schedule == "official"``) and Step B with ``strategy``. An epoch is one pass over the
    labeled set, capped at ``cfg.steps_per_epoch`` when > 0. After each epoch the discrepancy
    score's AUROC on ``split.val_id_x`` vs ``split.val_ood_x`` selects the model.

    Raises:
        NonFiniteLossError: when a loss becomes NaN or inf (names the step and the loss parts).
    """
    device = torch.device(cfg.device)
    model.to(device).train()
    opt = _sgd(model, cfg.finetune_lr, cfg.finetune_momentum, cfg.finetune_weight_decay)
    sup = _loader((x_sup, y_sup), cfg.batch_size_sup, cfg.seed + 1)
    unsup = infinite_loader(_loader(split.unlabeled().tensors, cfg.batch_size_unsup, cfg.seed + 2))
    steps = len(sup) if cfg.steps_per_epoch <= 0 else min(cfg.steps_per_epoch, len(sup))
    hist, best, best_auroc = FinetuneHistory(), None, -math.inf
    for epoch in range(cfg.finetune_epochs):
        model.train()
        bar = tqdm(itertools.islice(sup, steps), total=steps, disable=not progress, leave=False,
                   desc=f"fine-tuning ({strategy}) {epoch + 1}/{cfg.finetune_epochs}")
        for step, (xs, ys) in enumerate(bar):
            xs, ys = xs.to(device), ys.to(device)
            (xu,) = next(unsup)
            if cfg.schedule == "official":
                step_a(model, xs, ys, opt)
            loss, parts = step_b_loss(model, xs, ys, xu.to(device), strategy, cfg.margin)
            _check_finite(loss, parts, f"fine-tuning epoch {epoch + 1} step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            for k in ("ce", "dis", "gap"):
                getattr(hist, k).append(float(parts[k]))
        # ---- model selection on the validation split ----
        val = ood_metrics(discrepancy_score(*predict_logits(model, split.val_id_x, cfg.eval_batch_size, device)),
                          discrepancy_score(*predict_logits(model, split.val_ood_x, cfg.eval_batch_size, device)))
        hist.val_auroc.append(val["auroc"])
        if val["auroc"] > best_auroc:
            best_auroc, hist.best_epoch = val["auroc"], epoch
            best = copy.deepcopy(model.state_dict())
    model.load_state_dict(best)
    return hist
