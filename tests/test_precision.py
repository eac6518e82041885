"""Notebook 08's sections 8 and 9 checked against torch itself: bf16 autocast with two forwards, DataParallel.

Each claim is recomputed here another way: the running mean BatchNorm keeps under autocast against a
float64 mean of its bf16 input; bf16 against float16 underflow from their formats; DataParallel's
forward written out (chunk, replicas, cat) against separate forwards and a replica's buffers.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcd_helpers import compare_forwards, small_cnn
from mcd_helpers.forwards import forward_outputs
from mcd_helpers.multisource import source_net

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7


class Autocast(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


def test_batchnorm_under_bf16_autocast_keeps_float32_statistics_accumulated_in_float():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    conv = nn.Conv2d(1, 4, 3)
    x = torch.randn(16, 1, 10, 10) * 3 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = conv(x)
        out = bn(h)
    assert h.dtype == out.dtype == torch.bfloat16 and bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    # momentum 0.1 from zeros: running_mean = 0.1 * batch mean; the batch mean of the bf16 values, in float64
    expected = 0.1 * h.double().mean(dim=(0, 2, 3))
    err = (bn.running_mean.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err < 1e-5 * scale  # float accumulation: float32 rounding, far below one bf16 rounding (3.9e-3)


def _mcd_loss(y):
    def loss(outputs):
        (s1, s2), (u1, u2) = [[t.float() for t in out] for out in outputs]
        return F.cross_entropy(s1, y) + F.cross_entropy(s2, y) + (u1.softmax(1) * u2.log_softmax(1)).sum(1).mean()
    return loss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_makes_the_strategies_differ_by_rounding_and_coupling_stays_larger(seed):
    torch.manual_seed(seed)
    net = small_cnn(width=8)
    xs, xu, y = torch.randn(16, 1, 28, 28), torch.randn(12, 1, 28, 28) + 0.5, torch.randint(0, 10, (16,))
    rel, diff = {}, {}
    for mode in ("eval", "train"):
        for name, model in (("fp32", net), ("bf16", Autocast(net))):
            model.train(mode == "train")
            c = compare_forwards(model, [xs, xu], _mcd_loss(y))
            rel[name, mode], diff[name, mode] = c.max_grad_diff / c.grad_scale, c
    assert rel["fp32", "eval"] < 1e-5 < rel["bf16", "eval"] < 4 * BF16_EPS
    assert diff["bf16", "eval"].loss_diff == 0
    assert diff["bf16", "train"].max_grad_diff > 10 * diff["bf16", "eval"].max_grad_diff


def test_bf16_keeps_float32s_range_float16_underflows():
    assert torch.tensor(1e-8).half().item() == 0.0  # below float16's smallest subnormal (5.96e-8 / 2)
    assert torch.tensor(1e-8).bfloat16().item() == pytest.approx(1e-8, rel=BF16_EPS)
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny == 2.0 ** -126
    assert torch.finfo(torch.float16).tiny == 2.0 ** -14


def test_data_parallel_written_out_is_separate_forwards_and_keeps_the_first_chunks_statistics():
    torch.manual_seed(0)
    base, x = source_net("batch").double(), torch.randn(64, 8, dtype=torch.float64)
    chunks = x.chunk(2)
    dp = copy.deepcopy(base)
    replicas = [dp, copy.deepcopy(dp)]  # replica 0 shares the module's buffers (nn.DataParallel's documentation)
    out_dp = torch.cat([r(c) for r, c in zip(replicas, chunks)])
    # separate forwards through the package, and the first chunk alone, by other code paths
    sep = copy.deepcopy(base)
    out_sep = torch.cat(forward_outputs(sep, list(chunks), "separate"))
    first = copy.deepcopy(base)
    first(chunks[0])
    assert torch.allclose(out_dp, out_sep, rtol=0, atol=1e-12)
    assert (out_dp - copy.deepcopy(base)(x)).abs().max() > 1e-3
    for a, b in zip(dp.modules(), first.modules()):
        if isinstance(a, nn.BatchNorm1d):
            assert torch.equal(a.running_mean, b.running_mean) and int(a.num_batches_tracked) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU DataParallel scatters for real")
def test_data_parallel_without_a_gpu_is_the_module_itself():
    torch.manual_seed(0)
    base, x = source_net("batch"), torch.randn(32, 8)
    wrapped = nn.DataParallel(copy.deepcopy(base))
    assert wrapped.device_ids == [] and torch.equal(wrapped(x), copy.deepcopy(base)(x))
