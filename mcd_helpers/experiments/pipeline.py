"""The one experiment pipeline: every run goes through these functions, in this order.

The command line (:mod:`mcd_helpers.experiments.run`), the notebooks, torchrun and the benchmark
(:mod:`mcd_helpers.experiments.benchmark`) all call::

    data = load_data(cfg)                                # ID train / test images (subsets if asked)
    split = make_split(cfg, data, ood)                   # labeled, unlabeled, validation, test
    base = pretrained(cfg, split)                        # cached: "pretrain" stage
    tuned, hist, secs = finetuned(cfg, base, split, ood, s)  # cached: "finetune" stage, per strategy s
    rows, scores = evaluate(cfg, base, {s: tuned}, split, ood)

so a notebook that shows a preset's numbers gets exactly what the command line gets for it (same
epochs, one optimizer through all epochs, same data order, same model selection). Live plots pass
``on_epoch`` to :func:`finetuned`; a cached run replays its epochs into it.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..data.nearood import CLASS_SPLITS, SELECTIONS, ProtocolSplit, class_split, protocol_split
from ..data.sets import FMNIST_STD, load_id, load_ood, transductive_split
from ..errors import ConfigError, CorruptCheckpointError
from ..losses import discrepancy_score, energy_score, msp_score
from ..metrics import ood_metrics
from ..models import TwoHeadNet, build_model
from ..norms import per_source_batchnorm, recalibrate_bn
from ..training.checkpoint import RollingCheckpoint
from ..training.distributed import average_buffers, gather_scores, is_main_process, on_rank0_first
from ..steps import check_strategy
from ..training.loop import FinetuneHistory, finetune, predict_logits, pretrain, set_seed
from .baselines import BASELINES, ODIN_EPSILONS, ODIN_TEMPERATURES, OdinParams, odin_score, tune_odin
from .cache import cache_key, load_or_compute

__all__ = ["Data", "load_data", "make_split", "pretrained", "finetuned", "evaluate", "run_ood_set", "METHODS",
           "selected_epoch", "trained_as",
           "pixel_std_of", "HELD_OUT", "RECALIBRATION_IMAGES"]

METHODS = BASELINES + ("mcd",)  # msp, odin, energy (on the pre-trained network), mcd (fine-tuned)
HELD_OUT = "heldout"  # the OOD "set" of a near-OOD task: the held-out classes of cfg.class_split
RECALIBRATION_IMAGES = 10_000  # strategy "recalibrate": BatchNorm statistics from the first 10,000 labeled images


@dataclass
class Data:
    """The ID data of a run: ``x_*`` ``(N, C, H, W)`` float (normalised), ``y_*`` ``(N,)`` int64."""
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def pixel_std_of(id_dataset: str):
    """The std (pixel units) that normalises ``id_dataset``'s images: one number or one per channel."""
    if id_dataset == "fashion_mnist":
        return FMNIST_STD
    from ..data.cifar import CIFAR_STD
    return CIFAR_STD


def load_data(cfg) -> Data:
    """``cfg.id_dataset``'s training and test sets, cut to ``cfg.train_subset`` / ``cfg.test_subset``
    images when those are > 0. Rank 0 loads (downloads) first under torchrun.

    Raises:
        DataNotFoundError: when the ID set cannot be found (the message says where it looked).
    """
    def load():
        x_tr, y_tr = load_id(cfg.id_dataset, train=True)
        x_te, y_te = load_id(cfg.id_dataset, train=False)
        if cfg.train_subset > 0:
            x_tr, y_tr = x_tr[:cfg.train_subset], y_tr[:cfg.train_subset]
        if cfg.test_subset > 0:
            x_te, y_te = x_te[:cfg.test_subset], y_te[:cfg.test_subset]
        return Data(x_tr, y_tr, x_te, y_te)
    return on_rank0_first(load)


def make_split(cfg, data: Data, ood: str) -> ProtocolSplit:
    """The split of one experiment: labeled, unlabeled, validation and test data.

    * ``ood == "heldout"`` (:data:`HELD_OUT`): the held-out classes of ``cfg.class_split`` under
      ``cfg.protocol`` (:func:`mcd_helpers.data.nearood.protocol_split`; ``unseen-ood`` takes its
      unlabeled OOD images from ``cfg.far_ood``).
    * any other name: an OOD set (:func:`mcd_helpers.data.sets.load_ood`) split with the ID test
      set as the official loader does (transductive, :func:`~mcd_helpers.data.sets.transductive_split`);
      with ``cfg.class_split`` set, the ID data are its known classes (relabelled 0..5).

    Raises:
        ConfigError: ``heldout`` without a class split, or a far OOD set under another protocol
            than ``transductive``; ValueError: sizes (see the split functions).
    """
    if ood == HELD_OUT:
        if not cfg.class_split:
            raise ConfigError("class_split", f"OOD set {HELD_OUT!r} (held-out classes) needs a class_split: one "
                                             f"of {', '.join(CLASS_SPLITS)} or a written 'IDS/OODS' such as "
                                             "'012345/6789' (--class-split a).")
        id_classes, ood_classes = class_split(cfg.class_split)
        far = None
        if cfg.protocol == "unseen-ood":
            far = load_ood(cfg.far_ood, cfg.ood_size, cfg.seed + 1, cfg.id_dataset)
        return protocol_split(cfg.protocol, data.x_train, data.y_train, data.x_test, data.y_test, id_classes,
                              ood_classes, n_val=cfg.n_val, seed=cfg.split_seed, n_holdout=cfg.n_holdout,
                              far_ood_train=far)
    if cfg.protocol != "transductive":
        raise ConfigError("protocol", f"the OOD set {ood!r} runs under the transductive protocol only; "
                                      f"protocol {cfg.protocol!r} applies to the held-out classes ({HELD_OUT!r}).")
    x_tr, y_tr, x_te, y_te = data.x_train, data.y_train, data.x_test, data.y_test
    if cfg.class_split:
        id_classes, _ = class_split(cfg.class_split)
        relabel = torch.full((int(max(y_tr.max(), y_te.max())) + 1,), -1, dtype=torch.long)
        relabel[list(id_classes)] = torch.arange(len(id_classes))
        keep_tr, keep_te = relabel[y_tr] >= 0, relabel[y_te] >= 0
        x_tr, y_tr, x_te, y_te = x_tr[keep_tr], relabel[y_tr[keep_tr]], x_te[keep_te], relabel[y_te[keep_te]]
    t = transductive_split(x_te, y_te, load_ood(ood, cfg.ood_size, cfg.seed, cfg.id_dataset), cfg.n_val,
                           cfg.split_seed)
    return ProtocolSplit(x_sup=x_tr, y_sup=y_tr, x_unsup=t.unlabeled().tensors[0], val_id_x=t.val_id_x,
                         val_id_y=t.val_id_y, val_ood_x=t.val_ood_x, test_id_x=t.test_id_x, test_id_y=t.test_id_y,
                         test_ood_x=t.test_ood_x, protocol="transductive")


def _log(log, msg: str) -> None:
    if log is not None:
        log(msg)


def _build(cfg, split: ProtocolSplit, strategy: str | None = None) -> TwoHeadNet:
    model = build_model(cfg.model, split.x_sup.shape[1], int(split.y_sup.max()) + 1, cfg.norm)
    return per_source_batchnorm(model) if strategy == "split-bn" else model


def pretrained(cfg, split: ProtocolSplit, retrain: bool | set = False, progress: bool = True,
               log: Callable[[str], None] | None = print, checkpoint_dir=None, resume: bool = False) -> TwoHeadNet:
    """The network pre-trained on ``split.x_sup, split.y_sup`` (CE on both heads), from the cache or trained.

    Returns a plain model on the CPU. While training, checkpoints go to ``checkpoint_dir`` (when
    given); ``resume=True`` continues from them.

    Raises:
        NonFiniteLossError, TrainingInterrupted, CheckpointMismatchError: from
            :func:`~mcd_helpers.training.loop.pretrain`.
        CorruptCheckpointError: when the cached file holds a network of another architecture
            (the message says to pass ``--retrain``).
    """
    def compute() -> dict:
        set_seed(cfg.seed)
        model = _build(cfg, split)
        ckpt = RollingCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
        t0 = time.time()
        losses = pretrain(model, split.x_sup, split.y_sup, cfg, progress=progress, checkpoint=ckpt, resume=resume,
                          key=cache_key(cfg, "pretrain"))
        _log(log, f"pre-trained {cfg.model} for {cfg.pretrain_epochs} epochs in {time.time() - t0:.0f} s "
                  f"(last epoch's loss {losses[-1]:.3f} nats)")
        return {"model": {k: v.cpu() for k, v in model.state_dict().items()}, "losses": losses}

    state = load_or_compute(cfg, "pretrain", compute, retrain, log)
    if checkpoint_dir is not None and is_main_process():
        RollingCheckpoint(checkpoint_dir).clear()  # the cache holds the result now (also any leftover)
    model = _build(cfg, split)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # another architecture or width in the cached file
        raise CorruptCheckpointError(
            f"the cached pre-trained network {state.get('loaded_from')} does not fit {cfg.model} (norm={cfg.norm}, "
            f"{split.x_sup.shape[1]} input channels, {int(split.y_sup.max()) + 1} classes): "
            f"{str(err).splitlines()[0].strip()} Pass --retrain (retrain=True) to pre-train it again "
            "(the file is replaced), or delete the file.") from err
    average_buffers(model)  # after DDP pre-training the ranks' BatchNorm statistics differ: use their mean
    return model


def selected_epoch(hist: FinetuneHistory, upto: int, selection: str) -> int:
    """The epoch (<= ``upto``) whose weights ``selection`` keeps: best validation AUROC (first of ties) or the last."""
    if selection not in SELECTIONS:
        raise ConfigError("selection", f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}.")
    if selection == "last-epoch" or not hist.val_auroc:
        return upto
    return max(range(upto + 1), key=lambda i: (hist.val_auroc[i], -i))


def _replay(hist: FinetuneHistory, epochs: int, selection: str, on_epoch) -> None:
    """Call ``on_epoch(e, history up to e)`` for each epoch of a cached run (a live plot then shows it)."""
    per_epoch = len(hist.ce) // epochs
    for e in range(epochs):
        shown = {f.name: getattr(hist, f.name)[:(e + 1) * (per_epoch if f.name != "val_auroc" else 1)]
                 for f in dataclasses.fields(hist) if f.name != "best_epoch"}
        on_epoch(e, FinetuneHistory(**shown, best_epoch=selected_epoch(hist, e, selection)))


def trained_as(strategy: str) -> str:
    """The strategy a model is trained with: ``recalibrate`` is ``separate``'s training (then recalibrated)."""
    return "separate" if strategy == "recalibrate" else strategy


def finetuned(cfg, base: nn.Module, split: ProtocolSplit, ood: str, strategy: str, retrain: bool | set = False,
              progress: bool = True, log: Callable[[str], None] | None = print,
              on_epoch: Callable[[int, FinetuneHistory], None] | None = None, checkpoint_dir=None,
              resume: bool = False) -> tuple[TwoHeadNet, FinetuneHistory, float]:
    """``base`` fine-tuned with MCD on ``split`` with ``strategy``, from the cache or trained.

    ``base`` is not modified: a copy is fine-tuned after ``set_seed(cfg.seed)``. Strategy
    ``split-bn`` first gives the copy per-stream BatchNorm statistics. Strategy ``recalibrate`` is
    the ``separate`` run (the same cache entry: the two share their training exactly) whose
    running statistics are then recomputed on the first :data:`RECALIBRATION_IMAGES` labeled
    images, after model selection. The cache holds the best-validation and the last epoch's
    weights, so ``cfg.selection`` picks one without training again. ``on_epoch(e, history)`` is
    called after every epoch; a cached run replays its epochs into it.

    Returns:
        ``(model, history, seconds)``: the fine-tuned model on ``cfg.device``, its
        :class:`~mcd_helpers.training.loop.FinetuneHistory` (``best_epoch``: the epoch selected),
        and the training time in seconds (measured when it was trained, also when loaded).

    Raises:
        ValueError: on an unknown strategy; what :func:`~mcd_helpers.training.loop.finetune` raises.
    """
    check_strategy(strategy)
    trained = trained_as(strategy)

    def compute() -> dict:
        set_seed(cfg.seed)
        model = per_source_batchnorm(base) if trained == "split-bn" else copy.deepcopy(base)
        ckpt = RollingCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
        t0 = time.time()
        states: dict = {}
        hist = finetune(model, split.x_sup, split.y_sup, split, cfg, trained, progress=progress, checkpoint=ckpt,
                        resume=resume, key=cache_key(cfg, "finetune", ood=ood, strategy=trained), on_epoch=on_epoch,
                        states_out=states)
        seconds = round(time.time() - t0, 1)
        cpu = lambda sd: {k: v.cpu() for k, v in sd.items()}  # noqa: E731
        return {"best": cpu(states["best"]), "last": cpu(states["last"]), "history": dataclasses.asdict(hist),
                "seconds": seconds}

    state = load_or_compute(cfg, "finetune", compute, retrain, log, ood=ood, strategy=trained)
    if checkpoint_dir is not None and is_main_process():
        RollingCheckpoint(checkpoint_dir).clear()  # the cache holds the result now (also any leftover)
    hist = FinetuneHistory(**state["history"])
    hist.best_epoch = selected_epoch(hist, cfg.finetune_epochs - 1, cfg.selection)
    if on_epoch is not None and "loaded_from" in state:  # loaded from the cache: show its epochs
        _replay(hist, cfg.finetune_epochs, cfg.selection, on_epoch)
    model = _build(cfg, split, trained)
    model.load_state_dict(state["last" if cfg.selection == "last-epoch" else "best"])
    model = model.to(cfg.device)
    if strategy == "recalibrate":
        recalibrate_bn(model, split.x_sup[:RECALIBRATION_IMAGES].to(cfg.device), batch_size=cfg.batch_size_sup)
    return model, hist, state["seconds"]


def _logits(cfg, model: nn.Module, x: torch.Tensor):
    """Both heads' logits on all of ``x``, scored in shards by all ranks: two ``(N, K)`` CPU tensors."""
    return gather_scores(lambda t: predict_logits(model, t, cfg.eval_batch_size, cfg.device), x)


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


def evaluate(cfg, base: nn.Module, tuned: dict[str, nn.Module], split: ProtocolSplit, ood: str,
             methods: Sequence[str] = METHODS) -> tuple[list[dict], dict]:
    """Every method's metrics and test scores on ``split``: rows and ``{name: (id_scores, ood_scores)}``.

    Baselines (MSP, ODIN, energy) score F1 of ``base``; MCD scores the discrepancy of each model in
    ``tuned`` (``{strategy: model}``). ODIN's T and epsilon are chosen on the validation split
    (grid ``cfg.extra["odin_temperatures"]``/``["odin_epsilons"]`` when set) under selection
    ``ood-labels``; under ``last-epoch`` (no OOD labels) ODIN's published T = 1000, epsilon = 0.0014.
    ``id_accuracy`` is F1's accuracy on the ID test images (the base network's for the baselines).
    Score names: the method (``"msp"``, ...) and ``"mcd:<strategy>"``; each ``(N,)``, higher = more OOD.
    ``base`` and the ``tuned`` models are moved to ``cfg.device`` in place (and to the
    channels_last layout when ``cfg.channels_last``); their weights are not changed.

    Returns:
        ``(rows, scores)``; rows in the order msp, odin, energy, then mcd per strategy, metrics
        as fractions (:func:`mcd_helpers.metrics.ood_metrics`).
    """
    std, dev, bs = pixel_std_of(cfg.id_dataset), cfg.device, cfg.eval_batch_size
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format  # NHWC: small_cnn evaluates 1.6x faster on CPU (benchmarks/channels_last.py)
    base = base.to(dev, memory_format=layout)
    tuned = {k: m.to(dev, memory_format=layout) for k, m in tuned.items()}
    common = {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "class_split": cfg.class_split,
              "protocol": cfg.protocol, "selection": cfg.selection, "seed": cfg.seed}
    rows, scores = [], {}
    l1_id, _ = _logits(cfg, base, split.test_id_x)  # (N_id, K)
    l1_ood, _ = _logits(cfg, base, split.test_ood_x)  # (N_ood, K)
    base_acc = _accuracy(l1_id, split.test_id_y)
    odin = None
    if "odin" in methods:
        if cfg.selection == "ood-labels":
            grid = {"temperatures": cfg.extra.get("odin_temperatures", ODIN_TEMPERATURES),
                    "epsilons": cfg.extra.get("odin_epsilons", ODIN_EPSILONS)}
            odin = tune_odin(base, split.val_id_x, split.val_ood_x, **grid, pixel_std=std, batch_size=bs, device=dev)
        else:
            odin = OdinParams(1000.0, 0.0014, {})
        kw = dict(temperature=odin.temperature, epsilon=odin.epsilon, pixel_std=std, batch_size=bs, device=dev)
        scores["odin"] = (odin_score(base, split.test_id_x, **kw), odin_score(base, split.test_ood_x, **kw))
    if "msp" in methods:
        scores["msp"] = (msp_score(l1_id), msp_score(l1_ood))
    if "energy" in methods:
        scores["energy"] = (energy_score(l1_id), energy_score(l1_ood))
    for m in (m for m in BASELINES if m in methods):
        extra = {"odin_temperature": odin.temperature, "odin_epsilon": odin.epsilon} if m == "odin" else {}
        rows.append({**common, "method": m, "strategy": None, **ood_metrics(*scores[m]), "id_accuracy": base_acc,
                     **extra})
    if "mcd" in methods:
        for strategy, model in tuned.items():
            t1_id, t2_id = _logits(cfg, model, split.test_id_x)
            t1_ood, t2_ood = _logits(cfg, model, split.test_ood_x)
            s = scores[f"mcd:{strategy}"] = (discrepancy_score(t1_id, t2_id), discrepancy_score(t1_ood, t2_ood))
            rows.append({**common, "method": "mcd", "strategy": strategy, **ood_metrics(*s),
                         "id_accuracy": _accuracy(t1_id, split.test_id_y)})
    return rows, scores


def run_ood_set(cfg, data: Data, ood: str, strategies: Sequence[str] | None = None, retrain: bool | set = False,
                progress: bool = True, log: Callable[[str], None] | None = print, on_epoch=None,
                checkpoint_dir=None, resume: bool = False, methods: Sequence[str] = METHODS):
    """One OOD set end to end: split, pre-trained network, MCD per strategy, evaluation.

    ``on_epoch(strategy, epoch, history)`` when given; ``checkpoint_dir``: a folder that gets
    ``pretrain/`` and ``mcd-<ood>-<trained strategy>/`` rolling checkpoints (``recalibrate`` shares
    ``separate``'s; resumable with ``resume``; removed once the stage is in the cache).

    Returns:
        ``(rows, scores, models, histories)``: see :func:`evaluate`; ``models`` has ``"base"`` and
        each strategy; ``histories`` maps strategy -> FinetuneHistory. Rows of MCD carry
        ``val_auroc`` (the selected epoch's validation AUROC), ``selected_epoch`` and
        ``finetune_seconds``.
    """
    strategies = tuple(cfg.strategies if strategies is None else strategies)
    split = make_split(cfg, data, ood)
    sub = (lambda name: None) if checkpoint_dir is None else (lambda name: checkpoint_dir / name)
    base = pretrained(cfg, split, retrain, progress, log, sub("pretrain"), resume)
    tuned, hists, secs = {}, {}, {}
    for s in (strategies if "mcd" in methods else ()):
        cb = None if on_epoch is None else (lambda e, h, s=s: on_epoch(s, e, h))
        tuned[s], hists[s], secs[s] = finetuned(cfg, base, split, ood, s, retrain, progress, log, cb,
                                                 sub(f"mcd-{ood}-{trained_as(s)}"), resume)
    rows, scores = evaluate(cfg, base, tuned, split, ood, methods)
    for r in rows:
        if r["method"] == "mcd":
            h = hists[r["strategy"]]
            r.update(val_auroc=h.val_auroc[h.best_epoch], selected_epoch=h.best_epoch,
                     finetune_seconds=secs[r["strategy"]])
    return rows, scores, {"base": base, **tuned}, hists
