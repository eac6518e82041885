"""Figures (matplotlib, labelled axes and units): OOD scores, ROC curves, training histories.

Each function returns the ``Figure``; the caller shows or saves it and closes it.
"""

from typing import Mapping

import matplotlib.pyplot as plt
import numpy as np
import torch

from .metrics import as_scores, ood_metrics, roc_points


def finish_figure(fig, title: str | None = None, rect=None, **suptitle_kwargs):
    """``fig`` with its ``suptitle`` (none when ``title`` is None) and a tight layout (within
    ``rect``, figure fractions, when given)."""
    if title is not None:
        fig.suptitle(title, **suptitle_kwargs)
    fig.tight_layout(rect=rect)
    return fig


def plot_score_histograms(panels: Mapping[str, tuple], title: str = "", bins: int = 50):
    """One panel per ``{label: (id_scores, ood_scores)}``: ID vs OOD score densities (higher = more
    OOD)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (label, (s_id, s_ood)) in zip(axes[0], panels.items()):
        s_id, s_ood = as_scores(s_id, "id_scores"), as_scores(s_ood, "ood_scores")
        edges = np.histogram_bin_edges(np.concatenate([s_id, s_ood]), bins=bins)
        ax.hist(s_id, bins=edges, alpha=0.6, density=True, label=f"ID (n={s_id.size})")
        ax.hist(s_ood, bins=edges, alpha=0.6, density=True, label=f"OOD (n={s_ood.size})")
        ax.set(
            title=f"{label}\nAUROC {100 * ood_metrics(s_id, s_ood)['auroc']:.2f}%",
            xlabel="OOD score (higher = more OOD)",
            ylabel="density",
        )
        ax.legend(fontsize=8)
    return finish_figure(fig, title)


def plot_roc_curves(curves: Mapping[str, tuple], title: str = ""):
    """ROC curves of ``{label: (id_scores, ood_scores)}``, ID positive: TPR (ID accepted) against
    FPR (OOD accepted)."""
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    for label, (s_id, s_ood) in curves.items():
        fpr, tpr = roc_points(s_id, s_ood)
        ax.plot(
            100 * fpr,
            100 * tpr,
            label=f"{label} (AUROC {100 * ood_metrics(s_id, s_ood)['auroc']:.2f}%)",
        )
    ax.axhline(95, color="grey", lw=0.8, ls=":", label="TPR 95%")
    ax.plot([0, 100], [0, 100], color="grey", lw=0.8, ls="--")
    ax.set(
        xlabel="FPR: OOD accepted as ID (%)",
        ylabel="TPR: ID accepted (%)",
        title=title,
        xlim=(0, 100),
        ylim=(0, 101),
    )
    ax.legend(fontsize=8, loc="lower right")
    return finish_figure(fig)


def plot_history(hist, margin: float | None = None, title: str = ""):
    """A fine-tuning :class:`~mcd_helpers.train.History`: Step B losses and the entropy gap per step
    (nats), validation AUROC per epoch (%) with the epoch kept (``best_epoch``) starred; ``margin``
    drawn on the gap."""
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13.5, 3.6))
    steps = np.arange(1, len(hist.ce) + 1)
    ax1.plot(steps, hist.ce, label="CE(F1) + CE(F2), labeled batch")
    ax1.plot(steps, hist.dis, label="discrepancy loss, unlabeled batch")
    ax1.set(title="Step B losses", xlabel="fine-tuning step", ylabel="loss (nats)")
    ax2.plot(steps, hist.gap, color="C2", label="mean H(p1) − H(p2)")
    if margin is not None:
        ax2.axhline(margin, color="grey", ls="--", lw=1, label=f"margin m = {margin} nats")
    ax2.set(
        title="Entropy gap on unlabeled data",
        xlabel="fine-tuning step",
        ylabel="entropy gap (nats)",
    )
    epochs = np.arange(1, len(hist.val_auroc) + 1)
    ax3.plot(epochs, 100 * np.asarray(hist.val_auroc), "o-", color="C3", label="validation AUROC")
    if hist.best_epoch >= 0:
        ax3.plot(
            hist.best_epoch + 1,
            100 * hist.val_auroc[hist.best_epoch],
            "*",
            ms=14,
            color="gold",
            markeredgecolor="k",
            label="kept",
        )
    ax3.set(title="Model selection", xlabel="epoch", ylabel="AUROC (%)", xticks=epochs)
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    return finish_figure(fig, title)


def plot_extremes(
    x_id: torch.Tensor, x_ood: torch.Tensor, s_id, s_ood, mean, std, k: int = 8, title: str = ""
):
    """The ``k`` test images with the highest and the ``k`` with the lowest OOD score, each marked
    ID (green) or OOD (red) with its score. ``x_*``: ``(N, C, H, W)`` normalised with ``mean``,
    ``std`` (undone here).

    Raises:
        ValueError: ``k`` outside [1, number of images], or not one score per image.
    """
    x, s = (
        torch.cat([x_id, x_ood]),
        torch.cat([torch.as_tensor(s_id), torch.as_tensor(s_ood)]).double(),
    )
    if len(s) != len(x) or not 1 <= k <= len(x):
        raise ValueError(
            f"{len(x)} images and {len(s)} scores: pass one score per image and k in [1, "
            f"{len(x)}], got k={k}."
        )
    is_ood, order = (
        torch.arange(len(x)) >= len(x_id),
        torch.argsort(s, descending=True, stable=True),
    )
    m, sd = (torch.as_tensor(v, dtype=x.dtype).view(-1, 1, 1) for v in (mean, std))
    # about 1.15 inches an image
    fig, axes = plt.subplots(2, k, figsize=(1.15 * k + 0.6, 3.4), squeeze=False)
    for row, (idx, label) in enumerate(((order[:k], "most OOD"), (order.flip(0)[:k], "least OOD"))):
        for ax, i in zip(axes[row], idx.tolist()):
            img = (x[i] * sd + m).clamp(0, 1)  # (C, H, W) in [0, 1]
            ax.imshow(
                (img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)).numpy(),
                cmap="gray",
                vmin=0,
                vmax=1,
            )
            ax.set_title(
                f"{'OOD' if is_ood[i] else 'ID'} {s[i]:.2f}",
                fontsize=12,
                fontweight="bold",
                color="C3" if is_ood[i] else "C2",
            )
            ax.set(xticks=[], yticks=[])
        axes[row][0].set_ylabel(label, fontsize=12)
    return finish_figure(
        fig,
        title or "Test images scored most (top) and least (bottom) OOD; above each: origin, score",
        fontsize=13,
    )
