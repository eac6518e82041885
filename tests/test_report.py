"""mcd_helpers.experiments.report: the benchmark's tables and summary, whose numbers are recomputed
here from the rows."""

import matplotlib
import numpy as np
import pytest
from scipy import stats as st
from test_significance import anova, by_scipy, p_by_hand, pct, split_rows

from mcd_helpers.experiments.report import (
    benchmark_tables,
    method_label,
    pivot_markdown,
    pooled_summary,
    setting_differences,
    summary_text,
    write_report,
)

matplotlib.use("Agg")


# ---- report: the small tables --------------------------------------------------------------------


@pytest.mark.parametrize(
    "g, label",
    [
        ({"method": "msp"}, "MSP (pre-trained)"),
        ({"method": "odin"}, "ODIN (pre-trained)"),
        ({"method": "energy", "strategy": None}, "energy (pre-trained)"),
        ({"method": "mcd", "strategy": "concat"}, "MCD concat"),
        ({"method": "mcd", "strategy": "separate", "norm": "group"}, "MCD separate (GroupNorm)"),
    ],
)
def test_method_label(g, label):
    assert method_label(g) == label


# ---- report: the benchmark -----------------------------------------------------------------------


def bench_rows(far=True):
    """Near-OOD: splits a, b x protocols (disjoint first) x seeds 0-2 x MCD concat/separate and MSP;
    far-OOD: split a, OOD sets digits and uniform, MCD concat/separate. Metrics drawn at random."""
    rng, rows = np.random.RandomState(1), []
    near = [("near-ood", s, p, "heldout") for s in "ab" for p in ("disjoint", "transductive")]
    for task, split, protocol, ood in near + (
        [("far-ood", "a", "transductive", o) for o in ("digits", "uniform")] if far else []
    ):
        for seed in range(3):
            for method, strategy in [("mcd", "concat"), ("mcd", "separate"), ("msp", None)][
                : 3 if task == "near-ood" else 2
            ]:
                a, f, acc, pi, po = (
                    rng.uniform(0.6, 0.99),
                    rng.uniform(0.05, 0.6),
                    *rng.uniform(0.85, 0.95, 3),
                )
                rows.append(
                    {
                        "task": task,
                        "class_split": split,
                        "protocol": protocol,
                        "selection": "ood-labels",
                        "method": method,
                        "strategy": strategy,
                        "seed": seed,
                        "ood_dataset": ood,
                        "norm": "batch",
                        "auroc": a,
                        "fpr95": f,
                        "aupr_in": pi,
                        "aupr_out": po,
                        "id_accuracy": acc,
                    }
                )
    return rows


def values(rows, metric="auroc", **match):
    return [r[metric] for r in rows if all(r[k] == v for k, v in match.items())]


def diffs(rows, metric="auroc", a="concat", b="separate", field="strategy", **match):
    xa, xb = (
        values(rows, metric, **match, **{field: a}),
        values(rows, metric, **match, **{field: b}),
    )
    return np.subtract(xa, xb)  # rows are in seed order


def test_benchmark_tables_summary_pairs_and_pooled_pairs():
    rows = bench_rows()
    summary, paired = benchmark_tables(rows, "near-ood")
    assert len(summary) == 2 * 2 * 3 and all(
        g["n"] == 3 and g["task"] == "near-ood" for g in summary
    )
    for g in summary:
        match = {k: g[k] for k in ("class_split", "protocol", "method", "strategy")}
        assert g["fpr95"]["mean"] == pytest.approx(
            np.mean(values(rows, "fpr95", task="near-ood", **match)), rel=1e-12
        )
    assert {(d["class_split"], d["metric"]) for d in paired} == {
        (s, m)
        for s in ("a", "b", "all")
        for m in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")
    }
    assert len(paired) == 3 * 2 * 5 and all(
        (d["a"], d["b"], d["method"]) == ("concat", "separate", "mcd") for d in paired
    )
    d = next(
        d
        for d in paired
        if (d["class_split"], d["protocol"], d["metric"]) == ("b", "transductive", "id_accuracy")
    )
    assert d["diffs"] == pytest.approx(
        diffs(rows, "id_accuracy", task="near-ood", class_split="b", protocol="transductive")
    )
    pooled = next(
        d
        for d in paired
        if (d["class_split"], d["protocol"], d["metric"]) == ("all", "disjoint", "auroc")
    )
    # split as the block: one pair per split, its mean over seeds (the seeds are not independent
    # replicates of a split)
    want = [diffs(rows, class_split=s, protocol="disjoint").mean() for s in "ab"]
    assert pooled["seeds"] == ["a", "b"] and pooled["n"] == 2
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx(by_scipy(want), rel=1e-10)
    _, far_pairs = benchmark_tables(rows, "far-ood")  # one split: nothing pooled
    assert {d["class_split"] for d in far_pairs} == {"a"} and len(far_pairs) == 2 * 5


def test_setting_differences_pair_protocols_by_seed_and_split():
    rows = bench_rows(far=False)
    out = setting_differences(rows, "protocol", "disjoint", "transductive", "fpr95")
    assert [(d["class_split"], d["method"], d["arm"]) for d in out] == [
        (s, m, arm)
        for s in ("a", "b", "all")
        for m, arm in (("mcd", "concat"), ("mcd", "separate"), ("msp", "-"))
    ]
    d = next(d for d in out if (d["class_split"], d["arm"]) == ("b", "-"))
    assert d["diffs"] == pytest.approx(
        diffs(rows, "fpr95", "disjoint", "transductive", "protocol", class_split="b", method="msp")
    )
    pooled = next(d for d in out if (d["class_split"], d["arm"]) == ("all", "concat"))
    want = [
        diffs(
            rows, "fpr95", "disjoint", "transductive", "protocol", class_split=s, strategy="concat"
        ).mean()
        for s in "ab"
    ]
    assert pooled["seeds"] == ["a", "b"] and pooled["metric"] == "fpr95"
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx(by_scipy(want), rel=1e-10)
    with pytest.raises(ValueError, match="field.*'protocol'.*'selection'.*'norm'"):
        setting_differences(rows, "norm", "batch", "group")


def test_pooled_summary_and_pivot():
    rows = [
        r
        for r in bench_rows(far=False)
        if not (r["method"] == "msp" and r["protocol"] == "disjoint")
    ]
    pooled = pooled_summary(rows)
    assert len(pooled) == 5 and all("class_split" not in g for g in pooled)
    split_mean = lambda **m: [np.mean(values(rows, class_split=s, **m)) for s in "ab"]  # noqa: E731  a value per split
    for g in pooled:
        v = split_mean(protocol=g["protocol"], method=g["method"], strategy=g["strategy"])
        assert g["n"] == len(v) == 2 and g["auroc"]["mean"] == pytest.approx(np.mean(v), rel=1e-12)
        assert g["auroc"]["half_width"] == pytest.approx(by_scipy(v)[1], rel=1e-10)
    lines = pivot_markdown(pooled).splitlines()
    # PROTOCOLS order
    assert lines[0] == "| method | n | transductive: AUROC (%) | disjoint: AUROC (%) |"
    cells = {
        p: pct(split_mean(protocol=p, strategy="concat")) for p in ("transductive", "disjoint")
    }
    assert f"| MCD concat | 2 | {cells['transductive']} | {cells['disjoint']} |" in lines
    assert (
        f"| MSP (pre-trained) | 2 | {pct(split_mean(protocol='transductive', method='msp'))} | - |"
        in lines
    )
    assert pivot_markdown(pooled, selection="last-epoch").splitlines()[2:] == []


def test_summary_text_numbers_are_the_rows_means():
    rows = bench_rows()
    text = summary_text(rows, "My run", seconds=150)
    lines = text.splitlines()
    assert lines[0] == "# My run" and lines[2].startswith(f"{len(rows)} rows, seeds [0, 1, 2].")
    assert "Wall time of this run: 2.5 min" in text
    near, far = (
        text.index("## Near-OOD: held-out classes"),
        text.index("## Far-OOD rows (transductive)"),
    )
    assert (
        near < far
        and "Class splits a, b; OOD: heldout." in text
        and "Class splits a; OOD: digits, uniform." in text
    )
    m = dict(task="near-ood", class_split="b", protocol="transductive", strategy="separate")
    want = (
        "| b | transductive | MCD separate | 3 | "
        + " | ".join(
            pct(values(rows, k, **m))
            for k in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")
        )
        + " |"
    )
    assert want in lines and lines.index(want) < lines.index("### Paired differences")
    m = dict(task="far-ood", ood_dataset="uniform")
    want = (
        f"| uniform | transductive | MCD concat | 3 | {pct(values(rows, strategy='concat', **m))} |"
    )
    assert any(
        line.startswith(want) for line in lines[lines.index("## Far-OOD rows (transductive)") :]
    )
    # a pair per split: its mean over seeds
    d = {
        k: [
            diffs(rows, k, task="near-ood", class_split=s, protocol="disjoint").mean() for s in "ab"
        ]
        for k in ("auroc", "fpr95", "aupr_in", "aupr_out", "id_accuracy")
    }
    want = (
        "| all | disjoint | ood-labels | BatchNorm | concat − separate | 2 | "
        + " | ".join(pct(v, True) for v in d.values())
        + f" | {p_by_hand(d['auroc']):.2g} |"
    )
    assert want in lines


def test_write_report(tmp_path):
    import matplotlib.image

    rows = bench_rows()
    write_report(rows, tmp_path / "near", "Bench")
    assert sorted(p.name for p in (tmp_path / "near").iterdir()) == [
        "by_protocol.png",
        "forest.png",
        "summary.md",
    ]
    text = (tmp_path / "near" / "summary.md").read_text()
    m = dict(task="near-ood", class_split="a", protocol="disjoint", method="msp")
    assert (
        text.startswith("# Bench\n")
        and f"| a | disjoint | MSP (pre-trained) | 3 | {pct(values(rows, **m))} |" in text
    )
    # forest: the two pooled MCD AUROC differences, 9.0 x (1.4 + 0.35 * 2) inches at 100 dpi; by
    # protocol: a panel per class split, 2 x 4.6 x 3.6 inches
    assert matplotlib.image.imread(tmp_path / "near" / "forest.png").shape[:2] == (210, 900)
    assert matplotlib.image.imread(tmp_path / "near" / "by_protocol.png").shape[:2] == (360, 920)
    write_report([r for r in rows if r["task"] == "far-ood"], tmp_path / "far")
    assert [p.name for p in (tmp_path / "far").iterdir()] == ["summary.md"]


@pytest.mark.filterwarnings("ignore:The MLE may be on the boundary")  # statsmodels' optimiser note
def test_split_effects_equal_the_balanced_anova_and_the_pooled_split_means():
    from mcd_helpers.experiments.significance import split_effects

    rows, k, n = split_rows(), 8, 3
    d, mean, tau, sigma, se = anova(rows, k, n)
    out = split_effects(rows)
    assert (out["k"], out["n"]) == (k, k * n)
    assert out["mean"] == pytest.approx(mean, rel=1e-9)
    assert (out["tau"], out["sigma"], out["se"]) == pytest.approx((tau, sigma, se), rel=1e-12)
    assert out["high"] - out["mean"] == pytest.approx(st.t.ppf(0.975, k - 1) * se, rel=1e-12)
    assert out["pi_high"] - out["mean"] == pytest.approx(
        st.t.ppf(0.975, k - 2) * np.hypot(tau, se), rel=1e-12
    )
    # the same REML by statsmodels' optimiser (converged on this draw), the closed form's
    # independent check
    from statsmodels.regression.mixed_linear_model import MixedLM

    fit = MixedLM(d.ravel(), np.ones((d.size, 1)), np.repeat(np.arange(k), n)).fit(reml=True)
    assert fit.converged and (
        np.sqrt(np.asarray(fit.cov_re)[0, 0]),
        fit.bse_fe[0],
    ) == pytest.approx((tau, se), rel=1e-4)
    assert [s["mean"] for s in out["splits"]] == pytest.approx(d.mean(1), rel=1e-12)
    slope, intercept = np.polyfit([s["covariate"] for s in out["splits"]], d.mean(1), 1)
    assert out["slope"] == pytest.approx(slope, rel=1e-9)
    # MSP mean over seeds 0, 1, 2
    assert out["splits"][2]["covariate"] == pytest.approx(0.62 + 0.003, rel=1e-12)
    # the report's pooled pair (split as the block) is the same mean and interval: t_{k-1} sd(split
    # means) / sqrt(k)
    pooled = next(
        p
        for p in benchmark_tables(rows, "near-ood")[1]
        if p["class_split"] == "all" and p["metric"] == "auroc"
    )
    assert (pooled["mean"], pooled["half_width"]) == pytest.approx(
        (out["mean"], out["high"] - out["mean"]), rel=1e-12
    )
    half = st.t.ppf(0.975, k - 1) * se  # the report's line, from the ANOVA by hand
    line = (
        f"| disjoint | last-epoch | concat − separate | {k} | {k * n} | {100 * mean:+.2f} "
        f"[{100 * (mean - half):+.2f}, "
        f"{100 * (mean + half):+.2f}] | {100 * tau:.2f} [{100 * out['tau_low']:.2f}, "
        f"{100 * out['tau_high']:.2f}]; p {out['tau_p']:.2g} | {100 * sigma:.2f} |"
    )
    assert any(x.startswith(line) for x in summary_text(rows).splitlines())
    # two splits: no random effect
    assert "## Class split as a random effect" not in summary_text(bench_rows())


def test_an_arm_of_one_class_split_is_left_out_of_the_pooled_split_means():
    rows = bench_rows(far=False)
    extra = [
        {**r, "strategy": "eval-bn"}
        for r in rows
        if r["class_split"] == "a" and r["strategy"] == "separate"
    ]
    # eval-bn ran on split a only: nothing to pool over splits
    pooled = pooled_summary(rows + extra)
    assert {g["strategy"] for g in pooled} == {"concat", "separate", None}
    assert pooled == pooled_summary(rows)
