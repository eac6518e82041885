"""Figures (matplotlib, labelled axes and units): OOD scores, training histories, the benchmark.

Each function returns the ``Figure``; the caller shows or saves it and closes it.
"""

from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from .metrics import as_scores, ood_metrics, roc_points
from .splits import PROTOCOLS

NAMES = {"auroc": "AUROC", "fpr95": "FPR95", "id_accuracy": "ID acc.", "detection_error": "det. error",
         "aupr_in": "AUPR-In", "aupr_out": "AUPR-Out"}  # the metrics' names in tables and figures


def protocol_order(protocols) -> list[str]:
    """The distinct protocols in :data:`~mcd_helpers.splits.PROTOCOLS` order (others after, alphabetically)."""
    return sorted(set(protocols), key=lambda p: (PROTOCOLS.index(p) if p in PROTOCOLS else len(PROTOCOLS), p))


def _finish(fig, title: str | None = None, rect=None, **suptitle_kwargs):
    """``fig`` with its ``suptitle`` (none when ``title`` is None) and a tight layout (within ``rect``, figure
    fractions, when given)."""
    if title is not None:
        fig.suptitle(title, **suptitle_kwargs)
    fig.tight_layout(rect=rect)
    return fig


def plot_score_histograms(panels: Mapping[str, tuple], title: str = "", bins: int = 50):
    """One panel per ``{label: (id_scores, ood_scores)}``: ID vs OOD score densities (higher = more OOD)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (label, (s_id, s_ood)) in zip(axes[0], panels.items()):
        s_id, s_ood = as_scores(s_id, "id_scores"), as_scores(s_ood, "ood_scores")
        edges = np.histogram_bin_edges(np.concatenate([s_id, s_ood]), bins=bins)
        ax.hist(s_id, bins=edges, alpha=0.6, density=True, label=f"ID (n={s_id.size})")
        ax.hist(s_ood, bins=edges, alpha=0.6, density=True, label=f"OOD (n={s_ood.size})")
        ax.set(title=f"{label}\nAUROC {100 * ood_metrics(s_id, s_ood)['auroc']:.2f}%",
               xlabel="OOD score (higher = more OOD)", ylabel="density")
        ax.legend(fontsize=8)
    return _finish(fig, title)


def plot_roc_curves(curves: Mapping[str, tuple], title: str = ""):
    """ROC curves of ``{label: (id_scores, ood_scores)}``, ID positive: TPR (ID accepted) against FPR (OOD accepted)."""
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    for label, (s_id, s_ood) in curves.items():
        fpr, tpr = roc_points(s_id, s_ood)
        ax.plot(100 * fpr, 100 * tpr, label=f"{label} (AUROC {100 * ood_metrics(s_id, s_ood)['auroc']:.2f}%)")
    ax.axhline(95, color="grey", lw=0.8, ls=":", label="TPR 95%")
    ax.plot([0, 100], [0, 100], color="grey", lw=0.8, ls="--")
    ax.set(xlabel="FPR: OOD accepted as ID (%)", ylabel="TPR: ID accepted (%)", title=title, xlim=(0, 100), ylim=(0, 101))
    ax.legend(fontsize=8, loc="lower right")
    return _finish(fig)


def plot_history(hist, margin: float | None = None, title: str = ""):
    """A fine-tuning :class:`~mcd_helpers.train.History`: Step B losses and the entropy gap per step (nats),
    validation AUROC per epoch (%) with the epoch kept (``best_epoch``) starred; ``margin`` drawn on the gap."""
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13.5, 3.6))
    steps = np.arange(1, len(hist.ce) + 1)
    ax1.plot(steps, hist.ce, label="CE(F1) + CE(F2), labeled batch")
    ax1.plot(steps, hist.dis, label="discrepancy loss, unlabeled batch")
    ax1.set(title="Step B losses", xlabel="fine-tuning step", ylabel="loss (nats)")
    ax2.plot(steps, hist.gap, color="C2", label="mean H(p1) − H(p2)")
    if margin is not None:
        ax2.axhline(margin, color="grey", ls="--", lw=1, label=f"margin m = {margin} nats")
    ax2.set(title="Entropy gap on unlabeled data", xlabel="fine-tuning step", ylabel="entropy gap (nats)")
    epochs = np.arange(1, len(hist.val_auroc) + 1)
    ax3.plot(epochs, 100 * np.asarray(hist.val_auroc), "o-", color="C3", label="validation AUROC")
    if hist.best_epoch >= 0:
        ax3.plot(hist.best_epoch + 1, 100 * hist.val_auroc[hist.best_epoch], "*", ms=14, color="gold",
                 markeredgecolor="k", label="kept")
    ax3.set(title="Model selection", xlabel="epoch", ylabel="AUROC (%)", xticks=epochs)
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    return _finish(fig, title)


def plot_extremes(x_id: torch.Tensor, x_ood: torch.Tensor, s_id, s_ood, mean, std, k: int = 8, title: str = ""):
    """The ``k`` test images with the highest and the ``k`` with the lowest OOD score, each marked ID (green)
    or OOD (red) with its score. ``x_*``: ``(N, C, H, W)`` normalised with ``mean``, ``std`` (undone here).

    Raises:
        ValueError: ``k`` outside [1, number of images], or not one score per image.
    """
    x, s = torch.cat([x_id, x_ood]), torch.cat([torch.as_tensor(s_id), torch.as_tensor(s_ood)]).double()
    if len(s) != len(x) or not 1 <= k <= len(x):
        raise ValueError(f"{len(x)} images and {len(s)} scores: pass one score per image and k in [1, {len(x)}], got k={k}.")
    is_ood, order = torch.arange(len(x)) >= len(x_id), torch.argsort(s, descending=True, stable=True)
    m, sd = (torch.as_tensor(v, dtype=x.dtype).view(-1, 1, 1) for v in (mean, std))
    fig, axes = plt.subplots(2, k, figsize=(1.15 * k + 0.6, 3.4), squeeze=False)  # about 1.15 inches an image
    for row, (idx, label) in enumerate(((order[:k], "most OOD"), (order.flip(0)[:k], "least OOD"))):
        for ax, i in zip(axes[row], idx.tolist()):
            img = (x[i] * sd + m).clamp(0, 1)  # (C, H, W) in [0, 1]
            ax.imshow((img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)).numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_title(f"{'OOD' if is_ood[i] else 'ID'} {s[i]:.2f}", fontsize=12, fontweight="bold",
                         color="C3" if is_ood[i] else "C2")
            ax.set(xticks=[], yticks=[])
        axes[row][0].set_ylabel(label, fontsize=12)
    return _finish(fig, title or "Test images scored most (top) and least (bottom) OOD; above each: origin, score",
                   fontsize=13)


def _varying(entries: Sequence[dict], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if len({e[k] for e in entries}) > 1] or list(keys[-1:])


_PAIR_FIELDS = ("metric", "a", "b", "seeds", "diffs", "mean", "low", "high", "half_width", "n", "p_value")


def forest_plot(paired: Sequence[dict], metric: str = "auroc", title: str = ""):
    """Paired differences (:func:`~mcd_helpers.stats.paired_differences`) of ``metric``, a row per group: the
    mean and its 95% CI in percentage points, a line at 0, labelled by the keys that vary.

    Raises:
        ValueError: no entry for ``metric`` (the available ones named).
    """
    if not (entries := [d for d in paired if d["metric"] == metric]):
        raise ValueError(f"no paired differences for metric {metric!r}; available: {sorted({d['metric'] for d in paired})}.")
    shown = _varying(entries, [k for k in entries[0] if k not in _PAIR_FIELDS])
    pairs = list(dict.fromkeys((d["a"], d["b"]) for d in entries))
    labels = [(f"{d['a']} − {d['b']}: " if len(pairs) > 1 else "") + " / ".join(str(d[k]) for k in shown) for d in entries]
    fig, ax = plt.subplots(figsize=(9.0, 1.4 + 0.35 * len(entries)))
    ax.errorbar([100 * d["mean"] for d in entries], range(len(entries)), xerr=[100 * d["half_width"] for d in entries],
                fmt="o", capsize=3, label="mean and 95% CI over the pairs")
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(entries)), labels)
    ax.invert_yaxis()
    which = f"{pairs[0][0]} − {pairs[0][1]}" if len(pairs) == 1 else f"strategy − {pairs[0][1]}"
    ax.set(xlabel=f"{which}, {NAMES.get(metric, metric)} (percentage points)", ylabel=" / ".join(shown))
    ax.set_title(title or f"Paired differences in {NAMES.get(metric, metric)} ({which}, same seed)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return _finish(fig)


def plot_by_protocol(summary: Sequence[dict], metric: str = "auroc"):
    """``metric`` (%) by protocol, mean and 95% CI: a panel per (task, class split, selection), a series per
    method and strategy. Raises ``ValueError`` when no entry holds ``metric`` and a protocol."""
    if not (entries := [g for g in summary if isinstance(g.get(metric), dict) and "protocol" in g]):
        raise ValueError(f"no summary entry holds metric {metric!r} and a protocol; pass summarize(...) output.")
    panel_keys = [k for k in ("task", "class_split", "selection") if k in entries[0]]
    series_keys = _varying(entries, [k for k in ("method", "strategy") if k in entries[0]] or ["protocol"])
    protocols = protocol_order(g["protocol"] for g in entries)
    panels = list(dict.fromkeys(tuple(g[k] for k in panel_keys) for g in entries))
    series = list(dict.fromkeys(tuple(g[k] for k in series_keys) for g in entries))
    ncols, width = min(3, len(panels)), 0.8 / len(series)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for j, s in enumerate(series):
            if pts := [(protocols.index(g["protocol"]), g[metric]) for g in entries
                       if tuple(g[k] for k in panel_keys) == panel and tuple(g[k] for k in series_keys) == s]:
                ax.errorbar([p + (j - (len(series) - 1) / 2) * width for p, _ in pts], [100 * c["mean"] for _, c in pts],
                            yerr=[100 * c["half_width"] for _, c in pts], fmt="o", capsize=3, label=" / ".join(map(str, s)))
        ax.set_xticks(range(len(protocols)), protocols)
        ax.set(xlabel="evaluation protocol", ylabel=f"{NAMES.get(metric, metric)} (%)", title=" / ".join(map(str, panel)))
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(series), 4), fontsize=8, title=" / ".join(series_keys))
    return _finish(fig, f"{NAMES.get(metric, metric)} by protocol: mean and 95% CI over seeds",
                   rect=(0, 0.06 + 0.04 * ((len(series) - 1) // 4) + 0.12 / nrows, 1, 1))  # room for the legend
