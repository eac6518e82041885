"""Named run presets for ``python -m mcd_helpers reproduce --preset NAME``.

Each preset is an :class:`~mcd_helpers.experiments.config.MCDConfig`; every field can still be overridden
on the command line (``--finetune-lr 0.1`` for the paper text's fine-tuning lr, for instance).

* ``quick``: CPU-sized, Fashion-MNIST with ``small_cnn``.
* ``quick-step-b``: ``quick`` with the schedule of the seed blog and the unofficial
  reproduction (github.com/Mephisto405/Unsupervised-Out-of-Distribution-Detection-by-Maximum-
  Classifier-Discrepancy): Step B only, one optimizer, lr 0.001, weight decay 5e-4, batches of 64.
* ``notebook``, ``notebook-quick``: the settings of notebooks 04-05 (``notebook-quick`` under
  ``MCD_QUICK=1``).
* ``paper-cifar10-densenet``, ``paper-cifar10-wrn``, ``paper-cifar100-densenet``,
  ``paper-cifar100-wrn``: the paper's protocol (GPU-sized: 300 pre-training epochs).
  ID CIFAR-10/100; OOD ODIN's five folders and its two noise sets; pre-training as the unofficial
  reproduction does it (300 epochs, SGD lr 0.1, momentum 0.9, weight decay 5e-4, lr x 0.1 at
  epochs 150 and 225); fine-tuning as the authors' code (``solver.py``) does it: Step A then
  Step B each iteration, SGD lr 0.01 constant, momentum 0.9, weight decay 1e-4, 10 epochs,
  batch 128 + 128, margin 1.2 nats, the epoch with the best validation AUROC kept.
* ``unofficial-cifar10-densenet``: ``paper-cifar10-densenet`` with the Step-B-only schedule.

Not reproduced (no config field): the pre-training augmentation of the unofficial reproduction
(random flips and 4-pixel-padded crops); ``train.pretrain`` sees the images as they are.
"""
from __future__ import annotations

import dataclasses

from ..data.cifar import CIFAR_OOD_SETS
from .config import MCDConfig

__all__ = ["PRESETS", "get_preset", "describe_preset"]

# The paper's protocol, shared by the four paper presets.
_PAPER = dict(
    ood_sets=CIFAR_OOD_SETS, ood_size=10_000, n_val=1000, split_seed=3,
    # pre-training: unofficial reproduction (not in the official code, which ships checkpoints)
    pretrain_epochs=300, pretrain_lr=0.1, pretrain_momentum=0.9, pretrain_weight_decay=5e-4,
    pretrain_milestones=(150, 225), pretrain_batch_size=128,  # batch size: uncertain, not given
    # fine-tuning: official solver.py
    schedule="official", strategies=("separate",), finetune_epochs=10, steps_per_epoch=0,
    finetune_lr=0.01, finetune_momentum=0.9, finetune_weight_decay=1e-4,
    batch_size_sup=128, batch_size_unsup=128, margin=1.2,
    eval_batch_size=500, device="cuda",
)
# Seed blog / unofficial reproduction: Step B only (separate forwards), one optimizer.
_STEP_B = dict(schedule="step_b", finetune_lr=0.001, finetune_weight_decay=5e-4, batch_size_sup=64,
               batch_size_unsup=64)

PRESETS: dict[str, MCDConfig] = {
    # CPU-sized: Fashion-MNIST, small_cnn (BatchNorm), 4 pre-training epochs, one fine-tuning
    # epoch capped at 150 iterations of Step A + Step B, the official schedule otherwise.
    # lr 0.003 instead of the official 0.01: see the README (ID accuracy under separate forwards).
    "quick": MCDConfig(pretrain_epochs=4, pretrain_milestones=(3,), steps_per_epoch=150, finetune_lr=0.003),
    # Same pre-trained network as "quick" (same pre-training fields), the blog's fine-tuning.
    "quick-step-b": MCDConfig(pretrain_epochs=4, pretrain_milestones=(3,), steps_per_epoch=150, **_STEP_B),
    # Notebooks 04-05 without MCD_QUICK: the "quick" pre-trained network, 3 epochs of 150 steps.
    "notebook": MCDConfig(pretrain_epochs=4, pretrain_milestones=(3,), steps_per_epoch=150, finetune_epochs=3,
                          finetune_lr=0.003, strategies=("separate",)),
    # Notebooks 04-05 with MCD_QUICK=1 (headless, <= 3 minutes each on 2 cores, cold cache): pre-training
    # on the first 15,000 training images for 2 epochs; 3 fine-tuning epochs of 30 steps with batches
    # of 64 + 64 at lr 0.005 (the official 0.01 raises the labeled CE within so few steps, the quick
    # preset's 0.003 needs more of them); 500 validation images of each of ID and OOD (official:
    # 1,000); a 1,500-image ID test set (500 validation + 1,000 test); 1,000-image generated OOD sets
    # (500 validation + 500 test); ODIN's search at T = 1000 only.
    "notebook-quick": MCDConfig(train_subset=15_000, test_subset=1500, n_val=500, ood_size=1000,
                                pretrain_epochs=2, pretrain_milestones=(1,), steps_per_epoch=30,
                                finetune_epochs=3, finetune_lr=0.005, batch_size_sup=64, batch_size_unsup=64,
                                strategies=("separate",),
                                extra={"odin_temperatures": (1000.0,), "odin_epsilons": (0.0, 0.001, 0.002, 0.004)}),
    "paper-cifar10-densenet": MCDConfig(id_dataset="cifar10", model="densenet_bc_100", **_PAPER),
    "paper-cifar10-wrn": MCDConfig(id_dataset="cifar10", model="wrn_28_10", **_PAPER),
    "paper-cifar100-densenet": MCDConfig(id_dataset="cifar100", model="densenet_bc_100", **_PAPER),
    "paper-cifar100-wrn": MCDConfig(id_dataset="cifar100", model="wrn_28_10", **_PAPER),
    "unofficial-cifar10-densenet": MCDConfig(id_dataset="cifar10", model="densenet_bc_100",
                                             **{**_PAPER, **_STEP_B}),
}


def get_preset(name: str, **overrides) -> MCDConfig:
    """A copy of preset ``name`` with ``overrides`` applied.

    Raises:
        KeyError: on an unknown preset name (the message lists the known ones).
        TypeError: on an override that is not a config field.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **overrides)


def describe_preset(name: str) -> dict:
    """The fields in which preset ``name`` differs from the :class:`MCDConfig` defaults.

    Raises:
        KeyError: on an unknown preset name.
    """
    cfg, base = get_preset(name), MCDConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name != "extra" and getattr(cfg, f.name) != getattr(base, f.name)}
