"""Run configuration: one dataclass whose defaults say where they come from (presets: ``presets.py``).

Every field is a CLI flag of ``python -m mcd_helpers reproduce`` (``--finetune-lr 0.001`` sets
``finetune_lr``). The config is stored in every checkpoint and in ``results.json``'s folder.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..data.cifar import CIFAR_OOD_SETS
from ..data.sets import ID_DATASETS, OFFLINE_OOD_SETS
from ..data.nearood import PROTOCOLS, SELECTIONS, class_split
from ..errors import ConfigError
from ..steps import STRATEGIES

__all__ = ["MCDConfig", "STRATEGIES", "SCHEDULES", "AMP_MODES", "RUN_FIELDS", "PRETRAIN_FIELDS"]

SCHEDULES = ("official", "step_b")
AMP_MODES = ("none", "bf16")
# What determines the pre-trained network (its cache key); the other fields only change fine-tuning.
PRETRAIN_FIELDS = ("id_dataset", "model", "norm", "pretrain_epochs", "pretrain_lr", "pretrain_momentum",
                   "pretrain_weight_decay", "pretrain_milestones", "pretrain_batch_size", "seed", "train_subset", "amp",
                   "class_split", "protocol", "n_holdout", "split_seed")
# Fields that say how to run, not what to compute: left out of the cache key
# (:func:`mcd_helpers.experiments.cache.cache_key`), so they may change between an interrupted run and
# its resume, or between a notebook and the command line. num_threads, eval_batch_size and the GPU
# options change the numbers only at float rounding level (~1e-7 on gradients between 1 and 2 CPU
# threads). The world size and sync_bn enter the key under torchrun. selection only picks which of
# the two weights a fine-tuning keeps (best validation AUROC or last epoch): the training is the same.
RUN_FIELDS = ("selection", "sync_bn", "device", "num_threads", "eval_batch_size", "checkpoint_every", "channels_last",
              "compile", "data_on_device", "extra", "ood_sets", "strategies")


@dataclass
class MCDConfig:
    """Hyperparameters of one reproduction run (pre-training + fine-tuning per OOD set and strategy).

    Raises:
        ConfigError: (a ``ValueError``) on a value that cannot work; its ``field`` names the field
            and ``flag`` the command-line flag. Checks that need the data (batch sizes and ``n_val``
            against the split, memory for ``ood_size``) run in
            :func:`mcd_helpers.experiments.run.check_sizes`, before any training.
    """

    # --- data ---
    id_dataset: str = "fashion_mnist"
    ood_sets: tuple[str, ...] = OFFLINE_OOD_SETS  # offline sets; add "mnist" when it is on disk
    ood_size: int = 10_000  # size of the generated OOD sets (ODIN's 10,000)
    n_val: int = 1000  # validation samples of each of ID and OOD (official loader)
    split_seed: int = 3  # official loader: np.random.seed(3)
    train_subset: int = 0  # 0 = every ID training image; N > 0 = the first N (fast tests and demos)
    test_subset: int = 0  # 0 = the whole ID test set; N > 0 = its first N, before the split (fast tests)

    # --- near-OOD task and protocol (issue "experiments that can tell the answers apart") ---
    class_split: str = ""  # "" = all ID classes; a name of data.nearood.CLASS_SPLITS (6 known / 4 held-out) or "IDS/OODS"
    protocol: str = "transductive"  # transductive (paper) | disjoint | unseen-ood (data.nearood.PROTOCOLS)
    selection: str = "ood-labels"  # ood-labels (official: best validation AUROC) | last-epoch
    n_holdout: int = 6000  # disjoint / unseen-ood: ID training images held out of the labeled set (unlabeled pool)
    far_ood: str = "digits"  # unseen-ood: the source of the unlabeled OOD images (the test OOD is the held-out classes)

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
    strategies: tuple[str, ...] = ("separate", "concat")  # how Step B feeds x_sup and x_unsup (steps.STRATEGIES)
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
    checkpoint_every: int = 50  # steps between checkpoints (and at every epoch end); 0 = epoch ends only.
    # A small_cnn checkpoint costs a few ms, so 50 steps keep it well under 1% of the run.

    # --- fast path: all off by default; on CPU only channels_last helps (small_cnn: 1.33x
    # faster training and 1.63x faster evaluation on 2 cores, benchmarks/channels_last.py); the others are for GPUs ---
    amp: str = "none"  # "bf16": bfloat16 autocast; bf16 has float32's range, so no loss scaling
    channels_last: bool = False  # NHWC memory format for model and batches (faster convs on tensor cores)
    compile: bool = False  # torch.compile the feature extractor G (dynamic=False: one graph per batch shape)
    data_on_device: bool = False  # hold the whole data set on the device; batches are gathered there

    # --- torchrun (DDP): ignored in a single process ---
    sync_bn: bool = False  # SyncBatchNorm: BatchNorm statistics over the global batch (GPUs only)

    extra: dict = field(default_factory=dict)  # free-form notes stored with the results

    def __post_init__(self) -> None:
        from ..models import NORMS

        f32_max = torch.finfo(torch.float32).max
        checks = [
            ("model", self.model in ("small_cnn", "densenet_bc_100", "wrn_28_10"),
             f"model must be small_cnn, densenet_bc_100 or wrn_28_10, got {self.model!r}"),
            ("norm", self.norm in NORMS, f"norm must be one of {NORMS}, got {self.norm!r}"),
            ("schedule", self.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {self.schedule!r}"),
            ("strategies", len(self.strategies) > 0 and all(s in STRATEGIES for s in self.strategies),
             f"strategies must be a non-empty subset of {STRATEGIES}, got {self.strategies!r}"),

            ("class_split", self.class_split == "" or self.id_dataset == "fashion_mnist",
             f"class_split applies to fashion_mnist only, got id_dataset={self.id_dataset!r}"),
            ("protocol", self.protocol in PROTOCOLS, f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}"),
            ("protocol", self.protocol == "transductive" or self.class_split != "",
             f"protocol {self.protocol!r} needs a class_split (held-out classes); the OOD-set tasks are transductive"),
            ("selection", self.selection in SELECTIONS, f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}"),
            ("n_holdout", self.n_holdout >= 1, f"n_holdout must be >= 1 held-out ID training image, got {self.n_holdout}"),
            ("ood_sets", len(self.ood_sets) > 0, "ood_sets is empty: name at least one OOD set"),
            ("margin", self.margin >= 0, f"margin must be >= 0 nats, got {self.margin}"),
            ("batch_size_sup", self.batch_size_sup > 0, f"batch_size_sup must be positive, got {self.batch_size_sup}"),
            ("batch_size_unsup", self.batch_size_unsup > 0, f"batch_size_unsup must be positive, got {self.batch_size_unsup}"),
            ("pretrain_batch_size", self.pretrain_batch_size > 0,
             f"pretrain_batch_size must be positive, got {self.pretrain_batch_size}"),
            ("amp", self.amp in AMP_MODES, f"amp must be one of {AMP_MODES}, got {self.amp!r}"),
            ("checkpoint_every", self.checkpoint_every >= 0, f"checkpoint_every must be >= 0 steps (0 = epoch ends only), "
                                                             f"got {self.checkpoint_every}"),
            ("train_subset", self.train_subset >= 0, f"train_subset must be >= 0 (0 = all training images), got {self.train_subset}"),
            ("test_subset", self.test_subset >= 0, f"test_subset must be >= 0 (0 = the whole test set), got {self.test_subset}"),
            ("id_dataset", self.id_dataset in ID_DATASETS, f"id_dataset must be one of {ID_DATASETS}, got {self.id_dataset!r}"),
            ("strategies", self.norm == "batch" or not {"split-bn", "recalibrate"} & set(self.strategies),
             f"strategies split-bn and recalibrate change BatchNorm statistics and need norm='batch'; with "
             f"norm={self.norm!r} use separate or concat (they are equal without BatchNorm), got {tuple(self.strategies)}"),
            ("norm", self.model == "small_cnn" or self.norm == "batch",
             f"norm={self.norm!r} applies to small_cnn only; {self.model} always uses BatchNorm (leave norm=batch)"),
            ("n_val", self.n_val >= 1, f"n_val must be >= 1 validation sample of each of ID and OOD (official: 1000), got {self.n_val}"),
            ("ood_size", self.ood_size >= 1, f"ood_size must be >= 1 generated OOD image, got {self.ood_size}"),
            ("pretrain_epochs", self.pretrain_epochs >= 1, f"pretrain_epochs must be >= 1, got {self.pretrain_epochs}"),
            ("finetune_epochs", self.finetune_epochs >= 1, f"finetune_epochs must be >= 1, got {self.finetune_epochs}"),
            ("steps_per_epoch", self.steps_per_epoch >= 0, f"steps_per_epoch must be >= 0 (0 = a full pass), got {self.steps_per_epoch}"),
            ("eval_batch_size", self.eval_batch_size >= 1, f"eval_batch_size must be >= 1, got {self.eval_batch_size}"),
            ("seed", 0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}"),
            ("split_seed", 0 <= self.split_seed < 2**32,
             f"split_seed must be in [0, 2**32) (NumPy's RandomState; official: 3), got {self.split_seed}"),
            ("margin", math.isfinite(self.margin), f"margin must be a finite number of nats, got {self.margin}"),
            ("margin", not math.isfinite(self.margin) or self.margin <= f32_max,
             f"margin must be at most {f32_max:.4g} nats (float32's largest number: the loss is computed in "
             f"float32 and a larger margin becomes inf), got {self.margin}; the official margin is 1.2"),
            ("num_threads", self.num_threads >= 0, f"num_threads must be >= 0 (0 = PyTorch's default), got {self.num_threads}"),
            ("pretrain_milestones", all(m >= 0 for m in self.pretrain_milestones),
             f"pretrain_milestones must be epochs >= 0, got {tuple(self.pretrain_milestones)}"),
        ]
        for name in ("pretrain_lr", "finetune_lr"):
            value = getattr(self, name)
            checks.append((name, math.isfinite(value) and value > 0, f"{name} must be a positive number, got {value}"))
        for name in ("pretrain_momentum", "finetune_momentum", "pretrain_weight_decay", "finetune_weight_decay"):
            value = getattr(self, name)
            ok = math.isfinite(value) and value >= 0 and (value < 1 or "decay" in name)
            checks.append((name, ok, f"{name} must be {'in [0, 1)' if 'momentum' in name else '>= 0'}, got {value}"))
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            checks.append(("device", False, f"device must be a torch device such as cpu or cuda, got {self.device!r}"))
        else:
            checks.append(("device", device.type in ("cpu", "cuda", "mps", "xpu"),
                           f"device must be cpu or cuda (or mps/xpu), got {self.device!r}"))
        for name, ok, msg in checks:
            if not ok:
                raise ConfigError(name, msg + ".")
        if self.class_split:
            class_split(self.class_split)  # a known name or "IDS/OODS"; raises ConfigError otherwise
        self.ood_sets = tuple(self.ood_sets)
        self.strategies = tuple(self.strategies)
        self.pretrain_milestones = tuple(self.pretrain_milestones)

    def check_ood_sets(self) -> None:
        """Raise :class:`~mcd_helpers.errors.ConfigError` (a ``ValueError``) naming the known sets if ``ood_sets`` holds a name the loaders lack.

        Called by :func:`~mcd_helpers.experiments.run.run_reproduction` before any work (not in
        ``__post_init__``: notebooks and tests may pass their own OOD tensors under other names).
        """
        known = OFFLINE_OOD_SETS + ("mnist",) if self.id_dataset == "fashion_mnist" else CIFAR_OOD_SETS
        if self.class_split:
            known = known + ("heldout",)  # the held-out classes of the class split
        if self.protocol != "transductive":
            far = [name for name in self.ood_sets if name != "heldout"]
            if far:
                raise ConfigError("ood_sets", f"protocol {self.protocol!r} applies to the held-out classes only; "
                                              f"OOD set(s) {far} run under the transductive protocol. Pass "
                                              "--ood-sets heldout (or --protocol transductive).")
        unknown = [name for name in self.ood_sets if name not in known]
        if unknown:
            raise ConfigError("ood_sets", f"unknown OOD set(s) {unknown} for {self.id_dataset}; choose from {', '.join(known)}.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
