"""mcd_helpers.norms: per-source statistics, recalibration and eval-mode BatchNorm, checked against
nn.BatchNorm and by hand."""

import copy

import pytest
import torch
from torch import nn

from mcd_helpers.compare import compare_forwards
from mcd_helpers.models import small_cnn
from mcd_helpers.norms import (
    DetachedStatsBatchNorm,
    PerSourceBatchNorm,
    detached_stats_batchnorm,
    eval_mode_bn,
    has_sources,
    per_source_batchnorm,
    recalibrate_bn,
    use_source,
)

D = torch.float64


def net():
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)).double()


def data(n, shift=0.0, seed=0):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=D) * 2 + shift


@pytest.mark.parametrize(
    "bn_cls, shape", [(nn.BatchNorm2d, (6, 3, 4, 4)), (nn.BatchNorm1d, (6, 3))]
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_source_is_plain_batchnorm(bn_cls, shape, momentum):
    ref = bn_cls(3, momentum=momentum).double()
    mine = PerSourceBatchNorm.from_batchnorm(ref, num_sources=1)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2), ref.bias.uniform_(-1, 1)
        mine.weight.copy_(ref.weight), mine.bias.copy_(ref.bias)
    for seed in range(3):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D) + seed
        torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.running_mean[0], ref.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.running_var[0], ref.running_var, rtol=0, atol=1e-12)
    assert mine.num_batches_tracked.tolist() == [3] and int(ref.num_batches_tracked) == 3
    x = torch.randn(shape, dtype=D)
    torch.testing.assert_close(mine.eval()(x), ref.eval()(x), rtol=0, atol=1e-12)


def test_each_source_keeps_its_own_statistics_and_eval_uses_source_0():
    base = net()
    model, id_only = per_source_batchnorm(base), copy.deepcopy(base)
    x_id, x_ood = data(8, 0.0, 1), data(8, 5.0, 2)
    with use_source(model, 1):
        model(x_ood)
    model(x_id)  # source 0 by default
    id_only(x_id)  # plain BatchNorm that never saw the OOD batch
    bn = model[1]
    torch.testing.assert_close(bn.running_mean[0], id_only[1].running_mean, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        bn.running_mean[1], 0.1 * base[0](x_ood).mean(0).detach(), rtol=0, atol=1e-14
    )
    assert bn.num_batches_tracked.tolist() == [1, 1]
    torch.testing.assert_close(model.eval()(x_ood), id_only.eval()(x_ood), rtol=0, atol=1e-12)
    with use_source(model, 1):  # eval mode with source 1's statistics: not the ID ones
        assert (model(x_ood) - id_only(x_ood)).abs().max() > 1e-3


def test_use_source_restores_the_previous_source_even_after_an_error():
    model = per_source_batchnorm(nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3)), num_sources=3)
    with use_source(model, 2):
        with pytest.raises(RuntimeError):
            with use_source(model, 1):
                assert [m.source for m in model] == [1, 1]
                raise RuntimeError("inside the block")
        assert [m.source for m in model] == [2, 2]
    assert [m.source for m in model] == [0, 0]


def test_use_source_on_a_model_without_per_source_layers_changes_nothing():
    model, x = net().train(), data(8)
    ref = copy.deepcopy(model)
    with use_source(model, 5):  # no source to switch: any number, nothing checked or changed
        out = model(x)
    assert torch.equal(out, ref(x))
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
    )


def test_per_source_batchnorm_is_a_copy_with_every_batchnorm_replaced_from_its_statistics():
    base = small_cnn(norm="batch", width=4)
    base(torch.randn(4, 1, 8, 8))  # non-default running statistics to copy
    model = per_source_batchnorm(base, num_sources=3)
    old = [m for m in base.modules() if isinstance(m, nn.BatchNorm2d)]
    new = [m for m in model.modules() if isinstance(m, PerSourceBatchNorm)]
    assert len(old) == len(new) == 3 and not any(
        isinstance(m, nn.BatchNorm2d) for m in model.modules()
    )
    for o, n in zip(old, new):
        assert torch.equal(n.running_mean, o.running_mean.expand(3, -1)) and torch.equal(
            n.weight, o.weight
        )
        assert n.num_batches_tracked.tolist() == [1, 1, 1] and n.num_sources == 3
    assert has_sources(model) and not has_sources(base)  # the original is untouched
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), base.eval()(x))


def test_a_failed_forward_is_not_counted():
    bn = PerSourceBatchNorm(3).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 3))  # one sample: no variance
    assert bn.num_batches_tracked.tolist() == [0, 0]


def test_recalibrate_averages_the_batch_statistics_and_skips_a_one_sample_tail():
    model = net().train()
    for seed in range(5):  # running statistics polluted by a shifted stream
        model(data(16, 10.0, seed))
    model.eval()
    x = data(41, 0.0, 7)  # batches of 10, 10, 10, 10 and a last one of 1 sample (skipped)
    assert recalibrate_bn(model, x, batch_size=10) is model
    with torch.no_grad():
        chunks = model[0](x[:40]).split(10)  # the BatchNorm's inputs
    torch.testing.assert_close(
        model[1].running_mean, torch.stack([c.mean(0) for c in chunks]).mean(0), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        model[1].running_var, torch.stack([c.var(0) for c in chunks]).mean(0), rtol=0, atol=1e-12
    )
    assert (
        not model.training and model[1].momentum == 0.1 and int(model[1].num_batches_tracked) == 4
    )


def test_recalibrate_rewrites_source_0_only():
    model = per_source_batchnorm(net())
    with use_source(model, 1):
        model(data(8, 3.0, 1))
    source_1 = (model[1].running_mean[1].clone(), model[1].running_var[1].clone())
    x = data(20, 0.0, 2)
    recalibrate_bn(model, x, batch_size=20)
    with torch.no_grad():
        h = model[0](x)
    torch.testing.assert_close(model[1].running_mean[0], h.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(model[1].running_var[0], h.var(0), rtol=0, atol=1e-12)
    assert torch.equal(model[1].running_mean[1], source_1[0]) and torch.equal(
        model[1].running_var[1], source_1[1]
    )
    assert model[1].num_batches_tracked.tolist() == [1, 1] and model[1].momentum == 0.1


def test_recalibrate_restores_everything_on_error_and_keeps_eval_mode_layers_in_eval_mode():
    model = net().train()
    model(data(16, 2.0))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError):
        # wrong feature count, raised inside the forward
        recalibrate_bn(model, torch.randn(10, 3, dtype=D))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and model[1].momentum == 0.1
    in_eval = eval_mode_bn(net().train())
    recalibrate_bn(in_eval, data(20, 1.0), batch_size=10)
    assert in_eval.training and not in_eval[1].training and int(in_eval[1].num_batches_tracked) == 2


def test_eval_mode_batchnorm_decouples_the_samples_and_its_affine_still_learns():
    model = eval_mode_bn(net().train())
    assert model.training and not model[1].training
    loss = lambda outs: sum((i + 1) * o.pow(2).mean() for i, o in enumerate(outs))  # noqa: E731
    c = compare_forwards(model, [data(4, 0, 1), data(5, 3, 2), data(6, -2, 3)], loss)
    assert c.same and c.max_grad_diff < 1e-12 and c.tracked_increments == (0, 0)
    model(data(4)).sum().backward()
    assert model[1].weight.grad.abs().sum() > 0 and int(model[1].num_batches_tracked) == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: PerSourceBatchNorm(3, num_sources=0), r"num_sources.*\b0\b"),
        (
            lambda: PerSourceBatchNorm.from_batchnorm(nn.BatchNorm1d(3, affine=False)),
            "affine=False.*affine=True",
        ),
        (
            lambda: PerSourceBatchNorm.from_batchnorm(nn.BatchNorm1d(3, track_running_stats=False)),
            "track_running_stats=False.*track_running_stats=True",
        ),
        (
            lambda: per_source_batchnorm(nn.Sequential(nn.Linear(2, 2))),
            "no BatchNorm layer",
        ),
        (
            lambda: use_source(per_source_batchnorm(net()), 2).__enter__(),
            r"source.*\[0, 2\).*\b2\b",
        ),
        (
            lambda: use_source(per_source_batchnorm(net()), -1).__enter__(),
            r"source.*\[0, 2\).*-1",
        ),
        (
            lambda: recalibrate_bn(nn.Linear(4, 2), data(4)),
            "recalibrate_bn.*BatchNorm",
        ),
        (
            lambda: recalibrate_bn(
                nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False)), data(4)
            ),
            "recalibrate_bn.*BatchNorm",
        ),
        (
            lambda: recalibrate_bn(net(), data(1)),
            r"x \(N, \.\.\.\).*N >= 2",
        ),
        (lambda: recalibrate_bn(net(), data(8).tolist()), r"x \(N, \.\.\.\)"),
        (
            lambda: recalibrate_bn(net(), data(8), batch_size=1),
            r"batch_size.*\b1\b",
        ),
        (
            lambda: recalibrate_bn(net(), data(8), batch_size=2.5),
            r"batch_size.*2\.5",
        ),
        (
            lambda: eval_mode_bn(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))),
            "eval_mode_bn.*BatchNorm",
        ),
    ],
)
def test_refused_models_and_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_detached_statistics_batchnorm_by_hand_in_float64():
    # forward and running statistics: nn.BatchNorm2d's; backward: the statistics as constants,
    # written out here: y = w (x - mu) / sqrt(var + eps) + b, so dL/dx = g w / sqrt(var + eps)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    net = detached_stats_batchnorm(nn.Sequential(bn)).train()
    x = torch.randn(5, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    y = net(x)
    (y * g).sum().backward()
    mu = x.detach().mean((0, 2, 3), keepdim=True)
    var = ((x.detach() - mu) ** 2).mean((0, 2, 3), keepdim=True)  # biased, 20 values a channel
    w, b = bn.weight.detach().view(1, 3, 1, 1), bn.bias.detach().view(1, 3, 1, 1)
    torch.testing.assert_close(y, w * (x.detach() - mu) / torch.sqrt(var + bn.eps) + b)
    torch.testing.assert_close(x.grad, g * w / torch.sqrt(var + bn.eps))
    # running statistics: 0.7 * (0, 1) + 0.3 * (mean, unbiased variance)
    layer = net[0]
    torch.testing.assert_close(layer.running_mean, 0.3 * mu.flatten())
    torch.testing.assert_close(layer.running_var, 0.7 + 0.3 * var.flatten() * 20 / 19)
    assert isinstance(layer, DetachedStatsBatchNorm) and layer.num_batches_tracked.item() == 1
    # plain BatchNorm's gradient differs: it flows through the mean and the variance
    x2 = x.detach().clone().requires_grad_(True)
    (bn.train()(x2) * g).sum().backward()
    assert (x2.grad - x.grad).abs().max() > 1e-3
    # eval mode: the running statistics, as nn.BatchNorm
    net.eval()
    torch.testing.assert_close(net(x.detach()), bn.eval()(x.detach()))
