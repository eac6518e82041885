"""MCD's losses and OOD scores: pure functions of logits ``(N, K)`` (F1's and F2's:
``logits1, logits2``), in nats.

Paper: Q. Yu, K. Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum Classifier
Discrepancy", ICCV 2019 (arXiv 1908.04951), Sec. 3.2-3.3; official code github.com/YU1ut/UOOD-MCD,
``solver.py`` (``discrepancy``) and its test script (the L1 distance of the two softmax outputs).
Baselines, all "higher = more OOD": MSP (Hendrycks & Gimpel 2017, arXiv 1610.02136), energy (Liu et
al. 2020, arXiv 2010.03759).
"""

import math

import torch
import torch.nn.functional as F


def check_logits(*logits: torch.Tensor) -> None:
    """Raise ``ValueError`` (``TypeError`` for a non-tensor) unless every argument is ``(N, K)``,
    all one shape."""
    for i, t in enumerate(logits, start=1):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"logits{i} must be a torch.Tensor of shape (N, K), got {type(t).__name__}."
            )
        if t.dim() != 2 or t.shape != logits[0].shape:
            raise ValueError(
                f"logits must have shape (N, K) (batch, classes), the two heads alike; got "
                f"{[tuple(t.shape) for t in logits]}."
            )


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum_k p_k log p_k of the softmax, per sample over classes (not over the batch), in
    nats.

    Shapes: ``(N, K)`` -> ``(N,)``, each in [0, log K]; finite for any finite logits
    (``log_softmax``).
    """
    check_logits(logits)
    log_p = F.log_softmax(logits, dim=1)  # (N, K)
    return -(log_p.exp() * log_p).sum(dim=1)


def supervised_loss(
    logits1: torch.Tensor, logits2: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """CE(F1) + CE(F2) on labeled ID data, each cross-entropy the batch mean, in nats.

    Shapes: ``(N, K)``, ``(N, K)``, targets ``(N,)`` integer labels in ``[0, K)`` (any integer
    dtype) -> scalar.

    Raises:
        ValueError: mismatched shapes, an empty batch, labels that are not integers or lie outside
        ``[0, K)``.
    """
    check_logits(logits1, logits2)
    n, k = logits1.shape
    if n == 0:
        raise ValueError(
            "supervised_loss needs at least one labeled sample; got an empty batch (its "
            "mean is NaN)."
        )
    if (
        not isinstance(targets, torch.Tensor)
        or targets.dtype.is_floating_point
        or targets.dtype == torch.bool
    ):
        raise ValueError(
            "targets must be a tensor of integer class labels, got "
            f"{getattr(targets, 'dtype', targets)}."
        )
    if targets.shape != (n,):
        raise ValueError(
            f"targets must have shape ({n},) to match the logits, got {tuple(targets.shape)}."
        )
    if len(bad := targets[(targets < 0) | (targets >= k)]):
        raise ValueError(
            f"labels must lie in [0, {k}) ({k} classes), got {bad[:5].tolist()}: keep OOD "
            "samples out."
        )
    # int64 class indices
    return F.cross_entropy(logits1, targets.long()) + F.cross_entropy(logits2, targets.long())


def discrepancy_loss(
    logits1: torch.Tensor, logits2: torch.Tensor, margin: float = 1.2
) -> torch.Tensor:
    """The discrepancy loss on unlabeled data: ``max(m - mean_batch[H(p1) - H(p2)], 0)``, in nats.

    The paper's discrepancy loss (Sec. 3; its equation number not checked offline) with the official
    code's hinge (``solver.py``, ``discrepancy``): the mean
    over the batch first, then the hinge. Minimising it pushes F1 to high and F2 to low entropy
    until the mean gap reaches the margin; beyond that the loss is 0 with zero gradient.

    Shapes: ``(N, K)``, ``(N, K)`` with N >= 1 -> scalar.

    Raises:
        ValueError: mismatched shapes, an empty batch, a margin that is negative, not finite or
            beyond the logits' dtype (1e39 in float32).
    """
    check_logits(logits1, logits2)
    if len(logits1) == 0:
        raise ValueError(
            "discrepancy_loss needs at least one unlabeled sample, got an empty batch."
        )
    top = torch.finfo(logits1.dtype).max if logits1.dtype.is_floating_point else math.inf
    if not (math.isfinite(margin) and 0 <= margin <= top):
        raise ValueError(
            f"margin must be a finite number >= 0 nats within {logits1.dtype} ({top:.4g}), "
            f"got {margin}; the official margin is 1.2."
        )
    return torch.clamp(margin - (entropy(logits1) - entropy(logits2)).mean(), min=0)


def step_b_objective(
    outputs, y_sup: torch.Tensor, margin: float = 1.2
) -> tuple[torch.Tensor, dict]:
    """Step B's loss from the two batches' outputs
    ``[(logits1_sup, logits2_sup), (logits1_unsup, logits2_unsup)]``: CE(F1) + CE(F2) on the labeled
    batch + the discrepancy loss on the unlabeled one (nats; official ``solver.py``).

    Returns:
        ``(loss, parts)``: the scalar and detached ``ce``, ``dis`` and ``gap`` (mean H(p1) - H(p2),
        unlabeled batch).

    Raises:
        TypeError: ``outputs`` is not two pairs of logits; the losses' errors otherwise.
    """
    if not (
        isinstance(outputs, (tuple, list))
        and len(outputs) == 2
        and all(isinstance(o, (tuple, list)) and len(o) == 2 for o in outputs)
    ):
        raise TypeError(
            "Step B needs the model to return (logits1, logits2), the outputs of F1 and "
            "F2, for each of "
            f"the two batches; got {outputs!r:.80}. Use a two-head model (TwoHeadNet)."
        )
    (logits1_sup, logits2_sup), (logits1_unsup, logits2_unsup) = outputs
    ce, dis = (
        supervised_loss(logits1_sup, logits2_sup, y_sup),
        discrepancy_loss(logits1_unsup, logits2_unsup, margin),
    )
    with torch.no_grad():
        gap = (entropy(logits1_unsup) - entropy(logits2_unsup)).mean()
    return ce + dis, {"ce": ce.detach(), "dis": dis.detach(), "gap": gap}


def discrepancy_score(logits1: torch.Tensor, logits2: torch.Tensor) -> torch.Tensor:
    """MCD's OOD score, the L1 distance of the two softmax outputs ``sum_k |p1_k - p2_k|``: higher =
    more OOD.

    In [0, 2]: 0 when the heads agree, 2 - 2/K when one is uniform and the other one-hot.
    Shapes: ``(N, K)``, ``(N, K)`` -> ``(N,)``.
    """
    check_logits(logits1, logits2)
    return (F.softmax(logits1, dim=1) - F.softmax(logits2, dim=1)).abs().sum(dim=1)


def _temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    check_logits(logits)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            "temperature T must be a finite number > 0 (1 = softmax; ODIN uses 1000), got "
            f"{temperature}."
        )
    return logits / temperature


def msp_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The maximum-softmax-probability baseline as an OOD score,
    ``1 - max_k softmax(logits / T)_k``, in [0, 1 - 1/K]; T > 1 is ODIN's temperature scaling.
    Shapes: ``(N, K)`` -> ``(N,)``. ``ValueError``: T <= 0."""
    return 1.0 - F.softmax(_temperature(logits, temperature), dim=1).max(dim=1).values


def energy_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Free energy ``E(x) = -T logsumexp_k(logits_k / T)`` (Liu et al. 2020, Eq. 5); ID samples have
    lower energy. Shapes: ``(N, K)`` -> ``(N,)``. ``ValueError``: T <= 0."""
    return -temperature * torch.logsumexp(_temperature(logits, temperature), dim=1)
