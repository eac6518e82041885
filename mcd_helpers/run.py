"""``python -m mcd_helpers reproduce``: the pipeline run into an output folder, and that folder's rules.

The folder (:func:`output_folder`, shared with ``benchmark``): one run at a time (``<out>/.lock``, a
``filelock.FileLock``); ``<out>/run.json`` says ``"status"``: ``running``, then ``finished``,
``partial``, ``interrupted`` or ``failed``. Work an unfinished run left (stage checkpoints in
``checkpoints/``, finished benchmark cells in ``cells/``) is never deleted silently: without
``--resume`` (continue it) or ``--fresh`` (delete it and the earlier results) the run stops.

A reproduction checks before any training everything that can be checked (the device, every OOD
set, every split's sizes, errors naming the flag), then per OOD set runs
:func:`~mcd_helpers.pipeline.run_ood_set` and writes ``hist_<ood>.png`` and ``roc_<ood>.png``; at
the end ``config.json``, ``results.json`` and ``results.md`` together, and prints and records in
``run.json`` the wall-clock seconds of each stage (``"seconds"``) and the precision that trained (``"amp"``,
``"auto"`` resolved). An OOD set that fails later is recorded and the others still run. Under torchrun rank 0
alone writes.
"""

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import time
from pathlib import Path

import torch

from . import ddp
from .config import MCDConfig
from .data import cache_dir, data_dir, writable
from .errors import CheckpointError, ConfigError, TrainingInterrupted
from .files import atomic_write, write_json
from .pipeline import load_data, make_split, run_ood_set, timed

OUTPUTS = ("results.json", "results.md", "summary.md", "config.json", "forest.png", "by_protocol.png")


def _read_run(out: Path) -> dict:
    try:
        return json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def output_folder(out: Path, settings: dict, resume: bool = False, fresh: bool = False, quiet: bool = False):
    """Lock ``out`` for this run, refuse to bury unfinished work, keep ``run.json``; yields a dict whose
    entries (``status``, ``failures``, counts) go into ``run.json`` when the run ends. Rank 0 does the work.

    Raises:
        ConfigError: ``--resume`` with ``--fresh``; ``out`` a file, not writable, in use by another run
            (field ``out``), or holding an unfinished run without ``--resume`` or ``--fresh`` (nothing deleted).
    """
    from filelock import FileLock, Timeout

    out, lock = Path(out), FileLock(Path(out) / ".lock")
    if resume and fresh:
        raise ConfigError("fresh", "--resume continues the work in --out and --fresh deletes it: pass one.")

    def prepare() -> None:
        if out.exists() and not out.is_dir() or not writable(out):
            raise ConfigError("out", f"{out} is {'a file' if out.is_file() else 'not writable'}: use another folder.")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise ConfigError("out", f"another run (PID {_read_run(out).get('pid', '?')}) is using --out {out}: "
                                     "one run at a time per folder. Wait for it, or choose another --out.") from None
        # what an unfinished run left: stage checkpoints always, finished benchmark cells unless the run finished
        left = sorted(out.glob("checkpoints/**/*.pt"))
        left += [] if _read_run(out).get("status") == "finished" else sorted(out.glob("cells/*.json"))
        if left and not resume and not fresh:  # (the lock is released below, as on any failure of prepare)
            shown = ", ".join(str(p.relative_to(out)) for p in left[:4]) + (" ..." if len(left) > 4 else "")
            raise ConfigError("resume", f"{out} holds unfinished work ({shown}); nothing was deleted. Pass --resume "
                                        "to continue it (same settings), --fresh to delete it, or another --out.")
        if fresh:
            if left and not quiet:
                print(f"--fresh: deleting the earlier run's checkpoints, cells and results in {out}", flush=True)
            for path in [out / "checkpoints", out / "cells", out / "scores", *map(out.joinpath, OUTPUTS),
                         out / "run.json", *out.glob("hist_*.png"), *out.glob("roc_*.png")]:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        write_json(out / "run.json", {"status": "running", "pid": os.getpid(), "resumed": resume,
                                      "started": datetime.datetime.now().isoformat(timespec="seconds"), **settings})

    info, prepared = {"status": "finished"}, False  # info: what run.json gets when the run ends; the run adds to it
    try:
        ddp.rank0_first(lambda: prepare() if ddp.is_main() else None)
        prepared = True  # from here on, run.json records how the run ends
        yield info
    except BaseException as err:
        info = {"status": "interrupted" if isinstance(err, (KeyboardInterrupt, TrainingInterrupted)) else "failed",
                 "error": f"{type(err).__name__}: {err}"}
        raise
    finally:
        try:
            if prepared and ddp.is_main():  # a failed prepare leaves run.json as it was
                write_json(out / "run.json", {**_read_run(out), **info,
                                              "updated": datetime.datetime.now().isoformat(timespec="seconds")})
        finally:
            if lock.is_locked:  # taken, also when a deletion or a write of prepare failed: free the folder again
                lock.release()


def check_split(cfg, split, name: str) -> None:
    """Raise ConfigError (naming the flag) when a batch size is larger than the set it is drawn from."""
    sup, unsup = (len(split.x_sup), "labeled"), (len(split.x_unsup), "unlabeled")
    for field, (n, kind) in (("pretrain_batch_size", sup), ("batch_size_sup", sup), ("batch_size_unsup", unsup)):
        if getattr(cfg, field) > n:
            raise ConfigError(field, f"{field}={getattr(cfg, field)} is larger than the {n} {kind} images of {name} "
                                     f"(train_subset={cfg.train_subset}, n_val={cfg.n_val}).")


def check_device(device: str) -> None:
    """ConfigError (field ``device``) unless ``device`` names a device this PyTorch sees (cpu, cuda[:i], xpu, mps)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ConfigError("device", f"device={device!r} is not a device name; use cpu, cuda or cuda:0.") from None
    if not {"cpu": True, "cuda": torch.cuda.is_available(), "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
            "mps": torch.backends.mps.is_available()}.get(kind, False):
        raise ConfigError("device", f"device={device!r}, but PyTorch sees no such device; run with --device cpu.")


def run_reproduction(cfg: MCDConfig, out_dir: Path, retrain: bool = False, progress: bool = True, quiet: bool = False,
                     resume: bool = False, fresh: bool = False) -> list[dict]:
    """The reproduction of ``cfg`` into ``out_dir`` (see the module docstring); ``resume`` continues an
    interrupted run exactly (on the CPU its results equal an uninterrupted run's); ``retrain`` computes
    every stage again, each once.

    Returns:
        the rows of ``results.json``: per OOD set ``msp``, ``odin``, ``energy`` (the pre-trained network) and
        one ``mcd`` row per strategy, metrics as fractions.

    Raises:
        ConfigError: a setting that cannot work (before any training; ``field`` names it).
        DataNotFoundError: the ID data or an OOD set cannot be had (before training).
        RuntimeError: some OOD sets failed after others were done (their rows are written).
        CheckpointError: a checkpoint or cached network is unreadable or does not fit.
        FloatingPointError: training diverged. TrainingInterrupted: SIGTERM/SIGINT.
    """
    cfg.check_ood_sets()
    check_device(cfg.device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    cfg = dataclasses.replace(cfg, device=ddp.setup(cfg.device))
    out, quiet = Path(out_dir), quiet or not ddp.is_main()
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, flush=True))
    with output_folder(out, {"config": cfg.to_dict()}, resume, fresh, quiet) as info:
        if not quiet and cache_dir() != data_dir():
            log(f"note: {data_dir()} is read-only: data is read from it, downloads and caches go to {cache_dir()}.")
        log(f"training precision: amp={cfg.amp} is {cfg.resolved_amp()} on {cfg.device} (also in run.json)")
        profile, started = {}, time.perf_counter()  # wall-clock seconds of each stage, into run.json
        with timed(profile, "data"):
            data = load_data(cfg)
            for ood in cfg.ood_sets:  # every split made once before training: sizes, and OOD sets that cannot be had
                check_split(cfg, make_split(cfg, data, ood), f"the {ood} split")
        rows, failures, retrained = [], {}, set() if retrain else False
        for ood in cfg.ood_sets:
            try:
                res = run_ood_set(cfg, data, ood, retrain=retrained, progress=progress and not quiet, log=log,
                                  checkpoint_dir=out / "checkpoints", resume=resume)
            except Exception as err:  # noqa: BLE001  (recorded; the other OOD sets still run)
                if isinstance(err, (ConfigError, FloatingPointError, TrainingInterrupted, CheckpointError)) or ddp.world()[1] > 1:
                    raise  # the run cannot go on (resume, or fix the setting), or the ranks may be out of step
                failures[ood] = f"{type(err).__name__}: {err}"
                log(f"{ood:>12} | FAILED: {failures[ood]}; going on with the other OOD sets")
                continue
            log("\n".join(f"{ood:>12} | {r['method']:>6} {r['strategy'] or '':>11} | AUROC {100 * r['auroc']:6.2f}%"
                          f" | FPR95 {100 * r['fpr95']:5.2f}% | ID acc. {100 * r['id_accuracy']:.2f}%"
                          for r in res.rows))
            profile[ood] = res.seconds
            with timed(profile, "figures"):
                if ddp.is_main():
                    _plots(out, ood, cfg.id_dataset, res.scores)
            rows += [{**r, "world_size": ddp.world()[1]} for r in res.rows]
        if ddp.is_main():
            from .report import results_markdown

            for name, text in {"config.json": json.dumps(cfg.to_dict(), indent=2) + "\n",  # all rendered, then written
                               "results.json": json.dumps(rows, indent=2, allow_nan=False) + "\n",
                               "results.md": results_markdown(rows, failures)}.items():
                atomic_write(out / name, text)
        profile["total"] = round(time.perf_counter() - started, 2)
        info.update(status="partial" if failures else "finished", failures=failures, seconds=profile,
                    amp=cfg.resolved_amp())
        log(f"seconds of each stage (also in run.json): {json.dumps(profile)}")
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(cfg.ood_sets)} OOD sets failed: "
                           + "; ".join(f"{k}: {v}" for k, v in failures.items())
                           + f". The others' rows are in {out / 'results.json'}; the failures in run.json, results.md.")
    return rows


def _plots(out: Path, ood: str, id_dataset: str, scores: dict) -> None:
    import matplotlib.pyplot as plt  # the backend is the caller's (Agg when headless)

    from .plots import plot_roc_curves, plot_score_histograms

    name = "Fashion-MNIST" if id_dataset == "fashion_mnist" else id_dataset.upper().replace("CIFAR", "CIFAR-")
    panels = {f"MCD ({k[4:]})" if k.startswith("mcd:") else f"{k if k == 'energy' else k.upper()} (pre-trained)": v
              for k, v in scores.items()}
    for file, fig in ((f"hist_{ood}.png", plot_score_histograms(panels, f"{name} (ID) vs {ood} (OOD)")),
                      (f"roc_{ood}.png", plot_roc_curves(panels, f"{name} vs {ood}"))):
        fig.savefig(out / file, dpi=110)
        plt.close(fig)
