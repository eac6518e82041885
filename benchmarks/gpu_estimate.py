"""The paper presets' time on one GPU, on paper: counted FLOPs x images, at a stated share of the
chip's peak.

    python benchmarks/gpu_estimate.py                    # about a minute on 2 cores
    python benchmarks/gpu_estimate.py --shares 0.1,0.3 --peak-tflops 989

No GPU is lent to this project. For each GPU preset (``paper-*``, ``unofficial-*``) this counts the
FLOPs of one training image (forward + backward, ``torch.utils.flop_counter.FlopCounterMode``, which
counts matrix multiplications and convolutions, 2 per multiply-add) and of one evaluation image
(forward), multiplies them by the images the preset processes (pre-training, the fine-tuning per OOD
set with Step A and Step B, per-epoch validation, the MCD test forwards; ODIN's search and scoring,
at 3 forwards per gradient), and divides by ``share x peak``. Peak: an H200's dense bf16 tensor-core
rate, 989 TFLOP/s (NVIDIA's H200 data sheet, without sparsity): the time of a run with
``--amp bf16``; the presets train in float32 (TF32's dense peak is half, the hours double). The ID
test images are counted per OOD set, as if nothing were kept between sets (a small overestimate).
The share a CIFAR-sized network reaches is not known here: the table gives two (``--shares``,
default 5% and 20%; DenseNet-BC's 12-channel layers sit near the low one, WRN-28-10's wide
convolutions nearer the high one); ``benchmarks/cuda_check.py`` measures the real rate on a GPU.

It also measures this CPU's FLOP rate (training steps, channels_last, float32 and bf16 autocast) on
``small_cnn``, ``densenet_bc_100`` and ``wrn_28_10``, the same counter over measured images/s, and
gives each preset's time at the CPU's bf16 rate for its network.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcd_helpers.experiments.config import PRESETS  # noqa: E402
from mcd_helpers.losses import supervised_loss  # noqa: E402
from mcd_helpers.models import build_model  # noqa: E402

CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000
OOD_SIZES = {
    "Imagenet": 10_000,
    "Imagenet_resize": 10_000,
    "LSUN": 10_000,
    "LSUN_resize": 10_000,
    "iSUN": 8_925,
    "gaussian": 10_000,
    "uniform": 10_000,
}


def flops_per_image(model: torch.nn.Module, shape: tuple, train: bool) -> float:
    """FLOPs of one image: a forward (``train=False``, eval mode) or a forward and backward of CE on
    both heads."""
    x, y = torch.randn(4, *shape), torch.zeros(4, dtype=torch.long)
    model.train(train)
    with FlopCounterMode(display=False) as counter:
        if train:
            supervised_loss(*model(x), y).backward()
        else:
            with torch.no_grad():
                model(x)
    return counter.get_total_flops() / len(x)


def images(cfg) -> tuple[float, float]:
    """(training images, evaluation-image equivalents) a preset processes, from its fields."""
    iters = CIFAR_TRAIN // cfg.batch_size_sup  # one pass over the labeled set per fine-tuning epoch
    per_iter = (
        cfg.batch_size_sup * (cfg.schedule == "official")
        + cfg.batch_size_sup
        + cfg.batch_size_unsup
    )
    train = CIFAR_TRAIN * cfg.pretrain_epochs
    evals = 0.0
    for ood in cfg.ood_sets:
        n_ood = OOD_SIZES.get(ood, cfg.ood_size)
        test = CIFAR_TEST + n_ood - 2 * cfg.n_val
        train += len(cfg.strategies) * iters * per_iter * cfg.finetune_epochs
        # validation, MCD's test
        evals += len(cfg.strategies) * (cfg.finetune_epochs * 2 * cfg.n_val + test)
        # ODIN's search
        grid = len(cfg.odin_temperatures) * (3 + len(cfg.odin_epsilons)) * 2 * cfg.n_val
        # MSP/energy forwards; ODIN's gradient (3) and scoring forward
        evals += grid + test * (1 + 3 + 1)
    return train, evals


def cpu_rate(name: str, shape: tuple, batch: int, steps: int, amp: bool) -> tuple[float, float]:
    """(images/s, FLOP/s) of this CPU on training steps of ``name`` (SGD, CE on both heads),
    channels_last."""
    torch.manual_seed(0)
    model = build_model(name, shape[0], 10).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape).contiguous(memory_format=torch.channels_last)
    y = torch.randint(10, (batch,))

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = supervised_loss(*model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # warm-up: oneDNN primitives
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    rate = batch * steps / (time.perf_counter() - t0)
    return rate, rate * flops_per_image(build_model(name, shape[0], 10), shape, train=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200: 989)"
    )
    parser.add_argument(
        "--shares", default="0.05,0.2", help="shares of the peak reached (guesses), comma-separated"
    )
    args = parser.parse_args(argv)
    shares = [float(v) for v in args.shares.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    print("This CPU (training steps, channels_last):")
    print("| model | batch | autocast | images/s | GFLOP/s |")
    print("|---|---:|---|---:|---:|")
    cpu = {}
    for name, shape, batch, steps in (
        ("small_cnn", (1, 28, 28), 128, 20),
        ("densenet_bc_100", (3, 32, 32), 32, 3),
        ("wrn_28_10", (3, 32, 32), 8, 2),
    ):
        for amp in (False, True):
            ips, cpu[name] = cpu_rate(name, shape, batch, steps, amp)
            print(
                f"| {name} | {batch} | {'bf16' if amp else 'float32'} | {ips:.0f} | "
                f"{cpu[name] / 1e9:.1f} |"
            )
    print(
        f"\nOne H200 at {' and '.join(f'{100 * s:.0f}%' for s in shares)} of its "
        f"{args.peak_tflops:.0f} TFLOP/s dense bf16 peak, and this CPU at its bf16 rate:"
    )
    print(
        "| preset | train GFLOP/image | eval GFLOP/image | training images | eval images | PFLOP | "
        + " | ".join(f"H200 hours at {100 * s:.0f}%" for s in shares)
        + " | CPU days |"
    )
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * (len(shares) + 1))
    for name, cfg in PRESETS.items():
        if not name.startswith(("paper-", "unofficial-")):
            continue
        k = 100 if cfg.id_dataset == "cifar100" else 10
        f_train = flops_per_image(build_model(cfg.model, 3, k), (3, 32, 32), train=True)
        f_eval = flops_per_image(build_model(cfg.model, 3, k), (3, 32, 32), train=False)
        n_train, n_eval = images(cfg)
        total = n_train * f_train + n_eval * f_eval
        hours = [f"{total / (s * args.peak_tflops * 1e12) / 3600:.2f}" for s in shares]
        print(
            f"| {name} | {f_train / 1e9:.2f} | {f_eval / 1e9:.2f} | {n_train / 1e6:.1f} M "
            f"| {n_eval / 1e6:.2f} M "
            f"| {total / 1e15:.0f} | {' | '.join(hours)} | {total / cpu[cfg.model] / 86400:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
