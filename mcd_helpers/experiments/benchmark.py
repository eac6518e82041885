"""``python -m mcd_helpers benchmark``: near-OOD experiments over seeds, class splits, protocols and
strategies.

A preset (:data:`BENCHMARK_PRESETS`) is a grid of *cells*, one per seed, class split, task and
protocol; each goes through :func:`~mcd_helpers.experiments.pipeline.run_ood_set` under every model
selection. Tasks: ``near-ood`` (ID = the 6 known classes of a Fashion-MNIST class split, OOD = its
4 held-out classes, under every protocol) and ``far-ood`` (the first split's known classes against
a far set, transductive). MCD runs on ``small_cnn`` with BatchNorm under each strategy, and on
``small_cnn(norm="group")``, the reference in which no sample is coupled to another (rows with
``norm = "group"``). The seed varies pre-training and fine-tuning; the splits are fixed
(``split_seed``), so two strategies with one seed are a pair. ``--seeds 20-39`` runs those seeds,
``--seeds 5`` the seeds 0 to 4.

``--out`` gets ``results.json`` (a row per cell, selection, method, strategy and evaluation
statistics: the settings, the five metrics and ``id_accuracy`` as fractions, ``eval_stats``,
``finetune_steps``, ``scores``), ``scores/<row>.npz`` (``id`` and ``ood``, the per-sample test
scores as float32, higher = more OOD; compressed), ``summary.md``, ``forest.png`` and
``by_protocol.png`` (:mod:`mcd_helpers.experiments.report`). A finished cell is written to
``cells/`` at once with the seconds it took, so ``--resume`` continues where an interrupted run
stopped; a cell's key holds the settings and the package's code (:func:`code_version`). A preset's
``endpoints`` are tested in ``summary.md``
(:func:`mcd_helpers.experiments.significance.endpoint_tests`).

The cells are independent trainings, run one after another in one process: under torchrun the
benchmark refuses at once (each rank would run the whole grid); share seeds out over machines with
``--seeds`` and one ``--out`` each instead.

Example: ``python -m mcd_helpers benchmark --preset near-ood-quick --out runs/near-ood-quick``
"""

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..data import OFFLINE_OOD_SETS
from ..errors import ConfigError
from ..splits import HELD_OUT, PROTOCOLS, class_split, random_class_splits
from ..strategies import STRATEGIES
from . import cache
from .cache import cache_key
from .config import SELECTIONS, MCDConfig, check_device
from .evaluation import METHODS
from .files import output_folder, write_buffered, write_json
from .pipeline import run_ood_set
from .report import is_recalibrated_copy, write_report
from .stages import RunOptions, load_data, make_split


@dataclasses.dataclass(frozen=True)
class BenchmarkPreset:
    """A grid: the shared ``config`` (sizes, epochs, learning rates; class split, protocol,
    selection, seed and norm are set per cell) and the values of each dimension. ``strategies`` run
    on the BatchNorm network, ``reference`` on the GroupNorm one (near-OOD cells); ``far_ood_sets``
    give far rows (transductive, ``far_strategies``, the first class split). ``seeds``: the default
    count (seeds 0 to seeds - 1) or, once checked (:func:`check_benchmark`), the seeds themselves;
    ``max_seeds`` the most seeds one run takes."""

    config: MCDConfig
    class_splits: tuple[str, ...]
    protocols: tuple[str, ...] = PROTOCOLS
    selections: tuple[str, ...] = SELECTIONS
    strategies: tuple[str, ...] = ("separate", "concat", "split-bn", "recalibrate")
    reference: tuple[str, ...] = ("separate",)
    far_ood_sets: tuple[str, ...] = ()
    far_strategies: tuple[str, ...] = ("separate", "concat")
    # also evaluate each BatchNorm network with statistics recalibrated on each of these sources
    # (stages.RECALIBRATION_SOURCES: labeled, unlabeled, mixture; the rows' eval_stats)
    recalibrated: tuple[str, ...] = ()
    # (a, b, metric, eval_stats): the primary, then secondaries
    endpoints: tuple[tuple[str, str, str, str], ...] = ()
    # (MCDConfig field, values): near-OOD cells per value (dose-response)
    doses: tuple[tuple[str, tuple], ...] = ()
    seeds: int | tuple[int, ...] = 5
    max_seeds: int = 10
    about: str = ""


_FINETUNE = dict(
    pretrain_epochs=2,
    pretrain_milestones=(1,),
    finetune_epochs=2,
    finetune_lr=0.005,
    batch_size_sup=64,
    batch_size_unsup=64,
    unlabeled_ood="photo_crops",
    channels_last=True,
)
_ODIN = dict(odin_temperatures=(1000.0,), odin_epsilons=(0.0, 0.0014, 0.004))
# split a, disjoint: 6,400 unlabeled images (3,940 ID held out of the labeled set + 2,460 OOD)
_PRIMARY = MCDConfig(
    train_subset=30_000,
    n_val=500,
    n_holdout=4440,
    ood_size=5000,
    steps_per_epoch=100,
    **_FINETUNE,
    **_ODIN,
)


def _on_split_a(config: MCDConfig, **fields) -> BenchmarkPreset:
    """A preset of the reference answer's setting: ``config`` on class split a, the disjoint
    protocol, the last epoch's network, no GroupNorm reference, at most 40 seeds; ``fields`` the
    rest of :class:`BenchmarkPreset`."""
    setting = dict(
        class_splits=("a",),
        protocols=("disjoint",),
        selections=("last-epoch",),
        reference=(),
        max_seeds=40,
    )
    return BenchmarkPreset(config, **(setting | fields))


def _dose(
    field: str, values: tuple, what: str, config: MCDConfig = _PRIMARY, **more
) -> BenchmarkPreset:
    """A dose-response preset: ``config`` (the primary's) at each of ``values`` of ``field``, split
    a, disjoint, last epoch, concat and separate, 10 seeds."""
    return _on_split_a(
        config,
        strategies=("separate", "concat"),
        seeds=10,
        doses=((field, values),),
        about=f"concat - separate against {what}, split a, disjoint, 10 seeds; CPU",
        **more,
    )


def _over_splits(n_splits: int, protocols: tuple, seeds: int, about: str) -> BenchmarkPreset:
    """``concat`` and ``separate`` on the primary's setting over the first ``n_splits`` of
    ``random_class_splits(30)`` (drawn with seed 0), each of ``protocols``, the last epoch."""
    return BenchmarkPreset(
        _PRIMARY,
        class_splits=random_class_splits(30)[:n_splits],
        protocols=protocols,
        selections=("last-epoch",),
        strategies=("separate", "concat"),
        reference=(),
        seeds=seeds,
        max_seeds=10,
        about=about,
    )


BENCHMARK_PRESETS = {
    # CPU, at most 20 minutes on 2 cores from an empty cache: split a, 3 protocols x 4 strategies +
    # the GroupNorm reference, 5 seeds; the ID classes of the first 20,000 training images; 2 x 25
    # fine-tuning steps of 64 + 64.
    "near-ood-quick": BenchmarkPreset(
        MCDConfig(
            train_subset=20_000,
            test_subset=5000,
            n_val=500,
            n_holdout=3000,
            ood_size=2000,
            steps_per_epoch=25,
            amp="auto",
            **_FINETUNE,
            **_ODIN,
        ),
        class_splits=("a",),
        seeds=5,
        max_seeds=5,
        about="split a, every protocol, strategy and method, 5 seeds; CPU, <= 20 minutes",
    ),
    # Three class splits, every test image, the GroupNorm reference with both strategies (its concat
    # - separate is the no-coupling control), far rows (split a), 5 seeds (up to 10). About an hour
    # on 2 cores.
    "near-ood": BenchmarkPreset(
        MCDConfig(
            train_subset=30_000,
            n_val=500,
            n_holdout=4500,
            ood_size=5000,
            steps_per_epoch=30,
            **_FINETUNE,
            **_ODIN,
        ),
        class_splits=("a", "b", "c"),
        reference=("separate", "concat"),
        far_ood_sets=("digits", "photo_crops", "gaussian"),
        about="splits a, b, c, every protocol, strategy and method, far rows, 5 seeds; CPU, "
        "about an hour",
    ),
    # The pre-registered primary endpoint (README, "The reference answer"): split a, disjoint, last
    # epoch, AUROC of MCD concat - separate with the running statistics, paired over 20 seeds
    # (t-test, 95% CI, exact sign test). 6,400 unlabeled images, 2 x 100 steps of 64 + 64: every
    # unlabeled image drawn exactly twice. Secondaries (one family, Holm): concat-both against both,
    # concat - separate with recalibrated statistics and in FPR95, and separate - eval-bn
    # (eval-bn-concat - eval-bn is the no-coupling check: 0 to float rounding).
    "primary": _on_split_a(
        _PRIMARY,
        recalibrated=("labeled",),
        strategies=("separate", "concat", "concat-both", "eval-bn", "eval-bn-concat"),
        seeds=20,
        endpoints=(
            ("concat", "separate", "auroc", "running"),
            ("concat-both", "separate", "auroc", "running"),
            ("concat-both", "concat", "auroc", "running"),
            ("concat", "separate", "auroc", "recalibrated"),
            ("concat", "separate", "fpr95", "running"),
            ("separate", "eval-bn", "auroc", "running"),
        ),
        about="the primary endpoint: split a, disjoint, last epoch, 5 arms, recalibrated "
        "statistics, 20 seeds; CPU",
    ),
    # Dose-response in fine-tuning length: the primary's setting at 1, 2, 4, 8, 16 epochs of 30
    # iterations (30 to 480 iterations: 0.3 to 4.8 draws of each unlabeled image).
    "dose-length": _dose(
        "finetune_epochs",
        (1, 2, 4, 8, 16),
        "fine-tuning length (30 to 480 iterations)",
        dataclasses.replace(_PRIMARY, steps_per_epoch=30),
    ),
    # Dose-response in the margin (nats) against pi log K = 0.384 log 6 = 0.69, the batch-mean
    # entropy gap the pool's OOD share alone can reach: two margins below or at it, the official
    # 1.2, one above; the primary's schedule.
    "dose-margin": _dose("margin", (0.35, 0.7, 1.2, 2.0), "the margin (0.35 to 2.0 nats)"),
    # Dose-response in the OOD share of the unlabeled set: the primary's setting keeping 0 to all of
    # the pool's 2,460 unlabeled OOD images beside its 3,940 ID ones (OOD share 0, 7.3, 13.5, 23.8,
    # 38.4%).
    "dose-ood-share": _dose(
        "unlabeled_ood_fraction",
        (0.0, 0.125, 0.25, 0.5, 1.0),
        "the OOD share of the unlabeled set (0 to 38%)",
    ),
    # Dose-response in BatchNorm's momentum during fine-tuning: train mode normalises with the
    # batch's statistics, so with last-epoch selection the weights are the same at every momentum,
    # only the running statistics differ.
    "dose-momentum": _dose(
        "bn_momentum",
        (0.01, 0.03, 0.1, 0.3, 1.0),
        "BatchNorm's momentum (0.01 to 1)",
        recalibrated=("labeled",),
    ),
    # Generality: 30 random 6/4 class splits (splits.random_class_splits, seed 0) x 3 seeds on the
    # primary's setting, concat and separate; analysed with split as a random effect
    # (stats.split_effects).
    "generality": _over_splits(
        30,
        ("disjoint",),
        seeds=3,
        about="concat - separate over 30 random 6/4 class splits, disjoint, last epoch, 3 seeds; "
        "CPU",
    ),
    # Generality under both protocols: the first 15 of generality's random class splits, disjoint
    # and unseen-ood (the unlabeled OOD images from photo crops, not the held-out classes) from the
    # same pre-trained networks, concat and separate (benchmarks/generality-unseen-plan.md,
    # registered before its run). Fresh seeds: run it with --seeds 60-65.
    "generality-unseen": _over_splits(
        15,
        ("disjoint", "unseen-ood"),
        seeds=6,
        about="concat - separate over 15 random 6/4 class splits, disjoint and unseen-ood, last "
        "epoch, 6 seeds; CPU",
    ),
    # Depth: the primary endpoint on a pre-activation ResNet-20 (0.27 M parameters, 19 BatchNorm
    # layers against small_cnn's 3), concat and separate; about 2x small_cnn's time per cell on a
    # CPU (140 s against 63 s).
    "depth": _on_split_a(
        dataclasses.replace(_PRIMARY, model="resnet_20"),
        strategies=("separate", "concat"),
        seeds=10,
        endpoints=(("concat", "separate", "auroc", "running"),),
        about="the primary endpoint on resnet_20: split a, disjoint, last epoch, concat and "
        "separate, 10 seeds; CPU",
    ),
    # The mechanism study (benchmarks/mechanism-plan.md, registered before its run): the primary's
    # setting at the full OOD share and at none, five arms that take the coupling apart (interleave:
    # separate's BatchNorm batch size with concat's mixing; *-detached: no gradient through the
    # batch statistics), each network also evaluated with statistics recalibrated on the labeled
    # images, the unlabeled pool and a mixture. Fresh seeds: run it with --seeds 20-29.
    "mechanism": _on_split_a(
        _PRIMARY,
        strategies=("separate", "concat", "interleave", "separate-detached", "concat-detached"),
        recalibrated=("labeled", "unlabeled", "mixture"),
        doses=(("unlabeled_ood_fraction", (1.0, 0.0)),),
        seeds=10,
        about="why concat wins: 5 arms x 4 evaluation statistics at the full OOD share and at "
        "none, split a, disjoint, last epoch; CPU",
    ),
    # The converged network (benchmarks/pretrain-length-plan.md, part 2, registered before its
    # run): the primary's setting pre-trained for 10 epochs, the length the plan's rule chose on the
    # curve in benchmarks/results/pretrain-length/. Fresh seeds: run it with --seeds 40-59.
    "converged": _on_split_a(
        dataclasses.replace(_PRIMARY, pretrain_epochs=10, pretrain_milestones=(5,)),
        strategies=("separate", "concat", "interleave"),
        seeds=20,
        endpoints=(
            ("concat", "separate", "auroc", "running"),
            ("interleave", "separate", "auroc", "running"),
            ("concat", "interleave", "auroc", "running"),
        ),
        about="the primary endpoint on a converged network (10 pre-training epochs): split a, "
        "disjoint, last epoch, separate, concat and interleave, 20 seeds; CPU",
    ),
    # The test suite's: the whole grid at toy size (a minute or two).
    "near-ood-tiny": BenchmarkPreset(
        MCDConfig(
            **_FINETUNE
            | _ODIN
            | dict(
                train_subset=3000,
                test_subset=500,
                n_val=40,
                n_holdout=300,
                ood_size=200,
                pretrain_epochs=1,
                pretrain_milestones=(),
                pretrain_batch_size=64,
                steps_per_epoch=4,
                batch_size_sup=16,
                batch_size_unsup=16,
                eval_batch_size=500,
                odin_epsilons=(0.0, 0.002),
            )
        ),
        class_splits=("a",),
        far_ood_sets=("gaussian",),
        seeds=5,
        max_seeds=5,
        about="the whole grid at toy size, for the tests",
    ),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One seed, class split, task, OOD set and protocol: trained once, evaluated under every
    selection."""

    seed: int
    class_split: str
    task: str  # near-ood | far-ood
    ood: str  # "heldout" (the held-out classes) or a far OOD set
    protocol: str
    dose: tuple = ()  # (MCDConfig field, value) of a dose-response cell

    @property
    def name(self) -> str:
        dose = "_{}-{}".format(*self.dose) if self.dose else ""
        split = self.class_split.replace("/", "-")
        return f"{self.task}_{split}_{self.ood}_{self.protocol}{dose}_seed{self.seed}"


def seed_numbers(preset: str, seeds, max_seeds: int) -> tuple[int, ...]:
    """The seeds ``--seeds`` asks for: a count ``n`` (the seeds 0 to n - 1) or a range ``"A-B"``
    (A to B, both included), as a number or as text.

    Raises:
        ConfigError: (field ``seeds``) something else, fewer than 2 seeds or more than
            ``max_seeds``.
    """
    first, _, last = str(seeds).partition("-")
    found = ()
    if not isinstance(seeds, bool) and isinstance(seeds, int | str) and first.isdigit():
        found = (
            tuple(range(int(first), int(last) + 1)) if last.isdigit() else tuple(range(int(first)))
        )
    if not 2 <= len(found) <= max_seeds or (last and not last.isdigit()):
        raise ConfigError(
            "seeds",
            f"seeds must be a count or a range A-B of 2 to {max_seeds} seeds for {preset!r}, "
            f"got {seeds!r}.",
        )
    return found


def check_benchmark(
    preset: str,
    seeds: int | str | None = None,
    class_splits=None,
    protocols=None,
    strategies=None,
    selections=None,
) -> BenchmarkPreset:
    """Preset ``preset`` narrowed to the values asked for (``None``: the preset's), all checked
    before any work.

    Raises:
        ConfigError: an unknown preset, protocol, strategy, selection or class split; a value given
            twice (also one split under two names); seeds as :func:`seed_numbers` refuses them; the
            message lists the valid values.
    """
    if preset not in BENCHMARK_PRESETS:
        raise ConfigError(
            "preset", f"unknown benchmark preset {preset!r}; valid: {', '.join(BENCHMARK_PRESETS)}."
        )
    p = BENCHMARK_PRESETS[preset]
    numbers = seed_numbers(preset, p.seeds if seeds is None else seeds, p.max_seeds)

    def subset(name: str, asked, valid) -> tuple:  # the values asked for, else the preset's
        asked = tuple(getattr(p, name) if asked is None else asked)
        if not asked or set(asked) - set(valid) or len(set(asked)) < len(asked):
            raise ConfigError(
                name, f"{name} {list(asked)}: give each value once, from {', '.join(valid)}."
            )
        return asked

    splits = tuple(p.class_splits if class_splits is None else class_splits)
    try:
        classes = [class_split(s) for s in splits]
    except ConfigError as err:  # unknown or malformed: named by this command's flag
        raise ConfigError("class_splits", str(err)) from None
    if not splits or len(set(classes)) < len(classes):
        raise ConfigError(
            "class_splits",
            f"class splits {list(splits)}: give one or more, each once under one name.",
        )
    chosen = subset("strategies", strategies, STRATEGIES)
    q = dataclasses.replace(
        p,
        seeds=numbers,
        class_splits=splits,
        protocols=subset("protocols", protocols, PROTOCOLS),
        strategies=chosen,
        selections=subset("selections", selections, SELECTIONS),
        reference=tuple(s for s in p.reference if strategies is None or s in chosen),
        far_strategies=tuple(s for s in p.far_strategies if strategies is None or s in chosen),
    )
    # the endpoints are tested only on the grid they were registered for: those whose arms still
    # run, and none when the primary's arms are gone or the class splits, protocols or selections
    # changed
    ends = tuple(e for e in p.endpoints if {e[0], e[1]} <= set(chosen))
    same = [getattr(q, f) == getattr(p, f) for f in ("class_splits", "protocols", "selections")]
    return dataclasses.replace(
        q, endpoints=ends if all(same) and ends[:1] == p.endpoints[:1] else ()
    )


def cells_of(p: BenchmarkPreset) -> list[Cell]:
    """Every cell in run order: seed, class split, near-OOD protocols (each dose), then the far rows
    (first split only)."""
    doses = [(field, v) for field, values in p.doses for v in values] or [()]
    near = [("near-ood", HELD_OUT, protocol, dose) for protocol in p.protocols for dose in doses]
    far = (
        [("far-ood", ood, "transductive", ()) for ood in p.far_ood_sets]
        if "transductive" in p.protocols
        else []
    )
    seeds = range(p.seeds) if isinstance(p.seeds, int) else p.seeds
    return [
        Cell(seed, split, *c)
        for seed in seeds
        for split in p.class_splits
        for c in near + (far if split == p.class_splits[0] else [])
    ]


def _cell_config(p: BenchmarkPreset, cell: Cell, **more) -> MCDConfig:
    return dataclasses.replace(
        p.config,
        class_split=cell.class_split,
        protocol=cell.protocol,
        seed=cell.seed,
        ood_sets=(cell.ood,),
        **dict([cell.dose] if cell.dose else []),
        **more,
    )


def _score_file(stem: str, row: dict) -> str:
    """The path, in ``--out``, of a row's scores."""
    stats = row["eval_stats"] if is_recalibrated_copy(row) else ""
    parts = (stem, row["selection"], row["method"], row["strategy"], stats)
    return "scores/" + "_".join(filter(None, parts)) + ".npz"


def _run_cell(p: BenchmarkPreset, cell: Cell, data, out: Path, how: RunOptions) -> list[dict]:
    """Everything of ``cell`` trained (or loaded) and evaluated; its rows, their scores in
    ``out/scores``. The cell's split is made once, for both networks."""
    near = cell.task == "near-ood"
    networks = [("batch", p.strategies if near else p.far_strategies, METHODS)]
    networks += [("group", p.reference, ("mcd",))] if near and p.reference else []
    split = make_split(_cell_config(p, cell), data, cell.ood)
    rows = []
    for norm, strategies, methods in networks:
        stem = f"{cell.name}_{norm}"
        cfg = _cell_config(p, cell, norm=norm, strategies=tuple(strategies))
        where = dataclasses.replace(how, checkpoint_dir=out / "checkpoints" / stem)
        res = run_ood_set(cfg, split, cell.ood, p.selections, methods, where, None, p.recalibrated)
        for r, (s_id, s_ood) in zip(res.rows, res.row_scores):
            rel = _score_file(stem, r)
            # the metrics' dtype (float32), compressed: float16 moved the toy run's AUROC by up to
            # 0.14 (small scores)
            write_buffered(
                out / rel, lambda f: np.savez_compressed(f, id=s_id.numpy(), ood=s_ood.numpy())
            )
            # the pipeline's row (settings, metrics, ODIN's T and epsilon, MCD's selected epoch) and
            # the cell's
            dose = "{}={}".format(*cell.dose) if cell.dose else ""
            cell_fields = {
                "norm": norm,
                "dose": dose,
                "scores": rel,
                "n_id": len(s_id),
                "n_ood": len(s_ood),
            }
            rows.append({"task": cell.task, **r, **cell_fields})
    return rows


def code_version() -> str:
    """16 hex digits of a hash of the package's code (every module, docstrings and comments left
    out): in every cell's key, so that changed code reruns."""
    package = cache.PACKAGE
    modules = sorted(str(f.relative_to(package)) for f in package.rglob("*.py"))
    return cache.code_version(package, tuple(modules))


def git_commit() -> str | None:
    """The commit of the checkout the package runs from, ``+changes`` appended when files differ
    from it; None outside a git checkout (an installed package) or without git."""
    root = cache.PACKAGE.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        head = git("rev-parse", "HEAD")
        changed = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if changed else "")) or None


def _one_process() -> None:
    """Refuse torchrun: each rank would run the whole grid into one --out."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "benchmark runs in one process: its cells are independent trainings, and under "
            f"torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']}) each rank would run the whole grid "
            "into the same --out. Run `python -m mcd_helpers benchmark ...` without torchrun; to "
            "share the work out, run a range of seeds per machine (--seeds 0-9, --seeds 10-19), "
            "each into its own --out."
        )


def _cells(
    p: BenchmarkPreset, preset: str, data, out: Path, grid: list, how: RunOptions, log
) -> list[dict]:
    """Every cell's rows: a finished cell's from ``out/cells``, the others computed and written."""
    rows = []
    for cell in tqdm(
        cells_of(p), desc=f"benchmark {preset}", disable=not how.progress, unit="cell"
    ):
        key = cache_key(_cell_config(p, cell), "cell", cell=dataclasses.asdict(cell), grid=grid)
        path = out / "cells" / f"{cell.name}.json"
        saved = json.loads(path.read_text()) if path.exists() and not how.retrain else None
        if (
            saved
            and saved["key"] == key
            and all((out / r["scores"]).exists() for r in saved["rows"])
        ):
            rows += saved["rows"]
            continue
        if saved and how.resume:
            raise ConfigError(
                "resume",
                f"{path} was written with other settings than this run's (preset, grid or sizes). "
                "Resume with the interrupted run's settings, or pass --fresh.",
            )
        c0 = time.time()
        cell_rows = _run_cell(p, cell, data, out, how)
        write_json(path, {"key": key, "seconds": round(time.time() - c0, 1), "rows": cell_rows})
        log(f"{cell.name}: {len(cell_rows)} rows in {time.time() - c0:.0f} s")
        rows += cell_rows
    return rows


def _settings(p: BenchmarkPreset, preset: str) -> tuple[dict, list]:
    """``config.json``'s settings (the grid, the config, the code's version), and what of them
    enters a cell's key beside its config."""
    rest = {k: v for k, v in dataclasses.asdict(p).items() if k != "config"}
    settings = {
        "preset": preset,
        **rest,
        "config": p.config.to_dict(),
        "code_version": code_version(),
    }
    grid = [p.strategies, p.reference, p.far_strategies, p.selections, p.recalibrated]
    grid += [p.config.odin_temperatures, p.config.odin_epsilons, settings["code_version"]]
    return settings, grid


def _write_outputs(p: BenchmarkPreset, preset: str, out: Path, rows: list, settings: dict, seconds):
    """``summary.md`` and the figures, ``config.json``, then ``results.json``, the last file
    written."""
    given = BENCHMARK_PRESETS[preset]
    narrowed = p != dataclasses.replace(given, config=p.config, seeds=tuple(range(given.seeds)))
    note = " (narrowed by the command line: config.json has the grid)" if narrowed else ""
    write_report(rows, out, f"Benchmark {preset}: {p.about}{note}", seconds, p.endpoints)
    write_json(out / "config.json", settings)
    write_json(out / "results.json", rows)


def run_benchmark(
    preset: str,
    out_dir: Path,
    seeds: int | str | None = None,
    class_splits=None,
    protocols=None,
    strategies=None,
    selections=None,
    retrain: bool = False,
    progress: bool = True,
    quiet: bool = False,
    resume: bool = False,
    fresh: bool = False,
    device: str | None = None,
) -> list[dict]:
    """Run a benchmark preset into ``out_dir`` (the module docstring says what it writes): every
    setting and every split checked before training, the cells already in ``out_dir/cells`` with
    the same settings reused. Returns the rows of ``results.json`` (metrics as fractions).

    Raises:
        ValueError: under torchrun (exit code 2).
        ConfigError: a setting :func:`check_benchmark` refuses, a size or device that cannot work,
            ``--resume`` on cells of other settings, an out folder in use or holding unfinished
            work.
        DataNotFoundError: before training.
        TrainingInterrupted: SIGTERM or SIGINT.
    """
    _one_process()
    p = check_benchmark(preset, seeds, class_splits, protocols, strategies, selections)
    if device is not None:  # every cell on this device (ConfigError if PyTorch sees no such device)
        check_device(device)
        p = dataclasses.replace(p, config=dataclasses.replace(p.config, device=device))
    if bad := [o for o in p.far_ood_sets if o not in OFFLINE_OOD_SETS]:
        raise ConfigError(
            "far_ood_sets", f"far OOD sets {bad} are not offline: {', '.join(OFFLINE_OOD_SETS)}."
        )
    out, t0, log = Path(out_dir), time.time(), (lambda msg: None) if quiet else tqdm.write
    settings, grid = _settings(p, preset)
    # which registered plan and code ran, in run.json from the start
    with output_folder(out, {**settings, "commit": git_commit()}, resume, fresh, quiet) as info:
        data = load_data(p.config)
        # every split of the grid checked before any training (each cell makes its own again: the
        # generated OOD images depend on its seed, and a grid's splits together take gigabytes)
        for cell in {dataclasses.replace(c, seed=p.seeds[0]) for c in cells_of(p)}:
            make_split(_cell_config(p, cell), data, cell.ood)
        how = RunOptions(set() if retrain else False, progress, None, None, resume)
        rows = _cells(p, preset, data, out, grid, how, log)
        seconds = round(time.time() - t0, 1)
        _write_outputs(p, preset, out, rows, settings, seconds)
        info.update(seconds=seconds, cells=len(cells_of(p)), rows=len(rows))
        log(
            f"{len(rows)} rows from {len(cells_of(p))} cells in {seconds:.0f} s: "
            f"{out / 'summary.md'}"
        )
    return rows
