"""mcd_helpers.baselines: ODIN against its closed form on a linear model (float64), and the grid
search."""

import re

import numpy as np
import pytest
import torch
from tiny_models import TinyTwoHead
from torch import nn

import mcd_helpers.odin as baselines
from mcd_helpers.odin import odin_scores, tune_odin


class LinearTwoHead(nn.Module):
    """f(x) = W flatten(x) + b for both heads (F2 = 2 F1), so the input gradient has a closed
    form."""

    def __init__(self, d, k, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(d, k).double()

    def forward(self, x):
        z = self.lin(x.flatten(1))
        return z, 2 * z

    def wb(self):
        return self.lin.weight.detach().numpy(), self.lin.bias.detach().numpy()


def softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def odin_by_hand(model, x, T, eps, std=1.0):
    """ODIN with the gradient of CE(f(x)/T, yhat) written out: (softmax(f/T) - onehot(yhat)) W / T;
    then x~ = x - eps * sign(grad) / std (sign 0 -> +1, ODIN's code), score 1 - max softmax(f(x~) /
    T)."""
    W, b = model.wb()
    x = x.numpy()
    n = len(x)
    z = x.reshape(n, -1) @ W.T + b
    grad = ((softmax(z / T) - np.eye(W.shape[0])[z.argmax(1)]) @ W / T).reshape(x.shape)
    x_t = x - eps * np.where(grad >= 0, 1.0, -1.0) / np.asarray(std, dtype=np.float64).reshape(
        1, -1, 1, 1
    )
    return 1 - softmax((x_t.reshape(n, -1) @ W.T + b) / T).max(1)


@pytest.mark.parametrize(
    "T, epsilons, std",
    [(1.0, [0.0, 0.002], 1.0), (1000.0, [0.0014, 0.004], [0.3, 0.6]), (10.0, [0.05], (0.5,))],
)
def test_odin_matches_its_closed_form(T, epsilons, std):
    model = LinearTwoHead(2 * 3 * 3, 4)
    x = torch.randn(7, 2, 3, 3, dtype=torch.float64)
    got = odin_scores(model, x, T, epsilons, pixel_std=std, batch_size=3)  # batches of 3, 3, 1
    assert len(got) == len(epsilons)
    for s, eps in zip(got, epsilons):
        assert s.shape == (7,)
        np.testing.assert_allclose(
            s.numpy(), odin_by_hand(model, x, T, eps, std), rtol=1e-10, atol=1e-12
        )


def test_no_perturbation_is_temperature_scaled_msp_of_f1():
    model = LinearTwoHead(4, 3, seed=1)
    x = torch.randn(5, 1, 2, 2, dtype=torch.float64)
    W, b = model.wb()
    z = x.numpy().reshape(5, -1) @ W.T + b  # F1; F2 = 2 F1 would give other scores
    (got,) = odin_scores(model, x, temperature=5.0, epsilons=[0.0])
    np.testing.assert_allclose(got.numpy(), 1 - softmax(z / 5.0).max(1), rtol=1e-12)


def test_the_perturbation_raises_the_max_softmax():
    # x~ steps against the gradient of the predicted class's CE: to first order every max softmax
    # grows
    model = LinearTwoHead(9, 5, seed=2)
    x = torch.randn(50, 1, 3, 3, dtype=torch.float64)
    before, after = odin_scores(model, x, 2.0, [0.0, 1e-4])
    assert bool((after < before).all())


def test_mode_is_restored_and_parameters_and_statistics_are_untouched():
    for training in (True, False):
        model = TinyTwoHead(norm="batch", in_channels=1).train(training)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        odin_scores(model, torch.randn(6, 1, 5, 5), 1000.0, [0.0, 0.002], batch_size=4)
        assert model.training is training and all(p.grad is None for p in model.parameters())
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    "kw, shown",
    [
        (dict(temperature=0.0), "T=0.0"),
        (dict(temperature=-1.0), "T=-1.0"),
        (dict(epsilons=[0.0, -0.1]), "epsilons=[0.0, -0.1]"),
        (dict(pixel_std=[0.1, 0.2, 0.3]), "pixel_std=[0.1, 0.2, 0.3]"),
        (dict(pixel_std=-1.0), "pixel_std=-1.0"),
        (dict(pixel_std=[0.0, 0.5]), "pixel_std=[0.0, 0.5]"),
    ],
)
def test_bad_arguments(kw, shown):
    args = {"temperature": 1000.0, "epsilons": [0.0], **kw}
    with pytest.raises(ValueError, match=f"ODIN.*{re.escape(shown)}"):
        odin_scores(LinearTwoHead(8, 3), torch.randn(2, 2, 2, 2, dtype=torch.float64), **args)


def test_tune_odin_reports_every_validation_auroc_and_picks_the_best():
    model = LinearTwoHead(4, 3, seed=4)
    x_id, x_ood = (
        3 * torch.randn(40, 1, 2, 2, dtype=torch.float64),
        0.3 * torch.randn(30, 1, 2, 2, dtype=torch.float64),
    )
    temps, epss = (1.0, 100.0), (0.0, 0.01, 0.05)
    t, eps, grid = tune_odin(model, x_id, x_ood, temps, epss)
    assert list(grid) == [(a, b) for a in temps for b in epss]
    for (T, e), auroc in grid.items():
        s_id, s_ood = odin_by_hand(model, x_id, T, e), odin_by_hand(model, x_ood, T, e)
        # AUROC = P(OOD score > ID score) + 1/2 P(tie), over all 40 x 30 pairs
        pairs = s_ood[None, :] - s_id[:, None]
        assert auroc == pytest.approx((pairs > 0).mean() + 0.5 * (pairs == 0).mean(), abs=1e-12)
    assert grid[(t, eps)] == max(grid.values())
    assert len(set(grid.values())) > 1  # the grid matters here


@pytest.mark.parametrize(
    "aurocs, best",
    [
        ([0.7, 0.9, 0.9, 0.8], (1.0, 0.01)),
        ([0.9, 0.7, 0.9, 0.9], (1.0, 0.0)),
        ([0.6, 0.6, 0.6, 0.8], (10.0, 0.01)),
        ([0.5] * 4, (1.0, 0.0)),
    ],
)
def test_tune_odin_takes_the_first_of_ties_in_grid_order(monkeypatch, aurocs, best):
    calls = iter(aurocs)  # tune_odin scores the grid temperature by temperature, epsilon by epsilon
    monkeypatch.setattr(baselines, "ood_metrics", lambda a, b: {"auroc": next(calls)})
    t, eps, grid = tune_odin(
        LinearTwoHead(4, 3),
        torch.randn(3, 1, 2, 2, dtype=torch.float64),
        torch.randn(3, 1, 2, 2, dtype=torch.float64),
        (1.0, 10.0),
        (0.0, 0.01),
    )
    assert (t, eps) == best and list(grid.values()) == aurocs


def test_a_constant_model_ties_everywhere_and_keeps_the_first_pair():
    model = LinearTwoHead(4, 3)
    with torch.no_grad():
        model.lin.weight.zero_(), model.lin.bias.zero_()  # every score 1 - 1/3, every AUROC 0.5
    t, eps, grid = tune_odin(
        model,
        torch.randn(5, 1, 2, 2, dtype=torch.float64),
        torch.randn(4, 1, 2, 2, dtype=torch.float64),
        (10.0, 1.0),
        (0.002, 0.0),
    )
    assert (t, eps) == (10.0, 0.002) and set(grid.values()) == {0.5}
