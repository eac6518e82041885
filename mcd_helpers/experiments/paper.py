"""The paper's reported numbers, and our results beside them with the gap per metric.

Sources (every number here is copied from one of them):

* **The paper**: Qing Yu and Kiyoharu Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum
  Classifier Discrepancy", ICCV 2019 (arXiv 1908.04951): its results table for DenseNet-BC
  (L = 100, k = 12) with CIFAR-10 as the ID set, columns ODIN / ELOC / MCD, metrics FPR at 95% TPR,
  detection error and AUROC (:data:`PAPER_ROWS`). Rows for CIFAR-100 and WRN-28-10 are not
  transcribed here. Table and section numbers not verified offline (see :data:`PAPER_SOURCE`).
* **OpenOOD v1.5** (its leaderboard results files, 2025): MCD, MSP, energy and outlier exposure
  on CIFAR-10/100 with ResNet-18 under a protocol whose outlier data are disjoint from the test
  sets (:data:`OPENOOD_ROWS`); context for the benchmark's protocols, not a like-for-like row.
* **The unofficial reproduction** (github.com/Mephisto405/Unsupervised-Out-of-Distribution-Detection-
  by-Maximum-Classifier-Discrepancy): AUROC 99.83 +- 0.03 % over 3 fine-tuning runs on TINr
  (:data:`UNOFFICIAL_ROWS`), as it reports it in a figure of its README (not checked against text).

All numbers here are in **%** (the paper's unit); our result rows hold fractions and are
multiplied by 100 when put beside the paper. The gap is ``ours - paper`` in percentage points:
for AUROC a negative gap means we are worse, for FPR95 and detection error a positive one does.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["PAPER_SOURCE", "UNOFFICIAL_SOURCE", "OPENOOD_SOURCE", "OPENOOD_ROWS", "PAPER_METRICS", "PAPER_OOD_SETS", "PAPER_ROWS", "UNOFFICIAL_ROWS",
           "CIFAR_OOD_NAMES",
           "FMNIST_ANALOGS", "paper_rows", "beside_paper", "beside_paper_markdown", "plot_beside_paper",
           "markdown_table"]

PAPER_SOURCE = ("Yu & Aizawa, ICCV 2019 (arXiv 1908.04951), the paper's results table for DenseNet-BC, "
                "CIFAR-10 as ID")
"""Where :data:`PAPER_ROWS` come from, as printed under every comparison table.

The table is named by its content, not by number: the transcription could not be checked against
the paper offline, so table and section numbers are not verified offline (nor is any value of
:data:`PAPER_ROWS` re-checked since it was transcribed). Check against arXiv 1908.04951 before
citing a row."""
UNOFFICIAL_SOURCE = ("the unofficial reproduction, github.com/Mephisto405/Unsupervised-Out-of-Distribution-"
                     "Detection-by-Maximum-Classifier-Discrepancy (a figure of its README)")
PAPER_METRICS = ("fpr95", "detection_error", "auroc")
PAPER_OOD_SETS = ("TINc", "TINr", "LSUNc", "LSUNr", "iSUN")
_LABELS = {"fpr95": "FPR95", "detection_error": "det. error", "auroc": "AUROC"}
_NAN = float("nan")

# (OOD, metric) -> (ODIN, ELOC, MCD), %; "-" in the paper (ELOC on iSUN) is NaN.
_TABLE = {
    "TINc": {"fpr95": (3.6, 1.5, 0.1), "detection_error": (4.2, 3.0, 0.7), "auroc": (99.2, 99.6, 99.9)},
    "TINr": {"fpr95": (10.1, 3.2, 1.7), "detection_error": (6.9, 4.0, 2.3), "auroc": (98.2, 99.3, 99.6)},
    "LSUNc": {"fpr95": (6.0, 3.4, 0.2), "detection_error": (5.3, 4.1, 0.7), "auroc": (98.7, 99.3, 99.9)},
    "LSUNr": {"fpr95": (3.5, 1.4, 0.4), "detection_error": (4.2, 2.7, 1.1), "auroc": (99.2, 99.6, 99.9)},
    "iSUN": {"fpr95": (5.9, _NAN, 0.6), "detection_error": (5.3, _NAN, 1.3), "auroc": (98.9, _NAN, 99.9)},
}
PAPER_ROWS: list[dict] = [
    {"source": "paper", "id_dataset": "cifar10", "model": "densenet_bc_100", "ood": ood, "method": method,
     **{k: _TABLE[ood][k][i] for k in PAPER_METRICS}}
    for ood in PAPER_OOD_SETS for i, method in enumerate(("odin", "eloc", "mcd"))]
UNOFFICIAL_ROWS: list[dict] = [
    {"source": "unofficial reproduction", "id_dataset": "cifar10", "model": "densenet", "ood": "TINr",
     "method": "mcd", "auroc": 99.83, "auroc_std": 0.03, "runs": 3}]

OPENOOD_SOURCE = ("OpenOOD v1.5 leaderboard results files (2025): ResNet-18, outlier data disjoint from the test "
                  "sets, AUROC in % on its near-OOD and far-OOD groups")
"""Where :data:`OPENOOD_ROWS` come from. Context only: other data (CIFAR), another network and
OpenOOD's own protocol, so no row here is comparable to a Fashion-MNIST number one to one."""
OPENOOD_ROWS: list[dict] = [
    {"id_dataset": "cifar10", "method": "mcd", "near_auroc": 91.03, "far_auroc": 91.00, "id_accuracy": 94.95},
    {"id_dataset": "cifar10", "method": "msp", "near_auroc": 88.03, "far_auroc": 90.73},
    {"id_dataset": "cifar10", "method": "energy", "near_auroc": 87.58, "far_auroc": 91.21},
    {"id_dataset": "cifar10", "method": "oe", "near_auroc": 94.82, "far_auroc": 96.00},
    {"id_dataset": "cifar100", "method": "mcd", "near_auroc": 77.07, "far_auroc": 74.72},
    {"id_dataset": "cifar100", "method": "msp", "near_auroc": 80.27, "far_auroc": 77.76},
]
"""OpenOOD v1.5's AUROC (%) of MCD and its peers (``oe``: outlier exposure); ID accuracy where
given. From :data:`OPENOOD_SOURCE`."""

# Our OOD set names for the paper's: ODIN's folder names (mcd_helpers.data.cifar).
CIFAR_OOD_NAMES = {"TINc": "Imagenet", "TINr": "Imagenet_resize", "LSUNc": "LSUN", "LSUNr": "LSUN_resize",
                   "iSUN": "iSUN"}
# On CPU, Fashion-MNIST stands in for CIFAR-10; only the crop sets have an analog among the
# offline OOD sets: random crops of natural photos (sklearn's sample images).
FMNIST_ANALOGS = {"TINc": "photo_crops", "LSUNc": "photo_crops"}


def paper_rows(method: str | None = None) -> list[dict]:
    """The paper's reported rows (copies), optionally only one method (``odin``, ``eloc``, ``mcd``).

    Raises:
        ValueError: on an unknown method.
    """
    if method is not None and method not in ("odin", "eloc", "mcd"):
        raise ValueError(f"method must be 'odin', 'eloc' or 'mcd', got {method!r}.")
    return [dict(r) for r in PAPER_ROWS if method is None or r["method"] == method]


def beside_paper(ours: Sequence[dict], id_dataset: str = "cifar10",
                 ood_names: Mapping[str, str] | None = None, methods: Sequence[str] = ("odin", "mcd"),
                 strategy: str | None = "separate") -> list[dict]:
    """Put our result rows beside the paper's, one row per (paper OOD set, method, metric).

    Args:
        ours: result rows (metrics as fractions) with ``id_dataset``, ``ood_dataset``, ``method``
            and ``strategy`` keys, e.g. from :func:`mcd_helpers.experiments.benchmark.run_benchmark`.
        id_dataset: our ID set to match (``cifar10`` for a faithful rerun, ``fashion_mnist``
            for the CPU stand-in).
        ood_names: paper OOD name -> our OOD set name; default :data:`CIFAR_OOD_NAMES` for CIFAR
            and :data:`FMNIST_ANALOGS` otherwise. Paper sets without a name get ``ours = NaN``.
        methods: our methods to compare with the paper's columns of the same name.
        strategy: the MCD strategy to take from ``ours`` (ignored for the baselines).

    Returns:
        rows ``{"ood", "ours_ood", "method", "metric", "paper", "ours", "gap"}``; ``paper`` and
        ``ours`` in %, ``gap = ours - paper`` in percentage points (NaN where a side is missing).

    Raises:
        ValueError: if ``ours`` holds two rows for the same (ID, OOD, method, strategy)
            (average seeds first), or on a method the paper does not report.
    """
    bad = [m for m in methods if m not in ("odin", "eloc", "mcd")]
    if bad:
        raise ValueError(f"the paper reports odin, eloc and mcd; cannot compare {bad}.")
    if ood_names is None:
        ood_names = CIFAR_OOD_NAMES if id_dataset in ("cifar10", "cifar100") else FMNIST_ANALOGS
    index: dict[tuple, dict] = {}
    for r in ours:
        if r["id_dataset"] != id_dataset or (r["method"] == "mcd" and r.get("strategy") != strategy):
            continue
        key = (r["ood_dataset"], r["method"])
        if key in index:
            raise ValueError(f"two result rows for {key} with strategy {strategy!r}; average the seeds "
                             "first (one row per OOD set and method).")
        index[key] = r
    out = []
    for p in PAPER_ROWS:
        if p["method"] not in methods:
            continue
        ours_ood = ood_names.get(p["ood"])
        mine = index.get((ours_ood, p["method"]))
        for k in PAPER_METRICS:
            ours_pct = 100.0 * mine[k] if mine is not None else _NAN
            out.append({"ood": p["ood"], "ours_ood": ours_ood, "method": p["method"], "metric": k,
                        "paper": p[k], "ours": ours_pct, "gap": ours_pct - p[k]})
    return out


def _fmt(v: float, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table; the first column left-aligned, the others right-aligned."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(map(str, header)) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def beside_paper_markdown(comparison: Sequence[dict], ours_label: str = "ours", paired_only: bool = False) -> str:
    """One line per (paper OOD set, metric): the paper's ODIN / ELOC / MCD, ours, and the gaps (%).

    ``paired_only=True`` leaves out the lines where we have no number at all (all of ours and the
    gaps "–"), e.g. the paper's sets without an analog on the Fashion-MNIST stand-in; a note
    below the table names them.
    """
    by = {(c["ood"], c["method"], c["metric"]): c for c in comparison}
    methods = [m for m in ("odin", "mcd") if any(k[1] == m for k in by)]
    header = ["OOD (paper)", f"OOD ({ours_label})", "metric", "ODIN", "ELOC", "MCD"]
    header += [f"{ours_label} {m.upper()}" for m in methods] + [f"gap {m.upper()}" for m in methods]
    rows, dropped = [], []
    for ood in PAPER_OOD_SETS:
        for k in PAPER_METRICS:
            paper = {p["method"]: p[k] for p in PAPER_ROWS if p["ood"] == ood}
            mine = [by.get((ood, m, k)) for m in methods]
            if paired_only and not any(c and np.isfinite(c["ours"]) for c in mine):
                dropped.append(ood)
                continue
            ours_ood = next((c["ours_ood"] for c in mine if c and c["ours_ood"]), None) or "–"
            rows.append([ood, ours_ood, _LABELS[k], _fmt(paper["odin"]), _fmt(paper["eloc"]), _fmt(paper["mcd"])]
                        + [_fmt(c["ours"]) if c else "–" for c in mine]
                        + [_fmt(c["gap"], signed=True) if c else "–" for c in mine])
    note = ("\n\nAll numbers in %; gap = ours − paper in percentage points (AUROC: higher is better; "
            "FPR95 and detection error: lower is better). Paper: " + PAPER_SOURCE + ".")
    if dropped:
        note += (f" Not shown: the paper's rows for {', '.join(dict.fromkeys(dropped))}, which have no "
                 f"counterpart in our run.")
    return markdown_table(header, rows) + note


def plot_beside_paper(comparison: Sequence[dict], title: str = "", ours_label: str = "ours"):
    """Bars per paper OOD set and metric: the paper's MCD (and ODIN) against ours.

    Returns:
        the matplotlib ``Figure`` (one panel per metric, values in %).
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PAPER_METRICS), figsize=(4.6 * len(PAPER_METRICS), 4.3))
    x = np.arange(len(PAPER_OOD_SETS))
    series = [("paper ODIN", "odin", "paper", "#9ecae1"), ("paper MCD", "mcd", "paper", "#3182bd"),
              (f"{ours_label} ODIN", "odin", "ours", "#fdae6b"), (f"{ours_label} MCD", "mcd", "ours", "#e6550d")]
    width = 0.8 / len(series)
    for ax, k in zip(axes, PAPER_METRICS):
        for j, (label, method, side, color) in enumerate(series):
            vals = [next((c[side] for c in comparison if c["ood"] == o and c["method"] == method
                          and c["metric"] == k), _NAN) for o in PAPER_OOD_SETS]
            ax.bar(x + (j - 1.5) * width, vals, width, label=label, color=color)
        ax.set_xticks(x, PAPER_OOD_SETS)
        better = "higher" if k == "auroc" else "lower"
        ax.set(title=f"{_LABELS[k]} ({better} is better)", xlabel="OOD set (paper's name)", ylabel=f"{_LABELS[k]} (%)")
        if k == "auroc":
            finite = [c[s] for c in comparison for s in ("paper", "ours") if c["metric"] == k and np.isfinite(c[s])]
            ax.set_ylim(max(0.0, min(finite, default=90.0) - 2.0), 100.5)
    # One legend for all panels, below them, where it covers no bar.
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(series), fontsize=9, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
