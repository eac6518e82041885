"""Figures and widgets for the MCD training walk-through (notebook 04).

* :func:`plot_history` -- losses, the entropy gap H(p1) - H(p2) and validation AUROC of a run.
* :class:`LivePlot` -- redraws :func:`plot_history` in place after each epoch (a Jupyter display
  handle; works headless, where each update replaces the cell's output).
* :func:`plot_extremes` -- the test images scored most and least OOD, each marked ID or OOD.
* :func:`rerun`, :func:`rerun_widget` -- fine-tune again with another margin, OOD set, strategy or
  number of epochs (ipywidgets controls and a button), through the one pipeline
  (:mod:`mcd_helpers.experiments.pipeline`): a setting that was run before is loaded from the
  cache and its epochs replayed into the live plot.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

__all__ = ["plot_history", "LivePlot", "plot_extremes", "Rerun", "rerun", "rerun_widget", "METHOD_NAMES"]

METHOD_NAMES = {"msp": "MSP", "odin": "ODIN", "energy": "energy", "mcd": "MCD"}  # labels in figures


def plot_history(hist, margin: float | None = None, title: str = ""):
    """Three panels of a fine-tuning history: losses, entropy gap, validation AUROC.

    Args:
        hist: a :class:`~mcd_helpers.training.loop.FinetuneHistory` (per-step ``ce``, ``dis``, ``gap`` in
            nats; per-epoch ``val_auroc`` as fractions; ``best_epoch``).
        margin: the discrepancy loss's margin m (nats), drawn on the gap panel.

    Returns:
        the matplotlib ``Figure``.
    """
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13.5, 3.6))
    steps = np.arange(1, len(hist.ce) + 1)
    ax1.plot(steps, hist.ce, label="CE(F1) + CE(F2), labeled batch")
    ax1.plot(steps, hist.dis, label="discrepancy loss, unlabeled batch")
    ax1.set(title="Step B losses", xlabel="fine-tuning step", ylabel="loss (nats)")
    ax1.legend(fontsize=8)
    ax2.plot(steps, hist.gap, color="C2", label="mean H(p1) − H(p2)")
    if margin is not None:
        ax2.axhline(margin, color="grey", ls="--", lw=1, label=f"margin m = {margin} nats")
    ax2.set(title="Entropy gap on unlabeled data", xlabel="fine-tuning step", ylabel="entropy gap (nats)")
    ax2.legend(fontsize=8)
    epochs = np.arange(1, len(hist.val_auroc) + 1)
    ax3.plot(epochs, 100 * np.asarray(hist.val_auroc), "o-", color="C3", label="validation AUROC")
    if hist.best_epoch >= 0:
        ax3.plot(hist.best_epoch + 1, 100 * hist.val_auroc[hist.best_epoch], "*", ms=14, color="gold",
                 markeredgecolor="k", label="kept (best)")
    ax3.set(title="Model selection", xlabel="epoch", ylabel="AUROC (%)", xticks=epochs if len(epochs) else [])
    ax3.legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


class LivePlot:
    """Redraw :func:`plot_history` in one notebook output after every epoch.

    A ``LivePlot`` is the ``on_epoch(epoch, history)`` callback of
    :func:`~mcd_helpers.experiments.pipeline.finetuned`::

        live = LivePlot(margin=cfg.margin, title="...")
        model, hist, seconds = finetuned(cfg, base, split, ood, "separate", on_epoch=live)

    (for :func:`~mcd_helpers.experiments.pipeline.run_ood_set`, whose callback also gets the
    strategy, pass ``live.for_strategy``). The first call displays the figure with a display id,
    later calls update that output in place; ``updates`` counts the calls (one per epoch, also
    when a cached run is replayed).
    """

    def __init__(self, margin: float | None = None, title: str = ""):
        self.margin, self.title, self.handle, self.updates = margin, title, None, 0

    def __call__(self, epoch: int, hist) -> None:
        from IPython.display import display

        best = hist.best_epoch
        fig = plot_history(hist, self.margin, f"{self.title} (epoch {epoch + 1}, best so far {best + 1})")
        if self.handle is None:
            self.handle = display(fig, display_id=True)
        else:
            self.handle.update(fig)
        plt.close(fig)
        self.updates += 1

    def for_strategy(self, strategy: str, epoch: int, hist) -> None:
        """The ``on_epoch(strategy, epoch, history)`` callback of ``run_ood_set``: draws ``epoch``."""
        self(epoch, hist)


def _to_image(x: torch.Tensor, mean, std) -> np.ndarray:
    c = x.shape[0]
    m = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
    s = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
    img = (x * s + m).clamp(0, 1)  # (C, H, W) in [0, 1]
    return img[0].numpy() if c == 1 else img.permute(1, 2, 0).numpy()


def plot_extremes(x_id: torch.Tensor, x_ood: torch.Tensor, s_id, s_ood, mean, std, k: int = 8,
                  title: str = ""):
    """The ``k`` test images with the highest and the ``k`` with the lowest OOD score.

    ID and OOD test images are pooled; each cell shows the image, its score and where it came
    from (green "ID", red "OOD"), so mistakes stand out.

    Args:
        x_id: ``(N_id, C, H, W)`` normalised; x_ood: ``(N_ood, C, H, W)``.
        s_id, s_ood: their scores ``(N_id,)``, ``(N_ood,)``, higher = more OOD.
        mean, std: the normalisation to undo (numbers or one per channel).

    Returns:
        the matplotlib ``Figure`` (2 rows x ``k`` columns).

    Raises:
        ValueError: if ``k`` exceeds the number of pooled images or the scores' lengths differ.
    """
    x = torch.cat([x_id, x_ood])
    s = torch.cat([torch.as_tensor(s_id), torch.as_tensor(s_ood)]).double()
    if len(s) != len(x):
        raise ValueError(f"{len(x)} images but {len(s)} scores; pass one score per image.")
    if not 1 <= k <= len(x):
        raise ValueError(f"k must be in [1, {len(x)}], got {k}.")
    is_ood = torch.cat([torch.zeros(len(x_id), dtype=torch.bool), torch.ones(len(x_ood), dtype=torch.bool)])
    order = torch.argsort(s, descending=True, stable=True)
    # About 1.15 inches per image: at JupyterLab's usual width the figure is shown near its own
    # size (100 dpi), so the 12-point titles stay legible.
    fig, axes = plt.subplots(2, k, figsize=(1.15 * k + 0.6, 3.4), squeeze=False)
    for row, (idx, label) in enumerate(((order[:k], "most OOD"), (order.flip(0)[:k], "least OOD"))):
        for ax, i in zip(axes[row], idx.tolist()):
            ax.imshow(_to_image(x[i], mean, std), cmap="gray", vmin=0, vmax=1)
            origin = "OOD" if is_ood[i] else "ID"
            ax.set_title(f"{origin} {s[i]:.2f}", fontsize=12, fontweight="bold", color="C3" if is_ood[i] else "C2")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[row][0].set_ylabel(label, fontsize=12)
    fig.suptitle(title or "Test images scored most (top) and least (bottom) OOD; above each: origin, score",
                 fontsize=13)
    fig.tight_layout()
    return fig


@dataclass
class Rerun:
    """One :func:`rerun`: its settings, the fine-tuned model and its results.

    ``rows``/``scores`` are :func:`~mcd_helpers.experiments.pipeline.evaluate`'s (msp, odin,
    energy and ``mcd:<strategy>``); ``before`` holds the discrepancy scores ``(id, ood)`` of the
    pre-trained network on the same test split.
    """
    cfg: object
    ood: str
    strategy: str
    model: object
    history: object
    rows: list
    scores: dict
    before: tuple


def rerun(cfg, data, ood: str, strategy: str, margin: float, epochs: int, retrain: bool = False,
          show: bool = True) -> Rerun:
    """Fine-tune again with ``margin`` (nats) and ``epochs`` on ``ood``, through the one pipeline.

    ``cfg`` with ``margin`` and ``finetune_epochs`` replaced goes through
    :func:`~mcd_helpers.experiments.pipeline.make_split`, ``pretrained`` (the cached network:
    the pre-training settings are unchanged), ``finetuned`` and ``evaluate``. A setting run before
    is loaded from the cache (its epochs replayed into the live plot); ``retrain=True`` trains it
    again. With ``show``: the live history, score histograms (before and after) and ROC curves.

    Args:
        cfg: an :class:`~mcd_helpers.experiments.config.MCDConfig`; data: the
            :class:`~mcd_helpers.experiments.pipeline.Data` of ``load_data(cfg)``.
        strategy: one of :data:`mcd_helpers.steps.STRATEGIES`.

    Raises:
        ConfigError: (a ValueError) on a negative margin or ``epochs < 1`` (from ``MCDConfig``);
        ValueError: on an unknown strategy (from the training loop).
    """
    from IPython.display import display

    from ..experiments.pipeline import evaluate, finetuned, make_split, pretrained
    from ..experiments.plots import plot_roc_curves, plot_score_histograms

    cfg = dataclasses.replace(cfg, margin=margin, finetune_epochs=epochs)
    split = make_split(cfg, data, ood)
    base = pretrained(cfg, split, progress=False, log=None)
    live = LivePlot(margin, f"{ood}, {strategy}, m = {margin}") if show else None
    model, hist, _ = finetuned(cfg, base, split, ood, strategy, retrain=retrain, progress=False, on_epoch=live)
    rows, scores = evaluate(cfg, base, {strategy: model}, split, ood)
    before = evaluate(cfg, base, {"pre-trained": base}, split, ood, methods=("mcd",))[1]["mcd:pre-trained"]
    if show:
        panels = {"MCD before fine-tuning": before, "MCD after": scores[f"mcd:{strategy}"]}
        curves = {name: scores[f"mcd:{strategy}" if m == "mcd" else m] for m, name in METHOD_NAMES.items()}
        for fig in (plot_score_histograms(panels, f"{cfg.id_dataset} (ID) vs {ood} (OOD): discrepancy score"),
                    plot_roc_curves(curves, f"ROC: {cfg.id_dataset} vs {ood}")):
            display(fig)
            plt.close(fig)
    return Rerun(cfg, ood, strategy, model, hist, rows, scores, before)


def rerun_widget(cfg, data, ood_sets, max_epochs: int = 5):
    """Controls for margin, OOD set, strategy and epochs, and a button that calls :func:`rerun`.

    Returns:
        ``(box, controls)``: the ``ipywidgets.VBox`` to display and a dict of its widgets
        (``margin``, ``ood``, ``strategy``, ``epochs``, ``retrain``, ``button``, ``output``); after a
        click, ``controls["last"]`` holds the run's :class:`Rerun`.
    """
    import ipywidgets as w

    from ..steps import STRATEGIES

    controls = {
        "margin": w.FloatSlider(value=cfg.margin, min=0.0, max=2.3, step=0.1, description="margin m (nats)",
                                style={"description_width": "initial"}),
        "ood": w.Dropdown(options=list(ood_sets), value=ood_sets[0], description="OOD set"),
        "strategy": w.ToggleButtons(options=list(STRATEGIES), value="separate", description="Step B"),
        "epochs": w.IntSlider(value=min(cfg.finetune_epochs, max_epochs), min=1, max=max_epochs, description="epochs"),
        "retrain": w.Checkbox(value=False, description="train again even if cached"),
        "button": w.Button(description="fine-tune again", button_style="primary", icon="play"),
        "output": w.Output(),
    }

    def on_click(_):
        out = controls["output"]
        out.clear_output()
        with out:
            controls["last"] = rerun(cfg, data, controls["ood"].value, controls["strategy"].value,
                                     controls["margin"].value, controls["epochs"].value, controls["retrain"].value)

    controls["button"].on_click(on_click)
    row = w.HBox([controls[k] for k in ("margin", "ood", "epochs")])
    return (w.VBox([row, w.HBox([controls["strategy"], controls["retrain"], controls["button"]]), controls["output"]]),
            controls)
