"""Data-parallel MCD training with ``torchrun`` and DistributedDataParallel (DDP).

Run the reproduction on N processes (CPU: Gloo; GPUs: NCCL, one GPU per process)::

    torchrun --standalone --nproc_per_node=2 -m mcd_helpers reproduce --preset quick --out runs/ddp
    torchrun --standalone --nproc_per_node=8 -m mcd_helpers reproduce --preset paper-cifar10-wrn \
        --out runs/wrn --sync-bn
    # two machines, 8 GPUs each: the same command on both, one rendezvous endpoint
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \
        --rdzv-id=mcd1 -m mcd_helpers reproduce --preset paper-cifar10-wrn --out runs/wrn --sync-bn

``torchrun`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them (no variables: one plain
process, nothing changes).

**How DDP relates to the single-process graph** (notebooks 02/03). Each rank runs the same
forwards and one backward on its own shard of the batch; its graph is the single-process graph of
that shard. DDP adds one thing: a hook on every parameter's ``AccumulateGrad`` node (where the
graphs of the two forwards meet) that all-reduces ``.grad`` and divides by the world size W. So
after ``backward`` every rank holds ``(1/W) sum_r grad L_r`` where ``L_r`` is rank r's loss, and
every rank's optimizer takes the same step. The single-process equivalent of one DDP step is
therefore one step on ``(1/W) sum_r L_r``, the mean of the per-rank losses. With batch-mean
losses on equal shards this is the mean over the global batch for cross-entropy; for the
discrepancy loss ``max(m - mean gap, 0)`` it is the mean of the per-shard hinges, which equals the
hinge of the global mean while the hinge is active on every shard (the gap below the margin m).
Train-mode BatchNorm breaks the equivalence: each rank normalises with its own shard's statistics
("ghost batches" of size B/W) unless SyncBatchNorm all-gathers them.

**The DDP settings chosen** (:func:`wrap_ddp`) and why:

* ``find_unused_parameters=False``: every parameter of G, F1 and F2 receives a gradient in
  every backward (pre-training, Step A with F2 on detached features, Step B), so DDP needs no
  search for unused parameters; ``True`` walks the autograd graph after every forward, i.e. twice
  per Step B, for nothing. Measured in torch 2.14.1 on CPU/Gloo (``ddp_demo``): when both forwards
  use every parameter (case ``find-unused``), ``True`` runs and keeps the replicas equal, but the
  C++ side prints a performance warning to stderr ("find_unused_parameters=True was specified in
  DDP constructor, but did not find any unused parameters"; not a Python warning). When the two
  forwards use different parameter subsets (forward 1 through G and F1 only, forward 2 through G
  and F2 only; case ``find-unused-split``), ``True`` raises "Expected to mark a variable ready
  only once" in the backward. Each forward's search replaces the previous one: the search after
  forward 2 (which used G and F2) finds F1 unused and marks F1's parameters ready at once; in the
  backward forward 1's gradient reaches F1 and marks them a second time ("Parameter at index 9
  with name net.F1.bias has been marked as ready twice"). ``False`` runs that case.
* ``forward_sync_buffers=False`` (torch 2.13+'s name; ``broadcast_buffers`` is deprecated since
  2.13): with ``True`` (DDP's default) DDP copies rank 0's buffers (BatchNorm's
  ``running_mean``/``running_var``) into every rank, in place, at the start of *each* forward: two
  broadcasts per Step B, and the other ranks' running statistics thrown away each time. Older
  torch versions raised "modified by an inplace operation" in ``backward`` when that copy hit a
  buffer saved by the first forward (pytorch/pytorch#110363); torch 2.14.1 runs the copy inside
  ``torch.autograd._unsafe_preserve_version_counter`` (``DistributedDataParallel._sync_buffers``
  in ``torch/nn/parallel/distributed.py``, the fix of pytorch/pytorch#175024), so it no longer
  raises (case ``broadcast-buffers``: no error, replicas equal). The two flags differ at
  construction: ``broadcast_buffers=False`` also skips the initial buffer sync,
  ``forward_sync_buffers=False`` (what :func:`wrap_ddp` passes) keeps it, so every rank starts
  from rank 0's parameters *and* buffers. With ``False`` each rank keeps its own running
  statistics during training; :func:`average_buffers` replaces them by their mean over the ranks
  before an evaluation (:func:`broadcast_buffers`, rank 0's copy, drops the other ranks' data).
* ``--sync-bn``: :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`; train-mode BatchNorm
  then uses the statistics of the whole global batch (of each forward), so the concatenated
  strategy under DDP equals the single-process concatenated strategy. In this PyTorch SyncBatchNorm
  runs on CUDA (and XPU/HPU) only: on CPU its forward raises ``ValueError`` ("SyncBatchNorm
  expected input tensor to be on GPU ...") and its kernels (``torch.batch_norm_stats``) have no
  CPU implementation. :func:`check_sync_bn` refuses it on CPU before training starts.
* **Every training forward goes through the DDP wrapper.** DDP arms its gradient hooks in its own
  ``forward``; a backward through graphs built by calling the inner module (``model.features``,
  ``model.F1``) skips the all-reduce, and the ranks drift apart silently (case ``step-a-bypass``).
  Step A needs G's features once for F1 and detached for F2, so the wrapped module is
  :class:`TwoForwardModes`, whose ``forward(x, detach_f2=True)`` is Step A's forward. (The risk is
  this package's own: the official ``solver.py`` keeps G, F1 and F2 as three modules with three
  optimizers, each of which would be wrapped on its own; here one ``TwoHeadNet`` is wrapped once.)

Data: the global batch under DDP *is* the single-process batch. Every rank computes the
single-process run's seeded permutation of each pass (:class:`~mcd_helpers.engine.ShuffledBatches`;
a new one every pass) and a :class:`torch.utils.data.DistributedSampler` (``shuffle=False``) deals
each batch's positions round-robin to the ranks (:class:`ShardedBatches`), for the labeled and the
unlabeled stream alike. A batch-size flag keeps meaning the global batch (each rank takes
``B / W`` samples), so a preset's learning rate, steps per epoch and data order stay those of one
process. (A first version drew each rank's share from ``DistributedSampler(shuffle=True)`` with
``set_epoch``: another data order than the single-process run's; on 2 CPU ranks the quick
preset's MCD then reached an AUROC of 98.7% (separate) / 98.8% (concat) on ``digits``, against
99.8% in one process. With the single-process order dealt to the ranks: 99.84% / 99.89%.) Evaluation: :func:`gather_scores` splits the
test set in W contiguous shards and all-gathers the scores in order, so the metrics see every
test sample exactly once. Only :func:`is_main_process` writes files.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

__all__ = ["DistEnv", "dist_env", "init_distributed", "cleanup", "is_main_process", "barrier", "TwoForwardModes",
           "wrap_ddp", "unwrap", "check_sync_bn", "local_batch_size", "ShardedBatches", "make_batches", "stage_key",
           "shard_bounds",
           "gather_scores", "broadcast_buffers", "average_buffers", "all_ranks_equal"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` in ``[0, world_size)``, ``local_rank`` on its machine."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_env(environ=None) -> DistEnv:
    """Read ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (set by ``torchrun``); absent -> one process.

    Raises:
        ValueError: when only some of the variables are set or they are inconsistent
            (``RANK`` outside ``[0, WORLD_SIZE)``).
    """
    environ = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    present = [n for n in names if n in environ]
    if not present:
        return DistEnv()
    if len(present) != len(names):
        raise ValueError(f"found {present} but not {sorted(set(names) - set(present))} in the environment; "
                         "launch with torchrun (which sets all three) or unset them for one process.")
    env = DistEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        raise ValueError(f"RANK={env.rank} must lie in [0, WORLD_SIZE={env.world_size}).")
    return env


def init_distributed(device: str = "cpu", timeout_s: float = 600.0) -> tuple[DistEnv, str]:
    """Initialise the default process group when launched by ``torchrun``; return ``(env, device)``.

    Backend: NCCL when ``device`` is CUDA (each process then uses ``cuda:LOCAL_RANK``), Gloo on
    the CPU. Without torchrun's variables (or with ``WORLD_SIZE=1``) nothing is initialised and
    ``device`` comes back unchanged. Idempotent: a second call reuses the process group.

    Raises:
        ValueError: see :func:`dist_env`; or CUDA asked for with fewer GPUs than local ranks.
    """
    env = dist_env()
    if not env.distributed:
        return env, device
    if torch.device(device).type == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {env.local_rank} needs GPU {env.local_rank}, but "
                             f"{torch.cuda.device_count()} are visible; lower --nproc_per_node.")
        torch.cuda.set_device(env.local_rank)
        device, backend = f"cuda:{env.local_rank}", "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return env, device


def cleanup() -> None:
    """Destroy the default process group if there is one (call once at the end of every rank)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True on rank 0 (and in a plain single process): the one process that writes files."""
    return _world()[0] == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _world()[1] > 1:
        dist.barrier()


class TwoForwardModes(nn.Module):
    """A :class:`~mcd_helpers.models.TwoHeadNet` whose ``forward`` also serves Step A, for DDP.

    ``forward(x)`` is ``net(x)``; ``forward(x, detach_f2=True)`` is the official Step A forward
    ``(F1(G(x)), F2(G(x).detach()))``, so Step A runs through DDP's ``forward`` (which arms the
    gradient all-reduce) instead of calling ``net.features``/``net.F1`` directly (which would not).

    Shapes:
        x: ``(N, C, H, W)`` -> ``(logits1, logits2)``, each ``(N, K)``.
    """

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, detach_f2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if not detach_f2:
            return self.net(x)
        feat = self.net.features(x)  # (N, D)
        return self.net.F1(feat), self.net.F2(feat.detach())


def check_sync_bn(device: str) -> None:
    """Raise ``ValueError`` if SyncBatchNorm cannot run on ``device`` in this PyTorch (CPU: it cannot)."""
    if torch.device(device).type not in ("cuda", "xpu", "hpu"):
        raise ValueError(f"--sync-bn needs GPUs: in torch {torch.__version__} SyncBatchNorm runs on CUDA/XPU/HPU "
                         f"only, not on {device!r}. On the CPU drop --sync-bn (per-rank BatchNorm statistics).")


def wrap_ddp(net: nn.Module, device: str, sync_bn: bool = False) -> nn.Module:
    """Wrap ``net`` for training with DDP (see the module docstring for the settings and why).

    In a single process ``net`` is returned unchanged. Otherwise: BatchNorm converted to
    SyncBatchNorm when ``sync_bn``, then ``DDP(TwoForwardModes(net), find_unused_parameters=False,
    forward_sync_buffers=False)``; DDP broadcasts rank 0's parameters and buffers once, here, so every
    rank starts from the same weights. Train through the returned module; :func:`unwrap` gives
    ``net`` back (for ``state_dict``, evaluation and saving).

    Raises:
        ValueError: ``sync_bn`` on a device without SyncBatchNorm (:func:`check_sync_bn`).
    """
    if _world()[1] == 1:
        return net
    if sync_bn:
        check_sync_bn(device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    dev = torch.device(device)
    ids = [dev.index] if dev.type == "cuda" else None
    return DDP(TwoForwardModes(net), device_ids=ids, find_unused_parameters=False,
               forward_sync_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain network inside a :func:`wrap_ddp` result (``model`` itself if not wrapped)."""
    if isinstance(model, DDP):
        model = model.module
    return model.net if isinstance(model, TwoForwardModes) else model


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Per-rank batch ``B / W`` for a global batch ``B``.

    Raises:
        ValueError: if ``B`` is not a multiple of ``W``.
    """
    if global_batch % world_size:
        raise ValueError(f"the global batch size {global_batch} must be a multiple of the number of processes "
                         f"{world_size}; choose a batch size divisible by --nproc_per_node.")
    return global_batch // world_size


class ShardedBatches:
    """This rank's share of every batch of a :class:`~mcd_helpers.engine.ShuffledBatches` stream.

    Same interface (``per_pass``, ``batch_size``, ``batch(p, i)``, ``batch_at(k)``). The shuffle
    is the single-process one: every rank computes the same seeded permutation of pass ``p``
    (``batches.permutation(p)``, the order a one-process run uses), and a
    :class:`torch.utils.data.DistributedSampler` (``shuffle=False``, ``drop_last=True``) over the
    pass's ``per_pass * B`` positions hands rank r the positions ``r, r + W, r + 2W, ...``. Cut
    into batches of ``B / W``, rank r's batch i holds positions ``i*B + r, i*B + r + W, ...``:
    the W ranks' batches i are disjoint and together are exactly the single-process batch i. So
    under DDP the *global* batch, the data order, the steps per pass and the reshuffle per pass
    (the permutation depends on ``p``) are those of the single-process run; only train-mode
    BatchNorm sees ``B / W`` samples per forward (see the module docstring). The sampler's own
    shuffling (and so its ``set_epoch``) is not used: it would draw another order than the
    single-process run's.

    Raises:
        ValueError: if ``batches.batch_size`` is not a multiple of the world size.
    """

    def __init__(self, batches, rank: int | None = None, world_size: int | None = None):
        r, w = _world()
        self.rank, self.world_size = (r if rank is None else rank), (w if world_size is None else world_size)
        self.batches, self.per_pass = batches, batches.per_pass
        self.batch_size = local_batch_size(batches.batch_size, self.world_size)  # per rank
        self._pass, self._idx = None, None

    def batch(self, p: int, i: int) -> torch.Tensor:
        """This rank's indices of batch ``i`` of pass ``p``, shape ``(B / W,)``."""
        if not 0 <= i < self.per_pass:
            raise IndexError(f"a pass has {self.per_pass} batches, asked for batch {i}.")
        if p != self._pass:
            perm = self.batches.permutation(p)[:self.per_pass * self.batches.batch_size]  # (per_pass * B,)
            sampler = DistributedSampler(range(len(perm)), num_replicas=self.world_size, rank=self.rank,
                                         shuffle=False, drop_last=True)
            self._idx, self._pass = perm[torch.tensor(list(sampler), device=perm.device)], p
        return self._idx[i * self.batch_size:(i + 1) * self.batch_size]

    def batch_at(self, k: int) -> torch.Tensor:
        """Indices of the ``k``-th batch of the endless stream (pass ``k // per_pass``)."""
        return self.batch(*divmod(k, self.per_pass))


def make_batches(n: int, global_batch: int, seed: int, stream: int, device="cpu", **kwargs):
    """The training engine's index batches: :class:`~mcd_helpers.engine.ShuffledBatches` in one
    process, this rank's :class:`ShardedBatches` share (``global_batch / W``) of it under ``torchrun``.

    ``kwargs`` (``drained``, ``iterators``) go to :class:`~mcd_helpers.engine.ShuffledBatches`.

    Raises:
        ValueError: see :func:`local_batch_size` and the two classes.
    """
    from .engine import ShuffledBatches

    batches = ShuffledBatches(n, global_batch, seed, stream, device, **kwargs)
    return batches if _world()[1] == 1 else ShardedBatches(batches)


def stage_key(key: str, sync_bn: bool = False) -> str:
    """A config hash ``key`` marked with the world size (and SyncBatchNorm) under ``torchrun``.

    A stage trained on W ranks computes other numbers than one trained in one process (per-rank
    BatchNorm, another data order), so checkpoints and caches must not be mixed up. One process:
    ``key`` unchanged.
    """
    world = _world()[1]
    return key if world == 1 else f"{key}-ranks{world}" + ("-syncbn" if sync_bn else "")


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous shard of ``n`` samples (sizes differ by <= 1)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def gather_scores(fn, x: torch.Tensor):
    """Apply ``fn`` to this rank's contiguous shard of ``x`` and return the results of all ranks in order.

    ``fn`` maps ``(n, ...)`` to a tensor or a tuple of tensors with leading axis ``n`` (e.g. both
    heads' logits); the shards' results are gathered with ``all_gather_object`` (shards may
    differ in size by one) and concatenated in rank order, so the result equals ``fn(x)`` on the
    whole of ``x`` (CPU tensors), on every rank. In a single process: ``fn(x)``.
    """
    rank, world = _world()
    if world == 1:
        return fn(x)
    start, stop = shard_bounds(len(x), rank, world)
    out = fn(x[start:stop])
    single = isinstance(out, torch.Tensor)
    parts = [None] * world
    dist.all_gather_object(parts, tuple(t.cpu() for t in ((out,) if single else out)))
    joined = tuple(torch.cat(col) for col in zip(*parts))
    return joined[0] if single else joined


def broadcast_buffers(net: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) into every rank, in place.

    Every rank then holds rank 0's statistics, computed from rank 0's shards only: the other
    ranks' data are dropped. Prefer :func:`average_buffers` before an evaluation. No-op in a single
    process.
    """
    if _world()[1] == 1:
        return
    with torch.no_grad():
        for buf in net.buffers():
            dist.broadcast(buf, src=0)


def average_buffers(net: nn.Module) -> None:
    """Replace every floating-point buffer by its mean over the ranks (``all_reduce`` SUM / W), in place.

    The training engine (``train.py``, ``reproduce.py``) calls it before every evaluation under
    ``forward_sync_buffers=False``, where each rank's BatchNorm running statistics saw only its
    own shards, so every rank evaluates with the same statistics, built from every rank's data.

    How close that is to one process forwarding the global batches (same parameters, equal
    shards; per channel ``n`` values per shard, i.e. ``B / W`` samples times the spatial positions,
    and ``N = W n`` in the global batch):

    * ``running_mean`` is an exponential moving average, linear in the batch means, so its
      average over ranks equals the global one **exactly for the first BatchNorm layer** (which
      sees the same inputs either way). Deeper layers see inputs normalised with each rank's own
      shard statistics, not the global ones, so there the average is close, not equal.
    * ``running_var`` stores *unbiased* batch variances. For one channel with shard means
      ``mu_r``, shard variances ``s_r^2`` (unbiased), global mean ``mu`` and global variance
      ``s^2`` (unbiased), the exact identity is
      ``(N - 1) s^2 = sum_r (n - 1) s_r^2 + n sum_r (mu_r - mu)^2``.
      The mean over ranks ``(1/W) sum_r s_r^2`` therefore differs from ``s^2`` by a Bessel factor
      (``(n - 1) W / (N - 1)``, below 1) and by the missing between-shard term: it can lie above or
      below the global variance (even with equal shard means it is off by the Bessel factor).

    Integer buffers (``num_batches_tracked``) are equal on every rank (same number of forwards)
    and left as they are. No-op in a single process.
    """
    world = _world()[1]
    if world == 1:
        return
    with torch.no_grad():
        for buf in net.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                buf.div_(world)


def all_ranks_equal(net: nn.Module) -> float:
    """Largest ``|p_rank - p_rank0|`` over every parameter and rank (0.0 in a single process).

    A check that DDP kept the replicas in sync (run it on every rank; a collective).
    """
    rank, world = _world()
    if world == 1:
        return 0.0
    flat = torch.cat([p.detach().reshape(-1).cpu().double() for p in net.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)
