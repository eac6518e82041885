"""mcd_helpers.experiments.significance (intervals, paired differences, endpoints, split effects)
against hand computations and other scipy routines."""

import math
import re

import matplotlib
import numpy as np
import pytest
from scipy import optimize
from scipy import stats as st

from mcd_helpers.experiments.significance import (
    endpoint_tests,
    mean_ci,
    paired_differences,
    summarize,
)

matplotlib.use("Agg")

# any t table
T975_DF4, T975_DF2, T95_DF4 = (2.7764451051977934, 4.302652729749462, 2.1318467863266495)


def by_scipy(values, confidence=0.95):
    """Mean and half-width from scipy's interval routine (the package uses the quantile function
    instead)."""
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
    assert mean_ci([1, 2, 3, 4, 5]) == pytest.approx(
        {"mean": 3.0, "low": 3 - half, "high": 3 + half, "half_width": half, "n": 5}, rel=1e-12
    )
    assert mean_ci(np.array([5, 1, 4, 2, 3]), 0.90)["half_width"] == pytest.approx(
        T95_DF4 * math.sqrt(2.5 / 5), rel=1e-12
    )
    assert mean_ci([0.7, 0.7, 0.7])["half_width"] == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("n, confidence", [(2, 0.95), (5, 0.99), (12, 0.8)])
def test_mean_ci_against_scipys_interval(n, confidence):
    x = np.random.RandomState(n).uniform(0.6, 0.99, n)
    ci, (m, h) = mean_ci(x, confidence), by_scipy(x, confidence)
    assert (ci["mean"], ci["half_width"], ci["low"], ci["high"]) == pytest.approx(
        (m, h, m - h, m + h), rel=1e-10
    )


@pytest.mark.parametrize(
    "values, kw, match",
    [
        ([0.5], {}, r"\b2 values\b.*\b1\b"),
        ([], {}, r"\b2 values\b.*\b0\b"),
        (
            [0.5, 0.6, float("nan")],
            {},
            r"\b1 NaN.*index 2\b",
        ),
        ([float("inf"), 0.6, float("nan")], {}, r"\b2 NaN.*index 0\b"),
        (
            [0.5, 0.6],
            {"confidence": 95},
            r"confidence.*\(0, 1\).*\b95\b.*\b0\.95\b",
        ),
        ([0.5, 0.6], {"confidence": 1.0}, r"confidence.*\(0, 1\).*\b1\.0\.$"),
        ([0.5, 0.6], {"confidence": 0}, r"confidence.*\(0, 1\).*\b0\.$"),
    ],
)
def test_mean_ci_errors(values, kw, match):
    with pytest.raises(ValueError, match=match):
        mean_ci(values, **kw)


# ---- paired differences and summaries ------------------------------------------------------------


def row(strategy, seed, auroc, method="mcd", protocol="disjoint", class_split="a", **kw):
    return {
        "task": "near-ood",
        "class_split": class_split,
        "protocol": protocol,
        "selection": "last-epoch",
        "method": method,
        "strategy": strategy,
        "seed": seed,
        "auroc": auroc,
        **kw,
    }


# diffs by seed: 0.02, -0.01, 0.04
HAND = [row("concat", s, v) for s, v in zip((2, 0, 1), (0.95, 0.90, 0.85))] + [
    row("separate", s, v) for s, v in zip((1, 2, 0), (0.86, 0.91, 0.88))
]
GROUP = (
    "{'task': 'near-ood', 'class_split': 'a', 'protocol': 'disjoint', 'selection': "
    "'last-epoch', 'method': 'mcd'}"
)


def test_paired_differences_by_hand():
    # others ignored
    (d,) = paired_differences(HAND + [row("split-bn", 0, 0.5), row(None, 0, 0.6, method="msp")])
    assert d["seeds"] == [0, 1, 2] and d["diffs"] == pytest.approx([0.02, -0.01, 0.04], abs=1e-12)
    s = math.sqrt(((0.02 - 1 / 60) ** 2 + (-0.01 - 1 / 60) ** 2 + (0.04 - 1 / 60) ** 2) / 2)
    half = T975_DF2 * s / math.sqrt(3)
    assert (d["mean"], d["half_width"], d["low"], d["high"], d["n"]) == pytest.approx(
        (1 / 60, half, 1 / 60 - half, 1 / 60 + half, 3), rel=1e-9
    )
    assert d["p_value"] == pytest.approx(2 * st.t.sf((1 / 60) / (s / math.sqrt(3)), 2), rel=1e-9)
    assert {
        k: d[k]
        for k in ("task", "class_split", "protocol", "selection", "method", "metric", "a", "b")
    } == {
        "task": "near-ood",
        "class_split": "a",
        "protocol": "disjoint",
        "selection": "last-epoch",
        "method": "mcd",
        "metric": "auroc",
        "a": "concat",
        "b": "separate",
    }


def test_paired_differences_on_random_groups_agree_with_the_one_sample_test_and_the_interval():
    rng, rows = np.random.RandomState(0), []
    for protocol in ("unseen-ood", "transductive", "disjoint"):
        for seed in range(6):
            a, b = rng.uniform(0.6, 0.95, 2)
            rows += [
                row("split-bn", seed, a, protocol=protocol, fpr95=1 - a),
                row("separate", seed, b, protocol=protocol, fpr95=1 - b),
            ]
    out = paired_differences(rows, "split-bn", "separate", "fpr95", keys=("protocol",))
    # order of first appearance
    assert [d["protocol"] for d in out] == ["unseen-ood", "transductive", "disjoint"]
    for d in out:
        xa, xb = (
            [r["fpr95"] for r in rows if r["protocol"] == d["protocol"] and r["strategy"] == s]
            for s in ("split-bn", "separate")
        )
        diffs = np.subtract(xa, xb)
        assert d["p_value"] == pytest.approx(st.ttest_1samp(diffs, 0.0).pvalue, rel=1e-10)
        assert (d["mean"], d["half_width"]) == pytest.approx(by_scipy(diffs), rel=1e-10)
        assert (d["p_value"] < 0.05) == (d["low"] > 0 or d["high"] < 0)


def test_equal_differences_have_no_p_and_a_group_with_one_strategy_is_left_out():
    rows = [row("concat", s, 0.9) for s in range(3)] + [row("separate", s, 0.8) for s in range(3)]
    # no separate here: nothing to pair
    rows += [row("concat", s, 0.9, protocol="transductive") for s in range(3)]
    (d,) = paired_differences(rows)
    assert (
        d["protocol"] == "disjoint"
        and d["half_width"] == pytest.approx(0.0, abs=1e-12)
        and math.isnan(d["p_value"])
    )


@pytest.mark.parametrize(
    "rows, match",
    [
        (
            HAND + [row("concat", 3, 0.9)],
            rf"{re.escape(GROUP)}.*\[3\]",
        ),
        (
            HAND[:3] + [row("separate", s, 0.9) for s in (7, 8, 9)],
            r"\[0, 1, 2, 7, 8, 9\]",
        ),
        (
            HAND + [row("separate", 0, 0.5)],
            rf"seed 0\b.*'separate'.*{re.escape(GROUP)}",
        ),
        (
            [row("concat", 0, 0.9), row("separate", 0, 0.8)],
            rf"{re.escape(GROUP)}.*\b2 values\b.*\b1\b",
        ),
        (
            [{**HAND[0], "auroc": None}] + HAND[1:],
            r"row 0\b.*\['auroc'\].*\['auroc', 'class_split'",
        ),
        (
            HAND[:5] + [{"strategy": "concat", "seed": 9, "auroc": 0.9}],
            r"row 5\b.*\['task', 'class_split', 'protocol', 'selection', 'method'\]",
        ),
        (
            HAND[:3] + [row("separate", s, float("nan") if s == 1 else 0.8) for s in range(3)],
            rf"{re.escape(GROUP)}.*\b1 NaN.*index 1\b",
        ),
    ],
)
def test_paired_differences_errors(rows, match):
    with pytest.raises(ValueError, match=match):
        paired_differences(rows)


def test_summarize_groups_in_order_of_first_appearance():
    rows = [dict(r, fpr95=0.5, id_accuracy=0.9 + 0.01 * r["seed"]) for r in HAND[3:] + HAND[:3]]
    summary = summarize(rows)
    assert [(g["strategy"], g["n"]) for g in summary] == [("separate", 3), ("concat", 3)]
    concat = summary[1]
    assert {k: concat[k] for k in ("task", "class_split", "protocol", "selection", "method")} == {
        "task": "near-ood",
        "class_split": "a",
        "protocol": "disjoint",
        "selection": "last-epoch",
        "method": "mcd",
    }
    assert (concat["auroc"]["mean"], concat["auroc"]["half_width"]) == pytest.approx(
        (0.9, T975_DF2 * 0.05 / math.sqrt(3))
    )
    assert concat["fpr95"]["half_width"] == 0.0 and concat["id_accuracy"]["mean"] == pytest.approx(
        0.91
    )
    (pooled,) = summarize(rows, ("auroc",), keys=("task",))
    assert pooled["n"] == 6 and pooled["auroc"]["mean"] == pytest.approx(
        np.mean([r["auroc"] for r in rows])
    )


def test_summarize_errors():
    with pytest.raises(
        ValueError,
        match=r"'strategy': 'concat'\}, auroc.*\b2 values\b",
    ):
        summarize(HAND[:1] + HAND[3:], metrics=("auroc",))
    with pytest.raises(ValueError, match=r"row 0\b.*\['fpr95'\]"):
        summarize(HAND)


# ---- pre-registered endpoints --------------------------------------------------------------------


def holm(p):
    """Holm's step-down adjustment written out: the i-th smallest p times (m - i), kept monotone,
    capped at 1."""
    order, out, running = sorted(range(len(p)), key=lambda i: p[i]), [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def test_the_hand_holm_on_a_worked_example():
    # p sorted: 0.01 (x4 = 0.04), 0.02 (x3 = 0.06), 0.03 (x2 = 0.06), 0.5 (x1); in the order given
    assert holm([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06], abs=1e-15)
    # 0.3 x 2 = 0.6; 0.4 x 1 = 0.4, raised to 0.6 (monotone)
    assert holm([0.4, 0.3]) == pytest.approx([0.6, 0.6], abs=1e-15)


def _sign_p_by_hand(k, n):
    """Exact two-sided sign test: 2 min(P(X <= k), P(X >= k)) for X ~ Binomial(n, 1/2), at most
    1."""
    lower, upper = (
        sum(math.comb(n, i) for i in rng) / 2**n for rng in (range(k + 1), range(k, n + 1))
    )
    return min(1.0, 2 * min(lower, upper))


def _tost_p_by_hand(d, margin):
    """Two one-sided t-tests of mean(d) > -margin and mean(d) < margin: the larger of their
    p-values."""
    se, df = np.std(d, ddof=1) / np.sqrt(len(d)), len(d) - 1
    return max(st.t.sf((np.mean(d) + margin) / se, df), st.t.cdf((np.mean(d) - margin) / se, df))


def test_endpoint_tests_primary_unadjusted_secondaries_holm_sign_test_by_hand():
    rng, rows = np.random.RandomState(0), []
    base = dict(
        task="near-ood",
        class_split="a",
        protocol="disjoint",
        selection="last-epoch",
        method="mcd",
        norm="batch",
    )
    for seed in range(8):
        for s, shift in (("separate", 0.0), ("concat", 0.02), ("eval-bn", 0.0)):
            for stats_, extra in (("running", 0.0), ("recalibrated", -0.01)):
                rows.append(
                    {
                        **base,
                        "strategy": s,
                        "seed": seed,
                        "eval_stats": stats_,
                        "auroc": 0.8 + shift + extra + rng.normal(0, 0.01),
                        "fpr95": 0.3 + rng.normal(0, 0.02),
                    }
                )
    # ignored
    rows.append(
        {
            **base,
            "method": "msp",
            "strategy": None,
            "seed": 0,
            "eval_stats": "running",
            "auroc": 0.7,
        }
    )
    ends = [
        ("concat", "separate", "auroc", "running"),
        ("concat", "separate", "auroc", "recalibrated"),
        ("concat", "separate", "fpr95", "running"),
        ("separate", "eval-bn", "auroc", "running"),
    ]
    out = endpoint_tests(rows, ends)
    assert [d["role"] for d in out] == ["primary"] + ["secondary"] * 3
    for d, (a, b, metric, stats_) in zip(out, ends):
        xa, xb = (
            [r[metric] for r in rows if r["strategy"] == s and r["eval_stats"] == stats_]
            for s in (a, b)
        )
        diffs = np.subtract(xa, xb)
        assert d["diffs"] == pytest.approx(diffs, abs=1e-15) and d["p_value"] == pytest.approx(
            p_by_hand(diffs), rel=1e-9
        )
        assert d["sign_p"] == pytest.approx(
            _sign_p_by_hand(int((diffs > 0).sum()), len(diffs)), rel=1e-12
        )
        assert d["tost_p"] == pytest.approx(_tost_p_by_hand(diffs, 0.01), rel=1e-9)
    assert out[0]["tost_p"] > 0.5  # a 2 pp effect is not within ±1 pp
    # differences 0, 0.2 pp, 0, ...: within ±1 pp
    null = [
        {
            **base,
            "strategy": s,
            "seed": i,
            "eval_stats": "running",
            "auroc": 0.8 + (0.002 * (i % 2) if s == "concat" else 0),
        }
        for s in ("concat", "separate")
        for i in range(6)
    ]
    d0 = endpoint_tests(null, ends[:1])[0]
    assert (
        d0["tost_p"] == pytest.approx(_tost_p_by_hand(np.array(d0["diffs"]), 0.01), rel=1e-9)
        and d0["tost_p"] < 1e-5
    )
    assert out[0]["holm_p"] == out[0]["p_value"]
    assert [d["holm_p"] for d in out[1:]] == pytest.approx(
        holm([d["p_value"] for d in out[1:]]), rel=1e-12
    )
    with pytest.raises(
        ValueError,
        match=r"concat-both - separate \(auroc, running\b",
    ):
        endpoint_tests(rows, [("concat-both", "separate", "auroc", "running")])


def test_an_endpoint_of_equal_differences_takes_the_sign_tests_p_into_holm():
    base = dict(
        task="near-ood",
        class_split="a",
        protocol="disjoint",
        selection="last-epoch",
        method="mcd",
        norm="batch",
        eval_stats="running",
    )
    rows = [
        {
            **base,
            "strategy": s,
            "seed": i,
            "auroc": 0.8 + (0.01 if s == "concat" else 0.0) + 0.001 * i,
            "fpr95": 0.3,
        }
        for s in ("concat", "separate")
        for i in range(2)
    ]
    out = endpoint_tests(
        rows,
        [
            ("concat", "separate", "auroc", "running"),
            ("concat", "separate", "fpr95", "running"),
            ("concat", "separate", "auroc", "running"),
        ],
    )
    assert math.isnan(out[1]["p_value"]) and math.isnan(out[1]["sign_p"])  # all fpr95 differences 0
    # 2 of 2 positive: p = 2 / 4
    assert out[2]["sign_p"] == 0.5 and out[2]["diffs"] == pytest.approx([0.01, 0.01])
    # not 0: the sign test's p
    assert [d["holm_p"] for d in out[1:]] == pytest.approx(holm([1.0, 0.5]))


def split_rows(k=8, n=3, tau=0.03, sigma=0.02, seed=0):
    """Balanced rows of concat, separate and MSP over ``k`` splits x ``n`` seeds: concat - separate
    = 0.05 + u_i + e_ij."""
    rng, rows = np.random.default_rng(seed), []
    common = dict(
        task="near-ood",
        protocol="disjoint",
        selection="last-epoch",
        norm="batch",
        ood_dataset="heldout",
    )
    for i in range(k):
        u = rng.normal(0, tau)
        for j in range(n):
            base = rng.uniform(0.8, 0.9)
            for method, strategy, auroc in (
                ("mcd", "concat", base + 0.05 + u + rng.normal(0, sigma)),
                ("mcd", "separate", base),
                ("msp", None, 0.6 + 0.01 * i + 0.003 * j),
            ):
                rows.append(
                    {
                        **common,
                        "class_split": f"s{i}",
                        "seed": j,
                        "method": method,
                        "strategy": strategy,
                        "auroc": auroc,
                        **dict.fromkeys(("fpr95", "aupr_in", "aupr_out", "id_accuracy"), 0.5),
                    }
                )
    return rows


def anova(rows, k, n):
    """The balanced one-way random-effects ANOVA by hand: D (k, n), mean, tau, sigma, se(mean)."""

    def get(i, s):
        return [r["auroc"] for r in rows if (r["class_split"], r["strategy"]) == (f"s{i}", s)]  # noqa: E731

    d = np.array([np.subtract(get(i, "concat"), get(i, "separate")) for i in range(k)])
    m = d.mean(1)
    msb, msw = n * m.var(ddof=1), ((d - m[:, None]) ** 2).sum() / (k * (n - 1))
    return d, d.mean(), np.sqrt(max(msb - msw, 0) / n), np.sqrt(msw), np.sqrt(msb / (k * n))


def test_split_effects_at_no_split_effect_and_bad_input():
    from mcd_helpers.experiments.significance import split_effects

    rows = split_rows(k=6, n=4, tau=0.0, sigma=0.02, seed=1)
    _, mean, tau, _, _ = anova(rows, 6, 4)
    # this draw's between-split mean square is below the within one: tau on the boundary
    assert tau == 0
    out = split_effects(rows)
    # tau = 0: the 24 pairs are i.i.d., their variance with N - 1 and se = sigma / sqrt(N)
    d = anova(rows, 6, 4)[0]
    assert out["tau"] == 0 and out["mean"] == pytest.approx(mean, rel=1e-12)
    assert (out["sigma"], out["se"]) == pytest.approx(
        (d.std(ddof=1), d.std(ddof=1) / np.sqrt(24)), rel=1e-12
    )
    with pytest.raises(ValueError, match=r"\b3 class splits\b.*'concat'.*'separate'.*\b2\b"):
        split_effects([r for r in rows if r["class_split"] in ("s0", "s1")])
    with pytest.raises(ValueError, match=r"split_effects.*\btask\b.*\bprotocol\b.*\bselection\b"):
        split_effects(rows + [{**r, "protocol": "transductive"} for r in rows])
    with pytest.raises(
        ValueError, match=r"\b2 values\b.*\b1\b"
    ):  # one seed: no within-split variance
        split_effects([r for r in rows if r["seed"] == 0])
    far_msp = [{**r, "task": "far-ood", "auroc": 0.99} for r in rows if r["method"] == "msp"]
    # the covariate from the same task only
    assert split_effects(rows + far_msp)["slope"] == out["slope"]


def reml_profile_by_matrices(d: np.ndarray, tau2: float) -> float:
    """The REML log-likelihood of ``d`` (k, n) at tau^2 = ``tau2``, maximised over sigma^2 on a
    bounded search, from the general formula -1/2 [log|V| + log|X'V^-1 X| + y'Py] with V built
    entry by entry (Harville 1977, J. Am. Stat. Assoc. 72:320)."""
    k, n = d.shape
    y, x, z = d.ravel(), np.ones((d.size, 1)), np.kron(np.eye(k), np.ones((n, 1)))

    def loglik(sigma2):
        v = sigma2 * np.eye(d.size) + tau2 * z @ z.T
        vi = np.linalg.inv(v)
        xvx = x.T @ vi @ x
        p = vi - vi @ x @ np.linalg.inv(xvx) @ x.T @ vi
        return -0.5 * (np.linalg.slogdet(v)[1] + np.linalg.slogdet(xvx)[1] + y @ p @ y)

    best = optimize.minimize_scalar(
        lambda log_s2: -loglik(np.exp(log_s2)), bounds=(-14, 0), method="bounded"
    )
    return -best.fun


@pytest.mark.parametrize("tau, seed", [(0.03, 2), (0.0, 1)])
def test_split_effects_tau_interval_is_the_reml_profile_likelihoods(tau, seed):
    from mcd_helpers.experiments.significance import split_effects

    rows = split_rows(k=8, n=4, tau=tau, sigma=0.02, seed=seed)
    out = split_effects(rows)
    d = anova(rows, 8, 4)[0]
    top = reml_profile_by_matrices(d, out["tau"] ** 2)
    drop = st.chi2.ppf(0.95, 1) / 2
    for end in ("tau_low", "tau_high"):  # each end drops the profile by chi2_1(0.95) / 2
        if out[end] > 0:
            assert top - reml_profile_by_matrices(d, out[end] ** 2) == pytest.approx(drop, abs=1e-5)
    assert out["tau_low"] <= out["tau"] < out["tau_high"]
    if tau == 0:  # tau = 0 is inside: the interval starts at the boundary
        assert out["tau_low"] == 0 and top - reml_profile_by_matrices(d, 0.0) < drop
    else:
        assert out["tau_low"] > 0
    # tau = 0 tested exactly: the one-way ANOVA's F test over the splits, by scipy
    assert out["tau_p"] == pytest.approx(st.f_oneway(*d).pvalue, rel=1e-9)


def test_split_effects_tau_interval_scales_with_the_data_and_is_nan_without_spread():
    from mcd_helpers.experiments.significance import split_effects

    rows = split_rows(k=6, n=3, tau=0.03, sigma=0.02, seed=4)
    out = split_effects(rows)
    small = split_effects([{**r, "auroc": 1e-6 * r["auroc"]} for r in rows])
    assert (small["tau_low"], small["tau_high"]) == pytest.approx(
        (1e-6 * out["tau_low"], 1e-6 * out["tau_high"]), rel=1e-6
    )
    # every seed of a split the same: no within-split spread, no likelihood maximum
    same = [{**r, "auroc": 0.6 + 0.01 * int(r["class_split"][1:])} for r in rows]
    flat = split_effects(
        [r for r in same if r["method"] == "mcd" and r["strategy"] == "concat"]
        + [{**r, "auroc": 0.5} for r in same if r["strategy"] == "separate"]
    )
    assert np.isnan(flat["tau_low"]) and np.isnan(flat["tau_high"]) and flat["sigma"] == 0


def test_split_effects_refuses_splits_with_different_numbers_of_seeds():
    from mcd_helpers.experiments.significance import split_effects

    rows = [
        r
        for r in split_rows(k=8, n=4, tau=0.03, seed=2)
        if not (r["class_split"] in ("s1", "s5") and r["seed"] == 3)
    ]
    with pytest.raises(ValueError, match=r"\{'s0': 4, 's1': 3, "):
        split_effects(rows)


def test_hodges_lehmann_is_the_median_of_walsh_averages_by_hand():
    from mcd_helpers.experiments.significance import hodges_lehmann

    # Walsh averages of (1, 2, 10): 1, 1.5, 5.5, 2, 6, 10 -> median (2 + 5.5) / 2
    out = hodges_lehmann([1.0, 2.0, 10.0])
    assert (out["hl"], out["median"], out["n"]) == (3.75, 2.0, 3)
    # a collapsed seed moves the mean by 2.5, the shift by far less; its interval holds the shift
    bulk = [4.0, 4.5, 5.0, 3.5, 4.2, 4.8, 3.9, 4.4]
    out = hodges_lehmann(bulk + [24.0])
    assert abs(out["hl"] - np.median(bulk)) < 0.5 < np.mean(bulk + [24.0]) - np.mean(bulk)
    assert out["hl_low"] <= out["hl"] <= out["hl_high"]
    with pytest.raises(ValueError, match="at least 3.*got 2"):
        hodges_lehmann([1.0, 2.0])


def test_collapse_rate_with_the_clopper_pearson_interval_by_hand():
    from mcd_helpers.experiments.significance import collapse_rate

    out = collapse_rate([0.5, 0.9, 0.6, 0.95] + [0.9] * 16, threshold=0.73)  # 2 of 20 below
    # exact interval: beta quantiles (Clopper & Pearson 1934)
    low, high = st.beta.ppf(0.025, 2, 19), st.beta.ppf(0.975, 3, 18)
    assert (out["collapsed"], out["n"], out["rate"]) == (2, 20, 0.1)
    assert (out["low"], out["high"]) == pytest.approx((low, high), rel=1e-9)
