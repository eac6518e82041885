"""mcd_helpers.running_stats: steady states against nn.BatchNorm2d and the package's fine-tuning
loop run to convergence, and formulas by hand."""

import pytest
import torch
from torch import nn

from mcd_helpers import running_stats
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.experiments.loop import train
from mcd_helpers.models import TwoHeadNet
from mcd_helpers.splits import Split

D = torch.float64


def two_batches(n_s=6, n_u=5, std_u=2.0, shift_u=-1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_s, 3, 4, 4, generator=g, dtype=D) + 1.0,
        std_u * torch.randn(n_u, 3, 4, 4, generator=g, dtype=D) + shift_u,
    )


def per_channel(h):
    return h.transpose(0, 1).reshape(h.shape[1], -1)  # (C, N * H * W)


def mean_var(h, unbiased):
    v = per_channel(h)
    return v.mean(1), v.var(1, unbiased=unbiased)


@pytest.mark.parametrize("momentum, steps", [(0.1, 400), (0.5, 60), (None, 50)])
@pytest.mark.parametrize("strategy", ["concat", "separate"])
@pytest.mark.parametrize("schedule", ["official", "step_b"])
def test_steady_state_is_where_batchnorm_settles(strategy, momentum, steps, schedule):
    h_sup, h_unsup = two_batches()
    bn = running_stats.run_bn_steps(
        nn.BatchNorm2d(3, momentum=momentum).double(), h_sup, h_unsup, strategy, steps, schedule
    )
    want = running_stats.steady_state(h_sup, h_unsup, strategy, momentum, schedule)
    torch.testing.assert_close(bn.running_mean, want["mean"], rtol=0, atol=1e-12)
    torch.testing.assert_close(bn.running_var, want["var"], rtol=0, atol=1e-12)
    # Step A: one more forward
    per_step = (1 if strategy == "concat" else 2) + (schedule == "official")
    assert int(bn.num_batches_tracked) == steps * per_step


@pytest.mark.parametrize("strategy", ["separate", "concat"])
@pytest.mark.parametrize("schedule", ["official", "step_b"])
def test_fine_tuning_settles_where_steady_state_says(strategy, schedule):
    # a BatchNorm on the images themselves: its inputs, so its fixed point, do not move with the
    # weights
    g = torch.Generator().manual_seed(1)
    x_sup, y_sup = torch.randn(8, 1, 4, 4, generator=g, dtype=D) + 1.0, torch.arange(8) % 2
    x_unsup = 2.0 * torch.randn(8, 1, 4, 4, generator=g, dtype=D) - 1.0
    torch.manual_seed(0)
    net = TwoHeadNet(
        nn.Sequential(nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(16, 4)), 4, 2, 1
    ).double()
    # one batch a stream
    split = Split(x_sup, y_sup, x_unsup, x_sup, y_sup, x_unsup, x_sup, y_sup, x_unsup)
    cfg = MCDConfig(
        seed=0, finetune_epochs=250, batch_size_sup=8, batch_size_unsup=8, schedule=schedule
    )
    # one iteration an epoch: the same two batches each time
    train(net, split, cfg, strategy, progress=False)
    bn, want = net.G[0], running_stats.steady_state(x_sup, x_unsup, strategy, schedule=schedule)
    torch.testing.assert_close(bn.running_mean, want["mean"], rtol=0, atol=1e-10)
    torch.testing.assert_close(bn.running_var, want["var"], rtol=0, atol=1e-10)
    other = running_stats.steady_state(
        x_sup, x_unsup, strategy, schedule={"official": "step_b"}.get(schedule, "official")
    )
    assert (bn.running_mean - other["mean"]).abs().max() > 0.05  # the schedules settle apart


@pytest.mark.parametrize(
    "strategy, schedule, w_sup",
    [
        ("separate", "official", 0.171 / 0.271),
        ("concat", "official", (0.09 + 0.05) / 0.19),  # equal batch sizes
        ("separate", "step_b", 0.09 / 0.19),
        ("concat", "step_b", 0.5),
    ],
)
def test_the_labeled_batch_weighs_in_the_running_mean_as_the_schedule_says(
    strategy, schedule, w_sup
):
    h_sup, h_unsup = two_batches(n_s=6, n_u=6)
    (m_s, _), (m_u, _) = mean_var(h_sup, True), mean_var(h_unsup, True)
    got = running_stats.steady_state(h_sup, h_unsup, strategy, schedule=schedule)["mean"]
    torch.testing.assert_close(got, w_sup * m_s + (1 - w_sup) * m_u, rtol=0, atol=1e-14)


def test_separate_steady_state_is_the_0_09_0_1_blend_of_within_batch_statistics():
    h_sup, h_unsup = two_batches()
    (m_s, v_s), (m_u, v_u) = mean_var(h_sup, True), mean_var(h_unsup, True)
    got = running_stats.steady_state(h_sup, h_unsup, "separate", schedule="step_b")
    torch.testing.assert_close(got["mean"], (0.09 * m_s + 0.1 * m_u) / 0.19, rtol=0, atol=1e-14)
    torch.testing.assert_close(got["var"], (0.09 * v_s + 0.1 * v_u) / 0.19, rtol=0, atol=1e-14)
    # the pooled statistics, unbiased
    cat = running_stats.steady_state(h_sup, h_unsup, "concat", schedule="step_b")
    m_c, v_c = mean_var(torch.cat([h_sup, h_unsup]), True)
    torch.testing.assert_close(cat["mean"], m_c, rtol=0, atol=1e-14)
    torch.testing.assert_close(cat["var"], v_c, rtol=0, atol=1e-14)
    # equal weights
    none = running_stats.steady_state(h_sup, h_unsup, "separate", momentum=None, schedule="step_b")
    torch.testing.assert_close(none["mean"], (m_s + m_u) / 2, rtol=0, atol=1e-14)
    # Step A's labeled forward counts too
    none = running_stats.steady_state(h_sup, h_unsup, "separate", momentum=None)
    torch.testing.assert_close(none["mean"], (2 * m_s + m_u) / 3, rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "n_s, n_u, std_u, shift_u, separate_larger",
    [
        # means equal: the larger spread weighs 0.53 in the blend, only 1/3 in the pool
        (8, 4, 3.0, 1.0, True),
        # equal spreads, means 3 apart: the pool gains the between-batch term (2.0)
        (8, 4, 1.0, 4.0, False),
    ],
)
def test_separate_running_var_can_lie_above_or_below_the_pooled_one(
    n_s, n_u, std_u, shift_u, separate_larger
):
    h_s, h_u = two_batches(n_s, n_u, std_u, shift_u)
    sep = running_stats.steady_state(h_s, h_u, "separate", schedule="step_b")["var"]
    cat = running_stats.steady_state(h_s, h_u, "concat", schedule="step_b")["var"]
    assert ((sep - cat).min() > 0.5) if separate_larger else ((cat - sep).min() > 1.0)


def test_batch_stats_pooled_variance_and_unbiased_by_hand():
    h_sup, h_unsup = two_batches()
    (m_s, v_s, n_s), (m_u, v_u, n_u) = (
        running_stats.batch_stats(h_sup),
        running_stats.batch_stats(h_unsup),
    )
    assert (n_s, n_u) == (6 * 16, 5 * 16)
    torch.testing.assert_close((m_s, v_s), mean_var(h_sup, False), rtol=0, atol=1e-14)
    pooled = running_stats.pooled_variance(m_s, v_s, n_s, m_u, v_u, n_u)
    torch.testing.assert_close(
        pooled, mean_var(torch.cat([h_sup, h_unsup]), False)[1], rtol=0, atol=1e-12
    )
    # the between-group term, means ~2.5 apart
    assert (pooled - (n_s * v_s + n_u * v_u) / (n_s + n_u)).min() > 0.5
    v = torch.ones(3, dtype=D)
    # one group alone
    torch.testing.assert_close(running_stats.pooled_variance(v, 2 * v, 0, v, 3 * v, 5), 3 * v)
    torch.testing.assert_close(running_stats.unbiased(v, 2), 2 * v)
    torch.testing.assert_close(
        running_stats.unbiased(v_s, n_s), mean_var(h_sup, True)[1], rtol=0, atol=1e-14
    )


def test_ema_fixed_point_by_hand():
    v1, v2, v3 = (torch.tensor([x, -x], dtype=D) for x in (1.0, 2.0, 4.0))
    torch.testing.assert_close(running_stats.ema_fixed_point([v1], 0.3), v1)
    torch.testing.assert_close(
        running_stats.ema_fixed_point([v1, v2], 0.1), (0.09 * v1 + 0.1 * v2) / 0.19
    )
    r = torch.zeros(2, dtype=D)
    for _ in range(300):  # iterate the updates themselves
        for v in (v1, v2, v3):
            r = 0.8 * r + 0.2 * v
    torch.testing.assert_close(
        running_stats.ema_fixed_point([v1, v2, v3], 0.2), r, rtol=0, atol=1e-12
    )


def test_train_eval_mismatch_by_hand():
    h_sup, h_unsup = two_batches()
    eps = 1e-5
    sep = running_stats.train_eval_mismatch(h_sup, h_unsup, "separate", eps=eps, schedule="step_b")
    cat = running_stats.train_eval_mismatch(h_sup, h_unsup, "concat", eps=eps, schedule="step_b")
    # train mode: each part's mean normalises to 0 (its own statistics); eval: with the (0.09, 0.1)
    # / 0.19 blend
    (m_s, v_s), (m_u, v_u) = mean_var(h_sup, True), mean_var(h_unsup, True)
    r_mean, r_var = (0.09 * m_s + 0.1 * m_u) / 0.19, (0.09 * v_s + 0.1 * v_u) / 0.19
    for part, m_p in (("sup", m_s), ("unsup", m_u)):
        torch.testing.assert_close(
            sep[part], ((m_p - r_mean) / (r_var + eps).sqrt()).abs().max(), rtol=0, atol=1e-12
        )
        assert sep[part] > 0.3
    # concat: both modes use the pooled mean; only Bessel's n / (n - 1) differs
    m_c, v_c = mean_var(torch.cat([h_sup, h_unsup]), False)
    for part, m_p in (("sup", m_s), ("unsup", m_u)):
        want = ((m_p - m_c) * ((v_c * 176 / 175 + eps).rsqrt() - (v_c + eps).rsqrt())).abs().max()
        torch.testing.assert_close(cat[part], want, rtol=0, atol=1e-12)
        assert cat[part] < 0.02
    # official: Step A's labeled forward pulls the running mean to (0.09 m_s + 0.1 m_cat) / 0.19,
    # away from the pooled mean concat's Step B normalises with: a mismatch of its own
    official = running_stats.train_eval_mismatch(h_sup, h_unsup, "concat", eps=eps)
    r_mean, r_var = (0.09 * m_s + 0.1 * m_c) / 0.19, (0.09 * v_s + 0.1 * v_c * 176 / 175) / 0.19
    for part, m_p in (("sup", m_s), ("unsup", m_u)):
        want = (
            ((m_p - r_mean) / (r_var + eps).sqrt() - (m_p - m_c) / (v_c + eps).sqrt()).abs().max()
        )
        torch.testing.assert_close(official[part], want, rtol=0, atol=1e-12)
        assert official[part] > 0.1 > 5 * cat[part]  # here 0.21 and above, against below 0.02


H_SUP, H_UNSUP = two_batches()


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "interleave"),
            "strategy.*'concat'.*'separate'.*'interleave'",
        ),
        (
            lambda: running_stats.train_eval_mismatch(H_SUP, H_UNSUP, "mixed"),
            "strategy.*'concat'.*'separate'.*'mixed'",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "concat", schedule="step_a"),
            "schedule.*'official'.*'concat'.*'step_a'",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "separate", 1.5),
            r"momentum.*\(0, 1\].*1\.5",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "separate", 0.0),
            r"momentum.*\(0, 1\].*0\.0",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "concat", "0.1"),
            r"momentum.*'0\.1'",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP, "concat", True),
            r"momentum.*\bTrue\b",
        ),
        (
            lambda: running_stats.steady_state(H_SUP, H_UNSUP[:, :2], "separate"),
            r"h_sup \(6, 3, 4, 4\).*h_unsup \(5, 2, 4, 4\)",
        ),
        (
            lambda: running_stats.run_bn_steps(
                nn.BatchNorm2d(3).double(), H_SUP, H_UNSUP.float(), "separate", 2
            ),
            r"\(torch\.float64, torch\.float32\)",
        ),
        (
            lambda: running_stats.train_eval_mismatch(H_SUP, H_UNSUP, "separate", eps=-1.0),
            r"eps.*-1\.0",
        ),
        (
            lambda: running_stats.train_eval_mismatch(H_SUP, H_UNSUP, "separate", eps=float("inf")),
            r"eps.*\binf\b",
        ),
        (
            lambda: running_stats.ema_fixed_point([], 0.1),
            r"\bvalues\b",
        ),
        (
            lambda: running_stats.ema_fixed_point([torch.ones(3), torch.ones(2, 1)], 0.1),
            r"\bvalues\b",
        ),
        (
            lambda: running_stats.ema_fixed_point([torch.ones(3)], None),
            r"momentum=None.*steady_state\(\.\.\., momentum=None\)",
        ),
        (
            lambda: running_stats.ema_fixed_point([torch.ones(3)], 2.0),
            r"momentum.*\(0, 1\].*2\.0",
        ),
        (lambda: running_stats.unbiased(torch.ones(3), 1), r"^n\b.*>= 2.*\b1\b"),
        (lambda: running_stats.unbiased(torch.ones(3), 2.5), r"^n\b.*2\.5"),
        (lambda: running_stats.pooled_variance(1.0, 1.0, 0, 1.0, 1.0, 0), r"n_a \+ n_b > 0"),
        (
            lambda: running_stats.pooled_variance(1.0, 1.0, -1, 1.0, 1.0, 3),
            r"n_a\b.*>= 0.*-1",
        ),
        (
            lambda: running_stats.pooled_variance(
                torch.ones(3), torch.ones(3), 2, torch.ones(2), torch.ones(2), 3
            ),
            "pooled_variance",
        ),
    ],
)
def test_formulas_refuse_undefined_cases(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "h, match",
    [
        (torch.zeros(1, 3), r"\(1, 3\)"),
        (
            torch.tensor([[0.0, 1.0], [float("nan"), 2.0]]),
            r"torch\.float32 \(2, 2\)",
        ),
        (
            torch.tensor([[0.0, 1.0], [float("inf"), 2.0]]),
            r"torch\.float32 \(2, 2\)",
        ),
        (torch.zeros(0, 3, 4, 4), r"\(0, 3, 4, 4\)"),
        (torch.zeros(4, 3, 0, 2), r"\(4, 3, 0, 2\)"),
        (
            torch.zeros(4, 0),
            r"\(N, C, \*spatial\).*torch\.float32 \(4, 0\)",
        ),
        (torch.zeros(4), r"torch\.float32 \(4,\)"),
        (torch.ones(4, 3, dtype=torch.long), r"torch\.int64"),
        ([[1.0, 2.0]], r"\blist\b"),
    ],
)
def test_every_entry_point_checks_each_input(h, match):
    with pytest.raises(ValueError, match="h_sup .*" + match):
        running_stats.batch_stats(h)
    # a valid input: each is checked before the two are compared
    partner = torch.randn(4, 3, dtype=D)
    for fn in (running_stats.steady_state, running_stats.train_eval_mismatch):
        with pytest.raises(ValueError, match="h_sup .*" + match):
            fn(h, partner, "separate")
        with pytest.raises(ValueError, match="h_unsup .*" + match):
            fn(partner, h, "concat")


@pytest.mark.parametrize(
    "make_bn, steps, match",
    [
        (
            lambda: nn.Linear(3, 3),
            2,
            r"^bn\b.*Linear\(",
        ),
        (
            lambda: nn.BatchNorm2d(3, track_running_stats=False),
            2,
            r"track_running_stats=True\).*track_running_stats=False",
        ),
        (lambda: nn.BatchNorm2d(3).eval(), 2, r"bn\.train\(\)"),
        (lambda: nn.BatchNorm2d(5), 2, r"\b5\b.*torch\.float64.*\b3\b"),
        (lambda: nn.BatchNorm2d(3), 0, r"steps.*>= 1.*\b0\b"),
        (lambda: nn.BatchNorm2d(3), 2.5, r"steps.*2\.5"),
        (lambda: nn.BatchNorm2d(3), True, r"steps.*\bTrue\b"),
    ],
)
def test_run_bn_steps_refuses_before_running_anything(make_bn, steps, match):
    bn = make_bn().double()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        running_stats.run_bn_steps(bn, H_SUP, H_UNSUP, "separate", steps)
    assert all(torch.equal(v, bn.state_dict()[k]) for k, v in before.items())


def test_run_bn_steps_refuses_a_layer_of_another_dtype_before_counting_a_batch():
    # float32, the inputs float64: BatchNorm itself would fail after counting one batch
    bn = nn.BatchNorm2d(3)
    with pytest.raises(ValueError, match=r"torch\.float32.*torch\.float64"):
        running_stats.run_bn_steps(bn, H_SUP, H_UNSUP, "separate", 2)
    assert int(bn.num_batches_tracked) == 0
