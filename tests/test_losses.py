"""mcd_helpers.losses against per-sample loops written here in plain Python (math), in nats."""

import math
import re

import pytest
import torch

from mcd_helpers.losses import (
    discrepancy_loss,
    discrepancy_score,
    energy_score,
    entropy,
    msp_score,
    step_b_objective,
    supervised_loss,
)

D = torch.float64


def softmax_row(row, t=1.0):
    z = [math.exp(v / t) for v in row]
    return [v / sum(z) for v in z]


def entropy_row(row):
    return -sum(p * math.log(p) for p in softmax_row(row) if p > 0)


def ce_row(row, y):
    return math.log(sum(math.exp(v) for v in row)) - row[y]


def rand_logits(n=6, k=5, seed=0, scale=3.0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=D) * scale


def test_entropy_is_per_sample_over_classes():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 5.0], [0.7, 0.7, 0.7]], dtype=D)
    want = [entropy_row(r) for r in logits.tolist()]
    torch.testing.assert_close(entropy(logits), torch.tensor(want, dtype=D), rtol=0, atol=1e-14)
    assert want[2] == pytest.approx(math.log(3))  # uniform: log K
    # one sample alone gives its own entropy (not a sum over the batch)
    assert entropy(logits[:1]).shape == (1,) and entropy(logits[:1]).item() == pytest.approx(
        want[0], abs=1e-14
    )


def test_entropy_is_finite_for_extreme_logits():
    h = entropy(torch.tensor([[1e4, -1e4, 0.0], [-1e30, -1e30, -1e30]]))
    assert torch.isfinite(h).all()
    assert h[0].item() == pytest.approx(0.0, abs=1e-6) and h[1].item() == pytest.approx(
        math.log(3), abs=1e-6
    )


def test_supervised_loss_is_the_sum_of_two_batch_mean_cross_entropies():
    l1, l2 = rand_logits(5, 3, 1), rand_logits(5, 3, 2)
    y = [0, 2, 1, 1, 0]
    want = sum(sum(ce_row(r, t) for r, t in zip(z.tolist(), y)) / 5 for z in (l1, l2))
    assert supervised_loss(l1, l2, torch.tensor(y)).item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_supervised_loss_takes_any_integer_label_dtype(dtype):
    l1, l2 = rand_logits(4, 3, 3), rand_logits(4, 3, 4)
    y = [2, 0, 1, 2]
    want = sum(sum(ce_row(r, t) for r, t in zip(z.tolist(), y)) / 4 for z in (l1, l2))
    assert supervised_loss(l1, l2, torch.tensor(y, dtype=dtype)).item() == pytest.approx(
        want, abs=1e-12
    )


@pytest.mark.parametrize(
    "args, error, match",
    [
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 3])),
            ValueError,
            r"labels.*\[0, 3\).*\[3\]",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([-1, 0])),
            ValueError,
            r"labels.*\[0, 3\).*\[-1\]",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0.0, 1.0])),
            ValueError,
            r"targets.*torch\.float32",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([True, False])),
            ValueError,
            r"targets.*torch\.bool",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), [0, 1]),
            ValueError,
            r"targets.*\[0, 1\]",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 1, 2])),
            ValueError,
            r"targets.*\(2,\).*\(3,\)",
        ),
        (
            (torch.zeros(2, 3), torch.zeros(2, 4), torch.tensor([0, 1])),
            ValueError,
            r"\(N, K\).*\[\(2, 3\), \(2, 4\)\]",
        ),
        (
            (torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
            ValueError,
            "supervised_loss.*empty batch",
        ),
        (
            (torch.zeros(2, 3), [[0.0] * 3] * 2, torch.tensor([0, 1])),
            TypeError,
            r"logits2.*torch\.Tensor.*\blist\b",
        ),
    ],
)
def test_supervised_loss_refuses_what_it_cannot_score(args, error, match):
    with pytest.raises(error, match=match):
        supervised_loss(*args)


def test_discrepancy_loss_is_the_hinge_of_the_batch_mean_gap():
    # F1 flat, F2 peaked: a positive gap
    l1, l2 = (rand_logits(7, 4, 5, 0.5), rand_logits(7, 4, 6, 4.0))
    gap = sum(entropy_row(a) - entropy_row(b) for a, b in zip(l1.tolist(), l2.tolist())) / 7
    assert 0 < gap < 1.2
    assert discrepancy_loss(l1, l2, margin=1.2).item() == pytest.approx(1.2 - gap, abs=1e-12)
    assert discrepancy_loss(l1, l2, margin=gap / 2).item() == 0.0
    # mean first, then the hinge (a hinge per sample would give 0.25 and 0.74 below)
    # H = log 4 and ~0
    flat, peaked = (torch.zeros(1, 4, dtype=D), torch.tensor([[50.0, 0, 0, 0]], dtype=D))
    # gap log(4)/2
    assert (
        discrepancy_loss(torch.cat([flat, peaked]), torch.cat([peaked, peaked]), 0.5).item() == 0.0
    )
    assert discrepancy_loss(
        torch.cat([flat, peaked]), torch.cat([peaked, flat]), 0.1
    ).item() == pytest.approx(0.1)


def test_discrepancy_loss_beyond_the_margin_has_zero_gradient():
    l1 = torch.zeros(3, 5, dtype=D, requires_grad=True)  # H = log 5 = 1.61
    l2 = torch.tensor([[30.0, 0, 0, 0, 0]] * 3, dtype=D, requires_grad=True)  # H ~ 0
    loss = discrepancy_loss(l1, l2, margin=1.2)
    loss.backward()
    assert loss.item() == 0.0 and l1.grad.abs().max() == 0 and l2.grad.abs().max() == 0


def test_discrepancy_loss_gradient_raises_f1_entropy_and_lowers_f2s():
    l1 = torch.tensor([[2.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    l2 = torch.tensor([[2.0, 0.0, 0.0]], dtype=D, requires_grad=True)
    discrepancy_loss(l1, l2).backward()
    h0 = entropy_row([2.0, 0.0, 0.0])
    assert (
        entropy_row((l1 - 0.1 * l1.grad)[0].tolist())
        > h0
        > entropy_row((l2 - 0.1 * l2.grad)[0].tolist())
    )


@pytest.mark.parametrize(
    "logits, margin, match",
    [
        (torch.zeros(0, 3), 1.2, "discrepancy_loss.*empty batch"),
        (
            torch.zeros(2, 3),
            -0.1,
            r"margin.*-0\.1.*\b1\.2\b",
        ),
        (torch.zeros(2, 3), float("nan"), "margin must be a finite number >= 0 nats.*got nan"),
        (torch.zeros(2, 3), float("inf"), r"margin.*\binf\b"),
        (torch.zeros(2, 3), 1e39, r"torch\.float32 \(3\.403e\+38\).*1e\+39"),
    ],
)
def test_discrepancy_loss_refuses_bad_batches_and_margins(logits, margin, match):
    with pytest.raises(ValueError, match=match):
        discrepancy_loss(logits, logits, margin)


def test_a_margin_beyond_float32_is_fine_in_float64():
    l1, l2 = rand_logits(3, 3, 7), rand_logits(3, 3, 8)
    gap = sum(entropy_row(a) - entropy_row(b) for a, b in zip(l1.tolist(), l2.tolist())) / 3
    assert discrepancy_loss(l1, l2, 1e39).item() == pytest.approx(1e39 - gap, rel=1e-15)


def test_step_b_objective_adds_both_losses_and_reports_detached_parts():
    l1s, l2s, l1u, l2u = (rand_logits(4, 3, s).requires_grad_() for s in (9, 10, 11, 12))
    y = [1, 0, 2, 2]
    ce = sum(sum(ce_row(r, t) for r, t in zip(z.tolist(), y)) / 4 for z in (l1s, l2s))
    gap = sum(entropy_row(a) - entropy_row(b) for a, b in zip(l1u.tolist(), l2u.tolist())) / 4
    loss, parts = step_b_objective([(l1s, l2s), (l1u, l2u)], torch.tensor(y), margin=2.0)
    assert loss.item() == pytest.approx(ce + max(2.0 - gap, 0.0), abs=1e-12)
    assert parts["ce"].item() == pytest.approx(ce, abs=1e-12) and parts[
        "gap"
    ].item() == pytest.approx(gap, abs=1e-12)
    assert parts["dis"].item() == pytest.approx(max(2.0 - gap, 0.0), abs=1e-12)
    assert not any(p.requires_grad for p in parts.values()) and loss.requires_grad


@pytest.mark.parametrize(
    "outputs", [[torch.zeros(2, 3)], [(torch.zeros(2, 3),), (torch.zeros(2, 3),)], None]
)
def test_step_b_objective_refuses_outputs_that_are_not_two_pairs(outputs):
    with pytest.raises(
        TypeError,
        match=r"(?s)\(logits1, logits2\).*TwoHeadNet",
    ):
        step_b_objective(outputs, torch.tensor([0, 1]))


def test_discrepancy_score_is_the_l1_distance_of_the_softmaxes():
    l1, l2 = rand_logits(20, 7, 13), rand_logits(20, 7, 14)
    want = [
        sum(abs(p - q) for p, q in zip(softmax_row(a), softmax_row(b)))
        for a, b in zip(l1.tolist(), l2.tolist())
    ]
    torch.testing.assert_close(
        discrepancy_score(l1, l2), torch.tensor(want, dtype=D), rtol=0, atol=1e-14
    )


@pytest.mark.parametrize(
    "l1, l2, want",
    [
        ([[0.3, -1.0, 2.0]], [[0.3, -1.0, 2.0]], 0.0),  # heads agree
        ([[40.0, 0, 0]], [[0, 0, 40.0]], 2.0),  # confident and disagreeing
        ([[0.0] * 10], [[60.0] + [0.0] * 9], 2 - 2 / 10),  # uniform vs one-hot: 2 - 2/K
    ],
)
def test_discrepancy_score_extremes(l1, l2, want):
    assert discrepancy_score(
        torch.tensor(l1, dtype=D), torch.tensor(l2, dtype=D)
    ).item() == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("t", [1.0, 2.0, 1000.0])
def test_msp_and_energy_scores_by_hand(t):
    logits = rand_logits(5, 4, 15)
    msp = [1 - max(softmax_row(r, t)) for r in logits.tolist()]
    energy = [-t * math.log(sum(math.exp(v / t) for v in r)) for r in logits.tolist()]
    torch.testing.assert_close(msp_score(logits, t), torch.tensor(msp, dtype=D), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        energy_score(logits, t), torch.tensor(energy, dtype=D), rtol=1e-12, atol=1e-12
    )


def test_scores_stay_in_their_documented_ranges():
    k = 6
    l1 = torch.cat([rand_logits(200, k, 16, 10.0), torch.zeros(1, k, dtype=D)])
    l2 = torch.cat(
        [rand_logits(200, k, 17, 10.0), torch.tensor([[80.0] + [0.0] * (k - 1)], dtype=D)]
    )
    h, d, m = entropy(l1), discrepancy_score(l1, l2), msp_score(l1)
    assert (
        h.min() >= 0
        and h.max() <= math.log(k) + 1e-12
        and h[-1].item() == pytest.approx(math.log(k))
    )
    assert d.min() >= 0 and d.max() <= 2 + 1e-12
    assert (
        m.min() >= 0 and m.max() <= 1 - 1 / k + 1e-12 and m[-1].item() == pytest.approx(1 - 1 / k)
    )


@pytest.mark.parametrize("score", [msp_score, energy_score])
@pytest.mark.parametrize("t", [0.0, -1.0, float("nan"), float("inf")])
def test_scores_refuse_a_temperature_that_is_not_positive_and_finite(score, t):
    with pytest.raises(ValueError, match=f"temperature T.*{re.escape(str(t))}"):
        score(torch.zeros(2, 3), t)


@pytest.mark.parametrize(
    "fn", [entropy, msp_score, energy_score, lambda x: discrepancy_score(x, x)]
)
def test_logits_must_be_a_2d_tensor(fn):
    with pytest.raises(ValueError, match=r"logits.*\(N, K\).*\[\(3,\)"):
        fn(torch.zeros(3))
    with pytest.raises(TypeError, match=r"logits1.*torch\.Tensor.*\blist\b"):
        fn([[0.0, 1.0]])


@pytest.mark.parametrize("share, k", [(0.5, 10), (1 / 3, 10), (0.4, 6), (797 / 9797, 10)])
def test_ood_share_alone_cannot_reach_the_margin(share, k):
    # Notebook 01: the batch-mean gap is at most share * log K + (1 - share) * g_ID, because a
    # sample's gap H(p1) - H(p2) lies in [-log K, log K]. Checked with the package's entropy and
    # discrepancy loss: OOD rows at the largest gap (F1 uniform, F2 one-hot), ID rows with equal
    # heads (gap 0).
    n = 9797 if share == 797 / 9797 else 30
    n_ood = round(share * n)
    one_hot = 200.0 * torch.eye(k)[:1].repeat(n, 1)
    f1 = torch.cat([torch.zeros(n_ood, k), one_hot[n_ood:]])
    loss = discrepancy_loss(f1, one_hot, margin=1.2)
    by_hand = 1.2 - n_ood / n * math.log(k)  # every setting of the notebook: below the margin
    assert by_hand > 0 and abs(loss.item() - by_hand) < 1e-4
    gen = torch.Generator().manual_seed(0)
    l1, l2 = torch.randn(500, k, generator=gen) * 5, torch.randn(500, k, generator=gen) * 5
    assert ((entropy(l1) - entropy(l2)).abs() <= math.log(k) + 1e-6).all()  # no sample beyond log K


def test_sharded_discrepancy_equals_the_global_one_only_while_the_hinge_is_open():
    # notebook 07: DDP averages per-rank losses; the hinge of each shard's mean gap, averaged over
    # two equal shards, is the hinge of the global mean only while no shard's gap passes the margin
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 3, generator=g, dtype=torch.float64)
    b = 4 * torch.randn(4, 3, generator=g, dtype=torch.float64)

    def h(z):  # entropy by hand, nats
        p = z.softmax(1)
        return -(p * p.log()).sum(1)

    shard = [(h(a[:2]) - h(b[:2])).mean().item(), (h(a[2:]) - h(b[2:])).mean().item()]
    whole_mean = sum(shard) / 2
    assert shard[0] != shard[1]
    for m in (max(shard) + 0.1, (max(shard) + whole_mean) / 2):  # open on both; closed on one
        sharded = (discrepancy_loss(a[:2], b[:2], m) + discrepancy_loss(a[2:], b[2:], m)) / 2
        whole = discrepancy_loss(a, b, m)
        assert whole.item() == pytest.approx(m - whole_mean, abs=1e-12)
        assert (abs(sharded - whole).item() < 1e-12) == (m > max(shard)), (shard, m)
