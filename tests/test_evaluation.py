"""mcd_helpers.experiments.evaluation: every row's metrics, scores and ID accuracy recomputed from
the networks; ODIN's setting; the brute-force metrics themselves against a hand count and
sklearn."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pipeline_setup import LAST, TINY, brute_metrics
from sklearn.metrics import average_precision_score, roc_auc_score

from mcd_helpers.data import DEBIAN_FMNIST_DIR, FMNIST_STD
from mcd_helpers.experiments import evaluation
from mcd_helpers.experiments.stages import (
    RunOptions,
)
from mcd_helpers.metrics import METRIC_KEYS
from mcd_helpers.odin import odin_scores

needs_fmnist = pytest.mark.skipif(
    not DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed"
)
pytestmark = needs_fmnist
QUIET = RunOptions(progress=False, log=None)


def test_evaluates_scores_and_accuracy_recomputed_from_the_networks(run):
    res, _ = run  # res.scores: the last selection's (last-epoch)
    split, base = res.split, copy.deepcopy(res.models["base"]).eval()
    with torch.no_grad():
        l1 = base(split.test_id_x)[0], base(split.test_ood_x)[0]
        for name, fn in (
            ("msp", lambda z: 1 - F.softmax(z, 1).max(1).values),
            ("energy", lambda z: -z.logsumexp(1)),
        ):
            for got, logits in zip(res.scores[name], l1):
                torch.testing.assert_close(got, fn(logits), rtol=1e-5, atol=1e-6)
        for s in ("separate", "concat"):
            a, b = copy.deepcopy(res.models[s]).eval()(split.test_id_x)
            torch.testing.assert_close(
                res.scores[f"mcd:{s}"][0],
                (F.softmax(a, 1) - F.softmax(b, 1)).abs().sum(1),
                rtol=1e-5,
                atol=1e-6,
            )
            row = next(r for r in res.rows[5:] if r["strategy"] == s)
            assert row["id_accuracy"] == pytest.approx(
                (a.argmax(1) == split.test_id_y).double().mean().item(), abs=1e-7
            )
    acc = (l1[0].argmax(1) == split.test_id_y).double().mean().item()
    assert all(
        r["id_accuracy"] == pytest.approx(acc, abs=1e-7) for r in res.rows if r["method"] != "mcd"
    )


def test_odin_takes_the_best_validation_pair_of_the_grid_or_the_published_one_without_ood_labels(
    run, monkeypatch
):
    res, _ = run
    split, base = res.split, res.models["base"]
    by = {r["selection"]: r for r in res.rows if r["method"] == "odin"}
    # not in the grid
    assert (by["last-epoch"]["odin_temperature"], by["last-epoch"]["odin_epsilon"]) == (
        1000.0,
        0.0014,
    )
    val = {
        (t, e): brute_metrics(
            *(
                odin_scores(base, x, t, [e], FMNIST_STD)[0]
                for x in (split.val_id_x, split.val_ood_x)
            )
        )["auroc"]
        for t in TINY.odin_temperatures
        for e in TINY.odin_epsilons
    }
    chosen = (by["ood-labels"]["odin_temperature"], by["ood-labels"]["odin_epsilon"])
    assert chosen in val and val[chosen] == pytest.approx(max(val.values()), abs=1e-12)
    # what the test scores are computed with, and the networks are left as they were (ODIN's input
    # gradients)
    seen, real = [], evaluation.odin_scores
    monkeypatch.setattr(
        evaluation,
        "odin_scores",
        lambda m, x, t, eps, **kw: (
            seen.append((t, eps, kw["pixel_std"])) or real(m, x, t, eps, **kw)
        ),
    )
    before = copy.deepcopy(base.state_dict())
    evaluation.evaluate(LAST, base, {}, split, "gaussian", methods=("odin",))
    assert seen == [(1000.0, [0.0014], FMNIST_STD)] * 2  # the ID and the OOD test images
    for k, v in base.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_brute_force_metrics_agree_with_a_hand_count_and_with_scikit_learn():
    s_id = [0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9] * 2
    s_ood = [0.25, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95, 1.0, 1.1, 1.2]
    m = brute_metrics(s_id, s_ood)
    assert set(m) == set(METRIC_KEYS)
    # 95% of ID (19 of 20) first accepted at t = 0.9, where 6 of 10 OOD are accepted; at best half
    # the errors is 0.3
    assert (m["fpr95"], m["detection_error"]) == (pytest.approx(0.6), pytest.approx(0.3))
    rng = np.random.default_rng(0)
    s_id, s_ood = rng.integers(0, 8, 50) / 4, rng.integers(3, 12, 30) / 4  # many ties
    m, s, is_ood = brute_metrics(s_id, s_ood), np.r_[s_id, s_ood], np.r_[np.zeros(50), np.ones(30)]
    assert m["auroc"] == pytest.approx(roc_auc_score(is_ood, s), abs=1e-12)
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - is_ood, -s), abs=1e-12)
    assert m["aupr_out"] == pytest.approx(average_precision_score(is_ood, s), abs=1e-12)
