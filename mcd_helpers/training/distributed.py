"""Data-parallel training with ``torchrun`` and DistributedDataParallel (DDP), in a few lines.

Run the reproduction on N processes (CPU: Gloo; GPUs: NCCL, one GPU per process)::

    torchrun --standalone --nproc_per_node=2 -m mcd_helpers reproduce --preset quick --out runs/ddp
    torchrun --standalone --nproc_per_node=8 -m mcd_helpers reproduce --preset paper-cifar10-wrn \
        --out runs/wrn --sync-bn

As nanoGPT does it: :func:`init_distributed` once (reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``;
none set: one plain process, nothing changes); :func:`wrap_ddp` wraps the network, and every
training forward goes through the wrapper (Step A too: ``model(x, detach_f2=True)``); each rank
takes ``batch[rank::world]`` of the single-process batch (:class:`~mcd_helpers.training.batches.Batches`);
only :func:`is_main_process` writes; :func:`gather_scores` evaluates on all ranks and gathers the
scores in order; :func:`average_buffers` gives every rank the mean BatchNorm statistics before an
evaluation. Why these DDP settings (``find_unused_parameters=False``, ``forward_sync_buffers=False``,
SyncBatchNorm on GPUs only) is shown case by case in notebook 06 and
:mod:`mcd_helpers.teaching.ddp_demo`.
"""
from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["DistEnv", "dist_env", "init_distributed", "cleanup", "world", "is_main_process", "barrier",
           "on_rank0_first", "check_sync_bn", "wrap_ddp", "unwrap", "shard_bounds", "gather_scores",
           "average_buffers"]


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


def world() -> tuple[int, int]:
    """``(rank, world_size)``: ``(0, 1)`` in a single process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True on rank 0 (and in a plain single process): the one process that writes files."""
    return world()[0] == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if world()[1] > 1:
        dist.barrier()


def on_rank0_first(fn):
    """``fn()`` on rank 0 first, then (once it succeeded) on the other ranks, which wait meanwhile.

    In one process it is just ``fn()``. Under ``torchrun`` rank 0's exception, if any, is sent to
    every rank and raised there too, so that no rank waits forever for a rank that gave up.
    """
    if world()[1] == 1:
        return fn()
    main, result, err = is_main_process(), None, None
    if main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (sent to the other ranks, raised everywhere)
            err = e
    sent = err
    if err is not None:
        try:
            pickle.dumps(err)
        except Exception:  # noqa: BLE001  (an exception that does not pickle: send its text)
            sent = RuntimeError(f"rank 0 stopped the run: {type(err).__name__}: {err}")
    box = [sent]
    dist.broadcast_object_list(box, src=0)  # the other ranks wait here while rank 0 works
    if box[0] is not None:
        if main:
            raise err
        raise box[0]  # the same error class and message as on rank 0
    return result if main else fn()


def check_sync_bn(device: str) -> None:
    """Raise ``ValueError`` if SyncBatchNorm cannot run on ``device`` in this PyTorch (CPU: it cannot)."""
    if torch.device(device).type not in ("cuda", "xpu", "hpu"):
        raise ValueError(f"--sync-bn needs GPUs: in torch {torch.__version__} SyncBatchNorm runs on CUDA/XPU/HPU "
                         f"only, not on {device!r}. On the CPU drop --sync-bn (per-rank BatchNorm statistics).")


def wrap_ddp(net: nn.Module, device: str, sync_bn: bool = False) -> nn.Module:
    """``DDP(net, find_unused_parameters=False, forward_sync_buffers=False)``; ``net`` itself in one process.

    With ``sync_bn`` BatchNorm becomes SyncBatchNorm first (GPUs only). DDP broadcasts rank 0's
    parameters and buffers once, here. Train through the result; :func:`unwrap` gives ``net`` back.

    Raises:
        ValueError: ``sync_bn`` on a device without SyncBatchNorm (:func:`check_sync_bn`).
    """
    if world()[1] == 1:
        return net
    if sync_bn:
        check_sync_bn(device)
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    dev = torch.device(device)
    return DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None, find_unused_parameters=False,
               forward_sync_buffers=False)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain network inside a :func:`wrap_ddp` result (``model`` itself if not wrapped)."""
    return model.module if isinstance(model, DDP) else model


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
    rank, size = world()
    if size == 1:
        return fn(x)
    start, stop = shard_bounds(len(x), rank, size)
    out = fn(x[start:stop])
    single = isinstance(out, torch.Tensor)
    parts = [None] * size
    dist.all_gather_object(parts, tuple(t.cpu() for t in ((out,) if single else out)))
    joined = tuple(torch.cat(col) for col in zip(*parts))
    return joined[0] if single else joined


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
    size = world()[1]
    if size == 1:
        return
    with torch.no_grad():
        for buf in net.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)
                buf.div_(size)
