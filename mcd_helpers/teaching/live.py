"""Figures and widgets for the MCD training walk-through (notebook 04).

* :func:`plot_history` -- losses, the entropy gap H(p1) - H(p2) and validation AUROC of a run.
* :class:`LivePlot` -- redraws :func:`plot_history` in place after each epoch (a Jupyter display
  handle; works headless, where each update replaces the cell's output).
* :func:`plot_extremes` -- the test images scored most and least OOD, each marked ID or OOD.
* :func:`rerun_widget` -- ipywidgets controls (margin, OOD set, strategy, epochs) and a button
  that reruns fine-tuning with those settings and redraws the plots.
"""
from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
import torch

__all__ = ["plot_history", "LivePlot", "plot_extremes", "rerun", "rerun_widget", "METHOD_NAMES"]

METHOD_NAMES = {"msp": "MSP", "odin": "ODIN", "energy": "energy", "mcd": "MCD"}  # labels in figures


def plot_history(hist, margin: float | None = None, title: str = ""):
    """Three panels of a fine-tuning history: losses, entropy gap, validation AUROC.

    Args:
        hist: a :class:`~mcd_helpers.train.FinetuneHistory` (per-step ``ce``, ``dis``, ``gap`` in
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

    Use ``live = LivePlot(margin=1.2); finetune_by_epoch(..., on_epoch=live)``. The first call
    displays the figure with a display id, later calls update that output in place.
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


def rerun(base, x_sup, y_sup, x_test, y_test, cfg, ood: str, strategy: str, margin: float, epochs: int,
          show: bool = True):
    """Fine-tune ``base`` again with new settings; live history, score histograms and ROC curves.

    Returns:
        the :class:`~mcd_helpers.experiments.MethodComparison` of the run.
    """
    from IPython.display import display

    from ..experiments.pipeline import compare_methods, ood_split
    from ..experiments.plots import plot_roc_curves, plot_score_histograms

    cfg = dataclasses.replace(cfg, margin=margin, finetune_epochs=epochs)
    split = ood_split(cfg, ood, x_test, y_test)
    live = LivePlot(margin, f"{ood}, {strategy}, m = {margin}") if show else None
    comp = compare_methods(base, x_sup, y_sup, split, cfg, ood, strategy, on_epoch=live)
    if show:
        panels = {"MCD before fine-tuning": comp.scores["mcd_before"], "MCD after": comp.scores["mcd"]}
        for fig in (plot_score_histograms(panels, f"{cfg.id_dataset} (ID) vs {ood} (OOD): discrepancy score"),
                    plot_roc_curves({name: comp.scores[m] for m, name in METHOD_NAMES.items()},
                                    f"ROC: {cfg.id_dataset} vs {ood}")):
            display(fig)
            plt.close(fig)
    return comp


def rerun_widget(base, x_sup, y_sup, x_test, y_test, cfg, ood_sets, max_epochs: int = 5):
    """Controls for margin, OOD set, strategy and epochs, and a button that calls :func:`rerun`.

    Returns:
        ``(box, controls)``: the ``ipywidgets.VBox`` to display and a dict of its widgets
        (``margin``, ``ood``, ``strategy``, ``epochs``, ``button``, ``output``); after a click,
        ``controls["last"]`` holds the run's :class:`~mcd_helpers.experiments.MethodComparison`.
    """
    import ipywidgets as w

    controls = {
        "margin": w.FloatSlider(value=cfg.margin, min=0.0, max=2.3, step=0.1, description="margin m (nats)",
                                style={"description_width": "initial"}),
        "ood": w.Dropdown(options=list(ood_sets), value=ood_sets[0], description="OOD set"),
        "strategy": w.ToggleButtons(options=["separate", "concat"], value="separate", description="Step B"),
        "epochs": w.IntSlider(value=min(cfg.finetune_epochs, max_epochs), min=1, max=max_epochs, description="epochs"),
        "button": w.Button(description="fine-tune again", button_style="primary", icon="play"),
        "output": w.Output(),
    }

    def on_click(_):
        out = controls["output"]
        out.clear_output()
        with out:
            controls["last"] = rerun(base, x_sup, y_sup, x_test, y_test, cfg, controls["ood"].value,
                                     controls["strategy"].value, controls["margin"].value, controls["epochs"].value)

    controls["button"].on_click(on_click)
    row = w.HBox([controls[k] for k in ("margin", "ood", "epochs")])
    return w.VBox([row, w.HBox([controls["strategy"], controls["button"]]), controls["output"]]), controls
