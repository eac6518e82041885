"""The reproduction pipeline behind ``python -m mcd_helpers reproduce``.

1. Load Fashion-MNIST (ID) and pre-train the model, or reuse the cached pre-trained checkpoint
   (``<cache root>/checkpoints/pretrain-<model>-<hash>.pt``, the hash covering every setting
   that shapes it).
2. For each OOD set: the transductive split; the MSP baseline on the pre-trained network; then
   one MCD fine-tuning per strategy, each from the same pre-trained weights and seed.
3. Evaluate on the test split; per OOD set write ``hist_<ood>.png`` (score histograms) and
   ``roc_<ood>.png`` (ROC curves); at the end write ``config.json``, ``results.json`` and
   ``results.md`` together (each atomically), so the three always describe the same run.

Before any training (every setting that can be checked is checked then, errors naming the flag):
the output folder is locked for this run (``<out>/.lock``, :class:`~mcd_helpers.checkpoint.OutputLock`)
and ``<out>/run.json`` says ``"status": "running"`` (then ``finished``, ``partial``, ``interrupted``
or ``failed``); ``--out``, the data folder and the cache folder are checked to be writable (a
read-only data folder is read, and caches go to a writable fallback, which the log names); the
data are loaded, every OOD set is made available (an offline ``mnist`` fails here, not after
pre-training) and the sizes are checked against ``n_val`` and the batch sizes. Checkpoints of
an unfinished run in ``<out>`` are never deleted silently: without ``resume`` or ``fresh`` the
run stops with :class:`~mcd_helpers.errors.UnfinishedRunError`. When one OOD set fails later, the
rows of the others are still written and the failure is recorded (``run.json``, ``results.md``).

Under ``torchrun --standalone --nproc_per_node=N -m mcd_helpers reproduce ...`` every stage trains
with DDP (:mod:`mcd_helpers.distributed`: settings and why), the test and validation scores are
gathered from all ranks so the metrics use the whole split, and only rank 0 writes the cache,
checkpoints, ``results.json``, ``results.md`` and the plots; every rank returns the same rows.
Rank 0 prepares the data and the caches (downloads, extractions) while the other ranks wait;
a setting or data error found by rank 0 is raised on every rank (no rank is left waiting).

Every training stage checkpoints into ``<out>/checkpoints/`` (:mod:`mcd_helpers.train`), so an
interrupted run continues with ``resume=True`` (CLI: ``--resume``) and ends with the same numbers.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import torch

from ..training.checkpoint import (CorruptCheckpointError, OutputLock, RollingCheckpoint, atomic_write_json, atomic_write_text,
                         load_checkpoint, save_checkpoint)
from .config import MCDConfig
from ..data.files import check_writable, data_roots, writable_cache_root
from ..training.distributed import (average_buffers, check_sync_bn, gather_scores, init_distributed, is_main_process,
                          stage_key)
from ..data.sets import cache_root, load_id, load_ood, ood_set_size, transductive_split
from ..errors import ConfigError, PartialResultsError, UnfinishedRunError
from ..losses import discrepancy_score, msp_score
from ..metrics import METRIC_KEYS, ood_metrics
from ..models import TwoHeadNet, build_model
from ..training.engine import CheckpointMismatchError, TrainingInterrupted
from ..training.loop import finetune, predict_logits, pretrain, set_seed

__all__ = ["run_reproduction", "pretrained_model", "id_accuracy", "results_markdown", "load_results",
           "unfinished_work", "check_sizes", "check_device"]

_ID_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


def id_accuracy(logits1: torch.Tensor, targets: torch.Tensor) -> float:
    """Classification accuracy (fraction) of F1 on ID data.

    F1 is the network's classifier: in the official Step A only F1's cross-entropy reaches G
    (F2 sees detached features), and Step B pushes F2 to be confident on unlabeled data.

    Shapes:
        logits1: ``(N, K)``; targets: ``(N,)``.
    """
    return float((logits1.argmax(1) == targets).float().mean())


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def _fresh_copy(cfg: MCDConfig, model: TwoHeadNet) -> TwoHeadNet:
    """A plain (uncompiled, CPU) model of ``cfg.model`` holding ``model``'s weights and buffers."""
    fresh = build_model(cfg.model, model.in_channels, model.num_classes, cfg.norm)
    fresh.load_state_dict(model.state_dict())
    return fresh


def pretrained_model(cfg: MCDConfig, x: torch.Tensor, y: torch.Tensor, retrain: bool = False,
                     progress: bool = True, quiet: bool = False, checkpoint_dir: Path | None = None,
                     resume: bool = False) -> TwoHeadNet:
    """The pre-trained network for ``cfg``: loaded from the cache if there, else trained and cached.

    The cache file is ``<cache root>/checkpoints/pretrain-<model>-<cfg.pretrain_key()>.pt``
    (looked for in the data folder and the writable fallback cache; written to the writable one).
    While training, checkpoints go to ``checkpoint_dir`` (when given); ``resume=True`` continues
    from them. Returns a plain model on the CPU (not compiled), whatever ``cfg``'s fast path.

    Raises:
        NonFiniteLossError, TrainingInterrupted: from :func:`~mcd_helpers.train.pretrain`.
        CorruptCheckpointError: when the cached file holds a network of another architecture
            (the message says to pass ``--retrain``).
        NotWritableError: when no cache folder can be written.
    """
    name = f"pretrain-{cfg.model}-{stage_key(cfg.pretrain_key(), cfg.sync_bn)}.pt"
    write_root, _ = writable_cache_root()
    path = write_root / "checkpoints" / name
    in_channels, num_classes = x.shape[1], int(y.max()) + 1
    model = build_model(cfg.model, in_channels, num_classes, cfg.norm)
    # rank 0 decides whether the cached network is used, so that all ranks train or none does
    cached = None if retrain else _on_rank0_first(
        lambda: next((p for p in [r / "checkpoints" / name for r in data_roots()] + [path] if p.exists()), None))
    if cached is not None:
        try:
            state = load_checkpoint(cached, required=("model",))["model"]
        except CorruptCheckpointError as err:
            _log(f"{err} Training again.", quiet)
        else:
            try:
                model.load_state_dict(state)
            except RuntimeError as err:  # another architecture or width under this name
                raise CorruptCheckpointError(
                    f"the cached pre-trained network {cached} does not fit {cfg.model} (norm={cfg.norm}, "
                    f"{in_channels} input channels, {num_classes} classes): "
                    f"{str(err).splitlines()[0].strip()} Pass --retrain (retrain=True) to pre-train it again "
                    "(the file is replaced), or delete the file.") from err
            _log(f"reusing the pre-trained network {cached}", quiet)
            return model
    ckpt = RollingCheckpoint(checkpoint_dir) if checkpoint_dir is not None else None
    set_seed(cfg.seed)
    model = build_model(cfg.model, in_channels, num_classes, cfg.norm)
    t0 = time.time()
    losses = pretrain(model, x, y, cfg, progress=progress, checkpoint=ckpt, resume=resume)
    _log(f"pre-trained {cfg.model} for {cfg.pretrain_epochs} epochs in {time.time() - t0:.0f} s "
         f"(last epoch's loss {losses[-1]:.3f} nats)", quiet)
    model = _fresh_copy(cfg, model.cpu())
    if not is_main_process():
        return model
    save_checkpoint(path, {"model": model.state_dict(), "config": cfg.to_dict(), "losses": losses})
    if ckpt is not None:
        ckpt.clear()  # the cache file now holds the result
    return model


def results_markdown(rows: list[dict], failures: dict[str, str] | None = None) -> str:
    """A Markdown table of result rows, metrics in % (the paper's unit), and the failed OOD sets if any."""
    head = ("| ID | OOD | method | strategy | FPR95 | det. error | AUROC | AUPR-In | AUPR-Out | ID acc. |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|\n")
    lines = [f"| {r['id_dataset']} | {r['ood_dataset']} | {r['method']} | {r['strategy'] or '-'} | "
             + " | ".join(f"{100 * r[k]:.2f}" for k in (*METRIC_KEYS, "id_accuracy")) + " |"
             for r in rows]
    text = head + "\n".join(lines) + "\n\nAll numbers in %. FPR95 and detection error: lower is better.\n"
    if failures:
        text += "\n**Failed OOD sets** (no rows):\n\n" + "".join(f"- {k}: {v}\n" for k, v in failures.items())
    return text


def _row(cfg: MCDConfig, ood: str, method: str, strategy, metrics: dict, acc: float, **extra) -> dict:
    return {"id_dataset": cfg.id_dataset, "ood_dataset": ood, "method": method, "strategy": strategy,
            "seed": cfg.seed, **metrics, "id_accuracy": acc, **extra}


def _finetuned(cfg: MCDConfig, base: TwoHeadNet, x_train, y_train, split, ood: str, strategy: str,
               ckpt_dir: Path, progress: bool, quiet: bool, resume: bool) -> tuple[TwoHeadNet, dict]:
    """One fine-tuning stage: reloaded when a resumed run finished it already, else trained.

    Returns the fine-tuned model (best validation AUROC) and ``{"val_auroc", "seconds"}``.
    """
    final = ckpt_dir / f"mcd-{ood}-{strategy}.pt"
    if resume and final.exists():
        try:
            state = load_checkpoint(final, required=("model", "key", "val_auroc", "seconds"))
            if state["key"] != stage_key(cfg.training_key(), cfg.sync_bn):
                raise CheckpointMismatchError(
                    f"{final} was fine-tuned with other settings ({state['key']}) than this run's "
                    f"({stage_key(cfg.training_key(), cfg.sync_bn)}): the settings changed. Resume with the "
                    "same settings, or run without --resume (or with another --out).")
            model = _fresh_copy(cfg, base)
            model.load_state_dict(state["model"])
            _log(f"{ood:>12} | mcd {strategy:>8} | finished before, reloaded from {final}", quiet)
            return model.to(cfg.device), state
        except CorruptCheckpointError as err:
            _log(f"{err} Fine-tuning again.", quiet)
    stage = RollingCheckpoint(ckpt_dir / f"mcd-{ood}-{strategy}")
    set_seed(cfg.seed)
    model = _fresh_copy(cfg, base)
    t0 = time.time()
    hist = finetune(model, x_train, y_train, split, cfg, strategy, progress=progress, checkpoint=stage,
                    resume=resume)
    info = {"val_auroc": hist.val_auroc, "seconds": round(time.time() - t0, 1)}
    if not is_main_process():
        return model, info
    save_checkpoint(final, {"model": model.state_dict(), "config": cfg.to_dict(),
                            "key": stage_key(cfg.training_key(), cfg.sync_bn), "ood": ood, "strategy": strategy, **info})
    stage.clear()  # the final file now holds the result
    return model, info


def _on_rank0_first(fn):
    """``fn()`` on rank 0 first, then (once it succeeded) on the other ranks, which wait meanwhile.

    In one process it is just ``fn()``. Under ``torchrun`` rank 0's exception, if any, is sent to
    every rank and raised there too, so that no rank waits forever for a rank that gave up.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    main, result, err = is_main_process(), None, None
    if main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (sent to the other ranks, raised everywhere)
            err = e
    sent = err
    if err is not None:
        try:
            pickle.dumps(err)
        except Exception:  # noqa: BLE001  (an exception that does not pickle: send its text)
            sent = RuntimeError(f"rank 0 stopped the run: {type(err).__name__}: {err}")
    box = [sent]
    dist.broadcast_object_list(box, src=0)  # the other ranks wait here while rank 0 works
    if box[0] is not None:
        if main:
            raise err
        raise box[0]  # the same error class and message as on rank 0
    return result if main else fn()


def check_device(cfg: MCDConfig) -> None:
    """Raise :class:`~mcd_helpers.errors.ConfigError` when ``cfg.device`` is not available here."""
    kind = torch.device(cfg.device).type
    available = {"cpu": lambda: True, "cuda": torch.cuda.is_available,
                 "mps": lambda: getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}[kind]
    if not available():
        hint = {"cuda": "PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False)",
                "mps": "PyTorch sees no Apple-silicon GPU here (torch.backends.mps.is_available() is False)",
                "xpu": "PyTorch sees no Intel GPU here (torch.xpu.is_available() is False)"}[kind]
        raise ConfigError("device", f"device={cfg.device!r} but {hint}; run with --device cpu "
                                    "(the paper presets default to cuda).")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_sizes(cfg: MCDConfig, n_train: int, n_test: int, ood_sizes: dict[str, int],
                image_shape: tuple[int, ...]) -> None:
    """Check the batch sizes, ``n_val`` and ``ood_size`` against the data before any training.

    Args:
        n_train: ID training images (after ``train_subset``); n_test: ID test images (after
            ``test_subset``); ood_sizes: images per OOD set; image_shape: ``(C, H, W)``.

    Raises:
        ConfigError: naming the field (the CLI shows its flag) and the sizes involved.
    """
    generated = [n for n in ("photo_crops", "gaussian", "uniform") if n in cfg.ood_sets]
    need = 3 * cfg.ood_size * int(torch.tensor(image_shape).prod()) * 4  # float32; the split and unlabeled copies
    if generated and need > _memory_bytes() // 2:
        raise ConfigError("ood_size", f"ood_size={cfg.ood_size:,} generated images ({', '.join(generated)}) need about "
                                      f"{need / 1e9:.1f} GB of memory, more than half of this machine's "
                                      f"{_memory_bytes() / 1e9:.1f} GB; ODIN uses 10,000.")
    if cfg.pretrain_batch_size > n_train:
        raise ConfigError("pretrain_batch_size", f"pretrain_batch_size={cfg.pretrain_batch_size} is larger than the "
                                                 f"{n_train} ID training images (train_subset={cfg.train_subset}); "
                                                 "no full batch could be formed.")
    if cfg.batch_size_sup > n_train:
        raise ConfigError("batch_size_sup", f"batch_size_sup={cfg.batch_size_sup} is larger than the {n_train} "
                                            f"labeled ID training images (train_subset={cfg.train_subset}).")
    for ood, n_ood in ood_sizes.items():
        for what, n in (("ID test set", n_test), (f"OOD set {ood}", n_ood)):
            if cfg.n_val >= n:
                raise ConfigError("n_val", f"n_val={cfg.n_val} validation images are taken from the {what}, which "
                                           f"has only {n}; at least one must be left for testing. Pass a smaller "
                                           "n_val" + (" or a larger test_subset" if "ID" in what else
                                                      " or a larger ood_size" if ood in generated else "") + ".")
        unlabeled = (n_test - cfg.n_val) + (n_ood - cfg.n_val)
        if cfg.batch_size_unsup > unlabeled:
            raise ConfigError("batch_size_unsup", f"batch_size_unsup={cfg.batch_size_unsup} is larger than the "
                                                  f"{unlabeled} unlabeled images of the {ood} split (test ID + test "
                                                  "OOD, after n_val of each went to validation).")


def _read_run(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def unfinished_work(out_dir: Path) -> list[Path]:
    """Checkpoint files in ``out_dir/checkpoints`` that an unfinished run left (empty when none).

    Rolling checkpoints (``<stage>/last*.pt``) always count; finished stages' ``mcd-*.pt`` count
    unless ``run.json`` (or, for folders from before ``run.json``, a ``results.json`` with no
    rolling checkpoint) says the run finished.
    """
    ckpt = Path(out_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    rolling, finals = sorted(ckpt.glob("*/last*.pt")), sorted(ckpt.glob("*.pt"))
    status = _read_run(Path(out_dir)).get("status")
    if status == "finished" or (status is None and (Path(out_dir) / "results.json").exists()):
        return rolling
    return rolling + finals


def _write_run(out_dir: Path, **fields) -> None:
    atomic_write_json(out_dir / "run.json", {**_read_run(out_dir), **fields,
                                             "updated": datetime.datetime.now().isoformat(timespec="seconds")})


def _prepare_out(out_dir: Path, lock: OutputLock, cfg: MCDConfig, resume: bool, fresh: bool, quiet: bool) -> None:
    """Rank 0: ``--out`` writable, locked, no unfinished run in the way; ``run.json`` says running."""
    check_writable(out_dir, "--out", "choose another --out")
    lock.acquire()
    if lock.stale_pid is not None:
        _log(f"note: {lock.path} was left by PID {lock.stale_pid}, which no longer runs; taken over.", quiet)
    left = unfinished_work(out_dir)
    if left and not resume:
        if not fresh:
            shown = ", ".join(str(p.relative_to(out_dir)) for p in left[:4]) + (" ..." if len(left) > 4 else "")
            raise UnfinishedRunError(
                f"{out_dir} holds checkpoints of an unfinished run ({shown}). Pass --resume to continue it "
                "(same settings), or --fresh to delete them and start over, or choose another --out. "
                "Nothing was deleted.")
        shutil.rmtree(out_dir / "checkpoints")
        _log(f"--fresh: deleted the checkpoints of the earlier run in {out_dir / 'checkpoints'}", quiet)
    if fresh:
        (out_dir / "run.json").unlink(missing_ok=True)
    _write_run(out_dir, status="running", pid=os.getpid(), resumed=bool(resume),
               started=datetime.datetime.now().isoformat(timespec="seconds"), config=cfg.to_dict(), failures={})


def _write_results(out_dir: Path, cfg: MCDConfig, rows: list[dict], failures: dict[str, str]) -> None:
    """``config.json``, ``results.json``, ``results.md`` together: all three rendered first, then written."""
    blobs = {"config.json": json.dumps(cfg.to_dict(), indent=2, allow_nan=False) + "\n",
             "results.json": json.dumps(rows, indent=2, allow_nan=False) + "\n",
             "results.md": results_markdown(rows, failures)}
    for name, text in blobs.items():
        atomic_write_text(out_dir / name, text)


def run_reproduction(cfg: MCDConfig, out_dir: Path, retrain: bool = False, progress: bool = True,
                     quiet: bool = False, resume: bool = False, fresh: bool = False) -> list[dict]:
    """Run the whole reproduction for ``cfg`` and write the results into ``out_dir``.

    Checkpoints go to ``out_dir/checkpoints/``: ``pretrain/`` while pre-training (the result goes
    to the cache), ``mcd-<ood>-<strategy>/`` while fine-tuning and ``mcd-<ood>-<strategy>.pt`` once
    a fine-tuning stage is done. ``resume=True`` continues an interrupted run from them: finished
    stages are reloaded, the interrupted one continues from its last checkpoint, exactly (on the
    CPU the results equal those of an uninterrupted run). ``fresh=True`` deletes them and starts
    over; with neither, a run that finds them stops (nothing is deleted silently).

    Returns:
        the result rows (also in ``out_dir/results.json``): one ``msp`` row per OOD set and one
        ``mcd`` row per OOD set and strategy, metrics as fractions (see :mod:`mcd_helpers.metrics`).

    Raises:
        ConfigError: (a ValueError) on a setting that cannot work: an unknown OOD set, a device
            that is not available, batch sizes or ``n_val`` larger than the data, a huge
            ``ood_size`` (all checked before any work); ``field`` names the setting.
        DataNotFoundError: when the ID data or an OOD set cannot be had (checked before training).
        NotWritableError: when ``out_dir`` or every cache folder cannot be written, or ``out_dir``
            is a file (checked before training).
        OutputLockedError: while another run uses ``out_dir``.
        UnfinishedRunError: when ``out_dir`` holds checkpoints of an unfinished run and neither
            ``resume`` nor ``fresh`` is set.
        PartialResultsError: when an OOD set failed after others were done; their rows are written
            and the failures recorded in ``run.json`` and ``results.md``.
        NonFiniteLossError: when training diverges (the last good checkpoint is kept).
        TrainingInterrupted: on SIGTERM or SIGINT during training, after a checkpoint is saved.
        CheckpointMismatchError: (a ValueError) when resuming with settings that differ from the
            interrupted run's.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import plot_roc_curves, plot_score_histograms

    if resume and fresh:
        raise ConfigError("fresh", "--resume continues the checkpoints in --out and --fresh deletes them: pass one.")
    cfg.check_ood_sets()
    check_device(cfg)
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    # ---- torchrun: process group, this rank's device; only rank 0 logs and writes ----
    env, device = init_distributed(cfg.device)
    if device != cfg.device:
        cfg = dataclasses.replace(cfg, device=device)
    if cfg.sync_bn and env.distributed:
        check_sync_bn(cfg.device)
    main = is_main_process()
    quiet, progress = quiet or not main, progress and main
    out_dir = Path(out_dir)
    ckpt_dir = out_dir / "checkpoints"
    lock = OutputLock(out_dir)
    try:
        # ---- before any training: --out, the caches, the data, every OOD set, the sizes ----
        _on_rank0_first(lambda: _prepare_out(out_dir, lock, cfg, resume, fresh, quiet) if is_main_process() else None)
        try:
            _, note = _on_rank0_first(writable_cache_root)
            if note:
                _log(f"note: {note}", quiet)

            def load_data():
                x_tr, y_tr = load_id(cfg.id_dataset, train=True)
                x_te, y_te = load_id(cfg.id_dataset, train=False)
                sizes = {ood: ood_set_size(ood, cfg.ood_size, cfg.id_dataset) for ood in cfg.ood_sets}
                if cfg.train_subset > 0:
                    x_tr, y_tr = x_tr[:cfg.train_subset], y_tr[:cfg.train_subset]
                if cfg.test_subset > 0:
                    x_te, y_te = x_te[:cfg.test_subset], y_te[:cfg.test_subset]
                check_sizes(cfg, len(x_tr), len(x_te), sizes, tuple(x_tr.shape[1:]))
                return x_tr, y_tr, x_te, y_te

            x_train, y_train, x_test, y_test = _on_rank0_first(load_data)  # rank 0 downloads; the others wait
            rows, failures = _train_and_evaluate(cfg, env, out_dir, ckpt_dir, x_train, y_train, x_test, y_test,
                                                 retrain, progress, quiet, resume, plt, plot_roc_curves,
                                                 plot_score_histograms)
        except BaseException as err:
            if main:  # this run wrote run.json's "running" (in _prepare_out): say how it ended
                status = "interrupted" if isinstance(err, (KeyboardInterrupt, TrainingInterrupted)) else "failed"
                _write_run(out_dir, status=status, error=f"{type(err).__name__}: {err}")
            raise
        if main:
            _write_results(out_dir, cfg, rows, failures)
            _write_run(out_dir, status="partial" if failures else "finished", failures=failures)
    finally:
        lock.release()
    if failures:
        raise PartialResultsError(
            f"{len(failures)} of {len(cfg.ood_sets)} OOD sets failed: "
            + "; ".join(f"{k}: {v}" for k, v in failures.items())
            + f". The rows of the others are in {out_dir / 'results.json'}; the failures are recorded in "
            f"{out_dir / 'run.json'} and {out_dir / 'results.md'}.", failures)
    return rows


def _train_and_evaluate(cfg, env, out_dir, ckpt_dir, x_train, y_train, x_test, y_test, retrain, progress, quiet,
                        resume, plt, plot_roc_curves, plot_score_histograms) -> tuple[list[dict], dict[str, str]]:
    """Pre-training (or the cached network), then per OOD set: MSP, MCD per strategy, plots."""
    main = is_main_process()

    def logits(model, x):  # both heads' logits on all of x, scored in shards by all ranks
        return gather_scores(lambda t: predict_logits(model, t, cfg.eval_batch_size, cfg.device), x)

    base = pretrained_model(cfg, x_train, y_train, retrain=retrain, progress=progress, quiet=quiet,
                            checkpoint_dir=ckpt_dir / "pretrain", resume=resume)
    base.to(cfg.device)
    average_buffers(base)  # after DDP pre-training the ranks' BatchNorm statistics differ: use their mean
    id_name = _ID_NAMES.get(cfg.id_dataset, cfg.id_dataset)

    rows: list[dict] = []
    failures: dict[str, str] = {}
    for ood in cfg.ood_sets:
        try:
            ood_rows = []
            split = transductive_split(x_test, y_test, load_ood(ood, cfg.ood_size, cfg.seed, cfg.id_dataset),
                                       cfg.n_val, cfg.split_seed)
            # ---- MSP baseline on the pre-trained network (F1's softmax) ----
            l1_id, _ = logits(base, split.test_id_x)
            l1_ood, _ = logits(base, split.test_ood_x)
            msp = (msp_score(l1_id), msp_score(l1_ood))
            ood_rows.append(_row(cfg, ood, "msp", None, ood_metrics(*msp), id_accuracy(l1_id, split.test_id_y),
                                 world_size=env.world_size))
            panels, curves = {"MSP (pre-trained)": msp}, {"MSP (pre-trained)": msp}
            # ---- MCD fine-tuning, once per strategy, from the same weights and seed ----
            for strategy in cfg.strategies:
                model, info = _finetuned(cfg, base, x_train, y_train, split, ood, strategy, ckpt_dir,
                                         progress, quiet, resume)
                average_buffers(model)
                l1_id, l2_id = logits(model, split.test_id_x)
                l1_ood, l2_ood = logits(model, split.test_ood_x)
                mcd = (discrepancy_score(l1_id, l2_id), discrepancy_score(l1_ood, l2_ood))
                m = ood_metrics(*mcd)
                ood_rows.append(_row(cfg, ood, "mcd", strategy, m, id_accuracy(l1_id, split.test_id_y),
                                     best_val_auroc=max(info["val_auroc"]), finetune_seconds=info["seconds"],
                                     world_size=env.world_size))
                panels[f"MCD ({strategy})"] = curves[f"MCD ({strategy})"] = mcd
                _log(f"{ood:>12} | mcd {strategy:>8} | AUROC {100 * m['auroc']:6.2f}% | FPR95 "
                     f"{100 * m['fpr95']:5.2f}% | ID acc. {100 * ood_rows[-1]['id_accuracy']:.2f}% | "
                     f"{info['seconds']:.0f} s", quiet)
            if main:
                for name, fig in ((f"hist_{ood}.png", plot_score_histograms(panels, f"{id_name} (ID) vs {ood} (OOD)")),
                                  (f"roc_{ood}.png", plot_roc_curves(curves, f"{id_name} vs {ood}"))):
                    fig.savefig(out_dir / name, dpi=110)
                    plt.close(fig)
        except (TrainingInterrupted, CheckpointMismatchError, KeyboardInterrupt, CorruptCheckpointError):
            raise  # the run cannot go on: resume or fix, then rerun
        except Exception as err:  # noqa: BLE001  (recorded; the other OOD sets still run)
            if env.distributed:
                raise  # the ranks may be out of step: stop them all
            failures[ood] = f"{type(err).__name__}: {err}"
            _log(f"{ood:>12} | FAILED: {failures[ood]}; going on with the other OOD sets", quiet)
            continue
        rows += ood_rows
    return rows, failures


def load_results(out_dir: Path) -> list[dict]:
    """Read ``out_dir/results.json``."""
    return json.loads((Path(out_dir) / "results.json").read_text())
