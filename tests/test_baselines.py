"""MSP, ODIN and energy on a model, checked against hand-derived values (float64, closed-form gradients)."""
import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from mcd_helpers.experiments.baselines import baseline_scores, head_logits, odin_score, tune_odin
from tiny_models import TinyTwoHead


class LinearTwoHead(nn.Module):
    """f(x) = W flatten(x) + b for both heads (F2 = 2 x F1), so the input gradient has a closed form."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.lin = nn.Linear(d, k).double()

    def forward(self, x):
        z = self.lin(x.flatten(1))
        return z, 2 * z


def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _odin_by_hand(W, b, x, T, eps, std):
    """ODIN with the gradient of CE(f(x)/T, yhat) written out: (softmax(f/T) - onehot(yhat)) W / T."""
    n = x.shape[0]
    xf = x.reshape(n, -1)
    z = xf @ W.T + b
    p = _softmax(z / T)
    onehot = np.eye(W.shape[0])[z.argmax(1)]
    grad = ((p - onehot) @ W / T).reshape(x.shape)
    sign = np.where(grad >= 0, 1.0, -1.0)  # ODIN's code: torch.ge(grad, 0), then * 2 - 1
    x_t = x - eps * sign / std
    return 1 - _softmax((x_t.reshape(n, -1) @ W.T + b) / T).max(1)


@pytest.mark.parametrize("T, eps", [(1.0, 0.0), (1000.0, 0.0014), (10.0, 0.05)])
def test_odin_matches_closed_form(T, eps):
    torch.manual_seed(0)
    model = LinearTwoHead(2 * 3 * 3, 4)
    x = torch.randn(7, 2, 3, 3, dtype=torch.float64)
    std = np.array([0.3, 0.6]).reshape(1, 2, 1, 1)
    got = odin_score(model, x, T, eps, pixel_std=[0.3, 0.6], batch_size=3)
    W, b = model.lin.weight.detach().numpy(), model.lin.bias.detach().numpy()
    np.testing.assert_allclose(got.numpy(), _odin_by_hand(W, b, x.numpy(), T, eps, std), rtol=1e-10, atol=1e-12)


def test_odin_without_perturbation_is_temperature_scaled_msp():
    torch.manual_seed(1)
    model = LinearTwoHead(4, 3)
    x = torch.randn(5, 1, 2, 2, dtype=torch.float64)
    z = model(x)[1].detach().numpy()
    got = odin_score(model, x, temperature=5.0, epsilon=0.0, head="F2")
    np.testing.assert_allclose(got.numpy(), 1 - _softmax(z / 5.0).max(1), rtol=1e-12)


def test_odin_perturbation_raises_the_softmax_score():
    # x~ moves against the gradient of the CE of the predicted class: to first order every
    # sample's max softmax grows, so its OOD score falls (ODIN, Sec. 3).
    torch.manual_seed(2)
    model = LinearTwoHead(9, 5)
    x = torch.randn(50, 1, 3, 3, dtype=torch.float64)
    before = odin_score(model, x, 2.0, 0.0)
    after = odin_score(model, x, 2.0, 1e-4)
    assert bool((after < before).all())


def test_odin_restores_mode_and_leaves_parameters_and_stats_alone():
    model = TinyTwoHead(norm="batch", in_channels=1).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    odin_score(model, torch.randn(6, 1, 5, 5), 1000.0, 0.002)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_baseline_scores_match_definitions():
    torch.manual_seed(3)
    model = LinearTwoHead(4, 3)
    x = torch.randn(6, 1, 2, 2, dtype=torch.float64)
    z = model(x)[0].detach().numpy()
    s = baseline_scores(model, x, methods=("energy", "msp"), batch_size=4)
    assert list(s) == ["energy", "msp"]
    np.testing.assert_allclose(s["msp"].numpy(), 1 - _softmax(z).max(1), rtol=1e-12)
    np.testing.assert_allclose(s["energy"].numpy(), -np.log(np.exp(z).sum(1)), rtol=1e-12)


def test_tune_odin_reports_the_validation_auroc_and_picks_its_maximum():
    torch.manual_seed(4)
    model = LinearTwoHead(4, 3)
    x_id = 3 * torch.randn(40, 1, 2, 2, dtype=torch.float64)
    x_ood = 0.3 * torch.randn(30, 1, 2, 2, dtype=torch.float64)
    params = tune_odin(model, x_id, x_ood, temperatures=(1.0, 100.0), epsilons=(0.0, 0.01))
    assert set(params.val_auroc) == {(1.0, 0.0), (1.0, 0.01), (100.0, 0.0), (100.0, 0.01)}
    W, b = model.lin.weight.detach().numpy(), model.lin.bias.detach().numpy()
    for (T, eps), auroc in params.val_auroc.items():
        s = np.concatenate([_odin_by_hand(W, b, x_id.numpy(), T, eps, 1.0), _odin_by_hand(W, b, x_ood.numpy(), T, eps, 1.0)])
        label_ood = np.r_[np.zeros(40), np.ones(30)]
        assert auroc == pytest.approx(roc_auc_score(label_ood, s), abs=1e-12)
    assert params.val_auroc[(params.temperature, params.epsilon)] == max(params.val_auroc.values())


def test_head_logits():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert head_logits((a, b), "F2") is b and head_logits((a, b)) is a and head_logits(a, "F2") is a


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(pixel_std=[0.1, 0.2, 0.3]), "pixel_std"),
    (dict(pixel_std=-1.0), "pixel_std"),
    (dict(head="F3"), "head"),
])
def test_odin_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        odin_score(LinearTwoHead(4, 3), torch.randn(2, 1, 2, 2, dtype=torch.float64), **kwargs)


def test_unknown_baseline_and_empty_grid():
    with pytest.raises(ValueError, match="msp, odin, energy"):
        baseline_scores(LinearTwoHead(4, 3), torch.randn(2, 1, 2, 2, dtype=torch.float64), methods=("mahalanobis",))
    with pytest.raises(ValueError, match="at least one"):
        tune_odin(LinearTwoHead(4, 3), torch.randn(2, 1, 2, 2), torch.randn(2, 1, 2, 2), temperatures=())
