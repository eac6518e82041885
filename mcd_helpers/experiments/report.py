"""The benchmark's report from ``results.json``'s rows alone: tables of results (values in %),
paired differences, endpoints and split effects, and its figures.

* :func:`benchmark_tables` (summaries and paired differences), the views notebook 08 shows
  (:func:`pooled_summary`, :func:`pivot_markdown`, :func:`setting_differences`), and
* :func:`write_report` (``summary.md`` and :func:`draw_figures`: ``forest.png``,
  ``by_protocol.png``, ``splits.png``): ``write_report(json.load(f), folder)`` rebuilds them.
"""

import math
from collections import Counter
from pathlib import Path
from typing import Sequence

from ..strategies import STRATEGIES
from ..tables import METHOD_NAMES, METRIC_NAMES, markdown_table
from .figures import forest_plot, plot_by_protocol, protocol_order, split_forest
from .files import atomic_write, write_buffered
from .significance import (
    EQUIVALENCE,
    GROUP_KEYS,
    endpoint_tests,
    paired_differences,
    split_effects,
    summarize,
)

# a group: task, split, protocol, selection, method, OOD, network, dose
KEYS = GROUP_KEYS + ("ood_dataset", "norm", "dose")
# a strategy evaluated with recalibrated statistics (eval_stats) is its own arm here
RECAL = " (recalibrated)"
COMPARISONS = (  # the pairs of arms the report tests, (a, b) for a - b
    ("concat", "separate"),
    ("split-bn", "separate"),
    ("recalibrate", "separate"),
    ("concat-both", "separate"),
    ("concat" + RECAL, "separate" + RECAL),
    ("separate", "eval-bn"),
    ("eval-bn-concat", "eval-bn"),
)
METRICS = ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")
# class_split of the pairs pooled over class splits (a pair = one split's means over its seeds)
ALL_SPLITS = "all"


def _ci(ci: dict, signed: bool = False) -> str:
    return f"{100 * ci['mean']:{'+' if signed else ''}.2f} ± {100 * ci['half_width']:.2f}"


def is_recalibrated_copy(row: dict) -> bool:
    """Whether ``row`` is a network evaluated again with recalibrated statistics (``eval_stats``
    ``recalibrated`` or ``recalibrated-<source>``), beside its own (not a strategy whose evaluation
    statistics are recalibrated, such as ``recalibrate``)."""
    stats = row.get("eval_stats") or ""
    if not stats.startswith("recalibrated") or row.get("strategy") is None:
        return False
    return STRATEGIES[row["strategy"]].eval_stats != stats


def arms(rows: Sequence[dict]) -> list[dict]:
    """The rows with each :func:`is_recalibrated_copy` renamed to strategy
    ``"<strategy> (<eval_stats>)"`` (e.g. ``"concat (recalibrated)"``), so that the tables group and
    pair it as an arm of its own; rows written before doses existed get ``dose = ""``."""
    out = []
    for r in rows:
        copied = is_recalibrated_copy(r)
        renamed = {"strategy": f"{r['strategy']} ({r['eval_stats']})"} if copied else {}
        out.append({"dose": "", **r, **renamed})
    return out


def method_label(g: dict) -> str:
    """A row's or group's name: "MSP (pre-trained)", "MCD concat", "MCD separate (GroupNorm)"."""
    if g["method"] != "mcd":
        return METHOD_NAMES[g["method"]] + " (pre-trained)"
    return f"MCD {g['strategy']}" + (" (GroupNorm)" if g.get("norm") == "group" else "")


def split_means(rows: Sequence[dict]) -> list[dict]:
    """Each class split's rows averaged over seeds, as rows of split ``all`` whose ``seed`` is the
    class split: pairing them pairs splits (the split is the block, as in a two-stage random-effects
    analysis; with balanced seeds the mean and interval are
    :func:`~mcd_helpers.experiments.significance.split_effects`' REML ones). An arm found in one
    split only is left out."""
    keys = [
        k
        for k in (*KEYS, "strategy", "arm", "eval_stats")
        if k != "class_split" and any(k in r for r in rows)
    ]
    means: dict[tuple, dict] = {}
    for r in rows:
        m = means.setdefault(
            (r["class_split"], *(r.get(k) for k in keys)),
            {**{k: r.get(k) for k in keys}, "class_split": ALL_SPLITS, "seed": r["class_split"]},
        )
        for metric in METRICS:
            m.setdefault("_" + metric, []).append(r.get(metric))
    splits = Counter(key[1:] for key in means)
    return [
        {
            **{k: v for k, v in m.items() if k[0] != "_"},
            **{k[1:]: None if None in v else sum(v) / len(v) for k, v in m.items() if k[0] == "_"},
        }
        for key, m in means.items()
        if splits[key[1:]] > 1
    ]


def _with_pooled(rows: Sequence[dict], fn) -> list[dict]:
    """``fn(rows)``, and with several class splits also ``fn`` of their :func:`split_means` (split
    ``all``)."""
    return fn(rows) + (fn(split_means(rows)) if len({r["class_split"] for r in rows}) > 1 else [])


def benchmark_tables(rows: Sequence[dict], task: str) -> tuple[list[dict], list[dict]]:
    """``(summary, paired)`` of ``task``'s rows: mean and 95% CI of AUROC, FPR95 and ID accuracy per
    group of :data:`KEYS` and strategy, and each comparison of :data:`COMPARISONS` per group (with
    several class splits also pooled over them, ``class_split = "all"``). ValueError from the
    statistics."""
    mine = arms([r for r in rows if r["task"] == task])

    # every comparison whose two arms ran, every metric
    def pairs(rs: Sequence[dict]) -> list[dict]:
        out = []
        for a, b in COMPARISONS:
            both = [r for r in rs if r["strategy"] in (a, b)]
            if {a, b} <= {r["strategy"] for r in rs}:
                out += [d for m in METRICS for d in paired_differences(both, a, b, m, KEYS)]
        return out

    return summarize(mine, METRICS, KEYS + ("strategy",)), _with_pooled(mine, pairs)


def setting_differences(
    rows: Sequence[dict], field: str, a: str, b: str, metric: str = "auroc", task: str = "near-ood"
) -> list[dict]:
    """Paired differences ``a - b`` of two values of ``field`` (``"protocol"`` or ``"selection"``):
    a pair is one seed (and split) of the same method, network and strategy (``arm``; ``"-"`` for
    baselines), all else equal."""
    if field not in ("protocol", "selection"):
        raise ValueError(f"field must be 'protocol' or 'selection', got {field!r}.")
    keys = tuple(k for k in KEYS if k != field) + ("arm",)
    mine = [
        {**r, "strategy": r[field], "arm": r["strategy"] or "-"}
        for r in arms(rows)
        if r["task"] == task and r[field] in (a, b)
    ]
    return _with_pooled(mine, lambda rs: paired_differences(rs, a, b, metric, keys))


def pooled_summary(rows: Sequence[dict], task: str = "near-ood") -> list[dict]:
    """The summary of ``task``'s rows over class splits: a value per split, its mean over seeds
    (:func:`split_means`); with one class split, over its seeds."""
    keys, mine = (
        tuple(k for k in KEYS + ("strategy",) if k != "class_split"),
        arms([r for r in rows if r["task"] == task]),
    )
    return summarize(
        split_means(mine) if len({r["class_split"] for r in mine}) > 1 else mine, METRICS, keys
    )


def pivot_markdown(
    summary: Sequence[dict], metric: str = "auroc", selection: str = "ood-labels"
) -> str:
    """A line per method (and strategy, network), a column per protocol: ``metric`` in %, mean and
    95% CI."""
    entries = [g for g in summary if g["selection"] == selection]
    protocols = protocol_order(g["protocol"] for g in entries)
    by = {}
    for g in entries:
        by.setdefault(method_label(g), {})[g["protocol"]] = g
    lines = [
        [
            name,
            min(g["n"] for g in cells.values()),
            *(_ci(cells[p][metric]) if p in cells else "-" for p in protocols),
        ]
        for name, cells in by.items()
    ]
    return markdown_table(
        ["method", "n", *(f"{p}: {METRIC_NAMES.get(metric, metric)} (%)" for p in protocols)], lines
    )


def endpoints_markdown(tests: Sequence[dict]) -> str:
    """The table of :func:`mcd_helpers.experiments.significance.endpoint_tests`' results:
    differences in percentage points."""
    lines = [
        [
            d["role"],
            f"{d['a']} − {d['b']}",
            METRIC_NAMES[d["metric"]],
            d["eval_stats"],
            d["n"],
            _ci(d, True),
            f"{d['p_value']:.2g}",
            f"{d['sign_p']:.2g}",
            f"{d['holm_p']:.2g}" if d["role"] == "secondary" else "-",
            f"{d['tost_p']:.2g}",
        ]
        for d in tests
    ]
    return markdown_table(
        [
            "endpoint",
            "MCD difference",
            "metric",
            "statistics",
            "seeds",
            "mean ± 95% CI (pp)",
            "p (paired t)",
            "p (sign)",
            "p (Holm)",
            f"p (TOST, ±{100 * EQUIVALENCE:g} pp)",
        ],
        lines,
        "lllllrrrrr",
    )


def split_effect_tables(rows: Sequence[dict], a: str = "concat", b: str = "separate") -> list[dict]:
    """:func:`~mcd_helpers.experiments.significance.split_effects` of MCD ``a - b`` (AUROC) per
    near-OOD protocol and selection that has at least 3 class splits with both strategies, each with
    its ``protocol`` and ``selection``."""
    mine = [r for r in rows if r["task"] == "near-ood"]
    out = []
    for protocol, selection in dict.fromkeys((r["protocol"], r["selection"]) for r in mine):
        these = [r for r in mine if (r["protocol"], r["selection"]) == (protocol, selection)]
        if len({r["class_split"] for r in these if r["strategy"] in (a, b)}) >= 3:
            out.append({"protocol": protocol, "selection": selection, **split_effects(these, a, b)})
    return out


def split_effects_markdown(effects: Sequence[dict]) -> str:
    """The table of :func:`split_effect_tables`: percentage points (the slope in pp per pp of the
    covariate)."""

    def pp(x: float) -> str:
        return f"{100 * x:+.2f}"

    lines = [
        [
            e["protocol"],
            e["selection"],
            f"{e['a']} − {e['b']}",
            e["k"],
            e["n"],
            f"{pp(e['mean'])} [{pp(e['low'])}, {pp(e['high'])}]",
            f"{100 * e['tau']:.2f} [{100 * e['tau_low']:.2f}, {100 * e['tau_high']:.2f}]; "
            f"p {e['tau_p']:.2g}",
            f"{100 * e['sigma']:.2f}",
            f"[{pp(e['pi_low'])}, {pp(e['pi_high'])}]",
            f"{e['slope']:+.2f} (p {e['slope_p']:.2g})",
            f"{sum(s['mean'] > 0 for s in e['splits'])}/{e['k']}",
        ]
        for e in effects
    ]
    return markdown_table(
        [
            "protocol",
            "selection",
            "MCD difference",
            "splits",
            "pairs",
            "mean [95% CI] (pp)",
            "between-split SD (pp) [95% CI]; p of τ = 0",
            "within-split SD (pp)",
            "95% prediction interval, new split (pp)",
            "slope on MSP AUROC",
            "splits > 0",
        ],
        lines,
        "lllrrrrrrrr",
    )


_INTRO = (
    "Metrics in %: AUROC, FPR95 (ID positive, at 95% TPR; lower is better) and F1's ID test "
    "accuracy. MCD rows are fine-tuned networks, MSP/ODIN/energy the pre-trained BatchNorm "
    "one. Each cell: mean ± half-width of the 95% confidence interval over seeds (Student t)."
)
_ENDPOINTS = (
    "The first is the primary endpoint; the others are one family, Holm-adjusted. Paired by seed; "
    "the sign test is exact (two-sided); TOST tests equivalence within ±{:g} pp (p < 0.05: shown "
    "equivalent)."
)
_SPLIT_EFFECTS = (
    "MCD on the BatchNorm network, AUROC, running statistics: d = mu + u_split + e, fitted by REML "
    "(in closed form: as many seeds in every split), the between-split SD τ's interval by its "
    "profile likelihood (its χ² cut-off not corrected at τ = 0) and τ = 0 tested exactly (the "
    "one-way ANOVA's F test); the prediction interval is for a new class "
    "split's effect (Higgins et al. 2009); the slope regresses the split means on MSP's "
    "AUROC there (a harder split has a lower MSP AUROC)."
)
_TASKS = (("near-ood", "Near-OOD: held-out classes"), ("far-ood", "Far-OOD rows (transductive)"))
_COLUMN_NAMES = {"class_split": "split", "ood_dataset": "OOD", "dose": "dose"}


def _columns(summary: Sequence[dict]) -> list[str]:
    """The grouping fields that vary in ``summary`` (split, OOD set, dose), shown as columns."""
    return [k for k in _COLUMN_NAMES if len({g[k] for g in summary}) > 1]


def _summaries(summary: Sequence[dict], cols: list[str]) -> list[str]:
    """A table of means per model selection."""
    header = [_COLUMN_NAMES[k] for k in cols] + ["protocol", "method", "n"]
    header += [f"{METRIC_NAMES[m]} (%)" for m in METRICS]
    parts = []
    for selection in dict.fromkeys(g["selection"] for g in summary):
        lines = [
            [g[k] for k in cols]
            + [g["protocol"], method_label(g), g["n"], *(_ci(g[m]) for m in METRICS)]
            for g in summary
            if g["selection"] == selection
        ]
        parts += [f"**Model selection: {selection}**", "", markdown_table(header, lines), ""]
    return parts


def _paired_table(paired: Sequence[dict], cols: list[str], several_splits: bool) -> list[str]:
    """The paired differences, a line per group and pair of arms (every metric)."""
    by: dict[tuple, dict] = {}
    for d in paired:
        key = tuple(d[k] for k in (*cols, "protocol", "selection", "norm", "a", "b"))
        by.setdefault(key, {})[d["metric"]] = d
    lines = []
    for k, ds in by.items():
        p = ds["auroc"]["p_value"]
        network = {"batch": "BatchNorm", "group": "GroupNorm"}[k[-3]]
        cells = [_ci(ds[m], True) for m in METRICS]
        lines.append(
            [
                *k[:-3],
                network,
                f"{k[-2]} − {k[-1]}",
                ds["auroc"]["n"],
                *cells,
                "n/a" if math.isnan(p) else f"{p:.2g}",
            ]
        )
    if not lines:
        return []
    pooled = f"; split `{ALL_SPLITS}` pairs the splits' means over seeds (split as the block)"
    header = [_COLUMN_NAMES[k] for k in cols] + ["protocol", "selection", "network", "difference"]
    header += ["pairs", *(f"Δ{METRIC_NAMES[m]} (pp)" for m in METRICS), "p (AUROC)"]
    about = (
        "Same seed (and split) for both strategies; mean ± 95% CI half-width in percentage points, "
        "p of the two-sided paired t-test on AUROC" + (pooled if several_splits else "") + "."
    )
    return ["### Paired differences", "", about, "", markdown_table(header, lines)]


def summary_text(
    rows: Sequence[dict],
    title: str = "Benchmark",
    seconds: float | None = None,
    endpoints: Sequence = (),
) -> str:
    """The whole ``summary.md``: the pre-registered ``endpoints`` (if any), the class split as a
    random effect (3 or more splits), then per task (near-OOD, far-OOD) the summary per selection
    and the paired differences."""
    seeds = sorted({r["seed"] for r in rows})
    parts = [f"# {title}", "", f"{len(rows)} rows, seeds {seeds}. {_INTRO}"]
    if seconds is not None:
        parts.append(
            f"\nWall time of this run: {seconds / 60:.1f} min (stages found in the cache "
            "are not retrained)."
        )
    if endpoints:
        tests = endpoints_markdown(endpoint_tests(rows, endpoints))
        parts += [
            "",
            "## Pre-registered endpoints",
            "",
            _ENDPOINTS.format(100 * EQUIVALENCE),
            "",
            tests,
        ]
    if effects := split_effect_tables(rows):
        table = split_effects_markdown(effects)
        parts += ["", "## Class split as a random effect", "", _SPLIT_EFFECTS, "", table]
    for task, heading in _TASKS:
        summary, paired = benchmark_tables(rows, task)
        if not summary:  # no rows of this task
            continue
        splits, oods = (
            sorted({g["class_split"] for g in summary}),
            sorted({g["ood_dataset"] for g in summary}),
        )
        cols = _columns(summary)
        parts += [
            "",
            f"## {heading}",
            "",
            f"Class splits {', '.join(splits)}; OOD: {', '.join(oods)}.",
            "",
        ]
        parts += _summaries(summary, cols)
        parts += _paired_table(paired, cols, len(splits) > 1)
    return "\n".join(parts).rstrip() + "\n"


def forest_entries(paired: Sequence[dict]) -> list[dict]:
    """The MCD AUROC differences the forest plot shows: pooled over splits when there are
    several."""
    entries = [d for d in paired if d["method"] == "mcd" and d["metric"] == "auroc"]
    return [d for d in entries if d["class_split"] == ALL_SPLITS] or entries


def write_report(
    rows: Sequence[dict],
    folder: Path,
    title: str = "Benchmark",
    seconds: float | None = None,
    endpoints: Sequence = (),
) -> None:
    """``summary.md`` and the figures of :func:`draw_figures` in ``folder``."""
    atomic_write(Path(folder) / "summary.md", summary_text(rows, title, seconds, endpoints))
    draw_figures(rows, folder)


def draw_figures(rows: Sequence[dict], folder: Path) -> None:
    """With near-OOD rows, ``forest.png``, ``by_protocol.png`` (the first selection) and, with 3 or
    more class splits, ``splits.png`` (concat − separate per split: a meta-analysis forest,
    :func:`~mcd_helpers.experiments.figures.split_forest`, when one protocol and selection has
    them) in ``folder``."""
    import matplotlib.pyplot as plt

    def save(name: str, fig) -> None:
        write_buffered(Path(folder) / name, lambda f: fig.savefig(f, format="png", dpi=100))
        plt.close(fig)

    summary, paired = benchmark_tables(rows, "near-ood")  # empty without near-OOD rows
    if entries := forest_entries(paired):
        save(
            "forest.png",
            forest_plot(
                entries,
                "auroc",
                "MCD, held-out classes: paired AUROC differences "
                + (
                    "(pairs: the class splits' means)"
                    if len({d["class_split"] for d in paired}) > 1
                    else "(same seed)"
                ),
            ),
        )
    effects = split_effect_tables(rows)
    if len(effects) == 1:  # one protocol and selection: the random-effects forest
        where = (effects[0]["protocol"], effects[0]["selection"])
        these = [r for r in rows if r["task"] == "near-ood"]
        save(
            "splits.png",
            split_forest([r for r in these if (r["protocol"], r["selection"]) == where]),
        )
    elif effects:  # per class split first, then their block mean (split "all")
        save(
            "splits.png",
            forest_plot(
                [
                    d
                    for d in paired
                    if (d["method"], d["norm"], d["a"], d["b"])
                    == ("mcd", "batch", "concat", "separate")
                ],
                "auroc",
                "MCD concat − separate per class split (pairs: seeds; split all: the split means)",
            ),
        )
    if summary:
        save(
            "by_protocol.png",
            plot_by_protocol(
                [
                    {**g, "method": method_label(g), "strategy": ""}
                    for g in summary
                    if g["selection"] == summary[0]["selection"]
                ],
                "auroc",
            ),
        )
