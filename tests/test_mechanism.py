"""mcd_helpers.experiments.mechanism: the registered estimands and the arm table, against values
computed by hand from synthetic rows."""

import numpy as np
import pytest
from scipy import stats

from mcd_helpers.experiments.mechanism import (
    ARMS,
    arm_table,
    estimands,
    mechanism_markdown,
    plot_mechanism,
)

DOSE = "unlabeled_ood_fraction=1.0"
# AUROC per arm and seed (5 seeds): concat and interleave alike, separate lower, one collapse
AUROC = {
    "separate": [0.84, 0.86, 0.70, 0.85, 0.83],
    "concat": [0.90, 0.91, 0.89, 0.92, 0.90],
    "interleave": [0.905, 0.90, 0.895, 0.915, 0.90],
    "separate-detached": [0.85, 0.86, 0.84, 0.87, 0.85],
    "concat-detached": [0.89, 0.90, 0.88, 0.91, 0.89],
}


def rows():
    out = []
    for arm, values in AUROC.items():
        for seed, a in enumerate(values):
            for stats_, shift in (("running", 0.0), ("recalibrated", 0.01)):
                out.append(
                    {
                        "task": "near-ood",
                        "class_split": "a",
                        "protocol": "disjoint",
                        "selection": "last-epoch",
                        "method": "mcd",
                        "norm": "batch",
                        "dose": DOSE,
                        "strategy": arm,
                        "seed": 20 + seed,
                        "eval_stats": stats_,
                        "auroc": a + shift,
                        "id_accuracy": 0.9,
                    }
                )
    return out


def test_estimands_by_hand():
    got = {t["name"]: t for t in estimands(rows(), DOSE)}
    e1 = 100 * (np.array(AUROC["interleave"]) - np.array(AUROC["separate"]))
    e2 = 100 * (np.array(AUROC["concat"]) - np.array(AUROC["interleave"]))
    assert 100 * got["E1"]["mean"] == pytest.approx(e1.mean(), abs=1e-9)
    assert 100 * got["E2"]["median"] == pytest.approx(np.median(e2), abs=1e-9)
    # Holm over E1 and E2: the smaller p times 2, the larger at least that
    p = sorted([stats.ttest_1samp(e1, 0).pvalue, stats.ttest_1samp(e2, 0).pvalue])
    holm = sorted([got["E1"]["holm_p"], got["E2"]["holm_p"]])
    assert holm == pytest.approx([2 * p[0], max(2 * p[0], p[1])], rel=1e-9)
    assert np.isnan(got["E3"]["holm_p"]) and got["E2"]["tost_p"] < 0.05  # equivalent within ±1


def test_arm_table_counts_the_registered_collapses():
    table = {(e["arm"], e["eval_stats"]): e for e in arm_table(rows(), DOSE)}
    assert len(table) == 2 * len(ARMS)
    sep = table["separate", "running"]
    assert (sep["collapsed"], sep["n"]) == (1, 5)  # 0.70 < 0.75
    assert sep["median"] == pytest.approx(0.84) and table["concat", "running"]["collapsed"] == 0
    assert table["separate", "recalibrated"]["mean"] == pytest.approx(
        np.mean(AUROC["separate"]) + 0.01
    )
    text = mechanism_markdown(rows())
    assert "### unlabeled OOD images: 100% of the pool's" in text and "| 1 of 5 [" in text


def test_the_decomposition_figure_draws_each_arm_under_each_statistics_it_has():
    import matplotlib

    matplotlib.use("Agg")
    (ax,) = plot_mechanism(rows()).axes
    means = [c.lines[0].get_ydata()[0] for c in ax.containers]  # one errorbar per arm and stats
    assert len(means) == 2 * len(ARMS)
    assert means[0] == pytest.approx(100 * np.mean(AUROC["separate"]))  # running, first arm
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["running (the network's own)", "recalibrated on labeled ID images"]
    assert ax.get_title() == "unlabeled OOD images: 100% of the pool's"
    with pytest.raises(ValueError, match="no mechanism rows"):
        plot_mechanism([])


def test_the_flawed_evaluations_are_left_out_of_the_tables():
    flawed = [{**r, "eval_stats": "recalibrated-mixture"} for r in rows()]
    table = arm_table(rows() + flawed, DOSE)
    assert {e["eval_stats"] for e in table} == {"running", "recalibrated"}
