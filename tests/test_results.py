"""The committed benchmark results (``benchmarks/results/*/``): every row whose per-sample scores
are committed recomputes from its ``scores/*.npz`` with scikit-learn alone (AUROC, AUPR-In/Out,
FPR95 with ID as the positive class, as ``mcd_helpers.metrics`` defines them), so no number in a
table is unbacked."""

import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# finished runs
WITH_SCORES = sorted(
    p.parent for p in RESULTS.glob("*/results.json") if (p.parent / "scores").is_dir()
)


def by_sklearn(s_id: np.ndarray, s_ood: np.ndarray) -> dict:
    """Higher score = more OOD; FPR95: the OOD share accepted at the first threshold accepting >=
    95% of ID."""
    y_ood = np.r_[np.zeros(len(s_id)), np.ones(len(s_ood))]
    s = np.r_[s_id, s_ood].astype(np.float64)
    fpr, tpr, _ = roc_curve(1 - y_ood, -s, drop_intermediate=False)
    return {
        "auroc": roc_auc_score(y_ood, s),
        "aupr_in": average_precision_score(1 - y_ood, -s),
        "aupr_out": average_precision_score(y_ood, s),
        "fpr95": fpr[np.argmax(tpr * len(s_id) >= 0.95 * len(s_id) - 1e-9)],
    }


def load(name: str) -> list[dict]:
    """The rows of the committed run ``benchmarks/results/<name>/``."""
    return json.loads((RESULTS / name / "results.json").read_text())


def primary_auroc() -> dict:
    """The primary run's MCD AUROCs, ``(strategy, eval_stats, seed) -> auroc``: what a dose at its
    setting recomputes."""
    return {
        (r["strategy"], r["eval_stats"], r["seed"]): r["auroc"]
        for r in load("primary")
        if r["method"] == "mcd"
    }


def half_width(d: np.ndarray) -> float:
    """The 95% Student-t half-width of the mean of ``d`` (scipy by hand)."""
    return stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))


def tost_p(d: np.ndarray, margin: float = 1.0) -> float:
    """TOST within ±margin: the larger p of the one-sided t-tests mean > -margin and mean <
    margin."""
    se, df = d.std(ddof=1) / np.sqrt(len(d)), len(d) - 1
    return max(stats.t.sf((d.mean() + margin) / se, df), stats.t.cdf((d.mean() - margin) / se, df))


def git(*args: str) -> str:
    """A git command's output in the repository; the test is skipped where git cannot answer (not
    a full checkout)."""
    done = subprocess.run(["git", *args], cwd=RESULTS.parents[1], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"git cannot answer here ({done.stderr.strip()[:80]}): not a full checkout")
    return done.stdout.strip()


def doc_table(title: str) -> list[list[str]]:
    """The cells of the first table after the bold ``title`` in docs/near-ood.md (no header)."""
    text = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    after = text[text.index(f"**{title}") :].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    rows = itertools.takewhile(lambda line: line.startswith("|"), after[start + 2 :])
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def paired_cells(a: list[float], b: list[float]) -> list[str]:
    """How the docs print arms ``b`` and ``a`` (fractions, paired by seed) and ``a - b``: the two
    means in %, the mean difference in points with its 95% half-width, the paired t-test's p, and
    the seeds where ``a`` leads."""
    d = 100 * (np.array(a) - np.array(b))
    p = stats.ttest_1samp(d, 0).pvalue
    return [
        f"{100 * np.mean(b):.2f}",
        f"{100 * np.mean(a):.2f}",
        f"{d.mean():+.2f} ± {half_width(d):.2f}",
        f"{p:.2g}",
        f"{(d > 0).sum()} of {len(d)}",
    ]


def test_some_results_commit_their_scores():
    assert (RESULTS / "primary") in WITH_SCORES


def test_every_committed_row_names_only_score_files_that_exist():
    # a row's "scores" is the path of its per-sample scores; a run committed without them has none
    missing = [
        (folder.name, r["scores"])
        for folder in sorted(p.parent for p in RESULTS.glob("*/results.json"))
        for r in load(folder.name)
        if "scores" in r and not (folder / r["scores"]).is_file()
    ]
    assert not missing, missing[:3]


@pytest.mark.parametrize("folder", WITH_SCORES, ids=[p.name for p in WITH_SCORES])
def test_every_committed_row_recomputes_from_its_scores_with_scikit_learn(folder):
    rows = load(folder.name)
    assert rows and all((folder / r["scores"]).is_file() for r in rows), (
        "a row's scores file is not committed"
    )
    for r in rows:
        with np.load(folder / r["scores"]) as z:
            s_id, s_ood = z["id"], z["ood"]
        assert (len(s_id), len(s_ood)) == (r["n_id"], r["n_ood"])
        for k, v in by_sklearn(s_id, s_ood).items():
            assert r[k] == pytest.approx(v, abs=1e-12), (r["scores"], k)
    assert len({r["scores"] for r in rows}) == len(rows)


def test_the_primary_endpoint_and_the_numbers_the_readme_quotes():
    # docs/answer.md (the README's short answer) and docs/near-ood.md; recomputed here with scipy
    # alone
    rows = load("primary")
    v = {(r["strategy"], r["eval_stats"], r["seed"]): r for r in rows if r["method"] == "mcd"}
    seeds = sorted({r["seed"] for r in rows})

    def diff(a, b, stats_="running", metric="auroc"):
        d = 100 * np.array([v[a, stats_, s][metric] - v[b, stats_, s][metric] for s in seeds])
        return round(d.mean(), 2), round(half_width(d), 2), stats.ttest_1samp(d, 0).pvalue, d

    mean, half, p, d = diff("concat", "separate")
    assert (
        seeds == list(range(20))
        and (mean, half) == (6.96, 3.14)
        and 1e-4 < p < 2e-4
        and (d > 0).all()
    )
    assert stats.binomtest(20, 20).pvalue < 2e-6  # the exact sign test: 20 of 20 seeds positive
    answer = " ".join((RESULTS.parents[1] / "docs" / "answer.md").read_text().split())
    assert "+6.96 ± 3.14 (95% CI, 20 seeds) on split `a`" in answer
    eval_bn, concat = (
        np.mean([100 * v[s, "running", i]["auroc"] for i in seeds]) for s in ("eval-bn", "concat")
    )
    assert f"{eval_bn:.2f}% against {concat:.2f}% AUROC" == "90.17% against 91.10% AUROC"
    assert "90.17% against 91.10% AUROC" in answer
    assert diff("concat", "separate", "recalibrated")[:2] == (12.92, 3.52)
    # docs/near-ood.md: what recalibrating on labeled ID data does to each arm (not a neutral probe)
    shift = {
        s: round(
            np.mean(
                [
                    100 * (v[s, "recalibrated", i]["auroc"] - v[s, "running", i]["auroc"])
                    for i in seeds
                ]
            ),
            2,
        )
        for s in ("separate", "eval-bn", "concat")
    }
    assert shift == {"separate": -6.01, "eval-bn": -2.41, "concat": -0.06}
    docs = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    assert "`eval-bn` (by 2.41)" in docs and "(−0.06)" in docs
    assert diff("concat", "separate", metric="fpr95")[:2] == (-22.0, 5.45)
    assert diff("separate", "eval-bn")[:2] == (-6.03, 2.88)
    mean, half, p, d = diff("concat-both", "concat")
    # Step A's concatenation adds nothing measurable
    assert (mean, half) == (0.09, 0.24) and p > 0.4
    assert (
        f"{tost_p(d):.2g}" == "8.2e-08"
        and "| 0.42 | 0.82 | 0.42 | **8.2e-08** |"
        in (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    )
    mean, half, _, d = diff("eval-bn-concat", "eval-bn")
    # float32 rounding grown over 200 steps
    assert (mean, half) == (-0.01, 0.08) and round(np.abs(d).max(), 2) == 0.47
    assert (
        f"{tost_p(d):.2g}" == "2.2e-16"
        and "| 0.73 | | | 2.2e-16 |" in (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    )

    def mean(s, stats_="running"):
        return round(100 * np.mean([v[s, stats_, i]["auroc"] for i in seeds]), 2)  # noqa: E731

    assert [mean(s) for s in ("separate", "eval-bn", "concat")] == [84.15, 90.17, 91.10]
    # its running statistics rescue part
    assert mean("separate", "recalibrated") == 78.13 < mean("separate")
    assert sum(v["separate", "running", i]["auroc"] < 0.73 for i in seeds) == 3
    assert diff("concat", "separate", metric="id_accuracy")[:2] == (0.13, 0.23)
    assert round(stats.binomtest(20, 20).pvalue, 7) == 1.9e-6


def test_the_dose_response_in_fine_tuning_length_docs_quote():
    rows = load("dose-length")
    v = {
        (r["finetune_steps"], r["strategy"], r["seed"]): r["auroc"]
        for r in rows
        if r["method"] == "mcd"
    }
    quoted = doc_table("Dose-response in fine-tuning length")
    assert [int(row[0]) for row in quoted] == [30, 60, 120, 240, 480]
    for row in quoted:
        arm = {s: [v[int(row[0]), s, i] for i in range(10)] for s in ("concat", "separate")}
        assert row[2:] == paired_cells(arm["concat"], arm["separate"]), row


def test_the_margin_dose_response_and_margins_above_the_reachable_gap_train_the_same_network():
    # docs/near-ood.md, "Dose-response in the margin"
    rows = load("dose-margin")
    v = {(r["dose"], r["strategy"], r["seed"]): r["auroc"] for r in rows if r["method"] == "mcd"}
    quoted = doc_table("Dose-response in the margin")
    for row in quoted:
        m = row[0].split()[0]  # "1.2 (official)"
        arm = {s: [v[f"margin={m}", s, i] for i in range(10)] for s in ("concat", "separate")}
        assert row[1:] == paired_cells(arm["concat"], arm["separate"]), row
    assert [row[0].split()[0] for row in quoted] == ["0.35", "0.7", "1.2", "2.0"]
    assert all(
        v["margin=1.2", s, i] == v["margin=2.0", s, i]
        for s in ("concat", "separate")
        for i in range(10)
    )
    primary = primary_auroc()
    assert all(
        v["margin=1.2", s, i] == primary[s, "running", i]
        for s in ("concat", "separate")
        for i in range(10)
    )


def test_the_ood_share_dose_response_docs_quote_and_its_full_pool_is_the_primarys_networks():
    # docs/near-ood.md, "Dose-response in the OOD share"; fraction f keeps round(2460 f) of the
    # pool's OOD images
    rows = load("dose-ood-share")
    v = {
        (float(r["dose"].split("=")[1]), r["strategy"], r["seed"]): r
        for r in rows
        if r["method"] == "mcd"
    }
    quoted = doc_table("Dose-response in the OOD share")
    assert len(quoted) == 5
    for f, row in zip((0.0, 0.125, 0.25, 0.5, 1.0), quoted):
        share = 100 * round(2460 * f) / (3940 + round(2460 * f))
        arm = {s: [v[f, s, i] for i in range(10)] for s in ("concat", "separate")}
        auroc = {s: [r["auroc"] for r in arm[s]] for s in arm}
        fpr = 100 * np.mean([c["fpr95"] - s["fpr95"] for c, s in zip(*arm.values())])
        assert row[0].startswith(f"{share:.1f}%".replace(".0%", "%")), row
        assert row[2:7] == paired_cells(auroc["concat"], auroc["separate"]), row
        assert row[7] == f"{fpr:+.2f}".replace("-", "−"), row
    arm = lambda f, s: round(100 * np.mean([v[f, s, i]["auroc"] for i in range(10)]), 2)  # noqa: E731
    msp = round(
        100
        * np.mean(
            [r["auroc"] for r in rows if r["method"] == "msp" and r["dose"].endswith("=0.0")]
        ),
        2,
    )
    # no OOD to find: at MSP's level
    assert (arm(0.0, "separate"), arm(0.0, "concat"), msp) == (55.87, 59.4, 58.29)
    primary = primary_auroc()  # the whole pool: the primary's setting
    assert all(
        v[1.0, s, i]["auroc"] == primary[s, "running", i]
        for s in ("concat", "separate")
        for i in range(10)
    )


def test_bn_momentum_moves_only_the_running_statistics_and_the_effect_hardly():
    # docs/near-ood.md, "Dose-response in BatchNorm's momentum": last epoch, so the same weights at
    # every momentum
    rows = load("dose-momentum")
    v = {
        (float(r["dose"].split("=")[1]), r["strategy"], r["eval_stats"], r["seed"]): r["auroc"]
        for r in rows
        if r["method"] == "mcd"
    }
    momenta, arms = (0.01, 0.03, 0.1, 0.3, 1.0), ("concat", "separate")
    table = {}
    for m in momenta:
        d = 100 * np.array(
            [v[m, "concat", "running", s] - v[m, "separate", "running", s] for s in range(10)]
        )
        table[m] = (round(d.mean(), 2), round(half_width(d), 2), int((d > 0).sum()))
    assert table == {
        0.01: (8.1, 3.83, 10),
        0.03: (8.1, 4.9, 10),
        0.1: (7.29, 5.16, 10),
        0.3: (7.28, 4.95, 10),
        1.0: (7.68, 4.11, 10),
    }
    # recomputed statistics see only the weights: bit-identical AUROCs at every momentum
    assert all(
        v[m, a, "recalibrated", i] == v[0.1, a, "recalibrated", i]
        for m in momenta
        for a in arms
        for i in range(10)
    )
    d = 100 * np.array(
        [
            v[0.1, "concat", "recalibrated", s] - v[0.1, "separate", "recalibrated", s]
            for s in range(10)
        ]
    )
    assert (round(d.mean(), 2), round(half_width(d), 2)) == (14.09, 5.76)
    arm = lambda m, a, e="running": round(100 * np.mean([v[m, a, e, i] for i in range(10)]), 2)  # noqa: E731
    assert [arm(m, "separate") for m in momenta] == [82.27, 82.45, 83.54, 83.59, 83.02]
    assert arm(0.1, "separate", "recalibrated") == 76.58 < min(arm(m, "separate") for m in momenta)

    def acc(m, a):
        return round(
            100
            * np.mean(
                [
                    r["id_accuracy"]
                    for r in rows
                    if r["method"] == "mcd"
                    and r["strategy"] == a  # noqa: E731
                    and r["eval_stats"] == "running"
                    and r["dose"] == f"bn_momentum={m}"
                ]
            ),
            2,
        )

    assert (acc(1.0, "separate"), acc(0.1, "separate"), acc(1.0, "concat")) == (86.7, 89.61, 90.42)
    primary = primary_auroc()
    assert all(
        v[0.1, a, e, i] == primary[a, e, i]
        for a in arms
        for e in ("running", "recalibrated")
        for i in range(10)
    )


def test_the_three_split_table_docs_quote_is_per_split_and_pools_split_means():
    # docs/near-ood.md, "The three-split benchmark": concat - separate per split (5 seeds) and over
    # the 3 split means
    rows = [
        r
        for r in load("near-ood")
        if (r["task"], r["method"], r["norm"], r["selection"])
        == ("near-ood", "mcd", "batch", "ood-labels")
    ]
    v = {
        (r["class_split"], r["protocol"], r["strategy"], r["seed"]): 100 * r["auroc"] for r in rows
    }
    ci = lambda d: (d.mean(), half_width(d))  # noqa: E731
    docs = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text().replace("−", "-")
    cells = {"all": []}
    for split in "abc":
        cells[split] = []
        for protocol in ("transductive", "disjoint", "unseen-ood"):
            d = np.array(
                [
                    v[split, protocol, "concat", s] - v[split, protocol, "separate", s]
                    for s in range(5)
                ]
            )
            cells[split].append(
                f"{ci(d)[0]:+.2f} ± {ci(d)[1]:.2f} (p {stats.ttest_1samp(d, 0).pvalue:.2g})"
            )
    for protocol in ("transductive", "disjoint", "unseen-ood"):
        means = np.array(
            [
                np.mean(
                    [v[s, protocol, "concat", i] - v[s, protocol, "separate", i] for i in range(5)]
                )
                for s in "abc"
            ]
        )
        cells["all"].append("{:+.2f} ± {:.2f}".format(*ci(means)))
    for split, line in cells.items():
        name = "all (3 split means)" if split == "all" else split
        assert f"| {name} | " + " | ".join(line) + " |" in docs, (split, line)


def test_the_thirty_split_random_effect_docs_quote_recomputes_by_hand():
    # docs/near-ood.md "Generality", README, notebook 08: the balanced one-way random-effects ANOVA
    # by hand
    rows = load("generality")
    v = {
        (r["class_split"], r["strategy"], r["seed"]): 100 * r["auroc"]
        for r in rows
        if r["method"] == "mcd"
    }
    msp = {}
    for r in rows:
        if r["method"] == "msp":
            msp.setdefault(r["class_split"], []).append(100 * r["auroc"])
    splits = sorted({s for s, _, _ in v})
    # k x n
    d = np.array([[v[s, "concat", i] - v[s, "separate", i] for i in range(3)] for s in splits])
    k, n = d.shape
    means = d.mean(1)
    msb, msw = n * means.var(ddof=1), ((d - means[:, None]) ** 2).sum() / (k * (n - 1))
    tau2, se = (msb - msw) / n, np.sqrt(msb / (k * n))
    half, pi = stats.t.ppf(0.975, k - 1) * se, stats.t.ppf(0.975, k - 2) * np.sqrt(tau2 + se**2)
    got = [
        round(x, 2)
        for x in (
            d.mean(),
            d.mean() - half,
            d.mean() + half,
            np.sqrt(tau2),
            np.sqrt(msw),
            d.mean() - pi,
            d.mean() + pi,
        )
    ]
    assert (k, n, msb > msw) == (30, 3, True)
    assert got == [2.67, 1.50, 3.84, 2.10, 4.01, -1.80, 7.14] and (means > 0).sum() == 28
    # the package's fit, which the notebook and summary.md show
    from mcd_helpers.experiments.significance import split_effects

    fit = split_effects(rows)
    assert [
        round(100 * fit[k], 2) for k in ("mean", "low", "high", "tau", "sigma", "pi_low", "pi_high")
    ] == got
    x = np.array([np.mean(msp[s]) for s in splits])
    slope, r = np.polyfit(x, means, 1)[0], np.corrcoef(x, means)[0, 1]
    assert (round(slope, 2), round(r, 2)) == (-0.08, -0.28)
    docs = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text().replace("−", "-")
    answer = (RESULTS.parents[1] / "docs" / "answer.md").read_text().replace("−", "-")
    assert "+2.67 [+1.50, +3.84]" in docs and "[-1.80, +7.14]" in docs and "28 of 30" in docs
    answer = " ".join(answer.split())  # its lines rewrapped
    assert "it gained 2.67 points of **AUROC**" in answer and "95% CI +1.50 to +3.84" in answer
    assert "28 of 30 splits ahead" in answer and "a new split: -1.80 to +7.14" in answer
    assert (round(100 * fit["tau_low"], 2), round(100 * fit["tau_high"], 2)) == (0.00, 3.46)
    assert round(stats.f_oneway(*d).pvalue, 3) == 0.025 and "| p = 0.025 |" in docs  # tau = 0
    assert "| 2.10 [0.00, 3.46] / 4.01 |" in docs and "| -0.08, p = 0.14 (r = -0.28) |" in docs
    rest = np.delete(means, means.argmax())  # docs: without the largest split
    assert (round(rest.mean(), 2), round(half_width(rest), 2)) == (2.21, 0.73)
    assert "+2.21 ± 0.73" in docs


def test_the_deeper_network_endpoint_docs_quote():
    # docs/near-ood.md "Depth", README: concat - separate on resnet_20 and on small_cnn's primary
    # seeds 0-9
    def endpoint(folder):
        rows = load(folder)
        v = {
            (r["strategy"], r["seed"]): 100 * r["auroc"]
            for r in rows
            if r["method"] == "mcd" and r["eval_stats"] == "running"
        }
        d = np.array([v["concat", s] - v["separate", s] for s in range(10)])
        arms = [round(np.mean([v[a, s] for s in range(10)]), 2) for a in ("separate", "concat")]
        return arms, round(d.mean(), 2), round(half_width(d), 2), int((d > 0).sum()), d

    deep, shallow = endpoint("depth"), endpoint("primary")
    assert {r["model"] for r in load("depth")} == {"resnet_20"}
    assert deep[:4] == ([77.22, 90.49], 13.27, 3.27, 10) and shallow[:4] == (
        [83.54, 90.83],
        7.29,
        5.16,
        10,
    )
    gap = deep[4] - shallow[4]  # seed by seed: resnet_20's effect minus small_cnn's
    half = half_width(gap)
    # larger in the mean, not resolved
    assert (
        int((gap > 0).sum()) == 8
        and f"by +{gap.mean():.2f} points, 95% CI [{gap.mean() - half:+.2f}, "
        f"{gap.mean() + half:+.2f}]"
        == "by +5.99 points, 95% CI [-0.37, +12.34]"
    )
    v = {(r["strategy"], r["seed"]): r for r in load("depth") if r["method"] == "mcd"}
    for metric, said in (("fpr95", "-44.47 ± 5.10"), ("id_accuracy", "+0.30 ± 0.59")):
        d = 100 * np.array([v["concat", i][metric] - v["separate", i][metric] for i in range(10)])
        assert f"{d.mean():+.2f} ± {half_width(d):.2f}" == said
    docs = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    assert (
        "by +5.99 points, 95% CI [−0.37, +12.34]" in docs
        and "FPR95 −44.47 ± 5.10" in docs
        and "+0.30 ± 0.59" in docs
    )
    assert "| `resnet_20` | 77.22 | 90.49 | +13.27 ± 3.27 |" in docs


def test_the_committed_benchmark_splits_disagree_on_concat_minus_separate():
    # docs/near-ood.md and notebook 08: per class split, from the committed rows, with scipy's
    # paired t-test
    rows = load("near-ood")
    auroc = {
        (r["class_split"], r["protocol"], r["strategy"], r["seed"]): r["auroc"]
        for r in rows
        if r["task"] == "near-ood"
        and r["method"] == "mcd"
        and r["norm"] == "batch"
        and r["selection"] == "ood-labels"
    }
    result = {}
    for split in "abc":
        for protocol in ("transductive", "disjoint"):
            d = np.array(
                [
                    auroc[(split, protocol, "concat", s)] - auroc[(split, protocol, "separate", s)]
                    for s in range(5)
                ]
            )
            result[(split, protocol)] = (
                100 * d.mean(),
                100 * half_width(d),
                stats.ttest_1samp(d, 0).pvalue,
            )
    assert [round(result[(s, "disjoint")][0], 2) for s in "abc"] == [3.72, -0.49, 0.32]
    assert [round(result[(s, "transductive")][0], 2) for s in "abc"] == [3.23, 0.22, 0.06]
    mean, half, p = result[("a", "disjoint")]
    assert mean - half > 0 and round(half, 2) == 2.39 and round(p, 3) == 0.012
    assert all(
        abs(result[(s, pr)][0]) < result[(s, pr)][1]
        for s in "bc"
        for pr in ("transductive", "disjoint")
    )


def test_the_mechanism_plan_was_committed_before_its_run():
    # benchmarks/mechanism-plan.md: registered before the first cell; run.json records the commit
    run = json.loads((RESULTS / "mechanism" / "run.json").read_text())
    commit = run["commit"].split("+")[0]
    assert not run["commit"].endswith("+changes"), "the run started from uncommitted code"
    committed_at = git("log", "-1", "--format=%cI", commit)
    assert committed_at[:19] < run["started"]  # ISO times, both UTC on the machine that ran it
    assert "## Predictions" in git("show", f"{commit}:benchmarks/mechanism-plan.md")


def test_the_mechanism_study_the_answer_and_docs_quote():
    # benchmarks/mechanism-plan.md's estimands, recomputed with scipy alone; the tables in
    # docs/near-ood.md are the package's (mechanism_markdown) of the committed rows
    from mcd_helpers.experiments.mechanism import mechanism_markdown

    rows = load("mechanism")
    v = {
        (r["dose"], r["strategy"], r["seed"]): 100 * r["auroc"]
        for r in rows
        if r["method"] == "mcd" and r["eval_stats"] == "running"
    }
    full, seeds = "unlabeled_ood_fraction=1.0", range(20, 30)

    def diff(a, b, dose=full):
        return np.array([v[dose, a, i] - v[dose, b, i] for i in seeds])

    e1, e2 = diff("interleave", "separate"), diff("concat", "interleave")
    assert (round(e1.mean(), 2), round(e2.mean(), 2)) == (7.21, -0.17)
    assert tost_p(e2, margin=1.0) < 1e-5 and stats.ttest_1samp(e1, 0).pvalue < 0.01
    answer = " ".join((RESULTS.parents[1] / "docs" / "answer.md").read_text().split())
    assert "(−0.17 points, equivalent within ±1, 10 fresh seeds)" in answer
    assert "beat separate forwards by 7.21 points" in answer
    docs = (RESULTS.parents[1] / "docs" / "near-ood.md").read_text()
    assert mechanism_markdown(rows) in docs


def test_the_converged_network_plan_curve_and_replication_docs_quote():
    # benchmarks/pretrain-length-plan.md: committed before both parts; part 1's rule and part 2's
    # estimands recomputed with numpy and scipy alone
    curve = json.loads((RESULTS / "pretrain-length" / "curve.json").read_text())
    run = json.loads((RESULTS / "converged" / "run.json").read_text())
    assert not run["commit"].endswith("+changes"), "the run started from uncommitted code"
    assert git("log", "-1", "--format=%cI", curve["plan_commit"])[:19] < run["started"]
    accuracy = {
        e: np.mean([r["id_accuracy"] for r in curve["rows"] if r["epochs"] == e])
        for e in (2, 5, 10, 15)
    }
    best = max(accuracy.values())
    assert min(e for e, a in accuracy.items() if a >= best - 0.005) == 10  # the plan's rule
    assert [round(100 * accuracy[e], 2) for e in (2, 5, 10, 15)] == [90.63, 92.59, 93.98, 94.18]
    v = {
        (r["strategy"], r["seed"]): 100 * r["auroc"]
        for r in load("converged")
        if r["method"] == "mcd" and r["eval_stats"] == "running"
    }
    seeds = range(40, 60)

    def diff(a, b):
        return np.array([v[a, i] - v[b, i] for i in seeds])

    main, interleave_gain, last = (
        diff("concat", "separate"),
        diff("interleave", "separate"),
        diff("concat", "interleave"),
    )
    assert round(main.mean(), 2) == 5.03 and main.mean() - half_width(main) > 0
    assert round(interleave_gain.mean(), 2) == 5.07
    assert round(last.mean(), 2) == -0.04 and tost_p(last) < 0.05  # interleave matches concat
    docs = " ".join((RESULTS.parents[1] / "docs" / "near-ood.md").read_text().split())
    answer = " ".join((RESULTS.parents[1] / "docs" / "answer.md").read_text().split())
    assert "+5.03 [+3.80, +6.26]" in docs and "concat − separate +5.03 points" in answer
