"""mcd_helpers.compare on models that are not the package's own: concat and separate forwards agree
for per-sample models and differ under train-mode BatchNorm by the amounts the momentum formula and
the pooled statistics give; the verdict, the table and the refusals."""

import copy
import math

import pytest
import torch
from test_strategies import (
    D,
    LayerNormTokens,
    data,
    hand_concat,
    hand_separate,
    mlp,
    weighted,
    xs,
)
from tiny_models import MLPTwoHead, TinyTwoHead
from torch import nn

from mcd_helpers.compare import (
    ForwardsComparison,
    compare_forwards,
    compare_strategies,
    comparison_table,
    coupling_matrix,
)
from mcd_helpers.norms import per_source_batchnorm

# --- compare.py: per-sample models agree ---------------------------------------------------------

PER_SAMPLE = {
    "none": (lambda: TinyTwoHead("none"), (3, 1, 5, 5), (5, 1, 5, 5)),
    "group": (lambda: TinyTwoHead("group"), (4, 1, 6, 6), (1, 1, 6, 6)),
    "layer": (lambda: TinyTwoHead("layer", in_channels=2), (1, 2, 4, 4), (7, 2, 4, 4)),
    "bn-eval": (lambda: TinyTwoHead("batch").eval(), (5, 1, 5, 5), (2, 1, 5, 5)),
    "bn1d-eval": (lambda: MLPTwoHead(d_in=12, num_classes=3).eval(), (3, 12), (9, 12)),
    "layernorm-tokens": (lambda: LayerNormTokens(), (2, 7, 6), (5, 7, 6)),
    "dropout-eval": (lambda: TinyTwoHead("none", dropout=0.5).eval(), (3, 1, 5, 5), (3, 1, 5, 5)),
    "dropout-p0-train": (lambda: TinyTwoHead("none", dropout=0.0), (3, 1, 5, 5), (3, 1, 5, 5)),
}


@pytest.mark.parametrize("name", PER_SAMPLE)
def test_per_sample_models_agree_in_float64(name):
    build, s_sup, s_unsup = PER_SAMPLE[name]
    model = build()
    x_sup, y_sup, x_unsup = data(s_sup, s_unsup, dtype=torch.float32)
    ref = copy.deepcopy(model).double()
    hand_separate(ref, x_sup.double(), y_sup, x_unsup.double()).backward()
    # stale gradients on the caller's model must not leak into the comparison
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    c = compare_strategies(model, x_sup, y_sup, x_unsup, dtype=D)
    assert c.same and c.dtype == D and c.batch_sizes == (s_sup[0], s_unsup[0])
    assert c.loss_diff < 1e-12 and c.max_grad_diff < 1e-10
    assert c.loss_separate == pytest.approx(
        hand_separate(ref, x_sup.double(), y_sup, x_unsup.double()).item(), abs=1e-12
    )
    assert c.grad_scale == pytest.approx(
        max(float(p.grad.abs().max()) for p in ref.parameters()), rel=1e-10
    )


@pytest.mark.parametrize("k", [3, 5])
@pytest.mark.parametrize("norm", ["none", "layer"])
def test_k_batches_of_a_per_sample_model_agree(k, norm):
    model, b = mlp(norm), xs(*range(2, 2 + k))
    c = compare_forwards(model, b, weighted)
    assert c.same and c.max_grad_diff < 1e-10 and c.tracked_increments is None
    assert c.loss_separate == pytest.approx(weighted([model(x) for x in b]).item(), abs=1e-12)
    assert c.loss_concat == pytest.approx(
        weighted(list(model(torch.cat(b)).split([len(x) for x in b]))).item(), abs=1e-12
    )


# --- compare.py: train-mode BatchNorm differs, and the buffers say why --------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_train_mode_batchnorm_follows_the_momentum_formula_k_times(k):
    model, b = mlp("batch"), xs(*([4] * k))
    c = compare_forwards(model, b, weighted)
    assert not c.same and c.loss_diff > 1e-4 and c.max_grad_diff > 1e-4 and c.training
    assert c.tracked_increments == (1, k)
    with torch.no_grad():
        h = [model[0](x) for x in b]  # the BatchNorm's inputs
        mean_s, var_s = torch.zeros(6, dtype=D), torch.ones(6, dtype=D)
        for hi in h:  # running <- 0.9 running + 0.1 batch statistic (variance unbiased)
            mean_s, var_s = (
                0.9 * mean_s + 0.1 * hi.mean(0),
                0.9 * var_s + 0.1 * hi.var(0, unbiased=True),
            )
        h_cat = torch.cat(h)
        mean_c, var_c = 0.1 * h_cat.mean(0), 0.9 + 0.1 * h_cat.var(0, unbiased=True)
    for key, want in (("1.running_mean", mean_s), ("1.running_var", var_s)):
        torch.testing.assert_close(c.buffers_separate[key], want, rtol=0, atol=1e-14)
    torch.testing.assert_close(c.buffers_concat["1.running_mean"], mean_c, rtol=0, atol=1e-14)
    torch.testing.assert_close(c.buffers_concat["1.running_var"], var_c, rtol=0, atol=1e-14)
    want_diff = max(float((mean_s - mean_c).abs().max()), float((var_s - var_c).abs().max()))
    assert c.max_running_stat_diff == pytest.approx(want_diff, abs=1e-14)
    # the caller's model is untouched
    assert torch.equal(model[1].num_batches_tracked, torch.tensor(0))


def test_concat_batchnorm_normalises_with_the_pooled_batch_statistics():
    model = TinyTwoHead("batch").double()
    x_sup, y_sup, x_unsup = data((3, 1, 5, 5), (5, 1, 5, 5))
    c = compare_strategies(model, x_sup, y_sup, x_unsup)
    # the same loss from an eval-mode copy whose running statistics are the pooled (biased) ones
    with torch.no_grad():
        h = model.conv(torch.cat([x_sup, x_unsup]))
        frozen = copy.deepcopy(model).eval()
        frozen.norm.running_mean.copy_(h.mean(dim=(0, 2, 3)))
        frozen.norm.running_var.copy_(h.var(dim=(0, 2, 3), unbiased=False))
        want = hand_concat(frozen, x_sup, y_sup, x_unsup)
    assert c.loss_concat == pytest.approx(want.item(), abs=1e-12)


def test_per_source_model_counts_updates_over_its_sources():
    c = compare_forwards(per_source_batchnorm(mlp("batch")), xs(4, 4), weighted)
    assert c.tracked_increments == (1, 2) and not c.same


# --- compare.py: dropout, dtype, the caller's state ----------------------------------------------


def test_dropout_masks_come_from_one_seeded_stream_concat_first():
    model = TinyTwoHead("none", dropout=0.5).double()
    x_sup, y_sup, x_unsup = data((6, 1, 5, 5), (6, 1, 5, 5))
    c = compare_strategies(model, x_sup, y_sup, x_unsup, seed=3)
    torch.manual_seed(3)
    want_c = hand_concat(copy.deepcopy(model), x_sup, y_sup, x_unsup).item()
    want_s = hand_separate(copy.deepcopy(model), x_sup, y_sup, x_unsup).item()
    assert (c.loss_concat, c.loss_separate) == (
        pytest.approx(want_c, abs=1e-12),
        pytest.approx(want_s, abs=1e-12),
    )
    assert not c.same and c.max_grad_diff > 1e-6
    assert compare_strategies(model.eval(), x_sup, y_sup, x_unsup, seed=3).same


def test_float32_agrees_to_a_tolerance_and_the_callers_dtype_is_kept():
    model = TinyTwoHead("none")
    x_sup, y_sup, x_unsup = data((16, 1, 8, 8), (16, 1, 8, 8), dtype=torch.float32)
    c32, c64 = (
        compare_strategies(model, x_sup, y_sup, x_unsup),
        compare_strategies(model, x_sup, y_sup, x_unsup, dtype=D),
    )
    assert (c32.dtype, c64.dtype) == (torch.float32, D) and c32.same and c64.same
    assert c32.max_grad_diff < 1e-4 and c64.max_grad_diff < 1e-12
    assert next(model.parameters()).dtype == torch.float32
    # float32 inputs into a float64 model follow the model's dtype
    assert compare_strategies(model.double(), x_sup, y_sup, x_unsup).dtype == D


def test_callers_parameters_buffers_grads_mode_and_rng_are_untouched():
    model = TinyTwoHead("batch", dropout=0.3).double()
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (3, 1, 5, 5))
    hand_separate(model, x_sup, y_sup, x_unsup).backward()
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    compare_strategies(model, x_sup, y_sup, x_unsup, dtype=torch.float32)
    assert all(
        torch.equal(v, state[k]) and v.dtype == state[k].dtype
        for k, v in model.state_dict().items()
    )
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert model.training and torch.equal(torch.get_rng_state(), rng)


# --- compare.py: the verdict ---------------------------------------------------------------------


def comparison(
    loss_s=1.0, grad_diff=0.0, grad_scale=1.0, buf_diff=None, buf=None, tol=1e-4, loss_c=1.0
):
    bufs = {} if buf is None else {"bn.running_var": torch.tensor([buf])}
    return ForwardsComparison(
        loss_c,
        loss_s,
        {"w": grad_diff},
        grad_scale,
        {} if buf_diff is None else {"bn.running_var": buf_diff},
        True,
        torch.float32,
        (2, 2),
        tol,
        buffers_before=bufs,
        buffers_concat=bufs,
        buffers_separate=bufs,
    )


@pytest.mark.parametrize(
    "kwargs, same",
    [
        (dict(loss_c=1000.0, loss_s=1000.05), True),
        (dict(loss_c=1000.0, loss_s=1000.2), False),  # relative: 1e-4 x 1000
        (dict(loss_c=0.5, loss_s=0.50009), True),
        (dict(loss_c=0.5, loss_s=0.5002), False),  # small values: floor of 1
        (dict(grad_diff=0.5, grad_scale=1e4), True),
        (dict(grad_diff=2.0, grad_scale=1e4), False),
        (dict(buf_diff=0.05, buf=1000.0), True),
        (dict(buf_diff=0.2, buf=1000.0), False),
        (dict(grad_diff=math.nan), False),
        (dict(loss_s=math.nan), False),
    ],
)
def test_same_means_within_the_tolerance_relative_to_the_size(kwargs, same):
    c = comparison(**kwargs)
    assert c.same == same
    verdict = (
        "same up to float32 rounding" if same else "DIFFERENT"
    ) + " (relative tolerance 0.0001)"
    assert c._repr_markdown_().splitlines()[0].endswith(": " + verdict)


def test_parameters_without_gradients_are_listed_not_compared():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(5, 2), nn.Linear(5, 2)

        def forward(self, x):
            return self.used(x)

    c = compare_forwards(Unused().double(), xs(2, 3), weighted)
    assert c.no_grad_params == ["unused.weight", "unused.bias"] and set(c.grad_diff) >= {
        "used.weight",
        "used.bias",
    }
    assert "parameters without a gradient (not compared): 2" in str(c)


def test_report_and_table_show_the_numbers():
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (3, 1, 5, 5))
    c = compare_strategies(TinyTwoHead("batch"), x_sup, y_sup, x_unsup, dtype=D)
    text = str(c)
    assert text == c._repr_markdown_() and text.startswith(
        "concat vs 2 separate forwards, train mode, batches 4 + 3: DIFFERENT"
    )
    assert f"| loss | {c.loss_concat:.10g} | {c.loss_separate:.10g} | {c.loss_diff:.3g} |" in text
    assert f"| gradients (max abs) | {c.grad_scale:.3g} |  | {c.max_grad_diff:.3g} |" in text
    assert "| running-stat updates per step | +1 | +2 |  |" in text.splitlines()
    plain = compare_forwards(mlp(), xs(2, 2), weighted)
    table = comparison_table({"bn-train": c, "mlp": plain}).splitlines()
    assert table[0] == (
        "| setting | mode | dtype | batch sizes | abs Δloss | max abs Δgrad | max abs "
        "Δrunning stats | num_batches_tracked | verdict |"
    )
    assert table[2] == (
        f"| bn-train | train | float64 | 4+3 | {c.loss_diff:.2g} | {c.max_grad_diff:.2g} | "
        f"{c.max_running_stat_diff:.2g} | +1 vs +2 | DIFFERENT |"
    )
    assert table[3].endswith("| - | same |") and len(table) == 4
    with pytest.raises(ValueError, match="comparison_table"):
        comparison_table({})


# --- compare.py: refused inputs ------------------------------------------------------------------


class PoolsOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, x):
        return self.lin(x).mean(0, keepdim=True)  # one row for the whole batch


@pytest.mark.parametrize(
    "model, batches, loss_fn, dtype, error, match",
    [
        (
            mlp(),
            torch.zeros(3, 5),
            weighted,
            None,
            TypeError,
            r"batches.*\[x_1, \.\.\., x_k\]",
        ),
        (
            mlp(),
            [],
            weighted,
            None,
            ValueError,
            r"batches.*\[x_1, \.\.\., x_k\]",
        ),
        (
            mlp(),
            [torch.zeros(2, 5), "x"],
            weighted,
            None,
            TypeError,
            r"batch 1\b.*torch\.Tensor.*\bstr\b",
        ),
        (
            mlp(),
            [torch.zeros(2, 5), torch.zeros(2, 4)],
            weighted,
            None,
            ValueError,
            r"batch 1 \(2, 4\)",
        ),
        (
            mlp(),
            [torch.zeros(2, 5), torch.zeros(2, 5, dtype=D)],
            weighted,
            None,
            ValueError,
            r"batch 1 \(2, 5\) torch\.float64.*batch 0 \(2, 5\) torch\.float32",
        ),
        (mlp(), [torch.zeros(0, 5)], weighted, None, ValueError, r"batch 0 \(0, 5\)"),
        (mlp(), xs(2, 2), "mean", None, TypeError, r"loss_fn.*\bstr\b"),
        (
            nn.Sequential(nn.LazyLinear(3)),
            xs(2, 2),
            weighted,
            None,
            ValueError,
            "uninitialised lazy parameters",
        ),
        (
            mlp(),
            xs(2, 2),
            weighted,
            torch.int64,
            ValueError,
            r"dtype.*torch\.int64",
        ),
        (
            mlp(),
            xs(2, 2),
            weighted,
            "float64",
            TypeError,
            r"dtype.*'float64'",
        ),
        (
            mlp(),
            xs(2, 2),
            lambda o: torch.cat(o).sum(0),
            None,
            ValueError,
            r"loss_fn.*torch\.Size\(\[3\]\)",
        ),
        (
            mlp(),
            xs(2, 2),
            lambda o: weighted(o).detach(),
            None,
            ValueError,
            r"grad_fn.*no_grad\(\)",
        ),
        (
            PoolsOverBatch().double(),
            xs(2, 3),
            weighted,
            None,
            ValueError,
            r"\(2, 3\).*\b5\b",
        ),
    ],
)
def test_compare_forwards_refuses_what_it_cannot_compare(
    model, batches, loss_fn, dtype, error, match
):
    with pytest.raises(error, match=match):
        compare_forwards(model, batches, loss_fn, dtype=dtype)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x_sup=None), TypeError, r"batch 0\b.*NoneType"),
        (dict(y_sup=[0, 1, 2, 0]), TypeError, r"y_sup.*\blist\b"),
        (
            dict(y_sup=torch.tensor([0, 1, 2])),
            ValueError,
            r"targets.*\(4,\).*\(3,\)",
        ),
        (dict(y_sup=torch.tensor([0, 1, 2, 5])), ValueError, r"labels.*\[0, 3\).*\[5\]"),
        (dict(margin=-1.0), ValueError, r"margin.*-1\.0"),
    ],
)
def test_compare_strategies_refuses_bad_labels_and_margins(change, error, match):
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (3, 1, 5, 5))
    args = dict(x_sup=x_sup, y_sup=y_sup, x_unsup=x_unsup) | change
    with pytest.raises(error, match=match):
        compare_strategies(TinyTwoHead(), **args)


# --- coupling_matrix -----------------------------------------------------------------------------


@pytest.mark.parametrize("norm, coupled", [("none", False), ("group", False), ("batch", True)])
def test_coupling_matrix_against_the_full_jacobian(norm, coupled):
    model = TinyTwoHead(norm).double()
    x = torch.randn(5, 1, 4, 4, dtype=D)
    c = coupling_matrix(model, x)
    # (N, 2K, N, ...)
    jac = torch.autograd.functional.jacobian(lambda inp: torch.cat(copy.deepcopy(model)(inp), 1), x)
    want = jac.reshape(5, jac.shape[1], 5, -1).pow(2).sum(dim=(1, 3)).sqrt()
    torch.testing.assert_close(c, want, rtol=1e-10, atol=1e-12)
    off = c[~torch.eye(5, dtype=torch.bool)]
    assert (off.min() > 0) if coupled else (off.abs().max() == 0)
    if coupled:  # it ran on a copy: the caller's BatchNorm did not update
        assert int(model.norm.num_batches_tracked) == 0 and model.norm.running_mean.abs().max() == 0
    with pytest.raises(ValueError, match=r"^x\b.*\(N, \.\.\.\).*N >= 1"):
        coupling_matrix(model, x[:0])
