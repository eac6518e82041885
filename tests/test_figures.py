"""mcd_helpers.experiments.figures: the benchmark's figures read back from their Axes (labels, the
data drawn), against values by hand."""

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest

from mcd_helpers.experiments.figures import forest_plot, plot_by_protocol, split_forest
from mcd_helpers.experiments.significance import GROUP_KEYS, paired_differences, summarize

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def xy(line):
    return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)


def prow(strategy, seed, auroc, protocol, split="a"):
    return {
        "task": "near-ood",
        "class_split": split,
        "protocol": protocol,
        "selection": "last-epoch",
        "method": "mcd",
        "strategy": strategy,
        "seed": seed,
        "auroc": auroc,
    }


def three_protocols(strategies=("concat", "separate")):
    rng = np.random.RandomState(0)
    return [
        prow(s, seed, rng.uniform(0.7, 0.95), p)
        for p in ("unseen-ood", "transductive", "disjoint")
        for seed in range(3)
        for s in strategies
    ]


def test_forest_plot_draws_each_difference_and_its_interval():
    paired = paired_differences(three_protocols())
    (ax,) = forest_plot(paired).axes
    # what varies
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "unseen-ood",
        "transductive",
        "disjoint",
    ]
    # errorbar: the points, the caps, the interval segments
    points, _, (bars,) = ax.containers[0].lines
    assert np.asarray(points.get_xdata(), float) == pytest.approx(
        [100 * d["mean"] for d in paired], rel=1e-12
    )
    np.testing.assert_allclose(
        [s[:, 0] for s in bars.get_segments()],
        [[100 * d["low"], 100 * d["high"]] for d in paired],
        rtol=1e-12,
    )
    assert any(xy(line)[0].tolist() == [0, 0] for line in ax.lines)  # the vertical line at 0
    assert (ax.get_xlabel(), ax.get_ylabel()) == (
        "concat − separate, AUROC (percentage points)",
        "protocol",
    )
    assert ax.get_title() == "Paired differences in AUROC (concat − separate, same seed)"
    assert ax.yaxis_inverted()  # the first group on top


def test_forest_plot_with_two_comparisons_names_each_and_refuses_a_missing_metric():
    rows = three_protocols(("concat", "separate", "split-bn"))
    paired = paired_differences(rows) + paired_differences(rows, "split-bn")
    (ax,) = forest_plot(paired, title="T").axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert (
        labels[0] == "concat − separate: unseen-ood"
        and labels[3] == "split-bn − separate: unseen-ood"
    )
    assert (
        ax.get_xlabel() == "strategy − separate, AUROC (percentage points)"
        and ax.get_title() == "T"
    )
    with pytest.raises(ValueError, match=r"'fpr95'.*\['auroc'\]"):
        forest_plot(paired, metric="fpr95")


def test_forest_plot_labels_are_words_without_empty_fields():
    # the primary endpoint's layout: one class split, a constant empty "dose", pairs against two
    # different strategies
    rows = [
        {**r, "dose": ""}
        for r in three_protocols(("concat", "separate", "eval-bn"))
        if r["protocol"] == "disjoint"
    ]
    paired = paired_differences(rows) + paired_differences(rows, "separate", "eval-bn")
    (ax,) = forest_plot(paired).axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["concat − separate", "separate − eval-bn"]
    assert ax.get_xlabel() == "difference between strategies, AUROC (percentage points)"
    assert ax.get_ylabel() == "comparison"
    keys = (*GROUP_KEYS, "dose")
    dosed = [{**r, "dose": f"finetune_epochs={n}"} for n in (1, 16) for r in rows]
    (ax,) = forest_plot(paired_differences(dosed, keys=keys)).axes
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "finetune epochs 1",
        "finetune epochs 16",
    ]
    assert (ax.get_xlabel(), ax.get_ylabel()) == (
        "concat − separate, AUROC (percentage points)",
        "setting",
    )


def test_split_forest_sorts_the_splits_and_draws_the_random_effect_by_hand():
    from scipy import stats

    effect = {
        "s1": [1.0, 2.0, 3.0],
        "s2": [5.0, 6.0, 10.0],
        "s3": [-1.0, 0.0, 0.5],
        "s4": [2, 2, 5],
    }
    rows = [
        {**prow(strategy, seed, 0.8 + (d / 100 if strategy == "concat" else 0), "disjoint", split)}
        for split, diffs in effect.items()
        for seed, d in enumerate(diffs)
        for strategy in ("concat", "separate")
    ]
    selected = [{**r, "class_split": "a"} for r in rows if r["class_split"] == "s2"]
    (ax,) = split_forest(rows, selected).axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    # the selected split on top, the random splits from the largest effect down, the average last
    assert labels == [
        "split a: selected after a first look (3 seeds)",
        "s2 (3 seeds)",
        "s4 (3 seeds)",
        "s1 (3 seeds)",
        "s3 (3 seeds)",
        "average split (4 random splits, random effect)",
    ]
    # the diamond: the balanced one-way ANOVA's mean and its t interval, k - 1 df
    d = np.array(list(effect.values()))
    k, n = d.shape
    se = np.sqrt(n * d.mean(1).var(ddof=1) / (k * n))
    half = stats.t.ppf(0.975, k - 1) * se
    (diamond,) = ax.patches
    xs = diamond.get_xy()[:, 0]
    assert (xs.min(), xs.max()) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-9)
    assert ax.get_xlabel().startswith("concat − separate, AUROC points")
    assert ax.get_ylabel() == "class split: Fashion-MNIST classes ID / held out"


def test_plot_by_protocol_series_and_panels():
    summary = summarize(three_protocols(), metrics=("auroc",))
    fig = plot_by_protocol(summary)
    (ax,) = fig.axes
    # PROTOCOLS order, whatever the rows' order
    protocols = ["transductive", "disjoint", "unseen-ood"]
    assert [t.get_text() for t in ax.get_xticklabels()] == protocols
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "evaluation protocol",
        "AUROC (%)",
        "near-ood / a / last-epoch",
    )
    for j, (container, strategy) in enumerate(zip(ax.containers, ("concat", "separate"))):
        mine = [g for g in summary if g["strategy"] == strategy]
        x, y = xy(container.lines[0])
        assert x.tolist() == pytest.approx(
            [protocols.index(g["protocol"]) + (j - 0.5) * 0.4 for g in mine]
        )
        assert y.tolist() == pytest.approx([100 * g["auroc"]["mean"] for g in mine], rel=1e-12)
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [
        "concat",
        "separate",
    ] and legend.get_title().get_text() == "strategy"
    assert fig._suptitle.get_text() == "AUROC by protocol: mean and 95% CI over seeds"


def test_plot_by_protocol_one_panel_per_split_and_errors():
    rows = three_protocols() + [dict(r, class_split=s) for s in "bcd" for r in three_protocols()]
    fig = plot_by_protocol(summarize(rows, metrics=("auroc",)))
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == [
        f"near-ood / {s} / last-epoch" for s in "abcd"
    ]
    assert len(fig.axes) == 6  # 3 columns x 2 rows, the last two hidden
    with pytest.raises(ValueError, match=r"'fpr95'.*summarize\(\.\.\.\)"):
        plot_by_protocol(summarize(rows, metrics=("auroc",)), metric="fpr95")
