"""Run configuration: one dataclass whose defaults say where they come from (presets: ``presets.py``).

Every field is a CLI flag of ``python -m mcd_helpers reproduce`` (``--finetune-lr 0.001`` sets
``finetune_lr``). The config is stored in every checkpoint and in ``results.json``'s folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from .data import OFFLINE_OOD_SETS

__all__ = ["MCDConfig", "STRATEGIES", "SCHEDULES"]

STRATEGIES = ("separate", "concat")
SCHEDULES = ("official", "step_b")


@dataclass
class MCDConfig:
    """Hyperparameters of one reproduction run (pre-training + fine-tuning per OOD set and strategy)."""

    # --- data ---
    id_dataset: str = "fashion_mnist"
    ood_sets: tuple[str, ...] = OFFLINE_OOD_SETS  # offline sets; add "mnist" when it is on disk
    ood_size: int = 10_000  # size of the generated OOD sets (ODIN's 10,000)
    n_val: int = 1000  # validation samples of each of ID and OOD (official loader)
    split_seed: int = 3  # official loader: np.random.seed(3)

    # --- model ---
    model: str = "small_cnn"  # small_cnn | densenet_bc_100 | wrn_28_10
    norm: str = "batch"  # small_cnn only: batch | group | none

    # --- pre-training: CE on both heads (not in the official code, which ships checkpoints) ---
    pretrain_epochs: int = 3
    pretrain_lr: float = 0.05
    pretrain_momentum: float = 0.9
    pretrain_weight_decay: float = 5e-4  # unofficial reproduction
    pretrain_milestones: tuple[int, ...] = (2,)  # lr x 0.1 at these epochs (paper-sized: 150, 225)
    pretrain_batch_size: int = 128

    # --- fine-tuning: official code (solver.py) unless said otherwise ---
    schedule: str = "official"  # official: Step A then Step B each iteration | step_b: Step B only
    strategies: tuple[str, ...] = STRATEGIES  # how Step B feeds x_sup and x_unsup
    finetune_epochs: int = 1  # official: 10
    steps_per_epoch: int = 0  # 0 = one pass over the labeled set (official); >0 caps it
    finetune_lr: float = 0.01  # official: constant 0.01 (paper text: 0.1, uncertain)
    finetune_momentum: float = 0.9
    finetune_weight_decay: float = 1e-4
    batch_size_sup: int = 128
    batch_size_unsup: int = 128
    margin: float = 1.2  # nats, official default

    # --- run ---
    seed: int = 0
    eval_batch_size: int = 1000
    device: str = "cpu"
    num_threads: int = 0  # 0 = PyTorch's default

    extra: dict = field(default_factory=dict)  # free-form notes stored with the results

    def __post_init__(self) -> None:
        from .models import NORMS

        checks = [
            (self.model in ("small_cnn", "densenet_bc_100", "wrn_28_10"),
             f"model must be small_cnn, densenet_bc_100 or wrn_28_10, got {self.model!r}"),
            (self.norm in NORMS, f"norm must be one of {NORMS}, got {self.norm!r}"),
            (self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}"),
            (len(self.strategies) > 0 and all(s in STRATEGIES for s in self.strategies),
             f"strategies must be a non-empty subset of {STRATEGIES}, got {self.strategies!r}"),
            (len(self.ood_sets) > 0, "ood_sets is empty: name at least one OOD set"),
            (self.margin >= 0, f"margin must be >= 0 nats, got {self.margin}"),
            (min(self.batch_size_sup, self.batch_size_unsup, self.pretrain_batch_size) > 0,
             "batch sizes must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg + ".")
        self.ood_sets = tuple(self.ood_sets)
        self.strategies = tuple(self.strategies)
        self.pretrain_milestones = tuple(self.pretrain_milestones)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def pretrain_key(self) -> str:
        """Short hash of everything that determines the pre-trained network (its cache key)."""
        keys = ("id_dataset", "model", "norm", "pretrain_epochs", "pretrain_lr", "pretrain_momentum",
                "pretrain_weight_decay", "pretrain_milestones", "pretrain_batch_size", "seed")
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
