"""``python -m mcd_helpers reproduce``: the pipeline run into an output folder.

A reproduction checks before any training everything that can be checked (the device, every OOD
set, every split and its batch sizes, errors naming the flag; the splits made then are the ones
trained on), then per OOD set runs :func:`~mcd_helpers.experiments.pipeline.run_ood_set` and writes
``hist_<ood>.png`` and ``roc_<ood>.png``; at the end ``config.json``, ``results.json`` and
``results.md`` together, and prints and records in ``run.json`` the wall-clock seconds of each stage
(``"seconds"``) and the precision that trained (``"amp"``, ``"auto"`` resolved). An OOD set that
fails later is recorded and the others still run. The output folder's rules (one run at a time,
unfinished work kept) are :func:`~mcd_helpers.experiments.files.output_folder`'s. Under torchrun
rank 0 alone writes.
"""

import dataclasses
import json
import time
from pathlib import Path

import torch

from ..data import cache_dir, data_dir
from ..errors import CheckpointError, ConfigError, TrainingInterrupted
from ..metrics import METRIC_KEYS
from ..tables import markdown_table, method_label
from . import ddp
from .config import MCDConfig, check_device
from .evaluation import timed
from .files import atomic_write, output_folder
from .pipeline import run_ood_set
from .stages import RunOptions, load_data, make_split

# the run cannot go on after these (resume, or fix the setting); other errors skip the OOD set
FATAL = (ConfigError, FloatingPointError, TrainingInterrupted, CheckpointError)


def results_markdown(rows, failures: dict | None = None) -> str:
    """``reproduce``'s table, one line per row, metrics in %, and the failed OOD sets if any."""
    lines = []
    for r in rows:
        task = r["id_dataset"] + (f" {r['class_split']}" if r.get("class_split") else "")
        metrics = [f"{100 * r[k]:.2f}" for k in (*METRIC_KEYS, "id_accuracy")]
        lines.append([task, r["ood_dataset"], r["method"], r["strategy"] or "-", *metrics])
    header = ["ID", "OOD", "method", "strategy", "FPR95", "det. error", "AUROC", "AUPR-In"]
    header += ["AUPR-Out", "ID acc."]
    failed = "".join(f"- {k}: {v}\n" for k, v in (failures or {}).items())
    text = markdown_table(header, lines, "llll" + "r" * 6)
    text += "\n\nAll numbers in %. FPR95 and detection error: lower is better.\n"
    return text + (f"\n**Failed OOD sets** (no rows):\n\n{failed}" if failed else "")


def _log_rows(log, ood: str, rows: list[dict]) -> None:
    for r in rows:
        log(
            f"{ood:>12} | {r['method']:>6} {r['strategy'] or '':>11} | AUROC "
            f"{100 * r['auroc']:6.2f}% "
            f"| FPR95 {100 * r['fpr95']:5.2f}% | ID acc. {100 * r['id_accuracy']:.2f}%"
        )


def _write_results(out: Path, cfg: MCDConfig, rows: list, failures: dict) -> None:
    """``config.json``, ``results.json`` and ``results.md``, all rendered first, then written."""
    texts = {
        "config.json": json.dumps(cfg.to_dict(), indent=2) + "\n",
        "results.json": json.dumps(rows, indent=2, allow_nan=False) + "\n",
        "results.md": results_markdown(rows, failures),
    }
    for name, text in texts.items():
        atomic_write(out / name, text)


def _run_sets(
    cfg: MCDConfig, splits: dict, how: RunOptions, out: Path, profile: dict, log
) -> tuple:
    """Every OOD set's rows, its figures written; ``(rows, failures)``: an error the run cannot go
    on from (:data:`FATAL`, or any under torchrun) stops it, another is recorded and skips the
    set."""
    rows, failures = [], {}
    for ood, split in splits.items():
        try:
            res = run_ood_set(cfg, split, ood, how=how)
        except Exception as err:  # noqa: BLE001  (recorded; the other OOD sets still run)
            if isinstance(err, FATAL) or ddp.world()[1] > 1:  # (the ranks may be out of step)
                raise
            failures[ood] = f"{type(err).__name__}: {err}"
            log(f"{ood:>12} | FAILED: {failures[ood]}; going on with the other OOD sets")
            continue
        _log_rows(log, ood, res.rows)
        profile[ood] = res.seconds
        with timed(profile, "figures"):
            if ddp.is_main():
                _plots(out, ood, cfg.id_dataset, res.scores)
        rows += [{**r, "world_size": ddp.world()[1]} for r in res.rows]
    return rows, failures


def _announce(cfg: MCDConfig, log) -> None:
    """Where data and caches go when the data folder is read-only, and the precision that trains."""
    if cache_dir() != data_dir():
        log(
            f"note: {data_dir()} is read-only: data is read from it, downloads and caches "
            f"go to {cache_dir()}."
        )
    log(
        f"training precision: amp={cfg.amp} is {cfg.resolved_amp()} on {cfg.device} (also "
        "in run.json)"
    )


def run_reproduction(
    cfg: MCDConfig,
    out_dir: Path,
    retrain: bool = False,
    progress: bool = True,
    quiet: bool = False,
    resume: bool = False,
    fresh: bool = False,
) -> list[dict]:
    """The reproduction of ``cfg`` into ``out_dir`` (see the module docstring); ``resume`` continues
    an interrupted run exactly (on the CPU its results equal an uninterrupted run's); ``retrain``
    computes every stage again, each once. Returns the rows of ``results.json``: per OOD set
    ``msp``, ``odin``, ``energy`` (the pre-trained network) and an ``mcd`` row per strategy.

    Raises:
        ConfigError, DataNotFoundError: a setting that cannot work, data that cannot be had (before
            any training; ``field`` names the setting).
        RuntimeError: some OOD sets failed after others were done (their rows are written).
        CheckpointError, FloatingPointError, TrainingInterrupted: an unreadable checkpoint or cached
            network, a diverged training, SIGTERM or SIGINT.
    """
    check_device(cfg.device)
    for ood in cfg.ood_sets:  # before anything is loaded or written
        cfg.check_ood_set(ood)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    cfg = dataclasses.replace(cfg, device=ddp.setup(cfg.device))
    out, quiet = Path(out_dir), quiet or not ddp.is_main()
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, flush=True))
    how = RunOptions(
        set() if retrain else False, progress and not quiet, log, out / "checkpoints", resume
    )
    with output_folder(out, {"config": cfg.to_dict()}, resume, fresh, quiet) as info:
        _announce(cfg, log)
        profile, started = {}, time.perf_counter()  # seconds of each stage, into run.json
        with timed(profile, "data"):  # every split made and checked before any training
            data = load_data(cfg)
            splits = {ood: make_split(cfg, data, ood) for ood in cfg.ood_sets}
        rows, failures = _run_sets(cfg, splits, how, out, profile, log)
        if ddp.is_main():
            _write_results(out, cfg, rows, failures)
        profile["total"] = round(time.perf_counter() - started, 2)
        status = "partial" if failures else "finished"
        info.update(status=status, failures=failures, seconds=profile, amp=cfg.resolved_amp())
        log(f"seconds of each stage (also in run.json): {json.dumps(profile)}")
    if failures:
        failed = "; ".join(f"{k}: {v}" for k, v in failures.items())
        raise RuntimeError(
            f"{len(failures)} of {len(cfg.ood_sets)} OOD sets failed: {failed}. The "
            f"others' rows are in {out / 'results.json'}; the failures in run.json, results.md."
        )
    return rows


def _plots(out: Path, ood: str, id_dataset: str, scores: dict) -> None:
    import matplotlib.pyplot as plt  # the backend is the caller's (Agg when headless)

    from ..plots import plot_roc_curves, plot_score_histograms

    name = (
        "Fashion-MNIST"
        if id_dataset == "fashion_mnist"
        else id_dataset.upper().replace("CIFAR", "CIFAR-")
    )
    panels = {}  # scores are named "msp", "odin", "energy", "mcd:<strategy>"
    for key, pair in scores.items():
        method, _, strategy = key.partition(":")
        panels[method_label(method, strategy)] = pair
    figures = {
        f"hist_{ood}.png": plot_score_histograms(panels, f"{name} (ID) vs {ood} (OOD)"),
        f"roc_{ood}.png": plot_roc_curves(panels, f"{name} vs {ood}"),
    }
    for file, fig in figures.items():
        fig.savefig(out / file, dpi=110)
        plt.close(fig)
