"""mcd_helpers.memory: the saved-tensor meter on graphs whose saved tensors are known by hand, and
step_cost."""

import copy

import pytest
import torch
from torch import nn

from mcd_helpers.losses import discrepancy_loss, supervised_loss
from mcd_helpers.memory import BACKWARD_SCHEDULES, SavedTensorMeter, step_cost

D = torch.float64


class SavesTwo(torch.autograd.Function):
    """y = a * b, saving exactly a and b."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_meter_counts_saved_bytes_and_releases_them_when_autograd_frees_them():
    a, b = (
        torch.randn(10, 3, dtype=D, requires_grad=True),
        torch.randn(10, 3, dtype=torch.float32, requires_grad=True),
    )
    with SavedTensorMeter() as meter:
        loss = SavesTwo.apply(a, b.double()).sum()  # saves a (240 B) and b.double() (240 B)
    assert meter.live_bytes == meter.peak_bytes == 480
    loss.backward()  # after the context exits: still accounted, freed by backward
    assert meter.live_bytes == 0 and meter.peak_bytes == 480


def test_meter_counts_a_tensor_saved_twice_once_and_skips_excluded_ones():
    x = torch.randn(100, dtype=D, requires_grad=True)
    with SavedTensorMeter(exclude=[x]) as meter:
        y = x.exp()  # saves its result y
        z = SavesTwo.apply(y, y)  # saves y twice: counted once
        w = SavesTwo.apply(z, x).sum()  # saves z, and x (excluded)
    assert meter.peak_bytes == 2 * 100 * 8
    w.backward(retain_graph=True)
    assert meter.live_bytes == 1600  # retain_graph keeps the saved tensors
    del w, z, y
    assert meter.live_bytes == 0


def test_meter_counts_views_of_one_storage_by_the_memory_they_view():
    x = torch.randn(10, 4, dtype=D, requires_grad=True)
    base = torch.randn(10, 8, dtype=D)
    with SavedTensorMeter() as meter:
        # two views of one storage
        out = SavesTwo.apply(x, base[:, :4]) + SavesTwo.apply(x, base[:, 4:])
    assert meter.peak_bytes == 320 + 2 * 320  # x once, each 40-element view once
    del out


def test_batchnorm_running_buffers_are_counted_unless_excluded():
    bn = nn.BatchNorm1d(4).double()
    x = torch.randn(10, 4, dtype=D, requires_grad=True)
    with SavedTensorMeter(exclude=[*bn.parameters(), x]) as meter:
        y = bn(x)
    with SavedTensorMeter(exclude=[*bn.parameters(), *bn.buffers(), x]) as meter2:
        y2 = bn(x)
    # besides x and the weight: running_mean, running_var, the batch mean and 1/std, (4,) float64
    # each
    assert (meter.peak_bytes, meter2.peak_bytes) == (4 * 4 * 8, 2 * 4 * 8)
    del y, y2


@pytest.mark.parametrize("exclude", [[torch.zeros(2), 1.0], nn.Linear(2, 2).modules()])
def test_meter_refuses_non_tensors_in_exclude(exclude):
    with pytest.raises(TypeError, match="exclude"):
        SavedTensorMeter(exclude=exclude)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.f1, self.f2 = nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x):
        h = self.g(x)
        return self.f1(h), self.f2(h)


def setup(n_sup=20, n_unsup=12):
    model = Two().double()
    g = torch.Generator().manual_seed(1)
    # float32 inputs: step_cost moves them to the model's dtype
    return model, (
        torch.randn(n_sup, 6, generator=g),
        torch.randint(0, 3, (n_sup,), generator=g),
        torch.randn(n_unsup, 6, generator=g),
    )


def part_peak(model, x, y=None):
    with SavedTensorMeter(exclude=[*model.parameters(), x]) as meter:
        out = model(x)
        loss = supervised_loss(*out, y) if y is not None else discrepancy_loss(*out)
    del loss, out
    return meter.peak_bytes


def test_schedules_keep_both_graphs_or_one_at_a_time():
    model, (x_s, y_s, x_u) = setup()
    sup, unsup = part_peak(model, x_s.double(), y_s), part_peak(model, x_u.double())
    res = {s: step_cost(model, x_s, y_s, x_u, s) for s in BACKWARD_SCHEDULES}
    # both graphs alive at once
    assert res["separate"].peak_bytes == res["per_part_late"].peak_bytes == sup + unsup
    assert res["per_part"].peak_bytes == max(sup, unsup) < sup + unsup  # one part's graph at a time
    # one graph of both parts (less what inputs share)
    assert res["concat"].peak_bytes >= sup + unsup - 32 * 8
    assert all(r.live_after_bytes == 0 for r in res.values())  # every graph freed by its backward


def test_every_schedule_leaves_the_gradient_of_the_step_b_loss():
    model, (x_s, y_s, x_u) = setup()
    ref = copy.deepcopy(model)
    (a1, a2), (b1, b2) = ref(x_s.double()), ref(x_u.double())
    logp = lambda z: z - torch.logsumexp(z, 1, keepdim=True)  # noqa: E731
    ce = lambda z: -logp(z)[torch.arange(len(y_s)), y_s].mean()  # noqa: E731
    ent = lambda z: -(logp(z).exp() * logp(z)).sum(1)  # noqa: E731
    loss = ce(a1) + ce(a2) + torch.clamp(1.2 - (ent(b1) - ent(b2)).mean(), min=0)
    want = dict(
        zip(
            [n for n, _ in ref.named_parameters()],
            torch.autograd.grad(loss, list(ref.parameters())),
        )
    )
    for s in BACKWARD_SCHEDULES:
        r = step_cost(model, x_s, y_s, x_u, s)
        assert (
            r.loss == pytest.approx(loss.item(), abs=1e-12)
            and r.schedule == s
            and r.device == "cpu"
        )
        assert r.grads.keys() == want.keys()
        for name, g in r.grads.items():
            torch.testing.assert_close(g, want[name], rtol=0, atol=1e-12, msg=f"{s} {name}")
    assert all(p.grad is None for p in model.parameters())  # measured on a copy


def test_timing_runs_on_the_copy_and_reports_a_median():
    model, (x_s, y_s, x_u) = setup()
    before = copy.deepcopy(model.state_dict())
    assert step_cost(model, x_s, y_s, x_u, "separate").ms_per_step is None
    timed = step_cost(model, x_s, y_s, x_u, "separate", repeats=3)
    assert 0 < timed.ms_per_step < 10_000
    # SGD steps only on the copy
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class OneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x)


same = lambda xs, ys, xu: (xs, ys, xu)  # noqa: E731


@pytest.mark.parametrize(
    "model, inputs, kwargs, error, match",
    [
        (
            Two(),
            same,
            dict(schedule="interleave"),
            ValueError,
            r"schedule.*\('concat', 'separate'.*'interleave'",
        ),
        (
            Two(),
            same,
            dict(repeats=-1),
            ValueError,
            "repeats=-1",
        ),
        (
            Two(),
            same,
            dict(repeats=1.5),
            ValueError,
            r"repeats=1\.5",
        ),
        (
            Two(),
            lambda xs, ys, xu: (xs.numpy(), ys, xu),
            {},
            TypeError,
            r"x_unsup.*torch\.Tensor",
        ),
        (
            Two(),
            lambda xs, ys, xu: (xs, ys, xu[:, :5]),
            {},
            ValueError,
            r"x_sup \(20, 6\).*x_unsup \(12, 5\)",
        ),
        (
            Two().requires_grad_(False),
            same,
            {},
            ValueError,
            r"\(Two\).*requires_grad=True",
        ),
        *[
            (
                OneHead(),
                same,
                dict(schedule=s),
                TypeError,
                r"\(logits1, logits2\)",
            )
            for s in ("concat", "separate", "per_part_late", "per_part")
        ],
    ],
)
def test_step_cost_refuses_what_it_cannot_measure(model, inputs, kwargs, error, match):
    _, batches = setup()
    with pytest.raises(error, match=match):
        step_cost(model, *inputs(*batches), **kwargs)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_step_cost_refuses_to_run_with_autograd_disabled(context):
    model, (x_s, y_s, x_u) = setup()
    with (
        context(),
        pytest.raises(RuntimeError, match=r"torch\.no_grad\(\).*torch\.inference_mode\(\)"),
    ):
        step_cost(model, x_s, y_s, x_u)
