"""OOD-detection metrics over score arrays, in the paper's convention (ODIN's): ID is the positive
class.

Convention, in words: **higher score = more OOD**. A sample is accepted as ID when
``score <= t``. At a threshold t, TPR(t) = share of ID samples accepted and FPR(t) = share of OOD
samples accepted (fp / (fp + tn)). All metrics are fractions in [0, 1], not %; multiply by 100
to compare with the paper's tables.

* ``fpr95``: FPR at the smallest observed threshold where TPR >= 0.95.
* ``detection_error``: min over thresholds of 0.5 (1 - TPR) + 0.5 FPR.
* ``auroc``: P(OOD score > ID score) + 1/2 P(tie), the area under the ROC curve.
* ``aupr_in``: average precision with ID positive, ranked by -score.
* ``aupr_out``: average precision with OOD positive, ranked by score.

Exact over the observed scores (every unique score is a threshold, ties kept together), no
threshold grid. Built on ``sklearn.metrics.roc_curve(drop_intermediate=False)``,
``roc_auc_score`` and ``average_precision_score``. Note that OpenOOD v1.5 and pytorch-ood make
OOD the positive class and so report a different "FPR95".
"""

from typing import Sequence

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

__all__ = ["ood_metrics", "roc_points", "as_scores", "METRIC_KEYS"]

METRIC_KEYS = ("fpr95", "detection_error", "auroc", "aupr_in", "aupr_out")


def as_scores(scores, name: str = "scores") -> np.ndarray:
    """Convert a list, NumPy array or tensor of scores to a 1-D float64 array, validated.

    Raises:
        ValueError: if the set is empty, not 1-D, or holds NaN or inf.
    """
    if hasattr(scores, "detach"):  # torch.Tensor, without importing torch here
        scores = scores.detach().cpu().double().numpy()
    arr = np.asarray(scores, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D sequence of per-sample scores, got shape {arr.shape}: "
            "flatten it."
        )
    if arr.size == 0:
        raise ValueError(
            f"{name} is empty: OOD metrics need at least one ID and one OOD score; check the data."
        )
    if (bad := ~np.isfinite(arr)).any():
        raise ValueError(
            f"{name} holds {int(bad.sum())} non-finite value(s) (NaN or inf), first at "
            f"index {int(np.argmax(bad))}: a diverged model or a division by zero upstream."
        )
    return arr


def _labelled(id_scores, ood_scores) -> tuple[np.ndarray, np.ndarray]:
    s_id, s_ood = as_scores(id_scores, "id_scores"), as_scores(ood_scores, "ood_scores")
    is_id = np.concatenate([np.ones(s_id.size, dtype=int), np.zeros(s_ood.size, dtype=int)])
    return np.concatenate([s_id, s_ood]), is_id


def roc_points(
    id_scores: Sequence[float], ood_scores: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """ROC curve in the ID-positive convention, one point per unique observed threshold.

    Returns:
        ``(fpr, tpr)``: 1-D arrays of equal length, starting at (0, 0) (nothing accepted) and
        ending at (1, 1), ordered by increasing threshold t (accept as ID when score <= t).

    Raises:
        ValueError: as :func:`as_scores`.
    """
    scores, is_id = _labelled(id_scores, ood_scores)
    # ID positive, ranked by -score: "predict ID when -score >= -t" == "score <= t".
    return roc_curve(is_id, -scores, drop_intermediate=False)[:2]


def ood_metrics(id_scores, ood_scores, tpr_level: float = 0.95) -> dict[str, float]:
    """FPR95, detection error, AUROC, AUPR-In and AUPR-Out of a score (higher = more OOD).

    Args:
        id_scores: scores of ID test samples, shape ``(N_id,)``; list, NumPy array or tensor.
        ood_scores: scores of OOD test samples, shape ``(N_ood,)``.
        tpr_level: the TPR for ``fpr95`` as a fraction (0.95, not 95).

    Returns:
        dict with keys ``fpr95``, ``detection_error``, ``auroc``, ``aupr_in``, ``aupr_out``;
        fractions in [0, 1] (definitions in the module docstring).

    Raises:
        ValueError: on an empty set, NaN or inf, a non-1-D input, or ``tpr_level`` outside (0, 1].
    """
    if not 0.0 < tpr_level <= 1.0:
        hint = f" Did you mean {tpr_level / 100}?" if 1 < tpr_level <= 100 else ""
        raise ValueError(f"tpr_level is a fraction in (0, 1], got {tpr_level}.{hint}")
    scores, is_id = _labelled(id_scores, ood_scores)
    n_id = int(is_id.sum())
    fpr, tpr, _ = roc_curve(is_id, -scores, drop_intermediate=False)
    # Smallest threshold with TPR >= level; compare counts of accepted ID samples, not rounded
    # fractions.
    first = int(np.argmax(np.rint(tpr * n_id) >= tpr_level * n_id - 1e-9))
    return {
        "fpr95": float(fpr[first]),
        "detection_error": float(np.min(0.5 * (1.0 - tpr) + 0.5 * fpr)),
        "auroc": float(roc_auc_score(1 - is_id, scores)),  # OOD vs ID ranking, ties count 1/2
        "aupr_in": float(average_precision_score(is_id, -scores)),
        "aupr_out": float(average_precision_score(1 - is_id, scores)),
    }
