"""Figures of OOD scores: histograms of ID vs OOD and ROC curves (matplotlib, labelled axes)."""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from ..metrics import as_scores, ood_metrics, roc_points

__all__ = ["plot_score_histograms", "plot_roc_curves"]


def plot_score_histograms(panels: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                          title: str = "", bins: int = 50):
    """One histogram panel per method: ID vs OOD scores (higher = more OOD).

    Args:
        panels: ``{label: (id_scores, ood_scores)}``; the label names the method and its score.
        title: figure title.

    Returns:
        the matplotlib ``Figure``.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (label, (s_id, s_ood)) in zip(axes[0], panels.items()):
        s_id, s_ood = as_scores(s_id, "id_scores"), as_scores(s_ood, "ood_scores")
        edges = np.histogram_bin_edges(np.concatenate([s_id, s_ood]), bins=bins)
        ax.hist(s_id, bins=edges, alpha=0.6, density=True, label=f"ID (n={s_id.size})")
        ax.hist(s_ood, bins=edges, alpha=0.6, density=True, label=f"OOD (n={s_ood.size})")
        auroc = ood_metrics(s_id, s_ood)["auroc"]
        ax.set(title=f"{label}\nAUROC {100 * auroc:.2f}%", xlabel="OOD score (higher = more OOD)",
               ylabel="density")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_roc_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str = ""):
    """ROC curves in the ID-positive convention: TPR (ID accepted) against FPR (OOD accepted).

    Args:
        curves: ``{label: (id_scores, ood_scores)}``.

    Returns:
        the matplotlib ``Figure``.
    """
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    for label, (s_id, s_ood) in curves.items():
        fpr, tpr = roc_points(s_id, s_ood)
        auroc = ood_metrics(s_id, s_ood)["auroc"]
        ax.plot(100 * fpr, 100 * tpr, label=f"{label} (AUROC {100 * auroc:.2f}%)")
    ax.axhline(95, color="grey", lw=0.8, ls=":", label="TPR 95%")
    ax.plot([0, 100], [0, 100], color="grey", lw=0.8, ls="--")
    ax.set(xlabel="FPR: OOD accepted as ID (%)", ylabel="TPR: ID accepted (%)", title=title,
           xlim=(0, 100), ylim=(0, 101))
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
