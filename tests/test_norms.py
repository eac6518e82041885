"""BatchNorm fixes: per-source statistics, recalibration, frozen statistics (checked against nn.BatchNorm)."""
import pytest
import torch
from torch import nn

from mcd_helpers import compare_forwards
from mcd_helpers.norms import (PerSourceBatchNorm, freeze_bn, per_source_batchnorm, recalibrate_bn,
                               use_source)


def net():
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)).double()


def data(n, shift=0.0, seed=0):
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 + shift


@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_source_is_plain_batchnorm(momentum):
    ref = nn.BatchNorm2d(3, momentum=momentum).double()
    mine = PerSourceBatchNorm.from_batchnorm(ref, num_sources=1)
    for seed in range(3):
        x = torch.randn(6, 3, 4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + seed
        torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.running_mean[0], ref.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.running_var[0], ref.running_var, rtol=0, atol=1e-12)
    assert int(mine.num_batches_tracked[0]) == int(ref.num_batches_tracked) == 3
    mine.eval(), ref.eval()
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=1e-12)


def test_each_source_keeps_its_own_statistics():
    torch.manual_seed(0)
    base = net()
    model, id_only = per_source_batchnorm(base), base
    x_id, x_ood = data(8, 0.0, 1), data(8, 5.0, 2)
    with use_source(model, 0):
        model(x_id)
    with use_source(model, 1):
        model(x_ood)
    id_only(x_id)  # the same ID batch through plain BatchNorm, without the OOD forward
    bn = model[1]
    torch.testing.assert_close(bn.running_mean[0], id_only[1].running_mean, rtol=0, atol=1e-12)
    assert (bn.running_mean[1] - bn.running_mean[0]).abs().max() > 0.1  # the OOD stream has its own
    assert bn.num_batches_tracked.tolist() == [1, 1] and bn.source == 0  # use_source restored source 0
    model.eval(), id_only.eval()
    torch.testing.assert_close(model(x_ood), id_only(x_ood), rtol=0, atol=1e-12)  # evaluated with ID stats


def test_source_and_model_checks():
    with pytest.raises(ValueError, match="source must be in"):
        with use_source(per_source_batchnorm(net()), 2):
            pass
    with pytest.raises(ValueError, match="per_source_batchnorm"):
        with use_source(net(), 0):
            pass
    with pytest.raises(ValueError, match="no BatchNorm"):
        per_source_batchnorm(nn.Linear(2, 2))


def test_recalibrate_averages_batch_statistics():
    model = net().train()
    for seed in range(5):  # running statistics polluted by a shifted stream
        model(data(16, 10.0, seed))
    model.eval()
    x = data(40, 0.0, 7)
    recalibrate_bn(model, x, batch_size=10)
    h = model[0](x).detach()  # the BatchNorm's input, (40, 5)
    chunks = h.split(10)
    mean = torch.stack([c.mean(0) for c in chunks]).mean(0)
    var = torch.stack([c.var(0, unbiased=True) for c in chunks]).mean(0)
    torch.testing.assert_close(model[1].running_mean, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(model[1].running_var, var, rtol=0, atol=1e-12)
    assert not model.training and model[1].momentum == 0.1 and int(model[1].num_batches_tracked) == 4
    with pytest.raises(ValueError, match="batch_size"):
        recalibrate_bn(model, x, batch_size=1)
    with pytest.raises(ValueError, match="no BatchNorm"):
        recalibrate_bn(nn.Linear(4, 2), x)


def test_frozen_batchnorm_decouples_samples_and_still_learns_affine():
    model = freeze_bn(net().train())
    assert model.training and not model[1].training
    loss = lambda outs: sum((i + 1) * o.pow(2).mean() for i, o in enumerate(outs))  # noqa: E731
    c = compare_forwards(model, [data(4, 0, 1), data(5, 3, 2), data(6, -2, 3)], loss)
    assert c.same and c.max_grad_diff < 1e-12 and c.tracked_increments == (0, 0)
    assert c.grad_diff["1.weight"] < 1e-12 and c.grad_scale > 0
    out = model(data(4)).sum()
    out.backward()
    assert model[1].weight.grad is not None and model[1].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no BatchNorm"):
        freeze_bn(nn.Linear(2, 2))


def test_recalibrate_restores_everything_on_error_and_keeps_frozen_layers_frozen():
    model = net().train()
    model(data(16, 2.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError):
        recalibrate_bn(model, torch.randn(10, 3, dtype=torch.float64))  # wrong feature count
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and model[1].momentum == 0.1
    with pytest.raises(ValueError, match="N >= 2"):
        recalibrate_bn(model, data(1))
    with pytest.raises(ValueError, match="integer"):
        recalibrate_bn(model, data(8), batch_size=2.5)
    frozen = freeze_bn(net().train())
    recalibrate_bn(frozen, data(20, 1.0), batch_size=10)
    assert frozen.training and not frozen[1].training  # still frozen
    assert int(frozen[1].num_batches_tracked) == 2


def test_per_source_refuses_layers_without_statistics_and_counts_only_successful_forwards():
    with pytest.raises(ValueError, match="affine=True"):
        PerSourceBatchNorm.from_batchnorm(nn.BatchNorm1d(3, affine=False))
    with pytest.raises(ValueError, match="track_running_stats"):
        PerSourceBatchNorm.from_batchnorm(nn.BatchNorm1d(3, track_running_stats=False))
    bn = PerSourceBatchNorm(3).train()
    with pytest.raises(ValueError):
        bn(torch.randn(1, 3))  # one sample: no variance, refused by PyTorch
    assert bn.num_batches_tracked.tolist() == [0, 0]
