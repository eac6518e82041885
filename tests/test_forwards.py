"""compare_forwards: k batches, one concatenated forward vs k forwards, on models built here."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcd_helpers import compare_forwards
from mcd_helpers.teaching.forwards import forward_outputs, split_rows


def mlp(norm: str = "none") -> nn.Module:
    norms = {"none": nn.Identity(), "layer": nn.LayerNorm(6), "batch": nn.BatchNorm1d(6)}
    return nn.Sequential(nn.Linear(5, 6), norms[norm], nn.Tanh(), nn.Linear(6, 3)).double()


class Checkpointed(nn.Module):
    """Linear -> BatchNorm1d inside torch.utils.checkpoint -> head: the segment is re-run in backward."""

    def __init__(self):
        super().__init__()
        self.seg = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(checkpoint(self.seg, x, use_reentrant=False))


def batches(*sizes, d=5):
    g = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, d, generator=g, dtype=torch.float64) + i for i, n in enumerate(sizes)]


def weighted_loss(outputs):
    # a loss whose parts are weighted differently, so no accidental symmetry hides a difference
    return sum((i + 1) * (o ** 2).mean() for i, o in enumerate(outputs))


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("norm", ["none", "layer"])
def test_per_sample_models_agree_in_float64(k, norm):
    torch.manual_seed(k)
    model = mlp(norm)
    xs = batches(*range(3, 3 + k))
    c = compare_forwards(model, xs, weighted_loss)
    assert c.max_grad_diff < 1e-10 and c.loss_diff < 1e-12 and c.same
    assert c.grad_scale > 1e-3  # the gradients compared are not all zero
    assert c.tracked_increments is None and c.batch_sizes == tuple(range(3, 3 + k))
    # the loss computed by hand: one forward per batch
    by_hand = weighted_loss([model(x) for x in xs]).item()
    assert c.loss_separate == pytest.approx(by_hand, abs=1e-12)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_train_mode_batchnorm_updates_k_times_and_differs(k):
    torch.manual_seed(0)
    model = mlp("batch").train()
    xs = batches(*([4] * k))
    c = compare_forwards(model, xs, weighted_loss)
    assert c.tracked_increments == (1, k)
    assert c.loss_diff > 1e-4 and c.max_grad_diff > 1e-4 and not c.same
    # the running mean after k separate forwards, by hand: k momentum-0.1 updates with each batch mean
    bn = model[1]
    expected = bn.running_mean.clone()
    for x in xs:
        expected = 0.9 * expected + 0.1 * model[0](x).mean(0).detach()
    torch.testing.assert_close(c.buffers_separate["1.running_mean"], expected, rtol=0, atol=1e-12)
    # concat: one update with the mean of the concatenation
    concat = 0.1 * model[0](torch.cat(xs)).mean(0).detach()
    torch.testing.assert_close(c.buffers_concat["1.running_mean"], concat, rtol=0, atol=1e-12)
    assert torch.equal(bn.num_batches_tracked, torch.tensor(0))  # the caller's model is untouched


def test_eval_mode_batchnorm_agrees():
    model = mlp("batch").eval()
    c = compare_forwards(model, batches(3, 4, 5), weighted_loss)
    assert c.same and c.tracked_increments == (0, 0)


def test_checkpointed_batchnorm_is_reported_from_the_buffers():
    # torch.utils.checkpoint re-runs the segment's forward in backward: BatchNorm updates twice
    torch.manual_seed(0)
    model = Checkpointed().double().train()
    c = compare_forwards(model, batches(4, 4, 4), weighted_loss)
    assert c.tracked_increments == (2, 6)
    assert c.tracked_increments_by_layer == {"seg.1": (2, 6)}


def test_tuple_outputs_are_split_per_head():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.f1, self.f2 = nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x):
            h = torch.relu(self.g(x))
            return self.f1(h), self.f2(h)

    model = TwoHeads().double()
    xs = batches(2, 3)
    outs = forward_outputs(model, xs, "concat")
    assert [tuple(o[0].shape) for o in outs] == [(2, 3), (3, 3)] and len(outs[0]) == 2
    c = compare_forwards(model, xs, lambda outs: sum(o1.sum() - o2.pow(2).sum() for o1, o2 in outs))
    assert c.max_grad_diff < 1e-12


def test_report_prints_and_renders():
    c = compare_forwards(mlp("batch").train(), batches(3, 3, 3), weighted_loss)
    text, page = str(c), c._repr_html_()
    assert "3 separate forwards" in text and "different" in text and "+1" in text and "+3" in text
    assert "<table>" in page and "firebrick" in page


def test_split_rows_refuses_outputs_without_one_row_per_sample():
    with pytest.raises(ValueError, match="cannot be split by rows"):
        split_rows(torch.zeros(3), [2, 2])


@pytest.mark.parametrize("bad, error, match", [
    ([], ValueError, "at least one batch"),
    (torch.zeros(3, 5), TypeError, "list or tuple"),
    ([torch.zeros(2, 5), torch.zeros(2, 4)], ValueError, "agree in every axis"),
    ([torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.float64)], ValueError, "same dtype"),
    ([torch.zeros(0, 5)], ValueError, "non-empty"),
    ([torch.zeros(2, 5), "x"], TypeError, "batch 1 must be a torch.Tensor"),
])
def test_bad_batches_are_refused(bad, error, match):
    with pytest.raises(error, match=match):
        compare_forwards(mlp().float(), bad, weighted_loss)


def test_non_scalar_loss_and_unsplittable_model_are_refused():
    with pytest.raises(ValueError, match="scalar"):
        compare_forwards(mlp(), batches(2, 2), lambda outs: torch.cat(outs).sum(0))

    class PoolsOverBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 2)

        def forward(self, x):
            return self.lin(x).mean(0, keepdim=True)  # one row for the whole batch

    with pytest.raises(ValueError, match="cannot be split by rows"):
        compare_forwards(PoolsOverBatch().double(), batches(2, 3), lambda outs: sum(o.sum() for o in outs))
    with pytest.raises(TypeError, match="callable"):
        compare_forwards(mlp(), batches(2, 2), "mean")


def test_nan_gradients_are_never_called_same():
    class SqrtHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(5, 3), nn.Linear(5, 3)
            with torch.no_grad():
                self.b.weight.zero_(), self.b.bias.zero_()

        def forward(self, x):
            return torch.cat([self.a(x), self.b(x).sqrt()], 1)  # d sqrt(0) = inf -> NaN differences

    c = compare_forwards(SqrtHead().double(), batches(3, 4), lambda outs: sum(o.sum() for o in outs))
    assert c.max_grad_diff != c.max_grad_diff  # NaN propagates through the maximum
    assert not c.same and "NaN" in c.verdict


def test_tolerance_is_relative_to_the_size_of_the_gradients():
    torch.manual_seed(0)
    model = mlp("none").float()
    xs = [x.float() * 100 for x in batches(64, 48)]  # large activations: float32 rounding ~1e-4 absolute
    c = compare_forwards(model, xs, lambda outs: sum(o.pow(2).sum() for o in outs))
    assert c.grad_scale > 10 and c.same
    coupled = compare_forwards(mlp("batch").train(), batches(4, 4), weighted_loss)
    assert not coupled.same  # the relative bar still separates real coupling in float64


def test_detached_loss_and_lazy_modules_are_refused_and_inputs_untouched():
    with pytest.raises(ValueError, match="without a gradient path"):
        compare_forwards(mlp(), batches(2, 2), lambda outs: weighted_loss(outs).detach())
    with pytest.raises(ValueError, match="lazy"):
        compare_forwards(nn.Sequential(nn.LazyLinear(3)).double(), batches(2, 2), weighted_loss)
    with pytest.raises(TypeError, match="torch.dtype"):
        compare_forwards(mlp(), batches(2, 2), weighted_loss, dtype="float64")
    xs = [x.requires_grad_() for x in batches(2, 3)]
    compare_forwards(mlp(), xs, weighted_loss)
    assert all(x.grad is None for x in xs)


def test_parameters_without_gradients_are_listed_not_compared():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(5, 2), nn.Linear(5, 2)

        def forward(self, x):
            return self.used(x)

    c = compare_forwards(Unused().double(), batches(2, 3), weighted_loss)
    assert c.no_grad_params == ["unused.weight", "unused.bias"] and "without a gradient" in str(c)


def test_nested_outputs_name_the_bad_element():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 2)

        def forward(self, x):
            return self.lin(x), (self.lin(x),)

    with pytest.raises(TypeError, match="element 1"):
        compare_forwards(Nested().double(), batches(2, 2), weighted_loss)


def test_per_source_model_counts_updates_over_its_sources():
    from mcd_helpers.norms import per_source_batchnorm
    model = per_source_batchnorm(mlp("batch")).train()
    c = compare_forwards(model, batches(4, 4, 4), weighted_loss)
    assert c.tracked_increments == (1, 3) and not c.same
    assert "+3" in str(c)
