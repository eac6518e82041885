"""The benchmark (mcd_helpers.experiments.benchmark and .report).

Bad settings are refused before any work, with the valid values. The toy-size preset runs the whole
grid (every protocol x selection x method x strategy, both networks) end to end on 2 seeds, in a
cache of this module's own; every row's metrics are recomputed from its ``scores/*.npz`` with
scikit-learn, the report's numbers from the rows by hand; finished cells are reused, an
interrupted run resumes where it stopped. (The quick preset's 5 seeds are the README's run.)
"""
import dataclasses
import json
from itertools import product

import numpy as np
import pytest
from scipy import stats as st
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from mcd_helpers.__main__ import main
from mcd_helpers.data.sets import DEBIAN_FMNIST_DIR
from mcd_helpers.errors import CheckpointMismatchError, ConfigError, TrainingInterrupted, UnfinishedRunError
from mcd_helpers.experiments import benchmark as bm
from mcd_helpers.experiments.benchmark import BENCHMARK_PRESETS, Cell, cells_of, check_benchmark, run_benchmark
from mcd_helpers.experiments.report import benchmark_tables, summary_text
from mcd_helpers.steps import STRATEGIES

QUICK = "near-ood-quick"


@pytest.mark.parametrize("kwargs, match", [
    (dict(preset="bogus"), r"unknown benchmark preset 'bogus'; valid presets: near-ood-quick, near-ood, near-ood-tiny"),
    (dict(protocols=["transductive", "closed"]),
     r"unknown protocol \['closed'\]; valid values: transductive, disjoint, unseen-ood"),
    (dict(protocols=[]), r"unknown protocol list \(empty\); valid values: transductive, disjoint, unseen-ood"),
    (dict(strategies=["separate", "mixup"]),
     r"unknown strategies \['mixup'\]; valid values: separate, concat, split-bn, recalibrate"),
    (dict(selections=["oracle"]), r"unknown selection \['oracle'\]; valid values: ood-labels, last-epoch"),
    (dict(class_splits=["z"]), r"unknown class split 'z'; .*Known splits: 'a': "),
    (dict(class_splits=["012/2345"]), r"class\(es\) \[2\] are both ID and OOD \(overlap\)"),
    (dict(class_splits=["/0123"]), r"id_classes is empty"),
    (dict(class_splits=[]), r"the list of class splits is empty"),
    (dict(protocols=["disjoint", "disjoint"]), r"protocol \['disjoint'\] given more than once"),
    (dict(strategies=["separate", "concat", "separate"]), r"strategies \['separate'\] given more than once"),
    (dict(class_splits=["a", "012345/6789"]), r"class splits 'a' and '012345/6789' are the same split"),
    (dict(seeds=1), r"seeds must be an integer from 2 \(a confidence interval needs two\) to 5 .*got 1"),
    (dict(seeds=6), r"to 5 \(preset 'near-ood-quick''s most\), got 6"),
])
def test_bad_settings_are_refused_with_the_valid_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        check_benchmark(**{"preset": QUICK, **kwargs})


def test_the_command_line_refuses_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["benchmark", "--preset", QUICK, "--protocols", "transductive,closed", "--out", str(out)]) == 2
    assert "valid values: transductive, disjoint, unseen-ood" in capsys.readouterr().err
    assert main(["benchmark", "--preset", "near-ood", "--seeds", "11", "--out", str(out)]) == 2
    assert "to 10 (preset 'near-ood''s most), got 11" in capsys.readouterr().err
    assert not out.exists()  # nothing written, not even the folder


def test_narrowing_keeps_the_order_and_the_reference():
    p = check_benchmark("near-ood", seeds=2, class_splits=["b", "012345/6789"], strategies=["concat", "separate"])
    assert p.seeds == 2 and p.class_splits == ("b", "012345/6789") and p.strategies == ("concat", "separate")
    assert p.reference == ("separate", "concat") and p.far_strategies == ("separate", "concat")
    assert check_benchmark("near-ood", strategies=["split-bn"]).reference == ()  # GroupNorm: no split-bn


def test_cells_every_seed_split_protocol_and_far_row():
    cells = cells_of(check_benchmark(QUICK))
    assert cells[:3] == [Cell(0, "a", "near-ood", "heldout", p) for p in ("transductive", "disjoint", "unseen-ood")]
    assert len(cells) == 5 * 3 and {c.seed for c in cells} == set(range(5))
    full = cells_of(check_benchmark("near-ood"))
    assert len(full) == 5 * (3 * 3 + 3)  # seeds x (splits x protocols + far OOD sets of the first split)
    assert {(c.protocol, c.class_split) for c in full if c.task == "far-ood"} == {("transductive", "a")}
    assert len({c.name for c in full}) == len(full)


# ---- the toy-size grid end to end ------------------------------------------------------------------

TINY = "near-ood-tiny"
SEEDS = 2
pytestmark_slow = pytest.mark.skipif(not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """near-ood-tiny on 2 seeds into its own output folder and cache (computed once for the module)."""
    root = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("MCD_DATA_DIR", str(root / "cache"))
    try:
        rows = run_benchmark(TINY, root / "out", seeds=SEEDS, progress=False, quiet=True)
    finally:
        mp.undo()
    return root, rows


def _expected(p, seeds):
    near = [(m, None, "batch") for m in ("msp", "odin", "energy")] + [("mcd", s, "batch") for s in p.strategies]
    far = near[:3] + [("mcd", s, "batch") for s in p.far_strategies]
    ref = [("mcd", s, "group") for s in p.reference]
    out = {("near-ood", pr, sel, *k, seed) for pr, sel, k, seed in product(p.protocols, p.selections, near + ref,
                                                                          range(seeds))}
    out |= {("far-ood", "transductive", sel, *k, seed) for sel, k, seed in product(p.selections, far,
                                                                                  range(seeds))}
    return out


@pytestmark_slow
@pytest.mark.slow
def test_every_protocol_selection_method_and_strategy_has_its_rows(tiny_run):
    root, rows = tiny_run
    p = BENCHMARK_PRESETS[TINY]
    got = [(r["task"], r["protocol"], r["selection"], r["method"], r["strategy"], r["norm"], r["seed"]) for r in rows]
    assert len(got) == len(set(got)) and set(got) == _expected(p, SEEDS)
    assert set(STRATEGIES) <= {r["strategy"] for r in rows}
    assert json.loads((root / "out" / "results.json").read_text()) == rows
    run = json.loads((root / "out" / "run.json").read_text())
    assert run["status"] == "finished" and run["rows"] == len(rows) and run["seconds"] > 0
    for name in ("forest.png", "by_protocol.png"):
        assert (root / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sklearn_metrics(s_id: np.ndarray, s_ood: np.ndarray) -> dict:
    """The five metrics from scikit-learn alone (ID positive, higher score = more OOD)."""
    y = np.r_[np.ones(len(s_id)), np.zeros(len(s_ood))]
    s = np.r_[s_id, s_ood].astype(np.float64)
    fpr, tpr, _ = roc_curve(y, -s, drop_intermediate=False)
    return {"auroc": roc_auc_score(1 - y, s), "fpr95": fpr[np.argmax(tpr >= 0.95 - 1e-12)],
            "detection_error": float(np.min(0.5 * (1 - tpr) + 0.5 * fpr)),
            "aupr_in": average_precision_score(y, -s), "aupr_out": average_precision_score(1 - y, s)}


@pytestmark_slow
@pytest.mark.slow
def test_metrics_recomputed_from_the_written_scores_equal_the_reported(tiny_run):
    root, rows = tiny_run
    for r in rows:
        with np.load(root / "out" / r["scores"]) as z:
            s_id, s_ood = z["id"], z["ood"]
        assert (len(s_id), len(s_ood)) == (r["n_id"], r["n_ood"])
        for k, v in _sklearn_metrics(s_id, s_ood).items():
            assert abs(r[k] - v) <= 1e-12, (r["scores"], k, r[k], v)
    # not vacuous: the methods' scores differ, and F1's ID accuracy moved with fine-tuning
    assert len({r["auroc"] for r in rows}) > len(rows) // 3
    base = {(r["protocol"], r["seed"]): r["id_accuracy"] for r in rows if r["method"] == "msp"}
    assert any(r["id_accuracy"] != base[(r["protocol"], r["seed"])] for r in rows if r["method"] == "mcd")


@pytestmark_slow
@pytest.mark.slow
def test_recalibrate_is_trained_once_with_separate_and_differs_only_in_its_statistics(tiny_run):
    root, rows = tiny_run
    p = BENCHMARK_PRESETS[TINY]
    files = sorted(f.name for f in (root / "cache" / "cache").glob("*.pt"))
    # pre-training: BatchNorm and GroupNorm, each on the transductive and on the held-out labeled set
    assert len([f for f in files if f.startswith("pretrain-")]) == 2 * 2 * SEEDS
    trained = lambda strats: len({s if s != "recalibrate" else "separate" for s in strats})  # noqa: E731
    per_seed = len(p.protocols) * (trained(p.strategies) + len(p.reference)) + len(p.far_ood) * trained(
        p.far_strategies)
    assert len([f for f in files if f.startswith("finetune-")]) == per_seed * SEEDS
    pick = lambda s: {(r["task"], r["protocol"], r["selection"], r["seed"]): r for r in rows  # noqa: E731
                      if r["strategy"] == s and r["norm"] == "batch" and r["task"] == "near-ood"}
    sep, rec = pick("separate"), pick("recalibrate")
    assert set(sep) == set(rec)
    for k in sep:  # one training: the same selected epoch and validation AUROC
        assert (sep[k]["selected_epoch"], sep[k]["val_auroc"]) == (rec[k]["selected_epoch"], rec[k]["val_auroc"])
    assert any(sep[k]["id_accuracy"] != rec[k]["id_accuracy"] for k in sep)


@pytestmark_slow
@pytest.mark.slow
def test_the_summary_numbers_are_the_rows_mean_and_t_interval(tiny_run):
    root, rows = tiny_run
    text = (root / "out" / "summary.md").read_text()
    pick = [r for r in rows if (r["task"], r["protocol"], r["selection"], r["method"], r["strategy"], r["norm"])
            == ("near-ood", "disjoint", "ood-labels", "mcd", "concat", "batch")]
    a = np.array([r["auroc"] for r in sorted(pick, key=lambda r: r["seed"])])  # fractions, by seed
    half = st.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a))
    assert f"| disjoint | MCD concat | {SEEDS} | {100 * a.mean():.2f} ± {100 * half:.2f} |" in text
    sep = [r for r in rows if (r["task"], r["protocol"], r["selection"], r["method"], r["strategy"], r["norm"])
           == ("near-ood", "disjoint", "ood-labels", "mcd", "separate", "batch")]
    d = a - np.array([r["auroc"] for r in sorted(sep, key=lambda r: r["seed"])])
    dh = st.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    assert (f"| disjoint | ood-labels | BatchNorm | concat − separate | {SEEDS} | {100 * d.mean():+.2f} ± "
            f"{100 * dh:.2f} |") in text


@pytestmark_slow
@pytest.mark.slow
def test_finished_cells_are_reused_and_an_interrupted_run_resumes(tiny_run, tmp_path, monkeypatch):
    root, rows = tiny_run
    monkeypatch.setenv("MCD_DATA_DIR", str(root / "cache"))  # every stage is cached: cells only evaluate
    out = tmp_path / "out"
    real, calls = bm._run_cell, []

    def stop_at_third(*args, **kwargs):
        calls.append(args[1].name)
        if len(calls) == 3:
            raise TrainingInterrupted("stopped by the test")
        return real(*args, **kwargs)

    monkeypatch.setattr(bm, "_run_cell", stop_at_third)
    with pytest.raises(TrainingInterrupted):
        run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True)
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert len(list((out / "cells").glob("*.json"))) == 2 and not (out / "results.json").exists()
    with pytest.raises(UnfinishedRunError, match="Pass --resume to continue it"):
        run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True)
    calls.clear()
    monkeypatch.setattr(bm, "_run_cell", lambda *a, **k: calls.append(a[1].name) or real(*a, **k))
    again = run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True, resume=True)
    n_cells = len(cells_of(check_benchmark(TINY, seeds=SEEDS)))
    assert len(calls) == n_cells - 2  # the two finished cells were not run again
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["resumed"] and "error" not in run  # no stale error left
    assert again == rows  # the same numbers as the uninterrupted run
    # a finished folder: everything reused; a cell written with other settings is refused on resume
    calls.clear()
    assert run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True) == again and calls == []
    first = sorted((out / "cells").glob("*.json"))[0]
    saved = json.loads(first.read_text())
    first.write_text(json.dumps({**saved, "key": "0" * 16}))
    (out / "run.json").write_text(json.dumps({"status": "interrupted"}))
    with pytest.raises(CheckpointMismatchError, match="was written with other settings"):
        run_benchmark(TINY, out, seeds=SEEDS, progress=False, quiet=True, resume=True)


def test_cells_are_named_uniquely_and_readably():
    c = Cell(3, "012345/6789", "near-ood", "heldout", "unseen-ood")
    assert c.name == "near-ood_012345-6789_heldout_unseen-ood_seed3"
    assert dataclasses.replace(c, seed=4).name != c.name


def _row(task, ood, seed, method, strategy, auroc, norm="batch"):
    return {"task": task, "class_split": "a", "protocol": "transductive", "selection": "ood-labels",
            "method": method, "strategy": strategy, "norm": norm, "seed": seed, "ood_dataset": ood,
            "auroc": auroc, "fpr95": 1 - auroc, "id_accuracy": 0.9}


def test_far_rows_of_several_ood_sets_are_summarised_apart():
    # the full preset's far rows: three OOD sets share every other key; each is its own group
    rows = [_row("far-ood", ood, seed, "mcd", s, base + 0.01 * seed + (0.02 if s == "concat" else 0.0))
            for ood, base in (("digits", 0.9), ("gaussian", 0.5)) for seed in range(3) for s in ("separate", "concat")]
    summary, paired = benchmark_tables(rows, "far-ood")
    assert [(g["ood_dataset"], g["strategy"], g["n"]) for g in summary] == [
        ("digits", "separate", 3), ("digits", "concat", 3), ("gaussian", "separate", 3), ("gaussian", "concat", 3)]
    assert summary[0]["auroc"]["mean"] == pytest.approx(0.91) and summary[2]["auroc"]["mean"] == pytest.approx(0.51)
    d = [x for x in paired if x["metric"] == "auroc"]
    assert [(x["ood_dataset"], x["n"]) for x in d] == [("digits", 3), ("gaussian", 3)]
    assert all(x["mean"] == pytest.approx(0.02) for x in d)
    text = summary_text(rows, "t")
    assert "| digits | transductive | MCD concat | 3 | 93.00 ± 2.48 |" in text  # t_{0.975,2} * 0.01 / sqrt(3) * 100
