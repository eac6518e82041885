"""The paper's reported numbers, and our results beside them with the gap per metric.

Every number here is copied from a source, in % (the paper's unit; our rows hold fractions,
multiplied by 100 here). The gap is ``ours - paper`` in percentage points: for AUROC a negative gap
means we are worse, for FPR95 and detection error a positive one does.

* :data:`PAPER_ROWS`, :data:`PAPER_SOURCE`: Yu & Aizawa, ICCV 2019 (arXiv 1908.04951), the results
  table for DenseNet-BC (L = 100, k = 12) with CIFAR-10 as ID, ODIN / ELOC / MCD, as the project's
  reference notes transcribe it; the paper's PDF was not opened offline (nor the table's number):
  check arXiv 1908.04951 before citing a row.
* :data:`UNOFFICIAL_ROWS`: the unofficial reproduction's AUROC on TINr, the one run a figure of its
  README prints (``Test AUROC: 0.999``). An "AUROC 99.83 ± 0.03 over 3 runs" once attributed to it
  appears in no figure of that README (checked 2026-12-07) and is not used.
* :data:`OPENOOD_ROWS`: OpenOOD v1.5's leaderboard results files (2025), ResNet-18, outlier data
  disjoint from the test sets: context for the benchmark's protocols, not a like-for-like row.
"""

from typing import Mapping, Sequence

import numpy as np

from ..data import ODIN_ARCHIVES
from ..tables import METRIC_NAMES, markdown_table

PAPER_SOURCE = (
    "Yu & Aizawa, ICCV 2019 (arXiv 1908.04951), the paper's results table for DenseNet-BC, "
    "CIFAR-10 as ID, as the project's reference notes transcribe it (the PDF not opened offline)"
)
UNOFFICIAL_SOURCE = (
    "the unofficial reproduction, "
    "github.com/Mephisto405/Unsupervised-Out-of-Distribution-Detection-"
    "by-Maximum-Classifier-Discrepancy (a figure of its README)"
)
OPENOOD_SOURCE = (
    "OpenOOD v1.5 leaderboard results files (2025): ResNet-18, outlier data disjoint from "
    "the test sets, AUROC in % on its near-OOD and far-OOD groups"
)
PAPER_METRICS = ("fpr95", "detection_error", "auroc")
_NAN = float("nan")
_TABLE = {  # OOD -> metric -> (ODIN, ELOC, MCD), %; "-" in the paper (ELOC on iSUN) is NaN
    "TINc": {
        "fpr95": (3.6, 1.5, 0.1),
        "detection_error": (4.2, 3.0, 0.7),
        "auroc": (99.2, 99.6, 99.9),
    },
    "TINr": {
        "fpr95": (10.1, 3.2, 1.7),
        "detection_error": (6.9, 4.0, 2.3),
        "auroc": (98.2, 99.3, 99.6),
    },
    "LSUNc": {
        "fpr95": (6.0, 3.4, 0.2),
        "detection_error": (5.3, 4.1, 0.7),
        "auroc": (98.7, 99.3, 99.9),
    },
    "LSUNr": {
        "fpr95": (3.5, 1.4, 0.4),
        "detection_error": (4.2, 2.7, 1.1),
        "auroc": (99.2, 99.6, 99.9),
    },
    "iSUN": {
        "fpr95": (5.9, _NAN, 0.6),
        "detection_error": (5.3, _NAN, 1.3),
        "auroc": (98.9, _NAN, 99.9),
    },
}
PAPER_ROWS = [
    {
        "source": "paper",
        "id_dataset": "cifar10",
        "model": "densenet_bc_100",
        "ood": ood,
        "method": method,
        **{k: _TABLE[ood][k][i] for k in PAPER_METRICS},
    }
    for ood in _TABLE
    for i, method in enumerate(("odin", "eloc", "mcd"))
]
UNOFFICIAL_ROWS = [
    {
        "source": "unofficial reproduction",
        "id_dataset": "cifar10",
        "model": "densenet",
        "ood": "TINr",
        "method": "mcd",
        "auroc": 99.9,  # "Test AUROC: 0.999", three digits
        "runs": 1,
    }
]
OPENOOD_ROWS = [
    # oe: outlier exposure
    {"id_dataset": id_set, "method": method, "near_auroc": near, "far_auroc": far}
    for id_set, method, near, far in (
        ("cifar10", "mcd", 91.03, 91.00),
        ("cifar10", "msp", 88.03, 90.73),
        ("cifar10", "energy", 87.58, 91.21),
        ("cifar10", "oe", 94.82, 96.00),
        ("cifar100", "mcd", 77.07, 74.72),
        ("cifar100", "msp", 80.27, 77.76),
    )
]
OPENOOD_ROWS[0]["id_accuracy"] = 94.95  # the CIFAR-10 MCD row also gives the ID accuracy (%)
# TINc -> Imagenet, ...
CIFAR_OOD_NAMES = {paper: ours for ours, (_, _, paper) in ODIN_ARCHIVES.items()}
# crops of natural photos: the only offline analog
FMNIST_ANALOGS = {"TINc": "photo_crops", "LSUNc": "photo_crops"}


def beside_paper(
    ours: Sequence[dict],
    id_dataset: str = "cifar10",
    ood_names: Mapping[str, str] | None = None,
    methods: Sequence[str] = ("odin", "mcd"),
    strategy: str = "separate",
) -> list[dict]:
    """Our rows (fractions) beside the paper's: a row per (paper OOD set, method, metric)
    ``{"ood", "ours_ood", "method", "metric", "paper", "ours", "gap"}`` in % (NaN where a side is
    missing).

    ``ood_names``: paper OOD name -> ours (default :data:`CIFAR_OOD_NAMES`, or
    :data:`FMNIST_ANALOGS` off CIFAR).

    Raises:
        ValueError: a method the paper does not report, or two rows for one (OOD set, method):
        average seeds first.
    """
    if unknown := sorted(set(methods) - {"odin", "eloc", "mcd"}):
        raise ValueError(f"the paper reports odin, eloc and mcd; cannot compare {unknown}.")
    ood_names = ood_names or (CIFAR_OOD_NAMES if id_dataset.startswith("cifar") else FMNIST_ANALOGS)
    index: dict[tuple, dict] = {}
    for r in ours:
        if r["id_dataset"] == id_dataset and (
            r["method"] != "mcd" or r.get("strategy") == strategy
        ):
            if (r["ood_dataset"], r["method"]) in index:
                raise ValueError(
                    f"two result rows for {(r['ood_dataset'], r['method'])}; average the "
                    "seeds first."
                )
            index[(r["ood_dataset"], r["method"])] = r
    pairs = [
        (p, index.get((ood_names.get(p["ood"]), p["method"])))
        for p in PAPER_ROWS
        if p["method"] in methods
    ]
    out = [
        {
            "ood": p["ood"],
            "ours_ood": ood_names.get(p["ood"]),
            "method": p["method"],
            "metric": k,
            "paper": p[k],
            "ours": 100.0 * mine[k] if mine is not None else _NAN,
        }
        for p, mine in pairs
        for k in PAPER_METRICS
    ]
    return [{**c, "gap": c["ours"] - c["paper"]} for c in out]


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None or np.isnan(value) else format(value, spec)


def beside_paper_markdown(
    comparison: Sequence[dict], ours_label: str = "ours", paired_only: bool = False
) -> str:
    """A line per row of :func:`beside_paper` (paper OOD set, method, metric): the paper's number,
    ours and the gap (%); ``paired_only`` leaves out the lines where we have no number (a note names
    their OOD sets)."""
    shown = [c for c in comparison if not paired_only or np.isfinite(c["ours"])]
    rows = [
        [
            c["ood"],
            c["ours_ood"] or "–",
            c["method"].upper(),
            METRIC_NAMES[c["metric"]],
            _fmt(c["paper"]),
            _fmt(c["ours"]),
            _fmt(c["gap"], "+.2f"),
        ]
        for c in shown
    ]
    note = (
        "\n\nAll numbers in %; gap = ours − paper in percentage points (AUROC: higher is "
        f"better; FPR95 and detection error: lower is better). Paper: {PAPER_SOURCE}."
    )
    if dropped := [
        o for o in dict.fromkeys(c["ood"] for c in comparison) if o not in {c["ood"] for c in shown}
    ]:
        note += (
            f" Not shown: the paper's rows for {', '.join(dropped)}, which have no counterpart "
            "in our run."
        )
    return (
        markdown_table(
            ["OOD (paper)", f"OOD ({ours_label})", "method", "metric", "paper", ours_label, "gap"],
            rows,
            "llllrrr",
        )
        + note
    )
