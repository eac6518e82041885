"""The benchmark's figures (matplotlib): paired differences as a forest plot, metrics by protocol.

Each function returns the ``Figure``; the caller shows or saves it and closes it.
"""

from typing import Sequence

import matplotlib.pyplot as plt

from ..plots import finish_figure
from ..splits import PROTOCOLS
from ..tables import METRIC_NAMES


def protocol_order(protocols) -> list[str]:
    """The distinct protocols in :data:`~mcd_helpers.splits.PROTOCOLS` order (others after,
    alphabetically)."""
    return sorted(
        set(protocols), key=lambda p: (PROTOCOLS.index(p) if p in PROTOCOLS else len(PROTOCOLS), p)
    )


def _varying(entries: Sequence[dict], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if len({e[k] for e in entries}) > 1] or list(keys[-1:])


_PAIR_FIELDS = (
    "metric",
    "a",
    "b",
    "seeds",
    "diffs",
    "mean",
    "low",
    "high",
    "half_width",
    "n",
    "p_value",
)


def forest_plot(paired: Sequence[dict], metric: str = "auroc", title: str = ""):
    """Paired differences (:func:`~mcd_helpers.stats.paired_differences`) of ``metric``, a row per
    group: the mean and its 95% CI in percentage points, a line at 0, labelled by the keys that
    vary.

    Raises:
        ValueError: no entry for ``metric`` (the available ones named).
    """
    if not (entries := [d for d in paired if d["metric"] == metric]):
        raise ValueError(
            f"no paired differences for metric {metric!r}; available: "
            f"{sorted({d['metric'] for d in paired})}."
        )
    shown = _varying(entries, [k for k in entries[0] if k not in _PAIR_FIELDS])
    pairs = list(dict.fromkeys((d["a"], d["b"]) for d in entries))
    labels = [
        (f"{d['a']} − {d['b']}: " if len(pairs) > 1 else "") + " / ".join(str(d[k]) for k in shown)
        for d in entries
    ]
    fig, ax = plt.subplots(figsize=(9.0, 1.4 + 0.35 * len(entries)))
    ax.errorbar(
        [100 * d["mean"] for d in entries],
        range(len(entries)),
        xerr=[100 * d["half_width"] for d in entries],
        fmt="o",
        capsize=3,
        label="mean and 95% CI over the pairs",
    )
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(entries)), labels)
    ax.invert_yaxis()
    which = f"{pairs[0][0]} − {pairs[0][1]}" if len(pairs) == 1 else f"strategy − {pairs[0][1]}"
    ax.set(
        xlabel=f"{which}, {METRIC_NAMES.get(metric, metric)} (percentage points)",
        ylabel=" / ".join(shown),
    )
    ax.set_title(
        title or f"Paired differences in {METRIC_NAMES.get(metric, metric)} ({which}, same seed)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="lower right")
    return finish_figure(fig)


def plot_by_protocol(summary: Sequence[dict], metric: str = "auroc"):
    """``metric`` (%) by protocol, mean and 95% CI: a panel per (task, class split, selection), a
    series per method and strategy. Raises ``ValueError`` when no entry holds ``metric`` and a
    protocol."""
    if not (entries := [g for g in summary if isinstance(g.get(metric), dict) and "protocol" in g]):
        raise ValueError(
            f"no summary entry holds metric {metric!r} and a protocol; pass summarize(...) output."
        )
    panel_keys = [k for k in ("task", "class_split", "selection") if k in entries[0]]
    series_keys = _varying(
        entries, [k for k in ("method", "strategy") if k in entries[0]] or ["protocol"]
    )
    protocols = protocol_order(g["protocol"] for g in entries)
    panels = list(dict.fromkeys(tuple(g[k] for k in panel_keys) for g in entries))
    series = list(dict.fromkeys(tuple(g[k] for k in series_keys) for g in entries))
    ncols, width = min(3, len(panels)), 0.8 / len(series)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for j, s in enumerate(series):
            if pts := [
                (protocols.index(g["protocol"]), g[metric])
                for g in entries
                if tuple(g[k] for k in panel_keys) == panel
                and tuple(g[k] for k in series_keys) == s
            ]:
                ax.errorbar(
                    [p + (j - (len(series) - 1) / 2) * width for p, _ in pts],
                    [100 * c["mean"] for _, c in pts],
                    yerr=[100 * c["half_width"] for _, c in pts],
                    fmt="o",
                    capsize=3,
                    label=" / ".join(map(str, s)),
                )
        ax.set_xticks(range(len(protocols)), protocols)
        ax.set(
            xlabel="evaluation protocol",
            ylabel=f"{METRIC_NAMES.get(metric, metric)} (%)",
            title=" / ".join(map(str, panel)),
        )
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=min(len(series), 4),
        fontsize=8,
        title=" / ".join(series_keys),
    )
    # room for the legend
    return finish_figure(
        fig,
        f"{METRIC_NAMES.get(metric, metric)} by protocol: mean and 95% CI over seeds",
        rect=(0, 0.06 + 0.04 * ((len(series) - 1) // 4) + 0.12 / nrows, 1, 1),
    )
