"""mcd_helpers.plots: every figure read back from its Axes (labels, titles, the data drawn), against
values by hand."""

from types import SimpleNamespace

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

from mcd_helpers.metrics import roc_points
from mcd_helpers.plots import plot_extremes, plot_history, plot_roc_curves, plot_score_histograms

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def auroc_by_pairs(s_id, s_ood):
    """P(OOD score > ID score) + 1/2 P(tie), over every pair."""
    return np.mean([(o > i) + 0.5 * (o == i) for i in s_id for o in s_ood])


def xy(line):
    return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)


def test_score_histograms_are_densities_on_shared_bins():
    s_id, s_ood = [0.0, 0.1, 0.2, 1.0], torch.tensor([0.9, 1.0, 0.6])
    fig = plot_score_histograms(
        {"MSP": (s_id, s_ood), "MCD": (np.array([0.1, 0.2]), [0.3, 0.4])}, "Scores", bins=2
    )
    ax, ax2 = fig.axes
    assert (
        ax.get_title()
        == f"MSP\nAUROC {100 * auroc_by_pairs(s_id, s_ood.tolist()):.2f}%"
        == "MSP\nAUROC 79.17%"
    )
    assert ax2.get_title() == "MCD\nAUROC 100.00%" and fig._suptitle.get_text() == "Scores"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("OOD score (higher = more OOD)", "density")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ID (n=4)", "OOD (n=3)"]
    # edges 0, 0.5, 1 over both sets; ID counts 3, 1 -> 3 / (4 * 0.5), 1 / (4 * 0.5); OOD 0, 3 -> 0,
    # 3 / (3 * 0.5)
    bars = [(p.get_x(), p.get_width(), p.get_height()) for p in ax.patches]
    np.testing.assert_allclose(
        bars, [(0, 0.5, 1.5), (0.5, 0.5, 0.5), (0, 0.5, 0.0), (0.5, 0.5, 2.0)], atol=1e-12
    )


def test_roc_curves_by_hand_and_against_roc_points():
    s_id, s_ood = [0.1, 0.4], [0.3, 0.9]
    rng = np.random.RandomState(0)
    r_id, r_ood = rng.normal(0, 1, 30), rng.normal(1, 1, 20)
    fig = plot_roc_curves({"A": (s_id, s_ood), "B": (r_id, r_ood)}, title="ROC")
    (ax,) = fig.axes
    a, b = ax.lines[:2]
    # accept as ID when score <= t, t rising: nothing; 0.1 (ID); 0.3 (OOD); 0.4 (ID); 0.9 (OOD)
    assert np.array_equal(xy(a)[0], [0, 0, 50, 50, 100]) and np.array_equal(
        xy(a)[1], [0, 50, 50, 100, 100]
    )
    fpr, tpr = roc_points(r_id, r_ood)
    assert np.array_equal(xy(b)[0], 100 * fpr) and np.array_equal(xy(b)[1], 100 * tpr)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "A (AUROC 75.00%)",
        f"B (AUROC {100 * auroc_by_pairs(r_id, r_ood):.2f}%)",
        "TPR 95%",
    ]
    assert any(np.array_equal(xy(line)[1], [95, 95]) for line in ax.lines)
    assert any(
        np.array_equal(xy(line)[0], [0, 100]) and np.array_equal(xy(line)[1], [0, 100])
        for line in ax.lines
    )
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == (
        "FPR: OOD accepted as ID (%)",
        "TPR: ID accepted (%)",
        "ROC",
    )
    assert ax.get_xlim() == (0, 100) and ax.get_ylim() == (0, 101)


@pytest.mark.parametrize("best_epoch, margin", [(1, 1.2), (-1, None)])
def test_history(best_epoch, margin):
    hist = SimpleNamespace(
        ce=[2.0, 1.5, 1.2, 1.0],
        dis=[0.1, 0.2, 0.3, 0.4],
        gap=[0.0, 0.5, 0.9, 1.3],
        val_auroc=[0.80, 0.90, 0.85],
        best_epoch=best_epoch,
    )
    fig = plot_history(hist, margin=margin, title="run")
    ax1, ax2, ax3 = fig.axes
    steps = [1, 2, 3, 4]
    assert [xy(line)[0].tolist() for line in ax1.lines] == [steps, steps]
    assert [xy(line)[1].tolist() for line in ax1.lines] == [hist.ce, hist.dis]
    assert xy(ax2.lines[0])[1].tolist() == hist.gap
    assert [xy(line)[1].tolist() for line in ax2.lines[1:]] == ([[1.2, 1.2]] if margin else [])
    assert [t.get_text() for t in ax2.get_legend().get_texts()] == ["mean H(p1) − H(p2)"] + (
        ["margin m = 1.2 nats"] if margin else []
    )
    assert xy(ax3.lines[0])[0].tolist() == [1, 2, 3] and xy(ax3.lines[0])[1] == pytest.approx(
        [80, 90, 85]
    )
    stars = [xy(line) for line in ax3.lines[1:]]
    assert [(x.tolist(), y.tolist()) for x, y in stars] == (
        [([2], [pytest.approx(90.0)])] if best_epoch >= 0 else []
    )
    assert [ax.get_title() for ax in fig.axes] == [
        "Step B losses",
        "Entropy gap on unlabeled data",
        "Model selection",
    ]
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "loss (nats)",
        "entropy gap (nats)",
        "AUROC (%)",
    ]
    assert [ax.get_xlabel() for ax in fig.axes] == ["fine-tuning step", "fine-tuning step", "epoch"]
    assert list(ax3.get_xticks()) == [1, 2, 3] and fig._suptitle.get_text() == "run"


@pytest.mark.parametrize("channels", [1, 3])
def test_plot_extremes_shows_the_highest_and_lowest_scores(channels):
    mean, std = [0.5] * channels, [0.25] * channels
    raw = torch.rand(5, channels, 4, 4, generator=torch.Generator().manual_seed(0))
    x = (raw - 0.5) / 0.25
    fig = plot_extremes(
        x[:3], x[3:], torch.tensor([0.1, 0.5, 0.3]), np.array([0.9, 0.2]), mean, std, k=2
    )
    axes = np.array(fig.axes).reshape(2, 2)
    # scores 0.1, 0.5, 0.3 (ID) and 0.9, 0.2 (OOD): most OOD 0.9 (OOD), 0.5 (ID); least 0.1 (ID),
    # 0.2 (OOD)
    assert [[ax.get_title() for ax in row] for row in axes] == [
        ["OOD 0.90", "ID 0.50"],
        ["ID 0.10", "OOD 0.20"],
    ]
    assert [ax.title.get_color() for ax in axes.flat] == ["C3", "C2", "C2", "C3"]
    for ax, i in zip(axes.flat, (3, 1, 0, 4)):
        want = raw[i, 0] if channels == 1 else raw[i].permute(1, 2, 0)
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), want.numpy(), atol=1e-6)
    assert (axes[0, 0].get_ylabel(), axes[1, 0].get_ylabel()) == ("most OOD", "least OOD")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(k=0), r"\bk=0\b"),
        (dict(k=6), r"\[1, 5\].*\bk=6\b"),
        (dict(s_ood=[0.9]), r"\b5 images\b.*\b4 scores\b"),
    ],
)
def test_plot_extremes_errors(kw, match):
    x = torch.zeros(5, 1, 2, 2)
    args = {"s_id": [0.1, 0.2, 0.3], "s_ood": [0.4, 0.5], "mean": 0.0, "std": 1.0, "k": 2, **kw}
    with pytest.raises(ValueError, match=match):
        plot_extremes(x[:3], x[3:], **args)
