"""mcd_helpers.strategies and mcd_helpers.compare on models that are not the package's own.

Reference values are computed here: losses with a hand-written cross-entropy and entropy,
BatchNorm's running statistics from the momentum formula, Jacobians with
torch.autograd.functional.jacobian.
"""

import copy

import pytest
import torch
from tiny_models import TinyTwoHead
from torch import nn

from mcd_helpers.models import TwoHeadNet
from mcd_helpers.multisource import source_net
from mcd_helpers.norms import per_source_batchnorm
from mcd_helpers.strategies import (
    LAYOUTS,
    STRATEGIES,
    de_interleave,
    forward_batches,
    interleave,
    split_rows,
    step_a_loss,
    step_b_loss,
)

D = torch.float64


class LayerNormTokens(nn.Module):
    """Tokens (N, T, d) -> Linear -> LayerNorm -> GELU -> mean over tokens -> two heads."""

    def __init__(self, d=6, k=3):
        super().__init__()
        self.proj, self.ln, self.h1, self.h2 = (
            nn.Linear(d, 8),
            nn.LayerNorm(8),
            nn.Linear(8, k),
            nn.Linear(8, k),
        )

    def forward(self, x):
        h = nn.functional.gelu(self.ln(self.proj(x))).mean(dim=1)
        return self.h1(h), self.h2(h)


def mini_two_head(norm=True):
    """A TwoHeadNet (it takes detach_f2) with a conv -> [BatchNorm] -> ReLU -> mean-pool
    extractor."""
    g = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4) if norm else nn.Identity(),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return TwoHeadNet(g, 4, 3, 1).double()


def data(s_sup, s_unsup, k=3, seed=0, dtype=D):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(s_sup, generator=g, dtype=dtype),
        torch.randint(0, k, (s_sup[0],), generator=g),
        torch.randn(s_unsup, generator=g, dtype=dtype) + 0.5,
    )


def ce(z, y):
    return (torch.logsumexp(z, 1) - z[torch.arange(len(y)), y]).mean()


def ent(z):
    p = torch.exp(z - torch.logsumexp(z, 1, keepdim=True))
    return -(p * torch.log(p)).sum(1)


def hand_step_b(out_sup, out_unsup, y, margin=1.2):
    (a1, a2), (b1, b2) = out_sup, out_unsup
    return ce(a1, y) + ce(a2, y) + torch.clamp(margin - (ent(b1) - ent(b2)).mean(), min=0)


def hand_separate(model, x_sup, y_sup, x_unsup):
    return hand_step_b(model(x_sup), model(x_unsup), y_sup)


def hand_concat(model, x_sup, y_sup, x_unsup):
    l1, l2 = model(torch.cat([x_sup, x_unsup]))
    n = len(x_sup)
    return hand_step_b((l1[:n], l2[:n]), (l1[n:], l2[n:]), y_sup)


def weighted(outputs):  # parts weighted differently, so no symmetry hides a difference
    return sum((i + 1) * (o**2).mean() for i, o in enumerate(outputs))


def mlp(norm="none"):
    n = {"none": nn.Identity(), "layer": nn.LayerNorm(6), "batch": nn.BatchNorm1d(6)}[norm]
    return nn.Sequential(nn.Linear(5, 6), n, nn.Tanh(), nn.Linear(6, 3)).double()


def xs(*sizes):
    g = torch.Generator().manual_seed(sum(sizes))
    return [torch.randn(n, 5, generator=g, dtype=D) + i for i, n in enumerate(sizes)]


# ---- Step A, Step B -----------------------------------------------------------------------------


def test_split_rows_splits_a_tensor_and_each_head_by_rows():
    a, b = torch.arange(15.0).reshape(5, 3), -torch.arange(10.0).reshape(5, 2)
    parts = split_rows(a, [2, 3])
    assert [p.tolist() for p in parts] == [a[:2].tolist(), a[2:].tolist()]
    (a0, b0), (a1, b1) = split_rows((a, b), [4, 1])
    assert (
        torch.equal(a0, a[:4])
        and torch.equal(b0, b[:4])
        and torch.equal(a1, a[4:])
        and torch.equal(b1, b[4:])
    )


@pytest.mark.parametrize(
    "output, error, match",
    [
        (
            torch.zeros(3),
            ValueError,
            r"output \(3,\).*\(2, 2\).*\b4\b",
        ),
        (torch.tensor(1.0), ValueError, r"output \(\)"),
        (
            (torch.zeros(4), (torch.zeros(4),)),
            TypeError,
            r"\['Tensor', 'tuple'\]",
        ),
        ({"logits": torch.zeros(4)}, TypeError, r"\bdict\b"),
    ],
)
def test_split_rows_refuses_outputs_without_one_row_per_sample(output, error, match):
    with pytest.raises(error, match=match):
        split_rows(output, [2, 2])


def test_forward_batches_feeds_batch_i_through_source_i():
    model = per_source_batchnorm(TinyTwoHead("batch")).double()
    x_sup, _, x_unsup = data((4, 1, 5, 5), (6, 1, 5, 5))
    x = [x_sup, x_unsup]
    forward_batches(model, x, "separate")
    with torch.no_grad():
        for i in (0, 1):  # one momentum-0.1 update of source i's mean, with batch i's mean
            want = 0.1 * model.conv(x[i]).mean(dim=(0, 2, 3))
            torch.testing.assert_close(model.norm.running_mean[i], want, rtol=0, atol=1e-14)
    assert model.norm.num_batches_tracked.tolist() == [1, 1] and model.norm.source == 0
    with pytest.raises(ValueError, match="layout.*'zip'"):
        forward_batches(model, x, "zip")


@pytest.mark.parametrize(
    "strategy", [s for s, row in STRATEGIES.items() if row.step_b in ("concat", "separate")]
)
def test_step_b_loss_of_every_strategy_matches_the_hand_loss(strategy):
    base = TinyTwoHead("batch").double()
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (3, 1, 5, 5))
    # train-mode BatchNorm normalises with the batch: per-source BN gives the same outputs
    ref = copy.deepcopy(base)
    concat = STRATEGIES[strategy].step_b == "concat"
    want = (hand_concat if concat else hand_separate)(ref, x_sup, y_sup, x_unsup)
    other = (hand_separate if concat else hand_concat)(copy.deepcopy(base), x_sup, y_sup, x_unsup)
    model = per_source_batchnorm(base) if strategy == "split-bn" else base
    loss, parts = step_b_loss(model, x_sup, y_sup, x_unsup, strategy)
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)
    # the strategies really differ under train-mode BatchNorm
    assert abs(loss.item() - other.item()) > 1e-4
    assert parts["ce"] + parts["dis"] == pytest.approx(loss.item(), abs=1e-12)
    tracked = model.norm.num_batches_tracked
    assert tracked.tolist() == (1 if concat else {"split-bn": [1, 1]}.get(strategy, 2))


def test_interleave_strategy_forwards_two_halves_each_half_labeled_and_half_unlabeled():
    base = TinyTwoHead("batch").double()
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (4, 1, 5, 5))
    seen = []
    base.conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    loss, _ = step_b_loss(base, x_sup, y_sup, x_unsup, "interleave")
    # two forwards of 4 rows: labeled rows 0, 2 and unlabeled rows 0, 2, then rows 1, 3 of each
    first = torch.cat([x_sup[[0, 2]], x_unsup[[0, 2]]])
    second = torch.cat([x_sup[[1, 3]], x_unsup[[1, 3]]])
    assert len(seen) == 2 and torch.equal(seen[0], first) and torch.equal(seen[1], second)
    assert base.norm.num_batches_tracked.item() == 2
    # the loss by hand from those two forwards, each row back in its place in cat([x_sup, x_unsup])
    ref = copy.deepcopy(base)
    (a1, a2), (b1, b2) = ref(first), ref(second)
    l1, l2 = torch.empty(8, 3, dtype=D), torch.empty(8, 3, dtype=D)
    l1[[0, 2, 4, 6]], l2[[0, 2, 4, 6]] = a1, a2
    l1[[1, 3, 5, 7]], l2[[1, 3, 5, 7]] = b1, b2
    want = hand_step_b((l1[:4], l2[:4]), (l1[4:], l2[4:]), y_sup)
    assert loss.item() == pytest.approx(want.item(), abs=1e-12)


@pytest.mark.parametrize(
    "strategy, y, match",
    [
        (
            "both",
            None,
            "strategy.*separate, concat, split-bn, recalibrate, concat-both, eval-bn, "
            "eval-bn-concat.*'both'",
        ),
        (
            "split-bn",
            None,
            r"'split-bn'.*mcd_helpers\.norms\.per_source_batchnorm\(model\)",
        ),
        ("concat", torch.tensor([0, 1, 2, 7]), r"labels.*\[0, 3\).*\[7\]"),
    ],
)
def test_step_b_loss_refuses_what_it_cannot_run(strategy, y, match):
    x_sup, y_sup, x_unsup = data((4, 1, 5, 5), (3, 1, 5, 5), dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        step_b_loss(TinyTwoHead("batch"), x_sup, y_sup if y is None else y, x_unsup, strategy)


@pytest.mark.parametrize("per_source", [False, True])
def test_step_a_loss_lets_only_ce_f1_reach_g(per_source):
    base = mini_two_head()
    model = per_source_batchnorm(base) if per_source else base
    x, y, _ = data((5, 1, 6, 6), (1, 1, 6, 6))
    loss = step_a_loss(model, x, y)
    loss.backward()
    ref = copy.deepcopy(base)
    l1, l2 = ref(x)
    ce1, ce2 = ce(l1, y), ce(l2, y)
    assert loss.item() == pytest.approx((ce1 + ce2).item(), abs=1e-12)
    g_f1, f2 = [*ref.G.parameters(), *ref.F1.parameters()], list(ref.F2.parameters())
    for mine, want in zip(
        [*model.G.parameters(), *model.F1.parameters(), *model.F2.parameters()],
        [*torch.autograd.grad(ce1, g_f1, retain_graph=True), *torch.autograd.grad(ce2, f2)],
    ):
        torch.testing.assert_close(mine.grad, want, rtol=0, atol=1e-12)
    if per_source:  # the labeled batch goes through source 0's statistics
        assert model.G[1].num_batches_tracked.tolist() == [1, 0]


# ---- layouts ------------------------------------------------------------------------------------


def test_interleave_known_answer_and_inverse():
    x = torch.arange(12)  # three sources of four rows: 0-3, 4-7, 8-11
    out = interleave(x, 3)
    assert out.tolist() == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]
    # row j*size+i -> i*(N/size)+j
    assert all(out[i * 4 + j] == x[j * 3 + i] for i in range(3) for j in range(4))
    assert torch.equal(de_interleave(out, 3), x)
    y = torch.randn(12, 2, 3)
    assert torch.equal(de_interleave(interleave(y, 4), 4), y) and torch.equal(
        interleave(de_interleave(y, 2), 2), y
    )


def test_each_chunk_of_an_interleaved_batch_holds_an_equal_share_of_every_source():
    # FixMatch's point, for sources whose size is a multiple of their number: 3 sources of 6 rows, 2
    # of each per chunk
    source = torch.arange(18) // 6
    assert [sorted(c.tolist()) for c in source[interleave(torch.arange(18), 3)].chunk(3)] == [
        [0, 0, 1, 1, 2, 2]
    ] * 3


@pytest.mark.parametrize("fn", [interleave, de_interleave])
@pytest.mark.parametrize("n, size", [(10, 3), (10, 0), (4, -1)])
def test_interleave_needs_n_divisible_by_size(fn, n, size):
    with pytest.raises(ValueError, match=rf"N = {n}\b.*size = {size}\b"):
        fn(torch.arange(n), size)


def chunk_by_hand(model, xs, order):
    """Rows of cat(xs) in ``order`` cut into len(xs) forwards, outputs put back in source order."""
    x, k = torch.cat(xs), len(xs)
    out = torch.empty(len(x), 2, dtype=x.dtype)
    for idx in torch.tensor(order).chunk(k):
        out[idx] = model(x[idx])
    return list(out.split([len(t) for t in xs]))


def test_layouts_are_the_forwards_they_describe():
    torch.manual_seed(0)
    net = source_net("batch").double().train()
    xs = [
        torch.randn(6, 8, dtype=D),
        torch.randn(6, 8, dtype=D) + 3,
        torch.randn(6, 8, dtype=D) - 2,
    ]
    with torch.no_grad():
        got = {
            lay: forward_batches(net, xs, lay, torch.Generator().manual_seed(5)) for lay in LAYOUTS
        }
        perm = torch.randperm(18, generator=torch.Generator().manual_seed(5)).tolist()
        want = {
            "concat": list(net(torch.cat(xs)).split(6)),
            "separate": [net(x) for x in xs],
            "chunks": chunk_by_hand(net, xs, list(range(18))),
            # rows 0, 3, 6, ...
            "interleave": chunk_by_hand(net, xs, [j * 3 + i for i in range(3) for j in range(6)]),
            "mixed": chunk_by_hand(net, xs, perm),
        }
    for lay in LAYOUTS:
        for a, b in zip(got[lay], want[lay]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lay)
    # BatchNorm: the layouts really differ
    assert (got["concat"][0] - got["separate"][0]).abs().max() > 1e-3
    assert (got["interleave"][0] - got["separate"][0]).abs().max() > 1e-3


def test_without_coupling_every_layout_gives_the_same_outputs_in_source_order():
    plain = source_net("none").double()
    xs = [torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D) + 3]
    ref = [plain(x) for x in xs]
    for lay in LAYOUTS:
        for a, b in zip(forward_batches(plain, xs, lay, torch.Generator().manual_seed(1)), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lay)
    # unequal sizes are fine for the layouts that do not need equal chunks
    uneven = [xs[0], xs[1][:3]]
    assert [
        len(o) for o in forward_batches(plain, uneven, "mixed", torch.Generator().manual_seed(1))
    ] == [4, 3]


@pytest.mark.parametrize(
    "model, xs, layout, match",
    [
        (
            source_net(),
            [torch.randn(4, 8)] * 2,
            "zip",
            r"layout.*concat, separate, interleave.*'zip'",
        ),
        (
            source_net(),
            [torch.randn(4, 8), torch.randn(3, 8)],
            "interleave",
            r"'interleave'.*\[4, 3\]",
        ),
        (
            source_net(),
            [torch.randn(4, 8), torch.randn(3, 8)],
            "chunks",
            r"'chunks'.*\[4, 3\]",
        ),
    ],
)
def test_forward_batches_refuses_layouts_it_cannot_run(model, xs, layout, match):
    with pytest.raises(ValueError, match=match):
        forward_batches(model, xs, layout)


def _mixmatch_interleave(xy, batch):
    # YU1ut/MixMatch-pytorch train.py, written out: k groups per batch, group i of batch 0 <-> group
    # i of batch i
    k = len(xy)
    bounds = [round(p * batch / k) for p in range(k + 1)]
    parts = [[v[bounds[p] : bounds[p + 1]] for p in range(k)] for v in xy]
    for i in range(1, k):
        parts[0][i], parts[i][i] = parts[i][i], parts[0][i]
    return [torch.cat(p) for p in parts]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_fixmatch_and_mixmatch_interleave_agree_on_shares_for_two_sources_only(k):
    n = 12
    sources = [torch.full((n,), s) for s in range(k)]
    fix = [
        torch.bincount(ch, minlength=k).tolist()
        for ch in interleave(torch.cat(sources), k).chunk(k)
    ]
    mix = [torch.bincount(b, minlength=k).tolist() for b in _mixmatch_interleave(sources, n)]
    assert fix == [[n // k] * k] * k  # FixMatch: every chunk an equal share of every source
    assert mix[0] == [n // k] * k  # MixMatch: batch 0 is representative ...
    # ... batch i keeps its own rows except group i, which it gave to batch 0: no other source
    # reaches it
    assert all(
        mix[i] == [n // k if s == 0 else (n - n // k if s == i else 0) for s in range(k)]
        for i in range(1, k)
    )
    assert (fix == mix) == (k == 2)


def test_one_forward_of_an_interleaved_batch_gives_the_same_gradients_after_de_interleaving():
    # notebook 09's answer: with one forward (no chunks), interleaving changes nothing beyond
    # rounding, even under train-mode BatchNorm; per-chunk forwards of the same rows do change them
    torch.manual_seed(0)
    size, net = 15, source_net("batch").double()
    x = torch.randn(size * 4, 8, dtype=torch.float64)
    weights = torch.arange(len(x), dtype=torch.float64)  # a loss that depends on the row order

    def grads(forward):
        net.zero_grad()
        (forward(x)[:, 0] * weights).mean().backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    plain = grads(net)
    mixed = grads(lambda x: de_interleave(net(interleave(x, size)), size))
    chunked = grads(
        lambda x: de_interleave(torch.cat([net(c) for c in interleave(x, size).chunk(size)]), size)
    )
    assert torch.allclose(plain, mixed, rtol=0, atol=1e-12)
    assert (plain - chunked).abs().max() > 1e-6
