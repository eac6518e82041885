"""mcd_helpers.teaching.bn_stats: steady states checked against nn.BatchNorm2d run to convergence, and by hand."""
import pytest
import torch
from torch import nn

from mcd_helpers.teaching import bn_stats


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
    eps = 1e-5
    sep = bn_stats.train_eval_mismatch(h_sup, h_unsup, "separate", eps=eps)
    cat = bn_stats.train_eval_mismatch(h_sup, h_unsup, "concat", eps=eps)
    # By hand: in train mode each part's mean normalises to 0 (its own batch statistics); in eval mode
    # to (mu_p - r_mean) / sqrt(r_var + eps), r from the (0.09, 0.1) / 0.19 fixed point.
    mu_s, mu_u = h_sup.mean(dim=(0, 2, 3)), h_unsup.mean(dim=(0, 2, 3))
    v_s, v_u = h_sup.var(dim=(0, 2, 3), unbiased=True), h_unsup.var(dim=(0, 2, 3), unbiased=True)
    r_mean, r_var = (0.09 * mu_s + 0.1 * mu_u) / 0.19, (0.09 * v_s + 0.1 * v_u) / 0.19
    for part, mu_p in (("sup", mu_s), ("unsup", mu_u)):
        by_hand = ((mu_p - r_mean) / (r_var + eps).sqrt()).abs().max()
        torch.testing.assert_close(sep[part], by_hand, rtol=0, atol=1e-12)
        assert sep[part] > 0.3  # eval normalises with blended statistics
    # concat: train and eval both use the pooled mean; only Bessel's n/(n-1) in the variance remains
    assert cat["sup"] < 0.02 and cat["unsup"] < 0.02


def _two_streams(n_s, n_u, std_s, std_u, shift_u, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (std_s * torch.randn(n_s, 4, 5, 5, generator=g, dtype=torch.float64),
            std_u * torch.randn(n_u, 4, 5, 5, generator=g, dtype=torch.float64) + shift_u)


def _var_by_hand(h):
    return h.transpose(0, 1).reshape(h.shape[1], -1).var(dim=1, unbiased=True)  # per channel


def test_separate_steady_var_can_be_larger_or_smaller_than_the_concatenated_one():
    # Larger: sigma2_u > sigma2_s, nearly equal means, the unlabeled batch smaller. Separate forwards
    # weight sigma2_u by 0.1/0.19 = 0.53 whatever the sizes; the pooled variance by n_u/n = 1/3, and
    # its between-batch term is ~0.
    h_s, h_u = _two_streams(8, 4, 1.0, 3.0, 0.01)
    sep = bn_stats.steady_state(h_s, h_u, "separate")["var"]
    cat = bn_stats.steady_state(h_s, h_u, "concat")["var"]
    torch.testing.assert_close(sep, (0.09 * _var_by_hand(h_s) + 0.1 * _var_by_hand(h_u)) / 0.19, rtol=0, atol=1e-12)
    torch.testing.assert_close(cat, _var_by_hand(torch.cat([h_s, h_u])), rtol=0, atol=1e-12)
    assert (sep - cat).min() > 0.5
    # Smaller: equal spreads, means 3 apart: the pooled variance gains the between-batch term.
    h_s, h_u = _two_streams(8, 4, 1.0, 1.0, 3.0)
    sep = bn_stats.steady_state(h_s, h_u, "separate")["var"]
    cat = bn_stats.steady_state(h_s, h_u, "concat")["var"]
    assert (cat - sep).min() > 1.0


def test_ema_fixed_point_of_one_update_is_the_value():
    v = torch.tensor([1.0, -2.0], dtype=torch.float64)
    torch.testing.assert_close(bn_stats.ema_fixed_point([v], 0.3), v)


def test_errors():
    h_sup, h_unsup = _batches()
    with pytest.raises(ValueError, match="strategy must be one of"):
        bn_stats.steady_state(h_sup, h_unsup, "interleave")
    with pytest.raises(ValueError, match="momentum must be in"):
        bn_stats.steady_state(h_sup, h_unsup, "separate", momentum=1.5)
    with pytest.raises(ValueError, match="momentum must be a number"):
        bn_stats.steady_state(h_sup, h_unsup, "separate", momentum="0.1")
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


@pytest.mark.parametrize("h, match", [
    (torch.zeros(0, 3, 4, 4), "fewer than 2 values per channel"),  # empty batch
    (torch.zeros(4, 0), "has no channels"),
    (torch.zeros(4, 3, 0, 2), "fewer than 2 values per channel"),  # empty spatial size
    (torch.ones(4, 3, dtype=torch.long), "floating-point"),
    (torch.ones(4, 3, dtype=torch.bool), "floating-point"),
    ([[1.0, 2.0]], "BatchNorm input of shape"),
])
def test_bad_inputs_are_refused_by_every_entry_point(h, match):
    with pytest.raises(ValueError, match=match):
        bn_stats.batch_stats(h)
    partner = torch.randn(4, 2)  # a valid input: each input is checked before the two are compared
    for strategy in bn_stats.STRATEGIES:
        for fn in (bn_stats.steady_state, bn_stats.train_statistics, bn_stats.train_eval_mismatch):
            with pytest.raises(ValueError, match=match):
                fn(h, partner, strategy)
            with pytest.raises(ValueError, match=match):
                fn(partner, h, strategy)


def test_train_statistics_checks_its_inputs_like_steady_state():
    h_sup, h_unsup = _batches()
    with pytest.raises(ValueError, match="agree except in the batch size"):
        bn_stats.train_statistics(h_sup, h_unsup[:, :2], "concat")
    with pytest.raises(ValueError, match="fewer than 2 values"):
        bn_stats.train_statistics(torch.randn(1, 3), torch.randn(1, 3), "separate")
    with pytest.raises(ValueError, match="strategy must be one of"):
        bn_stats.train_statistics(h_sup, h_unsup, "interleave")


@pytest.mark.parametrize("make_bn, steps, match", [
    (lambda: nn.Linear(3, 3), 2, "must be a BatchNorm layer"),
    (lambda: nn.BatchNorm2d(3, track_running_stats=False), 2, "track_running_stats=False"),
    (lambda: nn.BatchNorm2d(3), 2.5, "steps must be an integer"),
    (lambda: nn.BatchNorm2d(3), True, "steps must be an integer"),
    (lambda: nn.BatchNorm2d(5), 2, "5 channels"),
])
def test_run_bn_steps_refuses_what_it_cannot_run_and_leaves_the_module_untouched(make_bn, steps, match):
    h_sup, h_unsup = _batches()
    bn = make_bn().double()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        bn_stats.run_bn_steps(bn, h_sup, h_unsup, "separate", steps)
    assert all(torch.equal(v, bn.state_dict()[k]) for k, v in before.items())  # nothing half-written


def test_formula_helpers_refuse_undefined_cases():
    v = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="at least 2"):
        bn_stats.unbiased(v, 1)  # n / (n - 1) would divide by 0
    with pytest.raises(ValueError, match="integer count"):
        bn_stats.unbiased(v, 2.5)
    with pytest.raises(ValueError, match="both 0"):
        bn_stats.pooled_variance(v, v, 0, v, v, 0)
    with pytest.raises(ValueError, match="at least 0"):
        bn_stats.pooled_variance(v, v, -1, v, v, 3)
    with pytest.raises(ValueError, match="same shape"):
        bn_stats.pooled_variance(v, v, 2, v[:2], v[:2], 3)
    with pytest.raises(ValueError, match="same shape"):
        bn_stats.ema_fixed_point([torch.ones(3), torch.ones(2, 1)], 0.1)  # would broadcast to (2, 3)
    with pytest.raises(ValueError, match="eps must be"):
        bn_stats.train_eval_mismatch(*_batches(), "separate", eps=-1.0)
    # the defined edge cases still work: one group alone is its own variance; n = 2 doubles
    torch.testing.assert_close(bn_stats.pooled_variance(v, 2 * v, 0, v, 3 * v, 5), 3 * v)
    torch.testing.assert_close(bn_stats.unbiased(v, 2), 2 * v)
