"""The package's DDP under torchrun (2 CPU ranks, Gloo), for tests/test_ddp.py: each rank writes its
results.

``torchrun --standalone --nproc_per_node=2 tests/ddp_script.py OUT_DIR``
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_setup import engine_split, tiny_model  # noqa: E402

from mcd_helpers.errors import ConfigError, TrainingInterrupted  # noqa: E402
from mcd_helpers.experiments import ddp  # noqa: E402
from mcd_helpers.experiments import loop as train  # noqa: E402

out = Path(sys.argv[1])
device = ddp.setup("cpu")
rank, world = ddp.world()
res = {"world": world}

# the training loop under DDP: float64, no BatchNorm, each rank half of every batch
for strategy in ("separate", "concat"):
    split, cfg = engine_split()
    net = tiny_model("none")
    hist = train.train(ddp.wrap(net, "cpu"), split, cfg, strategy, progress=False)["history"]
    res[strategy] = {
        "params": {k: v.reshape(-1).tolist() for k, v in net.state_dict().items()},
        "val_auroc": hist.val_auroc,
        "ce": hist.ce,
    }

# average_buffers: floating buffers to the ranks' mean, integer ones untouched
net = tiny_model("batch")
with torch.no_grad():
    net.G[1].running_mean.fill_(rank + 1.0)
    net.G[1].num_batches_tracked.fill_(7 + rank)
ddp.average_buffers(net)
res["average"] = {
    "running_mean": net.G[1].running_mean.tolist(),
    "tracked": int(net.G[1].num_batches_tracked),
}

# the first BatchNorm layer after one train-mode forward per rank: averaged = one process on the
# global batch
x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
net = tiny_model("batch").train()
with torch.no_grad():
    net(x[rank * 4 : (rank + 1) * 4])
ddp.average_buffers(net)
res["first_bn_mean"] = net.G[1].running_mean.tolist()

# gather: fn(x) of the whole, in order, each rank computing a contiguous shard of an odd length
res["gather"] = [
    t.tolist() for t in ddp.gather(lambda t: (t * 2, t.sum(1)), torch.arange(15.0).view(5, 3))
]
res["reduce_max"] = ddp.reduce_max(rank * 10 + 3)


def refuse():
    if rank == 0:
        raise ConfigError("n_val", "rank 0 found a setting that cannot work")
    return "rank 1 must not run it"


try:  # rank 0's error, raised on every rank
    ddp.rank0_first(refuse)
    res["rank0_first"] = None
except ConfigError as err:
    res["rank0_first"] = [err.field, str(err)]

# a SIGTERM that reaches rank 1 only, in its 3rd fine-tuning step: every rank stops after that step
split, cfg = engine_split()
calls = [0]
step_b = train.mcd_step


def counted(*args, **kwargs):
    calls[0] += 1
    if rank == 1 and calls[0] == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return step_b(*args, **kwargs)


train.mcd_step = counted
try:
    train.train(
        ddp.wrap(tiny_model("none"), "cpu"),
        split,
        cfg,
        "separate",
        checkpoint=out / "stop.pt",
        progress=False,
    )
    res["stop"] = None
except TrainingInterrupted as err:
    res["stop"] = {"signal": err.signal, "message": str(err), "steps": calls[0]}
finally:
    train.mcd_step = step_b
ddp.reduce_max(0)  # rank 0 has written the checkpoint before the ranks go on
if rank == 0:
    saved = torch.load(out / "stop.pt", weights_only=True)
    res["saved"] = [saved["epoch"], saved["step"]]

(out / f"rank{rank}.json").write_text(json.dumps(res))
torch.distributed.destroy_process_group()
