"""``python -m mcd_helpers benchmark``: near-OOD experiments that can tell the answers apart.

A benchmark preset (:data:`BENCHMARK_PRESETS`) is a grid of *cells*, one per seed, class split,
task and protocol. Each cell goes through the one pipeline (:mod:`mcd_helpers.experiments.pipeline`):
the split, the pre-trained network (cached), one MCD fine-tuning per strategy (cached; both model
selections come from the same run), then MSP, ODIN, energy and MCD on the test split, under each
model selection. Tasks:

* ``near-ood``: ID = the 6 known classes of a Fashion-MNIST class split, OOD = its 4 held-out
  classes (:mod:`mcd_helpers.data.nearood`), under every protocol of the preset;
* ``far-ood``: ID = the known classes of the first class split, OOD = a far set (digits, photo
  crops, noise), under the transductive protocol (the one the paper uses for such sets).

MCD runs on ``small_cnn`` with BatchNorm under each strategy (``separate``, ``concat``, and the
remedies ``split-bn`` and ``recalibrate``) and on ``small_cnn(norm="group")``, the reference in
which no sample is coupled to another (rows with ``norm = "group"``). The seed varies the
pre-training and the fine-tuning (initialisation, data order, generated OOD sets); the class
splits and the protocol splits are fixed (``split_seed``), so two strategies with the same seed
are a pair.

``DIR`` gets ``results.json`` (one row per cell, selection, method and strategy: ``task``,
``class_split``, ``protocol``, ``selection``, ``method``, ``strategy``, ``norm``, ``seed``, the five
metrics and ``id_accuracy`` as fractions, ``scores``), ``scores/<row>.npz`` (arrays ``id`` and
``ood``, the per-sample test scores, higher = more OOD), ``summary.md`` (means with 95% confidence
intervals and paired differences, :mod:`mcd_helpers.experiments.stats`), ``forest.png`` and
``by_protocol.png``. A finished cell is written to ``DIR/cells/`` at once, so an interrupted run
continues with ``--resume`` where it stopped (training stages also from their checkpoints).

Example::

    python -m mcd_helpers benchmark --preset near-ood-quick --out runs/near-ood-quick
"""
from __future__ import annotations

import dataclasses
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..data.nearood import PROTOCOLS, SELECTIONS, class_split
from ..data.sets import OFFLINE_OOD_SETS
from ..errors import CheckpointMismatchError, ConfigError, TrainingInterrupted
from ..metrics import METRIC_KEYS
from ..steps import STRATEGIES
from ..training.checkpoint import OutputLock, atomic_write_bytes, atomic_write_json, atomic_write_text
from .cache import cache_key
from .config import MCDConfig
from .outdir import CELLS, prepare_out, write_run
from .pipeline import (HELD_OUT, METHODS, selected_epoch, evaluate, finetuned, load_data, make_split, pretrained,
                       trained_as)
from .report import write_report

__all__ = ["BenchmarkPreset", "BENCHMARK_PRESETS", "Cell", "cells_of", "check_benchmark", "run_benchmark"]


@dataclass(frozen=True)
class BenchmarkPreset:
    """A benchmark grid: the shared settings and the values each dimension takes.

    ``config`` holds sizes, epochs and learning rates (its ``class_split``, ``protocol``,
    ``selection``, ``seed`` and ``norm`` are set per cell). ``strategies`` run on the BatchNorm
    network, ``reference`` on ``small_cnn(norm="group")`` (near-OOD cells); ``far_ood`` sets are far rows
    (transductive, ``far_strategies``, first class split). ``seeds`` is the default number of seeds (0, 1, ...),
    ``max_seeds`` the most a user may ask for.
    """
    config: MCDConfig
    class_splits: tuple[str, ...]
    protocols: tuple[str, ...] = PROTOCOLS
    selections: tuple[str, ...] = SELECTIONS
    strategies: tuple[str, ...] = STRATEGIES
    reference: tuple[str, ...] = ("separate",)
    far_ood: tuple[str, ...] = ()
    far_strategies: tuple[str, ...] = ("separate", "concat")
    seeds: int = 5
    max_seeds: int = 10
    about: str = ""


_ODIN_QUICK = {"odin_temperatures": (1000.0,), "odin_epsilons": (0.0, 0.0014, 0.004)}

BENCHMARK_PRESETS: dict[str, BenchmarkPreset] = {
    # CPU, at most 20 minutes on 2 cores from an empty cache: split a, 3 protocols x 4 strategies +
    # the GroupNorm reference, 5 seeds. Pre-training on the ID classes of the first 20,000 training
    # images (12,000; 2 epochs); fine-tuning 2 epochs x 25 steps of 64 + 64 (Step A + Step B).
    "near-ood-quick": BenchmarkPreset(
        config=MCDConfig(train_subset=20_000, test_subset=5000, n_val=500, n_holdout=3000, ood_size=2000,
                         pretrain_epochs=2, pretrain_milestones=(1,), pretrain_batch_size=128,
                         finetune_epochs=2, steps_per_epoch=25, finetune_lr=0.005, batch_size_sup=64,
                         batch_size_unsup=64, far_ood="photo_crops", channels_last=True, extra=_ODIN_QUICK),
        class_splits=("a",), seeds=5, max_seeds=5,
        about="split a, every protocol, strategy and method, 5 seeds; CPU, <= 20 minutes"),
    # The full preset: three class splits, 1.5x the training images, every test image, 1.2x the
    # fine-tuning steps, the GroupNorm reference with both strategies (its concat - separate is the
    # no-coupling control), far rows (split a), 5 seeds (up to 10). About an hour on 2 cores.
    "near-ood": BenchmarkPreset(
        config=MCDConfig(train_subset=30_000, n_val=500, n_holdout=4500, ood_size=5000,
                         pretrain_epochs=2, pretrain_milestones=(1,), pretrain_batch_size=128,
                         finetune_epochs=2, steps_per_epoch=30, finetune_lr=0.005, batch_size_sup=64,
                         batch_size_unsup=64, far_ood="photo_crops", channels_last=True, extra=_ODIN_QUICK),
        class_splits=("a", "b", "c"), reference=("separate", "concat"),
        far_ood=("digits", "photo_crops", "gaussian"), seeds=5, max_seeds=10,
        about="splits a, b, c, every protocol, strategy and method, far rows, 5 seeds; CPU, about an hour"),
    # The test suite's: the whole grid at toy size (a minute or two).
    "near-ood-tiny": BenchmarkPreset(
        config=MCDConfig(train_subset=3000, test_subset=1000, n_val=40, n_holdout=300, ood_size=200,
                         pretrain_epochs=1, pretrain_milestones=(), pretrain_batch_size=64,
                         finetune_epochs=2, steps_per_epoch=4, finetune_lr=0.005, batch_size_sup=16,
                         batch_size_unsup=16, eval_batch_size=500, far_ood="photo_crops", channels_last=True,
                         extra={"odin_temperatures": (1000.0,), "odin_epsilons": (0.0, 0.002)}),
        class_splits=("a",), far_ood=("gaussian",), seeds=5, max_seeds=5,
        about="the whole grid at toy size, for the tests"),
}


@dataclass(frozen=True)
class Cell:
    """One seed, class split, task, OOD set and protocol: everything trained once, evaluated per selection."""
    seed: int
    class_split: str
    task: str  # near-ood | far-ood
    ood: str  # "heldout" (the held-out classes) or a far OOD set
    protocol: str

    @property
    def name(self) -> str:
        split = self.class_split.replace("/", "-")
        return f"{self.task}_{split}_{self.ood}_{self.protocol}_seed{self.seed}"


def _subset(name: str, asked, allowed: tuple[str, ...], valid: tuple[str, ...]) -> tuple[str, ...]:
    """``asked`` (default ``allowed``) checked against ``valid``; refused with the valid values."""
    if asked is None:
        return tuple(allowed)
    asked = tuple(asked)
    bad = [v for v in asked if v not in valid]
    if not asked or bad:
        raise ConfigError(name, f"unknown {name} {bad or 'list (empty)'}; valid values: {', '.join(valid)}.")
    twice = sorted({v for v in asked if asked.count(v) > 1})
    if twice:
        raise ConfigError(name, f"{name} {twice} given more than once (each would count twice in the "
                                f"statistics); valid values: {', '.join(valid)}.")
    return asked


def check_benchmark(preset: str, seeds: int | None = None, class_splits=None, protocols=None, strategies=None,
                    selections=None) -> BenchmarkPreset:
    """The preset ``preset`` narrowed to the dimensions asked for, all checked before any work.

    Args:
        preset: a name of :data:`BENCHMARK_PRESETS`.
        seeds: how many seeds (0, 1, ..., seeds - 1); ``None`` = the preset's.
        class_splits: names of :data:`~mcd_helpers.data.nearood.CLASS_SPLITS` or written splits
            ``"IDS/OODS"``; protocols, strategies, selections: subsets of the valid values.

    Raises:
        ConfigError: an unknown preset, protocol, strategy, selection or class split; a value given
            twice (also one split under two names); an empty or overlapping ID/OOD class list;
            fewer than 2 seeds (no confidence interval) or more than the preset allows. The
            message lists the valid values.
    """
    if preset not in BENCHMARK_PRESETS:
        raise ConfigError("preset", f"unknown benchmark preset {preset!r}; valid presets: "
                                    f"{', '.join(BENCHMARK_PRESETS)}.")
    p = BENCHMARK_PRESETS[preset]
    n = p.seeds if seeds is None else seeds
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= p.max_seeds:
        raise ConfigError("seeds", f"seeds must be an integer from 2 (a confidence interval needs two) to "
                                   f"{p.max_seeds} (preset {preset!r}'s most), got {seeds!r}.")
    splits = tuple(p.class_splits if class_splits is None else class_splits)
    if not splits:
        raise ConfigError("class_split", "the list of class splits is empty; name at least one (e.g. a).")
    seen: dict = {}
    for s in splits:
        classes = class_split(s)  # raises ConfigError for unknown, empty or overlapping lists
        if classes in seen:
            raise ConfigError("class_split", f"class splits {seen[classes]!r} and {s!r} are the same split (each "
                                             "would count twice in the statistics); give each split once.")
        seen[classes] = s
    chosen = _subset("strategies", strategies, p.strategies, STRATEGIES)
    return dataclasses.replace(
        p, seeds=n, class_splits=splits, protocols=_subset("protocol", protocols, p.protocols, PROTOCOLS),
        strategies=chosen, selections=_subset("selection", selections, p.selections, SELECTIONS),
        reference=tuple(s for s in p.reference if strategies is None or s in chosen),
        far_strategies=tuple(s for s in p.far_strategies if strategies is None or s in chosen))


def cells_of(p: BenchmarkPreset) -> list[Cell]:
    """Every cell of ``p`` in run order: seed, class split, then near-OOD protocols, then the far rows
    (those with the first class split only: their ID classes)."""
    cells = []
    for seed in range(p.seeds):
        for split in p.class_splits:
            cells += [Cell(seed, split, "near-ood", HELD_OUT, protocol) for protocol in p.protocols]
            if "transductive" in p.protocols and split == p.class_splits[0]:  # far rows: the first split
                cells += [Cell(seed, split, "far-ood", ood, "transductive") for ood in p.far_ood]
    return cells


def _npz(id_scores, ood_scores) -> bytes:
    buf = io.BytesIO()
    as_array = lambda t: t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)  # noqa: E731
    np.savez(buf, id=as_array(id_scores), ood=as_array(ood_scores))  # the dtype the metrics saw: exact
    return buf.getvalue()


def _run_cell(p: BenchmarkPreset, cell: Cell, data, out_dir: Path, retrained: bool | set, progress: bool,
              resume: bool) -> list[dict]:
    """Train (or load) everything of ``cell``; its rows, with their scores written to ``out_dir/scores``.

    ``retrained``: ``False``, or the run's set of cache files trained again so far (``--retrain``:
    each stage once, :func:`~mcd_helpers.experiments.cache.load_or_compute`). Each network is
    evaluated once per distinct model: MSP and energy score the pre-trained
    network, the same under every selection; an MCD model whose selected epoch is the same under
    two selections (the best validation epoch was the last) is the same model, scored once.
    """
    cfg = dataclasses.replace(p.config, class_split=cell.class_split, protocol=cell.protocol, seed=cell.seed,
                              ood_sets=(cell.ood,))
    strategies = p.strategies if cell.task == "near-ood" else p.far_strategies
    split = make_split(cfg, data, cell.ood)
    ckpt = out_dir / "checkpoints"
    reference = p.reference if cell.task == "near-ood" else ()  # the no-coupling control: near-OOD cells
    networks = [("batch", strategies, METHODS)] + ([("group", reference, ("mcd",))] if reference else [])
    rows = []
    for norm, strats, methods in networks:
        c = dataclasses.replace(cfg, norm=norm, strategies=tuple(strats))
        stem = f"{cell.name}_{norm}"
        base = pretrained(c, split, retrained, progress, None, ckpt / f"{stem}_pretrain", resume)
        hists, done = {}, {}  # strategy -> history; (method, strategy, selected epoch) -> (row, scores)
        for i, selection in enumerate(p.selections):
            cs = dataclasses.replace(c, selection=selection)
            tuned = {}
            for s in strats:
                epoch = selected_epoch(hists[s], c.finetune_epochs - 1, selection) if s in hists else None
                if epoch is None or ("mcd", s, epoch) not in done:
                    tuned[s], hists[s], _ = finetuned(cs, base, split, cell.ood, s, retrained, progress, None,
                                                      None, ckpt / f"{stem}_{trained_as(s)}", resume)
            wanted = [m for m in methods if m != "mcd" and (i == 0 or m == "odin")] + ["mcd"] * ("mcd" in methods)
            found, scores = evaluate(cs, base, tuned, split, cell.ood, wanted)
            for r in found:
                if r["method"] == "mcd":
                    h = hists[r["strategy"]]
                    r.update(val_auroc=h.val_auroc[h.best_epoch], selected_epoch=h.best_epoch)
                done[_which(r["method"], r["strategy"], hists, c, selection)] = (
                    r, scores[f"mcd:{r['strategy']}" if r["method"] == "mcd" else r["method"]])
            for m in methods:
                for s in (strats if m == "mcd" else [None]):
                    r, sc = done[_which(m, s, hists, c, selection)]
                    rows.append(_row(cell, selection, norm, r, sc, out_dir, stem))
    return rows


def _which(method: str, strategy, hists: dict, cfg, selection: str) -> tuple:
    """What a row's scores depend on: the MCD model's selected epoch, ODIN's selection, nothing else."""
    if method == "mcd":
        return method, strategy, selected_epoch(hists[strategy], cfg.finetune_epochs - 1, selection)
    return method, selection if method == "odin" else None


def _row(cell: Cell, selection: str, norm: str, r: dict, scores, out_dir: Path, stem: str) -> dict:
    """A ``results.json`` row for ``evaluate``'s row ``r``; its scores go to ``scores/<row>.npz``."""
    name = f"{stem}_{selection}_{r['method']}" + (f"_{r['strategy']}" if r["strategy"] else "")
    rel = f"scores/{name}.npz"
    atomic_write_bytes(out_dir / rel, _npz(*scores))
    extra = {k: r[k] for k in ("odin_temperature", "odin_epsilon", "val_auroc", "selected_epoch") if k in r}
    return {"task": cell.task, "class_split": cell.class_split, "protocol": cell.protocol, "selection": selection,
            "method": r["method"], "strategy": r["strategy"], "norm": norm, "seed": cell.seed,
            "ood_dataset": cell.ood, **{k: r[k] for k in METRIC_KEYS}, "id_accuracy": r["id_accuracy"],
            "scores": rel, "n_id": len(scores[0]), "n_ood": len(scores[1]), **extra}


def run_benchmark(preset: str, out_dir: Path, seeds: int | None = None, class_splits=None, protocols=None,
                  strategies=None, selections=None, retrain: bool = False, progress: bool = True,
                  quiet: bool = False, resume: bool = False, fresh: bool = False) -> list[dict]:
    """Run a benchmark preset into ``out_dir`` (see the module docstring for what it writes).

    Every setting is checked before any work (:func:`check_benchmark`), then the output folder is
    locked and checked as for ``reproduce`` (:func:`~mcd_helpers.experiments.outdir.prepare_out`).
    Cells already in ``out_dir/cells`` with the same settings are reused (not with ``retrain``);
    training stages come from the cache.

    Returns:
        the rows of ``results.json`` (metrics as fractions).

    Raises:
        ConfigError: a bad preset, seed count, class split, protocol, strategy or selection.
        DataNotFoundError, NotWritableError, OutputLockedError, UnfinishedRunError: before training.
        CheckpointMismatchError: ``--resume`` on cells written with other settings.
        TrainingInterrupted: on SIGTERM or SIGINT, after a checkpoint (continue with ``resume``).
    """
    if resume and fresh:
        raise ConfigError("fresh", "--resume continues the work in --out and --fresh deletes it: pass one.")
    p = check_benchmark(preset, seeds, class_splits, protocols, strategies, selections)
    for ood in p.far_ood:
        if ood not in OFFLINE_OOD_SETS:
            raise ConfigError("far_ood", f"far OOD set {ood!r} is not available offline; valid: "
                                         f"{', '.join(OFFLINE_OOD_SETS)}.")
    out_dir = Path(out_dir)
    log = (lambda msg: None) if quiet else (lambda msg: tqdm.write(msg))
    lock = OutputLock(out_dir)
    settings = {"preset": preset, **{k: v for k, v in dataclasses.asdict(p).items() if k != "config"},
                "config": p.config.to_dict()}
    t0 = time.time()
    try:
        prepare_out(out_dir, lock, settings, resume, fresh, quiet)  # the lock is released below
        try:
            data = load_data(p.config)
            cells = cells_of(p)
            _check_sizes(p, cells, data)  # every split of the grid, before any training
            retrained = set() if retrain else False  # --retrain: each cached stage once in this run
            rows = []
            for cell in tqdm(cells, desc=f"benchmark {preset}", disable=not progress, unit="cell"):
                rows += _cell(p, cell, data, out_dir, retrained, progress, resume, log)
            seconds = round(time.time() - t0, 1)
            # the report first: results.json (the last file) then always has its summary beside it
            write_report(rows, out_dir, title=f"Benchmark {preset}: {p.about}", seconds=seconds)
            atomic_write_json(out_dir / "config.json", settings)
            atomic_write_text(out_dir / "results.json", json.dumps(rows, indent=1, allow_nan=False) + "\n")
        except BaseException as err:
            status = "interrupted" if isinstance(err, (KeyboardInterrupt, TrainingInterrupted)) else "failed"
            write_run(out_dir, status=status, error=f"{type(err).__name__}: {err}")
            raise
        write_run(out_dir, status="finished", seconds=seconds, cells=len(cells), rows=len(rows))
        log(f"{len(rows)} rows from {len(cells)} cells in {seconds:.0f} s: {out_dir / 'summary.md'}")
    finally:
        lock.release()
    return rows


def _check_sizes(p: BenchmarkPreset, cells: list[Cell], data) -> None:
    """Make every (class split, task, protocol) split once and check the batch sizes against it.

    Raises:
        ConfigError: a split the data cannot make (``n_val`` or ``n_holdout`` too large, see
            :func:`~mcd_helpers.data.nearood.protocol_split`), or a batch larger than its set.
    """
    c = p.config
    for cell in {dataclasses.replace(cell, seed=0) for cell in cells}:
        split = make_split(dataclasses.replace(c, class_split=cell.class_split, protocol=cell.protocol), data,
                           cell.ood)
        for name, batch, n in (("pretrain_batch_size", c.pretrain_batch_size, len(split.x_sup)),
                               ("batch_size_sup", c.batch_size_sup, len(split.x_sup)),
                               ("batch_size_unsup", c.batch_size_unsup, len(split.x_unsup))):
            if batch > n:
                raise ConfigError(name, f"{name}={batch} is larger than the {n} images of {cell.name}'s "
                                        f"{'unlabeled' if 'unsup' in name else 'labeled'} set.")


def _cell(p, cell: Cell, data, out_dir: Path, retrained, progress, resume, log) -> list[dict]:
    """A finished cell from ``out_dir/cells`` when its settings match, else :func:`_run_cell` (and saved)."""
    key = cache_key(dataclasses.replace(p.config, class_split=cell.class_split, protocol=cell.protocol,
                                        seed=cell.seed), "cell", cell=dataclasses.asdict(cell),
                    grid=[p.strategies, p.reference, p.far_strategies, p.selections, p.config.extra])
    path = out_dir / CELLS / f"{cell.name}.json"
    if path.exists() and retrained is False:
        saved = json.loads(path.read_text())
        if saved.get("key") == key and all((out_dir / r["scores"]).exists() for r in saved["rows"]):
            return saved["rows"]
        if resume:
            raise CheckpointMismatchError(
                f"{path} was written with other settings than this run's (preset, grid or sizes). Resume with "
                "the settings of the interrupted run, or pass --fresh to start over.")
    t0 = time.time()
    rows = _run_cell(p, cell, data, out_dir, retrained, progress, resume)
    atomic_write_json(path, {"key": key, "seconds": round(time.time() - t0, 1), "rows": rows})
    log(f"{cell.name}: {len(rows)} rows in {time.time() - t0:.0f} s")
    return rows
