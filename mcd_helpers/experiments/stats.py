"""Statistics over seeds: Student-t confidence intervals, paired strategy differences, tables and figures.

Rows are result dicts as in the benchmark's ``results.json``: the grouping keys (``task``,
``class_split``, ``protocol``, ``selection``, ``method``, ``strategy``), a ``seed`` and the metrics
as fractions in [0, 1] (``auroc``, ``fpr95``, ``id_accuracy``, ...). Functions here keep fractions;
only :func:`summary_markdown` and the figures show % (and percentage points, pp, for differences).

Formulas (any statistics text, e.g. NIST/SEMATECH e-Handbook of Statistical Methods, sections
7.2.2 and 7.3.1): for n values with mean m and sample standard deviation s (ddof=1), the
confidence interval is ``m ± t_{(1+c)/2, n-1} · s / sqrt(n)``; the paired t-test of differences
d = a - b uses ``t = mean(d) / (s_d / sqrt(n))`` with n - 1 degrees of freedom, two-sided
(``scipy.stats.ttest_rel``). The two agree: p < 1 - c exactly when the interval excludes 0.
"""
from __future__ import annotations

import math
from typing import Sequence

import matplotlib.pyplot as plt
import numpy as np
from scipy import stats as _st

__all__ = ["GROUP_KEYS", "mean_ci", "paired_differences", "summarize", "summary_markdown", "forest_plot",
           "plot_by_protocol", "protocol_order"]

GROUP_KEYS = ("task", "class_split", "protocol", "selection", "method")
_LABELS = {"auroc": "AUROC", "fpr95": "FPR95", "id_accuracy": "ID acc.", "detection_error": "Detection error",
           "aupr_in": "AUPR-In", "aupr_out": "AUPR-Out"}
_PROTOCOL_ORDER = ("transductive", "disjoint", "unseen-ood")  # as mcd_helpers.data.nearood.PROTOCOLS
_PAIR_FIELDS = ("metric", "a", "b", "seeds", "diffs", "mean", "low", "high", "half_width", "n", "p_value")


def protocol_order(protocols) -> list[str]:
    """The distinct protocols of ``protocols`` in the order of :data:`mcd_helpers.data.nearood.PROTOCOLS`
    (transductive, disjoint, unseen-ood), any other name after them, alphabetically."""
    return sorted(set(protocols), key=lambda p: (_PROTOCOL_ORDER.index(p) if p in _PROTOCOL_ORDER
                                                 else len(_PROTOCOL_ORDER), p))


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean with a Student-t confidence interval.

    Args:
        values: one value per seed, ``(n,)``, in the caller's units (fractions stay fractions).
        confidence: the interval's level as a fraction in (0, 1), e.g. 0.95 (not 95).

    Returns:
        ``{"mean", "low", "high", "half_width", "n"}``; ``half_width = t_{(1+c)/2, n-1} s / sqrt(n)``,
        ``s`` the sample standard deviation (ddof=1), ``t`` from ``scipy.stats.t.ppf``.

    Raises:
        ValueError: fewer than 2 values (no spread to estimate), a NaN or inf (its index is named),
            or a confidence outside (0, 1).
    """
    if not 0 < confidence < 1:
        hint = f" (did you mean {confidence / 100}?)" if 1 < confidence < 100 else ""
        raise ValueError(f"confidence must be a fraction in (0, 1), got {confidence}{hint}.")
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size < 2:
        raise ValueError(f"a confidence interval needs at least 2 values (seeds), got {x.size}; run more seeds.")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"values hold {bad.size} NaN or inf value(s), first at index {bad[0]} ({x[bad[0]]}); "
                         "a failed run or a missing metric upstream.")
    mean, n = float(x.mean()), int(x.size)
    half = float(_st.t.ppf((1 + confidence) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return {"mean": mean, "low": mean - half, "high": mean + half, "half_width": half, "n": n}


def _key(row: dict, keys: Sequence[str], index: int) -> tuple:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"row {index} has no field(s) {missing}; its fields are {sorted(row)}.")
    return tuple(row[k] for k in keys)


def _value(row: dict, metric: str, index: int) -> float:
    if row.get(metric) is None:
        raise ValueError(f"row {index} has no value for metric {metric!r}; its fields are {sorted(row)}.")
    return float(row[metric])


def _group_name(group: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in group.items())


def paired_differences(rows: Sequence[dict], a: str = "concat", b: str = "separate", metric: str = "auroc",
                       keys: Sequence[str] = GROUP_KEYS, confidence: float = 0.95) -> list[dict]:
    """Paired differences ``a - b`` between two strategies, per group, matched by seed.

    Rows of strategy ``a`` and ``b`` that agree on ``keys`` form a group; within it each seed gives
    one difference ``d = row_a[metric] - row_b[metric]`` (a fraction for fraction metrics). Groups
    in which one of the two strategies has no row at all are skipped; rows of other strategies are
    ignored.

    Returns:
        one dict per group, in order of first appearance: the ``keys`` values, ``metric``, ``a``,
        ``b``, ``seeds`` and ``diffs`` (sorted by seed), the :func:`mean_ci` fields of the
        differences, and ``p_value`` of the two-sided paired t-test (``scipy.stats.ttest_rel``);
        ``p_value`` is NaN when every difference is equal (the t statistic is undefined).

    Raises:
        ValueError: a row without a key, ``strategy``, ``seed`` or the metric; seeds present for one
            strategy but not the other (the group and the seeds are named); a seed twice for one
            strategy; fewer than 2 pairs in a group.
    """
    groups: dict[tuple, dict[str, dict]] = {}
    for i, row in enumerate(rows):
        strategy, seed = _key(row, ("strategy", "seed"), i)
        if strategy not in (a, b):
            continue
        by_seed = groups.setdefault(_key(row, keys, i), {a: {}, b: {}})[strategy]
        if seed in by_seed:
            raise ValueError(f"seed {seed} appears twice for strategy {strategy!r} in group "
                             f"{_group_name(dict(zip(keys, _key(row, keys, i))))}; each seed must appear once.")
        by_seed[seed] = _value(row, metric, i)
    out = []
    for group_key, by in groups.items():
        group = dict(zip(keys, group_key))
        if not by[a] or not by[b]:
            continue  # only one of the two strategies ran in this group: nothing to pair
        only_a, only_b = sorted(set(by[a]) - set(by[b])), sorted(set(by[b]) - set(by[a]))
        if only_a or only_b:
            raise ValueError(f"unmatched seeds in group {_group_name(group)}: seeds {only_a} only for {a!r}, "
                             f"seeds {only_b} only for {b!r}; pairs need the same seeds for both strategies.")
        seeds = sorted(by[a])
        xa, xb = np.array([by[a][s] for s in seeds]), np.array([by[b][s] for s in seeds])
        diffs = xa - xb
        try:
            ci = mean_ci(diffs, confidence)
        except ValueError as err:
            raise ValueError(f"group {_group_name(group)}: {err}") from None
        p = float("nan") if np.all(diffs == diffs[0]) else float(_st.ttest_rel(xa, xb).pvalue)
        out.append({**group, "metric": metric, "a": a, "b": b, "seeds": seeds, "diffs": diffs.tolist(),
                    **ci, "p_value": p})
    return out


def summarize(rows: Sequence[dict], metrics: Sequence[str] = ("auroc", "fpr95", "id_accuracy"),
              keys: Sequence[str] = GROUP_KEYS + ("strategy",), confidence: float = 0.95) -> list[dict]:
    """Mean and confidence interval over seeds of each metric, per group of rows equal on ``keys``.

    Returns:
        one dict per group, in order of first appearance: the ``keys`` values, ``n`` (rows) and,
        for each metric, ``{metric: mean_ci(values)}`` (fractions).

    Raises:
        ValueError: a row without a key or a metric value; a group with fewer than 2 rows or a NaN
            (see :func:`mean_ci`; the group is named).
    """
    groups: dict[tuple, list[tuple[int, dict]]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(_key(row, keys, i), []).append((i, row))
    out = []
    for group_key, members in groups.items():
        group = {**dict(zip(keys, group_key)), "n": len(members)}
        for metric in metrics:
            try:
                group[metric] = mean_ci([_value(r, metric, i) for i, r in members], confidence)
            except ValueError as err:
                raise ValueError(f"group {_group_name(dict(zip(keys, group_key)))}, {metric}: {err}") from None
        out.append(group)
    return out


def _pct(ci: dict) -> str:
    return f"{100 * ci['mean']:.2f} ± {100 * ci['half_width']:.2f}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(map(str, line)) + " |" for line in lines])


def summary_markdown(summary: Sequence[dict], paired: Sequence[dict]) -> str:
    """Markdown tables of a :func:`summarize` result and of :func:`paired_differences` results.

    Metric cells are ``mean ± half-width`` of the 95% interval, in % (differences in percentage
    points); the paired table also gives the interval ``[low, high]`` and the paired t-test's p.
    """
    parts = []
    if summary:
        metrics = [m for m in summary[0] if isinstance(summary[0][m], dict)]
        keys = [k for k in summary[0] if k != "n" and k not in metrics]
        lines = [[g[k] for k in keys] + [g["n"]] + [_pct(g[m]) for m in metrics] for g in summary]
        parts += ["Mean ± 95% CI half-width over seeds (Student t), in %.", "",
                  _table(keys + ["n"] + [f"{_LABELS.get(m, m)} (%)" for m in metrics], lines)]
    if paired:
        keys = [k for k in paired[0] if k not in _PAIR_FIELDS]
        lines = [[d[k] for k in keys] + [_LABELS.get(d["metric"], d["metric"]), f"{d['a']} − {d['b']}", d["n"],
                  _pct(d), f"[{100 * d['low']:.2f}, {100 * d['high']:.2f}]",
                  "n/a" if math.isnan(d["p_value"]) else f"{d['p_value']:.3g}"] for d in paired]
        parts += ["", "Paired differences (same seed), mean ± 95% CI half-width in percentage "
                  "points; p of the two-sided paired t-test.", "",
                  _table(keys + ["metric", "difference", "n", "mean ± CI (pp)", "95% CI (pp)", "p"], lines)]
    return "\n".join(parts).strip() + "\n"


def _label(entry: dict, keys: Sequence[str]) -> str:
    return " / ".join(str(entry[k]) for k in keys)


def _varying(entries: Sequence[dict], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if len({e[k] for e in entries}) > 1] or list(keys[-1:])


def forest_plot(paired: Sequence[dict], metric: str = "auroc", title: str = ""):
    """Forest plot of paired differences: one row per group, point = mean, bar = the 95% CI.

    Args:
        paired: :func:`paired_differences` results; those of ``metric`` are drawn.
        metric: which metric's differences to draw.
        title: figure title (default: says what is drawn).

    Returns:
        the matplotlib ``Figure``; x in percentage points (100 x the fraction difference), a
        vertical line at 0, rows top to bottom in the order given, labelled by the keys that vary
        (and by ``a − b`` when the entries hold several comparisons).

    Raises:
        ValueError: no entry for ``metric`` (the available metrics are named).
    """
    entries = [d for d in paired if d["metric"] == metric]
    if not entries:
        raise ValueError(f"no paired differences for metric {metric!r}; "
                         f"available: {sorted({d['metric'] for d in paired})}.")
    shown = _varying(entries, [k for k in entries[0] if k not in _PAIR_FIELDS])
    pairs = list(dict.fromkeys((d["a"], d["b"]) for d in entries))
    labels = [(f"{d['a']} − {d['b']}: " if len(pairs) > 1 else "") + _label(d, shown) for d in entries]
    y = np.arange(len(entries))
    fig, ax = plt.subplots(figsize=(9.0, 1.4 + 0.35 * len(entries)))
    ax.errorbar([100 * d["mean"] for d in entries], y, xerr=[100 * d["half_width"] for d in entries],
                fmt="o", capsize=3, label="mean and 95% CI over seeds")
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    name = _LABELS.get(metric, metric)
    if len(pairs) == 1:
        which = f"{pairs[0][0]} − {pairs[0][1]}"
    else:
        which = f"strategy − {pairs[0][1]}" if len({b for _, b in pairs}) == 1 else "a − b"
    ax.set(xlabel=f"{which}, {name} (percentage points)", ylabel=" / ".join(shown))
    ax.set_title(title or f"Paired differences in {name} ({which}, same seed)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_by_protocol(summary: Sequence[dict], metric: str = "auroc"):
    """A metric per protocol: one panel per (task, class split, selection), one series per method and strategy.

    Args:
        summary: :func:`summarize` results holding ``protocol`` and ``metric``.
        metric: the metric drawn, as mean with its 95% CI as error bar, in %.

    Returns:
        the matplotlib ``Figure``.

    Raises:
        ValueError: no summary entry holds ``metric`` or a ``protocol``.
    """
    entries = [g for g in summary if isinstance(g.get(metric), dict) and "protocol" in g]
    if not entries:
        raise ValueError(f"no summary entry holds metric {metric!r} and a protocol; pass summarize(...) "
                         f"output with metrics=({metric!r}, ...).")
    panel_keys = [k for k in ("task", "class_split", "selection") if k in entries[0]]
    series_keys = _varying(entries, [k for k in ("method", "strategy") if k in entries[0]] or ["protocol"])
    protocols = protocol_order(g["protocol"] for g in entries)
    panels = list(dict.fromkeys(tuple(g[k] for k in panel_keys) for g in entries))
    series = list(dict.fromkeys(tuple(g[k] for k in series_keys) for g in entries))
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    width = 0.8 / len(series)
    name = _LABELS.get(metric, metric)
    for ax, panel in zip(axes.flat, panels):
        for j, s in enumerate(series):
            pts = [(protocols.index(g["protocol"]), g[metric]) for g in entries
                   if tuple(g[k] for k in panel_keys) == panel and tuple(g[k] for k in series_keys) == s]
            if pts:
                ax.errorbar([p + (j - (len(series) - 1) / 2) * width for p, _ in pts],
                            [100 * ci["mean"] for _, ci in pts], yerr=[100 * ci["half_width"] for _, ci in pts],
                            fmt="o", capsize=3, label=" / ".join(map(str, s)))
        ax.set_xticks(range(len(protocols)), protocols)
        ax.set(xlabel="evaluation protocol", ylabel=f"{name} (%)", title=" / ".join(map(str, panel)))
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(series), 4), fontsize=8,
               title=" / ".join(series_keys))  # one legend for all panels, below them
    fig.suptitle(f"{name} by protocol: mean and 95% CI over seeds")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(series) - 1) // 4) + 0.12 / nrows, 1, 1))
    return fig
