"""compare_forwards: k batches, one concatenated forward vs k forwards, on models built here."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcd_helpers import compare_forwards
from mcd_helpers.forwards import forward_outputs, split_rows


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
