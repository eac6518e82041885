"""The losses of one MCD iteration: Step A and Step B, and how Step B feeds its two batches.

Official fine-tuning (github.com/YU1ut/UOOD-MCD ``solver.py``), each iteration:

* **Step A**: CE on a labeled batch; F2 sees G's features detached, so only CE(F1) reaches G.
* **Step B**: CE(F1) + CE(F2) on the labeled batch + the discrepancy loss on an unlabeled batch;
  one backward, one optimizer step.

Step B needs the labeled and the unlabeled batch in the same step. ``strategy`` (:data:`STRATEGIES`)
says how they go through the model:

* ``"separate"``: two forwards, ``model(x_sup)`` and ``model(x_unsup)`` (the official code).
* ``"concat"``: one forward of ``torch.cat([x_sup, x_unsup])``, outputs split by rows.
* ``"split-bn"``: two forwards, as ``separate``, through a model whose BatchNorm layers keep one set
  of running statistics per stream (:func:`mcd_helpers.norms.per_source_batchnorm`; labeled = source
  0, unlabeled = source 1); evaluation uses source 0, the ID statistics.
* ``"recalibrate"``: ``separate`` in every step; after fine-tuning the running statistics are
  recomputed on the labeled ID training data (:func:`mcd_helpers.norms.recalibrate_bn`, done by the
  pipeline, not here).

Both plain strategies give the same loss and gradients when every layer treats each sample on its
own; with train-mode BatchNorm they do not (batch statistics couple the samples; notebook 02).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .losses import discrepancy_loss, entropy, supervised_loss
from .norms import PerSourceBatchNorm, use_source

__all__ = ["STRATEGIES", "check_strategy", "step_a_loss", "step_b_loss"]

STRATEGIES = ("separate", "concat", "split-bn", "recalibrate")


def check_strategy(strategy: str) -> str:
    """Return ``strategy`` if it is one of :data:`STRATEGIES`, else raise ``ValueError`` naming them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}.")
    return strategy


def _source(model: nn.Module, source: int):
    """``use_source(model, source)`` when the model has per-stream BatchNorm, else nothing."""
    if any(isinstance(m, PerSourceBatchNorm) for m in model.modules()):
        return use_source(model, source)
    return contextlib.nullcontext()


def step_b_loss(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor, x_unsup: torch.Tensor,
                strategy: str = "separate", margin: float = 1.2) -> tuple[torch.Tensor, dict]:
    """The Step B loss: CE(F1) + CE(F2) on ``x_sup`` + discrepancy loss on ``x_unsup`` (nats).

    Args:
        model: any module whose ``forward`` returns ``(logits1, logits2)``.
        x_sup: labeled batch ``(N_sup, C, H, W)``; y_sup: its labels ``(N_sup,)`` in ``[0, K)``.
        x_unsup: unlabeled batch ``(N_unsup, C, H, W)``.
        strategy: one of :data:`STRATEGIES` (see the module docstring).
        margin: the discrepancy loss's margin m, in nats (paper Eq. 3; official default 1.2).

    Returns:
        ``(loss, parts)``: the scalar loss, and detached parts ``ce`` (CE1 + CE2), ``dis``
        (discrepancy loss) and ``gap`` (mean H(p1) - H(p2) on ``x_unsup``, nats).

    Raises:
        ValueError: on an unknown strategy, ``"split-bn"`` on a model without per-stream
            BatchNorm, or (from the losses) bad shapes or labels.
    """
    check_strategy(strategy)
    if strategy == "concat":
        n_sup = x_sup.shape[0]
        logits1, logits2 = model(torch.cat([x_sup, x_unsup]))  # (N_sup + N_unsup, K) each
        logits1_sup, logits1_unsup = logits1[:n_sup], logits1[n_sup:]
        logits2_sup, logits2_unsup = logits2[:n_sup], logits2[n_sup:]
    else:
        if strategy == "split-bn" and not any(isinstance(m, PerSourceBatchNorm) for m in model.modules()):
            raise ValueError("strategy 'split-bn' needs a model with per-stream BatchNorm: convert it with "
                             "mcd_helpers.norms.per_source_batchnorm(model) (the pipeline does).")
        with _source(model, 0):
            logits1_sup, logits2_sup = model(x_sup)  # (N_sup, K) each
        with _source(model, 1):
            logits1_unsup, logits2_unsup = model(x_unsup)  # (N_unsup, K) each
    ce = supervised_loss(logits1_sup, logits2_sup, y_sup)
    dis = discrepancy_loss(logits1_unsup, logits2_unsup, margin)
    with torch.no_grad():
        gap = (entropy(logits1_unsup) - entropy(logits2_unsup)).mean()
    return ce + dis, {"ce": ce.detach(), "dis": dis.detach(), "gap": gap}


def step_a_loss(model: nn.Module, x_sup: torch.Tensor, y_sup: torch.Tensor) -> torch.Tensor:
    """Official Step A loss: CE(F1(G(x))) + CE(F2(G(x).detach())), nats; only CE(F1) reaches G.

    The forward is ``model(x_sup, detach_f2=True)`` (:meth:`~mcd_helpers.models.TwoHeadNet.forward`),
    so a DistributedDataParallel wrapper sees it and all-reduces its gradients.

    Shapes:
        x_sup: ``(N, C, H, W)``; y_sup: ``(N,)`` -> scalar.
    """
    with _source(model, 0):
        return supervised_loss(*model(x_sup, detach_f2=True), y_sup)
