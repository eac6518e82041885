"""DDP with two forwards per step (mcd_helpers.training.distributed, mcd_helpers.teaching.ddp_demo): CPU, Gloo, 2 processes.

The 2-process cases run once, in one ``torchrun`` launch (module fixture, ~15-30 s); each test
then checks one result against a value computed here independently: the single-process step
written out by hand in float64, brute-force shards, or torch's own error. Every torchrun launch
gets the caller's ``OMP_NUM_THREADS`` (1 when unset); the file passes with 1 and with 2. Exact
parity is asserted where it is exact (float64, no BatchNorm); the tiny reproduction run is checked
for what it writes and caches, never for a detection quality (its AUROC moves with float rounding).

Why the single-process reference is a step on the *global* batch: DDP averages the gradients over
the W ranks, so one DDP step equals one step on (1/W) sum_r L_r, the mean of the per-rank losses.
Each L_r is a batch mean over B samples; for cross-entropy the mean of W such means over equal
shards is the mean over all W*B samples. The discrepancy loss max(m - mean gap, 0) is linear while
its hinge is active; with K = 3 classes H <= log 3 = 1.10 nats < m = 1.2, so it is active on every
batch and the mean of the per-shard hinges equals the hinge of the global mean. Hence, without
BatchNorm, DDP = one single-process step on the global batch.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mcd_helpers.experiments import cache
from mcd_helpers.experiments.config import MCDConfig
from mcd_helpers.losses import discrepancy_loss
from mcd_helpers.metrics import METRIC_KEYS
from mcd_helpers.steps import step_a_loss
from mcd_helpers.teaching import ddp_demo
from mcd_helpers.training.batches import LABELED, Batches
from mcd_helpers.training.distributed import (DistEnv, check_sync_bn, dist_env, gather_scores, shard_bounds, unwrap,
                                              wrap_ddp)

ROOT = Path(__file__).resolve().parents[1]

# find-unused-split last: its failing backward leaves DDP's reducer of that model mid-iteration.
CASES = ["parity", "find-unused", "broadcast-buffers", "init-sync", "sync-bn-cpu", "step-a-bypass", "chosen", "buffers",
         "no-sync", "engine", "find-unused-split"]


@pytest.fixture(scope="module")
def results():
    return ddp_demo.launch(CASES, nprocs=2)


# ---- the single-process step, written out independently of mcd_helpers.training.loop ----

def _entropy(logits):
    p = torch.softmax(logits, dim=1)
    return -(p * torch.log(p)).sum(dim=1)  # (N,), nats, over classes


def _reference_step(norm: str, strategy: str) -> dict:
    """One official iteration (Step A, Step B) on the global batch of 2 ranks, float64, by hand."""
    net = ddp_demo.tiny_model(norm)
    xs, ys, xu = ddp_demo.global_batches(2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    feat = net.G(xs)  # Step A: F2 on detached features
    loss_a = F.cross_entropy(net.F1(feat), ys) + F.cross_entropy(net.F2(feat.detach()), ys)
    opt.zero_grad()
    loss_a.backward()
    opt.step()
    if strategy == "separate":
        (l1s, l2s), (l1u, l2u) = net(xs), net(xu)
    else:
        l1, l2 = net(torch.cat([xs, xu]))
        l1s, l1u, l2s, l2u = l1[:len(xs)], l1[len(xs):], l2[:len(xs)], l2[len(xs):]
    gap = (_entropy(l1u) - _entropy(l2u)).mean()
    loss_b = F.cross_entropy(l1s, ys) + F.cross_entropy(l2s, ys) + torch.clamp(1.2 - gap, min=0)
    opt.zero_grad()
    loss_b.backward()
    opt.step()
    return {k: v.reshape(-1) for k, v in net.state_dict().items()}


def _max_param_diff(ddp_params: dict, ref: dict) -> float:
    names = [n for n in ref if "running" not in n and "num_batches" not in n]
    return max(float((torch.tensor(ddp_params[n], dtype=torch.float64) - ref[n]).abs().max()) for n in names)


def _hinge_mean_vs_global(num_classes: int) -> float:
    """|mean over 2 shards of the discrepancy loss - the loss of the global batch| in the extreme case:
    shard 0 with F1 uniform and F2 one-hot (the largest gap, log K), shard 1 with both uniform (gap 0)."""
    uniform = torch.zeros(4, num_classes, dtype=torch.float64)
    one_hot = 50.0 * F.one_hot(torch.arange(4) % num_classes, num_classes).double()
    l1, l2 = torch.cat([uniform, uniform]), torch.cat([one_hot, uniform])
    per_shard = [discrepancy_loss(l1[r * 4:(r + 1) * 4], l2[r * 4:(r + 1) * 4], 1.2) for r in range(2)]
    return float((sum(per_shard) / 2 - discrepancy_loss(l1, l2, 1.2)).abs())


def test_mean_of_shard_hinges_is_the_global_hinge_for_three_classes():
    """The premise of the DDP = global-batch reference: with K = 3 the gap H(p1) - H(p2) <= log 3 < 1.2
    on every shard, the hinge is linear there, so the mean over shards of the discrepancy loss equals
    the loss of the global batch, even in the extreme case. With K = 10 (log 10 = 2.3 > 1.2) the hinge
    clips shard 0 at 0 and they differ (0.6 against 1.2 - log(10)/2 = 0.049)."""
    assert _hinge_mean_vs_global(3) < 1e-12
    assert _hinge_mean_vs_global(10) == pytest.approx(0.6 - (1.2 - np.log(10) / 2), abs=1e-9)


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_parity_without_batchnorm(results, strategy):
    ddp = results["parity"][0][f"none/{strategy}"]
    assert _max_param_diff(ddp["params"], _reference_step("none", strategy)) < 1e-10
    assert ddp["ddp_vs_global"] < 1e-10 and results["parity"][1][f"none/{strategy}"]["replicas"] == 0.0


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_train_mode_batchnorm_breaks_parity(results, strategy):
    ddp = results["parity"][0][f"batch/{strategy}"]
    diff = _max_param_diff(ddp["params"], _reference_step("batch", strategy))
    assert diff > 1e-3  # per-rank statistics over B = 4 samples, not over the global 8
    assert ddp["ddp_vs_global"] == pytest.approx(diff, rel=1e-6)
    assert ddp["buffers_vs_global"] > 1e-3  # running statistics differ as well
    # ... but DDP equals, exactly, the single-process mean of per-shard losses ("ghost batches")
    assert ddp["ddp_vs_per_shard"] < 1e-10 and ddp["replicas"] == 0.0


def test_sync_batchnorm_is_gpu_only(results):
    """SyncBatchNorm (what would restore BatchNorm parity) raises in training on CPU in this torch."""
    for rank in results["sync-bn-cpu"]:
        assert rank["error"] == "ValueError" and "expected input tensor to be on GPU" in rank["message"]
    with pytest.raises(NotImplementedError):  # its statistics kernel has no CPU implementation
        torch.batch_norm_stats(torch.randn(4, 3, 2, 2), 1e-5)
    with pytest.raises(ValueError, match="--sync-bn needs GPUs"):
        check_sync_bn("cpu")


def test_find_unused_parameters_true_runs_but_warns_when_every_parameter_is_used(results):
    """Measured: with both forwards using every parameter, True runs and keeps the replicas equal, but
    DDP's C++ reducer prints a performance warning to stderr (not a Python warning)."""
    for rank in results["find-unused"]:
        assert rank.get("error") is None and rank["ok"] and rank["replicas"] == 0.0
        assert any("did not find any unused parameters" in line for line in rank["stderr"]), rank["stderr"]


def test_find_unused_parameters_true_fails_when_the_forwards_use_different_heads(results):
    """Forward 1 through G + F1, forward 2 through G + F2, one backward: True raises, False runs.
    Each forward's search for unused parameters replaces the previous one, so it is F1 (unused by
    forward 2) that is marked ready by the search and then again by forward 1's gradient."""
    for rank in results["find-unused-split"]:
        assert rank["False"]["error"] is None and rank["False"]["replicas"] == 0.0
        assert rank["True"]["error"] == "RuntimeError"
        assert "Expected to mark a variable ready only once" in rank["True"]["message"]
        # forward 2's search (G + F2 used) found F1 unused and marked it ready; forward 1's gradient
        # then marked F1 again: the parameter named is one of F1's, not F2's
        assert "marked as ready twice" in rank["True"]["ready_twice"] and "F1." in rank["True"]["ready_twice"]


def test_forward_sync_buffers_true_runs_in_torch_2_14(results):
    """forward_sync_buffers=True (DDP's default) with two forwards runs in torch 2.14.1, and not because
    of the CPU: an in-place copy into train-mode BatchNorm's running buffers between two forwards
    does make the CPU backward raise "modified by an inplace operation" (checked below, by hand),
    unless the copy runs inside torch.autograd._unsafe_preserve_version_counter, which is where
    torch 2.14.1's DDP._sync_buffers runs it (test_buffer_sync_facts_of_this_torch)."""
    for rank in results["broadcast-buffers"]:
        assert rank.get("error") is None and rank["ok"] and rank["replicas"] == 0.0

    def two_forwards(preserve: bool):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm2d(3).double().train()
        w = torch.nn.Parameter(torch.ones(3, 3, 1, 1, dtype=torch.float64))
        x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
        y1 = bn(F.conv2d(x, w))
        bufs = (bn.running_mean, bn.running_var)
        ctx = torch.autograd._unsafe_preserve_version_counter(bufs) if preserve else torch.no_grad()
        with torch.no_grad(), ctx:  # what a buffer broadcast does on a receiving rank
            bn.running_mean.copy_(torch.zeros(3))
            bn.running_var.copy_(torch.ones(3))
        (y1.sum() + bn(F.conv2d(x, w)).pow(2).sum()).backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        two_forwards(preserve=False)
    two_forwards(preserve=True)  # raises nothing


def test_buffer_sync_facts_of_this_torch(results):
    """torch 2.14.1: DDP's per-forward buffer sync runs inside _unsafe_preserve_version_counter (why
    forward_sync_buffers=True no longer raises with two forwards); broadcast_buffers is deprecated
    (FutureWarning) and, unlike forward_sync_buffers=False, also skips the buffer sync at construction."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    assert "_unsafe_preserve_version_counter" in inspect.getsource(DistributedDataParallel._sync_buffers)
    for rank, r in enumerate(results["init-sync"]):
        assert r["broadcast_buffers"]["running_mean"] == [float(rank)] * 4  # kept its own
        assert r["forward_sync_buffers"]["running_mean"] == [0.0] * 4  # rank 0's, synced at construction
        assert any("deprecated" in w for w in r["broadcast_buffers"]["future_warnings"])
        assert r["forward_sync_buffers"]["future_warnings"] == []


def test_the_gradient_hook_fires_once_per_backward_through_two_forwards():
    """Why two forwards work under DDP: the engine sums both forwards' contributions to a parameter
    before its AccumulateGrad node runs, so a post-accumulate hook (like DDP's) fires once, with the sum."""
    net = ddp_demo.tiny_model("none")
    xs, ys, xu = ddp_demo.global_batches(1)
    fired = []
    net.F1.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    (F.cross_entropy(net(xs)[0], ys) + net(xu)[0].logsumexp(1).mean()).backward()
    g1 = torch.autograd.grad(F.cross_entropy(net(xs)[0], ys), net.F1.weight)[0]
    g2 = torch.autograd.grad(net(xu)[0].logsumexp(1).mean(), net.F1.weight)[0]
    assert len(fired) == 1 and torch.allclose(fired[0], g1 + g2, rtol=0, atol=1e-12)
    assert (g1 - g2).abs().max() > 1e-3  # two different contributions, not one counted twice


def test_step_a_on_the_inner_module_desynchronises_the_ranks(results):
    r0, r1 = results["step-a-bypass"]
    assert r0["after_bypass"] > 1e-3  # net.features/F1/F2 outside DDP: each rank stepped on its own gradient
    assert r0["after_wrapped"] > 1e-3  # DDP never re-syncs parameters: the drift stays
    # Step A as the package runs it, model(x, detach_f2=True) through DDP, from the start: no drift,
    # although the two ranks' shards differ and the parameters did move
    assert r0["wrapped_only"] == 0.0 and r0["wrapped_only_moved"] > 1e-3
    assert r0 == r1  # both ranks measured the same spread (it is all-reduced)


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_chosen_settings_run_and_keep_replicas_equal(results, strategy):
    for rank in results["chosen"]:
        r = rank[strategy]
        assert r["replicas"] == 0.0
        assert r["running_mean_spread"] > 1e-4 and r["running_mean_spread_after_average"] == 0.0
        assert r["average_vs_mean_of_ranks"] < 1e-15  # the mean of the gathered per-rank statistics
        # rank 0's copy drops rank 1's statistics: it sits half the spread away from the average
        assert r["rank0_vs_average"] == pytest.approx(r["running_mean_spread"] / 2, rel=1e-9)
        # 3 iterations x (Step A: 1 forward + Step B: 2 separate forwards or 1 concat forward)
        assert r["num_batches_tracked"] == (9 if strategy == "separate" else 6)


def test_averaged_batchnorm_statistics_against_the_global_batch(results):
    """One train-mode forward per rank; the first BatchNorm layer (it sees the same inputs on one
    process and on the ranks, so the comparison is exact; deeper layers see inputs normalised per
    rank). By hand, from the first convolution's outputs h of each shard (n values per channel and
    shard, N = 2n globally): running_mean = 0.9 * 0 + 0.1 * mean(h), running_var = 0.9 * 1 +
    0.1 * var_unbiased(h). The average over ranks of running_mean is the global batch's exactly
    (equal shards). running_var stores unbiased variances, and the exact identity
    (N - 1) s^2 = sum_r (n - 1) s_r^2 + n sum_r (mu_r - mu)^2
    ties the global s^2 to the shards' s_r^2 and means mu_r: the mean of the s_r^2 differs from s^2
    by the Bessel factor and the between-shard term. Rank 0's copy matches neither."""
    xs, _, _ = ddp_demo.global_batches(2)
    conv = ddp_demo.tiny_model("batch").G[0]
    with torch.no_grad():
        h = [conv(xs[r * 4:(r + 1) * 4]).transpose(0, 1).reshape(4, -1) for r in range(2)]  # (C, n) per shard
    h_all = torch.cat(h, dim=1)
    n, big_n = h[0].shape[1], h_all.shape[1]
    mean_of_ranks = 0.1 * torch.stack([x.mean(1) for x in h]).mean(0)
    var_of_ranks = 0.9 + 0.1 * torch.stack([x.var(1) for x in h]).mean(0)
    var_global = 0.9 + 0.1 * h_all.var(1)
    r0 = results["buffers"][0]
    for rank in results["buffers"]:
        assert rank["average"] == r0["average"] and rank["rank0"] == r0["own"]  # the same on every rank
    avg, glob = (torch.tensor(r0[k]["mean"], dtype=torch.float64) for k in ("average", "global"))
    torch.testing.assert_close(avg, mean_of_ranks, rtol=0, atol=1e-15)
    torch.testing.assert_close(glob, 0.1 * h_all.mean(1), rtol=0, atol=1e-15)
    torch.testing.assert_close(avg, glob, rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.tensor(r0["average"]["var"], dtype=torch.float64), var_of_ranks, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.tensor(r0["global"]["var"], dtype=torch.float64), var_global, rtol=0, atol=1e-12)
    # the identity, from the package's buffers alone: per-rank means and variances ("own"), the
    # global ones, each undone from the momentum blend (x - 0.9 * init) / 0.1
    mu_r = [torch.tensor(r["own"]["mean"], dtype=torch.float64) / 0.1 for r in results["buffers"]]
    s2_r = [(torch.tensor(r["own"]["var"], dtype=torch.float64) - 0.9) / 0.1 for r in results["buffers"]]
    mu, s2 = glob / 0.1, (torch.tensor(r0["global"]["var"], dtype=torch.float64) - 0.9) / 0.1
    within = sum((n - 1) * v for v in s2_r)
    between = n * sum((m - mu) ** 2 for m in mu_r)
    torch.testing.assert_close((big_n - 1) * s2, within + between, rtol=1e-9, atol=0)
    assert (between / (big_n - 1)).min() > 1e-6  # the shards' means differ: the term is not negligible here
    # the average the package stores is (1/W) sum_r s_r^2, not s^2: it omits between / (N - 1) and
    # carries the Bessel factor (n - 1) W / (N - 1)
    s2_avg = (torch.tensor(r0["average"]["var"], dtype=torch.float64) - 0.9) / 0.1
    torch.testing.assert_close(s2 - s2_avg, (2 * (n - 1) / (big_n - 1) - 1) * s2_avg + between / (big_n - 1),
                               rtol=1e-9, atol=1e-12)
    assert (torch.tensor(r0["rank0"]["mean"], dtype=torch.float64) - glob).abs().max() > 1e-4  # rank 0's: one shard only
    assert r0["eval_logits_average_vs_global"] < r0["eval_logits_rank0_vs_global"]


def test_no_sync_accumulates_locally_and_all_reduces_once(results):
    """Gradient accumulation: no all-reduce in the no_sync() backward, one bucket all-reduced in the next,
    and the step equals the single-process step on the two global micro-batches (float64)."""
    ref = ddp_demo.no_sync_reference(2)
    net = ddp_demo.tiny_model("none")  # the same reference, written out here
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    xs, ys, xu = ddp_demo.global_batches(2)
    for k in range(2):
        rows = slice(4 * k, 4 * k + 4)  # global micro-batch k = both ranks' micro-batch k
        (l1s, l2s), (l1u, l2u) = net(xs[rows]), net(xu[rows])
        gap = (_entropy(l1u) - _entropy(l2u)).mean()
        loss = F.cross_entropy(l1s, ys[rows]) + F.cross_entropy(l2s, ys[rows]) + torch.clamp(1.2 - gap, min=0)
        (loss / 2).backward()
    opt.step()
    for k, v in net.named_parameters():
        torch.testing.assert_close(torch.tensor(ref[k], dtype=torch.float64), v.detach().reshape(-1), rtol=0, atol=1e-12)
    plain = ddp_demo.tiny_model("none")
    for rank in results["no-sync"]:
        assert rank["allreduces_after_no_sync_backward"] == 0 and rank["allreduces_after_synced_backward"] >= 1
        assert rank["vs_single_process"] < 1e-10 and rank["replicas"] == 0.0
    assert max(float((torch.tensor(ref[k]) - v.detach().reshape(-1)).abs().max())
               for k, v in plain.named_parameters()) > 1e-3  # the reference did move


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_engine_finetune_under_ddp_equals_single_process(results, strategy):
    """mcd_helpers.training.loop.finetune itself on 2 ranks (12 iterations of Step A + Step B, validation,
    model selection) = the same call in this single process, float64, no BatchNorm."""
    from mcd_helpers.training.loop import finetune

    x_sup, y_sup, split, cfg = ddp_demo.engine_setup()
    net = ddp_demo.tiny_model("none")
    hist = finetune(net, x_sup, y_sup, split, cfg, strategy, progress=False)
    ref = {k: v.reshape(-1) for k, v in net.state_dict().items()}
    ref_init = {k: v.reshape(-1) for k, v in ddp_demo.tiny_model("none").state_dict().items()}
    for rank in results["engine"]:
        r = rank[strategy]
        assert r["replicas"] == 0.0
        assert _max_param_diff(r["params"], ref) < 1e-10
        assert _max_param_diff(r["params"], ref_init) > 1e-2  # it did train
        assert r["val_auroc"] == pytest.approx(hist.val_auroc, abs=1e-12) and len(r["val_auroc"]) == 2


# ---- single-process units ----

def test_dist_env_reads_torchrun_variables():
    assert dist_env({}) == DistEnv(0, 1, 0) and not dist_env({}).distributed
    env = dist_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.distributed) == (3, 4, 1, True)
    with pytest.raises(ValueError, match="torchrun"):
        dist_env({"RANK": "0"})
    with pytest.raises(ValueError, match="must lie in"):
        dist_env({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})


@pytest.mark.parametrize("n,w", [(10, 3), (9, 3), (2, 4), (1001, 2)])
def test_shard_bounds_match_numpy_array_split(n, w):
    expected = [(int(a[0]), int(a[-1]) + 1) if len(a) else None for a in np.array_split(np.arange(n), w)]
    for r in range(w):
        start, stop = shard_bounds(n, r, w)
        assert (start, stop) == expected[r] or (expected[r] is None and start == stop)


@pytest.mark.parametrize("n,b,w", [(23, 4, 2), (50, 12, 3), (64, 16, 4), (10, 5, 5), (9, 3, 1)])
def test_ranks_deal_each_single_process_batch(n, b, w):
    """What every rank of the engine draws (Batches with its rank and the world size): rank r's
    batch i of pass p = positions i*B + r, i*B + r + W, ... of the pass's permutation (by hand);
    the W shares are disjoint and together are the single-process batch i, for every pass and batch.
    So under DDP the global batch, the data order and the reshuffle per pass are the single-process run's."""
    one = Batches(n, b, seed=5, stream=LABELED)
    ranks = [Batches(n, b, seed=5, stream=LABELED, rank=r, world_size=w) for r in range(w)]
    assert all(r.per_pass == one.per_pass == n // b for r in ranks)
    for p in (0, 1, 2):
        perm = one.permutation(p).tolist()  # the single-process order of pass p
        for i in range(one.per_pass):
            shares = [r.batch(p, i).tolist() for r in ranks]
            for r in range(w):
                assert shares[r] == perm[i * b + r:(i + 1) * b:w] and len(shares[r]) == b // w
            union = sum(shares, [])
            assert len(set(union)) == b  # disjoint
            assert sorted(union) == sorted(one.batch(p, i).tolist())
    assert one.permutation(0).tolist() != one.permutation(1).tolist()  # every pass reshuffles
    assert torch.equal(ranks[-1].batch_at(one.per_pass + 1), ranks[-1].batch(1, 1))


@pytest.mark.parametrize("b,w", [(130, 4), (5, 2), (4, 3)])
def test_a_global_batch_not_divisible_by_the_ranks_is_refused(b, w):
    with pytest.raises(ValueError, match=f"global batch size {b} must be a multiple of the number of processes {w}"):
        Batches(200, b, seed=0, stream=LABELED, rank=0, world_size=w)


def test_single_process_helpers_are_identity():
    net = ddp_demo.tiny_model("batch")
    assert wrap_ddp(net, "cpu") is net and unwrap(net) is net
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    assert torch.equal(gather_scores(lambda t: t.sum(dim=(1, 2, 3)), x), x.sum(dim=(1, 2, 3)))
    with torch.no_grad():
        net.G[1].running_mean.fill_(3.0)
    ddp_demo.broadcast_buffers(net)  # the teaching helpers: no process group, nothing to do
    assert ddp_demo.all_ranks_equal(net) == 0.0 and torch.equal(net.G[1].running_mean, torch.full((4,), 3.0,
                                                                                                    dtype=torch.float64))


def test_step_a_goes_through_forward_and_detaches_f2_only():
    """Step A is one call of the model's forward (so a DDP wrapper sees it): F2's loss reaches F2 but
    not G, F1's loss reaches G; the logits are those of the plain forward."""
    net = ddp_demo.tiny_model("none")
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    l1, l2 = net(x, detach_f2=True)
    l2.sum().backward()  # F2's loss must not reach G
    assert all(p.grad is None for p in net.G.parameters()) and net.F2.weight.grad is not None
    assert net.F1.weight.grad is None
    torch.testing.assert_close((l1, l2), net(x), rtol=0, atol=0)
    calls = []
    net.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs), with_kwargs=True)
    step_a_loss(net, x, torch.tensor([0, 1, 2, 0])).backward()  # the loop's Step A: one forward call
    assert calls == [{"detach_f2": True}] and all(p.grad is not None for p in net.G.parameters())


# ---- the reproduction under torchrun: the one pipeline, its cache keyed with the world size ----

def _stage_paths(cfg: MCDConfig, world_size: int) -> list[Path]:
    """The cache files of the quick run's stages as rank 0 of ``world_size`` ranks names them."""
    stages = [("pretrain", {})] + [("finetune", {"ood": "gaussian", "strategy": s}) for s in ("separate", "concat")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "world", lambda: (0, world_size))
        return [cache.cache_path(cfg, stage, **more) for stage, more in stages]


@pytest.fixture(scope="module")
def repro_runs(tmp_path_factory):
    """``python -m mcd_helpers reproduce`` with ``ddp_demo.QUICK_FLAGS`` (the suite's cache, conftest.py):
    1 process and 2 ranks, each with ``--retrain`` (so both really train, whatever the cache holds),
    then 2 ranks again without it, which should load what the first 2-rank run cached; the cache
    files' modification times before and after that third run. About 1-1.5 CPU minutes."""
    root = tmp_path_factory.mktemp("ddp_repro")
    runs = {name: ddp_demo.launch_reproduction(root / name, ddp_demo.QUICK_FLAGS + ["--retrain"], nprocs=n)[0]
            for name, n in (("nproc1", 1), ("nproc2", 2))}
    cfg = MCDConfig(**json.loads((root / "nproc2" / "config.json").read_text()))
    runs["paths"] = {w: _stage_paths(cfg, w) for w in (1, 2)}
    mtimes = lambda: [p.stat().st_mtime_ns if p.exists() else None for p in runs["paths"][2]]  # noqa: E731
    runs["mtimes_before"] = mtimes()
    runs["nproc2-cached"] = ddp_demo.launch_reproduction(root / "nproc2-cached", ddp_demo.QUICK_FLAGS, nprocs=2)[0]
    runs["mtimes_after"] = mtimes()
    return runs


def test_reproduction_under_torchrun_writes_each_row_once(repro_runs):
    """The pipeline under torchrun (2 ranks) against one process, on the tiny QUICK_FLAGS run: the same
    rows in the same order (MSP, ODIN, energy, MCD per strategy), each written once, tagged with the
    world size. No detection quality is asserted: 2,000 training images, 1 pre-training epoch and 15
    fine-tuning steps amplify every rounding difference (per-rank BatchNorm over B / W samples, the
    thread count, the CPU), so the AUROC of such a run is no claim about DDP. Exact parity is tested
    where it is exact (float64, no BatchNorm: test_engine_finetune_under_ddp_equals_single_process)."""
    one, two = repro_runs["nproc1"], repro_runs["nproc2"]
    keys = [[(r["method"], r["strategy"], r["ood_dataset"]) for r in run] for run in (one, two)]
    assert keys[0] == keys[1] == [("msp", None, "gaussian"), ("odin", None, "gaussian"), ("energy", None, "gaussian"),
                                  ("mcd", "separate", "gaussian"), ("mcd", "concat", "gaussian")]
    assert {r["world_size"] for r in two} == {2} and {r["world_size"] for r in one} == {1}
    for run in (one, two):
        assert all(0.0 <= r["auroc"] <= 1.0 and 0.0 <= r["id_accuracy"] <= 1.0 for r in run)


def test_reproduction_under_torchrun_caches_by_world_size(repro_runs):
    """One cache for every run: the stages of the 1-process and the 2-rank run have their own files (the
    key holds the world size: W ranks compute other numbers), written by rank 0; a second 2-rank run
    loads them (the files stay untouched) and reproduces the first one's metrics exactly."""
    paths = repro_runs["paths"]
    assert all(p.exists() for w in (1, 2) for p in paths[w]), paths
    assert not set(paths[1]) & set(paths[2])  # separate files per world size
    assert None not in repro_runs["mtimes_before"] and repro_runs["mtimes_after"] == repro_runs["mtimes_before"]
    fields = ("method", "strategy", "ood_dataset", "world_size", "id_accuracy", *METRIC_KEYS)
    rows = [[{k: r.get(k) for k in fields} for r in repro_runs[name]] for name in ("nproc2", "nproc2-cached")]
    assert rows[1] == rows[0]  # every metric, to the last bit


def _script_reference() -> torch.Tensor:
    """Notebook 06's script in one process, by hand: Step A on the global batch of 8, then Step B on
    global micro-batches (rows 0-3, then 4-7), each loss halved, gradients summed; one SGD step each."""
    net = ddp_demo.tiny_model("none")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    xs, ys, xu = ddp_demo.global_batches(2)
    feat = net.G(xs)
    (F.cross_entropy(net.F1(feat), ys) + F.cross_entropy(net.F2(feat.detach()), ys)).backward()
    opt.step()
    opt.zero_grad()
    for rows in (slice(0, 4), slice(4, 8)):  # rank r's micro-batch k: rows r + 2j of the global micro-batch k
        (l1s, l2s), (l1u, l2u) = net(xs[rows]), net(xu[rows])
        gap = (_entropy(l1u) - _entropy(l2u)).mean()
        loss = F.cross_entropy(l1s, ys[rows]) + F.cross_entropy(l2s, ys[rows]) + torch.clamp(1.2 - gap, min=0)
        (loss / 2).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_notebook_torchrun_script_equals_the_single_process_step(tmp_path):
    """The ~25-line script that notebook 06 writes with %%writefile, launched with torchrun on 2 ranks."""
    nb = nbformat.read(ROOT / "notebooks" / "06_scaling_out_ddp.ipynb", as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%writefile"))
    script = tmp_path / "mcd_ddp_step.py"
    script.write_text(source.split("\n", 1)[1])
    assert len(script.read_text().splitlines()) <= 35
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": ddp_demo.omp_threads(), "PYTHONPATH": str(ROOT)})
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and sorted(r["rank"] for r in ranks) == [0, 1], proc.stderr[-2000:]
    ref = _script_reference()
    for r in ranks:
        got = torch.tensor(r["params"], dtype=torch.float64)
        assert got.shape == ref.shape and (got - ref).abs().max() < 1e-10
    init = torch.cat([p.detach().reshape(-1) for p in ddp_demo.tiny_model("none").parameters()])
    assert (ref - init).abs().max() > 1e-3  # the step did move the parameters
