"""Images per second of small_cnn in NCHW and in channels_last (NHWC) memory layout, on this machine.

    python benchmarks/channels_last.py            # about a minute on 2 cores
    python benchmarks/channels_last.py --rounds 9

Why: the benchmark presets (``mcd_helpers.benchmark``) set ``channels_last=True``, a
fast-path option that the other presets leave off. This measures what it buys on the CPU, for
evaluation (``predict_logits``'s forwards, batch 1,000, no gradients) and for one training step of
CE on both heads (batch 128, SGD). Rounds alternate the two layouts, so drift cancels; the table
gives the median images/s over the rounds and the median of each round's ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mcd_helpers.models import small_cnn


def _eval(model, x, layout) -> float:
    model = model.to(memory_format=layout)
    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(0, len(x), 1000):
            model(x[i:i + 1000])
        return len(x) / (time.perf_counter() - t0)


def _train(model, x, y, layout, steps: int = 20) -> float:
    model = model.to(memory_format=layout)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xb = x[:128].contiguous(memory_format=layout)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits1, logits2 = model(xb)
        loss = F.cross_entropy(logits1, y[:128]) + F.cross_entropy(logits2, y[:128])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * 128 / (time.perf_counter() - t0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x, y = torch.randn(4000, 1, 28, 28), torch.randint(0, 6, (4000,))
    layouts = {"NCHW": torch.contiguous_format, "channels_last": torch.channels_last}
    results = {(task, name): [] for task in ("eval", "train") for name in layouts}
    for task, run in (("eval", lambda m, lay: _eval(m.eval(), x, lay)), ("train", lambda m, lay: _train(m.train(), x, y, lay))):
        for r in range(args.rounds + 1):  # round 0 warms up
            order = list(layouts.items()) if r % 2 else list(layouts.items())[::-1]
            for name, layout in order:
                speed = run(small_cnn(1, 6), layout)
                if r:
                    results[(task, name)].append(speed)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print("| work | NCHW images/s | channels_last images/s | ratio (median of rounds) |")
    print("|---|---:|---:|---:|")
    for task in ("eval", "train"):
        a, b = results[(task, "NCHW")], results[(task, "channels_last")]
        ratio = statistics.median(q / p for p, q in zip(a, b))
        print(f"| {task} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
