"""MCD losses and OOD scores: pure functions of logits.

Paper: Q. Yu, K. Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum Classifier
Discrepancy", ICCV 2019 (arXiv 1908.04951), Sec. 3.2-3.3; official code github.com/YU1ut/UOOD-MCD,
``solver.py`` (``discrepancy``) and its test script (L1 distance of the two softmax outputs).

Baseline scores for comparison (all "higher = more OOD"):
MSP (Hendrycks & Gimpel 2017, arXiv 1610.02136), energy (Liu et al. 2020, arXiv 2010.03759).

Glossary: ``logits1, logits2`` are F1's and F2's outputs, shape ``(N, K)``; entropies are in nats.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["entropy", "supervised_loss", "discrepancy_loss", "discrepancy_score",
           "msp_score", "energy_score", "check_logits", "check_targets"]


def check_logits(logits1: torch.Tensor, logits2: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless the logits are ``(N, K)`` (and both heads agree in shape)."""
    for name, t in (("logits1", logits1), ("logits2", logits2)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (N, K), got {type(t).__name__}.")
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape (N, K) (batch, classes), got {tuple(t.shape)}.")
    if logits2 is not None and logits1.shape != logits2.shape:
        raise ValueError(f"logits1 and logits2 must have the same shape (N, K), "
                         f"got {tuple(logits1.shape)} and {tuple(logits2.shape)}.")


def check_targets(targets: torch.Tensor, num_classes: int, batch: int) -> None:
    """Raise ``ValueError`` unless ``targets`` is ``(N,)`` of integer labels in ``[0, num_classes)``."""
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of class indices, shape (N,); "
                         f"got {getattr(targets, 'dtype', type(targets).__name__)}.")
    if targets.shape != (batch,):
        raise ValueError(f"targets must have shape ({batch},) to match the logits, got {tuple(targets.shape)}.")
    if batch and (targets.min() < 0 or targets.max() >= num_classes):
        bad = targets[(targets < 0) | (targets >= num_classes)]
        raise ValueError(f"labels must lie in [0, {num_classes}) for a {num_classes}-class model; "
                         f"got {bad[:5].tolist()} (OOD samples carry no label: keep them out of "
                         "the supervised loss).")


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax, per sample over classes: H(p) = -sum_k p_k log p_k, in nats.

    Computed from ``log_softmax`` so that it is finite for any finite logits.

    Shapes:
        logits: ``(N, K)`` -> ``(N,)``, each value in [0, log K].
    """
    check_logits(logits)
    log_p = F.log_softmax(logits, dim=1)  # (N, K)
    return -(log_p.exp() * log_p).sum(dim=1)  # sum over classes, not over the batch


def supervised_loss(logits1: torch.Tensor, logits2: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CE(F1) + CE(F2) on labeled ID data, each cross-entropy averaged over the batch (nats).

    Shapes:
        logits1, logits2: ``(N, K)``; targets: ``(N,)`` integer labels in ``[0, K)`` -> scalar.

    Raises:
        ValueError: on mismatched shapes, an empty batch or labels outside ``[0, K)``.
    """
    check_logits(logits1, logits2)
    if logits1.shape[0] == 0:
        raise ValueError("supervised_loss needs at least one labeled sample; got an empty batch "
                         "(the mean over zero samples is NaN).")
    check_targets(targets, logits1.shape[1], logits1.shape[0])
    targets = targets.long()  # any integer dtype (int32, uint8, ...); cross_entropy wants int64
    return F.cross_entropy(logits1, targets) + F.cross_entropy(logits2, targets)


def discrepancy_loss(logits1: torch.Tensor, logits2: torch.Tensor, margin: float = 1.2) -> torch.Tensor:
    """Discrepancy loss on unlabeled data: max(m - mean_batch[H(p1) - H(p2)], 0), in nats.

    Eq. (3) of the paper with the official code's hinge (``solver.py``, ``discrepancy``): the mean
    over the batch is taken first, then the hinge. Minimising it pushes F1 to high and F2 to low
    entropy on unlabeled samples until the mean entropy gap reaches the margin; beyond that the
    loss is 0 with zero gradient.

    Shapes:
        logits1, logits2: ``(N, K)`` with N >= 1 -> scalar.

    Raises:
        ValueError: on mismatched shapes, an empty batch or a negative, NaN or infinite margin, or one
            beyond the logits' dtype (1e39 in float32).
    """
    check_logits(logits1, logits2)
    if logits1.shape[0] == 0:
        raise ValueError("discrepancy_loss needs at least one unlabeled sample, got an empty batch.")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"margin must be a finite number >= 0 nats (official: 1.2), got {margin}.")
    top = torch.finfo(logits1.dtype).max if logits1.dtype.is_floating_point else math.inf
    if margin > top:
        raise ValueError(f"margin={margin:g} nats is larger than the largest {logits1.dtype} number ({top:.4g}): "
                         "the loss would be inf. Use a margin of a few nats (official: 1.2).")
    gap = (entropy(logits1) - entropy(logits2)).mean()
    return torch.clamp(margin - gap, min=0)


def discrepancy_score(logits1: torch.Tensor, logits2: torch.Tensor) -> torch.Tensor:
    """MCD's OOD score: L1 distance of the two heads' softmax outputs, sum_k |p1_k - p2_k|.

    Higher = more OOD. In [0, 2]: 0 when the heads agree; confident heads that disagree give
    close to 2 (2 - 2/K when one head is uniform and the other one-hot).

    Shapes:
        logits1, logits2: ``(N, K)`` -> ``(N,)``.
    """
    check_logits(logits1, logits2)
    return (F.softmax(logits1, dim=1) - F.softmax(logits2, dim=1)).abs().sum(dim=1)


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature T must be a finite number > 0 (1 = plain softmax; ODIN uses 1000), "
                         f"got {temperature}.")


def msp_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Maximum-softmax-probability baseline as an OOD score: 1 - max_k softmax(logits / T)_k.

    Higher = more OOD; in [0, 1 - 1/K]. T > 1 is ODIN's temperature scaling (arXiv 1706.02690).

    Shapes:
        logits: ``(N, K)`` -> ``(N,)``.

    Raises:
        ValueError: on bad logits or a temperature that is not a finite number > 0.
    """
    check_logits(logits)
    _check_temperature(temperature)
    return 1.0 - F.softmax(logits / temperature, dim=1).max(dim=1).values


def energy_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Free energy E(x) = -T logsumexp_k(logits_k / T) (Liu et al. 2020, Eq. 5).

    Higher = more OOD (ID samples have lower energy).

    Shapes:
        logits: ``(N, K)`` -> ``(N,)``.

    Raises:
        ValueError: on bad logits or a temperature that is not a finite number > 0.
    """
    check_logits(logits)
    _check_temperature(temperature)
    return -temperature * torch.logsumexp(logits / temperature, dim=1)
