"""The one pipeline: every run, from the command line, a notebook, torchrun or the benchmark, goes through
these functions, and :func:`run_ood_set` drives them::

    data = load_data(cfg)                                  # ID training and test images
    split = make_split(cfg, data, ood)                     # labeled, unlabeled, validation, test
    base = pretrained(cfg, split)                          # cached stage "pretrain"
    model, hist, seconds = finetuned(cfg, base, split, ood, strategy)  # cached stage "finetune"
    rows, scores = evaluate(cfg, base, {strategy: model}, split, ood)  # MSP, ODIN, energy, MCD

A stage's result is cached in ``<cache_dir>/cache/<stage>-<key>.pt`` (:func:`mcd_helpers.data.cache_dir`),
``key`` a hash of the settings that change it (:func:`cache_key`), written atomically by rank 0 and read
with ``weights_only=True``. One fine-tuning keeps the best-validation and the last epoch's weights, so
both model selections (:func:`selected_epoch`) come from one run.
"""

import contextlib
import copy
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from . import ddp
from .baselines import odin_scores, tune_odin
from .config import HELD_OUT, PRETRAIN_FIELDS, RUN_FIELDS, SELECTIONS
from .data import cache_dir, data_dir, load_id, load_ood, pixel_std
from .errors import CheckpointError, ConfigError
from .files import load_state, save_state
from .forwards import check_strategy
from .losses import discrepancy_score, energy_score, msp_score
from .metrics import ood_metrics
from .models import build_model
from .norms import PerSourceBatchNorm, per_source_batchnorm, recalibrate_bn
from .splits import Split, class_split, keep_classes, protocol_split, transductive_split
from .train import History, predict_logits, set_seed, train

METHODS = ("msp", "odin", "energy", "mcd")  # the baselines score the pre-trained network, MCD the fine-tuned one
RECALIBRATION_IMAGES = 10_000  # strategy "recalibrate": BatchNorm statistics from the first 10,000 labeled images


@dataclasses.dataclass
class Data:
    """A run's ID images ``x_* (N, C, H, W)`` (normalised) and labels ``y_* (N,)``."""
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@contextlib.contextmanager
def timed(seconds: dict, stage: str):
    """``with timed(seconds, stage):`` adds the block's wall-clock seconds to ``seconds[stage]`` (a profile)."""
    t0 = time.perf_counter()
    yield
    seconds[stage] = round(seconds.get(stage, 0.0) + time.perf_counter() - t0, 2)


def load_data(cfg) -> Data:
    """``cfg.id_dataset``'s training and test sets (their first ``train_subset`` / ``test_subset`` images when
    those are > 0); rank 0 loads (downloads) first. Raises DataNotFoundError naming where it looked."""
    def load() -> Data:
        (x_tr, y_tr), (x_te, y_te) = load_id(cfg.id_dataset, train=True), load_id(cfg.id_dataset, train=False)
        tr, te = slice(cfg.train_subset or None), slice(cfg.test_subset or None)
        return Data(x_tr[tr], y_tr[tr], x_te[te], y_te[te])
    return ddp.rank0_first(load)


def make_split(cfg, data: Data, ood: str) -> Split:
    """One experiment's split. ``ood == "heldout"``: the held-out classes of ``cfg.class_split`` under
    ``cfg.protocol`` (:func:`~mcd_helpers.splits.protocol_split`); another name: that OOD set under the
    transductive split (with a class split, the ID classes only, relabelled).

    Raises:
        ConfigError: held-out classes without a class split, a far OOD set under another protocol, sizes the
            data cannot give (the message names the field).
    """
    if ood == HELD_OUT and not cfg.class_split:
        raise ConfigError("class_split", "OOD set 'heldout' needs a class split: --class-split a, b, c or 012345/6789.")
    if ood != HELD_OUT and cfg.protocol != "transductive":
        raise ConfigError("protocol", f"{ood!r} needs --protocol transductive; {cfg.protocol!r} is for 'heldout' only.")
    (x_tr, y_tr), (x_te, y_te) = (data.x_train, data.y_train), (data.x_test, data.y_test)
    images = lambda name, seed: ddp.rank0_first(lambda: load_ood(name, cfg.ood_size, seed, cfg.id_dataset))
    if ood == HELD_OUT:  # rank 0 loads (downloads) first
        far = images(cfg.unlabeled_ood, cfg.seed + 1) if cfg.protocol == "unseen-ood" else None
        return protocol_split(cfg.protocol, x_tr, y_tr, x_te, y_te, *class_split(cfg.class_split), n_val=cfg.n_val,
                              seed=cfg.split_seed, n_holdout=cfg.n_holdout, far_ood_train=far,
                              ood_fraction=cfg.unlabeled_ood_fraction)
    if cfg.class_split:
        ids = class_split(cfg.class_split)[0]
        (x_tr, y_tr), (x_te, y_te) = keep_classes(x_tr, y_tr, ids), keep_classes(x_te, y_te, ids)
    return transductive_split(x_tr, y_tr, x_te, y_te, images(ood, cfg.seed), cfg.n_val, cfg.split_seed)


def cache_key(cfg, stage: str, **more) -> str:
    """16 hex digits of a hash of what ``stage``'s result depends on: pre-training hashes
    :data:`~mcd_helpers.config.PRETRAIN_FIELDS` with the protocol reduced to what the labeled set is (every
    ID training image, or those left after ``n_holdout``: disjoint and unseen-ood share a network); the other
    stages every field but :data:`~mcd_helpers.config.RUN_FIELDS`; plus ``more`` (the OOD set, the strategy),
    ``channels_last`` when on, and, under torchrun, the world size and SyncBatchNorm."""
    fields, held = {k: v for k, v in cfg.to_dict().items() if k not in RUN_FIELDS}, cfg.protocol != "transductive"
    fields["amp"] = cfg.resolved_amp()  # what trains: "auto" is bf16 on one machine, float32 on another
    if stage == "pretrain":  # the protocol reduced to what the labeled set is
        skip = ("protocol",) if held else ("protocol", "n_holdout", "split_seed")
        fields = {**{k: fields[k] for k in PRETRAIN_FIELDS if k not in skip}, "labeled": "holdout" if held else "all"}
    if cfg.channels_last:  # NHWC trains another network (docs/speed.md); off, the keys stay what they were
        fields["channels_last"] = True
    if ddp.world()[1] > 1:
        fields.update(world_size=ddp.world()[1], sync_bn=cfg.sync_bn)
    blob = json.dumps({"stage": stage, **fields, **more}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached(cfg, stage: str, compute: Callable[[], dict], retrain: bool | set = False, log=print,
           checkpoint: Path | None = None, **more) -> dict:
    """``stage``'s result from the cache, else ``compute()`` (written by rank 0; the stage's ``checkpoint``
    is deleted then). ``retrain``: False loads what is cached, True computes again, a set (one per run,
    ``--retrain``) computes each file the first time its name is met. An unreadable file is computed again.
    A loaded result carries ``"loaded_from"``."""
    name, log = f"{stage}-{cache_key(cfg, stage, **more)}.pt", log or (lambda msg: None)
    if isinstance(retrain, set):
        retrain, _ = name not in retrain, retrain.add(name)
    found = None if retrain else ddp.rank0_first(
        lambda: next((p for p in (data_dir() / "cache" / name, cache_dir() / "cache" / name) if p.exists()), None))
    state = None
    if found is not None:
        try:
            state = {**load_state(found), "loaded_from": str(found)}
            log(f"{stage}: loaded from the cache, {found} (computed earlier in this run or before; --retrain computes "
                "it again)")
        except RuntimeError as err:  # unreadable (load_state's message names the file)
            log(f"{err} Computing it again.")
    if state is None:
        state = compute()
        if ddp.is_main():
            save_state(cache_dir() / "cache" / name, state)
    if checkpoint is not None and ddp.is_main():
        checkpoint.unlink(missing_ok=True)  # the cache holds the result now (also a leftover's)
    return state


def _build(cfg, split: Split, strategy: str | None = None) -> nn.Module:
    model = build_model(cfg.model, split.x_sup.shape[1], int(split.y_sup.max()) + 1, cfg.norm)
    return per_source_batchnorm(model) if strategy == "split-bn" else model


def _fit(cfg, model: nn.Module, split: Split, strategy, checkpoint, resume: bool, key: str, progress, on_epoch=None):
    """:func:`~mcd_helpers.train.train` on ``model`` moved to the device (NHWC if asked), then DDP-wrapped."""
    model.to(cfg.device, memory_format=torch.channels_last if cfg.channels_last else torch.contiguous_format)
    return train(ddp.wrap(model, cfg.device, cfg.sync_bn), split, cfg, strategy, checkpoint, resume, key, on_epoch, progress)


def pretrained(cfg, split: Split, retrain: bool | set = False, progress: bool = True, log=print,
               checkpoint_dir: Path | None = None, resume: bool = False) -> nn.Module:
    """The network pre-trained on ``split.x_sup, y_sup`` (CE on both heads), from the cache or trained after
    ``set_seed(cfg.seed)`` (checkpoints in ``checkpoint_dir/pretrain.pt``). A plain model on the CPU.

    Raises:
        CheckpointError: the cached file holds another architecture (the message says ``--retrain``); what
            :func:`~mcd_helpers.train.train` raises.
    """
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir) / "pretrain.pt"

    def compute() -> dict:
        set_seed(cfg.seed)
        model, t0 = _build(cfg, split), time.time()
        hist = _fit(cfg, model, split, None, ckpt, resume, cache_key(cfg, "pretrain"), progress)["history"]
        if log:
            log(f"pre-trained {cfg.model} for {cfg.pretrain_epochs} epochs in {time.time() - t0:.0f} s")
        return {"model": {k: v.cpu() for k, v in model.state_dict().items()}, "ce": hist.ce}

    state, model = cached(cfg, "pretrain", compute, retrain, log, ckpt), _build(cfg, split)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:  # another architecture or width in the cached file
        raise CheckpointError(f"the cached network {state.get('loaded_from')} does not fit {cfg.model} (norm={cfg.norm}, "
                              f"{split.x_sup.shape[1]} channels, {int(split.y_sup.max()) + 1} classes): "
                              f"{str(err).splitlines()[0]} Pass --retrain (retrain=True) to train it again.") from err
    return model


def selected_epoch(hist: History, selection: str, upto: int | None = None) -> int:
    """Model selection, in one place: the epoch (<= ``upto``, default the last) whose weights are kept,
    ``"ood-labels"`` the best validation AUROC (the first of ties, as the loop keeps it), ``"last-epoch"`` the last."""
    if selection not in SELECTIONS:
        raise ConfigError("selection", f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}.")
    upto = len(hist.val_auroc) - 1 if upto is None else upto
    if not 0 <= upto < len(hist.val_auroc):
        raise ValueError(f"epoch {upto} is not in the history's {len(hist.val_auroc)} validated epochs.")
    return upto if selection == "last-epoch" else max(range(upto + 1), key=lambda i: (hist.val_auroc[i], -i))


def finetuned(cfg, base: nn.Module, split: Split, ood: str, strategy: str, retrain: bool | set = False,
              progress: bool = True, log=print, on_epoch: Callable | None = None, checkpoint_dir: Path | None = None,
              resume: bool = False) -> tuple[nn.Module, History, float]:
    """A copy of ``base`` fine-tuned with MCD and ``strategy`` (from the cache or trained after
    ``set_seed(cfg.seed)``), holding the weights of the epoch ``cfg.selection`` keeps.

    ``split-bn`` gives the copy per-source BatchNorm; ``recalibrate`` is ``separate``'s run (one cache entry)
    with the running statistics recomputed on the first :data:`RECALIBRATION_IMAGES` labeled images after
    model selection. ``on_epoch(epoch, history)`` after every epoch (a cached run replays its epochs).
    Checkpoints in ``checkpoint_dir/mcd-<ood>-<trained strategy>.pt``.

    Returns:
        ``(model on cfg.device, history with best_epoch the selected epoch, training seconds)``.
    """
    trained = "separate" if strategy == "recalibrate" else check_strategy(strategy)  # recalibrated after separate's run
    ckpt = None if checkpoint_dir is None else Path(checkpoint_dir) / f"mcd-{ood}-{trained}.pt"

    def shown(epoch: int, h: History) -> None:  # the live view marks the epoch the selection would keep
        h.best_epoch = selected_epoch(h, cfg.selection, epoch)
        on_epoch(epoch, h)

    def compute() -> dict:
        set_seed(cfg.seed)
        model, t0 = per_source_batchnorm(base) if trained == "split-bn" else copy.deepcopy(base), time.time()
        out = _fit(cfg, model, split, trained, ckpt, resume, cache_key(cfg, "finetune", ood=ood, strategy=trained),
                   progress, shown if on_epoch else None)
        return {**{w: {k: v.cpu() for k, v in out[w].items()} for w in ("best", "last")},
                "history": dataclasses.asdict(out["history"]), "seconds": round(time.time() - t0, 1)}

    state = cached(cfg, "finetune", compute, retrain, log, ckpt, ood=ood, strategy=trained)
    hist = History(**state["history"])
    if on_epoch is not None and "loaded_from" in state:  # from the cache: show its epochs
        per = len(hist.ce) // len(hist.val_auroc)
        for e in range(len(hist.val_auroc)):
            shown(e, History(*(v[:(e + 1) * per] for v in (hist.ce, hist.dis, hist.gap, hist.step_a)), hist.val_auroc[:e + 1]))
    hist.best_epoch = selected_epoch(hist, cfg.selection)
    model = _build(cfg, split, trained)
    model.load_state_dict(state["last" if cfg.selection == "last-epoch" else "best"])
    if strategy == "recalibrate":
        _recalibrated(cfg, model, split)
    return model.to(cfg.device), hist, state["seconds"]


_MEMO: dict = {}  # what a network gives once per weights: a hash of (what, network, images) -> tensors


def _memo(what: tuple, tensors: list, compute: Callable):
    """``compute()`` (a sequence of tensors) as a list, or what it gave before in this process for ``what`` and
    ``tensors`` of the same bytes (a network's state, images); copies both ways: a caller may change them in
    place. The 64 newest kept."""
    h = hashlib.blake2b(repr(what).encode(), digest_size=16)
    for t in tensors:
        h.update(repr(t.shape).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    if (key := h.hexdigest()) not in _MEMO:
        _MEMO.pop(next(iter(_MEMO))) if len(_MEMO) >= 64 else None
        _MEMO[key] = [t.detach().clone() for t in compute()]  # kept apart from the tensors compute() handed out
    return [t.clone() for t in _MEMO[key]]


def _recalibrated(cfg, model: nn.Module, split: Split) -> nn.Module:
    """``model`` on ``cfg.device`` with its BatchNorm statistics recomputed on the first :data:`RECALIBRATION_IMAGES`
    labeled images, in place (memoised by the weights: a second selection of the same epoch is not recomputed)."""
    x, model = split.x_sup[:RECALIBRATION_IMAGES], model.to(cfg.device)

    def compute() -> list:  # the buffers (running statistics); the weights are not changed
        recalibrate_bn(model, x.to(cfg.device), cfg.batch_size_sup)
        return list(model.buffers())
    layout = tuple(p.is_contiguous() for p in model.parameters())  # NCHW or NHWC: equal to rounding only
    stats = _memo(("recalibrate", cfg.device, cfg.batch_size_sup, layout), [*model.state_dict().values(), x], compute)
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), stats):
            buffer.copy_(value)
    return model


def evaluate(cfg, base: nn.Module, tuned: dict[str, nn.Module], split: Split, ood: str,
             methods: Sequence[str] = METHODS, seconds: dict | None = None) -> tuple[list[dict], dict]:
    """Every method's metrics and test scores: rows, and ``{name: (id_scores (N_id,), ood_scores (N_ood,))}``;
    ODIN's search time added to ``seconds["odin search"]`` when ``seconds`` is given.

    MSP, ODIN and energy score F1 of ``base``; MCD the discrepancy of each model in ``tuned`` (``{strategy:
    model}``, scores ``"mcd:<strategy>"``); higher = more OOD. ODIN's (T, epsilon): the best validation
    AUROC over ``cfg``'s grid under ``ood-labels``, ODIN's published T = 1000, epsilon = 0.0014 under
    ``last-epoch`` (no OOD label). ``id_accuracy``: F1's accuracy on the ID test images. The models move to
    ``cfg.device`` (NHWC when ``cfg.channels_last``: 1.6x faster on a CPU); their weights are not changed.
    Logits and ODIN's scores are kept in this process by the bytes of the network and of the images, so the
    ID images that every OOD set shares are scored once per pre-trained network, and a fine-tuned network
    that two selections both keep (the same epoch) once.

    Returns:
        ``(rows, scores)``; rows in the order msp, odin, energy, then mcd per strategy, metrics as fractions.
    """
    layout = torch.channels_last if cfg.channels_last else torch.contiguous_format
    common = {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "class_split": cfg.class_split,
              "protocol": cfg.protocol, "selection": cfg.selection, "seed": cfg.seed}

    run, net = (cfg.device, cfg.channels_last, cfg.eval_batch_size, cfg.id_dataset, ddp.world()[1]), [
        *base.state_dict().values()]  # what the memo's scores depend on: the settings (at rounding level), the network

    def heads(model: nn.Module) -> list:  # both heads' logits on the ID and the OOD test images, shared over the ranks
        model, weights = model.to(cfg.device, memory_format=layout), [*model.state_dict().values()]
        sources = [m.source for m in model.modules() if isinstance(m, PerSourceBatchNorm)]  # not in the state
        logits = lambda x: ddp.gather(lambda t: predict_logits(model, t, cfg.eval_batch_size, cfg.device), x)  # noqa: E731
        return [_memo(("logits", run, sources), weights + [x], lambda: logits(x))
                for x in (split.test_id_x, split.test_ood_x)]

    def odin(model, x, t, epsilons, **kw) -> list:  # ODIN's scores of the pre-trained network, memoised
        return _memo(("odin", t, tuple(epsilons), run), net + [x], lambda: odin_scores(model, x, t, epsilons, **kw))

    def add(method: str, strategy, scores: tuple, l1_id, **extra) -> None:  # a row, its scores under its name
        out[method if strategy is None else f"mcd:{strategy}"] = scores
        rows.append({**common, "method": method, "strategy": strategy, **ood_metrics(*scores),
                     "id_accuracy": float((l1_id.argmax(1) == split.test_id_y).float().mean()), **extra})

    (l1_id, _), (l1_ood, _) = heads(base)  # (N, K) each
    rows, out = [], {}
    for m in (m for m in METHODS[:3] if m in methods):
        if m == "odin":
            kw = dict(pixel_std=pixel_std(cfg.id_dataset), batch_size=cfg.eval_batch_size, device=cfg.device)
            with timed({} if seconds is None else seconds, "odin search"):
                t, eps = (tune_odin(base, split.val_id_x, split.val_ood_x, cfg.odin_temperatures, cfg.odin_epsilons,
                                    **kw, score=odin)[:2] if cfg.selection == "ood-labels" else (1000.0, 0.0014))
            add(m, None, tuple(odin(base, x, t, [eps], **kw)[0] for x in (split.test_id_x, split.test_ood_x)),
                l1_id, odin_temperature=t, odin_epsilon=eps)
        else:
            add(m, None, tuple((msp_score if m == "msp" else energy_score)(x) for x in (l1_id, l1_ood)), l1_id)
    for strategy, model in (tuned.items() if "mcd" in methods else ()):
        (t1_id, t2_id), (t1_ood, t2_ood) = heads(model)
        add("mcd", strategy, (discrepancy_score(t1_id, t2_id), discrepancy_score(t1_ood, t2_ood)), t1_id)
    return rows, out


@dataclasses.dataclass
class Result:
    """What :func:`run_ood_set` gives: ``rows`` of every selection (MCD rows also carry the selected epoch's
    ``val_auroc``, ``selected_epoch`` and ``finetune_seconds``) and each row's ``(id_scores, ood_scores)`` in
    ``row_scores``; of the last selection the ``scores`` by name, the ``models`` (``"base"`` and each
    strategy) and ``histories``; the ``split``; and the wall-clock ``seconds`` of each stage (a stage loaded
    from the cache counts its loading; "evaluation" without ODIN's search)."""
    rows: list
    row_scores: list
    scores: dict
    models: dict
    histories: dict
    split: Split
    seconds: dict = dataclasses.field(default_factory=dict)


def run_ood_set(cfg, data: Data, ood: str, selections: Sequence[str] | None = None, methods: Sequence[str] = METHODS,
                retrain: bool | set = False, progress: bool = True, log=print, on_epoch: Callable | None = None,
                checkpoint_dir: Path | None = None, resume: bool = False, recalibrated: bool = False) -> Result:
    """One OOD set end to end, the one driver of ``reproduce``, the benchmark and the notebooks' rerun widget:
    the split, the pre-trained network, a fine-tuning per strategy of ``cfg.strategies``, evaluated under
    each selection (default ``cfg.selection``; all from the same runs). ``on_epoch(strategy, epoch, history)``
    when given; checkpoints in ``checkpoint_dir`` (resumable).

    Every row carries ``model`` and ``eval_stats``, the BatchNorm statistics it was evaluated with:
    ``"running"`` (the network's own), ``"per-source"`` (``split-bn``'s labeled stream) or ``"recalibrated"``
    (strategy ``recalibrate``; and with ``recalibrated=True`` one more MCD row per other strategy of a
    BatchNorm network: a copy with the statistics recomputed on the first :data:`RECALIBRATION_IMAGES` labeled
    images, timed as stage "recalibration"). MCD rows carry ``finetune_steps``, the steps up to the selected epoch."""
    retrain = set() if retrain is True else retrain  # each stage once, though every selection asks for it
    rows, row_scores, seconds = [], [], {}
    with timed(seconds, "split"):
        split = make_split(cfg, data, ood)
    with timed(seconds, "pre-training"):
        base = pretrained(cfg, split, retrain, progress, log, checkpoint_dir, resume)
    for i, selection in enumerate(selections or (cfg.selection,)):
        c, tuned, hists, secs = dataclasses.replace(cfg, selection=selection), {}, {}, {}
        for s in (cfg.strategies if "mcd" in methods else ()):  # later selections load the same runs, quietly
            cb = None if on_epoch is None or i else (lambda e, h, s=s: on_epoch(s, e, h))
            with timed(seconds, f"fine-tuning {s}"):
                tuned[s], hists[s], secs[s] = finetuned(c, base, split, ood, s, retrain, progress, None if i else log,
                                                        cb, checkpoint_dir, resume)
        with timed(seconds, "evaluation"):
            found, scores = evaluate(c, base, tuned, split, ood, methods, seconds)
        row_scores += [scores[f"mcd:{r['strategy']}" if r["method"] == "mcd" else r["method"]] for r in found]
        stats = {"split-bn": "per-source", "recalibrate": "recalibrated"}
        for r in found:
            r.update(model=cfg.model, eval_stats=stats.get(r["strategy"], "running"))
        if recalibrated and cfg.norm == "batch" and "mcd" in methods:
            with timed(seconds, "recalibration"):
                again = {s: _recalibrated(cfg, copy.deepcopy(m), split) for s, m in tuned.items() if s not in stats}
            more, more_scores = evaluate(c, base, again, split, ood, ("mcd",))
            found += [{**r, "model": cfg.model, "eval_stats": "recalibrated"} for r in more]
            row_scores += [more_scores[f"mcd:{r['strategy']}"] for r in more]
        for r in (r for r in found if r["method"] == "mcd"):
            h = hists[r["strategy"]]
            r.update(val_auroc=h.val_auroc[h.best_epoch], selected_epoch=h.best_epoch, finetune_seconds=secs[r["strategy"]],
                     finetune_steps=len(h.ce) // len(h.val_auroc) * (h.best_epoch + 1))
        rows += found
    seconds["evaluation"] = round(seconds["evaluation"] - seconds.get("odin search", 0.0), 2)
    return Result(rows, row_scores, scores, {"base": base, **tuned}, hists, split, seconds)
