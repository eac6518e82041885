"""mcd_helpers.teaching.memory: the saved-tensor meter checked on graphs whose saved tensors are known by hand."""
import pytest
import torch
from torch import nn

from mcd_helpers.teaching.memory import SCHEDULES, SavedTensorMeter, schedule_memory


class _SavesTwo(torch.autograd.Function):
    """y = a * b, saving a and b (and nothing else): the saved bytes are known exactly."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_meter_counts_saved_bytes_and_releases_them_after_backward():
    a = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, 3, dtype=torch.float32).double().requires_grad_(True)
    with SavedTensorMeter() as meter:
        loss = _SavesTwo.apply(a, b).sum()
    assert meter.live_bytes == meter.peak_bytes == 2 * 30 * 8
    loss.backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 480


def test_meter_counts_a_tensor_saved_twice_once_and_skips_excluded():
    x = torch.randn(100, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter(exclude=[x]) as meter:
        y = x.exp()  # ExpBackward saves its result y
        z = y.sin()  # SinBackward saves its input: the same y
        w = (z * x).sum()  # MulBackward saves z and x; x is excluded
    assert meter.peak_bytes == 2 * 100 * 8  # y and z, 800 bytes each
    w.backward(retain_graph=True)
    assert meter.live_bytes == 1600  # retain_graph keeps the saved tensors
    del w, z, y
    assert meter.live_bytes == 0  # dropping the graph frees them


def _mlp():
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.g = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
            self.f1, self.f2 = nn.Linear(16, 3), nn.Linear(16, 3)

        def forward(self, x):
            h = self.g(x)
            return self.f1(h), self.f2(h)

    return Two().double()


def _data(n_sup=20, n_unsup=20):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n_sup, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n_sup,), generator=g),
            torch.randn(n_unsup, 6, generator=g, dtype=torch.float64))


def _part_peak(model, x, part, y=None):
    from mcd_helpers import discrepancy_loss, supervised_loss
    with SavedTensorMeter(exclude=[*model.parameters(), x]) as meter:
        out = model(x)
        loss = supervised_loss(*out, y) if part == "sup" else discrepancy_loss(*out)
    del loss, out
    return meter.peak_bytes


def test_schedules_peak_is_sum_of_parts_or_max_of_parts():
    model, (x_s, y_s, x_u) = _mlp(), _data(20, 12)
    sup, unsup = _part_peak(model, x_s, "sup", y_s), _part_peak(model, x_u, "unsup")
    res = {s: schedule_memory(model, x_s, y_s, x_u, s) for s in SCHEDULES}
    assert res["sum"].peak_bytes == res["per_part_late"].peak_bytes == sup + unsup
    assert res["per_part"].peak_bytes == max(sup, unsup)
    assert res["concat"].peak_bytes >= res["sum"].peak_bytes - 32 * 8  # one graph of both parts
    assert all(r.live_after_bytes == 0 for r in res.values())  # every graph was freed by its backward


def test_schedules_give_the_same_gradients():
    model, (x_s, y_s, x_u) = _mlp(), _data()
    res = {s: schedule_memory(model, x_s, y_s, x_u, s) for s in SCHEDULES}
    for s in SCHEDULES:
        assert res[s].grads.keys() == res["sum"].grads.keys()
        for name, g in res[s].grads.items():
            tol = 0 if s.startswith("per_part") else 1e-12  # per-part accumulation adds the same two terms
            torch.testing.assert_close(g, res["sum"].grads[name], rtol=0, atol=tol)


def test_per_part_halves_the_peak_for_equal_parts():
    model, (x_s, y_s, x_u) = _mlp(), _data(64, 64)
    res = {s: schedule_memory(model, x_s, y_s, x_u, s).peak_bytes for s in ("sum", "per_part")}
    assert 0.45 < res["per_part"] / res["sum"] < 0.55


def test_unknown_schedule_is_refused():
    model, (x_s, y_s, x_u) = _mlp(), _data()
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedule_memory(model, x_s, y_s, x_u, "interleave")


def test_batchnorm_running_buffers_are_saved_and_counted():
    bn = nn.BatchNorm1d(4).double()
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter(exclude=[*bn.parameters(), x]) as meter:
        y = bn(x)
    # saved besides x and the weight: running_mean, running_var and the batch's mean and 1/std, (4,) each
    assert meter.peak_bytes == 4 * 4 * 8
    with SavedTensorMeter(exclude=[*bn.parameters(), *bn.buffers(), x]) as meter2:
        y2 = bn(x)
    assert meter2.peak_bytes == 2 * 4 * 8  # without the two running buffers
    del y, y2


class _OneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x)


class _NoParameters(nn.Module):
    def forward(self, x):
        return x[:, :3], x[:, 3:]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_memory_refuses_models_it_cannot_measure(schedule):
    x_s, y_s, x_u = _data()
    with pytest.raises(TypeError, match=r"must return \(logits1, logits2\).*returned a tensor of shape"):
        schedule_memory(_OneHead().double(), x_s, y_s, x_u, schedule)
    with pytest.raises(ValueError, match="has no parameters"):
        schedule_memory(_NoParameters(), x_s, y_s, x_u, schedule)
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="requires a gradient"):
        schedule_memory(frozen, x_s, y_s, x_u, schedule)
    with torch.no_grad(), pytest.raises(RuntimeError, match="autograd is disabled"):
        schedule_memory(_mlp(), x_s, y_s, x_u, schedule)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="autograd is disabled"):
        schedule_memory(_mlp(), x_s, y_s, x_u, schedule)


def test_schedule_memory_refuses_bad_inputs_and_leaves_the_model_untouched():
    model, (x_s, y_s, x_u) = _mlp(), _data()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match="x_sup must be a torch.Tensor, got ndarray"):
        schedule_memory(model, x_s.numpy(), y_s, x_u, "sum")
    with pytest.raises(TypeError, match="y_sup must be a torch.Tensor, got list"):
        schedule_memory(model, x_s, y_s.tolist(), x_u, "sum")
    with pytest.raises(TypeError, match="x_unsup must be a torch.Tensor"):
        schedule_memory(model, x_s, y_s, None, "sum")
    with pytest.raises(ValueError, match="agree except in the batch size"):
        schedule_memory(model, x_s, y_s, torch.randn(3, 5, dtype=torch.float64), "concat")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


def test_meter_refuses_non_tensors_in_exclude():
    with pytest.raises(TypeError, match="item 1 is a float"):
        SavedTensorMeter(exclude=[torch.zeros(2), 1.0])
    with pytest.raises(TypeError, match="item 0 is a Linear"):
        SavedTensorMeter(exclude=[nn.Linear(2, 2)])
