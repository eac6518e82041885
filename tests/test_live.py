"""Walk-through figures and widgets: what they draw is the data they are given."""
import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

import mcd_helpers.teaching.live as live
from mcd_helpers.data.sets import DEBIAN_FMNIST_DIR
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.metrics import ood_metrics
from mcd_helpers.training.loop import FinetuneHistory


def _hist():
    return FinetuneHistory(ce=[1.0, 0.8, 0.7, 0.6], dis=[1.2, 0.9, 0.3, 0.0], gap=[0.0, 0.3, 0.9, 1.3],
                           val_auroc=[0.9, 0.97], best_epoch=1)


def test_plot_history_draws_the_history():
    fig = live.plot_history(_hist(), margin=1.2, title="t")
    ax1, ax2, ax3 = fig.axes
    np.testing.assert_array_equal(ax1.lines[0].get_ydata(), [1.0, 0.8, 0.7, 0.6])
    np.testing.assert_array_equal(ax1.lines[1].get_ydata(), [1.2, 0.9, 0.3, 0.0])
    np.testing.assert_array_equal(ax2.lines[0].get_ydata(), [0.0, 0.3, 0.9, 1.3])
    assert ax2.lines[1].get_ydata()[0] == 1.2  # the margin line
    np.testing.assert_allclose(ax3.lines[0].get_ydata(), [90.0, 97.0])
    assert ax3.lines[1].get_xdata()[0] == 2 and ax3.lines[1].get_ydata()[0] == pytest.approx(97.0)  # best epoch, 1-based
    assert ax1.get_ylabel() == "loss (nats)" and ax3.get_ylabel() == "AUROC (%)"


def test_live_plot_displays_once_then_updates(monkeypatch):
    shown, updated = [], []

    class Handle:
        def update(self, fig):
            updated.append(fig)

    import IPython.display
    monkeypatch.setattr(IPython.display, "display", lambda fig, display_id=False: shown.append(fig) or Handle())
    plot = live.LivePlot(margin=1.2)
    for epoch in range(3):
        plot(epoch, _hist())
    assert len(shown) == 1 and len(updated) == 2 and plot.updates == 3


def test_plot_extremes_picks_highest_and_lowest_scores():
    x_id, x_ood = torch.zeros(5, 1, 4, 4), torch.ones(3, 1, 4, 4)
    s_id, s_ood = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.2]), torch.tensor([1.5, 0.4, 1.9])
    fig = live.plot_extremes(x_id, x_ood, s_id, s_ood, mean=0.0, std=1.0, k=3)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:3] == ["OOD 1.90", "OOD 1.50", "ID 0.50"]
    assert titles[3:] == ["ID 0.05", "ID 0.10", "ID 0.20"]
    assert fig.axes[0].images[0].get_array().max() == 1.0  # an OOD image (all ones), un-normalised
    # legible: 12-point titles, and at most ~1.2 inches per image, so that a notebook shows the
    # figure near its own size (a wider figure is scaled down, and its titles with it)
    assert min(ax.title.get_fontsize() for ax in fig.axes) >= 11
    assert fig.get_figwidth() / 3 <= 1.4
    with pytest.raises(ValueError, match="k must be"):
        live.plot_extremes(x_id, x_ood, s_id, s_ood, 0.0, 1.0, k=9)
    with pytest.raises(ValueError, match="one score per image"):
        live.plot_extremes(x_id, x_ood, s_id[:4], s_ood, 0.0, 1.0)


def test_live_plot_is_run_ood_sets_callback_too(monkeypatch):
    import IPython.display
    drawn = []
    monkeypatch.setattr(IPython.display, "display", lambda fig, display_id=False: drawn.append(fig) or None)
    plot = live.LivePlot(margin=1.2, title="t")
    plot.for_strategy("concat", 0, _hist())  # run_ood_set calls on_epoch(strategy, epoch, history)
    assert plot.updates == 1 and "epoch 1, best so far 2" in drawn[0]._suptitle.get_text()


def test_rerun_widget_passes_the_controls_values(monkeypatch):
    calls = []
    monkeypatch.setattr(live, "rerun", lambda *args: calls.append(args) or "result")
    cfg = MCDConfig(finetune_epochs=2, margin=1.2)
    box, c = live.rerun_widget(cfg, "data", ("digits", "gaussian"))
    assert (c["margin"].value, c["ood"].value, c["epochs"].value, c["retrain"].value) == (1.2, "digits", 2, False)
    assert c["strategy"].options == ("separate", "concat", "split-bn", "recalibrate")
    c["margin"].value, c["ood"].value, c["strategy"].value, c["epochs"].value = 0.5, "gaussian", "split-bn", 3
    c["retrain"].value = True
    c["button"].click()
    assert calls == [(cfg, "data", "gaussian", "split-bn", 0.5, 3, True)]
    assert c["last"] == "result"


@pytest.mark.skipif(not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")
def test_rerun_fine_tunes_through_the_pipeline_and_loads_a_setting_run_before(monkeypatch, tmp_data_dir):
    import IPython.display

    import mcd_helpers.experiments.pipeline as pipeline
    from mcd_helpers.experiments.pipeline import load_data
    from test_pipeline import TINY

    shown, updated = [], []

    class Handle:
        def update(self, fig):
            updated.append(fig)

    monkeypatch.setattr(IPython.display, "display", lambda fig, display_id=False: shown.append(fig) or Handle())
    trained = []
    real = pipeline.finetune
    monkeypatch.setattr(pipeline, "finetune", lambda *a, **k: trained.append(1) or real(*a, **k))
    data = load_data(TINY)
    r = live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=2)
    assert (r.ood, r.strategy, r.cfg.margin, r.cfg.finetune_epochs, trained) == ("gaussian", "concat", 0.3, 2, [1])
    assert r.rows[-1]["strategy"] == "concat" and [x["method"] for x in r.rows] == ["msp", "odin", "energy", "mcd"]
    assert len(r.history.val_auroc) == 2 and len(r.history.ce) == 2 * TINY.steps_per_epoch
    # the live plot (shown once, then updated in place), the histograms and the ROC curves
    assert len(shown) == 3 and len(updated) == 1
    assert shown[0].axes[1].lines[1].get_ydata()[0] == 0.3  # the margin line
    titles = [ax.get_title().splitlines() for ax in shown[1].axes]
    assert [t[0] for t in titles] == ["MCD before fine-tuning", "MCD after"]
    assert titles[1][1] == f"AUROC {100 * r.rows[-1]['auroc']:.2f}%"  # the after panel: the MCD row's scores
    assert titles[0][1] == f"AUROC {100 * ood_metrics(*r.before)['auroc']:.2f}%" != titles[1][1]
    # the same setting again: loaded from the cache, its epochs replayed into a new live plot
    again = live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=2)
    assert trained == [1] and len(shown) == 6 and len(updated) == 2
    assert again.rows == r.rows and again.history == r.history
    # another margin, or retrain: trained
    live.rerun(TINY, data, "gaussian", "concat", margin=0.4, epochs=2, show=False)
    live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=2, retrain=True, show=False)
    assert trained == [1, 1, 1] and len(shown) == 6
