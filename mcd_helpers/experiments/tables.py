"""Tables of notebooks 04-05's results (Markdown; values in %).

* :func:`methods_markdown` -- MCD against the baselines, one line per OOD set.
* :func:`config_markdown` -- a config's main settings as a two-column table.

Result rows are those of :mod:`mcd_helpers.experiments` (metrics as fractions).
"""
from __future__ import annotations

from typing import Sequence

from .baselines import BASELINES, ODIN_EPSILONS, ODIN_TEMPERATURES
from .paper import markdown_table

__all__ = ["METHODS", "methods_markdown", "config_markdown"]

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
