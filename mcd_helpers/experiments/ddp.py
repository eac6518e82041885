"""DDP under torchrun as nanoGPT does it: set-up, wrap, rank 0 writes; in one process every call is
a no-op.

Each rank takes ``batch[rank::world]`` of the single-process batch
(:class:`mcd_helpers.experiments.loop.Batches`), the ranks' BatchNorm statistics are averaged before
an evaluation, and scores are gathered. Why: notebook 07.
"""

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn


def setup(device: str) -> str:
    """Join torchrun's process group when ``WORLD_SIZE > 1`` (NCCL on ``cuda:LOCAL_RANK``, else
    Gloo); the device."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.device(device).type == "cuda":
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if "cuda" in device else "gloo", timeout=datetime.timedelta(minutes=10)
        )
    return device


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` in one process."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def is_main() -> bool:
    return world()[0] == 0  # the one process that writes files


def wrap(net: nn.Module, device: str, sync_bn: bool = False) -> nn.Module:
    """``DDP(net, find_unused_parameters=False, forward_sync_buffers=False)`` (rank 0's weights
    broadcast), SyncBatchNorm first if asked (GPUs only); ``net`` itself in one process."""
    if world()[1] == 1:
        return net
    if sync_bn:  # the config allows it on GPUs only
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    return nn.parallel.DistributedDataParallel(
        net,
        device_ids=[torch.device(device).index] if "cuda" in device else None,
        find_unused_parameters=False,
        forward_sync_buffers=False,
    )


def reduce_max(value: int, device="cpu") -> int:
    """The largest of the ranks' ``value``: a stop signal on one rank stops every rank after the
    same step."""
    if world()[1] > 1:
        t = torch.tensor([value], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        value = int(t.item())
    return value


@torch.no_grad()
def average_buffers(net: nn.Module) -> None:
    """Every floating buffer replaced by its mean over the ranks: exact for the first BatchNorm's
    running mean; the averaged running_var lacks the between-rank term of the global variance
    (notebook 07)."""
    for buf in (b for b in net.buffers() if b.is_floating_point() and world()[1] > 1):
        dist.all_reduce(buf)
        buf.div_(world()[1])


def gather(fn, x: torch.Tensor):
    """``fn(x)`` (a tuple of tensors, a row per sample), each rank computing its contiguous
    shard."""
    rank, size = world()
    if size == 1:
        return fn(x)
    parts = [None] * size
    shard = x[len(x) * rank // size : len(x) * (rank + 1) // size]
    dist.all_gather_object(parts, tuple(t.cpu() for t in fn(shard)))
    return tuple(torch.cat(col) for col in zip(*parts))


def rank0_first(fn):
    """``fn()`` on rank 0, then on the other ranks (downloads, cache checks); rank 0's error raised
    on every rank."""
    if world()[1] == 1:
        return fn()
    box, result = [None], None  # an exception to send, or None
    if world()[0] == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (sent to the other ranks, raised everywhere)
            box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    return result if world()[0] == 0 else fn()
