"""The benchmark's figures (matplotlib): paired differences as a forest plot, metrics by protocol.

Each function returns the ``Figure``; the caller shows or saves it and closes it.
"""

from typing import Sequence

import matplotlib.pyplot as plt

from ..plots import finish_figure
from ..splits import PROTOCOLS
from ..tables import METRIC_NAMES
from .significance import paired_differences, split_effects


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


# The row keys a forest plot may label its rows by, in words.
_KEY_WORDS = {
    "task": "task",
    "class_split": "class split",
    "protocol": "protocol",
    "selection": "model selection",
    "method": "method",
    "norm": "normalisation",
    "eval_stats": "evaluation statistics",
    "model": "network",
    "dose": "setting",
}


def _in_words(value) -> str:
    """A row key's value as a reader reads it: ``finetune_epochs=16`` -> ``finetune epochs 16``."""
    return str(value).replace("_", " ").replace("=", " ")


def forest_plot(paired: Sequence[dict], metric: str = "auroc", title: str = ""):
    """Paired differences (:func:`~mcd_helpers.stats.paired_differences`) of ``metric``, a row per
    group: the mean and its 95% CI in percentage points, a line at 0, labelled in words by the keys
    that vary (and by the pair when there are several).

    Raises:
        ValueError: no entry for ``metric`` (the available ones named).
    """
    if not (entries := [d for d in paired if d["metric"] == metric]):
        raise ValueError(
            f"no paired differences for metric {metric!r}; available: "
            f"{sorted({d['metric'] for d in paired})}."
        )
    keys = [k for k in entries[0] if k not in _PAIR_FIELDS]
    shown = [k for k in keys if len({str(e[k]) for e in entries}) > 1]
    pairs = list(dict.fromkeys((d["a"], d["b"]) for d in entries))
    labels = [
        ": ".join(
            ([f"{d['a']} − {d['b']}"] if len(pairs) > 1 or not shown else [])
            + ([" / ".join(_in_words(d[k]) for k in shown)] if shown else [])
        )
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
    name = METRIC_NAMES.get(metric, metric)
    if len(pairs) == 1:
        which = f"{pairs[0][0]} − {pairs[0][1]}"
    elif len({b for _, b in pairs}) == 1:
        which = f"strategy − {pairs[0][1]}"
    else:
        which = "difference between strategies"
    ax.set(
        xlabel=f"{which}, {name} (percentage points)",
        ylabel=" / ".join(_KEY_WORDS.get(k, _in_words(k)) for k in shown) or "comparison",
    )
    ax.set_title(
        title or f"Paired differences in {name} ({which}, same seed)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="best")
    return finish_figure(fig)


def _running_mcd(rows: Sequence[dict]) -> list[dict]:
    """MCD rows of the BatchNorm network evaluated with its running statistics."""
    return [
        r
        for r in rows
        if r.get("method") == "mcd"
        and r.get("norm", "batch") == "batch"
        and r.get("eval_stats", "running") == "running"
    ]


def _draw_random_effect(ax, fit: dict, y: float) -> float:
    """The random-effects estimate at height ``y``: a diamond over its CI, the prediction interval
    as a line through it (percentage points). Returns ``y``."""
    mu, low, high = (100 * fit[k] for k in ("mean", "low", "high"))
    pi = (100 * fit["pi_low"], 100 * fit["pi_high"])
    ax.plot(pi, [y, y], color="k", lw=1, label="95% prediction interval, a new split")
    ax.fill([low, mu, high, mu], [y, y - 0.45, y, y + 0.45], color="k")
    # the legend's diamond (a filled polygon's own handle would be a rectangle)
    ax.plot([], [], "D", color="k", label="average split: mean, 95% CI (diamond's width)")
    return y


def _draw_selected(ax, d: dict, y: float) -> float:
    """A selected split's paired difference at height ``y``, apart and in red. Returns ``y``."""
    ax.errorbar(
        100 * d["mean"],
        y,
        xerr=100 * d["half_width"],
        fmt="s",
        color="C3",
        capsize=3,
        label="a selected split, not in the average: mean, 95% CI",
    )
    return y


def split_forest(
    rows: Sequence[dict], selected: Sequence[dict] = (), title: str = "", xlim=(-15.0, 30.0)
):
    """Concat − separate in AUROC over random class splits, drawn the way a meta-analysis draws its
    studies: a row per split, sorted by effect, its mean and 95% CI over seeds (Student t); the
    random-effects estimate (:func:`~mcd_helpers.experiments.significance.split_effects`) as a
    diamond spanning its 95% CI at the bottom, and the prediction interval for a new split as a
    line through it. ``selected``: the rows of one more class split (e.g. the primary endpoint's
    split ``a``), drawn apart at the top and labelled as selected, not part of the fit. Units: AUROC
    percentage points; ``xlim`` clips the widest whiskers (3 seeds give wide t intervals).

    Raises:
        ValueError: as ``split_effects`` (fewer than 3 splits, unequal seeds, more than one task,
        protocol or selection), or ``selected`` holding more than one class split.
    """
    fit = split_effects(rows)
    pairs = sorted(paired_differences(_running_mcd(rows)), key=lambda d: -d["mean"])
    extra = paired_differences(_running_mcd(selected)) if selected else []
    if len(extra) > 1:
        raise ValueError(
            f"selected holds {len(extra)} class splits or protocols; pass the rows of one."
        )
    fig, ax = plt.subplots(figsize=(7.5, 2.0 + 0.2 * (len(pairs) + 3 * len(extra))))
    ticks, labels = [], []
    for d in extra:  # at the top, apart from the random splits
        ticks.append(_draw_selected(ax, d, y=-2))
        labels.append(
            f"split {d['class_split']}: selected after a first look ({len(d['diffs'])} seeds)"
        )
    ax.errorbar(
        [100 * d["mean"] for d in pairs],
        range(len(pairs)),
        xerr=[100 * d["half_width"] for d in pairs],
        fmt="o",
        color="C0",
        ms=4,
        capsize=2,
        label="a random split: mean, 95% CI over its seeds",
    )
    ticks += range(len(pairs))
    labels += [f"{d['class_split']} ({len(d['diffs'])} seeds)" for d in pairs]
    ticks.append(_draw_random_effect(ax, fit, y=len(pairs) + 1))
    labels.append(f"average split ({fit['k']} random splits, random effect)")
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlim(*xlim)
    ax.set(
        xlabel="concat − separate, AUROC points (> 0: concat detects better)",
        ylabel="class split: Fashion-MNIST classes ID / held out",
    )
    ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1, 0.13))
    return finish_figure(
        fig, title or "Concatenating against separate forwards, class split by class split"
    )


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
