"""Notebook 09's sections 8 and 9: bf16 autocast with two forwards, and DataParallel with BatchNorm.

The running mean BatchNorm keeps under autocast is checked against a float64 mean of its bf16
input; bf16 against float16 underflow from their formats' constants. DataParallel: on the CPU the
notebook's written-out forward (chunk, replicas, cat) is checked against the package's separate
forwards and a fresh network's one update; the real ``nn.DataParallel`` against the same where two
GPUs are (skipped on this project's CPU machines).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcd_helpers import compare_forwards, small_cnn
from mcd_helpers.multisource import source_net
from mcd_helpers.strategies import forward_batches

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
    assert (
        h.dtype == out.dtype == torch.bfloat16
        and bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    )
    # momentum 0.1 from zeros: running_mean = 0.1 * batch mean; the batch mean of the bf16 values,
    # in float64
    expected = 0.1 * h.double().mean(dim=(0, 2, 3))
    err = (bn.running_mean.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    # float accumulation: float32 rounding, far below one bf16 rounding (3.9e-3)
    assert err < 1e-5 * scale


def _mcd_loss(y):
    def loss(outputs):
        (s1, s2), (u1, u2) = [[t.float() for t in out] for out in outputs]
        return (
            F.cross_entropy(s1, y)
            + F.cross_entropy(s2, y)
            + (u1.softmax(1) * u2.log_softmax(1)).sum(1).mean()
        )

    return loss


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_bf16_makes_the_strategies_differ_by_rounding_and_coupling_stays_larger(seed):
    torch.manual_seed(seed)
    net = small_cnn(width=8)
    xs, xu, y = (
        torch.randn(16, 1, 28, 28),
        torch.randn(12, 1, 28, 28) + 0.5,
        torch.randint(0, 10, (16,)),
    )
    rel, diff = {}, {}
    for mode in ("eval", "train"):
        for name, model in (("fp32", net), ("bf16", Autocast(net))):
            model.train(mode == "train")
            c = compare_forwards(model, [xs, xu], _mcd_loss(y))
            rel[name, mode], diff[name, mode] = c.max_grad_diff / c.grad_scale, c
    assert rel["fp32", "eval"] < 1e-5 < rel["bf16", "eval"] < 4 * BF16_EPS
    # row by row
    assert diff["bf16", "eval"].loss_diff <= BF16_EPS * abs(diff["bf16", "eval"].loss_concat)
    assert diff["bf16", "train"].max_grad_diff > 10 * diff["bf16", "eval"].max_grad_diff
    # the coupling is of one size in both precisions (seeds 0-9 measured: bf16 / float32 = 0.90 to
    # 1.23)
    assert 2 / 3 < diff["bf16", "train"].max_grad_diff / diff["fp32", "train"].max_grad_diff < 1.5


def test_bf16_keeps_float32s_range_float16_underflows():
    # below float16's smallest subnormal (5.96e-8 / 2)
    assert torch.tensor(1e-8).half().item() == 0.0
    assert torch.tensor(1e-8).bfloat16().item() == pytest.approx(1e-8, rel=BF16_EPS)
    assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny == 2.0**-126
    assert torch.finfo(torch.float16).tiny == 2.0**-14


def _bn_means(model):
    return [m.running_mean.cpu() for m in model.modules() if isinstance(m, nn.BatchNorm1d)]


def test_data_parallel_written_out_is_separate_forwards_and_keeps_the_first_chunks_statistics():
    # the notebook's CPU emulation: replica 0 is the module itself, the others copies
    torch.manual_seed(0)
    base, x = source_net("batch").double(), torch.randn(64, 8, dtype=torch.float64)
    chunks = x.chunk(2)
    dp = copy.deepcopy(base)
    out_dp = torch.cat([r(c) for r, c in zip([dp, copy.deepcopy(dp)], chunks)])
    # other code paths: the package, one fresh update
    sep, first = (copy.deepcopy(base), copy.deepcopy(base))
    out_sep = torch.cat(forward_batches(sep, list(chunks), "separate"))
    first(chunks[0])
    assert torch.allclose(out_dp, out_sep, rtol=0, atol=1e-12)
    assert (out_dp - copy.deepcopy(base)(x)).abs().max() > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(_bn_means(dp), _bn_means(first)))


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="nn.DataParallel scatters only over two or more GPUs"
)
def test_real_data_parallel_on_two_gpus_normalises_per_chunk_and_keeps_chunk_0s_statistics():
    torch.manual_seed(0)
    base, x = source_net("batch").cuda(), torch.randn(64, 8, device="cuda")
    chunks = x.chunk(2)
    dp_module = copy.deepcopy(base)
    out_dp = nn.DataParallel(dp_module, device_ids=[0, 1])(x)
    out_sep = torch.cat(forward_batches(copy.deepcopy(base), list(chunks), "separate"))
    first = copy.deepcopy(base)
    first(chunks[0])
    assert torch.allclose(out_dp, out_sep, atol=1e-5)
    assert all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(_bn_means(dp_module), _bn_means(first))
    )


def test_data_parallel_without_devices_is_the_module_itself():
    torch.manual_seed(0)
    base, x = source_net("batch"), torch.randn(32, 8)
    wrapped = nn.DataParallel(copy.deepcopy(base))
    if wrapped.device_ids:
        pytest.skip(f"DataParallel found devices {wrapped.device_ids} here")
    assert torch.equal(wrapped(x), copy.deepcopy(base)(x))
