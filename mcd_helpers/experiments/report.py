"""The benchmark's report: ``summary.md`` and its two figures, from ``results.json``'s rows alone.

* :func:`benchmark_tables` -- the summaries (mean and 95% CI over seeds) and the paired strategy
  differences (same seed, same split; also pooled over the class splits) that the report shows;
* :func:`summary_text` -- them as Markdown (metrics in %, differences in percentage points, pp);
* :func:`write_report` -- ``summary.md``, ``forest.png`` (paired AUROC differences of MCD,
  near-OOD) and ``by_protocol.png`` (AUROC by protocol, the first selection) into a folder.

Anyone with a ``results.json`` can rebuild the report: ``write_report(json.load(f), folder)``.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt

from ..training.checkpoint import atomic_write_bytes, atomic_write_text
from .stats import GROUP_KEYS, forest_plot, paired_differences, plot_by_protocol, protocol_order, summarize

__all__ = ["KEYS", "COMPARISONS", "ALL_SPLITS", "benchmark_tables", "setting_differences", "pooled_summary", "pivot_markdown",
           "forest_entries", "method_label", "summary_text", "write_report"]

KEYS = GROUP_KEYS + ("ood_dataset", "norm")  # a group: task, class split, protocol, selection, method, OOD set, network
COMPARISONS = (("concat", "separate"), ("split-bn", "separate"), ("recalibrate", "separate"))
METRICS = ("auroc", "fpr95", "id_accuracy")
ALL_SPLITS = "all"  # class_split of the pairs pooled over every class split (pair = split and seed)
_NAMES = {"auroc": "AUROC", "fpr95": "FPR95", "id_accuracy": "ID acc."}
_NETWORKS = {"batch": "BatchNorm", "group": "GroupNorm"}


def _pairs(rows: Sequence[dict]) -> list[dict]:
    out = []
    strategies = {r["strategy"] for r in rows}
    for a, b in COMPARISONS:
        if a in strategies and b in strategies:
            for metric in METRICS:
                out += paired_differences([r for r in rows if r["strategy"] in (a, b)], a, b, metric, KEYS)
    return out


def benchmark_tables(rows: Sequence[dict], task: str) -> tuple[list[dict], list[dict]]:
    """``(summary, paired)`` of the rows of ``task``.

    ``summary``: :func:`~mcd_helpers.experiments.stats.summarize` of AUROC, FPR95 and ID accuracy
    per group (:data:`KEYS`) and strategy. ``paired``:
    :func:`~mcd_helpers.experiments.stats.paired_differences` of each comparison of
    :data:`COMPARISONS` where both strategies ran, per group; with several class splits also
    pooled over them (``class_split`` = :data:`ALL_SPLITS`, one pair per split and seed).

    Raises:
        ValueError: from the statistics (fewer than 2 seeds, unmatched seeds, a missing metric).
    """
    mine = [r for r in rows if r["task"] == task]
    summary = summarize(mine, METRICS, KEYS + ("strategy",))
    paired = _pairs(mine)
    if len({r["class_split"] for r in mine}) > 1:
        pooled = [{**r, "class_split": ALL_SPLITS, "seed": f"{r['class_split']}:{r['seed']}"} for r in mine]
        paired += _pairs(pooled)
    return summary, paired


def setting_differences(rows: Sequence[dict], field: str, a: str, b: str, metric: str = "auroc",
                        task: str = "near-ood") -> list[dict]:
    """Paired differences ``a - b`` between two values of ``field`` (``"protocol"`` or ``"selection"``).

    A pair is one seed (and class split) of the same method, network and strategy, with every
    other setting equal, under both values: what changing ``field`` alone does. With several class
    splits there are also entries pooled over them (``class_split`` = :data:`ALL_SPLITS`).

    Returns:
        :func:`~mcd_helpers.experiments.stats.paired_differences` entries; ``a``/``b`` name the two
        values and ``arm`` the MCD strategy (``"-"`` for the baselines).

    Raises:
        ValueError: an unknown ``field``, or as :func:`~mcd_helpers.experiments.stats.paired_differences`.
    """
    if field not in ("protocol", "selection"):
        raise ValueError(f"field must be 'protocol' or 'selection', got {field!r}.")
    other = "selection" if field == "protocol" else "protocol"
    keys = ("task", "class_split", other, "method", "ood_dataset", "norm", "arm")
    mine = [{**r, "strategy": r[field], "arm": r["strategy"] or "-"} for r in rows
            if r["task"] == task and r[field] in (a, b)]
    out = paired_differences(mine, a, b, metric, keys)
    if len({r["class_split"] for r in mine}) > 1:
        pooled = [{**r, "class_split": ALL_SPLITS, "seed": f"{r['class_split']}:{r['seed']}"} for r in mine]
        out += paired_differences(pooled, a, b, metric, keys)
    return out


def pooled_summary(rows: Sequence[dict], task: str = "near-ood") -> list[dict]:
    """:func:`~mcd_helpers.experiments.stats.summarize` of ``task``'s rows over every class split and
    seed together (one value per split and seed), per protocol, selection, method, network and strategy.

    Raises:
        ValueError: as :func:`~mcd_helpers.experiments.stats.summarize`.
    """
    keys = tuple(k for k in KEYS + ("strategy",) if k != "class_split")
    return summarize([r for r in rows if r["task"] == task], METRICS, keys)


def pivot_markdown(summary: Sequence[dict], metric: str = "auroc", selection: str = "ood-labels") -> str:
    """One line per method (and strategy, network), one column per protocol: ``metric`` in %, mean ± CI."""
    entries = [g for g in summary if g["selection"] == selection]
    protocols = protocol_order(g["protocol"] for g in entries)
    by: dict[str, dict] = {}
    for g in entries:
        by.setdefault(method_label(g), {})[g["protocol"]] = g
    lines = [[name, min(g["n"] for g in cells.values())] + [_ci(cells[p][metric]) if p in cells else "-"
                                                           for p in protocols] for name, cells in by.items()]
    return _table(["method", "n", *[f"{p}: {_NAMES.get(metric, metric)} (%)" for p in protocols]], lines)


PROTOCOL_GAPS = (("transductive", "disjoint"), ("disjoint", "unseen-ood"))


def _gap_table(rows: Sequence[dict], task: str) -> list[str]:
    """MCD (every strategy) and the baselines: AUROC gained by each protocol change, pp."""
    protocols = {r["protocol"] for r in rows if r["task"] == task}
    cols = [(a, b) for a, b in PROTOCOL_GAPS if {a, b} <= protocols]
    if not cols:
        return []
    by: dict[tuple, dict] = {}
    for a, b in cols:
        for d in setting_differences(rows, "protocol", a, b, "auroc", task):
            if d["class_split"] == ALL_SPLITS or len({r["class_split"] for r in rows}) == 1:
                by.setdefault((d["selection"], d["method"], d["norm"], d["arm"]), {})[(a, b)] = d  # one OOD: held-out
    lines = [[sel, method_label({"method": m, "norm": n, "strategy": arm})] + [_ci(ds[c], True) if c in ds else "-"
                                                                      for c in cols] for (sel, m, n, arm), ds in by.items()]
    return ["### What each protocol change does (paired by seed" + (" and split, pooled" if len(
        {r["class_split"] for r in rows}) > 1 else "") + ")", "",
            "ΔAUROC in percentage points, mean ± 95% CI half-width; positive = the first protocol gives the higher "
            "AUROC.", "", _table(["selection", "method"] + [f"{a} − {b}" for a, b in cols], lines), ""]


def _ci(ci: dict, signed: bool = False) -> str:
    sign = "+" if signed else ""
    return f"{100 * ci['mean']:{sign}.2f} ± {100 * ci['half_width']:.2f}"


def _table(header: Sequence[str], lines: Sequence[Sequence]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(v) for v in line) + " |" for line in lines])


def method_label(g: dict) -> str:
    """A row's or group's name in the tables: "MSP (pre-trained)", "MCD concat", "MCD separate (GroupNorm)"."""
    if g["method"] != "mcd":
        return {"msp": "MSP", "odin": "ODIN", "energy": "energy"}[g["method"]] + " (pre-trained)"
    return f"MCD {g['strategy']}" + (" (GroupNorm)" if g["norm"] == "group" else "")


def _summary_tables(summary: list[dict]) -> list[str]:
    splits = len({g["class_split"] for g in summary}) > 1
    oods = len({g["ood_dataset"] for g in summary}) > 1
    parts = []
    for selection in dict.fromkeys(g["selection"] for g in summary):
        lines = [([g["class_split"]] if splits else []) + ([g["ood_dataset"]] if oods else [])
                 + [g["protocol"], method_label(g), g["n"]] + [_ci(g[m]) for m in METRICS]
                 for g in summary if g["selection"] == selection]
        header = ((["split"] if splits else []) + (["OOD"] if oods else [])
                  + ["protocol", "method", "n", "AUROC (%)", "FPR95 (%)", "ID acc. (%)"])
        parts += [f"**Model selection: {selection}**", "", _table(header, lines), ""]
    return parts


def _paired_table(paired: list[dict]) -> list[str]:
    by: dict[tuple, dict] = {}
    for d in paired:
        key = (d["class_split"], d["ood_dataset"], d["protocol"], d["selection"], d["norm"], d["a"], d["b"])
        by.setdefault(key, {})[d["metric"]] = d
    splits, oods = len({k[0] for k in by}) > 1, len({k[1] for k in by}) > 1
    lines = []
    for (split, ood, protocol, selection, norm, a, b), ds in by.items():
        auroc = ds["auroc"]
        p = "n/a" if math.isnan(auroc["p_value"]) else f"{auroc['p_value']:.2g}"
        lines.append(([split] if splits else []) + ([ood] if oods else [])
                     + [protocol, selection, _NETWORKS[norm], f"{a} − {b}", auroc["n"]]
                     + [_ci(ds[m], signed=True) for m in METRICS] + [p])
    header = ((["split"] if splits else []) + (["OOD"] if oods else [])
              + ["protocol", "selection", "network", "difference", "pairs"]
              + [f"Δ{_NAMES[m]} (pp)" for m in METRICS] + ["p (AUROC)"])
    return [_table(header, lines)]


def summary_text(rows: Sequence[dict], title: str = "Benchmark", seconds: float | None = None) -> str:
    """The whole ``summary.md``: a section per task (near-OOD, far-OOD), each with its tables."""
    seeds = sorted({r["seed"] for r in rows})
    parts = [f"# {title}", "",
             f"{len(rows)} rows, seeds {seeds}. Metrics in %: AUROC, FPR95 (ID positive, at 95% TPR; lower is "
             "better) and F1's ID test accuracy. MCD rows are fine-tuned networks, MSP/ODIN/energy the pre-trained "
             "BatchNorm one. Each cell: mean ± half-width of the 95% confidence interval over seeds (Student t)."]
    if seconds is not None:
        parts.append(f"\nWall time of this run: {seconds / 60:.1f} min (stages found in the cache are not retrained).")
    for task, heading in (("near-ood", "Near-OOD: held-out classes"), ("far-ood", "Far-OOD rows (transductive)")):
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        summary, paired = benchmark_tables(rows, task)
        splits = sorted({r["class_split"] for r in mine})
        oods = sorted({r["ood_dataset"] for r in mine})
        parts += ["", f"## {heading}", "", f"Class splits {', '.join(splits)}; OOD: {', '.join(oods)}.", ""]
        parts += _summary_tables(summary)
        parts += _gap_table(mine, task)
        if paired:
            parts += ["### Paired differences", "",
                      "Same seed (and split) for both strategies; mean ± 95% CI half-width in percentage points, "
                      "p of the two-sided paired t-test on AUROC" + (f"; split `{ALL_SPLITS}` pools every split"
                                                                       if len(splits) > 1 else "") + ".", ""]
            parts += _paired_table(paired)
    return "\n".join(parts).rstrip() + "\n"


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def forest_entries(paired: Sequence[dict]) -> list[dict]:
    """The MCD entries the forest plot shows: AUROC; pooled over splits when there are several."""
    entries = [d for d in paired if d["method"] == "mcd" and d["metric"] == "auroc"]
    pooled = [d for d in entries if d["class_split"] == ALL_SPLITS]
    return pooled or entries


def write_report(rows: Sequence[dict], folder: Path, title: str = "Benchmark", seconds: float | None = None) -> None:
    """Write ``summary.md``, ``forest.png`` and ``by_protocol.png`` (near-OOD rows) into ``folder``.

    Each file is written atomically. The figures need near-OOD rows; without them only
    ``summary.md`` is written.
    """
    folder = Path(folder)
    atomic_write_text(folder / "summary.md", summary_text(rows, title, seconds))
    if not any(r["task"] == "near-ood" for r in rows):
        return
    summary, paired = benchmark_tables(rows, "near-ood")
    entries = forest_entries(paired)
    if entries:
        atomic_write_bytes(folder / "forest.png", _png(forest_plot(
            entries, "auroc", "MCD, held-out classes: paired AUROC differences (same seed)")))
    first = summary[0]["selection"]  # one selection (the first run: ood-labels, the official one)
    series = [{**g, "method": method_label(g), "strategy": ""} for g in summary if g["selection"] == first]
    atomic_write_bytes(folder / "by_protocol.png", _png(plot_by_protocol(series, "auroc")))
