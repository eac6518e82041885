"""Small DDP experiments on two forwards per step, each run under ``torchrun`` (notebook 06, tests).

Run one case on 2 CPU processes (Gloo) and print every rank's result::

    python -m mcd_helpers.teaching.ddp_demo parity find-unused    # launches torchrun itself
    torchrun --standalone --nproc_per_node=2 -m mcd_helpers.teaching.ddp_demo parity --out DIR   # the same

Cases (each a function below, run on every rank; results are JSON-able dicts, one per rank):

* ``parity``: one official MCD iteration (Step A, then Step B) in float64, under DDP with the
  chosen settings (:func:`mcd_helpers.training.distributed.wrap_ddp`), against single-process steps
  on the same global batches; per norm (``none``, ``batch``) and strategy.
* ``find-unused``: ``find_unused_parameters=True`` with Step B's two forwards, both using every
  parameter: runs, but DDP's C++ side prints a performance warning to stderr (kept under ``"stderr"``).
* ``find-unused-split``: forward 1 through G and F1 only, forward 2 through G and F2 only, one
  backward: ``find_unused_parameters=True`` raises "Expected to mark a variable ready only once"
  (F1's parameters "marked as ready twice": forward 2's search found them unused, forward 1's
  gradient reached them), ``False`` runs.
* ``broadcast-buffers``: ``forward_sync_buffers=True`` (the old ``broadcast_buffers=True``,
  DDP's default), train-mode BatchNorm, two forwards.
* ``init-sync``: BatchNorm buffers that differ per rank, wrapped with ``broadcast_buffers=False``
  (deprecated) or ``forward_sync_buffers=False``: which one syncs them at construction.
* ``sync-bn-cpu``: SyncBatchNorm in training on the CPU.
* ``step-a-bypass``: Step A called on the inner module (``net.features``/``net.F1``/``net.F2``),
  not through DDP's ``forward``; then Step A as the package runs it, ``model(x, detach_f2=True)``
  through the wrapper.
* ``chosen``: the chosen settings for several iterations with BatchNorm and both strategies; the
  per-rank running statistics, then :func:`~mcd_helpers.training.distributed.average_buffers` against
  rank 0's copy (:func:`broadcast_buffers`).
* ``buffers``: one train-mode forward per rank, then rank 0's BatchNorm statistics (broadcast)
  and the average over ranks, against one process forwarding the global batch.
* ``no-sync``: gradient accumulation over 2 micro-batches with ``DDP.no_sync()`` on the first:
  all-reduces counted with a communication hook, parameters against the single-process step.
* ``engine``: :func:`mcd_helpers.training.loop.finetune` itself (2 epochs of the official schedule,
  model selection included) under ``torchrun``, float64, no BatchNorm: the parameters to compare
  with the same call in one process (:func:`engine_setup`).

A case that raises records ``{"error": type name, "message": ...}`` for that rank instead of
crashing, so the pitfalls can be read back and asserted; DDP's Python warnings are kept under
``"warnings"`` and the lines DDP's C++ side wrote to stderr during the case under ``"stderr"``.
Collectives run with a 60 s timeout, so a rank whose partner died ends instead of hanging.

Every training forward goes through ``DDP(net)`` itself: Step A is ``model(x, detach_f2=True)``
(:meth:`mcd_helpers.models.TwoHeadNet.forward`), Step B two plain forwards (or one, ``concat``).
Two helpers exist for teaching only (the training engine needs neither): :func:`all_ranks_equal`
(how far the replicas drifted apart) and :func:`broadcast_buffers` (rank 0's BatchNorm statistics
everywhere, the alternative that :func:`~mcd_helpers.training.distributed.average_buffers` beats).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..losses import supervised_loss
from ..models import small_cnn
from ..steps import step_a_loss, step_b_loss
from ..training.distributed import average_buffers, barrier, cleanup, init_distributed, wrap_ddp
from ..training.distributed import world as _world

__all__ = ["CASES", "QUICK_FLAGS", "launch", "launch_reproduction", "tiny_model", "global_batches", "engine_setup",
           "engine_gap", "omp_threads", "OneHead", "shard", "no_sync_reference", "all_ranks_equal",
           "broadcast_buffers"]

B, K, HW = 4, 3, 8  # per-rank batch, classes, image side: seconds per case on a CPU
MARGIN, LR = 1.2, 0.1
# With K = 3 classes an entropy is at most log 3 = 1.10 nats < MARGIN, so the discrepancy hinge is
# active on every batch: the mean of per-shard hinges equals the hinge of the global mean
# (tests/test_distributed.py checks it on these batches, and that it fails with K = 10).


def tiny_model(norm: str) -> nn.Module:
    """``small_cnn`` of width 4 on ``(N, 1, 8, 8)`` images, K = 3, float64, seeded identically on every rank."""
    torch.manual_seed(0)
    return small_cnn(1, K, norm=norm, width=4).double()


def global_batches(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The global batches ``x_sup (W*B, 1, 8, 8)``, ``y_sup (W*B,)``, ``x_unsup (W*B, 1, 8, 8)``, float64."""
    g = torch.Generator().manual_seed(1)
    n = world * B
    x_sup = torch.randn(n, 1, HW, HW, generator=g, dtype=torch.float64)
    y_sup = torch.randint(0, K, (n,), generator=g)
    x_unsup = 2 * torch.randn(n, 1, HW, HW, generator=g, dtype=torch.float64)
    return x_sup, y_sup, x_unsup


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share ``t[rank*B:(rank+1)*B]`` of a global batch of ``world * B`` rows."""
    return t[rank * B:(rank + 1) * B]


def all_ranks_equal(net: nn.Module) -> float:
    """Largest ``|p_rank - p_rank0|`` over every parameter and rank (0.0 in a single process).

    How far DDP let the replicas drift apart: 0.0 when every update was all-reduced. A collective:
    call it on every rank; every rank gets the same number.
    """
    if _world()[1] == 1:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).cpu().double() for p in net.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def broadcast_buffers(net: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) into every rank, in place.

    What ``DDP(..., forward_sync_buffers=True)`` does before every forward: every rank then holds
    statistics computed from rank 0's shards only, the other ranks' data dropped. Shown in cases
    ``chosen`` and ``buffers`` against :func:`~mcd_helpers.training.distributed.average_buffers`,
    which the engine uses. A collective; no-op in a single process.
    """
    if _world()[1] == 1:
        return
    with torch.no_grad():
        for buf in net.buffers():
            dist.broadcast(buf, src=0)


class OneHead(nn.Module):
    """A :class:`~mcd_helpers.models.TwoHeadNet` whose forward uses G and *one* head: ``forward(x, head)``.

    ``head=1``: ``F1(G(x))``; ``head=2``: ``F2(G(x))``; each ``(N, K)``. Two forwards, one per head,
    use different parameter subsets: the case where ``find_unused_parameters=True`` fails.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return (self.net.F1 if head == 1 else self.net.F2)(self.net.features(x))


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)


def _iteration(model: nn.Module, opt, shards, strategy: str) -> None:
    """One official iteration on ``shards`` (a list of ``(x_sup, y_sup, x_unsup)``), mean of shard losses.

    Step A is :func:`mcd_helpers.steps.step_a_loss` (``model(x, detach_f2=True)``), Step B
    :func:`~mcd_helpers.steps.step_b_loss`: the package's own losses, on ``model`` (a DDP wrapper
    or a plain net). One shard = what a DDP rank does; several shards = the single-process mean of
    the per-rank losses (what DDP's averaged gradient equals).
    """
    opt.zero_grad(set_to_none=True)
    loss_a = sum(step_a_loss(model, xs, ys) for xs, ys, _ in shards) / len(shards)
    loss_a.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_b = sum(step_b_loss(model, xs, ys, xu, strategy, MARGIN)[0] for xs, ys, xu in shards) / len(shards)
    loss_b.backward()
    opt.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _buffers_diff(a: nn.Module, b: nn.Module) -> float:
    diffs = [float((p.double() - q.double()).abs().max()) for p, q in zip(a.buffers(), b.buffers())]
    return max(diffs, default=0.0)


def case_parity(rank: int, world: int) -> dict:
    """DDP (chosen settings) vs single-process, one official iteration each, float64."""
    xs_all, ys_all, xu_all = global_batches(world)
    shards = [(xs_all[r * B:(r + 1) * B], ys_all[r * B:(r + 1) * B], xu_all[r * B:(r + 1) * B]) for r in range(world)]
    out = {}
    for norm in ("none", "batch"):
        for strategy in ("separate", "concat"):
            net = tiny_model(norm)
            ref_global, ref_shards = copy.deepcopy(net), copy.deepcopy(net)
            ddp = wrap_ddp(net, "cpu")
            _iteration(ddp, _sgd(ddp), [shards[rank]], strategy)
            # single process, the global batch in one piece (what "the same global batches" means)
            _iteration(ref_global, _sgd(ref_global), [(xs_all, ys_all, xu_all)], strategy)
            # single process, the mean of the per-rank losses, each shard forwarded on its own
            _iteration(ref_shards, _sgd(ref_shards), shards, strategy)
            out[f"{norm}/{strategy}"] = {
                "ddp_vs_global": _max_diff(net, ref_global),
                "ddp_vs_per_shard": _max_diff(net, ref_shards),
                "replicas": all_ranks_equal(net),
                "buffers_vs_global": _buffers_diff(net, ref_global),
                "params": {k: v.reshape(-1).tolist() for k, v in net.state_dict().items()} if rank == 0 else None,
            }
    return out


def _separate_steps(ddp: nn.Module, steps: int, strategy: str = "separate") -> None:
    xs, ys, xu = global_batches(1)
    opt = _sgd(ddp)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        step_b_loss(ddp, xs, ys, xu, strategy, MARGIN)[0].backward()
        opt.step()


def case_find_unused(rank: int, world: int) -> dict:
    """``find_unused_parameters=True`` with Step B's two forwards, three iterations."""
    net = tiny_model("none")
    ddp = DDP(net, find_unused_parameters=True, forward_sync_buffers=False)
    _separate_steps(ddp, 3)
    return {"ok": True, "replicas": all_ranks_equal(net)}


def case_broadcast_buffers(rank: int, world: int) -> dict:
    """``forward_sync_buffers=True`` (DDP's default) with train-mode BatchNorm and two forwards."""
    net = tiny_model("batch")
    ddp = DDP(net, find_unused_parameters=False, forward_sync_buffers=True)
    _separate_steps(ddp, 2)
    return {"ok": True, "replicas": all_ranks_equal(net)}


def case_init_sync(rank: int, world: int) -> dict:
    """Each rank's BatchNorm running_mean set to its rank, then wrapped: the running_mean right after
    construction with ``broadcast_buffers=False`` and with ``forward_sync_buffers=False``, and the
    deprecation warnings the first one emits."""
    out = {}
    for flag in ("broadcast_buffers", "forward_sync_buffers"):
        net = tiny_model("batch")
        with torch.no_grad():
            net.G[1].running_mean.fill_(float(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DDP(net, find_unused_parameters=False, **{flag: False})
        out[flag] = {"running_mean": net.G[1].running_mean.tolist(),
                     "future_warnings": [str(w.message)[:120] for w in caught if issubclass(w.category, FutureWarning)]}
    return out


def case_sync_bn_cpu(rank: int, world: int) -> dict:
    """SyncBatchNorm in training mode on the CPU (the module, without DDP)."""
    net = nn.SyncBatchNorm.convert_sync_batchnorm(tiny_model("batch"))
    net(global_batches(1)[0])
    return {"ok": True}


def case_step_a_bypass(rank: int, world: int) -> dict:
    """Step A on the inner module under DDP, then through the wrapper; and Step A through it from the start.

    ``after_bypass``: the replicas' spread after Step A computed as ``net.F1(net.features(x))``,
    ``net.F2(...detach())``: DDP's ``forward`` never ran, its gradients are never all-reduced.
    ``after_wrapped``: after one more Step A through the wrapper, ``ddp(x, detach_f2=True)``
    (:func:`mcd_helpers.steps.step_a_loss`): the drift stays, DDP never re-syncs parameters.
    ``wrapped_only``: a fresh network that ran Step A through the wrapper twice: no drift.
    """
    xs, ys, _ = (shard(t, rank, world) for t in global_batches(world))
    net = tiny_model("none")
    ddp = wrap_ddp(net, "cpu")
    opt = _sgd(ddp)
    feat = net.features(xs)  # bypasses DDP.forward
    supervised_loss(net.F1(feat), net.F2(feat.detach()), ys).backward()
    opt.step()
    bypass = all_ranks_equal(net)
    opt.zero_grad(set_to_none=True)
    step_a_loss(ddp, xs, ys).backward()  # ddp(xs, detach_f2=True): through DDP, the update is shared
    opt.step()
    after = all_ranks_equal(net)
    net2 = tiny_model("none")
    ddp2 = wrap_ddp(net2, "cpu")
    opt2 = _sgd(ddp2)
    for _ in range(2):
        opt2.zero_grad(set_to_none=True)
        step_a_loss(ddp2, xs, ys).backward()
        opt2.step()
    moved = max(float((p - q).abs().max()) for p, q in zip(net2.parameters(), tiny_model("none").parameters()))
    return {"after_bypass": bypass, "after_wrapped": after, "wrapped_only": all_ranks_equal(net2),
            "wrapped_only_moved": moved}


def case_chosen(rank: int, world: int) -> dict:
    """Chosen settings, train-mode BatchNorm, 3 official iterations per strategy."""
    out = {}
    xs_all, ys_all, xu_all = global_batches(world)
    shard = (xs_all[rank * B:(rank + 1) * B], ys_all[rank * B:(rank + 1) * B], xu_all[rank * B:(rank + 1) * B])
    for strategy in ("separate", "concat"):
        net = tiny_model("batch")
        ddp = wrap_ddp(net, "cpu")
        opt = _sgd(ddp)
        for _ in range(3):
            _iteration(ddp, opt, [shard], strategy)
        mean = net.G[1].running_mean.clone()
        others = [torch.empty_like(mean) for _ in range(world)]
        dist.all_gather(others, mean)
        before = max(float((o - mean).abs().max()) for o in others)
        rank0 = copy.deepcopy(net)
        broadcast_buffers(rank0)
        average_buffers(net)
        gathered_mean = torch.stack(others).mean(0)
        dist.all_gather(others, net.G[1].running_mean)
        after = max(float((o - net.G[1].running_mean).abs().max()) for o in others)
        out[strategy] = {"replicas": all_ranks_equal(net), "running_mean_spread": before,
                         "running_mean_spread_after_average": after,
                         "average_vs_mean_of_ranks": float((net.G[1].running_mean - gathered_mean).abs().max()),
                         "rank0_vs_average": float((rank0.G[1].running_mean - net.G[1].running_mean).abs().max()),
                         "num_batches_tracked": int(net.G[1].num_batches_tracked)}
    return out


def case_find_unused_split(rank: int, world: int) -> dict:
    """Forward 1 through G + F1 only, forward 2 through G + F2 only, one backward; False then True.

    With True the error's first line and its line naming the parameter ("Parameter at index ...
    with name net.F1.... has been marked as ready twice") are kept: each forward's search for
    unused parameters replaces the previous one, so the search after forward 2 finds F1 unused
    and marks it ready, and forward 1's gradient then marks F1 a second time in the backward."""
    xs, ys, xu = (shard(t, rank, world) for t in global_batches(world))
    out = {}
    for flag in (False, True):
        net = tiny_model("none")
        ddp = DDP(OneHead(net), find_unused_parameters=flag, forward_sync_buffers=False)
        opt = _sgd(ddp)
        try:
            loss = F.cross_entropy(ddp(xs, 1), ys) + F.cross_entropy(ddp(xu, 2), ys)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out[str(flag)] = {"error": None, "replicas": all_ranks_equal(net)}
        except RuntimeError as err:
            lines = str(err).strip().splitlines()
            out[str(flag)] = {"error": type(err).__name__, "message": lines[0][:300],
                              "ready_twice": next((ln.strip()[:300] for ln in lines if "marked as ready twice" in ln), None)}
    return out


def case_buffers(rank: int, world: int) -> dict:
    """One train-mode forward of each rank's shard; the first BatchNorm's running statistics:
    rank 0's (what :func:`broadcast_buffers` spreads), the mean over ranks (:func:`average_buffers`)
    and those of one process forwarding the global batch; plus eval-mode logits with each."""
    x_all = global_batches(world)[0]
    net, ref = tiny_model("batch").train(), tiny_model("batch").train()
    with torch.no_grad():
        net(shard(x_all, rank, world))  # what each rank's training forward does to the buffers
        ref(x_all)
    bn, bn_ref = net.G[1], ref.G[1]
    own = {"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist()}
    rank0 = copy.deepcopy(net)
    broadcast_buffers(rank0)
    average_buffers(net)
    x_eval = 2 * global_batches(world)[2][:8]  # evaluation inputs, the same on every rank
    with torch.no_grad():
        logits = [m.eval()(x_eval)[0] for m in (rank0, net, ref)]
    return {"own": own,
            "rank0": {"mean": rank0.G[1].running_mean.tolist(), "var": rank0.G[1].running_var.tolist()},
            "average": {"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist()},
            "global": {"mean": bn_ref.running_mean.tolist(), "var": bn_ref.running_var.tolist()},
            "eval_logits_rank0_vs_global": float((logits[0] - logits[2]).abs().max()),
            "eval_logits_average_vs_global": float((logits[1] - logits[2]).abs().max())}


def no_sync_reference(world: int) -> dict:
    """The single-process step that case ``no-sync`` must equal: the global batch in 2 micro-batches
    (rows ``[0, W*B/2)`` and ``[W*B/2, W*B)``), Step B's loss halved on each, gradients summed.

    Rank r's micro-batch k is ``shard(t, r, W).chunk(2)[k]``; DDP all-reduces the sum of both
    micro-batches' gradients once and divides by W: the mean over ranks, which for batch-mean
    losses on equal shards (and an active hinge) is the gradient on global micro-batch k.
    Returns ``{name: flat float64 list}`` of the parameters after one SGD step.
    """
    net = tiny_model("none")
    opt = _sgd(net)
    xs, ys, xu = global_batches(world)
    opt.zero_grad(set_to_none=True)
    for k in range(2):
        rows = slice(k * world * B // 2, (k + 1) * world * B // 2)
        (step_b_loss(net, xs[rows], ys[rows], xu[rows], "separate", MARGIN)[0] / 2).backward()
    opt.step()
    return {k: v.reshape(-1).tolist() for k, v in net.named_parameters()}


def case_no_sync(rank: int, world: int) -> dict:
    """Step B accumulated over 2 micro-batches per rank, ``no_sync()`` on the first; all-reduces counted."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    net = tiny_model("none")
    ddp = wrap_ddp(net, "cpu")
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    opt = _sgd(ddp)
    parts = [t.chunk(2) for t in (shard(t, rank, world) for t in global_batches(world))]
    opt.zero_grad(set_to_none=True)
    with ddp.no_sync():  # micro-batch 1: gradients stay local, accumulate in .grad
        (step_b_loss(ddp, parts[0][0], parts[1][0], parts[2][0], "separate", MARGIN)[0] / 2).backward()
    after_first = len(calls)
    (step_b_loss(ddp, parts[0][1], parts[1][1], parts[2][1], "separate", MARGIN)[0] / 2).backward()
    opt.step()
    ref = no_sync_reference(world)
    gap = max(float((torch.tensor(ref[k], dtype=torch.float64) - v.reshape(-1)).abs().max())
              for k, v in net.named_parameters())
    return {"allreduces_after_no_sync_backward": after_first, "allreduces_after_synced_backward": len(calls),
            "vs_single_process": gap, "replicas": all_ranks_equal(net)}


def engine_setup():
    """Data, split and config of case ``engine``: 48 labeled images, 24 + 24 test ID/OOD, batches of 8.

    Returns ``(x_sup (48, 1, 8, 8), y_sup (48,), split, cfg)``, float64; 6 iterations per epoch, 2 epochs.
    """
    from ..experiments.config import MCDConfig
    from ..data.sets import transductive_split

    g = torch.Generator().manual_seed(2)
    x_sup = torch.randn(48, 1, HW, HW, generator=g, dtype=torch.float64)
    y_sup = torch.randint(0, K, (48,), generator=g)
    id_x = torch.randn(30, 1, HW, HW, generator=g, dtype=torch.float64)
    id_y = torch.randint(0, K, (30,), generator=g)
    ood_x = 2 * torch.randn(30, 1, HW, HW, generator=g, dtype=torch.float64)
    split = transductive_split(id_x, id_y, ood_x, n_val=6, seed=3)
    cfg = MCDConfig(norm="none", finetune_epochs=2, batch_size_sup=8, batch_size_unsup=8, finetune_lr=LR,
                    margin=MARGIN, checkpoint_every=0, eval_batch_size=16)
    return x_sup, y_sup, split, cfg


def case_engine(rank: int, world: int) -> dict:
    """``training.loop.finetune`` under DDP (no BatchNorm, float64), both strategies: parameters and history."""
    from ..training.loop import finetune

    x_sup, y_sup, split, cfg = engine_setup()
    out = {}
    for strategy in ("separate", "concat"):
        net = tiny_model("none")
        hist = finetune(net, x_sup, y_sup, split, cfg, strategy, progress=False)
        out[strategy] = {"replicas": all_ranks_equal(net), "val_auroc": hist.val_auroc,
                         "params": {k: v.reshape(-1).tolist() for k, v in net.state_dict().items()}}
    return out


def engine_gap(rank_result: dict, strategy: str) -> float:
    """Largest ``|parameter|`` difference between case ``engine``'s DDP result for ``strategy`` and the
    same :func:`mcd_helpers.training.loop.finetune` call run here, in one process (float64)."""
    from ..training.loop import finetune

    x_sup, y_sup, split, cfg = engine_setup()
    net = tiny_model("none")
    finetune(net, x_sup, y_sup, split, cfg, strategy, progress=False)
    return max(float((torch.tensor(rank_result[strategy]["params"][k], dtype=torch.float64) - v.reshape(-1)).abs().max())
               for k, v in net.state_dict().items())


CASES = {"parity": case_parity, "find-unused": case_find_unused, "broadcast-buffers": case_broadcast_buffers,
         "sync-bn-cpu": case_sync_bn_cpu, "step-a-bypass": case_step_a_bypass, "chosen": case_chosen,
         "buffers": case_buffers, "no-sync": case_no_sync, "init-sync": case_init_sync, "engine": case_engine,
         "find-unused-split": case_find_unused_split}


@contextlib.contextmanager
def _stderr_lines():
    """Collect what is written to file descriptor 2 (C++ warnings included) while the block runs.

    Yields a list that holds the lines once the block has ended; the previous stderr is restored.
    """
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def _run_rank(cases: list[str], out: Path) -> None:
    env, _ = init_distributed("cpu", timeout_s=60)
    results = {}
    for case in cases:
        with warnings.catch_warnings(record=True) as caught, _stderr_lines() as stderr:
            warnings.simplefilter("always")
            try:
                result = CASES[case](env.rank, env.world_size)
            except Exception as err:  # recorded, so that the notebook and the tests can read the pitfall back
                result = {"error": type(err).__name__, "message": str(err).strip().splitlines()[0][:300]}
        result["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught
                                     if "ddp" in str(w.message).lower() or "find_unused" in str(w.message)})
        result["stderr"] = [line[:300] for line in stderr if "find_unused_parameters" in line]
        results[case] = result
        barrier()  # the next case starts together on every rank
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{env.rank}.json").write_text(json.dumps(results, indent=1))
    cleanup()


def launch(cases, nprocs: int = 2, timeout_s: float = 300) -> dict[str, list[dict]]:
    """Run ``cases`` (a name or a list) in one ``torchrun --standalone --nproc_per_node=nprocs`` (Gloo).

    Returns ``{case: [rank 0's dict, rank 1's dict, ...]}``. The cases run one after another in
    the same process group (starting torchrun costs seconds); a case that raises on every rank
    before any collective leaves the group usable for the next one. Every rank gets the caller's
    ``OMP_NUM_THREADS`` (:func:`omp_threads`): the exact (float64) results hold for any thread count.

    Raises:
        ValueError: on an unknown case.
        RuntimeError: if torchrun fails without the ranks writing results (its output attached).
    """
    cases = [cases] if isinstance(cases, str) else list(cases)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}.")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}",
               "-m", "mcd_helpers.teaching.ddp_demo", *cases, "--out", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": omp_threads(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        files = [Path(tmp) / f"rank{r}.json" for r in range(nprocs)]
        if not all(f.exists() for f in files):
            raise RuntimeError(f"torchrun exited with {proc.returncode} without results:\n{proc.stderr[-3000:]}")
        per_rank = [json.loads(f.read_text()) for f in files]
    return {case: [r[case] for r in per_rank] for case in cases}


# A CPU-minute reproduction (notebook 06's quick mode and tests/test_distributed.py): Fashion-MNIST
# subsets, 1 pre-training epoch, 15 fine-tuning iterations per strategy, Gaussian noise as OOD.
QUICK_FLAGS = ["--preset", "quick", "--ood-sets", "gaussian", "--strategies", "separate,concat",
               "--train-subset", "2000", "--test-subset", "1200", "--pretrain-epochs", "1", "--pretrain-milestones",
               "1", "--steps-per-epoch", "15", "--n-val", "200", "--ood-size", "1000", "--checkpoint-every", "0"]


def omp_threads() -> str:
    """The caller's ``OMP_NUM_THREADS`` (``"1"`` when unset or empty): what :func:`launch` and
    :func:`launch_reproduction` pass to every rank."""
    return os.environ.get("OMP_NUM_THREADS") or "1"


def launch_reproduction(out: Path, flags: list[str], nprocs: int = 2, timeout_s: float = 1800) -> tuple[list[dict], float]:
    """Run ``python -m mcd_helpers reproduce --out OUT FLAGS`` on ``nprocs`` processes; return (rows, seconds).

    ``nprocs > 1``: under ``torchrun --standalone --nproc_per_node=nprocs`` (Gloo on the CPU);
    ``nprocs == 1``: a plain process. Every rank gets the caller's ``OMP_NUM_THREADS`` (``1`` when
    it is unset), never a value derived from the machine's core count: the thread count changes the
    order of float reductions and so the trajectory of a small run (measured on :data:`QUICK_FLAGS`,
    seed 0, 2 ranks: the pre-trained network's MSP AUROC 15.6% with 1 thread per rank, 16.1% with 2),
    so the same call must give the same numbers on every machine. Set ``OMP_NUM_THREADS`` before
    calling to choose another thread count. The stages go through the pipeline's cache
    (:mod:`mcd_helpers.experiments.cache`, keyed with the world size, not the thread count): put
    ``--retrain`` in ``flags`` to train again.

    Raises:
        RuntimeError: when the command exits non-zero (the tail of its output attached).
    """
    import time

    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", "-m"]
                if nprocs > 1 else [sys.executable, "-m"])
    cmd = launcher + ["mcd_helpers", "reproduce", "--out", str(out), "--quiet", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": omp_threads(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    seconds = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((Path(out) / "results.json").read_text()), seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    parser.add_argument("--out", type=Path, default=None, help="folder for rank<R>.json (set: run as one rank)")
    args = parser.parse_args(argv)
    if args.out is not None or "RANK" in os.environ:
        _run_rank(args.cases, args.out or Path(tempfile.mkdtemp()))
    else:
        for case, per_rank in launch(args.cases).items():
            for rank, result in enumerate(per_rank):
                print(f"{case} rank {rank}: {json.dumps(result)}")


if __name__ == "__main__":
    main()
