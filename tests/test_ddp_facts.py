"""Facts notebook 06 states about torch's DDP, checked in one process against torch 2.14.1
itself."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_ddp_constructor_refuses_syncbatchnorm_on_a_cpu_module(gloo_group):
    net = nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    )
    with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU modules"):
        nn.parallel.DistributedDataParallel(net)
    # outside DDP: the forward
    with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
        net.train()(torch.randn(4, 1, 5, 5))


def test_the_default_allreduce_divides_by_the_world_size_before_summing(monkeypatch):
    seen = []

    class Future:
        def then(self, fn):
            return self

    class Work:
        def get_future(self):
            return Future()

    class Group:  # a stand-in process group of 4 ranks
        def size(self):
            return 4

    monkeypatch.setattr(
        default_hooks.dist, "all_reduce", lambda t, **kw: seen.append(t.clone()) or Work()
    )
    grad = torch.tensor([8.0, -4.0])
    default_hooks._allreduce_fut(Group(), grad)
    # what the all-reduce sums: grad / W
    torch.testing.assert_close(seen[0], torch.tensor([2.0, -1.0]))


def test_mean_of_shard_variances_misses_the_between_term_and_is_weighted_up():
    gen = torch.Generator().manual_seed(0)
    world, n = 4, 16
    shards = torch.randn(world, n, generator=gen, dtype=torch.float64) + torch.arange(world).view(
        -1, 1
    )
    big_n, s2 = world * n, shards.flatten().var()
    s_r2, mu_r = shards.var(dim=1), shards.mean(dim=1)
    within, between = (n - 1) * s_r2.sum(), n * ((mu_r - shards.mean()) ** 2).sum()
    # the identity
    torch.testing.assert_close((big_n - 1) * s2, within + between, rtol=0, atol=1e-10)
    factor = (big_n - 1) / ((n - 1) * world)
    assert factor > 1
    torch.testing.assert_close(s_r2.mean(), factor * within / (big_n - 1), rtol=0, atol=1e-12)
