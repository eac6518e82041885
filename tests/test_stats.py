"""Confidence intervals and paired differences against hand computations and scipy; tables and figures read back."""
import math

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from scipy import stats as st

from mcd_helpers.experiments.stats import forest_plot, mean_ci, paired_differences, plot_by_protocol, summarize, summary_markdown

matplotlib.use("Agg")

T975_DF4 = 2.7764451051977934  # Student t quantiles (any table): t_{0.975, 4}, t_{0.975, 2}, t_{0.95, 4}
T975_DF2 = 4.302652729749462
T95_DF4 = 2.1318467863266495


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---- mean_ci -----------------------------------------------------------------------------------

def test_mean_ci_by_hand():
    ci = mean_ci([1, 2, 3, 4, 5])
    half = T975_DF4 * math.sqrt(2.5) / math.sqrt(5)  # s^2 = (4+1+0+1+4)/4 = 2.5
    assert half == pytest.approx(1.9632, abs=1e-4)
    assert ci == pytest.approx({"mean": 3.0, "low": 3 - half, "high": 3 + half, "half_width": half, "n": 5},
                               rel=1e-12)
    assert mean_ci(np.array([1, 2, 3, 4, 5]), confidence=0.90)["half_width"] == pytest.approx(
        T95_DF4 * math.sqrt(2.5 / 5), rel=1e-12)
    assert mean_ci([0.7, 0.7, 0.7])["half_width"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("values, kw, match", [
    ([0.5], {}, "at least 2 values .*got 1"),
    ([], {}, "got 0"),
    ([0.5, float("nan"), 0.6], {}, "1 NaN or inf value.*first at index 1"),
    ([0.5, 0.6], {"confidence": 95}, r"fraction in \(0, 1\), got 95 \(did you mean 0.95\?\)"),
    ([0.5, 0.6], {"confidence": 0.0}, "fraction"),
])
def test_mean_ci_errors(values, kw, match):
    with pytest.raises(ValueError, match=match):
        mean_ci(values, **kw)


# ---- paired differences -----------------------------------------------------------------------

def row(strategy, seed, auroc, method="mcd", protocol="disjoint", **kw):
    return {"task": "fmnist", "class_split": "a", "protocol": protocol, "selection": "last-epoch",
            "method": method, "strategy": strategy, "seed": seed, "auroc": auroc, **kw}


HAND = ([row("concat", s, v) for s, v in zip((2, 0, 1), (0.95, 0.90, 0.85))]
        + [row("separate", s, v) for s, v in zip((1, 2, 0), (0.86, 0.91, 0.88))])
# seed 0: 0.90 - 0.88 = 0.02; seed 1: 0.85 - 0.86 = -0.01; seed 2: 0.95 - 0.91 = 0.04


def test_paired_differences_by_hand():
    (d,) = paired_differences(HAND + [row("group-norm", 0, 0.5), row("none", 0, 0.6, method="msp")])
    assert d["seeds"] == [0, 1, 2] and d["diffs"] == pytest.approx([0.02, -0.01, 0.04], abs=1e-12)
    s = math.sqrt(((0.02 - 1 / 60) ** 2 + (-0.01 - 1 / 60) ** 2 + (0.04 - 1 / 60) ** 2) / 2)
    half = T975_DF2 * s / math.sqrt(3)
    assert (d["mean"], d["half_width"], d["low"], d["high"], d["n"]) == pytest.approx(
        (1 / 60, half, 1 / 60 - half, 1 / 60 + half, 3), rel=1e-9)
    t = (1 / 60) / (s / math.sqrt(3))
    assert d["p_value"] == pytest.approx(2 * st.t.sf(t, 2), rel=1e-9)
    assert d["p_value"] == pytest.approx(st.ttest_rel([0.90, 0.85, 0.95], [0.88, 0.86, 0.91]).pvalue, rel=1e-12)
    assert {k: d[k] for k in ("task", "class_split", "protocol", "selection", "method", "metric", "a", "b")} == {
        "task": "fmnist", "class_split": "a", "protocol": "disjoint", "selection": "last-epoch", "method": "mcd",
        "metric": "auroc", "a": "concat", "b": "separate"}


def test_paired_differences_against_scipy_on_random_groups():
    rng = np.random.RandomState(0)
    rows = []
    for protocol in ("transductive", "disjoint", "unseen-ood"):
        for seed in range(6):
            a, b = rng.uniform(0.6, 0.95), rng.uniform(0.6, 0.95)
            rows += [row("concat", seed, a, protocol=protocol, fpr95=1 - a),
                     row("separate", seed, b, protocol=protocol, fpr95=1 - b)]
    out = paired_differences(rows, metric="fpr95")
    assert [d["protocol"] for d in out] == ["transductive", "disjoint", "unseen-ood"]
    for d in out:
        xa = [r["fpr95"] for r in rows if r["protocol"] == d["protocol"] and r["strategy"] == "concat"]
        xb = [r["fpr95"] for r in rows if r["protocol"] == d["protocol"] and r["strategy"] == "separate"]
        assert d["p_value"] == pytest.approx(st.ttest_rel(xa, xb).pvalue, rel=1e-10)
        assert d["mean"] == pytest.approx(np.mean(np.subtract(xa, xb)), abs=1e-15)
        assert (d["p_value"] < 0.05) == (d["low"] > 0 or d["high"] < 0)  # t-test and CI agree


def test_paired_differences_equal_diffs_have_no_p():
    rows = [row("concat", s, 0.9) for s in range(3)] + [row("separate", s, 0.8) for s in range(3)]
    (d,) = paired_differences(rows)
    assert d["half_width"] == pytest.approx(0.0, abs=1e-12) and math.isnan(d["p_value"])


@pytest.mark.parametrize("rows, match", [
    (HAND + [row("concat", 3, 0.9)], r"unmatched seeds in group .*protocol=disjoint.*seeds \[3\] only for 'concat'"),
    (HAND[:3] + [row("separate", 7, 0.9), row("separate", 8, 0.9), row("separate", 9, 0.9)],
     r"seeds \[0, 1, 2\] only for 'concat', seeds \[7, 8, 9\] only for 'separate'"),
    (HAND + [row("separate", 0, 0.5)], "seed 0 appears twice for strategy 'separate'"),
    ([row("concat", 0, 0.9), row("separate", 0, 0.8)], "group .*method=mcd: a confidence interval needs at least 2"),
    (HAND + [{"strategy": "concat", "seed": 9, "auroc": 0.9}], r"row 6 has no field\(s\) \['task'"),
    (HAND + [{"task": "x"}], r"row 6 has no field\(s\) \['strategy', 'seed'\]"),
    ([row("concat", 0, None)], "row 0 has no value for metric 'auroc'"),
    (HAND[:3] + [row("separate", s, float("nan")) for s in range(3)], "NaN or inf"),
])
def test_paired_differences_errors(rows, match):
    with pytest.raises(ValueError, match=match):
        paired_differences(rows)


# ---- summaries and the markdown tables ----------------------------------------------------------

def test_summarize_and_markdown():
    rows = [dict(r, fpr95=0.5, id_accuracy=0.9 + 0.01 * r["seed"]) for r in HAND]
    summary = summarize(rows)
    assert [(g["strategy"], g["n"]) for g in summary] == [("concat", 3), ("separate", 3)]
    concat = summary[0]
    assert concat["auroc"]["mean"] == pytest.approx(0.9)
    assert concat["auroc"]["half_width"] == pytest.approx(T975_DF2 * 0.05 / math.sqrt(3), rel=1e-9)  # s = 0.05
    assert concat["fpr95"]["half_width"] == 0.0
    md = summary_markdown(summary, paired_differences(rows))
    # AUROC 90.00 ± 100 * 4.3027 * 0.05 / sqrt(3) = 12.42; ID acc. 91.00 ± 100 * 4.3027 * 0.01 / sqrt(3) = 2.48
    assert "| fmnist | a | disjoint | last-epoch | mcd | concat | 3 | 90.00 ± 12.42 | 50.00 ± 0.00 | 91.00 ± 2.48 |" in md
    assert "| AUROC (%) | FPR95 (%) | ID acc. (%) |" in md
    # paired: mean 1.67 pp, half width 100 * 4.3027 * 0.025166 / sqrt(3) = 6.25, p = 0.37
    assert "| mcd | AUROC | concat − separate | 3 | 1.67 ± 6.25 | [-4.58, 7.92] | 0.37 |" in md
    assert "percentage points" in md and "Student t" in md


def test_summarize_errors():
    with pytest.raises(ValueError, match="group .*strategy=concat, auroc: a confidence interval needs at least 2"):
        summarize(HAND[:1] + HAND[3:], metrics=("auroc",))
    with pytest.raises(ValueError, match="row 0 has no value for metric 'fpr95'"):
        summarize(HAND)


# ---- figures, read back from the Axes ----------------------------------------------------------

def paired_three_protocols():
    rows = []
    for k, protocol in enumerate(("transductive", "disjoint", "unseen-ood")):
        for seed, (a, b) in enumerate([(0.90, 0.88), (0.85, 0.86), (0.95, 0.91 - 0.01 * k)]):
            rows += [row("concat", seed, a, protocol=protocol), row("separate", seed, b, protocol=protocol)]
    return rows, paired_differences(rows)


def test_forest_plot_rows_and_x_data_are_the_diffs():
    _, paired = paired_three_protocols()
    fig = forest_plot(paired)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["transductive", "disjoint", "unseen-ood"]
    points, _, (bars,) = ax.containers[0].lines  # errorbar: data line, caps, CI bars
    np.testing.assert_allclose(np.asarray(points.get_xdata(), float), [100 * d["mean"] for d in paired], rtol=1e-12)
    np.testing.assert_allclose([s[:, 0] for s in bars.get_segments()],
                               [[100 * d["low"], 100 * d["high"]] for d in paired], rtol=1e-12)
    assert any(list(line.get_xdata()) == [0, 0] for line in ax.lines)  # the vertical line at 0
    assert "percentage points" in ax.get_xlabel() and "concat − separate" in ax.get_xlabel()
    with pytest.raises(ValueError, match=r"no paired differences for metric 'fpr95'; available: \['auroc'\]"):
        forest_plot(paired, metric="fpr95")


def test_plot_by_protocol():
    rows, _ = paired_three_protocols()
    summary = summarize(rows, metrics=("auroc",))
    fig = plot_by_protocol(summary)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["transductive", "disjoint", "unseen-ood"]
    assert ax.get_ylabel() == "AUROC (%)" and ax.get_xlabel() == "evaluation protocol"
    assert len(ax.containers) == 2  # one series per strategy
    for container, strategy in zip(ax.containers, ("concat", "separate")):
        want = [100 * g["auroc"]["mean"] for g in summary if g["strategy"] == strategy]
        np.testing.assert_allclose(np.asarray(container.lines[0].get_ydata(), float), want, rtol=1e-12)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["concat", "separate"]
    with pytest.raises(ValueError, match="no summary entry holds metric 'fpr95'"):
        plot_by_protocol(summary, metric="fpr95")
