"""mcd_helpers.memory: the saved-tensor meter checked on graphs whose saved tensors are known by hand."""
import pytest
import torch
from torch import nn

from mcd_helpers.memory import SCHEDULES, SavedTensorMeter, schedule_memory


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
