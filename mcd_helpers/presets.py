"""Named run presets for ``python -m mcd_helpers reproduce --preset NAME``.

Each preset is an :class:`~mcd_helpers.config.MCDConfig`; every field can still be overridden
on the command line.
"""
from __future__ import annotations

import dataclasses

from .config import MCDConfig

__all__ = ["PRESETS", "get_preset"]

PRESETS: dict[str, MCDConfig] = {
    # CPU-sized: Fashion-MNIST, small_cnn (BatchNorm), 4 pre-training epochs, one fine-tuning
    # epoch capped at 150 iterations of Step A + Step B, the official schedule otherwise.
    # lr 0.003 instead of the official 0.01: see the README (ID accuracy under separate forwards).
    "quick": MCDConfig(pretrain_epochs=4, pretrain_milestones=(3,), steps_per_epoch=150, finetune_lr=0.003),
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
