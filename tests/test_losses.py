import math

import pytest
import torch
import torch.nn.functional as F

from mcd_helpers.losses import (discrepancy_loss, discrepancy_score, energy_score, entropy, msp_score,
                                supervised_loss)


@pytest.mark.parametrize("k", [2, 10, 100])
def test_entropy_of_uniform_logits_is_log_k(k):
    logits = torch.full((3, k), 0.7, dtype=torch.float64)
    torch.testing.assert_close(entropy(logits), torch.full((3,), math.log(k), dtype=torch.float64))


def test_entropy_matches_hand_computation_per_sample():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 5.0]], dtype=torch.float64)
    expected = []
    for row in logits.tolist():
        z = sum(math.exp(v) for v in row)
        p = [math.exp(v) / z for v in row]
        expected.append(-sum(q * math.log(q) for q in p))
    torch.testing.assert_close(entropy(logits), torch.tensor(expected, dtype=torch.float64))


def test_entropy_is_over_classes_not_batch():
    # OpenOOD's port summed over the batch axis; a (1, K) batch tells the two apart.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    assert entropy(logits).shape == (1,)
    assert entropy(logits).item() == pytest.approx(math.log(4))


def test_entropy_finite_for_extreme_logits():
    h = entropy(torch.tensor([[1e4, -1e4, 0.0]]))
    assert torch.isfinite(h).all() and h.item() == pytest.approx(0.0, abs=1e-6)


def test_supervised_loss_is_sum_of_two_cross_entropies():
    l1, l2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0])
    manual = sum(-(l.log_softmax(1)[torch.arange(5), y]).mean() for l in (l1, l2))
    torch.testing.assert_close(supervised_loss(l1, l2, y), manual)


@pytest.mark.parametrize("labels", [[0, 3], [-1, 0]])
def test_supervised_loss_rejects_labels_out_of_range(labels):
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        supervised_loss(torch.randn(2, 3), torch.randn(2, 3), torch.tensor(labels))


def test_supervised_loss_rejects_float_labels_and_shape_mismatch():
    with pytest.raises(ValueError, match="integer"):
        supervised_loss(torch.randn(2, 3), torch.randn(2, 3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="same shape"):
        supervised_loss(torch.randn(2, 3), torch.randn(2, 4), torch.tensor([0, 1]))


def test_discrepancy_loss_mean_then_hinge():
    l1 = torch.zeros(2, 4, dtype=torch.float64)  # H = log 4 for both samples
    l2 = torch.tensor([[50.0, 0, 0, 0], [0.0, 0, 0, 0]], dtype=torch.float64)  # H = ~0 and log 4
    gap = (math.log(4) - 0.0 + math.log(4) - math.log(4)) / 2
    assert discrepancy_loss(l1, l2, margin=1.2).item() == pytest.approx(1.2 - gap, abs=1e-9)
    # Hinge after the mean: a big gap on one sample can cover a negative gap on another.
    assert discrepancy_loss(l1, l2, margin=0.5).item() == 0.0


def test_discrepancy_loss_hinge_clamps_at_zero_with_zero_gradient():
    l1 = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)  # high entropy
    l2 = torch.tensor([[30.0, 0, 0, 0, 0]] * 3, dtype=torch.float64, requires_grad=True)  # ~0
    loss = discrepancy_loss(l1, l2, margin=1.2)  # gap = log 5 = 1.61 > 1.2
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(l1.grad) == 0 and torch.count_nonzero(l2.grad) == 0


def test_discrepancy_loss_gradient_pushes_f1_up_and_f2_down_in_entropy():
    l1 = torch.tensor([[2.0, 0.0, 0.0]], requires_grad=True)
    l2 = torch.tensor([[2.0, 0.0, 0.0]], requires_grad=True)
    discrepancy_loss(l1, l2).backward()
    with torch.no_grad():
        h1_after = entropy(l1 - 0.1 * l1.grad)
        h2_after = entropy(l2 - 0.1 * l2.grad)
        h0 = entropy(torch.tensor([[2.0, 0.0, 0.0]]))
    assert h1_after > h0 > h2_after


def test_discrepancy_loss_errors():
    with pytest.raises(ValueError, match="empty"):
        discrepancy_loss(torch.zeros(0, 3), torch.zeros(0, 3))
    with pytest.raises(ValueError, match="margin"):
        discrepancy_loss(torch.zeros(1, 3), torch.zeros(1, 3), margin=-1)


def test_discrepancy_score_identical_heads_is_zero():
    l = torch.randn(6, 10, dtype=torch.float64)
    torch.testing.assert_close(discrepancy_score(l, l.clone()), torch.zeros(6, dtype=torch.float64))


def test_discrepancy_score_confident_disagreeing_heads_is_about_two():
    l1 = torch.tensor([[40.0, 0, 0], [0, 40.0, 0]])
    l2 = torch.tensor([[0, 0, 40.0], [40.0, 0, 0]])
    torch.testing.assert_close(discrepancy_score(l1, l2), torch.tensor([2.0, 2.0]))


def test_discrepancy_score_uniform_vs_one_hot_is_two_minus_two_over_k():
    k = 10
    l1, l2 = torch.zeros(1, k), torch.tensor([[60.0] + [0.0] * (k - 1)])
    assert discrepancy_score(l1, l2).item() == pytest.approx(2 - 2 / k, abs=1e-6)


def test_discrepancy_score_matches_numpy_and_range():
    l1, l2 = torch.randn(100, 7), torch.randn(100, 7) * 3
    p1 = l1.softmax(1).numpy(); p2 = l2.softmax(1).numpy()
    expected = abs(p1 - p2).sum(1)
    got = discrepancy_score(l1, l2)
    torch.testing.assert_close(got, torch.from_numpy(expected))
    assert (got >= 0).all() and (got <= 2).all()


def test_msp_and_energy_scores_by_hand():
    logits = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # softmax (0.75, 0.25)
    assert msp_score(logits).item() == pytest.approx(0.25)
    assert energy_score(logits).item() == pytest.approx(-math.log(4.0))


def test_logits_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        entropy(torch.zeros(3))


def test_supervised_loss_takes_any_integer_label_dtype_and_refuses_an_empty_batch():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    want = F.cross_entropy(logits, torch.tensor([0, 1])) * 2  # both heads get the same logits
    for dtype in (torch.int32, torch.uint8, torch.int64):
        torch.testing.assert_close(supervised_loss(logits, logits, torch.tensor([0, 1], dtype=dtype)), want)
    with pytest.raises(ValueError, match="empty batch"):
        supervised_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize("margin", [float("nan"), float("inf"), -0.1])
def test_discrepancy_loss_refuses_a_margin_that_is_not_finite_and_non_negative(margin):
    with pytest.raises(ValueError, match="margin"):
        discrepancy_loss(torch.zeros(2, 3), torch.zeros(2, 3), margin)


@pytest.mark.parametrize("score", [msp_score, energy_score])
@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_scores_refuse_a_temperature_that_is_not_positive_and_finite(score, temperature):
    with pytest.raises(ValueError, match="temperature"):
        score(torch.zeros(2, 3), temperature)


def test_a_margin_beyond_float32_is_refused_not_blamed_on_the_learning_rate():
    # Finding 8: --margin 1e39 was accepted, became inf in float32 and ended as "non-finite loss ... lower the lr".
    from mcd_helpers.losses import discrepancy_loss

    l1, l2 = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"margin=1e\+39 nats is larger than the largest torch.float32 number"):
        discrepancy_loss(l1, l2, 1e39)
    # In float64 it is representable: the hinge is then margin - gap, finite.
    assert torch.isfinite(discrepancy_loss(l1.double(), l2.double(), 1e39))
