"""compare_strategies, coupling_matrix and step_cost on models that are not mcd_helpers' own.

Reference values are computed here by hand (losses from F.cross_entropy and a hand-written
entropy; BatchNorm running statistics from the momentum formula; Jacobians with
torch.autograd.functional.jacobian), never by the code under test.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcd_helpers import compare_strategies
from mcd_helpers.teaching.compare import ComparisonTable, StrategyComparison, coupling_matrix, step_cost
from tiny_models import MLPTwoHead, TinyTwoHead


class LayerNormTwoHead(nn.Module):
    """Tokens -> Linear -> LayerNorm -> GELU -> mean over tokens -> two heads (no conv, no .features)."""

    def __init__(self, d=6, k=5):
        super().__init__()
        self.proj, self.ln = nn.Linear(d, 8), nn.LayerNorm(8)
        self.out = nn.ModuleList([nn.Linear(8, k), nn.Linear(8, k)])

    def forward(self, x):  # x: (N, T, d)
        h = F.gelu(self.ln(self.proj(x))).mean(dim=1)
        return self.out[0](h), self.out[1](h)


def batches(shape_sup, shape_unsup, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape_sup, generator=g), torch.randint(0, k, (shape_sup[0],), generator=g),
            torch.randn(shape_unsup, generator=g))


def hand_step_b(model, x_sup, y_sup, x_unsup, margin=1.2):
    """Step B loss written out independently: CE1 + CE2 + max(m - mean(H1 - H2), 0), separate forwards."""
    a1, a2 = model(x_sup)
    b1, b2 = model(x_unsup)

    def ent(z):
        p = torch.softmax(z, 1)
        return -(p * torch.log(p)).sum(1)

    gap = (ent(b1) - ent(b2)).mean()
    return F.cross_entropy(a1, y_sup) + F.cross_entropy(a2, y_sup) + torch.clamp(margin - gap, min=0)


# ---------------------------------------------------------------------------------------------
# Verdicts on per-sample models: equal in float64
# ---------------------------------------------------------------------------------------------

PER_SAMPLE = [
    ("tiny-none", lambda: TinyTwoHead("none"), (3, 1, 5, 5), (5, 1, 5, 5), 3),
    ("tiny-group", lambda: TinyTwoHead("group"), (4, 1, 6, 6), (1, 1, 6, 6), 3),
    ("tiny-layer", lambda: TinyTwoHead("layer", in_channels=2), (1, 2, 4, 4), (7, 2, 4, 4), 3),
    ("tiny-bn-eval", lambda: TinyTwoHead("batch").eval(), (5, 1, 5, 5), (2, 1, 5, 5), 3),
    ("mlp-bn1d-eval", lambda: MLPTwoHead().eval(), (3, 12), (9, 12), 4),
    ("layernorm-tokens", lambda: LayerNormTwoHead(), (2, 7, 6), (5, 7, 6), 5),
    ("tiny-dropout-eval", lambda: TinyTwoHead("none", dropout=0.5).eval(), (3, 1, 5, 5), (3, 1, 5, 5), 3),
    ("tiny-dropout-p0-train", lambda: TinyTwoHead("none", dropout=0.0), (3, 1, 5, 5), (3, 1, 5, 5), 3),
]


@pytest.mark.parametrize("name, build, s_sup, s_unsup, k", PER_SAMPLE, ids=[p[0] for p in PER_SAMPLE])
def test_per_sample_models_agree_in_float64(name, build, s_sup, s_unsup, k):
    model = build()
    x_sup, y_sup, x_unsup = batches(s_sup, s_unsup, k)
    c = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert isinstance(c, StrategyComparison)
    assert c.max_grad_diff < 1e-10
    assert c.loss_diff < 1e-12
    assert c.same and c.dtype == torch.float64
    assert c.n_sup == s_sup[0] and c.n_unsup == s_unsup[0]
    # The loss is the Step B loss, checked against an independent implementation.
    ref = hand_step_b(_copy(model).double(), x_sup.double(), y_sup, x_unsup.double())
    assert c.loss_separate == pytest.approx(ref.item(), abs=1e-12)
    assert c.grad_scale > 0  # there were gradients to compare


def _copy(model):
    import copy
    return copy.deepcopy(model)


def test_gradients_match_independent_backward():
    model = TinyTwoHead("group").double()
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)
    x_sup, x_unsup = x_sup.double(), x_unsup.double()
    ref = _copy(model)
    hand_step_b(ref, x_sup, y_sup, x_unsup).backward()
    # Run compare on a model whose .grad is already set to garbage: the copies must start from zero.
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    c = compare_strategies(model, x_sup, y_sup, x_unsup)
    assert c.grad_scale == pytest.approx(max(float(p.grad.abs().max()) for p in ref.parameters()), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Train-mode BatchNorm: different, and the buffers tell why
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, s_sup, s_unsup, k", [
    (lambda: TinyTwoHead("batch"), (4, 1, 5, 5), (3, 1, 5, 5), 3),
    (lambda: TinyTwoHead("batch"), (1, 1, 4, 4), (6, 1, 4, 4), 3),
    (lambda: MLPTwoHead(), (5, 12), (2, 12), 4),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_train_mode_batchnorm_differs(build, s_sup, s_unsup, k, dtype):
    x_sup, y_sup, x_unsup = batches(s_sup, s_unsup, k)
    c = compare_strategies(build(), x_sup, y_sup, x_unsup, dtype=dtype)
    assert c.max_grad_diff > 1e-6
    assert not c.same
    rm = [n for n in c.buffer_diff if n.endswith("running_mean")]
    assert rm and all(c.buffer_diff[n] > 1e-6 for n in rm)
    assert c.tracked_increments == (1, 2)
    assert c.max_running_stat_diff > 1e-6


def test_running_statistics_follow_the_momentum_formula():
    """running <- (1 - 0.1) running + 0.1 * batch stat, once per forward; var stored unbiased."""
    model = TinyTwoHead("batch").double()
    x_sup, y_sup, x_unsup = batches((6, 1, 5, 5), (4, 1, 5, 5), 3)
    x_sup, x_unsup = x_sup.double(), x_unsup.double()
    with torch.no_grad():
        h_sup, h_unsup = model.conv(x_sup), model.conv(x_unsup)  # input of the BatchNorm
        h_cat = torch.cat([h_sup, h_unsup])
    mean = lambda h: h.mean(dim=(0, 2, 3))
    var = lambda h: h.var(dim=(0, 2, 3), unbiased=True)
    m0, v0 = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    c = compare_strategies(model, x_sup, y_sup, x_unsup)
    torch.testing.assert_close(c.buffers_concat["norm.running_mean"], 0.9 * m0 + 0.1 * mean(h_cat), rtol=0, atol=1e-12)
    torch.testing.assert_close(c.buffers_separate["norm.running_mean"],
                               0.9 * (0.9 * m0 + 0.1 * mean(h_sup)) + 0.1 * mean(h_unsup), rtol=0, atol=1e-12)
    torch.testing.assert_close(c.buffers_concat["norm.running_var"], 0.9 * v0 + 0.1 * var(h_cat), rtol=0, atol=1e-12)
    torch.testing.assert_close(c.buffers_separate["norm.running_var"],
                               0.9 * (0.9 * v0 + 0.1 * var(h_sup)) + 0.1 * var(h_unsup), rtol=0, atol=1e-12)
    assert int(c.buffers_concat["norm.num_batches_tracked"]) == 1
    assert int(c.buffers_separate["norm.num_batches_tracked"]) == 2


def test_concat_batchnorm_uses_the_pooled_batch_statistics():
    """The concatenated forward normalises with stats of all N_sup + N_unsup samples: its loss is
    the loss of a model whose BN is replaced by a fixed affine map with the pooled mean/var."""
    model = TinyTwoHead("batch").double()
    x_sup, y_sup, x_unsup = batches((3, 1, 5, 5), (5, 1, 5, 5), 3)
    x_sup, x_unsup = x_sup.double(), x_unsup.double()
    c = compare_strategies(model, x_sup, y_sup, x_unsup)
    with torch.no_grad():
        h = model.conv(torch.cat([x_sup, x_unsup]))
        mu, var = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=False)  # forward uses the biased var
        frozen = _copy(model).eval()
        frozen.norm.running_mean.copy_(mu)
        frozen.norm.running_var.copy_(var)
        l1, l2 = frozen(torch.cat([x_sup, x_unsup]))
        p1u, p2u = torch.softmax(l1[3:], 1), torch.softmax(l2[3:], 1)
        gap = (-(p1u * p1u.log()).sum(1) + (p2u * p2u.log()).sum(1)).mean()
        ref = F.cross_entropy(l1[:3], y_sup) + F.cross_entropy(l2[:3], y_sup) + torch.clamp(1.2 - gap, min=0)
    assert c.loss_concat == pytest.approx(float(ref), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# dtype, mode, dropout
# ---------------------------------------------------------------------------------------------

def test_float32_agrees_only_to_a_tolerance_and_respects_model_dtype():
    model = TinyTwoHead("none")
    x_sup, y_sup, x_unsup = batches((16, 1, 8, 8), (16, 1, 8, 8), 3)
    c32 = compare_strategies(model, x_sup, y_sup, x_unsup)
    c64 = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert c32.dtype == torch.float32 and c64.dtype == torch.float64
    assert c32.max_grad_diff < 1e-4 and c32.same
    assert c64.max_grad_diff <= c32.max_grad_diff
    assert next(model.parameters()).dtype == torch.float32  # the caller's model was not converted


def test_float64_model_with_float32_inputs():
    model = MLPTwoHead().double().eval()
    x_sup, y_sup, x_unsup = batches((3, 12), (4, 12), 4)
    c = compare_strategies(model, x_sup, y_sup, x_unsup)  # inputs follow the model's dtype
    assert c.dtype == torch.float64 and c.max_grad_diff < 1e-10


def test_dropout_in_train_mode_differs_in_eval_mode_agrees():
    x_sup, y_sup, x_unsup = batches((8, 1, 5, 5), (8, 1, 5, 5), 3)
    model = TinyTwoHead("none", dropout=0.5)
    train = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert train.max_grad_diff > 1e-6 and not train.same and train.training
    ev = compare_strategies(model.eval(), x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert ev.max_grad_diff < 1e-10 and not ev.training


def test_eval_mode_batchnorm_leaves_running_stats_alone():
    model = TinyTwoHead("batch").eval()
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)
    c = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert c.tracked_increments == (0, 0)
    assert c.max_buffer_diff == 0.0
    torch.testing.assert_close(c.buffers_concat["norm.running_mean"], torch.zeros(4, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# The caller's model is untouched
# ---------------------------------------------------------------------------------------------

def test_callers_model_state_grad_mode_and_rng_untouched():
    model = TinyTwoHead("batch", dropout=0.3)
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)
    hand_step_b(model, x_sup, y_sup, x_unsup).backward()  # sets .grad and running stats
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
        assert v.dtype == state[k].dtype
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng)


# ---------------------------------------------------------------------------------------------
# Errors and display
# ---------------------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors():
    model = TinyTwoHead()
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)
    with pytest.raises(ValueError, match="every axis but the first"):
        compare_strategies(model, x_sup, y_sup, torch.randn(3, 1, 6, 6))
    with pytest.raises(ValueError, match="at least one sample"):
        compare_strategies(model, x_sup, y_sup, x_unsup[:0])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        compare_strategies(model, x_sup, y_sup[:3], x_unsup)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        compare_strategies(model, x_sup, y_sup + 5, x_unsup)
    with pytest.raises(TypeError, match="nn.Module"):
        compare_strategies(lambda x: (x, x), x_sup, y_sup, x_unsup)
    with pytest.raises(TypeError, match=r"two tensors \(logits1, logits2\)"):
        compare_strategies(nn.Sequential(nn.Flatten(), nn.Linear(25, 3)), x_sup, y_sup, x_unsup)
    with pytest.raises(ValueError, match="floating dtype"):
        compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.int64)


def test_summary_and_html_report_the_numbers():
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)
    c = compare_strategies(TinyTwoHead("batch"), x_sup, y_sup, x_unsup, dtype=torch.float64)
    text, page = str(c), c._repr_html_()
    assert "different" in text and "train mode" in text and "4 labeled + 3 unlabeled" in text
    assert f"{c.loss_concat:.10g}" in text and f"{c.max_grad_diff:.3g}" in text
    assert "+1" in text and "+2" in text  # num_batches_tracked per step
    assert page.startswith("<p>") and "<table>" in page and f"{c.loss_separate:.10g}" in page
    table = ComparisonTable({"bn-train": c})
    assert "DIFFERENT" in str(table) and "+1 vs +2" in table._repr_html_()
    with pytest.raises(ValueError):
        ComparisonTable({})


# ---------------------------------------------------------------------------------------------
# coupling_matrix and step_cost
# ---------------------------------------------------------------------------------------------

def brute_force_coupling(model, x):
    def f(inp):
        a, b = model(inp)
        return torch.cat([a, b], 1)

    jac = torch.autograd.functional.jacobian(f, x)  # (N, 2K, N, ...)
    n = x.shape[0]
    return jac.reshape(n, jac.shape[1], n, -1).pow(2).sum(dim=(1, 3)).sqrt()


@pytest.mark.parametrize("norm, coupled", [("none", False), ("group", False), ("batch", True)])
def test_coupling_matrix(norm, coupled):
    model = TinyTwoHead(norm).double()
    x = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    c = coupling_matrix(model, x)
    ref = brute_force_coupling(_copy(model), x)
    torch.testing.assert_close(c, ref, rtol=1e-10, atol=1e-12)
    off = c[~torch.eye(5, dtype=torch.bool)]
    if coupled:
        assert off.min() > 0
        assert torch.equal(model.norm.running_mean, torch.zeros(4, dtype=torch.float64))  # ran on a copy
    else:
        assert off.abs().max() == 0


def test_step_cost_saves_the_same_activations_both_ways():
    model = TinyTwoHead("batch")
    data = torch.randn(1000, 1, 8, 8)  # batches sliced from one big tensor share its storage
    x_sup, y_sup, x_unsup = data[:8], torch.randint(0, 3, (8,)), data[8:16]
    a = step_cost(model, x_sup, y_sup, x_unsup, "concat", repeats=1)
    b = step_cost(model, x_sup, y_sup, x_unsup, "separate", repeats=1)
    # conv input (16x1x8x8 float32 = 4 KiB) and conv output (16x4x8x8 = 16 KiB) are saved either way.
    assert 16 * 4 * 8 * 8 * 4 <= a.peak_bytes < 1000 * 8 * 8 * 4 and a.device == "cpu"
    assert 0.8 < a.peak_bytes / b.peak_bytes < 1.25
    assert torch.equal(model.norm.num_batches_tracked, torch.tensor(0))
    with pytest.raises(ValueError, match="repeats"):
        step_cost(model, x_sup, y_sup, x_unsup, "concat", repeats=0)
    with pytest.raises(ValueError, match="strategy"):
        step_cost(model, x_sup, y_sup, x_unsup, "both")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_is_compared_and_measured_on_its_device():
    model = TinyTwoHead("batch").cuda()
    x_sup, y_sup, x_unsup = batches((4, 1, 5, 5), (3, 1, 5, 5), 3)  # CPU inputs: moved to the model's device
    c = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float64)
    assert c.max_grad_diff > 1e-6 and c.tracked_increments == (1, 2)
    cost = step_cost(model, x_sup, y_sup, x_unsup, "separate", repeats=1)
    assert cost.device.startswith("cuda") and cost.peak_bytes > 0
