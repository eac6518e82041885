"""The stages of one experiment, each computed once and cached
(:mod:`~mcd_helpers.experiments.cache`)::

    data = load_data(cfg)                        # ID training and test images
    split = make_split(cfg, data, ood)           # labeled, unlabeled, validation, test; checked
    base = pretrained(cfg, split)                # stage "pretrain"
    model, hist, seconds = finetuned(cfg, base, split, ood, strategy)   # stage "finetune"

One fine-tuning keeps the best-validation and the last epoch's weights, so both model selections
(:func:`selected_epoch`) come from one run. How a stage runs (progress, log, checkpoints, resume,
retraining) is :class:`RunOptions`, passed through unchanged.
"""

import copy
import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..data import load_id, load_ood, set_seed
from ..errors import CheckpointError
from ..models import build_model
from ..norms import detached_stats_batchnorm, per_source_batchnorm, recalibrate_bn
from ..splits import HELD_OUT, Split, class_split, keep_classes, protocol_split, transductive_split
from ..strategies import get_strategy
from . import ddp
from .cache import cache_key, cached
from .config import check_batch_sizes
from .loop import History, train

# eval statistics recomputed after fine-tuning: at most 10,000 images
RECALIBRATION_IMAGES = 10_000
# the images recalibrated statistics come from -> the eval_stats of the rows evaluated with them
RECALIBRATION_SOURCES = {
    "labeled": "recalibrated",  # labeled ID images
    "unlabeled": "recalibrated-unlabeled",  # the unlabeled fine-tuning pool (ID and OOD)
    "mixture": "recalibrated-mixture",  # both, 2 labeled : 1 unlabeled, shuffled together
}


@dataclasses.dataclass
class RunOptions:
    """How the stages run, not what they compute (no cache key holds these)."""

    retrain: bool | set = False  # True or a set (one per run): compute each stage again, once
    progress: bool = True  # progress bars
    log: Callable | None = print  # where the log lines go; None: nowhere
    checkpoint_dir: Path | None = None  # the stages' checkpoints; None: no checkpoints
    resume: bool = False  # continue from the checkpoints in checkpoint_dir


@dataclasses.dataclass
class IDImages:
    """A run's ID images ``x_* (N, C, H, W)`` (normalised) and labels ``y_* (N,)``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def load_data(cfg) -> IDImages:
    """``cfg.id_dataset``'s training and test sets (their first ``train_subset`` / ``test_subset``
    images when those are > 0); rank 0 loads (downloads) first.

    Raises:
        DataNotFoundError: naming where it looked.
    """

    def load() -> IDImages:
        x_tr, y_tr = load_id(cfg.id_dataset, train=True)
        x_te, y_te = load_id(cfg.id_dataset, train=False)
        tr, te = slice(cfg.train_subset or None), slice(cfg.test_subset or None)
        return IDImages(x_tr[tr], y_tr[tr], x_te[te], y_te[te])

    return ddp.rank0_first(load)


def _ood_images(cfg, name: str, seed: int) -> torch.Tensor:
    """OOD set ``name``, rank 0 loading (downloading) first."""
    return ddp.rank0_first(lambda: load_ood(name, cfg.ood_size, seed, cfg.id_dataset))


def make_split(cfg, data: IDImages, ood: str) -> Split:
    """One experiment's split, checked: ``ood == "heldout"``: the held-out classes of
    ``cfg.class_split`` under ``cfg.protocol`` (:func:`~mcd_helpers.splits.protocol_split`); another
    name: that OOD set under the transductive split (with a class split, the ID classes only,
    relabelled).

    Raises:
        ConfigError: an OOD set that ``cfg`` cannot run (:meth:`MCDConfig.check_ood_set`), sizes the
            data cannot give, a batch size larger than its set (the message names the field).
    """
    cfg.check_ood_set(ood)
    x_tr, y_tr, x_te, y_te = data.x_train, data.y_train, data.x_test, data.y_test
    if ood == HELD_OUT:
        far = (
            _ood_images(cfg, cfg.unlabeled_ood, cfg.seed + 1)
            if cfg.protocol == "unseen-ood"
            else None
        )
        sizes = dict(n_val=cfg.n_val, seed=cfg.split_seed, n_holdout=cfg.n_holdout)
        classes = class_split(cfg.class_split)
        split = protocol_split(
            cfg.protocol, x_tr, y_tr, x_te, y_te, *classes, **sizes, far_ood_train=far,
            ood_fraction=cfg.unlabeled_ood_fraction,
        )  # fmt: skip
    else:
        if cfg.class_split:  # the ID classes alone, relabelled
            ids = class_split(cfg.class_split)[0]
            x_tr, y_tr = keep_classes(x_tr, y_tr, ids)
            x_te, y_te = keep_classes(x_te, y_te, ids)
        x_ood = _ood_images(cfg, ood, cfg.seed)
        split = transductive_split(x_tr, y_tr, x_te, y_te, x_ood, cfg.n_val, cfg.split_seed)
    check_batch_sizes(cfg, split, f"the {ood} split")
    return split


def _fit(
    cfg, model: nn.Module, split: Split, strategy, how: RunOptions, checkpoint, key, on_epoch=None
):
    """:func:`~mcd_helpers.experiments.loop.train` on ``model`` moved to the device (NHWC if
    asked), then DDP-wrapped; ``key``: the stage's cache key, kept with its checkpoint."""
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model.to(cfg.device, memory_format=layout)
    wrapped = ddp.wrap(model, cfg.device, cfg.sync_bn)
    return train(wrapped, split, cfg, strategy, checkpoint, how.resume, key, on_epoch, how.progress)


def _checkpoint(how: RunOptions, name: str) -> Path | None:
    return None if how.checkpoint_dir is None else Path(how.checkpoint_dir) / name


def pretrained(cfg, split: Split, how: RunOptions = RunOptions()) -> nn.Module:
    """The network pre-trained on ``split.x_sup, y_sup`` (CE on both heads), from the cache or
    trained (checkpoints in ``how.checkpoint_dir/pretrain.pt``). A plain model on the CPU.

    Raises:
        CheckpointError: the cached file holds another architecture (the message says
            ``--retrain``); what :func:`~mcd_helpers.experiments.loop.train` raises.
    """
    set_seed(cfg.seed)  # the initial weights come from the seed
    model = build_model(cfg.model, split.x_sup.shape[1], int(split.y_sup.max()) + 1, cfg.norm)
    checkpoint = _checkpoint(how, "pretrain.pt")

    def compute() -> dict:
        t0 = time.time()
        out = _fit(cfg, model, split, None, how, checkpoint, cache_key(cfg, "pretrain"))
        if how.log:
            how.log(
                f"pre-trained {cfg.model} for {cfg.pretrain_epochs} epochs in "
                f"{time.time() - t0:.0f} s"
            )
        return {
            "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "ce": out["history"].ce,
        }

    state = cached(cfg, "pretrain", compute, how.retrain, how.log, checkpoint)
    if "loaded_from" in state:
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as err:  # another architecture or width in the cached file
            raise CheckpointError(
                f"the cached network {state['loaded_from']} does not fit {cfg.model} "
                f"(norm={cfg.norm}, "
                f"{split.x_sup.shape[1]} channels, {int(split.y_sup.max()) + 1} classes): "
                f"{str(err).splitlines()[0]} Pass --retrain (retrain=True) to train it again."
            ) from err
    return model.to("cpu", memory_format=torch.contiguous_format)


def selected_epoch(hist: History, selection: str, upto: int | None = None) -> int:
    """Model selection, in one place: the epoch (<= ``upto``, default the last) whose weights are
    kept, ``"ood-labels"`` the best validation AUROC (the first of ties, as the loop keeps it),
    ``"last-epoch"`` the last.

    Raises:
        ValueError: ``upto`` is not a validated epoch.
    """
    upto = len(hist.val_auroc) - 1 if upto is None else upto
    if not 0 <= upto < len(hist.val_auroc):
        raise ValueError(
            f"epoch {upto} is not in the history's {len(hist.val_auroc)} validated epochs."
        )
    if selection == "last-epoch":
        return upto
    return max(range(upto + 1), key=lambda i: (hist.val_auroc[i], -i))


def _replay(hist: History, shown: Callable) -> None:
    """A cached run's epochs, shown one by one as the live run would have shown them."""
    per = len(hist.ce) // len(hist.val_auroc)
    for e in range(len(hist.val_auroc)):
        losses = (v[: (e + 1) * per] for v in (hist.ce, hist.dis, hist.gap, hist.step_a))
        shown(e, History(*losses, hist.val_auroc[: e + 1]))


def finetuned(
    cfg,
    base: nn.Module,
    split: Split,
    ood: str,
    strategy: str,
    how: RunOptions = RunOptions(),
    on_epoch: Callable | None = None,
) -> tuple[nn.Module, History, float]:
    """A copy of ``base`` fine-tuned with MCD and ``strategy`` (from the cache or trained after
    ``set_seed(cfg.seed)``), holding the weights of the epoch ``cfg.selection`` keeps.

    The strategy's row of :data:`~mcd_helpers.strategies.STRATEGIES` says how: a per-source
    BatchNorm copy for ``split-bn``, one with detached batch statistics for ``*-detached``;
    ``recalibrate`` shares ``separate``'s run (``trains_as``, one cache entry) and gets its
    statistics recomputed (:func:`recalibrated`) after model selection.
    ``on_epoch(epoch, history)`` after every epoch (a cached run replays its epochs). Checkpoints in
    ``how.checkpoint_dir/mcd-<ood>-<trained strategy>.pt``.

    Returns:
        ``(model on cfg.device, history with best_epoch the selected epoch, training seconds)``.
    """
    row = get_strategy(strategy)
    if row.batchnorm == "per-source":
        model = per_source_batchnorm(base)
    elif row.batchnorm == "detached-stats":
        model = detached_stats_batchnorm(base)
    else:
        model = copy.deepcopy(base)
    checkpoint = _checkpoint(how, f"mcd-{ood}-{row.trains_as}.pt")

    def shown(epoch: int, h: History) -> None:  # the live view marks the epoch the selection keeps
        h.best_epoch = selected_epoch(h, cfg.selection, epoch)
        on_epoch(epoch, h)

    def compute() -> dict:
        set_seed(cfg.seed)
        t0 = time.time()
        key = cache_key(cfg, "finetune", ood=ood, strategy=row.trains_as)
        out = _fit(
            cfg, model, split, row.trains_as, how, checkpoint, key, shown if on_epoch else None
        )
        weights = {w: {k: v.cpu() for k, v in out[w].items()} for w in ("best", "last")}
        history = dataclasses.asdict(out["history"])
        return {**weights, "history": history, "seconds": round(time.time() - t0, 1)}

    state = cached(
        cfg, "finetune", compute, how.retrain, how.log, checkpoint, ood=ood, strategy=row.trains_as
    )
    hist = History(**state["history"])
    if on_epoch is not None and "loaded_from" in state:  # from the cache: show its epochs
        _replay(hist, shown)
    hist.best_epoch = selected_epoch(hist, cfg.selection)
    model.load_state_dict(state["last" if cfg.selection == "last-epoch" else "best"])
    model = model.to(cfg.device, memory_format=torch.contiguous_format)  # as a loaded network
    if row.eval_stats == "recalibrated":
        recalibrated(cfg, model, split)
    return model, hist, state["seconds"]


def recalibration_images(split: Split, source: str = "labeled", seed: int = 0) -> torch.Tensor:
    """The images BatchNorm's statistics are recomputed on, at most :data:`RECALIBRATION_IMAGES`:
    the first labeled ones (``"labeled"``, already in random order); the unlabeled fine-tuning pool
    (``"unlabeled"``), shuffled with ``seed``, since the pool is stored ID first and every batch
    must hold both, as the fine-tuning batches did; or both in the proportions an official-schedule
    iteration's BatchNorm sees them (``"mixture"``: Step A's labeled batch, then Step B's labeled
    and unlabeled one, 2 : 1 at equal batch sizes), the unlabeled part drawn from the shuffled pool,
    shuffled together.

    Shapes: ``(N, C, H, W)``.

    Raises:
        ValueError: an unknown source (the valid ones named).
    """
    if source not in RECALIBRATION_SOURCES:
        raise ValueError(
            f"recalibration source must be one of {', '.join(RECALIBRATION_SOURCES)}, got "
            f"{source!r}."
        )
    if source == "labeled":
        return split.x_sup[:RECALIBRATION_IMAGES]
    g = torch.Generator().manual_seed(seed)
    pool = split.x_unsup[torch.randperm(len(split.x_unsup), generator=g)]
    if source == "unlabeled":
        return pool[:RECALIBRATION_IMAGES]
    n_unsup = min(len(pool), RECALIBRATION_IMAGES // 3, len(split.x_sup) // 2)
    x = torch.cat([split.x_sup[: 2 * n_unsup], pool[:n_unsup]])
    return x[torch.randperm(len(x), generator=g)]


def recalibrated(cfg, model: nn.Module, split: Split, source: str = "labeled") -> nn.Module:
    """``model`` on ``cfg.device`` with its BatchNorm statistics recomputed on
    :func:`recalibration_images` of ``source`` (:func:`~mcd_helpers.norms.recalibrate_bn`, batches
    of ``cfg.batch_size_sup``), in place."""
    x = recalibration_images(split, source, cfg.seed).to(cfg.device)
    return recalibrate_bn(model.to(cfg.device), x, cfg.batch_size_sup)
