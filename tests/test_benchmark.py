"""The benchmark (mcd_helpers/experiments/benchmark.py): its settings are checked before any work;
the toy preset runs the whole grid end to end on 2 seeds (once for the module, in a cache and an
output folder of its own); every row's metrics are recomputed from its ``scores/*.npz``; finished
cells are reused; resuming cells written with other settings is refused.
"""

import dataclasses
import json
import re
import shutil
import subprocess
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from pipeline_setup import brute_metrics
from sklearn.metrics import roc_auc_score

from mcd_helpers.data import DEBIAN_FMNIST_DIR
from mcd_helpers.errors import ConfigError
from mcd_helpers.experiments import benchmark as bm
from mcd_helpers.experiments import stages
from mcd_helpers.experiments.benchmark import (
    BENCHMARK_PRESETS,
    Cell,
    cells_of,
    check_benchmark,
    run_benchmark,
)
from mcd_helpers.metrics import METRIC_KEYS

QUICK, TINY, SEEDS = "near-ood-quick", "near-ood-tiny", 2
needs_fmnist = pytest.mark.skipif(
    not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed"
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "kwargs, field, named",
    [
        (dict(preset="bogus"), "preset", "'bogus'"),
        (dict(seeds=1), "seeds", "got 1"),
        (dict(seeds=6), "seeds", "got 6"),
        (dict(seeds="0-5"), "seeds", "got '0-5'"),
        (dict(seeds="5-3"), "seeds", "got '5-3'"),
        (dict(seeds="a-b"), "seeds", "got 'a-b'"),
        (dict(seeds=True), "seeds", "got True"),
        (dict(seeds=2.0), "seeds", "got 2.0"),
        (dict(seeds=(3, 3)), "seeds", "got (3, 3)"),
        (dict(protocols=["transductive", "closed"]), "protocols", "'closed'"),
        (dict(protocols=[]), "protocols", "[]"),
        (dict(protocols=["disjoint", "disjoint"]), "protocols", "['disjoint', 'disjoint']"),
        (dict(strategies=["separate", "mixup"]), "strategies", "'mixup'"),
        (dict(strategies=["concat", "concat"]), "strategies", "['concat', 'concat']"),
        (dict(selections=["oracle"]), "selections", "'oracle'"),
        (dict(class_splits=["z"]), "class_splits", "'z'"),
        (dict(class_splits=["a", "012345/6789"]), "class_splits", "['a', '012345/6789']"),
        (dict(class_splits=[]), "class_splits", "[]"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(kwargs, field, named):
    with pytest.raises(ConfigError, match=re.escape(named)) as err:
        check_benchmark(**{"preset": QUICK, **kwargs})
    assert err.value.field == field


@pytest.mark.parametrize(
    "seeds, want",
    [(None, (0, 1, 2, 3, 4)), (3, (0, 1, 2)), ("2", (0, 1)), ("20-24", (20, 21, 22, 23, 24))],
)
def test_seeds_are_a_count_or_a_range(seeds, want):
    p = check_benchmark(QUICK, seeds=seeds)
    assert p.seeds == want and [c.seed for c in cells_of(p)] == [s for s in want for _ in range(3)]


def test_narrowing_keeps_the_order_asked_and_the_reference_of_the_strategies_chosen():
    p = check_benchmark(
        "near-ood", seeds=2, class_splits=["b", "012345/6789"], strategies=["concat", "separate"]
    )
    assert (p.seeds, p.class_splits, p.strategies) == (
        (0, 1),
        ("b", "012345/6789"),
        ("concat", "separate"),
    )
    assert p.reference == ("separate", "concat") and p.far_strategies == ("separate", "concat")
    assert p.protocols == BENCHMARK_PRESETS["near-ood"].protocols and p.selections == (
        "ood-labels",
        "last-epoch",
    )
    only = check_benchmark("near-ood", strategies=["split-bn"])
    # no GroupNorm network, no far rows' arms
    assert (only.seeds, only.reference, only.far_strategies) == ((0, 1, 2, 3, 4), (), ())


def test_cells_run_seed_by_seed_split_by_split_with_the_far_rows_after_the_first_splits_protocols():
    p = check_benchmark("near-ood", seeds=2)
    want = []
    for seed in (0, 1):
        for split in ("a", "b", "c"):
            want += [
                Cell(seed, split, "near-ood", "heldout", pr)
                for pr in ("transductive", "disjoint", "unseen-ood")
            ]
            if split == "a":
                want += [
                    Cell(seed, "a", "far-ood", o, "transductive")
                    for o in ("digits", "photo_crops", "gaussian")
                ]
    cells = cells_of(p)
    assert cells == want and len({c.name for c in cells}) == len(cells)
    assert all(
        c.task == "near-ood"
        for c in cells_of(check_benchmark("near-ood", protocols=["disjoint", "unseen-ood"]))
    )
    assert (
        Cell(3, "012345/6789", "near-ood", "heldout", "unseen-ood").name
        == "near-ood_012345-6789_heldout_unseen-ood_seed3"
    )


def test_far_sets_that_are_not_offline_are_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(
        BENCHMARK_PRESETS,
        "x",
        dataclasses.replace(BENCHMARK_PRESETS[TINY], far_ood_sets=("mnist",)),
    )
    with pytest.raises(ConfigError, match=r"\['mnist'\]") as err:
        run_benchmark("x", tmp_path / "out", progress=False, quiet=True)
    assert err.value.field == "far_ood_sets" and not (tmp_path / "out").exists()


@needs_fmnist
def test_every_split_is_checked_before_any_training(tmp_path, tmp_data_dir, monkeypatch):
    p = BENCHMARK_PRESETS[TINY]
    monkeypatch.setitem(
        BENCHMARK_PRESETS,
        "x",
        dataclasses.replace(p, config=dataclasses.replace(p.config, batch_size_unsup=5000)),
    )
    monkeypatch.setattr(
        stages, "train", lambda *a, **k: pytest.fail("trained before every split was checked")
    )
    with pytest.raises(ConfigError, match=r"batch_size_unsup=5000\b.*\b\d+ unlabeled\b") as err:
        run_benchmark("x", tmp_path / "out", seeds=2, progress=False, quiet=True)
    assert err.value.field == "batch_size_unsup"


# ---- the toy-size grid end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """near-ood-tiny on 2 seeds into its own output folder, computed once for the module. Its
    networks go to the suite's shared cache: notebook 08's quick run is this grid and loads them
    from there."""
    root = tmp_path_factory.mktemp("bench")
    rows = run_benchmark(TINY, root / "out", seeds=SEEDS, progress=False, quiet=True)
    return root / "out", rows


def _key(r) -> tuple:
    return (
        r["task"],
        r["ood_dataset"],
        r["protocol"],
        r["selection"],
        r["method"],
        r["strategy"],
        r["norm"],
        r["seed"],
    )


@needs_fmnist
@pytest.mark.slow
def test_every_protocol_selection_method_and_strategy_has_one_row_and_the_outputs_are_written(tiny):
    out, rows = tiny
    p = BENCHMARK_PRESETS[TINY]
    base = [(m, None, "batch") for m in ("msp", "odin", "energy")]
    near = (
        base
        + [("mcd", s, "batch") for s in p.strategies]
        + [("mcd", s, "group") for s in p.reference]
    )
    far = base + [("mcd", s, "batch") for s in p.far_strategies]
    want = {
        ("near-ood", "heldout", pr, sel, *k, seed)
        for pr, sel, k, seed in product(
            ("transductive", "disjoint", "unseen-ood"),
            ("ood-labels", "last-epoch"),
            near,
            range(SEEDS),
        )
    }
    want |= {
        ("far-ood", "gaussian", "transductive", sel, *k, seed)
        for sel, k, seed in product(("ood-labels", "last-epoch"), far, range(SEEDS))
    }
    got = [_key(r) for r in rows]
    assert len(got) == len(set(got)) == 2 * (3 * 2 * 8 + 2 * 5) and set(got) == want
    assert json.loads((out / "results.json").read_text()) == rows
    config = json.loads((out / "config.json").read_text())
    assert (
        config["preset"] == TINY
        and config["seeds"] == [0, 1]
        and config["config"]["train_subset"] == 3000
    )
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and (run["rows"], run["cells"]) == (len(rows), SEEDS * 4)
    # the commit that ran, from git itself (None outside a checkout)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert (run["commit"] or "").split("+")[0] == (head.stdout.strip() or "")
    summary = (out / "summary.md").read_text()
    assert (
        summary.startswith(f"# Benchmark {TINY}: the whole grid at toy size")
        and f"{len(rows)} rows, seeds [0, 1]" in summary
    )
    for name in ("forest.png", "by_protocol.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_fmnist
@pytest.mark.slow
def test_the_metrics_recomputed_from_the_written_scores_equal_the_reported_ones(tiny):
    out, rows = tiny
    for r in rows:
        with np.load(out / r["scores"]) as z:
            s_id, s_ood = z["id"], z["ood"]
        assert (len(s_id), len(s_ood)) == (r["n_id"], r["n_ood"])
        want = brute_metrics(s_id, s_ood)
        assert want["auroc"] == pytest.approx(
            roc_auc_score(np.r_[np.zeros(len(s_id)), np.ones(len(s_ood))], np.r_[s_id, s_ood]),
            abs=1e-12,
        )
        for k in METRIC_KEYS:
            assert r[k] == pytest.approx(want[k], abs=1e-12), (r["scores"], k)
    assert len({r["scores"] for r in rows}) == len(rows)  # a file per row
    # not vacuous: the methods' scores differ
    assert len({r["auroc"] for r in rows}) > len(rows) // 3


@needs_fmnist
@pytest.mark.slow
def test_a_second_run_into_the_folder_reuses_the_finished_cells(tiny, monkeypatch):
    out, rows = tiny
    monkeypatch.setattr(
        stages, "train", lambda *a, **k: pytest.fail("trained instead of reusing a finished cell")
    )
    monkeypatch.setattr(
        bm,
        "run_ood_set",
        lambda *a, **k: pytest.fail("evaluated instead of reusing a finished cell"),
    )
    assert run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True) == rows
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


@needs_fmnist
@pytest.mark.slow
def test_resuming_cells_written_with_other_settings_is_refused(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(tiny[0], out)
    monkeypatch.setattr(
        stages, "train", lambda *a, **k: pytest.fail("trained before the cells were checked")
    )
    with pytest.raises(
        ConfigError,
        match=r"near-ood_a_heldout_transductive_seed0\.json.*--fresh",
    ) as err:
        run_benchmark(
            TINY,
            out,
            seeds=SEEDS,
            strategies=["separate", "concat"],
            progress=False,
            quiet=True,
            resume=True,
        )
    assert err.value.field == "resume"


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    """The primary preset's grid (5 arms, recalibrated statistics, endpoints) at near-ood-tiny's
    sizes, 3 seeds."""
    root = tmp_path_factory.mktemp("arms")
    p = BENCHMARK_PRESETS["primary"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MCD_DATA_DIR", str(root / "cache"))
        mp.setitem(
            BENCHMARK_PRESETS,
            "x",
            dataclasses.replace(p, config=BENCHMARK_PRESETS[TINY].config, max_seeds=5),
        )
        rows = run_benchmark("x", root / "out", seeds=3, progress=False, quiet=True)
    return root / "out", rows


@needs_fmnist
@pytest.mark.slow
def test_every_arm_has_running_and_recalibrated_rows_and_eval_batchnorm_uncouples_the_arms(
    arms,
):
    out, rows = arms
    mcd = {(r["strategy"], r["eval_stats"], r["seed"]): r for r in rows if r["method"] == "mcd"}
    strategies = BENCHMARK_PRESETS["primary"].strategies
    assert set(mcd) == {
        (s, e, seed) for s in strategies for e in ("running", "recalibrated") for seed in range(3)
    }
    # 2 epochs x 4 steps
    assert all(r["finetune_steps"] == 2 * 4 and r["model"] == "small_cnn" for r in mcd.values())
    for seed in range(3):
        # no coupling: the same network, to float32 rounding
        for stats in ("running", "recalibrated"):
            a, b = mcd["eval-bn", stats, seed], mcd["eval-bn-concat", stats, seed]
            assert (
                abs(a["auroc"] - b["auroc"]) < 1e-3
                and abs(a["id_accuracy"] - b["id_accuracy"]) < 1e-3
            )
        assert (
            mcd["concat", "running", seed]["scores"]
            != mcd["concat", "recalibrated", seed]["scores"]
        )
    with (
        np.load(out / mcd["concat", "running", 0]["scores"]) as z,
        np.load(out / mcd["concat", "recalibrated", 0]["scores"]) as w,
    ):
        # other statistics
        assert z["id"].dtype == np.float32 and np.abs(z["id"].astype(float) - w["id"]).max() > 1e-3
    summary = (out / "summary.md").read_text()
    assert (
        "## Pre-registered endpoints" in summary
        and "| primary | concat − separate | AUROC | running | 3 |" in summary
    )
    assert "MCD concat (recalibrated)" in summary
    assert json.loads((out / "config.json").read_text())["code_version"] == bm.code_version()


def test_a_dose_response_preset_has_a_cell_per_seed_and_dose_each_with_its_setting():
    p = check_benchmark("dose-length", seeds=2)
    cells = cells_of(p)
    assert [(c.seed, c.dose) for c in cells] == [
        (s, ("finetune_epochs", e)) for s in range(2) for e in (1, 2, 4, 8, 16)
    ]
    assert cells[3].name == "near-ood_a_heldout_disjoint_finetune_epochs-8_seed0"
    cfg = bm._cell_config(p, cells[3])
    assert (cfg.finetune_epochs, cfg.steps_per_epoch, cfg.seed, cfg.protocol) == (
        8,
        30,
        0,
        "disjoint",
    )
    assert bm._cell_config(p, cells[0]).finetune_epochs * 30 == 30 and all(
        c.task == "near-ood" for c in cells
    )
    assert cells_of(check_benchmark(TINY, seeds=2))[0].dose == ()


@needs_fmnist
@pytest.mark.slow
def test_a_dose_response_run_trains_each_length_and_pairs_the_strategies_per_dose(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "cache"))
    p = dataclasses.replace(
        BENCHMARK_PRESETS["dose-length"],
        config=BENCHMARK_PRESETS[TINY].config,
        doses=(("finetune_epochs", (1, 3)),),
    )
    monkeypatch.setitem(BENCHMARK_PRESETS, "x", p)
    rows = run_benchmark("x", tmp_path / "out", seeds=2, progress=False, quiet=True)
    mcd = {(r["dose"], r["strategy"], r["seed"]): r for r in rows if r["method"] == "mcd"}
    assert set(mcd) == {
        (f"finetune_epochs={e}", s, seed)
        for e in (1, 3)
        for s in ("separate", "concat")
        for seed in (0, 1)
    }
    # 4 steps an epoch
    assert all(r["finetune_steps"] == 4 * int(d[-1]) for (d, _, _), r in mcd.items())
    base = {(r["dose"], r["seed"]): r["auroc"] for r in rows if r["method"] == "msp"}
    # one pre-trained network
    assert all(base["finetune_epochs=1", s] == base["finetune_epochs=3", s] for s in (0, 1))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert (
        "| finetune_epochs=3 | disjoint | last-epoch | BatchNorm | concat − separate | 2 |"
        in summary
    )
    # 2 of 10 seeds
    assert summary.splitlines()[0].endswith(
        "(narrowed by the command line: config.json has the grid)"
    )


@needs_fmnist
def test_the_primary_pool_is_6400_unlabeled_images_38_percent_ood_each_drawn_twice():
    import torch

    from mcd_helpers.experiments.stages import load_data, make_split
    from mcd_helpers.splits import class_split

    p = BENCHMARK_PRESETS["primary"]
    cell = cells_of(p)[0]
    cfg = bm._cell_config(p, cell)
    data = load_data(cfg)
    split = make_split(cfg, data, cell.ood)
    held_out = data.x_train[torch.isin(data.y_train, torch.tensor(class_split("a")[1]))]
    ood = {bytes(r) for r in held_out.flatten(1).numpy()}
    n_ood = sum(bytes(r) in ood for r in split.x_unsup.flatten(1).numpy())
    assert (len(split.x_unsup), n_ood) == (6400, 2460)  # 3,940 ID + 2,460 OOD (docs/near-ood.md)
    assert cfg.finetune_epochs * cfg.steps_per_epoch * cfg.batch_size_unsup == 2 * 6400


def test_endpoints_are_kept_only_on_the_grid_they_were_registered_for():
    ends = BENCHMARK_PRESETS["primary"].endpoints
    assert check_benchmark("primary", seeds=2).endpoints == ends  # fewer seeds: the same design
    two = check_benchmark("primary", strategies=["concat", "separate"]).endpoints
    assert (
        two == tuple(e for e in ends if {e[0], e[1]} == {"concat", "separate"})
        and two[0] == ends[0]
    )
    # the primary's arm gone
    assert check_benchmark("primary", strategies=["concat-both", "separate"]).endpoints == ()
    assert check_benchmark("primary", protocols=["transductive"]).endpoints == ()
    assert check_benchmark("primary", selections=["ood-labels"]).endpoints == ()
    assert check_benchmark("primary", class_splits=["b"]).endpoints == ()
