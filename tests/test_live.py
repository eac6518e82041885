"""Walk-through figures and widgets: what they draw is the data they are given."""
import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")

import mcd_helpers.teaching.live as live
from mcd_helpers.experiments.config import MCDConfig
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


def test_rerun_widget_passes_the_controls_values(monkeypatch):
    calls = []
    monkeypatch.setattr(live, "rerun", lambda *args: calls.append(args) or "result")
    cfg = MCDConfig(finetune_epochs=2, margin=1.2)
    box, c = live.rerun_widget("base", "x", "y", "xt", "yt", cfg, ("digits", "gaussian"))
    assert (c["margin"].value, c["ood"].value, c["epochs"].value) == (1.2, "digits", 2)
    c["margin"].value, c["ood"].value, c["strategy"].value, c["epochs"].value = 0.5, "gaussian", "concat", 3
    c["button"].click()
    assert calls == [("base", "x", "y", "xt", "yt", cfg, "gaussian", "concat", 0.5, 3)]
    assert c["last"] == "result"


def test_rerun_fine_tunes_with_the_new_settings_and_shows_the_plots(monkeypatch):
    import IPython.display

    import mcd_helpers.experiments.pipeline as ex
    from test_experiments import _tiny

    model, x_sup, y_sup, split, cfg = _tiny()
    monkeypatch.setattr(ex, "ood_split", lambda cfg, ood, x, y: split)
    shown, updated = [], []

    class Handle:
        def update(self, fig):
            updated.append(fig)

    monkeypatch.setattr(IPython.display, "display", lambda fig, display_id=False: shown.append(fig) or Handle())
    comp = live.rerun(model, x_sup, y_sup, None, None, cfg, "noise", "concat", margin=0.3, epochs=2)
    assert comp.ood == "noise" and comp.rows[-1]["strategy"] == "concat"
    assert len(comp.history.val_auroc) == 2 and len(comp.history.ce) == 2 * cfg.steps_per_epoch
    # the live plot (shown once, then updated in place), the histograms and the ROC curves
    assert len(shown) == 3 and len(updated) == 1
    assert shown[0].axes[1].lines[1].get_ydata()[0] == 0.3  # the margin line
