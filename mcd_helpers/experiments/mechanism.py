"""The mechanism study's analysis (``benchmarks/mechanism-plan.md``, preset ``mechanism``): why
concatenating wins under train-mode BatchNorm, from ``results.json``'s rows alone.

* :func:`estimands` -- the registered paired differences E1-E3 per dose, each with the mean and its
  t interval, the sign test, TOST at ±1 point, the median and the Hodges-Lehmann shift;
* :func:`arm_table` -- per arm and evaluation statistics: mean AUROC, median, ID accuracy and the
  collapse rate (AUROC below :data:`COLLAPSE`, registered);
* :func:`mechanism_markdown` -- both as the tables docs/near-ood.md and notebook 08 show.

Values are fractions in the rows and percentage points in the tables.
"""

from typing import Sequence

import numpy as np
from statsmodels.stats.multitest import multipletests

from ..tables import markdown_table
from .significance import (
    EQUIVALENCE,
    collapse_rate,
    endpoint_tests,
    hodges_lehmann,
)

# the registered collapse threshold: a run whose AUROC is below 75%
COLLAPSE = 0.75
ARMS = ("separate", "concat", "interleave", "separate-detached", "concat-detached")
# The evaluation statistics the tables and the figure show. The registered run also evaluated
# "recalibrated-unlabeled" and "recalibrated-mixture", but drew their images in the pool's stored
# order, ID first (stages.recalibration_images, fixed after the run): its "unlabeled pool" batches
# were pure ID, then pure OOD, and its "mixture" held no OOD image. Their rows stay in
# results.json and are left out here.
EVAL_STATS = ("running", "recalibrated")
# each evaluation statistics in words (tables and figures)
EVAL_STATS_WORDS = {
    "running": "running (the network's own)",
    "recalibrated": "recalibrated on labeled ID images",
}
# (name, a, b): the registered estimands, a - b; E1 and E2 are the primary family (Holm)
ESTIMANDS = (
    ("E1", "interleave", "separate"),
    ("E2", "concat", "interleave"),
    ("E3", "concat-detached", "separate-detached"),
    ("concat − separate", "concat", "separate"),
)


def _mcd(rows: Sequence[dict], dose: str, eval_stats: str = "running") -> list[dict]:
    return [
        r
        for r in rows
        if r["method"] == "mcd"
        and r.get("dose") == dose
        and r.get("eval_stats", "running") == eval_stats
    ]


def doses(rows: Sequence[dict]) -> list[str]:
    """The study's doses in run order (``unlabeled_ood_fraction=1.0`` first)."""
    return list(dict.fromkeys(r["dose"] for r in rows if r.get("dose")))


def estimands(rows: Sequence[dict], dose: str, eval_stats: str = "running") -> list[dict]:
    """The registered differences of :data:`ESTIMANDS` at ``dose`` (AUROC, paired by seed): each
    :func:`~mcd_helpers.experiments.significance.endpoint_tests` entry (mean, t interval, p, sign
    test, TOST at ±1 point; ``holm_p`` Holm-adjusted over E1 and E2, NaN for the others) with
    ``name``, ``median``, ``hl``, ``hl_low``, ``hl_high``
    (:func:`~mcd_helpers.experiments.significance.hodges_lehmann`).

    Raises:
        ValueError: an arm missing at that dose (``endpoint_tests``), or rows of more than one
        task, class split, protocol or selection.
    """
    found = endpoint_tests(
        _mcd(rows, dose, eval_stats), [(a, b, "auroc", eval_stats) for _, a, b in ESTIMANDS]
    )
    if len(found) != len(ESTIMANDS):
        raise ValueError(
            f"the mechanism rows at {dose} hold {len(found)} groups for {len(ESTIMANDS)} "
            "estimands; pass the rows of one task, class split, protocol and selection."
        )
    tests = {(t["a"], t["b"]): t for t in found}
    family = [tests[a, b] for _, a, b in ESTIMANDS[:2]]
    holm = multipletests([t["p_value"] for t in family], method="holm")[1]
    adjusted = {(t["a"], t["b"]): float(p) for t, p in zip(family, holm)}
    return [
        {
            "name": name,
            **tests[a, b],
            "holm_p": adjusted.get((a, b), float("nan")),
            **hodges_lehmann(tests[a, b]["diffs"]),
        }
        for name, a, b in ESTIMANDS
    ]


def arm_table(rows: Sequence[dict], dose: str) -> list[dict]:
    """Per arm of :data:`ARMS` and evaluation statistics of :data:`EVAL_STATS` found at ``dose``:
    ``arm``, ``eval_stats``, ``n``, mean and median AUROC, mean ID accuracy, and the collapse rate
    (:func:`~mcd_helpers.experiments.significance.collapse_rate` below :data:`COLLAPSE`)."""
    out = []
    for stats_ in EVAL_STATS:
        mine = _mcd(rows, dose, stats_)
        for arm in ARMS:
            auroc = [r["auroc"] for r in mine if r["strategy"] == arm]
            if not auroc:
                continue
            accuracy = [r["id_accuracy"] for r in mine if r["strategy"] == arm]
            out.append(
                {
                    "arm": arm,
                    "eval_stats": stats_,
                    "n": len(auroc),
                    "mean": float(np.mean(auroc)),
                    "median": float(np.median(auroc)),
                    "id_accuracy": float(np.mean(accuracy)),
                    **collapse_rate(auroc, COLLAPSE),
                }
            )
    return out


def _pp(x: float, signed: bool = True) -> str:
    return f"{100 * x:{'+' if signed else ''}.2f}"


def _p(x: float) -> str:
    return "" if x != x else f"{x:.2g}"  # NaN: not in the family


def estimands_markdown(tests: Sequence[dict]) -> str:
    """The table of :func:`estimands`, in percentage points."""
    header = [
        "estimand",
        "a − b",
        "n",
        "mean [95% CI]",
        "p (t)",
        "Holm p",
        "sign p",
        f"TOST p (±{100 * EQUIVALENCE:.0f})",
        "median",
        "Hodges–Lehmann [95% CI]",
    ]
    lines = [
        [
            t["name"],
            f"{t['a']} − {t['b']}",
            t["n"],
            f"{_pp(t['mean'])} [{_pp(t['low'])}, {_pp(t['high'])}]",
            _p(t["p_value"]),
            _p(t["holm_p"]),
            _p(t["sign_p"]),
            _p(t["tost_p"]),
            _pp(t["median"]),
            f"{_pp(t['hl'])} [{_pp(t['hl_low'])}, {_pp(t['hl_high'])}]",
        ]
        for t in tests
    ]
    return markdown_table(header, lines, "lllrrrrrrr")


def arms_markdown(table: Sequence[dict]) -> str:
    """The table of :func:`arm_table`: AUROC mean / median (%) per arm, a column per evaluation
    statistics, then ID accuracy and the collapses with running statistics."""
    cell = {(e["arm"], e["eval_stats"]): e for e in table}
    found = [s for s in EVAL_STATS if any(k[1] == s for k in cell)]
    header = ["arm", *[f"AUROC, {EVAL_STATS_WORDS[s]} (mean / median)" for s in found]]
    header += ["ID accuracy, running (%)", f"AUROC < {100 * COLLAPSE:.0f}%, running [95% CI]"]
    lines = []
    for arm in (a for a in ARMS if (a, "running") in cell):
        run = cell[arm, "running"]
        values = [
            f"{_pp(cell[arm, s]['mean'], False)} / {_pp(cell[arm, s]['median'], False)}"
            for s in found
        ]
        collapses = (
            f"{run['collapsed']} of {run['n']} [{_pp(run['low'], False)}, "
            f"{_pp(run['high'], False)}]%"
        )
        lines.append([arm, *values, _pp(run["id_accuracy"], False), collapses])
    return markdown_table(header, lines, "l" + "r" * (len(header) - 1))


def dose_label(dose: str) -> str:
    """``unlabeled_ood_fraction=0.5`` -> ``unlabeled OOD images: 50% of the pool's``."""
    field, _, value = dose.partition("=")
    if field != "unlabeled_ood_fraction":
        return dose
    return f"unlabeled OOD images: {100 * float(value):.0f}% of the pool's"


def mechanism_markdown(rows: Sequence[dict]) -> str:
    """Per dose the estimands and the arms, as Markdown."""
    parts = []
    for dose in doses(rows):
        parts += [
            f"### {dose_label(dose)}",
            "Estimands (AUROC points, running statistics, paired by seed):",
            estimands_markdown(estimands(rows, dose)),
            "Arms under each evaluation statistics:",
            arms_markdown(arm_table(rows, dose)),
        ]
    return "\n\n".join(parts) + "\n"


def plot_mechanism(rows: Sequence[dict]):
    """The decomposition figure: per dose a panel, per arm of :data:`ARMS` its AUROC (%) under each
    evaluation statistics of :data:`EVAL_STATS`, mean over seeds with its 95% t interval, and every
    seed's value as a faint dot. Returns the ``Figure``.

    Raises:
        ValueError: no mechanism rows (no dose found).
    """
    import matplotlib.pyplot as plt

    from ..plots import finish_figure
    from .significance import mean_ci

    if not (found := doses(rows)):
        raise ValueError("no mechanism rows: pass the rows of benchmarks/results/mechanism.")
    fig, axes = plt.subplots(1, len(found), figsize=(6.5 * len(found), 4.2), squeeze=False)
    width = 0.8 / len(EVAL_STATS)
    for ax, dose in zip(axes[0], found):
        for j, stats_ in enumerate(EVAL_STATS):
            mine = _mcd(rows, dose, stats_)
            for i, arm in enumerate(ARMS):
                values = [100 * r["auroc"] for r in mine if r["strategy"] == arm]
                if len(values) < 2:
                    continue
                x = i + (j - (len(EVAL_STATS) - 1) / 2) * width
                ci = mean_ci(values)
                ax.plot([x] * len(values), values, ".", color=f"C{j}", alpha=0.25, ms=4)
                ax.errorbar(
                    x,
                    ci["mean"],
                    yerr=ci["half_width"],
                    fmt="o",
                    color=f"C{j}",
                    capsize=3,
                    label=EVAL_STATS_WORDS[stats_] if i == 0 else None,
                )
        ax.set_xticks(range(len(ARMS)), [a.replace("-", "-\n") for a in ARMS], fontsize=8)
        ax.set(ylabel="MCD AUROC (%)", title=dose_label(dose))
    axes[0][0].legend(title="evaluation statistics", fontsize=7, title_fontsize=7)
    return finish_figure(
        fig, "Which part of BatchNorm's coupling: each arm, mean and 95% CI over seeds"
    )
