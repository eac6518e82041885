"""Notebook 08's claims about PyTorch itself (checkpointing, torch.func, torch.compile), each checked here."""
import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcd_helpers.teaching.compare import coupling_matrix
from tiny_models import TinyTwoHead


class Block(nn.Module):
    def __init__(self, mode):  # mode: "none", "all" (BatchNorm inside the segment), "linear" (outside)
        super().__init__()
        self.lin, self.bn, self.head, self.mode = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2), mode

    def forward(self, x):
        if self.mode == "all":
            h = checkpoint(lambda t: torch.relu(self.bn(self.lin(t))), x, use_reentrant=False)
        elif self.mode == "linear":
            h = torch.relu(self.bn(checkpoint(self.lin, x, use_reentrant=False)))
        else:
            h = torch.relu(self.bn(self.lin(x)))
        return self.head(h)


def test_checkpointed_batchnorm_updates_twice_with_right_gradients_and_momentum_fix():
    torch.manual_seed(0)
    ref = Block("none").double()
    ck, outside, lowered = (copy.deepcopy(ref) for _ in range(3))
    ck.mode, outside.mode, lowered.mode = "all", "linear", "all"
    lowered.bn.momentum = 1 - 0.9 ** 0.5
    x = torch.randn(16, 8, dtype=torch.float64)
    for m in (ref, ck, outside, lowered):
        m(x).pow(2).mean().backward()
    mu = ref.lin(x).mean(0).detach()
    assert [int(m.bn.num_batches_tracked) for m in (ref, ck, outside, lowered)] == [1, 2, 1, 2]
    for m in (ck, outside, lowered):
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(ck.bn.running_mean, 0.19 * mu, rtol=0, atol=1e-12)  # 1 - 0.9**2
    for m in (ref, outside, lowered):
        torch.testing.assert_close(m.bn.running_mean, 0.1 * mu, rtol=0, atol=1e-12)


def test_checkpointed_batchnorm_with_cumulative_average_matches_no_checkpoint():
    torch.manual_seed(0)
    ref = Block("none").double()
    ck = copy.deepcopy(ref)
    ck.mode = "all"
    for m in (ref, ck):
        m.bn.momentum = None
    for step in range(3):
        xb = torch.randn(16, 8, dtype=torch.float64) + step
        for m in (ref, ck):
            m(xb).pow(2).mean().backward()
    assert int(ck.bn.num_batches_tracked) == 6 and int(ref.bn.num_batches_tracked) == 3
    torch.testing.assert_close(ck.bn.running_mean, ref.bn.running_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(ck.bn.running_var, ref.bn.running_var, rtol=0, atol=1e-12)


def test_vmap_refuses_train_mode_batchnorm_until_tracking_is_off():
    model = TinyTwoHead("batch").double().train()
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])

    def per_sample(m):
        params = {k: v.detach() for k, v in m.named_parameters()}
        bufs = {k: v.detach() for k, v in m.named_buffers()}

        def loss(p, b, xi, yi):
            return F.cross_entropy(torch.func.functional_call(m, (p, b), (xi[None],))[0], yi[None])
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, None, 0, 0))(params, bufs, x, y)

    with pytest.raises(RuntimeError, match="Batch norm got a batched tensor"):
        per_sample(model)
    torch.func.replace_all_batch_norm_modules_(model)
    assert model.norm.running_mean is None
    g = per_sample(model)["head_a.weight"]
    assert g.shape == (4, 3, 4)
    model.zero_grad()
    F.cross_entropy(model(x[:1])[0], y[:1]).backward()  # sample 0 normalised by its own statistics
    torch.testing.assert_close(g[0], model.head_a.weight.grad, rtol=0, atol=1e-12)
    # per-sample gradients of a model without coupling equal one backward per sample
    plain = TinyTwoHead("group").double()
    grads = per_sample(plain)["head_a.weight"]
    for i in range(4):
        plain.zero_grad()
        F.cross_entropy(plain(x[i:i + 1])[0], y[i:i + 1]).backward()
        torch.testing.assert_close(grads[i], plain.head_a.weight.grad, rtol=0, atol=1e-12)


def test_jacrev_coupling_equals_coupling_matrix():
    torch.manual_seed(0)
    model = TinyTwoHead("batch").double().train()
    probe = copy.deepcopy(model)
    torch.func.replace_all_batch_norm_modules_(probe)
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    jac = torch.func.jacrev(lambda xb: torch.cat(probe(xb), dim=1))(x)  # (N, 2K, N, 1, 6, 6)
    c = jac.pow(2).sum(dim=(1, 3, 4, 5)).sqrt()
    torch.testing.assert_close(c, coupling_matrix(model, x), rtol=0, atol=1e-10)
    assert c[~torch.eye(5, dtype=torch.bool)].min() > 0


def test_compile_recompiles_per_batch_shape_and_mode():
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    handler = Collect()
    log.addHandler(handler)
    torch._logging.set_logs(recompiles=True)
    try:
        def count(calls):
            torch._dynamo.reset()
            records.clear()
            net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
            compiled = torch.compile(net, backend="eager")
            for call in calls:
                call(net, compiled)
            return len(records)

        fwd = lambda n: lambda net, c: c(torch.randn(n, 8))  # noqa: E731
        assert count([fwd(64), fwd(48)] * 3) == 1  # the second shape recompiles once, then it is dynamic
        assert count([fwd(112)] * 3) == 0
        assert count([fwd(112), lambda net, c: net.eval(), fwd(112), lambda net, c: net.train(), fwd(112)]) == 1
    finally:
        torch._logging.set_logs()
        log.removeHandler(handler)
        torch._dynamo.reset()
