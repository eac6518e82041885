"""Images per second of the main job's work under each CPU setting, side by side, on this machine.

    python benchmarks/cpu_settings.py             # about two minutes on 2 idle cores
    python benchmarks/cpu_settings.py --rounds 9

What ``make demo`` spends its time on, with ``small_cnn`` on Fashion-MNIST-sized images: a training
step (CE on both heads, batch 128, SGD), the evaluation forwards (``predict_logits``: eval mode,
batches of ``eval_batch_size``), and ODIN's input gradient (a forward and backward to the input,
in batches of ``eval_batch_size``). Each setting is added to the one before, as the presets take
them: NCHW float32, batch 1,000 (the old default) -> ``channels_last`` -> bf16 autocast (training
only) -> ``torch.inference_mode`` -> batches of 250 (activations that stay in the cache); rows
marked "not taken" were measured and left out: larger evaluation batches, and bf16 in evaluation
(ODIN's input step, 0.0014 / 0.353 = 0.004 in normalised units, is below bf16's resolution of a
normalised pixel between 1 and 2, 2^-7 = 0.008, and MCD's scores would be rounded to 3 significant
digits). Rounds alternate the order of the settings, so drift cancels; the table gives the median
images/s and each setting's speed-up over the first, the median of each round's own ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mcd_helpers.experiments.config import native_bf16
from mcd_helpers.models import small_cnn


def _layout(channels_last: bool):
    return torch.channels_last if channels_last else torch.contiguous_format


def train_step(x, y, channels_last=False, bf16=False, steps=15) -> float:
    model = small_cnn(1, 10).to(memory_format=_layout(channels_last)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xb, yb = x[:128].contiguous(memory_format=_layout(channels_last)), y[:128]
    t0 = 0.0
    for i in range(steps + 1):  # step 0 warms up
        t0 = time.perf_counter() if i == 1 else t0
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits1, logits2 = model(xb)
            loss = F.cross_entropy(logits1, yb) + F.cross_entropy(logits2, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * 128 / (time.perf_counter() - t0)


def evaluation(x, channels_last=False, inference=False, batch=1000, bf16=False) -> float:
    model = small_cnn(1, 10).to(memory_format=_layout(channels_last)).eval()
    with (
        torch.inference_mode() if inference else torch.no_grad(),
        torch.autocast("cpu", torch.bfloat16, enabled=bf16),
    ):
        model(x[:batch])  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(x), batch):
            model(x[i : i + batch])
    return len(x) / (time.perf_counter() - t0)


def odin_gradient(x, channels_last=False, batch=1000, bf16=False) -> float:
    model = small_cnn(1, 10).to(memory_format=_layout(channels_last)).eval()
    t0 = 0.0
    for i in range(0, 5000, batch):  # the first batch warms up
        t0 = time.perf_counter() if i == batch else t0
        xb = x[i : i + batch].requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(xb)[0].float() / 1000.0
        (grad,) = torch.autograd.grad(
            F.cross_entropy(logits, logits.argmax(1), reduction="sum"), xb
        )
    return (5000 - batch) / (time.perf_counter() - t0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = torch.randn(9000, 1, 28, 28), torch.randint(0, 10, (9000,))
    x_cl = x.contiguous(memory_format=torch.channels_last)
    work = {
        "training step": {
            "NCHW float32": lambda: train_step(x, y),
            "channels_last": lambda: train_step(x, y, True),
            "channels_last + bf16 autocast": lambda: train_step(x, y, True, True),
        },
        "evaluation": {
            "NCHW, no_grad, batch 1000": lambda: evaluation(x),
            "channels_last": lambda: evaluation(x_cl, True),
            "+ inference_mode": lambda: evaluation(x_cl, True, True),
            "+ batch 250": lambda: evaluation(x_cl, True, True, 250),
            "batch 3000 (not taken)": lambda: evaluation(x_cl, True, True, 3000),
            "bf16 autocast (not taken)": lambda: evaluation(x_cl, True, True, 250, True),
        },
        "ODIN's input gradient": {
            "NCHW, batch 1000": lambda: odin_gradient(x),
            "channels_last": lambda: odin_gradient(x_cl, True),
            "+ batch 250": lambda: odin_gradient(x_cl, True, 250),
            "bf16 autocast (not taken)": lambda: odin_gradient(x_cl, True, 250, True),
        },
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16: "
        f"{native_bf16('cpu')}, {args.rounds} rounds"
    )
    print("| work | setting | images/s | speed-up over the first (median of rounds) |")
    print("|---|---|---:|---:|")
    for task, settings in work.items():
        speeds = {name: [] for name in settings}
        for r in range(args.rounds):
            for name in list(settings) if r % 2 else list(settings)[::-1]:
                speeds[name].append(settings[name]())
        first = speeds[next(iter(settings))]
        for name, s in speeds.items():
            ratio = statistics.median(b / a for a, b in zip(first, s))
            print(f"| {task} | {name} | {statistics.median(s):,.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
