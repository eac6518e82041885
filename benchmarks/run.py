"""Speed and memory of one MCD fine-tuning step: a hand-written PyTorch loop vs mcd_helpers' loop.

    python benchmarks/run.py --quick                 # CPU, small batches, about 4 minutes on 2 idle
    cores python benchmarks/run.py --quick --threads 1 --clock cpu   # CPU shared with other jobs
    python benchmarks/run.py --quick --rounds 75     # a median over more rounds (about 15 minutes)
    python benchmarks/run.py                         # CPU, the quick preset's batch sizes python
    benchmarks/run.py --device cuda           # also bf16, channels_last, torch.compile, data on GPU

Writes ``build/bench.json`` and prints a table. For ``small_cnn`` (1x28x28 inputs) and
``densenet_bc_100`` (3x32x32, the paper's CIFAR network), both Step B strategies and each variant,
two loops run the same work, the official iteration (Step A, then Step B, SGD):

* ``raw``: :func:`raw_loop`, the lines a user would write: ``DataLoader``s over the tensors, the
  losses written out, no checks, no logging; after the epoch the official solver's validation
  (the discrepancy-score AUROC on the validation split, scikit-learn's ``roc_auc_score``).
* ``mcd_helpers``: :func:`mcd_helpers.experiments.loop.train` for one epoch of ``steps`` iterations
  (with its model selection on a 1+1-image validation split, and without checkpoints: their cost is
  measured on its own and given in the notes).

Measured alternating: in each round both loops run one block of ``steps`` iterations, in turns
(raw first in even rounds, helper first in odd ones), after one warm-up block each.
``images_per_s`` = (labeled + unlabeled images per iteration) x iterations / seconds, median over
the rounds; ``helper_over_raw`` = median over the rounds of the ratio of the two adjacent blocks'
speeds, so load that drifts over the run cancels. Timing: CUDA events on GPU; on CPU
``time.perf_counter`` (wall), or with ``--clock cpu`` the process's CPU time, which other jobs on
a shared machine do not inflate (with one thread; more threads spin while they wait). Peak memory:
on CUDA ``torch.cuda.max_memory_allocated`` over a block minus the memory allocated before it; on
CPU the peak of the bytes autograd saves for backward (the activations) during one iteration, by the
notebooks' own meter, :class:`mcd_helpers.memory.SavedTensorMeter` (parameters and inputs not
counted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mcd_helpers.experiments.config import PRESETS, MCDConfig  # noqa: E402
from mcd_helpers.experiments.files import save_state  # noqa: E402
from mcd_helpers.experiments.loop import train  # noqa: E402
from mcd_helpers.memory import SavedTensorMeter  # noqa: E402
from mcd_helpers.models import build_model  # noqa: E402
from mcd_helpers.splits import Split  # noqa: E402

SHAPES = {"small_cnn": (1, 28, 28), "densenet_bc_100": (3, 32, 32)}
VARIANTS = {  # fast-path options per variant (config fields)
    "plain": {},
    "bf16": {"amp": "bf16"},
    "channels_last": {"channels_last": True},
    "compile": {"compile": True},
    "data_on_device": {"data_on_device": True},
    "all": {"amp": "bf16", "channels_last": True, "compile": True, "data_on_device": True},
}
_QUICK = PRESETS["quick"]  # its fine-tuning settings, for both loops
LR, MOMENTUM, WEIGHT_DECAY, MARGIN = (
    _QUICK.finetune_lr,
    _QUICK.finetune_momentum,
    _QUICK.finetune_weight_decay,
    _QUICK.margin,
)


def raw_loop(
    model,
    x,
    y,
    x_unsup,
    steps: int,
    strategy: str,
    batch_sup: int,
    batch_unsup: int,
    device: str,
    amp: str = "none",
    channels_last: bool = False,
    data_on_device: bool = False,
    compile: bool = False,
    val=None,
) -> float | None:
    """A hand-written MCD fine-tuning epoch: ``steps`` iterations of Step A then Step B, then the
    validation AUROC on ``val = (val_id_x, val_ood_x)`` when given."""
    dev = torch.device(device)
    model.to(dev).train()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if compile:
        model.compile(dynamic=False)  # the same compile as the helper's
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if data_on_device:  # what one writes with the data on the GPU: random index batches there
        x, y, x_unsup = x.to(dev), y.to(dev), x_unsup.to(dev)
        perm_sup, perm_unsup = (
            torch.randperm(len(x), device=dev),
            torch.randperm(len(x_unsup), device=dev),
        )
        batches = (
            (x[i], y[i], x_unsup[j])
            for i, j in zip(perm_sup.split(batch_sup), perm_unsup.split(batch_unsup))
        )
    else:
        sup = DataLoader(TensorDataset(x, y), batch_size=batch_sup, shuffle=True, drop_last=True)
        unsup = DataLoader(
            TensorDataset(x_unsup), batch_size=batch_unsup, shuffle=True, drop_last=True
        )
        batches = ((xs, ys, xu) for (xs, ys), (xu,) in zip(sup, unsup))
    for step, (xs, ys, xu) in enumerate(batches):
        if step == steps:
            break
        xs, ys, xu = xs.to(dev), ys.to(dev), xu.to(dev)
        if channels_last:
            xs, xu = (
                xs.contiguous(memory_format=torch.channels_last),
                xu.contiguous(memory_format=torch.channels_last),
            )
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            feat = model.features(xs)  # Step A
            loss_a = F.cross_entropy(model.F1(feat), ys) + F.cross_entropy(
                model.F2(feat.detach()), ys
            )
        opt.zero_grad()
        loss_a.backward()
        opt.step()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
            if strategy == "separate":  # Step B
                (l1s, l2s), (l1u, l2u) = model(xs), model(xu)
            else:
                l1, l2 = model(torch.cat([xs, xu]))
                l1s, l1u, l2s, l2u = l1[: len(xs)], l1[len(xs) :], l2[: len(xs)], l2[len(xs) :]
            ce = F.cross_entropy(l1s, ys) + F.cross_entropy(l2s, ys)
            lp1, lp2 = F.log_softmax(l1u, 1), F.log_softmax(l2u, 1)
            gap = ((lp2.exp() * lp2).sum(1) - (lp1.exp() * lp1).sum(1)).mean()  # H(p1) - H(p2)
            loss = ce + torch.clamp(MARGIN - gap, min=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if val is not None:  # the official solver validates after every epoch (model selection)
        model.eval()
        with torch.no_grad():
            scores = [
                (F.softmax(a, 1) - F.softmax(b, 1)).abs().sum(1)
                for a, b in (model(v.to(dev)) for v in val)
            ]
        model.train()
        return roc_auc_score(
            [0] * len(scores[0]) + [1] * len(scores[1]), torch.cat(scores).cpu().numpy()
        )
    return None


def _setup(model_name: str, batch: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = max(512, batch * (steps + 1))
    x = torch.randn(n, *SHAPES[model_name], generator=g)
    y = torch.randint(10, (n,), generator=g)
    xu = torch.randn(n, *SHAPES[model_name], generator=g)
    split = Split(
        x_sup=x,
        y_sup=y,
        x_unsup=xu,
        val_id_x=x[:1],
        val_id_y=y[:1],
        val_ood_x=xu[:1] + 3,
        test_id_x=xu[: n // 2],
        test_id_y=y[: n // 2],
        test_ood_x=xu[n // 2 :],
    )
    torch.manual_seed(seed)
    return build_model(model_name, SHAPES[model_name][0], 10), x, y, xu, split


def _cfg(model_name: str, batch: int, steps: int, device: str, variant: str) -> MCDConfig:
    return MCDConfig(
        model=model_name,
        finetune_epochs=1,
        steps_per_epoch=steps,
        finetune_lr=LR,
        finetune_momentum=MOMENTUM,
        finetune_weight_decay=WEIGHT_DECAY,
        margin=MARGIN,
        batch_size_sup=batch,
        batch_size_unsup=batch,
        device=device,
        **VARIANTS[variant],
    )


def _block(loop: str, model, x, y, xu, split, cfg, strategy: str) -> None:
    if loop == "raw":
        raw_loop(
            model,
            x,
            y,
            xu,
            cfg.steps_per_epoch,
            strategy,
            cfg.batch_size_sup,
            cfg.batch_size_unsup,
            cfg.device,
            cfg.resolved_amp(),
            cfg.channels_last,
            cfg.data_on_device,
            cfg.compile,
            (split.val_id_x, split.val_ood_x),
        )
    else:
        train(model, split, cfg, strategy, progress=False)


def _timed(fn, device: str, clock: str = "wall") -> float:
    """Seconds that ``fn()`` takes: CUDA events on a GPU; on the CPU wall time, or with
    ``clock="cpu"`` this process's CPU time (``time.process_time``: blind to other processes
    that share the cores, exact with one thread)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    now = time.process_time if clock == "cpu" else time.perf_counter
    t0 = now()
    fn()
    return now() - t0


def measure(
    model_name: str,
    strategy: str,
    device: str,
    variant: str,
    batch: int,
    steps: int,
    rounds: int,
    clock: str = "wall",
) -> list[dict]:
    """Time both loops alternating; two rows (raw, mcd_helpers) with images/s and the ratio."""
    models, rates, peaks = {}, {"raw": [], "mcd_helpers": []}, {"raw": 0.0, "mcd_helpers": 0.0}
    for loop in rates:
        models[loop], x, y, xu, split = _setup(model_name, batch, steps)
    cfg = _cfg(model_name, batch, steps, device, variant)
    for loop in rates:  # a warm-up block each: allocations, oneDNN primitives, compilation of G
        _block(loop, models[loop], x, y, xu, split, cfg, strategy)
    cfg = dataclasses.replace(cfg, compile=False)  # G stays compiled; do not wrap it again
    ratios = []
    for r in range(rounds):
        order = ("raw", "mcd_helpers") if r % 2 == 0 else ("mcd_helpers", "raw")
        got = {}
        for loop in order:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            seconds = _timed(
                lambda: _block(loop, models[loop], x, y, xu, split, cfg, strategy), device, clock
            )
            got[loop] = 2 * batch * steps / seconds
            rates[loop].append(got[loop])
            if device.startswith("cuda"):
                peaks[loop] = max(peaks[loop], (torch.cuda.max_memory_allocated() - before) / 2**20)
        ratios.append(got["mcd_helpers"] / got["raw"])
    ratio = statistics.median(ratios)
    if not device.startswith("cuda"):
        peaks = {
            loop: peak_tensor_memory_mb(loop, models[loop], x, y, xu, split, cfg, strategy)
            for loop in rates
        }
    return [
        {
            "model": model_name,
            "strategy": strategy,
            "device": device,
            "variant": variant,
            "loop": loop,
            "batch": f"{batch}+{batch}",
            "images_per_s": round(statistics.median(rates[loop]), 1),
            "peak_memory_mb": round(peaks[loop], 1),
            "helper_over_raw": round(ratio, 3),
            "ratio_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        }
        for loop in rates
    ]


def peak_tensor_memory_mb(loop: str, model, x, y, xu, split, cfg, strategy: str) -> float:
    """Peak MiB of saved activations during one iteration of ``loop``
    (:class:`~mcd_helpers.memory.SavedTensorMeter`)."""
    with SavedTensorMeter(exclude=[*model.parameters(), x, y, xu]) as meter:
        _block(loop, model, x, y, xu, split, dataclasses.replace(cfg, steps_per_epoch=1), strategy)
    return meter.peak_bytes / 2**20


def checkpoint_ms(model_name: str) -> float:
    """Milliseconds to write one fine-tuning checkpoint (model, momentum buffers, best weights)."""
    model, *_ = _setup(model_name, 8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "best_model": model.state_dict(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_state(Path(tmp) / "last.pt", state)
        times = [_timed(lambda: save_state(Path(tmp) / "last.pt", state), "cpu") for _ in range(3)]
    return round(1000 * statistics.median(times), 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small batches (CPU: about 4 minutes)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench.json")
    parser.add_argument(
        "--threads", type=int, default=0, help="CPU threads for PyTorch (0 = its default)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="alternating rounds per model (0 = the plan's: --quick 25 small_cnn, 15 DenseNet)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="CPU timing: wall time (default) or this process's CPU time, for machines "
        "shared with other jobs (use with --threads 1)",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    variants = list(VARIANTS) if cuda else ["plain"]
    # (batch per loader, iterations per block, rounds) per model
    # (CPU block-to-block noise is about +-10% on a shared 2-core VM, so the ratio needs rounds.)
    plan = {
        "small_cnn": (64, 8, 25) if args.quick else (128, 20, 15),
        "densenet_bc_100": (8, 4, 15) if args.quick else (32, 8, 9),
    }
    if cuda:
        plan = {m: (128, 20, 3 if args.quick else 6) for m in plan}
    # more rounds: a median nearer the true ratio (single rounds scatter +-15% on a 2-core VM)
    if args.rounds > 0:
        plan = {m: (batch, steps, args.rounds) for m, (batch, steps, _) in plan.items()}
    t0, rows = time.time(), []
    for model_name, (batch, steps, rounds) in plan.items():
        for strategy in ("separate", "concat"):
            for variant in variants:
                new = measure(
                    model_name, strategy, args.device, variant, batch, steps, rounds, args.clock
                )
                rows += new
                for row in new:
                    print(
                        f"  measured {model_name} {strategy} {variant} {row['loop']}: "
                        f"{row['images_per_s']} images/s",
                        flush=True,
                    )
    ckpt = {m: checkpoint_ms(m) for m in plan}
    helper = {
        (r["model"], r["strategy"], r["variant"]): r["images_per_s"]
        for r in rows
        if r["loop"] == "mcd_helpers"
    }
    notes = [
        f"checkpoint write for {m}: {ms} ms, i.e. "
        f"{100 * ms / 1000 / (50 * 2 * plan[m][0] / helper[(m, 'separate', 'plain')]):.2f}% "
        f"of 50 iterations at the measured speed (checkpoint_every=50)"
        for m, ms in ckpt.items()
    ]
    if cuda:
        notes += [
            f"fast path ({m}, {s}): all options "
            f"{helper[(m, s, 'all')] / helper[(m, s, 'plain')]:.2f}x the plain CUDA loop's images/s"
            for m in plan
            for s in ("separate", "concat")
        ]
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "quick": args.quick,
        "seconds": round(time.time() - t0, 1),
        "timing": "CUDA events"
        if cuda
        else (
            "time.process_time (CPU time of this process)"
            if args.clock == "cpu"
            else "time.perf_counter (wall)"
        ),
        "peak_memory_method": (
            "torch.cuda.max_memory_allocated over a block, minus the memory allocated before it"
        )
        if cuda
        else "peak bytes of the activations autograd saves during one iteration "
        "(mcd_helpers.memory.SavedTensorMeter)",
        "images_per_iteration": "labeled + unlabeled batch (Step A reuses the labeled batch)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "notes": notes}, indent=2) + "\n")
    print(_table(rows))
    rounds = ", ".join(f"{m} {r}" for m, (_, _, r) in plan.items())
    print(
        f"\npeak memory: {meta['peak_memory_method']}.\nimages/s: median over the "
        f"alternating rounds ({rounds})."
    )
    for note in notes:
        print("note:", note)
    print(f"wrote {args.out} in {meta['seconds']:.0f} s")
    return 0


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':<16} {'strategy':<9} {'device':<6} {'variant':<15} {'loop':<12} {'batch':>7} "
        f"{'images/s':>9} {'peak MB':>8} {'helper/raw':>10} {'(min-max)':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, hi = r["ratio_min_max"]
        lines.append(
            f"{r['model']:<16} {r['strategy']:<9} {r['device']:<6} {r['variant']:<15} "
            f"{r['loop']:<12} {r['batch']:>7} {r['images_per_s']:>9.1f} "
            f"{r['peak_memory_mb'] or float('nan'):>8.1f} "
            f"{r['helper_over_raw']:>10.3f} {f'{lo:.2f}-{hi:.2f}':>13}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
