"""mcd_helpers.bn_stats: steady states checked against nn.BatchNorm2d run to convergence, and by hand."""
import pytest
import torch
from torch import nn

from mcd_helpers import bn_stats


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    h_sup = torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64) + 1.0
    h_unsup = 2.0 * torch.randn(5, 3, 4, 4, generator=g, dtype=torch.float64) - 1.5
    return h_sup, h_unsup


def _converged_bn(h_sup, h_unsup, strategy, momentum=0.1, steps=400):
    bn = nn.BatchNorm2d(3, momentum=momentum).double()
    return bn_stats.run_bn_steps(bn, h_sup, h_unsup, strategy, steps)


@pytest.mark.parametrize("strategy", ["concat", "separate"])
def test_steady_state_matches_batchnorm_run_to_convergence(strategy):
    h_sup, h_unsup = _batches()
    bn = _converged_bn(h_sup, h_unsup, strategy)
    pred = bn_stats.steady_state(h_sup, h_unsup, strategy)
    torch.testing.assert_close(bn.running_mean, pred["mean"], rtol=0, atol=1e-12)
    torch.testing.assert_close(bn.running_var, pred["var"], rtol=0, atol=1e-12)


def test_separate_mean_is_the_0_09_0_1_blend_by_hand():
    h_sup, h_unsup = _batches()
    mu_s, mu_u = h_sup.mean(dim=(0, 2, 3)), h_unsup.mean(dim=(0, 2, 3))
    pred = bn_stats.steady_state(h_sup, h_unsup, "separate", momentum=0.1)
    torch.testing.assert_close(pred["mean"], (0.09 * mu_s + 0.1 * mu_u) / 0.19, rtol=0, atol=1e-14)
    # the variance blends the within-batch (unbiased) variances: no between-batch term
    v_s, v_u = h_sup.var(dim=(0, 2, 3)), h_unsup.var(dim=(0, 2, 3))
    torch.testing.assert_close(pred["var"], (0.09 * v_s + 0.1 * v_u) / 0.19, rtol=0, atol=1e-14)


def test_pooled_variance_has_the_between_group_term():
    h_sup, h_unsup = _batches()
    (m_s, v_s, n_s), (m_u, v_u, n_u) = bn_stats.batch_stats(h_sup), bn_stats.batch_stats(h_unsup)
    direct = torch.cat([h_sup, h_unsup]).var(dim=(0, 2, 3), unbiased=False)
    torch.testing.assert_close(bn_stats.pooled_variance(m_s, v_s, n_s, m_u, v_u, n_u), direct, rtol=0, atol=1e-12)
    within_only = (n_s * v_s + n_u * v_u) / (n_s + n_u)
    assert (direct - within_only).min() > 0.5  # the batches' means differ by ~2.5: a large between term


def test_momentum_none_cumulative_average_weights_each_forward_equally():
    h_sup, h_unsup = _batches()
    for strategy in ("concat", "separate"):
        bn = _converged_bn(h_sup, h_unsup, strategy, momentum=None, steps=50)
        pred = bn_stats.steady_state(h_sup, h_unsup, strategy, momentum=None)
        torch.testing.assert_close(bn.running_mean, pred["mean"], rtol=0, atol=1e-12)
        assert int(bn.num_batches_tracked) == (50 if strategy == "concat" else 100)
    mu_s, mu_u = h_sup.mean(dim=(0, 2, 3)), h_unsup.mean(dim=(0, 2, 3))
    torch.testing.assert_close(bn_stats.steady_state(h_sup, h_unsup, "separate", None)["mean"], (mu_s + mu_u) / 2)


@pytest.mark.parametrize("momentum, matters", [(0.1, False), (None, True)])
def test_num_batches_tracked_matters_only_with_momentum_none(momentum, matters):
    h_sup, _ = _batches()
    after = []
    for tracked in (1, 9):
        bn = nn.BatchNorm2d(3, momentum=momentum).double()
        bn.running_mean.fill_(0.5)
        bn.num_batches_tracked.fill_(tracked)
        with torch.no_grad():
            bn(h_sup)
        after.append(bn.running_mean.clone())
    assert (not torch.equal(*after)) == matters


def test_train_eval_mismatch_separate_only():
    h_sup, h_unsup = _batches()
    sep = bn_stats.train_eval_mismatch(h_sup, h_unsup, "separate")
    cat = bn_stats.train_eval_mismatch(h_sup, h_unsup, "concat")
    assert sep["sup"] > 0.3 and sep["unsup"] > 0.3  # eval normalises with blended statistics
    assert cat["sup"] < 0.02 and cat["unsup"] < 0.02  # only Bessel's n/(n-1) remains


def test_ema_fixed_point_of_one_update_is_the_value():
    v = torch.tensor([1.0, -2.0], dtype=torch.float64)
    torch.testing.assert_close(bn_stats.ema_fixed_point([v], 0.3), v)


def test_errors():
    h_sup, h_unsup = _batches()
    with pytest.raises(ValueError, match="strategy must be one of"):
        bn_stats.steady_state(h_sup, h_unsup, "interleave")
    with pytest.raises(ValueError, match="momentum must be in"):
        bn_stats.steady_state(h_sup, h_unsup, "separate", momentum=1.5)
    with pytest.raises(ValueError, match="agree except in the batch size"):
        bn_stats.steady_state(h_sup, h_unsup[:, :2], "separate")
    with pytest.raises(ValueError, match="fewer than 2 values"):
        bn_stats.batch_stats(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="at least one update"):
        bn_stats.ema_fixed_point([], 0.1)
    with pytest.raises(ValueError, match="cumulative average"):
        bn_stats.ema_fixed_point([h_sup], None)
    with pytest.raises(ValueError, match="eval mode"):
        bn_stats.run_bn_steps(nn.BatchNorm2d(3).double().eval(), h_sup, h_unsup, "concat", 1)
    with pytest.raises(ValueError, match="steps must be"):
        bn_stats.run_bn_steps(nn.BatchNorm2d(3).double(), h_sup, h_unsup, "concat", 0)
