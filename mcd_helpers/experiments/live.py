"""What updates while you watch (notebook 05): a live training plot and a widget that fine-tunes
again.

:func:`rerun` goes through :func:`~mcd_helpers.experiments.pipeline.run_ood_set`, the one driver: a
setting run before is loaded from the cache and its epochs replayed into the live plot.
"""

import dataclasses

import IPython.display
import matplotlib.pyplot as plt

from ..plots import plot_history, plot_roc_curves, plot_score_histograms
from ..strategies import STRATEGIES
from ..tables import METHOD_NAMES


class LivePlot:
    """:func:`~mcd_helpers.plots.plot_history` redrawn in one notebook output after every epoch: the
    ``on_epoch(epoch, history)`` callback of :func:`~mcd_helpers.experiments.stages.finetuned`.
    ``updates`` counts the calls (one per epoch, also when a cached run is replayed)."""

    def __init__(self, margin: float | None = None, title: str = ""):
        self.margin = margin
        self.title = title
        self.handle = None  # the notebook output redrawn
        self.updates = 0

    def __call__(self, epoch: int, hist) -> None:
        fig = plot_history(
            hist,
            self.margin,
            f"{self.title} (epoch {epoch + 1}, kept so far {hist.best_epoch + 1})",
        )
        if self.handle is None:
            self.handle = IPython.display.display(fig, display_id=True)
        else:
            self.handle.update(fig)
        plt.close(fig)
        self.updates += 1


def rerun(
    cfg,
    data,
    ood: str,
    strategy: str,
    margin: float,
    epochs: int,
    retrain: bool = False,
    show: bool = True,
):
    """Fine-tune again on ``ood`` with ``margin`` (nats) and ``epochs`` (the pre-trained network
    from the cache: its settings are unchanged); with ``show``, the live history, the score
    histograms before and after, and ROC curves. Returns
    :func:`~mcd_helpers.experiments.pipeline.run_ood_set`'s ``Result``, its ``scores`` also holding
    ``"mcd:pre-trained"``: the pre-trained network's discrepancy scores ``(id, ood)``.

    Raises:
        ConfigError: a negative margin or ``epochs < 1`` (from the config); ValueError: an unknown
        strategy.
    """
    from .cache import cache_key
    from .evaluation import evaluate
    from .pipeline import run_ood_set
    from .stages import RunOptions, make_split

    cfg = dataclasses.replace(cfg, margin=margin, finetune_epochs=epochs, strategies=(strategy,))
    live = LivePlot(margin, f"{ood}, {strategy}, m = {margin}") if show else None
    # retrain: the fine-tuning only (a name in the set counts as retrained already: the cached
    # pre-training loads)
    retrained = {f"pretrain-{cache_key(cfg, 'pretrain')}.pt"} if retrain else False
    how = RunOptions(retrain=retrained, progress=False, log=None)
    shown = None if live is None else lambda s, e, h: live(e, h)
    res = run_ood_set(cfg, make_split(cfg, data, ood), ood, how=how, on_epoch=shown)
    base, scores = res.models["base"], res.scores
    before = evaluate(cfg, base, {"pre-trained": base}, res.split, ood, ("mcd",))[1][
        "mcd:pre-trained"
    ]
    scores["mcd:pre-trained"] = before  # the result carries it too
    if show:
        for fig in (
            plot_score_histograms(
                {"MCD before fine-tuning": before, "MCD after": scores[f"mcd:{strategy}"]},
                f"{cfg.id_dataset} (ID) vs {ood} (OOD): discrepancy score",
            ),
            plot_roc_curves(
                {
                    name: scores[f"mcd:{strategy}" if m == "mcd" else m]
                    for m, name in METHOD_NAMES.items()
                },
                f"ROC: {cfg.id_dataset} vs {ood}",
            ),
        ):
            IPython.display.display(fig)
            plt.close(fig)
    return res


def rerun_widget(cfg, data, ood_sets, max_epochs: int = 5):
    """Controls for margin, OOD set, strategy and epochs, and a button that calls :func:`rerun`.

    Returns ``(box, controls)``: the ``ipywidgets.VBox`` to display and its widgets (``margin``,
    ``ood``, ``strategy``, ``epochs``, ``retrain``, ``button``, ``output``); after a click
    ``controls["last"]`` is :func:`rerun`'s result.
    """
    import ipywidgets as w

    controls = {
        "margin": w.FloatSlider(
            value=cfg.margin,
            min=0.0,
            max=2.3,
            step=0.1,
            description="margin m (nats)",
            style={"description_width": "initial"},
        ),
        "ood": w.Dropdown(options=list(ood_sets), value=ood_sets[0], description="OOD set"),
        "strategy": w.ToggleButtons(
            options=list(STRATEGIES), value="separate", description="Step B"
        ),
        "epochs": w.IntSlider(
            value=min(cfg.finetune_epochs, max_epochs), min=1, max=max_epochs, description="epochs"
        ),
        "retrain": w.Checkbox(value=False, description="train again even if cached"),
        "button": w.Button(description="fine-tune again", button_style="primary", icon="play"),
        "output": w.Output(),
    }

    def on_click(_):
        controls["output"].clear_output()
        with controls["output"]:
            controls["last"] = rerun(
                cfg,
                data,
                controls["ood"].value,
                controls["strategy"].value,
                controls["margin"].value,
                controls["epochs"].value,
                controls["retrain"].value,
            )

    controls["button"].on_click(on_click)
    return (
        w.VBox(
            [
                w.HBox([controls[k] for k in ("margin", "ood", "epochs")]),
                w.HBox([controls["strategy"], controls["retrain"], controls["button"]]),
                controls["output"],
            ]
        ),
        controls,
    )
