"""``python -m mcd_helpers reproduce``: the pipeline (:mod:`mcd_helpers.experiments.pipeline`) run
into an output folder.

1. Load the ID data; per OOD set (:func:`~mcd_helpers.experiments.pipeline.run_ood_set`): the
   split, the pre-trained network and one MCD fine-tuning per strategy (both from the one cache,
   :mod:`mcd_helpers.experiments.cache`), then MSP, ODIN, energy and MCD on the test split.
2. Per OOD set write ``hist_<ood>.png`` (score histograms) and ``roc_<ood>.png`` (ROC curves);
   at the end write ``config.json``, ``results.json`` and ``results.md`` together (each
   atomically), so the three always describe the same run.

Before any training (every setting that can be checked is checked then, errors naming the flag):
the output folder is locked for this run (``<out>/.lock``, :class:`~mcd_helpers.training.checkpoint.OutputLock`)
and ``<out>/run.json`` says ``"status": "running"`` (then ``finished``, ``partial``, ``interrupted``
or ``failed``); ``--out``, the data folder and the cache folder are checked to be writable (a
read-only data folder is read, and caches go to a writable fallback, which the log names); the
data are loaded, every OOD set is made available (an offline ``mnist`` fails here, not after
pre-training) and the sizes are checked against ``n_val`` and the batch sizes. Checkpoints of
an unfinished run in ``<out>`` are never deleted silently: without ``resume`` or ``fresh`` the
run stops with :class:`~mcd_helpers.errors.UnfinishedRunError`. When one OOD set fails later, the
rows of the others are still written and the failure is recorded (``run.json``, ``results.md``).

Under ``torchrun --standalone --nproc_per_node=N -m mcd_helpers reproduce ...`` every stage trains
with DDP (:mod:`mcd_helpers.training.distributed`), the test and validation scores are
gathered from all ranks so the metrics use the whole split, and only rank 0 writes the cache,
checkpoints, ``results.json``, ``results.md`` and the plots; every rank returns the same rows.
Rank 0 prepares the data and the caches (downloads, extractions) while the other ranks wait;
a setting or data error found by rank 0 is raised on every rank (no rank is left waiting).

Every training stage checkpoints into ``<out>/checkpoints/`` (:mod:`mcd_helpers.training.loop`), so an
interrupted run continues with ``resume=True`` (CLI: ``--resume``) and ends with the same numbers.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..data.files import writable_cache_root
from ..data.sets import ood_set_size
from ..errors import (CheckpointMismatchError, ConfigError, CorruptCheckpointError, NonFiniteLossError,
                      PartialResultsError, TrainingInterrupted)
from ..metrics import METRIC_KEYS
from ..training.checkpoint import OutputLock, atomic_write_text
from ..training.distributed import check_sync_bn, init_distributed, is_main_process, on_rank0_first
from .config import MCDConfig
from .outdir import prepare_out, write_run
from .pipeline import HELD_OUT, load_data, run_ood_set

__all__ = ["run_reproduction", "results_markdown", "load_results", "check_sizes", "check_device"]

_ID_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def results_markdown(rows: list[dict], failures: dict[str, str] | None = None) -> str:
    """A Markdown table of result rows, metrics in % (the paper's unit), and the failed OOD sets if any."""
    head = ("| ID | OOD | method | strategy | FPR95 | det. error | AUROC | AUPR-In | AUPR-Out | ID acc. |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|\n")
    lines = [f"| {r['id_dataset']}{' ' + r['class_split'] if r.get('class_split') else ''} | {r['ood_dataset']} | "
             f"{r['method']} | {r['strategy'] or '-'} | "
             + " | ".join(f"{100 * r[k]:.2f}" for k in (*METRIC_KEYS, "id_accuracy")) + " |"
             for r in rows]
    text = head + "\n".join(lines) + "\n\nAll numbers in %. FPR95 and detection error: lower is better.\n"
    if failures:
        text += "\n**Failed OOD sets** (no rows):\n\n" + "".join(f"- {k}: {v}\n" for k, v in failures.items())
    return text


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
    for ood, n_ood in ood_sizes.items():  # (the held-out classes' split checks its own sizes)
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

    Rolling checkpoints go to ``out_dir/checkpoints/``: ``pretrain/`` while pre-training,
    ``mcd-<ood>-<strategy>/`` while fine-tuning; a finished stage goes to the cache
    (:mod:`mcd_helpers.experiments.cache`) and its checkpoints are removed. ``resume=True``
    continues an interrupted run: finished stages are loaded from the cache, the interrupted one
    continues from its last checkpoint, exactly (on the CPU the results equal those of an
    uninterrupted run). ``fresh=True`` deletes the checkpoints and the earlier results and starts
    over; with neither, a run that finds checkpoints stops (nothing is deleted silently).
    ``retrain=True`` computes every stage again, each once.

    Returns:
        the result rows (also in ``out_dir/results.json``): per OOD set one row each for ``msp``,
        ``odin`` and ``energy`` (the pre-trained network) and one ``mcd`` row per strategy, metrics
        as fractions (see :mod:`mcd_helpers.metrics`).

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
    lock = OutputLock(out_dir)
    try:
        # ---- before any training: --out, the caches, the data, every OOD set, the sizes ----
        on_rank0_first(lambda: prepare_out(out_dir, lock, cfg.to_dict(), resume, fresh, quiet) if is_main_process() else None)
        try:
            _, note = on_rank0_first(writable_cache_root)
            if note:
                _log(f"note: {note}", quiet)

            data = load_data(cfg)
            sizes = {ood: ood_set_size(ood, cfg.ood_size, cfg.id_dataset) for ood in cfg.ood_sets if ood != HELD_OUT}
            check_sizes(cfg, len(data.x_train), len(data.x_test), sizes, tuple(data.x_train.shape[1:]))
            rows, failures = _train_and_evaluate(cfg, env, out_dir, data, retrain, progress, quiet, resume)
        except BaseException as err:
            if main:  # this run wrote run.json's "running" (in _prepare_out): say how it ended
                status = "interrupted" if isinstance(err, (KeyboardInterrupt, TrainingInterrupted)) else "failed"
                write_run(out_dir, status=status, error=f"{type(err).__name__}: {err}")
            raise
        if main:
            _write_results(out_dir, cfg, rows, failures)
            write_run(out_dir, status="partial" if failures else "finished", failures=failures)
    finally:
        lock.release()
    if failures:
        raise PartialResultsError(
            f"{len(failures)} of {len(cfg.ood_sets)} OOD sets failed: "
            + "; ".join(f"{k}: {v}" for k, v in failures.items())
            + f". The rows of the others are in {out_dir / 'results.json'}; the failures are recorded in "
            f"{out_dir / 'run.json'} and {out_dir / 'results.md'}.", failures)
    return rows


def _train_and_evaluate(cfg, env, out_dir, data, retrain, progress, quiet, resume) -> tuple[list[dict], dict[str, str]]:
    """Per OOD set: :func:`~mcd_helpers.experiments.pipeline.run_ood_set`, log lines and plots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import plot_roc_curves, plot_score_histograms

    log = None if quiet else (lambda msg: print(msg, flush=True))
    id_name = _ID_NAMES.get(cfg.id_dataset, cfg.id_dataset)
    rows: list[dict] = []
    failures: dict[str, str] = {}
    retrained = set() if retrain else False  # --retrain: each cached stage once (OOD sets share the pre-training)
    for ood in cfg.ood_sets:
        try:
            ood_rows, scores, _, _ = run_ood_set(cfg, data, ood, retrain=retrained, progress=progress, log=log,
                                                 checkpoint_dir=out_dir / "checkpoints", resume=resume)
            for r in ood_rows:
                r["world_size"] = env.world_size
                _log(f"{ood:>12} | {r['method']:>6} {r['strategy'] or '':>11} | AUROC {100 * r['auroc']:6.2f}% | "
                     f"FPR95 {100 * r['fpr95']:5.2f}% | ID acc. {100 * r['id_accuracy']:.2f}%", quiet)
            if is_main_process():
                panels = {(f"MCD ({k[4:]})" if k.startswith("mcd:") else f"{k.upper() if k != 'energy' else k} (pre-trained)"): v
                          for k, v in scores.items()}
                for name, fig in ((f"hist_{ood}.png", plot_score_histograms(panels, f"{id_name} (ID) vs {ood} (OOD)")),
                                  (f"roc_{ood}.png", plot_roc_curves(panels, f"{id_name} vs {ood}"))):
                    fig.savefig(out_dir / name, dpi=110)
                    plt.close(fig)
        except (TrainingInterrupted, CheckpointMismatchError, KeyboardInterrupt, CorruptCheckpointError,
                NonFiniteLossError):
            raise  # the run cannot go on: resume or fix (e.g. a lower learning rate), then rerun
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
