"""Notebook 07's claims about the committed full benchmark (benchmarks/results/near-ood/), each
recomputed here from results.json with NumPy and SciPy alone. (Only the check that the committed
summary.md is the report of results.json uses mcd_helpers.experiments.report.)"""
import json
from pathlib import Path

import numpy as np
from scipy import stats

from mcd_helpers.data.nearood import PROTOCOLS, SELECTIONS
from mcd_helpers.experiments.benchmark import BENCHMARK_PRESETS
from mcd_helpers.experiments.report import summary_text

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "near-ood"
ROWS = json.loads((RESULTS / "results.json").read_text())
NEAR = [r for r in ROWS if r["task"] == "near-ood"]


def values(metric="auroc", **fields) -> dict:
    """{(class_split, seed): value} of the near-OOD rows whose fields equal ``fields``."""
    fields = {"selection": "ood-labels", "norm": "batch", **fields}
    out = {}
    for r in NEAR:
        if all(r[k] == v for k, v in fields.items()):
            key = (r["class_split"], r["seed"])
            assert key not in out, (fields, key)
            out[key] = r[metric]
    return out


def ci(x) -> tuple[float, float, float]:
    """Mean and the 95% Student-t interval, in percent."""
    x = 100 * np.asarray(x, dtype=np.float64)
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return x.mean(), x.mean() - half, x.mean() + half


def mean(d: dict) -> float:
    """Mean of a :func:`values` dict, in percent."""
    return ci(list(d.values()))[0]


def p_paired(a: dict, b: dict) -> float:
    """Two-sided paired t-test of two :func:`values` dicts over the same (split, seed) keys."""
    assert a.keys() == b.keys()
    return stats.ttest_rel([a[k] for k in sorted(a)], [b[k] for k in sorted(a)]).pvalue


def paired(a: dict, b: dict) -> tuple[float, float, float]:
    assert a.keys() == b.keys() and len(a) == 15, (len(a), len(b))
    return ci([a[k] - b[k] for k in sorted(a)])


def test_the_committed_grid_is_complete():
    p = BENCHMARK_PRESETS["near-ood"]
    seeds = {r["seed"] for r in ROWS}
    assert seeds == set(range(5)) and {r["class_split"] for r in NEAR} == set(p.class_splits)
    want = {(pr, sel, m, None, "batch") for pr in PROTOCOLS for sel in SELECTIONS for m in ("msp", "odin", "energy")}
    want |= {(pr, sel, "mcd", s, "batch") for pr in PROTOCOLS for sel in SELECTIONS for s in p.strategies}
    want |= {(pr, sel, "mcd", s, "group") for pr in PROTOCOLS for sel in SELECTIONS for s in p.reference}
    got = {}
    for r in NEAR:
        got.setdefault((r["protocol"], r["selection"], r["method"], r["strategy"], r["norm"]), set()).add(
            (r["class_split"], r["seed"]))
    assert set(got) == want and all(len(v) == 15 for v in got.values())
    assert all(0 <= r[k] <= 1 for r in ROWS for k in ("auroc", "fpr95", "id_accuracy"))
    far = {r["ood_dataset"] for r in ROWS if r["task"] == "far-ood"}
    assert far == set(p.far_ood)


def test_the_committed_summary_is_the_results_summary():
    run = json.loads((RESULTS / "run.json").read_text())
    p = BENCHMARK_PRESETS["near-ood"]
    text = summary_text(ROWS, f"Benchmark near-ood: {p.about}", run["seconds"])
    assert (RESULTS / "summary.md").read_text() == text
    assert json.loads((RESULTS / "config.json").read_text())["preset"] == "near-ood"


def mcd(protocol, strategy="separate", metric="auroc", **kw):
    return values(metric, protocol=protocol, method="mcd", strategy=strategy, **kw)


def baseline(protocol, method, metric="auroc"):
    return values(metric, protocol=protocol, method=method)


def test_nothing_at_the_ceiling_and_mcd_far_above_the_baselines_unless_unseen_ood():
    assert max(r["auroc"] for r in NEAR) < 0.99
    for protocol in ("transductive", "disjoint"):
        best = max(mean(baseline(protocol, m)) for m in ("msp", "odin", "energy"))
        assert best == mean(baseline(protocol, "msp"))
        for s in ("separate", "concat", "split-bn", "recalibrate"):
            assert ci(list(mcd(protocol, s).values()))[1] > best + 15
    gap = mean(mcd("unseen-ood")) - mean(baseline("unseen-ood", "msp"))
    assert abs(gap) < 2


def test_what_flatters_mcd_is_the_source_of_its_unlabeled_ood():
    seen = paired(mcd("transductive"), mcd("disjoint"))
    assert seen[1] < 0 < seen[2] < 2.5
    assert paired(baseline("transductive", "msp"), baseline("disjoint", "msp"))[1] > 0
    for kw in ({"strategy": "separate"}, {"strategy": "concat"}, {"strategy": "separate", "norm": "group"}):
        assert paired(mcd("disjoint", **kw), mcd("unseen-ood", **kw))[1] > 10


def test_model_selection_with_ood_labels_adds_little():
    t = paired(mcd("transductive"), mcd("transductive", selection="last-epoch"))
    assert t[1] < 0 < t[2]
    d, d_last = mcd("disjoint"), mcd("disjoint", selection="last-epoch")
    assert len(d) == 15 and d == d_last  # the best validation epoch was the last: the same model


def test_concat_ahead_in_the_mean_not_resolved_at_95_and_the_groupnorm_control_flat():
    for protocol in PROTOCOLS:
        m, low, high = paired(mcd(protocol, "concat"), mcd(protocol))
        assert m > 0 > low
        m, low, high = paired(mcd(protocol, "concat", norm="group"), mcd(protocol, norm="group"))
        assert abs(m) < 0.01 and high - m < 0.05
    assert paired(mcd("disjoint", "concat", "fpr95"), mcd("disjoint", metric="fpr95"))[2] < 0


def test_the_strategy_matters_on_split_a():
    a = {k: v for k, v in mcd("disjoint", "concat").items() if k[0] == "a"}
    b = {k: v for k, v in mcd("disjoint").items() if k[0] == "a"}
    diffs = [a[k] - b[k] for k in sorted(a)]
    assert len(diffs) == 5 and min(diffs) > 0 and ci(diffs)[1] > 0
    cc, cs = mcd("unseen-ood", "concat"), mcd("unseen-ood")
    assert cc.keys() == cs.keys()
    c = [cc[k] - cs[k] for k in sorted(cc) if k[0] == "c"]
    assert len(c) == 5 and max(c) < 0 and ci(c)[2] < 0


def test_recalibration_raises_id_accuracy_and_remedies_help_only_under_unseen_ood():
    for protocol in PROTOCOLS:
        assert paired(mcd(protocol, "recalibrate", "id_accuracy"), mcd(protocol, metric="id_accuracy"))[1] > 0
    for s in ("split-bn", "recalibrate"):
        assert paired(mcd("unseen-ood", s), mcd("unseen-ood"))[1] > 0
        for protocol in ("transductive", "disjoint"):
            _, low, high = paired(mcd(protocol, s), mcd(protocol))
            assert low < 0 < high


def test_far_rows_at_the_ceiling_except_digits():
    far = [r for r in ROWS if r["task"] == "far-ood" and r["selection"] == "ood-labels"]

    def of(ood, method, strategy=None):
        return {r["seed"]: r["auroc"] for r in far if r["ood_dataset"] == ood and r["method"] == method
                and r["strategy"] == strategy}
    for ood in ("photo_crops", "gaussian"):
        for s in ("separate", "concat"):
            assert mean(of(ood, "mcd", s)) > 99
        c, s_ = of(ood, "mcd", "concat"), of(ood, "mcd", "separate")
        _, low, high = ci([c[k] - s_[k] for k in sorted(c)])
        assert low < 0 < high
    c, s_ = of("digits", "mcd", "concat"), of("digits", "mcd", "separate")
    assert ci([c[k] - s_[k] for k in sorted(c)])[1] > 0
    assert mean(of("digits", "energy")) > mean(c)


def test_on_split_a_unseen_ood_mcd_falls_below_msp_to_chance():
    a = lambda d: [v for k, v in sorted(d.items()) if k[0] == "a"]
    m, low, high = ci(a(mcd("unseen-ood")))
    assert high < ci(a(baseline("unseen-ood", "msp")))[1] and abs(m - 50) < 1.5


def pooled_means() -> list[float]:
    groups = {}
    for r in NEAR:
        groups.setdefault((r["protocol"], r["selection"], r["method"], r["strategy"], r["norm"]), []).append(r["auroc"])
    return [100 * np.mean(v) for v in groups.values()]


def test_the_best_cell_and_the_id_accuracy_of_every_batchnorm_strategy():
    assert 86 < max(pooled_means()) < 86.5
    for protocol in PROTOCOLS:
        pre = mean(baseline(protocol, "msp", "id_accuracy"))
        accs = {s: mean(mcd(protocol, s, "id_accuracy"))
                for s in ("separate", "concat", "split-bn", "recalibrate")}
        assert all(0.2 < pre - a < 1.2 for a in accs.values())
        assert accs["separate"] < accs["recalibrate"] < pre
        assert 4.4 < accs["separate"] - mean(mcd(protocol, metric="id_accuracy", norm="group")) < 5.5
    assert paired(mcd("transductive", "concat", "id_accuracy"), mcd("transductive", metric="id_accuracy"))[1] > 0


def test_per_split_differences_and_their_p_values():
    ps = []
    for split in ("a", "b", "c"):
        for protocol in PROTOCOLS:
            a = {k: v for k, v in mcd(protocol, "concat").items() if k[0] == split}
            b = {k: v for k, v in mcd(protocol).items() if k[0] == split}
            assert a.keys() == b.keys() and len(a) == 5
            d = 100 * np.array([a[k] - b[k] for k in sorted(a)])
            ps.append(p_paired(a, b))
            if split in ("b", "c") and protocol != "unseen-ood":
                assert -0.6 < d.mean() < 0.6
    assert 0.05 / 9 < min(ps) < 0.05  # none survives a Bonferroni correction over the nine


def test_remedies_under_unseen_ood_have_p_below_0_001_and_the_leads_beside_openood():
    for s in ("split-bn", "recalibrate"):
        assert p_paired(mcd("unseen-ood", s), mcd("unseen-ood")) < 0.001
    lead = lambda p: mean(mcd(p)) - mean(baseline(p, "msp"))
    assert round(lead("disjoint")) == 20 and round(lead("unseen-ood")) == 1
