"""Settings of a run: one dataclass whose defaults say where they come from, and the named presets.

Every field is a flag of ``python -m mcd_helpers reproduce`` (``finetune_lr`` -> ``--finetune-lr``) and
is stored with the results (``config.json``). A value that cannot work raises
:class:`~mcd_helpers.errors.ConfigError` naming the field; checks that need the data run before
any training (:func:`mcd_helpers.run.run_reproduction`).
"""

import dataclasses
import math

import torch

from .data import ID_DATASETS, OFFLINE_OOD_SETS, OOD_SETS
from .errors import ConfigError
from .forwards import BN_ONLY, STRATEGIES
from .models import MODELS, NORMS
from .splits import PROTOCOLS, class_split

FINETUNE_SCHEDULES = ("official", "step_b")  # Step A then Step B each iteration | Step B only
SELECTIONS = ("ood-labels", "last-epoch")  # best validation AUROC (official) | the last epoch, no OOD label
HELD_OUT = "heldout"  # the OOD "set" of a near-OOD task: the held-out classes of class_split
# What determines the pre-trained network (its cache key); the other fields change only fine-tuning.
PRETRAIN_FIELDS = ("id_dataset", "model", "norm", "pretrain_epochs", "pretrain_lr", "pretrain_momentum",
                   "pretrain_weight_decay", "pretrain_milestones", "pretrain_batch_size", "seed", "train_subset", "amp",
                   "class_split", "protocol", "n_holdout", "split_seed")
# Left out of every cache key, so they may change between a run and its resume: how and where to run
# (num_threads, device, eval_batch_size, the GPU options: the machine decides them, at rounding level),
# and what only picks or evaluates (selection picks one of the two weights a fine-tuning keeps; the ODIN
# grid, ood_sets, strategies). A computation the user chooses enters the keys even when it is rounding
# only: amp does (PRETRAIN_FIELDS), and channels_last does when on, since its rounding, amplified by
# training, gave another network (MSP FPR95 8.59 -> 46.82%, docs/speed.md).
RUN_FIELDS = ("selection", "sync_bn", "device", "num_threads", "eval_batch_size", "checkpoint_every", "channels_last",
              "compile", "data_on_device", "ood_sets", "strategies", "odin_temperatures", "odin_epsilons")


def native_bf16(device: str = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX-512 BF16
    or AMX (oneDNN's bf16 kernels; other CPUs emulate bf16, slower than float32)."""
    if str(device).split(":")[0] == "cuda":  # without emulation: emulated bf16 is slower than float32
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return str(device) == "cpu" and any(getattr(torch.cpu, f, bool)() for f in ("_is_avx512_bf16_supported",
                                                                           "_is_amx_tile_supported"))


@dataclasses.dataclass
class MCDConfig:
    """Hyperparameters of one reproduction run (pre-training, then fine-tuning per OOD set and strategy).

    Raises:
        ConfigError: (a ValueError) on a value that cannot work; ``field`` names it, ``flag`` its flag.
    """

    # --- data ---
    id_dataset: str = "fashion_mnist"  # the ID set: fashion_mnist | cifar10 | cifar100 (data.ID_DATASETS)
    ood_sets: tuple[str, ...] = OFFLINE_OOD_SETS  # add "mnist" when it is on disk
    ood_size: int = 10_000  # images of each generated OOD set (ODIN's 10,000)
    n_val: int = 1000  # validation images of each of ID and OOD (official loader)
    split_seed: int = 3  # official loader: np.random.seed(3)
    train_subset: int = 0  # 0 = every ID training image; N > 0 = the first N (fast tests and demos)
    test_subset: int = 0  # 0 = the whole ID test set; N > 0 = its first N, before the split

    # --- near-OOD task (held-out classes) and protocol ---
    class_split: str = ""  # "" = every ID class; a name of splits.CLASS_SPLITS (6 known / 4 held out) or "IDS/OODS"
    protocol: str = "transductive"  # transductive (paper) | disjoint | unseen-ood (splits.PROTOCOLS)
    selection: str = "ood-labels"  # ood-labels (official: best validation AUROC) | last-epoch
    n_holdout: int = 6000  # disjoint / unseen-ood: ID training images held out as the unlabeled pool's ID part
    unlabeled_ood: str = "digits"  # unseen-ood: the source of the unlabeled OOD images (the test OOD: held-out classes)
    unlabeled_ood_fraction: float = 1.0  # disjoint / unseen-ood: fraction of the pool's unlabeled OOD images kept

    # --- model ---
    model: str = "small_cnn"  # small_cnn | resnet_20 | densenet_bc_100 | wrn_28_10
    norm: str = "batch"  # small_cnn only: batch | group | none

    # --- pre-training: CE on both heads (not in the official code, which ships checkpoints) ---
    pretrain_epochs: int = 3  # epochs of supervised pre-training (paper-sized: 300)
    pretrain_lr: float = 0.05  # SGD learning rate of pre-training, before the milestones
    pretrain_momentum: float = 0.9  # SGD momentum of pre-training
    pretrain_weight_decay: float = 5e-4  # unofficial reproduction
    pretrain_milestones: tuple[int, ...] = (2,)  # lr x 0.1 at these epochs (paper-sized: 150, 225)
    pretrain_batch_size: int = 128  # labeled images per pre-training step

    # --- fine-tuning: official code (solver.py) unless said otherwise ---
    schedule: str = "official"  # official: Step A then Step B each iteration | step_b: Step B only
    strategies: tuple[str, ...] = ("separate", "concat")  # separate|concat|concat-both|split-bn|recalibrate|frozen-bn|frozen-bn-concat
    finetune_epochs: int = 1  # official: 10
    steps_per_epoch: int = 0  # 0 = one pass over the labeled set (official); > 0 caps it
    finetune_lr: float = 0.01  # official: constant 0.01 (paper text: 0.1, uncertain)
    finetune_momentum: float = 0.9  # official train.py: 0.9
    finetune_weight_decay: float = 1e-4  # official train.py: 1e-4 (its resumed optimizer state: notebook 05)
    batch_size_sup: int = 128  # labeled ID images per step (official train.py: 128)
    batch_size_unsup: int = 128  # unlabeled images per step (official: the same loader batch size, 128)
    margin: float = 1.2  # nats, official default
    bn_momentum: float = 0.1  # BatchNorm's running-statistics momentum in fine-tuning (PyTorch's and the official 0.1)

    # --- baselines: ODIN's grid (paper Sec. 4.2: T in 1..1000, eps in 0..0.004), a coarser one of the same range ---
    odin_temperatures: tuple[float, ...] = (1.0, 10.0, 100.0, 1000.0)  # ODIN: softmax temperatures T searched
    odin_epsilons: tuple[float, ...] = (0.0, 0.0005, 0.001, 0.0014, 0.002, 0.003, 0.004)  # ODIN: input perturbations

    # --- run ---
    seed: int = 0  # seeds the weights, the data order and the generated OOD sets
    eval_batch_size: int = 250  # images per evaluation forward (speed and memory, not results: docs/speed.md)
    device: str = "cpu"  # cpu, cuda, cuda:1, mps
    num_threads: int = 0  # 0 = PyTorch's default
    checkpoint_every: int = 50  # steps between checkpoints (and at every epoch end); 0 = epoch ends only

    # --- fast path, all off by default (the quick presets turn on the first two); on the CPU channels_last and
    # bf16 autocast help (benchmarks/cpu_settings.py, docs/speed.md); the others are for GPUs ---
    amp: str = "none"  # "bf16": bfloat16 autocast (float32's range: no loss scaling); "auto": bf16 where native
    channels_last: bool = False  # NHWC memory format for model and batches
    compile: bool = False  # torch.compile the feature extractor G (dynamic=False: one graph per batch shape)
    data_on_device: bool = False  # hold the whole data set on the device and gather batches there
    sync_bn: bool = False  # under torchrun: SyncBatchNorm, statistics over the global batch (GPUs only)

    def __post_init__(self) -> None:
        for name in ("ood_sets", "strategies", "pretrain_milestones", "odin_temperatures", "odin_epsilons"):
            setattr(self, name, tuple(getattr(self, name)))
        choices = {"id_dataset": ID_DATASETS, "model": MODELS, "norm": NORMS, "schedule": FINETUNE_SCHEDULES,
                   "protocol": PROTOCOLS, "selection": SELECTIONS, "amp": ("none", "bf16", "auto")}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ConfigError(name, f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}.")
        at_least = {"ood_size": 1, "n_val": 1, "train_subset": 0, "test_subset": 0, "n_holdout": 1,
                    "pretrain_epochs": 1, "pretrain_batch_size": 1, "finetune_epochs": 1, "steps_per_epoch": 0,
                    "batch_size_sup": 1, "batch_size_unsup": 1, "eval_batch_size": 1, "num_threads": 0,
                    "checkpoint_every": 0, "seed": 0, "split_seed": 0, "margin": 0.0, "pretrain_momentum": 0.0,
                    "finetune_momentum": 0.0, "pretrain_weight_decay": 0.0, "finetune_weight_decay": 0.0,
                    "unlabeled_ood_fraction": 0.0, "bn_momentum": 0.0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
                raise ConfigError(name, f"{name} must be a finite number >= {low}, got {value!r}.")
        checks = [(name, isinstance(value := getattr(self, name), (int, float)) and math.isfinite(value) and value > 0,
                   f"{name} must be a number > 0, got {value!r}") for name in ("pretrain_lr", "finetune_lr")]
        checks += [(name, getattr(self, name) < high, f"{name} must be below {text}") for name, high, text in (
            ("seed", 2**32, "2**32"), ("split_seed", 2**32, "2**32"),
            ("pretrain_momentum", 1, "1"), ("finetune_momentum", 1, "1"))]
        checks += [
            ("margin", self.margin <= 3.4e38, f"margin must be at most 3.4e38 nats (float32's largest number; the loss "
                                              f"would be inf), got {self.margin}; the official margin is 1.2"),
            ("strategies", self.strategies and set(self.strategies) <= set(STRATEGIES),
             f"strategies must be a non-empty subset of {STRATEGIES}, got {self.strategies}"),
            ("strategies", self.norm == "batch" or not set(BN_ONLY) & set(self.strategies),
             f"strategies {', '.join(BN_ONLY)} need norm='batch'; with norm={self.norm!r} use separate, concat or concat-both"),
            ("norm", self.model == "small_cnn" or self.norm == "batch", f"norm={self.norm!r} is for small_cnn only"),
            ("sync_bn", not self.sync_bn or self.device.startswith("cuda"),
             f"--sync-bn needs GPUs (in torch 2.14.1 SyncBatchNorm has no CPU kernel), got device {self.device!r}"),
            ("pretrain_milestones", all(m >= 0 for m in self.pretrain_milestones), "milestones must be epochs >= 0"),
            ("ood_sets", len(self.ood_sets) > 0, "name at least one OOD set"),
            ("class_split", not self.class_split or self.id_dataset == "fashion_mnist",
             f"class_split needs fashion_mnist, got id_dataset {self.id_dataset!r}"),
            ("protocol", self.protocol == "transductive" or self.class_split,
             f"protocol {self.protocol!r} needs a class_split (held-out classes); the OOD-set tasks are transductive"),
            ("bn_momentum", self.bn_momentum <= 1, f"bn_momentum must be at most 1 (1 keeps only the last batch's "
                                                   f"statistics), got {self.bn_momentum}"),
            ("unlabeled_ood_fraction", self.unlabeled_ood_fraction <= 1 and (self.protocol != "transductive" or
                                        self.unlabeled_ood_fraction == 1), "unlabeled_ood_fraction must be at most 1, "
             f"and 1 under protocol transductive (its unlabeled set is the test set), got {self.unlabeled_ood_fraction}"),
            ("odin_temperatures", self.odin_temperatures and all(0 < t < math.inf for t in self.odin_temperatures),
             f"ODIN's grid needs finite temperatures > 0, got {self.odin_temperatures}"),
            ("odin_epsilons", self.odin_epsilons and all(0 <= e < math.inf for e in self.odin_epsilons),
             f"ODIN's grid needs finite epsilons >= 0, got {self.odin_epsilons}"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ConfigError(name, message + ".")
        if self.class_split:
            class_split(self.class_split)  # a known name or "IDS/OODS"; ConfigError otherwise

    def check_ood_sets(self) -> None:
        """Raise ConfigError unless every name in ``ood_sets`` can be loaded for ``id_dataset`` (not in
        ``__post_init__``: notebooks and tests may pass their own OOD tensors under other names)."""
        known = OOD_SETS[self.id_dataset] + ((HELD_OUT,) if self.class_split else ())
        if self.protocol != "transductive" and (far := [o for o in self.ood_sets if o != HELD_OUT]):
            raise ConfigError("ood_sets", f"protocol {self.protocol!r} is for the held-out classes only; OOD set(s) "
                                          f"{far} run under the transductive protocol. Pass --ood-sets {HELD_OUT}.")
        if unknown := [o for o in self.ood_sets if o not in known]:
            raise ConfigError("ood_sets", f"unknown OOD set(s) {unknown} for {self.id_dataset}; choose from "
                                          f"{', '.join(known)}.")

    def resolved_amp(self) -> str:
        """``amp`` with ``"auto"`` resolved for ``device`` when asked (a preset's ``--device cuda`` too):
        ``"bf16"`` where :func:`native_bf16`, else ``"none"``. What trains, and what the cache keys hold."""
        return ("bf16" if native_bf16(self.device) else "none") if self.amp == "auto" else self.amp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The paper's protocol (GPU-sized): CIFAR, ODIN's five folders and two noise sets; pre-training as the
# unofficial reproduction does it (300 epochs, SGD 0.1, lr x 0.1 at 150 and 225; batch size not given);
# fine-tuning as the authors' solver.py: Step A then Step B, SGD lr 0.01 constant, 10 epochs, 128 + 128.
_PAPER = dict(ood_sets=OOD_SETS["cifar10"], pretrain_epochs=300, pretrain_lr=0.1, pretrain_milestones=(150, 225),
              strategies=("separate",), finetune_epochs=10, eval_batch_size=500, device="cuda")
# The seed blog's and the unofficial reproduction's fine-tuning: Step B only, one optimizer, lr 0.001.
_STEP_B = dict(schedule="step_b", finetune_lr=0.001, finetune_weight_decay=5e-4, batch_size_sup=64, batch_size_unsup=64)
# CPU-sized, the fastest measured CPU settings (docs/speed.md): NHWC, and bf16 autocast where the CPU has it natively.
_QUICK = dict(pretrain_epochs=6, pretrain_milestones=(4,), steps_per_epoch=150, channels_last=True, amp="auto")

PRESETS: dict[str, MCDConfig] = {
    # Fashion-MNIST, small_cnn (BatchNorm), 6 pre-training epochs, one fine-tuning epoch of 150 iterations; lr 0.003
    # instead of the official 0.01 (docs/results.md: ID accuracy under separate forwards; with 4 pre-training
    # epochs separate's ID accuracy on Gaussian noise was 87.6%, with 6 88.6%).
    "quick": MCDConfig(**_QUICK, finetune_lr=0.003),
    "quick-step-b": MCDConfig(**_QUICK, **_STEP_B),  # the same pre-trained network, the blog's fine-tuning
    # Notebooks 04-05 in full mode: the "quick" pre-trained network, 3 fine-tuning epochs.
    "notebook": MCDConfig(**_QUICK, finetune_epochs=3, finetune_lr=0.003, strategies=("separate",)),
    # Notebooks 04-05 with MCD_QUICK=1 (<= 3 minutes each on 2 cores, cold cache): 15,000 training images, 2
    # pre-training epochs, 3 fine-tuning epochs of 30 steps of 64 + 64 at lr 0.005 (0.01 raises the labeled CE
    # within so few steps), 500 + 500 validation images, 1,500 ID test images, 1,000-image generated OOD sets.
    "notebook-quick": MCDConfig(train_subset=15_000, test_subset=1500, n_val=500, ood_size=1000, pretrain_epochs=2,
                                pretrain_milestones=(1,), steps_per_epoch=30, finetune_epochs=3, finetune_lr=0.005,
                                batch_size_sup=64, batch_size_unsup=64, strategies=("separate",),
                                odin_temperatures=(1000.0,), odin_epsilons=(0.0, 0.001, 0.002, 0.004)),
    **{f"paper-{id_set}-{net}": MCDConfig(id_dataset=id_set, model=model, **_PAPER)
       for id_set in ("cifar10", "cifar100") for net, model in (("densenet", "densenet_bc_100"), ("wrn", "wrn_28_10"))},
    "unofficial-cifar10-densenet": MCDConfig(id_dataset="cifar10", model="densenet_bc_100", **{**_PAPER, **_STEP_B}),
}
# Named presets of ``reproduce --preset NAME``; every field can still be overridden by its flag.
# Not reproduced (no field): the unofficial pre-training's flips and padded crops.


def get_preset(name: str, **overrides) -> MCDConfig:
    """A copy of preset ``name`` with ``overrides`` applied.

    Raises:
        KeyError: an unknown preset (the message lists them). TypeError: an override that is no field.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}.")
    return dataclasses.replace(PRESETS[name], **overrides)
