"""mcd_helpers.multisource: batch layouts against per-chunk forwards by hand, the domains, the measured training."""
import numpy as np
import pytest
import torch
from scipy.optimize import linprog
from torch import nn

from mcd_helpers.multisource import (LAYOUTS, SOURCE_NORMS, de_interleave, interleave, layout_forward, make_domains,
                                     source_net, train_sources)
from mcd_helpers.norms import PerSourceBatchNorm

D = torch.float64


def test_interleave_known_answer_and_inverse():
    x = torch.arange(12)  # three sources of four rows: 0-3, 4-7, 8-11
    out = interleave(x, 3)
    assert out.tolist() == [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]
    assert all(out[i * 4 + j] == x[j * 3 + i] for i in range(3) for j in range(4))  # row j*size+i -> i*(N/size)+j
    assert torch.equal(de_interleave(out, 3), x)
    y = torch.randn(12, 2, 3)
    assert torch.equal(de_interleave(interleave(y, 4), 4), y) and torch.equal(interleave(de_interleave(y, 2), 2), y)


def test_each_chunk_of_an_interleaved_batch_holds_an_equal_share_of_every_source():
    # FixMatch's point, for sources whose size is a multiple of their number: 3 sources of 6 rows, 2 of each per chunk
    source = torch.arange(18) // 6
    assert [sorted(c.tolist()) for c in source[interleave(torch.arange(18), 3)].chunk(3)] == [[0, 0, 1, 1, 2, 2]] * 3


@pytest.mark.parametrize("fn", [interleave, de_interleave])
@pytest.mark.parametrize("n, size", [(10, 3), (10, 0), (4, -1)])
def test_interleave_needs_n_divisible_by_size(fn, n, size):
    with pytest.raises(ValueError, match=f"needs N = {n} divisible by size = {size} \\(size >= 1\\)"):
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
    xs = [torch.randn(6, 8, dtype=D), torch.randn(6, 8, dtype=D) + 3, torch.randn(6, 8, dtype=D) - 2]
    with torch.no_grad():
        got = {lay: layout_forward(net, xs, lay, torch.Generator().manual_seed(5)) for lay in LAYOUTS}
        perm = torch.randperm(18, generator=torch.Generator().manual_seed(5)).tolist()
        want = {"concat": list(net(torch.cat(xs)).split(6)), "separate": [net(x) for x in xs],
                "chunks": chunk_by_hand(net, xs, list(range(18))),
                "interleave": chunk_by_hand(net, xs, [j * 3 + i for i in range(3) for j in range(6)]),  # rows 0, 3, 6, ...
                "mixed": chunk_by_hand(net, xs, perm)}
    for lay in LAYOUTS:
        for a, b in zip(got[lay], want[lay]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lay)
    assert (got["concat"][0] - got["separate"][0]).abs().max() > 1e-3  # BatchNorm: the layouts really differ
    assert (got["interleave"][0] - got["separate"][0]).abs().max() > 1e-3


def test_without_coupling_every_layout_gives_the_same_outputs_in_source_order():
    plain = source_net("none").double()
    xs = [torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D) + 3]
    ref = [plain(x) for x in xs]
    for lay in LAYOUTS:
        for a, b in zip(layout_forward(plain, xs, lay, torch.Generator().manual_seed(1)), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lay)
    # unequal sizes are fine for the layouts that do not need equal chunks
    uneven = [xs[0], xs[1][:3]]
    assert [len(o) for o in layout_forward(plain, uneven, "mixed", torch.Generator().manual_seed(1))] == [4, 3]


@pytest.mark.parametrize("model, xs, layout, match", [
    (source_net(), [torch.randn(4, 8)] * 2, "zip", r"layout must be one of \('concat', 'separate', 'mixed'.*got 'zip'"),
    (source_net(), [torch.randn(4, 8), torch.randn(3, 8)], "interleave", r"'interleave' needs sources of equal size, got \[4, 3\]"),
    (source_net(), [torch.randn(4, 8), torch.randn(3, 8)], "chunks", r"'chunks' needs sources of equal size"),
    (source_net("per_source"), [torch.randn(4, 8)] * 2, "concat", "per-source BatchNorm needs the 'separate' layout"),
    (source_net("per_source"), [torch.randn(4, 8)] * 2, "mixed", "per-source BatchNorm needs the 'separate' layout.*'mixed'"),
])
def test_layout_forward_refuses_layouts_it_cannot_run(model, xs, layout, match):
    with pytest.raises(ValueError, match=match):
        layout_forward(model, xs, layout)


def test_domains_are_shifted_copies_of_one_linear_task():
    data = {seed: make_domains(300, num_domains=3, seed=seed) for seed in (0, 7)}
    (x0, y0), (x1, y1), (x2, y2) = data[0]
    assert x0.shape == (300, 8) and x0.dtype == torch.float32 and y0.dtype == torch.int64 and set(y0.tolist()) == {0, 1}
    for d, x in enumerate((x0, x1, x2)):  # x = z + d * shift, z ~ N(0, I): mean d * 3 (5 sigma = 0.29)
        assert (x.mean(0) - 3.0 * d).abs().max() < 0.3
    # one w for every domain and seed: y = [w . (x - d * shift) > 0] is exactly linearly separable through 0
    z = torch.cat([x - 3.0 * d for s in data for d, (x, _) in enumerate(data[s])]).double().numpy()
    sign = np.where(torch.cat([y for s in data for _, y in data[s]]).numpy() == 1, 1.0, -1.0)
    lp = linprog(np.zeros(8), A_ub=-(sign[:, None] * z), b_ub=-np.full(len(z), 1e-6), bounds=[(None, None)] * 8)
    assert lp.status == 0  # feasible: one hyperplane separates all 1,800 samples
    # ... which a different task per seed would not be (labels of seed 7 flipped)
    sign_bad = sign.copy()
    sign_bad[900:] *= -1
    assert linprog(np.zeros(8), A_ub=-(sign_bad[:, None] * z), b_ub=-np.full(len(z), 1e-6),
                   bounds=[(None, None)] * 8).status == 2  # infeasible


ANY_NORM = (nn.BatchNorm1d, nn.GroupNorm, nn.LayerNorm, PerSourceBatchNorm)


@pytest.mark.parametrize("norm, layer, count", [
    ("batch", nn.BatchNorm1d, 2), ("frozen", nn.BatchNorm1d, 2), ("recalibrate", nn.BatchNorm1d, 2),
    ("no_running_stats", nn.BatchNorm1d, 2), ("group", nn.GroupNorm, 2), ("layer", nn.LayerNorm, 2),
    ("per_source", PerSourceBatchNorm, 2), ("none", ANY_NORM, 0)])
def test_source_net_uses_the_named_norm(norm, layer, count):
    net = source_net(norm, dim=5, hidden=16)
    layers = [m for m in net.modules() if isinstance(m, layer)]
    assert len(layers) == count and net(torch.randn(4, 5)).shape == (4, 2)
    assert all((m.running_mean is None) == (norm == "no_running_stats") for m in layers if isinstance(m, nn.BatchNorm1d))


def mean_acc(results, key, domain=0):
    return float(np.mean([getattr(r, key)[domain] for r in results]))


@pytest.fixture(scope="module")
def runs():
    """Two seeds of every norm with separate forwards, and of every layout with plain BatchNorm (8-15 s)."""
    by_norm = {n: [train_sources("separate", n, steps=150, seed=s) for s in range(2)] for n in SOURCE_NORMS}
    by_layout = {lay: by_norm["batch"] if lay == "separate" else [train_sources(lay, "batch", steps=150, seed=s)
                                                                  for s in range(2)] for lay in LAYOUTS}
    return by_norm, by_layout


@pytest.mark.slow
def test_separate_forwards_of_two_domains_fail_in_eval_mode_and_mixing_fixes_it(runs):
    # measured (2 seeds): separate and chunks 0.50-0.57 in eval, 0.96 with train-mode statistics; concat,
    # mixed and interleave >= 0.94
    _, by_layout = runs
    assert mean_acc(by_layout["separate"], "train_acc") - mean_acc(by_layout["separate"], "eval_acc") > 0.2
    for lay in ("concat", "mixed", "interleave"):
        assert mean_acc(by_layout[lay], "eval_acc") > mean_acc(by_layout["separate"], "eval_acc") + 0.2, lay
    assert mean_acc(by_layout["chunks"], "eval_acc") < mean_acc(by_layout["concat"], "eval_acc") - 0.2  # chunks = separate


@pytest.mark.slow
def test_each_fix_rescues_domain_0_and_recalibration_loses_domain_1(runs):
    # measured: plain 0.50; every fix 0.95-0.97 on domain 0; recalibrated domain 1 0.50, per-source domain 1 0.92
    by_norm, _ = runs
    plain = mean_acc(by_norm["batch"], "eval_acc")
    for norm in SOURCE_NORMS:
        if norm != "batch":
            assert mean_acc(by_norm[norm], "eval_acc") > plain + 0.2, norm
    assert mean_acc(by_norm["recalibrate"], "eval_acc", 1) < 0.7
    assert mean_acc(by_norm["per_source"], "eval_acc", 1) > mean_acc(by_norm["recalibrate"], "eval_acc", 1) + 0.2


@pytest.mark.slow
def test_without_train_mode_coupling_eval_and_train_accuracy_are_the_same(runs):
    by_norm, _ = runs
    for norm in ("group", "layer", "none", "frozen", "no_running_stats"):
        for r in by_norm[norm]:  # the same statistics normalise a pure test batch in both modes
            assert r.eval_acc == r.train_acc, norm
            assert len(r.losses) == 150 and all(np.isfinite(r.losses))


@pytest.mark.parametrize("kwargs, match", [
    (dict(layout="zip"), r"layout must be one of .*got 'zip', 200, 32"),
    (dict(steps=0), r"steps >= 1, batch >= 2; got 'separate', 0, 32"),
    (dict(batch=1), r"steps >= 1, batch >= 2; got 'separate', 200, 1"),
    (dict(norm="instance"), r"norm must be one of \('batch', 'group'.*got 'instance'"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_sources(**kwargs)


def _mixmatch_interleave(xy, batch):
    # YU1ut/MixMatch-pytorch train.py, written out: k groups per batch, group i of batch 0 <-> group i of batch i
    k = len(xy)
    bounds = [round(p * batch / k) for p in range(k + 1)]
    parts = [[v[bounds[p]:bounds[p + 1]] for p in range(k)] for v in xy]
    for i in range(1, k):
        parts[0][i], parts[i][i] = parts[i][i], parts[0][i]
    return [torch.cat(p) for p in parts]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_fixmatch_and_mixmatch_interleave_agree_on_shares_for_two_sources_only(k):
    n = 12
    sources = [torch.full((n,), s) for s in range(k)]
    fix = [torch.bincount(ch, minlength=k).tolist() for ch in interleave(torch.cat(sources), k).chunk(k)]
    mix = [torch.bincount(b, minlength=k).tolist() for b in _mixmatch_interleave(sources, n)]
    assert fix == [[n // k] * k] * k  # FixMatch: every chunk an equal share of every source
    assert mix[0] == [n // k] * k  # MixMatch: batch 0 is representative ...
    # ... batch i keeps its own rows except group i, which it gave to batch 0: no other source reaches it
    assert all(mix[i] == [n // k if s == 0 else (n - n // k if s == i else 0) for s in range(k)] for i in range(1, k))
    assert (fix == mix) == (k == 2)


def test_one_forward_of_an_interleaved_batch_gives_the_same_gradients_after_de_interleaving():
    # notebook 08's answer: with one forward (no chunks), interleaving changes nothing beyond rounding,
    # even under train-mode BatchNorm; per-chunk forwards of the same rows do change them
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
    chunked = grads(lambda x: de_interleave(torch.cat([net(c) for c in interleave(x, size).chunk(size)]), size))
    assert torch.allclose(plain, mixed, rtol=0, atol=1e-12)
    assert (plain - chunked).abs().max() > 1e-6
