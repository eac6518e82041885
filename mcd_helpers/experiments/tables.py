"""Tables and figures of notebooks 04-05's results (Markdown tables, matplotlib figures; values in %).

* :func:`methods_markdown` -- MCD against the baselines, one line per OOD set.
* :func:`ablation_markdown`, :func:`plot_ablation` -- the Step B strategy ablation over seeds.
* :func:`config_markdown` -- a config's main settings as a two-column table.

Result rows are those of :mod:`mcd_helpers.experiments` (metrics as fractions).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .baselines import BASELINES, ODIN_EPSILONS, ODIN_TEMPERATURES
from .paper import markdown_table

__all__ = ["METHODS", "methods_markdown", "ablation_markdown", "plot_ablation", "config_markdown"]

METHODS = BASELINES + ("mcd",)


def methods_markdown(rows: Sequence[dict], methods: Sequence[str] = METHODS) -> str:
    """A Markdown table, one line per OOD set: AUROC and FPR95 of each method (%), the best in bold.

    Also F1's ID test accuracy of the pre-trained network (the baselines') and after MCD.
    """
    names = {"msp": "MSP", "odin": "ODIN", "energy": "energy", "mcd": "MCD"}
    header = ([f"AUROC {names[m]}" for m in methods] + [f"FPR95 {names[m]}" for m in methods]
              + ["ID acc. pre-trained", "ID acc. MCD"])
    lines = []
    for ood in dict.fromkeys(r["ood_dataset"] for r in rows):
        by = {r["method"]: r for r in rows if r["ood_dataset"] == ood}
        cells = [ood]
        for key, best in (("auroc", max), ("fpr95", min)):
            top = best(by[m][key] for m in methods if m in by)
            cells += [("–" if m not in by else f"**{100 * by[m][key]:.2f}**" if by[m][key] == top
                       else f"{100 * by[m][key]:.2f}") for m in methods]
        cells += [f"{100 * by[m]['id_accuracy']:.2f}" if m in by else "–" for m in ("msp", "mcd")]
        lines.append(cells)
    return (markdown_table(["OOD set", *header], lines)
            + "\n\nAll numbers in %. AUROC: higher is better; FPR95 (OOD accepted at 95% ID accepted): lower is better.")


def ablation_markdown(summary: Sequence[dict], metrics: Sequence[str] = ("auroc", "fpr95", "id_accuracy")) -> str:
    """A Markdown table of :func:`summarize_ablation`'s rows: mean ± sample std in %."""
    names = {"auroc": "AUROC", "fpr95": "FPR95", "detection_error": "det. error", "id_accuracy": "ID acc.",
             "aupr_in": "AUPR-In", "aupr_out": "AUPR-Out"}
    lines = [[s["ood_dataset"], s["strategy"], s["n"]]
             + [f"{100 * s[f'{k}_mean']:.2f} ± {100 * s[f'{k}_std']:.2f}" for k in metrics] for s in summary]
    return (markdown_table(["OOD set", "Step B", "seeds", *[names.get(k, k) for k in metrics]], lines)
            + "\n\nMean ± sample standard deviation over seeds, in %.")


def plot_ablation(rows: Sequence[dict], metrics: Sequence[str] = ("auroc", "id_accuracy"), title: str = ""):
    """Each run as a dot and mean ± std as a bar, per OOD set and strategy; one panel per metric (%)."""
    import matplotlib.pyplot as plt

    labels = {"auroc": "AUROC (%)", "id_accuracy": "ID test accuracy of F1 (%)", "fpr95": "FPR95 (%)"}
    groups = list(dict.fromkeys((r["ood_dataset"], r["strategy"]) for r in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, k in zip(axes[0], metrics):
        labelled = set()
        for i, (ood, strategy) in enumerate(groups):
            v = 100 * np.array([r[k] for r in rows if r["ood_dataset"] == ood and r["strategy"] == strategy])
            color = "C0" if strategy == "separate" else "C1"
            ax.plot(np.full(len(v), i) + np.linspace(-0.08, 0.08, len(v)), v, "o", color=color, alpha=0.6)
            ax.errorbar(i + 0.25, v.mean(), yerr=v.std(ddof=1) if len(v) > 1 else 0, fmt="s", color=color,
                        capsize=4, label=None if strategy in labelled else strategy)
            labelled.add(strategy)
        ax.set_xticks(range(len(groups)), [f"{o}\n{s}" for o, s in groups])
        ax.set(ylabel=labels.get(k, k), xlabel="OOD set and Step B strategy", title=labels.get(k, k).split(" (")[0])
        ax.legend(title="mean ± std", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def config_markdown(cfg) -> str:
    """A config's main settings as a two-column Markdown table (training images, steps, lr, ...)."""
    n_train = f"{cfg.train_subset:,}" if cfg.train_subset else "all"
    steps = f"{cfg.steps_per_epoch}" if cfg.steps_per_epoch else "one pass over the labeled set"
    odin = cfg.extra.get("odin_temperatures", ODIN_TEMPERATURES), cfg.extra.get("odin_epsilons", ODIN_EPSILONS)
    rows = [("ID set, model", f"{cfg.id_dataset}, {cfg.model} ({cfg.norm} norm)"),
            ("training images (labeled)", n_train),
            ("ID test images", f"{cfg.test_subset:,}" if cfg.test_subset else "all"),
            ("generated OOD images per set", f"{cfg.ood_size:,}"),
            ("validation images, ID + OOD", f"{cfg.n_val} + {cfg.n_val}"),
            ("pre-training", f"{cfg.pretrain_epochs} epochs, SGD lr {cfg.pretrain_lr}, batch {cfg.pretrain_batch_size}, "
                             f"lr × 0.1 at epochs {list(cfg.pretrain_milestones)}"),
            ("fine-tuning schedule", "Step A then Step B" if cfg.schedule == "official" else "Step B only"),
            ("fine-tuning", f"{cfg.finetune_epochs} epoch{'s' * (cfg.finetune_epochs != 1)} × {steps} steps, "
                            f"SGD lr {cfg.finetune_lr}, "
                            f"weight decay {cfg.finetune_weight_decay}"),
            ("batch, labeled + unlabeled", f"{cfg.batch_size_sup} + {cfg.batch_size_unsup}"),
            ("margin m", f"{cfg.margin} nats"),
            ("ODIN grid", f"T ∈ {list(odin[0])}, ε ∈ {list(odin[1])}"),
            ("seed", str(cfg.seed))]
    return markdown_table(["setting", "value"], rows).replace("| --- | ---: |", "| --- | --- |", 1)  # values left-aligned
