"""Notebook 05's live pieces (mcd_helpers/experiments/live.py): the live plot, rerun through the
pipeline and its widget.

``IPython.display.display`` is replaced by a recorder, so the tests see what a notebook would show.
"""

import copy

import matplotlib
import pytest
import torch
import torch.nn.functional as F

matplotlib.use("Agg")

import IPython.display  # noqa: E402
from pipeline_setup import TINY  # noqa: E402

from mcd_helpers.data import DEBIAN_FMNIST_DIR  # noqa: E402
from mcd_helpers.errors import ConfigError  # noqa: E402
from mcd_helpers.experiments import live, stages  # noqa: E402
from mcd_helpers.experiments.config import MCDConfig  # noqa: E402
from mcd_helpers.experiments.loop import History  # noqa: E402
from mcd_helpers.strategies import STRATEGIES  # noqa: E402


@pytest.fixture
def shown(monkeypatch):
    """``(shown, updated)``: the figures given to display() and to its handle's update()."""
    shown, updated = [], []

    class Handle:
        def update(self, fig):
            updated.append(fig)

    monkeypatch.setattr(
        IPython.display, "display", lambda fig, display_id=False: shown.append(fig) or Handle()
    )
    return shown, updated


def test_the_live_plot_displays_once_then_updates_the_same_output(shown):
    shown, updated = shown
    plot = live.LivePlot(margin=1.2, title="digits")
    hist = History(ce=[1.0, 0.8], dis=[1.2, 0.9], gap=[0.0, 0.3], val_auroc=[0.9], best_epoch=0)
    for epoch in range(3):
        plot(epoch, hist)
        hist = History(
            ce=hist.ce + [0.7, 0.6],
            dis=hist.dis + [0.3, 0.0],
            gap=hist.gap + [0.9, 1.3],
            val_auroc=hist.val_auroc + [0.97],
            best_epoch=1,
        )
    assert (len(shown), len(updated), plot.updates) == (1, 2, 3)
    titles = [f._suptitle.get_text() for f in shown + updated]
    assert titles == [
        "digits (epoch 1, kept so far 1)",
        "digits (epoch 2, kept so far 2)",
        "digits (epoch 3, kept so far 2)",
    ]
    # the history it was given
    assert list(updated[-1].axes[0].lines[0].get_ydata()) == [1.0, 0.8, 0.7, 0.6, 0.7, 0.6]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(margin=-0.1), r"margin.*-0\.1"),
        (dict(epochs=0), r"finetune_epochs.*\b0\b"),
        (dict(strategy="both"), "strategies.*'both'"),
    ],
)
def test_rerun_refuses_bad_settings_before_any_work(kwargs, match):
    args = {"ood": "gaussian", "strategy": "concat", "margin": 0.3, "epochs": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        live.rerun(TINY, None, **args)  # no data: nothing may be loaded or trained first


@pytest.mark.skipif(not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")
@pytest.mark.slow
def test_rerun_goes_through_the_pipeline_and_an_identical_rerun_loads_from_the_cache(
    shown, tmp_data_dir, monkeypatch
):
    shown, updated = shown
    trained, cfgs, real = [], [], stages.train
    monkeypatch.setattr(
        stages,
        "train",
        lambda *a, **k: trained.append(a[3]) or cfgs.append(a[2]) or real(*a, **k),
    )
    data = stages.load_data(TINY)
    r = live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=3)
    assert trained == [None, "concat"]
    assert (cfgs[1].margin, cfgs[1].finetune_epochs, cfgs[1].strategies) == (0.3, 3, ("concat",))
    assert {x["ood_dataset"] for x in r.rows} == {"gaussian"} and list(r.histories) == ["concat"]
    assert [(x["method"], x["strategy"]) for x in r.rows] == [
        ("msp", None),
        ("odin", None),
        ("energy", None),
        ("mcd", "concat"),
    ]
    assert (
        len(r.histories["concat"].val_auroc) == 3
        and len(r.histories["concat"].ce) == 3 * TINY.steps_per_epoch
    )
    # the live plot (shown once, updated after epochs 2 and 3, its margin line at 0.3), the
    # histograms, the ROC curves
    assert (len(shown), len(updated)) == (3, 2)
    assert shown[0].axes[1].lines[1].get_ydata()[0] == 0.3
    # "before": the pre-trained network's discrepancy scores on the test images, recomputed here
    split = stages.make_split(cfgs[1], data, "gaussian")
    quiet = stages.RunOptions(progress=False, log=None)
    base = copy.deepcopy(stages.pretrained(cfgs[1], split, quiet)).eval()
    with torch.no_grad():
        for got, x in zip(r.scores["mcd:pre-trained"], (split.test_id_x, split.test_ood_x)):
            a, b = base(x)
            torch.testing.assert_close(
                got, (F.softmax(a, 1) - F.softmax(b, 1)).abs().sum(1), rtol=1e-5, atol=1e-6
            )
    # the same setting again: loaded, its epochs replayed into a new live plot, the same metrics
    again = live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=3)
    assert trained == [None, "concat"] and (len(shown), len(updated)) == (6, 4)
    assert again.rows == r.rows and again.histories == r.histories
    # retrain: the fine-tuning only (the pre-trained network is loaded); show=False draws nothing
    live.rerun(TINY, data, "gaussian", "concat", margin=0.3, epochs=3, retrain=True, show=False)
    assert trained == [None, "concat", "concat"] and len(shown) == 6


@pytest.mark.parametrize("finetune_epochs, epochs", [(2, 2), (9, 5)])
def test_the_widgets_button_passes_the_controls_values(monkeypatch, finetune_epochs, epochs):
    calls = []
    monkeypatch.setattr(live, "rerun", lambda *args: calls.append(args) or "result")
    cfg = MCDConfig(finetune_epochs=finetune_epochs, margin=1.2)
    box, c = live.rerun_widget(cfg, "data", ("digits", "gaussian"), max_epochs=5)
    assert (
        c["margin"].value,
        c["ood"].value,
        c["epochs"].value,
        c["epochs"].max,
        c["retrain"].value,
    ) == (1.2, "digits", epochs, 5, False)
    assert c["strategy"].options == tuple(STRATEGIES)
    (
        c["margin"].value,
        c["ood"].value,
        c["strategy"].value,
        c["epochs"].value,
        c["retrain"].value,
    ) = (0.5, "gaussian", "split-bn", 3, True)
    c["button"].click()
    assert calls == [(cfg, "data", "gaussian", "split-bn", 0.5, 3, True)] and c["last"] == "result"
