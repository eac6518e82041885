"""ood_metrics against brute-force counts over every threshold, and against sklearn."""
import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from mcd_helpers.metrics import METRIC_KEYS, ood_metrics, roc_points


def brute_force(s_id, s_ood):
    """Direct definitions: accept as ID when score <= t, t over every observed score (and -inf)."""
    s_id, s_ood = np.asarray(s_id, float), np.asarray(s_ood, float)
    thresholds = [-np.inf] + sorted(set(s_id) | set(s_ood))
    tpr = [np.mean(s_id <= t) for t in thresholds]
    fpr = [np.mean(s_ood <= t) for t in thresholds]
    fpr95 = next(f for t, f in zip(tpr, fpr) if t >= 0.95)
    det = min(0.5 * (1 - t) + 0.5 * f for t, f in zip(tpr, fpr))
    pairs = [(o > i) + 0.5 * (o == i) for o in s_ood for i in s_id]
    return {"fpr95": fpr95, "detection_error": det, "auroc": float(np.mean(pairs))}


def brute_ap(scores, positive):
    """Average precision by hand: mean over positives of precision at their (tie-grouped) rank."""
    scores, positive = np.asarray(scores, float), np.asarray(positive, bool)
    ap = 0.0
    for t in sorted(set(scores), reverse=True):
        at = scores == t
        sel = scores >= t
        prec = positive[sel].mean()
        ap += prec * positive[at].sum()
    return ap / positive.sum()


CASES = {
    "separated": ([0.1, 0.2, 0.3], [0.8, 0.9]),
    "ties_across": ([0.1, 0.5, 0.5, 0.5, 0.9], [0.5, 0.5, 0.7, 1.0]),
    "all_equal": ([1.0] * 4, [1.0] * 3),
    "reversed": ([0.9, 0.8], [0.1, 0.2, 0.3]),
    "integers_many_ties": (list(np.random.RandomState(0).randint(0, 5, 40)),
                           list(np.random.RandomState(1).randint(2, 8, 30))),
    "random_floats": (list(np.random.RandomState(2).randn(60)), list(np.random.RandomState(3).randn(50) + 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_against_brute_force(name):
    s_id, s_ood = CASES[name]
    got, want = ood_metrics(s_id, s_ood), brute_force(s_id, s_ood)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    assert got["aupr_in"] == pytest.approx(brute_ap(-np.asarray(s_id + s_ood, float),
                                                    [1] * len(s_id) + [0] * len(s_ood)), abs=1e-12)
    assert got["aupr_out"] == pytest.approx(brute_ap(np.asarray(s_id + s_ood, float),
                                                     [0] * len(s_id) + [1] * len(s_ood)), abs=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_auroc_against_sklearn(name):
    s_id, s_ood = CASES[name]
    y = [0] * len(s_id) + [1] * len(s_ood)
    assert ood_metrics(s_id, s_ood)["auroc"] == pytest.approx(roc_auc_score(y, list(s_id) + list(s_ood)))


def test_perfect_separation_known_answer():
    m = ood_metrics([0, 0.1, 0.2], [1, 2])
    assert m == {"fpr95": 0.0, "detection_error": 0.0, "auroc": 1.0, "aupr_in": 1.0, "aupr_out": 1.0}


def test_fpr95_by_hand_with_twenty_id_samples():
    # 20 ID scores 1..20: TPR reaches 0.95 at t=19. OOD at 5, 18.5, 19 (tie), 30: 3 of 4 accepted.
    m = ood_metrics(list(range(1, 21)), [5, 18.5, 19, 30])
    assert m["fpr95"] == 0.75


def test_fpr_is_over_ood_only():
    # Every OOD scored below every ID: at TPR 95% all OOD are accepted, FPR = 1 (fp / (fp + tn)).
    assert ood_metrics([5, 6, 7], [1, 2])["fpr95"] == 1.0


def test_accepts_lists_arrays_tensors_alike():
    a, b = [0.1, 0.4, 0.35], [0.8, 0.3]
    ref = ood_metrics(a, b)
    assert ood_metrics(np.array(a), np.array(b)) == ref
    assert ood_metrics(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)) == ref
    assert set(ref) == set(METRIC_KEYS)
    assert all(0.0 <= v <= 1.0 for v in ref.values())


@pytest.mark.parametrize("bad, match", [
    (([], [1.0]), "empty"),
    (([1.0], []), "empty"),
    (([1.0, float("nan")], [1.0]), "non-finite"),
    (([1.0], [float("inf")]), "non-finite"),
    (([[1.0, 2.0]], [1.0]), "1-D"),
])
def test_bad_input_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        ood_metrics(*bad)


def test_tpr_level_must_be_a_fraction():
    with pytest.raises(ValueError, match="0.95"):
        ood_metrics([0.1], [0.2], tpr_level=95)


def test_roc_points_start_at_origin_and_end_at_one():
    fpr, tpr = roc_points([0.1, 0.5, 0.5], [0.5, 0.9])
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    # one point per unique threshold (0.1, 0.5, 0.9) plus the origin: ties are not split
    assert len(fpr) == 4
