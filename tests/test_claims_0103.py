"""Unit tests behind the prose claims of notebooks 01-03 (each named after its notebook section).

Claims about compare_strategies, coupling and step cost live in test_compare.py; graphs and
draw_graph in test_graphs.py; the losses in test_losses.py; infinite_loader in test_data.py;
running-statistics steady states in test_bn_stats.py; schedule memory in test_memory.py.
Tests here that would repeat those were removed.
"""
import copy
import gc
import itertools
import math
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mcd_helpers import discrepancy_loss, discrepancy_score, entropy, small_cnn, supervised_loss
from mcd_helpers.data.sets import infinite_loader
from mcd_helpers.teaching.graphs import graph_stats
from mcd_helpers.training.loop import step_b_loss
from tiny_models import MLPTwoHead, TinyTwoHead


# ---------------------------------------------------------------------------------------------
# 01: the two-head model and the losses
# ---------------------------------------------------------------------------------------------

def test_01_small_cnn_parameter_count_by_hand():
    w = 32
    convs = [(1, w), (w, 2 * w), (2 * w, 4 * w)]
    by_hand = sum(ci * co * 9 + 2 * co for ci, co in convs)  # conv (no bias before BN) + BN weight/bias
    by_hand += (4 * w) * 128 + 128 + 2 * (128 * 10 + 10)  # Linear to 128 features, two heads
    assert by_hand == 111_988
    assert sum(p.numel() for p in small_cnn().parameters()) == by_hand


def _np_entropy(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return -(p * np.log(np.clip(p, 1e-300, None))).sum(axis=1)


def _pair_with_gap(gap, k=10):
    """F1 uniform and F2 = t * e_0 with t solved (bisection) so that H(F1) - H(F2) = gap."""
    lo, hi = 0.0, 60.0
    for _ in range(100):
        t = (lo + hi) / 2
        z = np.zeros((1, k))
        z[0, 0] = t
        lo, hi = (t, hi) if math.log(k) - _np_entropy(z)[0] < gap else (lo, t)
    l2 = torch.zeros(1, k, dtype=torch.float64)
    l2[0, 0] = t
    return torch.zeros(1, k, dtype=torch.float64), l2


@pytest.mark.parametrize("gap, expected", [(0.0, 1.2), (0.5, 0.7), (2.0, 0.0)])
def test_01_hinge_worked_numbers(gap, expected):
    assert discrepancy_loss(*_pair_with_gap(gap), margin=1.2).item() == pytest.approx(expected, abs=1e-6)


def test_01_mean_before_hinge_lets_ood_samples_carry_the_gap():
    # Two OOD-like samples (gap 2.25) and two ID-like ones (gap 0.2): mean 1.225 > m = 1.2.
    pairs = [_pair_with_gap(g) for g in (2.25, 2.25, 0.2, 0.2)]
    l1 = torch.cat([a for a, _ in pairs]).requires_grad_(True)
    l2 = torch.cat([b for _, b in pairs]).requires_grad_(True)
    loss = discrepancy_loss(l1, l2, margin=1.2)
    assert loss.item() == 0.0
    g1, g2 = torch.autograd.grad(loss, (l1, l2))
    assert g1.abs().max() == 0 and g2.abs().max() == 0  # the ID-like samples are left agreeing
    per_sample = torch.clamp(1.2 - (entropy(l1) - entropy(l2)), min=0).mean()  # hinge, then mean
    assert per_sample.item() == pytest.approx(0.5, abs=1e-6)
    h1, h2 = torch.autograd.grad(per_sample, (l1, l2))
    assert h2[2:].abs().max() > 1e-3 and h1[:2].abs().max() == 0  # it would push the ID-like samples


def _openood_entropy(logits):
    """OpenOOD's openood/trainers/mcd_trainer.py: softmax and sum over dim 0 (the batch axis)."""
    score = torch.softmax(logits, dim=0)
    return torch.sum(-score * torch.log(score), dim=0)


def test_01_openood_entropy_is_over_the_batch_and_torch_max_is_not_a_hinge():
    two = torch.tensor([[6.0, 0.0, 0.0], [6.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_openood_entropy(two), torch.full((3,), math.log(2), dtype=torch.float64))
    assert (entropy(two) < 0.05).all()
    x = torch.randn(7, 5, dtype=torch.float64)
    np.testing.assert_allclose(_openood_entropy(x).numpy(), _np_entropy(x.numpy().T))  # the transpose's entropy
    gap = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    not_a_hinge = torch.max(1.2 - gap, 0)[0]
    assert not_a_hinge.item() == pytest.approx(-0.8)
    assert torch.autograd.grad(not_a_hinge, gap)[0].item() == -1.0
    hinge = torch.nn.functional.relu(1.2 - gap)  # OpenOOD's concatenated-forward version
    assert hinge.item() == 0.0


def test_01_score_rises_to_two_minus_two_over_k_as_f2_grows_confident():
    k = 10
    s = torch.stack([discrepancy_score(torch.zeros(1, k, dtype=torch.float64), t * torch.eye(k, dtype=torch.float64)[:1])[0]
                     for t in torch.linspace(0, 40, 41)])
    assert (s.diff() >= 0).all() and s[0] == 0 and s[-1].item() == pytest.approx(2 - 2 / k, abs=1e-12)


def test_01_fashion_mnist_test_set_is_near_mean_0_std_1():
    from mcd_helpers.data import sets as data
    if not data.DEBIAN_FMNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist not installed")
    x, _ = data.load_fashion_mnist(train=False)
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05


def test_01_normalisation_constants_are_the_training_sets_mean_and_std():
    """FMNIST_MEAN / FMNIST_STD against the raw training pixels read here from the IDX file (not the loader)."""
    import gzip
    from mcd_helpers.data import sets as data
    path = data.DEBIAN_FMNIST_DIR / "train-images-idx3-ubyte.gz"
    if not path.exists():
        pytest.skip("dataset-fashion-mnist not installed")
    with gzip.open(path, "rb") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8, offset=16)  # IDX header: 16 bytes for 3-d images
    assert raw.size == 60_000 * 28 * 28
    pixels = raw.astype(np.float64) / 255.0
    assert round(pixels.mean(), 4) == data.FMNIST_MEAN == 0.2860
    assert round(pixels.std(), 4) == data.FMNIST_STD == 0.3530
    x, _ = data.load_fashion_mnist(train=True)  # normalised with them: mean ~0, std ~1 on the training set
    assert abs(x.double().mean().item()) < 1e-3 and abs(x.double().std().item() - 1) < 1e-3


def test_01_at_initialisation_heads_are_near_uniform():
    torch.manual_seed(0)
    model = small_cnn().eval()
    with torch.no_grad():
        l1, l2 = model(torch.randn(16, 1, 28, 28))
    assert (entropy(l1) > math.log(10) - 0.2).all() and (entropy(l2) > math.log(10) - 0.2).all()
    assert discrepancy_loss(l1, l2).item() == pytest.approx(1.2, abs=0.1)


# ---------------------------------------------------------------------------------------------
# 02: loaders, loops, rounding, loss weighting, in-place trap
# ---------------------------------------------------------------------------------------------

def _toy_loader():
    return DataLoader(TensorDataset(torch.arange(6)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


def test_02_dataloader_is_not_subscriptable():
    with pytest.raises(TypeError, match="not subscriptable"):
        _toy_loader()[0]


def _kept_alive(it, n=3):
    refs = [weakref.ref(next(it)[0]) for _ in range(n)]
    gc.collect()
    return sum(r() is not None for r in refs)


def test_02_cycle_holds_the_first_pass_in_memory():
    assert _kept_alive(itertools.cycle(_toy_loader())) == 3
    assert _kept_alive(infinite_loader(_toy_loader())) <= 1


def _train(model, batches, concat, lr=0.05):
    """Both corrected seed loops, written independently of mcd_helpers.training.loop."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x_s, y_s, x_u in batches:
        if concat:
            n = len(x_s)
            o1, o2 = model(torch.cat([x_s, x_u]))
            loss = supervised_loss(o1[:n], o2[:n], y_s) + discrepancy_loss(o1[n:], o2[n:])
        else:
            loss = supervised_loss(*model(x_s), y_s) + discrepancy_loss(*model(x_u))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("norm, equal", [("none", True), ("group", True), ("batch", False)])
def test_02_corrected_loops_train_the_same_model_iff_no_coupling(norm, equal):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g),
                torch.randn(3, 1, 6, 6, generator=g, dtype=torch.float64)) for _ in range(3)]
    start = TinyTwoHead(norm).double()
    a, b = _train(copy.deepcopy(start), batches, True), _train(copy.deepcopy(start), batches, False)
    diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert (diff < 1e-12) if equal else (diff > 1e-6)


def test_02_concat_loop_loss_is_step_b_concat():
    model = MLPTwoHead().double()
    x_s, y_s, x_u = torch.randn(4, 12, dtype=torch.float64), torch.tensor([0, 1, 2, 3]), torch.randn(3, 12, dtype=torch.float64)
    o1, o2 = copy.deepcopy(model)(torch.cat([x_s, x_u]))
    by_hand = supervised_loss(o1[:4], o2[:4], y_s) + discrepancy_loss(o1[4:], o2[4:])
    assert step_b_loss(copy.deepcopy(model), x_s, y_s, x_u, "concat")[0].item() == pytest.approx(by_hand.item(), abs=1e-12)


def test_02_float32_addition_is_not_associative_float64_is_tighter():
    v = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    d32 = (v.sum() - (v[:30_000].sum() + v[30_000:].sum())).abs().item()
    v64 = v.double()
    d64 = (v64.sum() - (v64[:30_000].sum() + v64[30_000:].sum())).abs().item()
    assert d32 > 0 and d64 < 1e-10 and d64 < d32


def test_02_one_mean_over_a_concatenation_weights_parts_by_size_row_by_row():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (64,), generator=g)
    logits = torch.randn(64, 10, generator=g, dtype=torch.float64)
    n_a = 48
    logits[:n_a] += 4 * F.one_hot(y[:n_a], 10)  # part A fitted, part B not: their losses really differ
    ce_a, ce_b = F.cross_entropy(logits[:n_a], y[:n_a]), F.cross_entropy(logits[n_a:], y[n_a:])
    assert ce_b.item() - ce_a.item() > 1.0
    ce_cat = F.cross_entropy(logits, y)
    assert ce_cat.item() == pytest.approx((n_a * ce_a.item() + 16 * ce_b.item()) / 64, abs=1e-12)
    # dCE/dlogits per row: 1/64 in the concatenated mean; 1/48 and 1/16 in CE_A + CE_B.
    lg = logits.clone().requires_grad_(True)
    (F.cross_entropy(lg[:n_a], y[:n_a]) + F.cross_entropy(lg[n_a:], y[n_a:])).backward()
    lg2 = logits.clone().requires_grad_(True)
    F.cross_entropy(lg2, y).backward()
    torch.testing.assert_close(lg.grad[n_a:], 4 * lg2.grad[n_a:], rtol=0, atol=1e-15)  # B rows: (1/16) / (1/64)
    torch.testing.assert_close(lg.grad[:n_a], (64 / 48) * lg2.grad[:n_a], rtol=0, atol=1e-15)
    assert F.cosine_similarity(lg.grad.flatten(), lg2.grad.flatten(), dim=0) < 0.999  # another direction


def test_02_optimizer_step_between_forward_and_backward_raises_with_the_versions():
    torch.manual_seed(0)
    model = TinyTwoHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x_s, y_s, x_u = torch.randn(3, 1, 4, 4), torch.tensor([0, 1, 2]), torch.randn(2, 1, 4, 4)
    loss_sup, loss_unsup = supervised_loss(*model(x_s), y_s), discrepancy_loss(*model(x_u))
    before = model.head_a.weight._version
    # no retain_graph: the two graphs share no nodes except the parameters' AccumulateGrad leaves
    # (which save nothing), and a backward frees only its own nodes' saved tensors
    loss_sup.backward()
    opt.step()
    assert model.head_a.weight._version == before + 1
    with pytest.raises(RuntimeError, match=f"is at version {before + 1}; expected version {before} instead"):
        loss_unsup.backward()


def test_02_backward_twice_through_a_shared_graph_raises():
    model = TinyTwoHead()
    x_s, y_s, x_u = torch.randn(3, 1, 4, 4), torch.tensor([0, 1, 2]), torch.randn(2, 1, 4, 4)
    loss_sup, loss_unsup = supervised_loss(*model(x_s), y_s), discrepancy_loss(*model(x_u))
    loss_sup.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        (loss_sup + loss_unsup).backward()


def test_02_one_backward_per_part_trains_exactly_like_the_summed_backward_with_batchnorm():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g),
                torch.randn(3, 1, 6, 6, generator=g, dtype=torch.float64)) for _ in range(3)]
    start = TinyTwoHead("batch").double()
    summed = _train(copy.deepcopy(start), batches, concat=False)
    per_part = copy.deepcopy(start)
    opt = torch.optim.SGD(per_part.parameters(), lr=0.05)
    for x_s, y_s, x_u in batches:
        opt.zero_grad()
        supervised_loss(*per_part(x_s), y_s).backward()
        discrepancy_loss(*per_part(x_u)).backward()
        opt.step()
    for a, b in zip(summed.state_dict().values(), per_part.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # parameters and running statistics


def test_02_dropout_masks_are_identical_on_cpu_when_reseeded():
    """Observed in torch 2.14.1's CPU kernel (bernoulli_ on the default CPU generator); not a documented
    guarantee, and not checked for CUDA: if a torch update breaks this, notebook 02 section 4 must change."""
    x = torch.ones(16, 32, dtype=torch.float64)
    drop = nn.Dropout(0.5)
    torch.manual_seed(3)
    cat = drop(x)
    torch.manual_seed(3)
    sep = torch.cat([drop(x[:10]), drop(x[10:])])
    assert torch.equal(cat, sep)
    torch.manual_seed(3)
    drop(x)
    assert not torch.equal(torch.cat([drop(x[:10]), drop(x[10:])]), cat)  # a continued stream: other masks


def test_02_concatenated_running_var_has_the_between_group_term():
    from mcd_helpers.teaching.bn_stats import batch_stats, pooled_variance, unbiased
    g = torch.Generator().manual_seed(0)
    h_s = torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64)
    h_u = torch.randn(5, 3, 4, 4, generator=g, dtype=torch.float64) + 2.0
    bn = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        bn(torch.cat([h_s, h_u]))
    (m_s, v_s, n_s), (m_u, v_u, n_u) = batch_stats(h_s), batch_stats(h_u)
    expected = 0.9 * torch.ones(3, dtype=torch.float64) + 0.1 * unbiased(pooled_variance(m_s, v_s, n_s, m_u, v_u, n_u), n_s + n_u)
    torch.testing.assert_close(bn.running_var, expected, rtol=0, atol=1e-12)
    within = 0.9 + 0.1 * unbiased((n_s * v_s + n_u * v_u) / (n_s + n_u), n_s + n_u)
    assert (bn.running_var - within).min() > 0.05  # without the between-group term it would be far off


# ---------------------------------------------------------------------------------------------
# 03: gradients add up
# ---------------------------------------------------------------------------------------------

def _parts(model, x_s, y_s, x_u, strategy):
    """(L_sup, L_unsup) from two forwards or from one concatenated forward, written out by hand."""
    if strategy == "separate":
        return supervised_loss(*model(x_s), y_s), discrepancy_loss(*model(x_u))
    n = len(x_s)
    o1, o2 = model(torch.cat([x_s, x_u]))
    return supervised_loss(o1[:n], o2[:n], y_s), discrepancy_loss(o1[n:], o2[n:])


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 1, 4, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0]),
            2 * torch.randn(3, 1, 4, 4, generator=g, dtype=torch.float64) + 1)


def _accumulate_grad_nodes(fn, found):
    if hasattr(fn, "variable"):
        found[id(fn.variable)] = fn
    for nxt, _ in (fn.next_functions if fn is not None else ()):
        _accumulate_grad_nodes(nxt, found)
    return found


def test_03_both_forwards_reach_the_same_accumulate_grad_node():
    model = TinyTwoHead().double()
    ls, lu = _parts(model, *_batch(), "separate")
    a, b = _accumulate_grad_nodes(ls.grad_fn, {}), _accumulate_grad_nodes(lu.grad_fn, {})
    assert set(a) == set(b) == {id(p) for p in model.parameters()}
    assert all(a[k] is b[k] for k in a)


def _graph_nodes(fn):
    found, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in found:
            found.add(node)
            stack += [nxt for nxt, _ in node.next_functions]
    return found


def test_03_separate_graphs_share_only_the_accumulate_grad_leaves_but_save_the_same_weights():
    model = TinyTwoHead().double()
    ls, lu = _parts(model, *_batch(), "separate")
    shared = _graph_nodes(ls.grad_fn) & _graph_nodes(lu.grad_fn)
    assert len(shared) == sum(1 for _ in model.parameters())
    assert all(type(n).__name__ == "AccumulateGrad" for n in shared)
    assert not any(a.startswith("_saved") for n in shared for a in dir(n))  # the leaves save nothing
    # ... yet nodes of both graphs save the same weight storage: "no shared saved tensors" would be wrong
    w = model.head_a.weight.untyped_storage().data_ptr()
    saved = []
    for loss in (ls, lu):
        ptrs = set()
        for node in _graph_nodes(loss.grad_fn):
            for attr in dir(node):
                if attr.startswith("_saved"):
                    t = getattr(node, attr)
                    if isinstance(t, torch.Tensor):
                        ptrs.add(t.untyped_storage().data_ptr())
        saved.append(ptrs)
    assert w in saved[0] and w in saved[1]
    ls.backward()
    lu.backward()  # no retain_graph needed: the first backward freed only its own nodes' saved tensors


def test_03_parameter_hook_fires_once_per_backward_with_the_summed_gradient():
    torch.manual_seed(0)
    model = TinyTwoHead().double()
    w = model.head_a.weight
    ls, lu = _parts(model, *_batch(), "separate")
    g_s, g_u = torch.autograd.grad(ls, w, retain_graph=True)[0], torch.autograd.grad(lu, w)[0]
    assert g_s.abs().max() > 1e-3 and g_u.abs().max() > 1e-3
    calls = []
    handle = w.register_hook(lambda g: calls.append(g.clone()))
    sum(_parts(model, *_batch(), "separate")).backward()
    assert len(calls) == 1
    assert torch.equal(calls[0], g_s + g_u)  # the same two terms added once: bit for bit
    calls.clear()
    ls, lu = _parts(model, *_batch(), "separate")
    ls.backward()
    lu.backward()
    handle.remove()
    assert len(calls) == 2


@pytest.mark.parametrize("strategy", ["separate", "concat"])
@pytest.mark.parametrize("norm", ["none", "batch"])
def test_03_linearity_holds_on_either_graph(norm, strategy):
    torch.manual_seed(0)
    model = TinyTwoHead(norm).double()
    params = list(model.parameters())
    ls, lu = _parts(model, *_batch(), strategy)
    gs = torch.autograd.grad(ls, params, retain_graph=True)
    gu = torch.autograd.grad(lu, params, retain_graph=True)
    gt = torch.autograd.grad(ls + lu, params)
    for a, b, t in zip(gs, gu, gt):
        torch.testing.assert_close(a + b, t, rtol=0, atol=1e-12)


@pytest.mark.parametrize("norm, train, same", [("none", True, True), ("group", True, True), ("layer", True, True),
                                               ("batch", False, True), ("batch", True, False)])
def test_03_l_cat_equals_l_sep_at_the_same_theta_iff_no_layer_couples_samples(norm, train, same):
    for seed in range(3):
        torch.manual_seed(seed)
        model = TinyTwoHead(norm).double().train(train)
        results = {}
        for strategy in ("concat", "separate"):
            m = copy.deepcopy(model)
            loss = sum(_parts(m, *_batch(seed), strategy))
            results[strategy] = (loss.item(), torch.autograd.grad(loss, list(m.parameters())))
        dl = abs(results["concat"][0] - results["separate"][0])
        dg = max((a - b).abs().max().item() for a, b in zip(results["concat"][1], results["separate"][1]))
        assert (dl < 1e-12 and dg < 1e-12) if same else (dl > 1e-6 and dg > 1e-6)


def test_03_per_part_backward_needs_no_retain_graph_but_the_concat_graph_does():
    torch.manual_seed(0)
    model = TinyTwoHead().double()
    gt = torch.autograd.grad(sum(_parts(model, *_batch(), "separate")), list(model.parameters()))
    ls, lu = _parts(model, *_batch(), "separate")
    ls.backward()
    lu.backward()
    for p, t in zip(model.parameters(), gt):
        torch.testing.assert_close(p.grad, t, rtol=0, atol=1e-12)
    cs, cu = _parts(model, *_batch(), "concat")
    cs.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        cu.backward()


def test_03_first_graph_is_freed_before_the_second_forward():
    from mcd_helpers.teaching.memory import SavedTensorMeter
    model = TinyTwoHead("batch").double()
    x_s, y_s, x_u = _batch()
    with SavedTensorMeter(exclude=[*model.parameters(), x_s, x_u]) as meter:
        ls = supervised_loss(*model(x_s), y_s)
        first = meter.live_bytes
        ls.backward()
        assert meter.live_bytes == 0
        lu = discrepancy_loss(*model(x_u))
        second = meter.live_bytes
        lu.backward()
    assert first > 0 and second > 0 and meter.peak_bytes == max(first, second)


def test_03_separate_output_depends_only_on_its_own_batch():
    torch.manual_seed(0)
    model = TinyTwoHead("batch").double()
    x_s, _, x_u = _batch()
    x_s, x_u = x_s.requires_grad_(True), x_u.requires_grad_(True)
    w = torch.randn(4, 3, dtype=torch.float64)
    sep = torch.autograd.grad((w * model(x_s)[0]).sum(), x_u, allow_unused=True)[0]
    cat = torch.autograd.grad((w * model(torch.cat([x_s, x_u]))[0][:4]).sum(), x_u)[0]
    assert sep is None and cat.abs().max() > 1e-6


def test_03_tiny_graph_node_counts():
    from mcd_helpers import TwoHeadNet
    tiny = TwoHeadNet(nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU()), 3, 2, 1)
    x_s, y_s, x_u = torch.randn(3, 1, 2, 2), torch.tensor([0, 1, 1]), torch.randn(2, 1, 2, 2)
    sep = graph_stats(step_b_loss(tiny, x_s, y_s, x_u, "separate")[0])["by_type"]
    cat = graph_stats(step_b_loss(tiny, x_s, y_s, x_u, "concat")[0])["by_type"]
    # three Linear layers (G, F1, F2): once per forward
    assert sep["AddmmBackward0"] == 6 and cat["AddmmBackward0"] == 3
    assert cat["SliceBackward0"] == 4  # (labeled, unlabeled) rows of each of the two heads


def test_03_densenet_graph_has_two_batchnorm_nodes_per_layer_with_separate_forwards():
    from mcd_helpers import densenet_bc_100
    model = densenet_bc_100(in_channels=1, num_classes=3)
    x = torch.randn(2, 1, 8, 8)
    stats = graph_stats(step_b_loss(model, x, torch.tensor([0, 1]), x, "separate")[0])
    bn_nodes = sum(n for name, n in stats["by_type"].items() if "BatchNormBackward" in name)
    assert bn_nodes == 2 * sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert stats["leaves"] == sum(1 for _ in model.parameters())
