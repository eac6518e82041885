"""mcd_helpers.stats (intervals, paired differences) against hand computations and other scipy routines, and
mcd_helpers.report's tables, whose numbers are recomputed here from the rows."""
import math

import matplotlib
import numpy as np
import pytest
from scipy import stats as st

from mcd_helpers.report import (benchmark_tables, markdown_table, method_label, pivot_markdown, pooled_summary, results_markdown, setting_differences, summary_text,
                                write_report)
from mcd_helpers.stats import endpoint_tests, mean_ci, paired_differences, summarize

matplotlib.use("Agg")

T975_DF4, T975_DF2, T95_DF4 = 2.7764451051977934, 4.302652729749462, 2.1318467863266495  # any t table


def by_scipy(values, confidence=0.95):
    """Mean and half-width from scipy's interval routine (the package uses the quantile function instead)."""
    x = np.asarray(values, float)
    low, high = st.t.interval(confidence, len(x) - 1, loc=x.mean(), scale=st.sem(x))
    return x.mean(), (high - low) / 2


def p_by_hand(diffs):
    """Two-sided paired t-test: t = mean(d) / (s_d / sqrt(n)), p = 2 P(T_{n-1} > |t|)."""
    d = np.asarray(diffs, float)
    return 2 * st.t.sf(abs(d.mean() / (d.std(ddof=1) / math.sqrt(len(d)))), len(d) - 1)


def pct(values, signed=False):
    m, h = by_scipy(values)
    return f"{100 * m:{'+' if signed else ''}.2f} ± {100 * h:.2f}"


# ---- mean_ci -------------------------------------------------------------------------------------

def test_mean_ci_by_hand():
    half = T975_DF4 * math.sqrt(2.5 / 5)  # 1..5: s^2 = (4 + 1 + 0 + 1 + 4) / 4
    assert mean_ci([1, 2, 3, 4, 5]) == pytest.approx({"mean": 3.0, "low": 3 - half, "high": 3 + half,
                                                      "half_width": half, "n": 5}, rel=1e-12)
    assert mean_ci(np.array([5, 1, 4, 2, 3]), 0.90)["half_width"] == pytest.approx(T95_DF4 * math.sqrt(2.5 / 5), rel=1e-12)
    assert mean_ci([0.7, 0.7, 0.7])["half_width"] == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("n, confidence", [(2, 0.95), (5, 0.99), (12, 0.8)])
def test_mean_ci_against_scipys_interval(n, confidence):
    x = np.random.RandomState(n).uniform(0.6, 0.99, n)
    ci, (m, h) = mean_ci(x, confidence), by_scipy(x, confidence)
    assert (ci["mean"], ci["half_width"], ci["low"], ci["high"]) == pytest.approx((m, h, m - h, m + h), rel=1e-10)


@pytest.mark.parametrize("values, kw, match", [
    ([0.5], {}, r"at least 2 values \(seeds\), got 1; run more seeds"), ([], {}, "got 0"),
    ([0.5, 0.6, float("nan")], {}, r"values hold 1 NaN or inf value\(s\), first at index 2: a failed run upstream"),
    ([float("inf"), 0.6, float("nan")], {}, r"2 NaN or inf value\(s\), first at index 0"),
    ([0.5, 0.6], {"confidence": 95}, r"confidence must be a fraction in \(0, 1\), got 95 \(did you mean 0.95\?\)"),
    ([0.5, 0.6], {"confidence": 1.0}, r"fraction in \(0, 1\), got 1.0.$"), ([0.5, 0.6], {"confidence": 0}, "got 0.$")])
def test_mean_ci_errors(values, kw, match):
    with pytest.raises(ValueError, match=match):
        mean_ci(values, **kw)


# ---- paired differences and summaries -------------------------------------------------------------

def row(strategy, seed, auroc, method="mcd", protocol="disjoint", class_split="a", **kw):
    return {"task": "near-ood", "class_split": class_split, "protocol": protocol, "selection": "last-epoch",
            "method": method, "strategy": strategy, "seed": seed, "auroc": auroc, **kw}


HAND = ([row("concat", s, v) for s, v in zip((2, 0, 1), (0.95, 0.90, 0.85))]
        + [row("separate", s, v) for s, v in zip((1, 2, 0), (0.86, 0.91, 0.88))])  # diffs by seed: 0.02, -0.01, 0.04
GROUP = "{'task': 'near-ood', 'class_split': 'a', 'protocol': 'disjoint', 'selection': 'last-epoch', 'method': 'mcd'}"


def test_paired_differences_by_hand():
    (d,) = paired_differences(HAND + [row("split-bn", 0, 0.5), row(None, 0, 0.6, method="msp")])  # others ignored
    assert d["seeds"] == [0, 1, 2] and d["diffs"] == pytest.approx([0.02, -0.01, 0.04], abs=1e-12)
    s = math.sqrt(((0.02 - 1 / 60) ** 2 + (-0.01 - 1 / 60) ** 2 + (0.04 - 1 / 60) ** 2) / 2)
    half = T975_DF2 * s / math.sqrt(3)
    assert (d["mean"], d["half_width"], d["low"], d["high"], d["n"]) == pytest.approx(
        (1 / 60, half, 1 / 60 - half, 1 / 60 + half, 3), rel=1e-9)
    assert d["p_value"] == pytest.approx(2 * st.t.sf((1 / 60) / (s / math.sqrt(3)), 2), rel=1e-9)
    assert {k: d[k] for k in ("task", "class_split", "protocol", "selection", "method", "metric", "a", "b")} == {
        "task": "near-ood", "class_split": "a", "protocol": "disjoint", "selection": "last-epoch", "method": "mcd",
        "metric": "auroc", "a": "concat", "b": "separate"}


def test_paired_differences_on_random_groups_agree_with_the_one_sample_test_and_the_interval():
    rng, rows = np.random.RandomState(0), []
    for protocol in ("unseen-ood", "transductive", "disjoint"):
        for seed in range(6):
            a, b = rng.uniform(0.6, 0.95, 2)
            rows += [row("split-bn", seed, a, protocol=protocol, fpr95=1 - a),
                     row("separate", seed, b, protocol=protocol, fpr95=1 - b)]
    out = paired_differences(rows, "split-bn", "separate", "fpr95", keys=("protocol",))
    assert [d["protocol"] for d in out] == ["unseen-ood", "transductive", "disjoint"]  # order of first appearance
    for d in out:
        xa, xb = ([r["fpr95"] for r in rows if r["protocol"] == d["protocol"] and r["strategy"] == s]
                  for s in ("split-bn", "separate"))
        diffs = np.subtract(xa, xb)
        assert d["p_value"] == pytest.approx(st.ttest_1samp(diffs, 0.0).pvalue, rel=1e-10)
        assert (d["mean"], d["half_width"]) == pytest.approx(by_scipy(diffs), rel=1e-10)
        assert (d["p_value"] < 0.05) == (d["low"] > 0 or d["high"] < 0)


def test_equal_differences_have_no_p_and_a_group_with_one_strategy_is_left_out():
    rows = [row("concat", s, 0.9) for s in range(3)] + [row("separate", s, 0.8) for s in range(3)]
    rows += [row("concat", s, 0.9, protocol="transductive") for s in range(3)]  # no separate here: nothing to pair
    (d,) = paired_differences(rows)
    assert d["protocol"] == "disjoint" and d["half_width"] == pytest.approx(0.0, abs=1e-12) and math.isnan(d["p_value"])


@pytest.mark.parametrize("rows, match", [
    (HAND + [row("concat", 3, 0.9)], rf"unmatched seeds in group {GROUP}: \[3\] only for one strategy; pairs need"),
    (HAND[:3] + [row("separate", s, 0.9) for s in (7, 8, 9)], r"unmatched seeds .*: \[0, 1, 2, 7, 8, 9\]"),
    (HAND + [row("separate", 0, 0.5)], rf"seed 0 appears twice for strategy 'separate' in group {GROUP}"),
    ([row("concat", 0, 0.9), row("separate", 0, 0.8)], rf"group {GROUP}: a confidence interval needs at least 2"),
    ([{**HAND[0], "auroc": None}] + HAND[1:], r"row 0 has no field\(s\) \['auroc'\]; its fields are \['auroc', 'class_split'"),
    (HAND[:5] + [{"strategy": "concat", "seed": 9, "auroc": 0.9}], r"row 5 has no field\(s\) \['task', 'class_split', "
                                                                    r"'protocol', 'selection', 'method'\]"),
    (HAND[:3] + [row("separate", s, float("nan") if s == 1 else 0.8) for s in range(3)],
     rf"group {GROUP}: values hold 1 NaN or inf value\(s\), first at index 1"),
])
def test_paired_differences_errors(rows, match):
    with pytest.raises(ValueError, match=match):
        paired_differences(rows)


def test_summarize_groups_in_order_of_first_appearance():
    rows = [dict(r, fpr95=0.5, id_accuracy=0.9 + 0.01 * r["seed"]) for r in HAND[3:] + HAND[:3]]
    summary = summarize(rows)
    assert [(g["strategy"], g["n"]) for g in summary] == [("separate", 3), ("concat", 3)]
    concat = summary[1]
    assert {k: concat[k] for k in ("task", "class_split", "protocol", "selection", "method")} == {
        "task": "near-ood", "class_split": "a", "protocol": "disjoint", "selection": "last-epoch", "method": "mcd"}
    assert (concat["auroc"]["mean"], concat["auroc"]["half_width"]) == pytest.approx((0.9, T975_DF2 * 0.05 / math.sqrt(3)))
    assert concat["fpr95"]["half_width"] == 0.0 and concat["id_accuracy"]["mean"] == pytest.approx(0.91)
    (pooled,) = summarize(rows, ("auroc",), keys=("task",))
    assert pooled["n"] == 6 and pooled["auroc"]["mean"] == pytest.approx(np.mean([r["auroc"] for r in rows]))


def test_summarize_errors():
    with pytest.raises(ValueError, match=r"group \{.*'strategy': 'concat'\}, auroc: a confidence interval needs at least 2"):
        summarize(HAND[:1] + HAND[3:], metrics=("auroc",))
    with pytest.raises(ValueError, match=r"row 0 has no field\(s\) \['fpr95'\]"):
        summarize(HAND)


# ---- report: the small tables -----------------------------------------------------------------------

def test_markdown_table():
    assert markdown_table(["a", "b"], [[1, 2.5], ["x", None]], "lr") == \
        "| a | b |\n| --- | ---: |\n| 1 | 2.5 |\n| x | None |"
    assert markdown_table(["a"], []) == "| a |\n| --- |"


@pytest.mark.parametrize("g, label", [({"method": "msp"}, "MSP (pre-trained)"), ({"method": "odin"}, "ODIN (pre-trained)"),
                                      ({"method": "energy", "strategy": None}, "energy (pre-trained)"),
                                      ({"method": "mcd", "strategy": "concat"}, "MCD concat"),
                                      ({"method": "mcd", "strategy": "separate", "norm": "group"}, "MCD separate (GroupNorm)")])
def test_method_label(g, label):
    assert method_label(g) == label


def metrics(fpr95, det, auroc, aupr_in, aupr_out, acc):
    return dict(fpr95=fpr95, detection_error=det, auroc=auroc, aupr_in=aupr_in, aupr_out=aupr_out, id_accuracy=acc)


def test_results_markdown():
    rows = [{"id_dataset": "fashion_mnist", "class_split": "b", "ood_dataset": "heldout", "method": "mcd",
             "strategy": "separate", **metrics(0.1234, 0.05, 0.98765, 0.9, 0.875, 0.91)},
            {"id_dataset": "cifar10", "ood_dataset": "LSUN", "method": "msp", "strategy": None,
             **metrics(0.5, 0.25, 0.8, 0.7, 0.6, 0.95)}]
    text = results_markdown(rows)
    assert text.splitlines()[:4] == [
        "| ID | OOD | method | strategy | FPR95 | det. error | AUROC | AUPR-In | AUPR-Out | ID acc. |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| fashion_mnist b | heldout | mcd | separate | 12.34 | 5.00 | 98.77 | 90.00 | 87.50 | 91.00 |",
        "| cifar10 | LSUN | msp | - | 50.00 | 25.00 | 80.00 | 70.00 | 60.00 | 95.00 |"]
    assert "All numbers in %" in text and "Failed" not in text
    failed = results_markdown(rows, {"mnist": "DataNotFoundError: MNIST was not found"})
    assert failed.endswith("**Failed OOD sets** (no rows):\n\n- mnist: DataNotFoundError: MNIST was not found\n")


# ---- report: the benchmark ---------------------------------------------------------------------------

def bench_rows(far=True):
    """Near-OOD: splits a, b x protocols (disjoint first) x seeds 0-2 x MCD concat/separate and MSP; far-OOD: split a,
    OOD sets digits and uniform, MCD concat/separate. Metrics drawn at random."""
    rng, rows = np.random.RandomState(1), []
    near = [("near-ood", s, p, "heldout") for s in "ab" for p in ("disjoint", "transductive")]
    for task, split, protocol, ood in near + ([("far-ood", "a", "transductive", o) for o in ("digits", "uniform")] if far else []):
        for seed in range(3):
            for method, strategy in [("mcd", "concat"), ("mcd", "separate"), ("msp", None)][:3 if task == "near-ood" else 2]:
                a, f, acc, pi, po = rng.uniform(0.6, 0.99), rng.uniform(0.05, 0.6), *rng.uniform(0.85, 0.95, 3)
                rows.append({"task": task, "class_split": split, "protocol": protocol, "selection": "ood-labels",
                             "method": method, "strategy": strategy, "seed": seed, "ood_dataset": ood, "norm": "batch",
                             "auroc": a, "fpr95": f, "aupr_in": pi, "aupr_out": po, "id_accuracy": acc})
    return rows


def values(rows, metric="auroc", **match):
    return [r[metric] for r in rows if all(r[k] == v for k, v in match.items())]


def diffs(rows, metric="auroc", a="concat", b="separate", field="strategy", **match):
    xa, xb = values(rows, metric, **match, **{field: a}), values(rows, metric, **match, **{field: b})
    return np.subtract(xa, xb)  # rows are in seed order


def test_benchmark_tables_summary_pairs_and_pooled_pairs():
    rows = bench_rows()
    summary, paired = benchmark_tables(rows, "near-ood")
    assert len(summary) == 2 * 2 * 3 and all(g["n"] == 3 and g["task"] == "near-ood" for g in summary)
    for g in summary:
        match = {k: g[k] for k in ("class_split", "protocol", "method", "strategy")}
        assert g["fpr95"]["mean"] == pytest.approx(np.mean(values(rows, "fpr95", task="near-ood", **match)), rel=1e-12)
    assert {(d["class_split"], d["metric"]) for d in paired} == {
        (s, m) for s in ("a", "b", "all") for m in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")}
    assert len(paired) == 3 * 2 * 5 and all((d["a"], d["b"], d["method"]) == ("concat", "separate", "mcd") for d in paired)
    d = next(d for d in paired if (d["class_split"], d["protocol"], d["metric"]) == ("b", "transductive", "id_accuracy"))
    assert d["diffs"] == pytest.approx(diffs(rows, "id_accuracy", task="near-ood", class_split="b", protocol="transductive"))
    pooled = next(d for d in paired if (d["class_split"], d["protocol"], d["metric"]) == ("all", "disjoint", "auroc"))
    # split as the block: one pair per split, its mean over seeds (the seeds are not independent replicates of a split)
    want = [diffs(rows, class_split=s, protocol="disjoint").mean() for s in "ab"]
    assert pooled["seeds"] == ["a", "b"] and pooled["n"] == 2
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx(by_scipy(want), rel=1e-10)
    _, far_pairs = benchmark_tables(rows, "far-ood")  # one split: nothing pooled
    assert {d["class_split"] for d in far_pairs} == {"a"} and len(far_pairs) == 2 * 5


def test_setting_differences_pair_protocols_by_seed_and_split():
    rows = bench_rows(far=False)
    out = setting_differences(rows, "protocol", "disjoint", "transductive", "fpr95")
    assert [(d["class_split"], d["method"], d["arm"]) for d in out] == [
        (s, m, arm) for s in ("a", "b", "all") for m, arm in (("mcd", "concat"), ("mcd", "separate"), ("msp", "-"))]
    d = next(d for d in out if (d["class_split"], d["arm"]) == ("b", "-"))
    assert d["diffs"] == pytest.approx(diffs(rows, "fpr95", "disjoint", "transductive", "protocol", class_split="b",
                                             method="msp"))
    pooled = next(d for d in out if (d["class_split"], d["arm"]) == ("all", "concat"))
    want = [diffs(rows, "fpr95", "disjoint", "transductive", "protocol", class_split=s, strategy="concat").mean()
            for s in "ab"]
    assert pooled["seeds"] == ["a", "b"] and pooled["metric"] == "fpr95"
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx(by_scipy(want), rel=1e-10)
    with pytest.raises(ValueError, match="field must be 'protocol' or 'selection', got 'norm'"):
        setting_differences(rows, "norm", "batch", "group")


def test_pooled_summary_and_pivot():
    rows = [r for r in bench_rows(far=False) if not (r["method"] == "msp" and r["protocol"] == "disjoint")]
    pooled = pooled_summary(rows)
    assert len(pooled) == 5 and all("class_split" not in g for g in pooled)
    split_mean = lambda **m: [np.mean(values(rows, class_split=s, **m)) for s in "ab"]  # noqa: E731  a value per split
    for g in pooled:
        v = split_mean(protocol=g["protocol"], method=g["method"], strategy=g["strategy"])
        assert g["n"] == len(v) == 2 and g["auroc"]["mean"] == pytest.approx(np.mean(v), rel=1e-12)
        assert g["auroc"]["half_width"] == pytest.approx(by_scipy(v)[1], rel=1e-10)
    lines = pivot_markdown(pooled).splitlines()
    assert lines[0] == "| method | n | transductive: AUROC (%) | disjoint: AUROC (%) |"  # PROTOCOLS order
    cells = {p: pct(split_mean(protocol=p, strategy="concat")) for p in ("transductive", "disjoint")}
    assert f"| MCD concat | 2 | {cells['transductive']} | {cells['disjoint']} |" in lines
    assert f"| MSP (pre-trained) | 2 | {pct(split_mean(protocol='transductive', method='msp'))} | - |" in lines
    assert pivot_markdown(pooled, selection="last-epoch").splitlines()[2:] == []


def test_summary_text_numbers_are_the_rows_means():
    rows = bench_rows()
    text = summary_text(rows, "My run", seconds=150)
    lines = text.splitlines()
    assert lines[0] == "# My run" and lines[2].startswith(f"{len(rows)} rows, seeds [0, 1, 2].")
    assert "Wall time of this run: 2.5 min" in text
    near, far = text.index("## Near-OOD: held-out classes"), text.index("## Far-OOD rows (transductive)")
    assert near < far and "Class splits a, b; OOD: heldout." in text and "Class splits a; OOD: digits, uniform." in text
    m = dict(task="near-ood", class_split="b", protocol="transductive", strategy="separate")
    want = "| b | transductive | MCD separate | 3 | " + " | ".join(
        pct(values(rows, k, **m)) for k in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")) + " |"
    assert want in lines and lines.index(want) < lines.index("### Paired differences")
    m = dict(task="far-ood", ood_dataset="uniform")
    want = f"| uniform | transductive | MCD concat | 3 | {pct(values(rows, strategy='concat', **m))} |"
    assert any(line.startswith(want) for line in lines[lines.index("## Far-OOD rows (transductive)"):])
    d = {k: [diffs(rows, k, task="near-ood", class_split=s, protocol="disjoint").mean() for s in "ab"]
         for k in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")}  # a pair per split: its mean over seeds
    want = (f"| all | disjoint | ood-labels | BatchNorm | concat − separate | 2 | "
            + " | ".join(pct(v, True) for v in d.values()) + f" | {p_by_hand(d['auroc']):.2g} |")
    assert want in lines


def test_write_report(tmp_path):
    import matplotlib.image

    rows = bench_rows()
    write_report(rows, tmp_path / "near", "Bench")
    assert sorted(p.name for p in (tmp_path / "near").iterdir()) == ["by_protocol.png", "forest.png", "summary.md"]
    text = (tmp_path / "near" / "summary.md").read_text()
    m = dict(task="near-ood", class_split="a", protocol="disjoint", method="msp")
    assert text.startswith("# Bench\n") and f"| a | disjoint | MSP (pre-trained) | 3 | {pct(values(rows, **m))} |" in text
    # forest: the two pooled MCD AUROC differences, 9.0 x (1.4 + 0.35 * 2) inches at 100 dpi; by protocol: a panel
    # per class split, 2 x 4.6 x 3.6 inches
    assert matplotlib.image.imread(tmp_path / "near" / "forest.png").shape[:2] == (210, 900)
    assert matplotlib.image.imread(tmp_path / "near" / "by_protocol.png").shape[:2] == (360, 920)
    write_report([r for r in rows if r["task"] == "far-ood"], tmp_path / "far")
    assert [p.name for p in (tmp_path / "far").iterdir()] == ["summary.md"]


def test_the_committed_benchmark_splits_disagree_on_concat_minus_separate():
    # docs/near-ood.md and notebook 07: per class split, from the committed rows, with scipy's paired t-test
    import json
    from pathlib import Path

    from scipy import stats as sps

    rows = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/near-ood/results.json").read_text())
    auroc = {(r["class_split"], r["protocol"], r["strategy"], r["seed"]): r["auroc"] for r in rows
             if r["task"] == "near-ood" and r["method"] == "mcd" and r["norm"] == "batch" and r["selection"] == "ood-labels"}
    result = {}
    for split in "abc":
        for protocol in ("transductive", "disjoint"):
            d = np.array([auroc[(split, protocol, "concat", s)] - auroc[(split, protocol, "separate", s)] for s in range(5)])
            half = sps.t.ppf(0.975, 4) * d.std(ddof=1) / np.sqrt(5)
            result[(split, protocol)] = (100 * d.mean(), 100 * half, sps.ttest_1samp(d, 0).pvalue)
    assert [round(result[(s, "disjoint")][0], 2) for s in "abc"] == [3.72, -0.49, 0.32]
    assert [round(result[(s, "transductive")][0], 2) for s in "abc"] == [3.23, 0.22, 0.06]
    mean, half, p = result[("a", "disjoint")]
    assert mean - half > 0 and round(half, 2) == 2.39 and round(p, 3) == 0.012
    assert all(abs(result[(s, pr)][0]) < result[(s, pr)][1] for s in "bc" for pr in ("transductive", "disjoint"))


# ---- pre-registered endpoints -------------------------------------------------------------------------

def holm(p):
    """Holm's step-down adjustment written out: the i-th smallest p times (m - i), kept monotone, capped at 1."""
    order, out, running = sorted(range(len(p)), key=lambda i: p[i]), [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def test_the_hand_holm_on_a_worked_example():
    # p sorted: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06), 0.5 (x1); in the order given
    assert holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06], abs=1e-15)
    assert holm([0.4, 0.3]) == pytest.approx([0.6, 0.6], abs=1e-15)  # 0.3 x 2 = 0.6; 0.4 x 1 = 0.4, raised to 0.6 (monotone)


def _sign_p_by_hand(k, n):
    """Exact two-sided sign test: 2 min(P(X <= k), P(X >= k)) for X ~ Binomial(n, 1/2), at most 1."""
    lower, upper = (sum(math.comb(n, i) for i in rng) / 2 ** n for rng in (range(k + 1), range(k, n + 1)))
    return min(1.0, 2 * min(lower, upper))


def _tost_p_by_hand(d, margin):
    """Two one-sided t-tests of mean(d) > -margin and mean(d) < margin: the larger of their p-values."""
    se, df = np.std(d, ddof=1) / np.sqrt(len(d)), len(d) - 1
    return max(st.t.sf((np.mean(d) + margin) / se, df), st.t.cdf((np.mean(d) - margin) / se, df))


def test_endpoint_tests_primary_unadjusted_secondaries_holm_sign_test_by_hand():
    rng, rows = np.random.RandomState(0), []
    base = dict(task="near-ood", class_split="a", protocol="disjoint", selection="last-epoch", method="mcd", norm="batch")
    for seed in range(8):
        for s, shift in (("separate", 0.0), ("concat", 0.02), ("frozen-bn", 0.0)):
            for stats_, extra in (("running", 0.0), ("recalibrated", -0.01)):
                rows.append({**base, "strategy": s, "seed": seed, "eval_stats": stats_,
                             "auroc": 0.8 + shift + extra + rng.normal(0, 0.01), "fpr95": 0.3 + rng.normal(0, 0.02)})
    rows.append({**base, "method": "msp", "strategy": None, "seed": 0, "eval_stats": "running", "auroc": 0.7})  # ignored
    ends = [("concat", "separate", "auroc", "running"), ("concat", "separate", "auroc", "recalibrated"),
            ("concat", "separate", "fpr95", "running"), ("separate", "frozen-bn", "auroc", "running")]
    out = endpoint_tests(rows, ends)
    assert [d["role"] for d in out] == ["primary"] + ["secondary"] * 3
    for d, (a, b, metric, stats_) in zip(out, ends):
        xa, xb = ([r[metric] for r in rows if r["strategy"] == s and r["eval_stats"] == stats_] for s in (a, b))
        diffs = np.subtract(xa, xb)
        assert d["diffs"] == pytest.approx(diffs, abs=1e-15) and d["p_value"] == pytest.approx(p_by_hand(diffs), rel=1e-9)
        assert d["sign_p"] == pytest.approx(_sign_p_by_hand(int((diffs > 0).sum()), len(diffs)), rel=1e-12)
        assert d["tost_p"] == pytest.approx(_tost_p_by_hand(diffs, 0.01), rel=1e-9)
    assert out[0]["tost_p"] > 0.5  # a 2 pp effect is not within ±1 pp
    null = [{**base, "strategy": s, "seed": i, "eval_stats": "running", "auroc": 0.8 + (0.002 * (i % 2) if s == "concat" else 0)}
            for s in ("concat", "separate") for i in range(6)]  # differences 0, 0.2 pp, 0, ...: within ±1 pp
    d0 = endpoint_tests(null, ends[:1])[0]
    assert d0["tost_p"] == pytest.approx(_tost_p_by_hand(np.array(d0["diffs"]), 0.01), rel=1e-9) and d0["tost_p"] < 1e-5
    assert out[0]["holm_p"] == out[0]["p_value"]
    assert [d["holm_p"] for d in out[1:]] == pytest.approx(holm([d["p_value"] for d in out[1:]]), rel=1e-12)
    with pytest.raises(ValueError, match=r"endpoint concat-both - separate \(auroc, running statistics\) has no paired rows"):
        endpoint_tests(rows, [("concat-both", "separate", "auroc", "running")])


def test_an_endpoint_of_equal_differences_takes_the_sign_tests_p_into_holm():
    base = dict(task="near-ood", class_split="a", protocol="disjoint", selection="last-epoch", method="mcd", norm="batch",
                eval_stats="running")
    rows = [{**base, "strategy": s, "seed": i, "auroc": 0.8 + (0.01 if s == "concat" else 0.0) + 0.001 * i, "fpr95": 0.3}
            for s in ("concat", "separate") for i in range(2)]
    out = endpoint_tests(rows, [("concat", "separate", "auroc", "running"), ("concat", "separate", "fpr95", "running"),
                                ("concat", "separate", "auroc", "running")])
    assert math.isnan(out[1]["p_value"]) and math.isnan(out[1]["sign_p"])  # all fpr95 differences 0
    assert out[2]["sign_p"] == 0.5 and out[2]["diffs"] == pytest.approx([0.01, 0.01])  # 2 of 2 positive: p = 2 / 4
    assert [d["holm_p"] for d in out[1:]] == pytest.approx(holm([1.0, 0.5]))  # not 0: the sign test's p


def split_rows(k=8, n=3, tau=0.03, sigma=0.02, seed=0):
    """Balanced rows of concat, separate and MSP over ``k`` splits x ``n`` seeds: concat - separate = 0.05 + u_i + e_ij."""
    rng, rows = np.random.default_rng(seed), []
    common = dict(task="near-ood", protocol="disjoint", selection="last-epoch", norm="batch", ood_dataset="heldout")
    for i in range(k):
        u = rng.normal(0, tau)
        for j in range(n):
            base = rng.uniform(0.8, 0.9)
            for method, strategy, auroc in (("mcd", "concat", base + 0.05 + u + rng.normal(0, sigma)),
                                            ("mcd", "separate", base), ("msp", None, 0.6 + 0.01 * i + 0.003 * j)):
                rows.append({**common, "class_split": f"s{i}", "seed": j, "method": method, "strategy": strategy,
                             "auroc": auroc, **dict.fromkeys(("fpr95", "aupr_in", "aupr_out", "id_accuracy"), 0.5)})
    return rows


def anova(rows, k, n):
    """The balanced one-way random-effects ANOVA by hand: D (k, n), mean, tau, sigma, se(mean)."""
    get = lambda i, s: [r["auroc"] for r in rows if (r["class_split"], r["strategy"]) == (f"s{i}", s)]  # noqa: E731
    d = np.array([np.subtract(get(i, "concat"), get(i, "separate")) for i in range(k)])
    m = d.mean(1)
    msb, msw = n * m.var(ddof=1), ((d - m[:, None]) ** 2).sum() / (k * (n - 1))
    return d, d.mean(), np.sqrt(max(msb - msw, 0) / n), np.sqrt(msw), np.sqrt(msb / (k * n))


@pytest.mark.filterwarnings("ignore:The MLE may be on the boundary")  # statsmodels' optimiser note
def test_split_effects_equal_the_balanced_anova_and_the_pooled_split_means():
    from mcd_helpers.stats import split_effects
    rows, k, n = split_rows(), 8, 3
    d, mean, tau, sigma, se = anova(rows, k, n)
    out = split_effects(rows)
    assert (out["k"], out["n"]) == (k, k * n)
    assert out["mean"] == pytest.approx(mean, rel=1e-9)
    assert (out["tau"], out["sigma"], out["se"]) == pytest.approx((tau, sigma, se), rel=1e-12)
    assert out["high"] - out["mean"] == pytest.approx(st.t.ppf(0.975, k - 1) * se, rel=1e-12)
    assert out["pi_high"] - out["mean"] == pytest.approx(st.t.ppf(0.975, k - 2) * np.hypot(tau, se), rel=1e-12)
    # the same REML by statsmodels' optimiser (converged on this draw), the closed form's independent check
    from statsmodels.regression.mixed_linear_model import MixedLM
    fit = MixedLM(d.ravel(), np.ones((d.size, 1)), np.repeat(np.arange(k), n)).fit(reml=True)
    assert fit.converged and (np.sqrt(np.asarray(fit.cov_re)[0, 0]), fit.bse_fe[0]) == pytest.approx((tau, se), rel=1e-4)
    assert [s["mean"] for s in out["splits"]] == pytest.approx(d.mean(1), rel=1e-12)
    slope, intercept = np.polyfit([s["covariate"] for s in out["splits"]], d.mean(1), 1)
    assert out["slope"] == pytest.approx(slope, rel=1e-9)
    assert out["splits"][2]["covariate"] == pytest.approx(0.62 + 0.003, rel=1e-12)  # MSP mean over seeds 0, 1, 2
    # the report's pooled pair (split as the block) is the same mean and interval: t_{k-1} sd(split means) / sqrt(k)
    pooled = next(p for p in benchmark_tables(rows, "near-ood")[1] if p["class_split"] == "all" and p["metric"] == "auroc")
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx((out["mean"], out["high"] - out["mean"]), rel=1e-12)
    half = st.t.ppf(0.975, k - 1) * se  # the report's line, from the ANOVA by hand
    line = (f"| disjoint | last-epoch | concat − separate | {k} | {k * n} | {100 * mean:+.2f} [{100 * (mean - half):+.2f}, "
            f"{100 * (mean + half):+.2f}] | {100 * tau:.2f} | {100 * sigma:.2f} |")
    assert any(x.startswith(line) for x in summary_text(rows).splitlines())
    assert "## Class split as a random effect" not in summary_text(bench_rows())  # two splits: no random effect


def test_split_effects_at_no_split_effect_and_bad_input():
    from mcd_helpers.stats import split_effects
    rows = split_rows(k=6, n=4, tau=0.0, sigma=0.02, seed=1)
    _, mean, tau, _, _ = anova(rows, 6, 4)
    assert tau == 0  # this draw's between-split mean square is below the within one: tau on the boundary
    out = split_effects(rows)
    d = anova(rows, 6, 4)[0]  # tau = 0: the 24 pairs are i.i.d., their variance with N - 1 and se = sigma / sqrt(N)
    assert out["tau"] == 0 and out["mean"] == pytest.approx(mean, rel=1e-12)
    assert (out["sigma"], out["se"]) == pytest.approx((d.std(ddof=1), d.std(ddof=1) / np.sqrt(24)), rel=1e-12)
    with pytest.raises(ValueError, match="at least 3 class splits"):
        split_effects([r for r in rows if r["class_split"] in ("s0", "s1")])
    with pytest.raises(ValueError, match="one task, protocol and selection"):
        split_effects(rows + [{**r, "protocol": "transductive"} for r in rows])
    with pytest.raises(ValueError, match="run more seeds"):  # one seed: no within-split variance
        split_effects([r for r in rows if r["seed"] == 0])
    far_msp = [{**r, "task": "far-ood", "auroc": 0.99} for r in rows if r["method"] == "msp"]
    assert split_effects(rows + far_msp)["slope"] == out["slope"]  # the covariate from the same task only


def test_split_effects_refuses_splits_with_different_numbers_of_seeds():
    from mcd_helpers.stats import split_effects
    rows = [r for r in split_rows(k=8, n=4, tau=0.03, seed=2) if not (r["class_split"] in ("s1", "s5") and r["seed"] == 3)]
    with pytest.raises(ValueError, match=r"same number of seeds in every class split, got \{'s0': 4, 's1': 3, "):
        split_effects(rows)


def test_an_arm_of_one_class_split_is_left_out_of_the_pooled_split_means():
    rows = bench_rows(far=False)
    extra = [{**r, "strategy": "frozen-bn"} for r in rows if r["class_split"] == "a" and r["strategy"] == "separate"]
    pooled = pooled_summary(rows + extra)  # frozen-bn ran on split a only: nothing to pool over splits
    assert {g["strategy"] for g in pooled} == {"concat", "separate", None}
    assert pooled == pooled_summary(rows)
