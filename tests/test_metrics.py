"""ood_metrics and roc_points against brute-force counts over every threshold (ID positive, accept
when score <= t)."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from mcd_helpers.metrics import METRIC_KEYS, as_scores, ood_metrics, roc_points


def thresholds(s_id, s_ood):
    return [-np.inf] + sorted(set(s_id) | set(s_ood))


def brute_roc(s_id, s_ood):
    ts = thresholds(s_id, s_ood)
    return (
        [sum(o <= t for o in s_ood) / len(s_ood) for t in ts],
        [sum(i <= t for i in s_id) / len(s_id) for t in ts],
    )


def brute_metrics(s_id, s_ood, level):
    fpr, tpr = brute_roc(s_id, s_ood)
    # ID samples accepted, counted
    accepted = [sum(i <= t for i in s_id) for t in thresholds(s_id, s_ood)]
    # exact
    fpr_at = next(
        f for a, f in zip(accepted, fpr) if Fraction(a, len(s_id)) >= Fraction(repr(level))
    )
    pairs = [(o > i) + 0.5 * (o == i) for o in s_ood for i in s_id]  # P(OOD > ID) + P(tie) / 2
    return {
        "fpr95": fpr_at,
        "detection_error": min(0.5 * (1 - t) + 0.5 * f for t, f in zip(tpr, fpr)),
        "auroc": sum(pairs) / len(pairs),
    }


def brute_ap(scores, positive):
    """Average precision: sum over thresholds (tie groups) of precision x the positives gained
    there."""
    ap = 0.0
    for t in sorted(set(scores), reverse=True):
        sel = [p for s, p in zip(scores, positive) if s >= t]
        ap += sum(sel) / len(sel) * sum(p for s, p in zip(scores, positive) if s == t)
    return ap / sum(positive)


rs = np.random.RandomState
CASES = {
    "separated": ([0.1, 0.2, 0.3], [0.8, 0.9]),
    "reversed": ([0.9, 0.8], [0.1, 0.2, 0.3]),
    "ties_across": ([0.1, 0.5, 0.5, 0.5, 0.9], [0.5, 0.5, 0.7, 1.0]),
    "all_equal": ([1.0] * 4, [1.0] * 3),
    "one_each": ([0.3], [0.2]),
    "integers_many_ties": (rs(0).randint(0, 5, 40).tolist(), rs(1).randint(2, 8, 30).tolist()),
    # TPR hits 57/60 = 0.95 exactly
    "sixty_id": (rs(2).randn(60).tolist(), (rs(3).randn(50) + 1).tolist()),
    "hundred_id_coarse": (
        (rs(4).randint(0, 20, 100) / 4).tolist(),
        (rs(5).randint(5, 30, 70) / 4).tolist(),
    ),
}


@pytest.mark.parametrize("level", [0.95, 0.8, 1.0])
@pytest.mark.parametrize("name", CASES)
def test_metrics_against_brute_force(name, level):
    s_id, s_ood = CASES[name]
    got, want = ood_metrics(s_id, s_ood, tpr_level=level), brute_metrics(s_id, s_ood, level)
    assert set(got) == set(METRIC_KEYS)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    scores, is_id = s_id + s_ood, [1] * len(s_id) + [0] * len(s_ood)
    assert got["aupr_in"] == pytest.approx(brute_ap([-s for s in scores], is_id), abs=1e-12)
    assert got["aupr_out"] == pytest.approx(brute_ap(scores, [1 - i for i in is_id]), abs=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_roc_points_are_one_point_per_unique_threshold(name):
    s_id, s_ood = CASES[name]
    fpr, tpr = roc_points(s_id, s_ood)
    want_fpr, want_tpr = brute_roc(s_id, s_ood)
    np.testing.assert_allclose(fpr, want_fpr, rtol=0, atol=1e-15)
    np.testing.assert_allclose(tpr, want_tpr, rtol=0, atol=1e-15)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)


def test_perfect_and_inverted_separation_known_answers():
    assert ood_metrics([0, 0.1, 0.2], [1, 2]) == {
        "fpr95": 0.0,
        "detection_error": 0.0,
        "auroc": 1.0,
        "aupr_in": 1.0,
        "aupr_out": 1.0,
    }
    # every OOD below every ID: to accept 95% of ID all OOD are accepted, FPR = fp / (fp + tn) = 1
    m = ood_metrics([5, 6, 7], [1, 2])
    assert m["fpr95"] == 1.0 and m["auroc"] == 0.0 and m["detection_error"] == 0.5


def test_fpr95_by_hand_with_twenty_id_samples():
    # ID 1..20: TPR reaches 19/20 = 0.95 at t = 19, where OOD 5, 18.5 and 19 (a tie, accepted) are
    # in: 3 of 4.
    assert ood_metrics(list(range(1, 21)), [5, 18.5, 19, 30])["fpr95"] == 0.75
    # at TPR >= 0.8 (t = 16) only the OOD score 5 is accepted
    assert ood_metrics(list(range(1, 21)), [5, 18.5, 19, 30], tpr_level=0.8)["fpr95"] == 0.25


def _grad_tensor(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("kind", [list, tuple, np.array, _grad_tensor])
def test_scores_as_lists_arrays_or_tensors_give_the_brute_force_metrics(kind):
    s_id, s_ood = CASES["ties_across"]
    got, want = ood_metrics(kind(s_id), kind(s_ood)), brute_metrics(s_id, s_ood, 0.95)
    assert {k: got[k] for k in want} == pytest.approx(want, abs=1e-12)


def test_as_scores_converts_to_1d_float64():
    out = as_scores(torch.tensor([1.5, -2.0], requires_grad=True))
    assert out.dtype == np.float64 and out.tolist() == [1.5, -2.0]
    assert as_scores((3, 4)).dtype == np.float64


@pytest.mark.parametrize(
    "bad, match",
    [
        (([], [1.0]), "id_scores is empty"),
        (([1.0], []), "ood_scores is empty"),
        (
            ([1.0, 2.0, float("nan")], [1.0]),
            r"id_scores.*1 non-finite.*index 2",
        ),
        (
            ([1.0], [0.0, float("inf"), -float("inf")]),
            r"ood_scores.*2 non-finite.*index 1",
        ),
        (
            ([[1.0, 2.0]], [1.0]),
            r"id_scores.*1-D.*shape \(1, 2\)",
        ),
        (([1.0], 0.5), r"ood_scores.*1-D.*shape \(\)"),
    ],
)
def test_bad_scores_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ood_metrics(*bad)
    with pytest.raises(ValueError, match=match):
        roc_points(*bad)


@pytest.mark.parametrize(
    "level, match",
    [
        (95, r"got 95\. Did you mean 0\.95\?"),
        (0.0, r"got 0\.0\.$"),
        (1.5, r"got 1\.5\. Did you mean 0\.015\?"),
        (-0.5, r"got -0\.5\.$"),
    ],
)
def test_tpr_level_must_be_a_fraction(level, match):
    with pytest.raises(ValueError, match=r"tpr_level is a fraction in \(0, 1\], " + match):
        ood_metrics([0.1], [0.2], tpr_level=level)


def _official_fpr95(id_scores, ood_scores):
    # the official test.py's estimator (YU1ut/UOOD-MCD), rewritten: FPR averaged over the thresholds
    # (distinct scores + 1e-4, and -0.1, 0, 2.1) whose TPR (ID accepted as score < t) is in [0.9495,
    # 0.9505]
    deltas = sorted(set([-0.1, 0.0, 2.1] + [float(v) + 1e-4 for v in np.r_[id_scores, ood_scores]]))
    fprs = [np.mean(ood_scores <= d) for d in deltas if 0.9495 <= np.mean(id_scores < d) <= 0.9505]
    return sum(fprs) / len(fprs) if fprs else float("nan")


def test_the_official_fpr95_averages_a_band_and_is_undefined_for_small_id_sets():
    rng = np.random.default_rng(0)
    ten_id = np.linspace(0.0, 0.9, 10)
    assert np.isnan(_official_fpr95(ten_id, np.array([0.5, 1.0])))  # TPR moves in steps of 0.1
    # ours: all 10 ID accepted at t = 0.9
    assert ood_metrics(ten_id, np.array([0.5, 1.0]))["fpr95"] == 0.5
    # 9,000 ID: several thresholds in the band
    s_id, s_ood = (rng.uniform(0, 1, 9000), rng.uniform(0.3, 1.3, 9000))
    deltas = np.unique(np.r_[s_id, s_ood]) + 1e-4
    in_band = [d for d in deltas if 0.9495 <= np.mean(s_id < d) <= 0.9505]
    assert len(in_band) > 5  # an average over many thresholds, not one point
    ours = ood_metrics(s_id, s_ood)["fpr95"]
    assert abs(_official_fpr95(s_id, s_ood) - ours) < 0.01 and _official_fpr95(s_id, s_ood) != ours
