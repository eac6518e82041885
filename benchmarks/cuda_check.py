r"""CUDA check: MCD fine-tuning of ``densenet_bc_100`` on Fashion-MNIST padded to 32x32; prints
throughput.

The paper's network on the project's offline ID set: a short pre-training (so that the
validation AUROC means something), then a few hundred fine-tuning iterations (official schedule:
Step A + Step B) per Step B strategy, through the package's own training loop,
``mcd_helpers.experiments.loop.train``. Times are wall-clock with ``torch.cuda.synchronize()``
around each timed part; the first ``--warmup`` iterations (cuDNN autotuning, allocator growth) are
run and not timed.

Prepare the data here and carry it to the GPU machine (no data sets there, no network)::

    python benchmarks/cuda_check.py --prepare build/fmnist32.pt   # 20k train + 10k test, ~31 MB
    python benchmarks/cuda_check.py --data build/fmnist32.pt --steps 300 --device cuda \
        --json $OUT/cuda_check.json
    python benchmarks/cuda_check.py --data build/fmnist32.pt --device cuda \
        --set amp=bf16 --set channels_last=True

Smoke check on a CPU (seconds, numbers meaningless)::

    python benchmarks/cuda_check.py --device cpu --steps 2 --warmup 1 --batch 8 --n-train 64 \
        --n-test 300 --n-val 100

Without ``--data`` the images come from ``mcd_helpers.data.load_fashion_mnist`` (Debian's
``dataset-fashion-mnist`` or ``$MCD_DATA_DIR``). OOD set: ODIN's Gaussian noise, padded the same
way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcd_helpers.data import (  # noqa: E402
    FMNIST_MEAN,
    FMNIST_STD,
    load_fashion_mnist,
    load_ood,
    set_seed,
)
from mcd_helpers.experiments.config import MCDConfig  # noqa: E402
from mcd_helpers.experiments.loop import train  # noqa: E402
from mcd_helpers.losses import discrepancy_score  # noqa: E402
from mcd_helpers.metrics import ood_metrics  # noqa: E402
from mcd_helpers.models import build_model, predict_logits  # noqa: E402
from mcd_helpers.splits import transductive_split  # noqa: E402


def pad32(x: torch.Tensor) -> torch.Tensor:
    """Normalised ``(N, 1, 28, 28)`` -> ``(N, 1, 32, 32)``, padded with the normalised value of a
    black pixel."""
    return F.pad(x, (2, 2, 2, 2), value=(0.0 - FMNIST_MEAN) / FMNIST_STD)


def prepare(path: Path, n_train: int, n_test: int) -> None:
    """Write the first ``n_train`` training and ``n_test`` test images as uint8 28x28, with
    labels."""
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x, y = load_fashion_mnist(train=split == "train")
        # (n, 1, 28, 28)
        raw = (x[:n] * FMNIST_STD + FMNIST_MEAN).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        out[f"x_{split}"], out[f"y_{split}"] = raw, y[:n].clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    print(
        f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): {n_train} train + {n_test} "
        "test images"
    )


def load(path: Path | None, n_train: int, n_test: int):
    if path is None:
        (x, y), (xt, yt) = load_fashion_mnist(train=True), load_fashion_mnist(train=False)
        return x[:n_train], y[:n_train], xt[:n_test], yt[:n_test]
    d = torch.load(path, weights_only=True)
    norm = lambda u: (u.float() / 255 - FMNIST_MEAN) / FMNIST_STD  # noqa: E731
    return (
        norm(d["x_train"][:n_train]),
        d["y_train"][:n_train],
        norm(d["x_test"][:n_test]),
        d["y_test"][:n_test],
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set(cfg: MCDConfig, assignments: list[str]) -> MCDConfig:
    """Apply ``field=value`` overrides, each value parsed as the field's type."""
    fields = {f.name: f for f in dataclasses.fields(MCDConfig)}
    changes = {}
    for a in assignments:
        name, _, text = a.partition("=")
        if name not in fields:
            raise SystemExit(f"--set {a}: MCDConfig has no field {name!r}.")
        kind = type(getattr(cfg, name))
        changes[name] = (text.lower() in ("1", "true", "yes")) if kind is bool else kind(text)
    return dataclasses.replace(cfg, **changes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prepare", type=Path, help="write the carried data file here and exit")
    p.add_argument(
        "--data", type=Path, help="data file written by --prepare (default: load Fashion-MNIST)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--steps", type=int, default=300, help="timed fine-tuning iterations per strategy"
    )
    p.add_argument("--warmup", type=int, default=20, help="untimed fine-tuning iterations first")
    p.add_argument(
        "--batch", type=int, default=128, help="labeled and unlabeled batch size (official: 128)"
    )
    p.add_argument(
        "--pretrain-epochs", type=int, default=1, help="pre-training epochs over --n-train images"
    )
    p.add_argument("--n-train", type=int, default=20_000)
    p.add_argument("--n-test", type=int, default=10_000)
    p.add_argument("--n-val", type=int, default=1000)
    p.add_argument("--strategies", default="separate,concat")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="any MCDConfig field"
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.prepare:
        prepare(args.prepare, args.n_train, args.n_test)
        return 0

    device = torch.device(args.device)
    x, y, xt, yt = load(args.data, args.n_train, args.n_test)
    x, xt = pad32(x), pad32(xt)  # (N, 1, 32, 32)
    ood = pad32(load_ood("gaussian", n=len(xt), seed=0))
    split = transductive_split(x, y, xt, yt, ood, n_val=args.n_val)
    cfg = MCDConfig(
        model="densenet_bc_100",
        device=args.device,
        pretrain_epochs=args.pretrain_epochs,
        pretrain_milestones=(),
        pretrain_lr=0.1,
        pretrain_batch_size=args.batch,
        batch_size_sup=args.batch,
        batch_size_unsup=args.batch,
        finetune_epochs=1,
        n_val=args.n_val,
        eval_batch_size=500,
    )
    cfg = _set(cfg, args.set)
    info = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "batch": args.batch,
        "steps": args.steps,
        "config": cfg.to_dict(),
        "runs": [],
    }
    print(
        f"{info['device']} | torch {info['torch']} | densenet_bc_100 | Fashion-MNIST 32x32 "
        f"| batch {args.batch} + {args.batch}"
    )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    # ---- pre-training (timed, for the record) ----
    set_seed(0)
    base = build_model("densenet_bc_100", 1, 10)
    _sync(device)
    t0 = time.perf_counter()
    losses = (
        train(base, split, cfg, progress=False)["history"].ce if args.pretrain_epochs > 0 else []
    )
    _sync(device)
    pre_s = time.perf_counter() - t0
    pre_steps = args.pretrain_epochs * (len(x) // args.batch)
    if pre_steps:
        print(
            f"pre-training: {pre_steps} steps in {pre_s:.1f} s = "
            f"{pre_steps * args.batch / pre_s:,.0f} images/s (loss {losses[-1]:.3f} nats)"
        )
    info["pretrain"] = {"steps": pre_steps, "seconds": pre_s}

    for strategy in args.strategies.split(","):
        model = build_model("densenet_bc_100", 1, 10)
        model.load_state_dict(base.state_dict())
        train(
            model,
            split,
            dataclasses.replace(cfg, steps_per_epoch=args.warmup),
            strategy,
            progress=False,
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # ---- one validation pass alone, to take it out of the fine-tuning time ----
        _sync(device)
        t0 = time.perf_counter()
        predict_logits(model, split.val_id_x, cfg.eval_batch_size, device)
        predict_logits(model, split.val_ood_x, cfg.eval_batch_size, device)
        _sync(device)
        eval_s = time.perf_counter() - t0
        # ---- timed: --steps iterations of Step A + Step B, then the epoch's validation ----
        t0 = time.perf_counter()
        hist = train(
            model,
            split,
            dataclasses.replace(cfg, steps_per_epoch=args.steps),
            strategy,
            progress=False,
        )["history"]
        _sync(device)
        total = time.perf_counter() - t0
        train_s = max(total - eval_s, 1e-9)
        s_id = discrepancy_score(
            *predict_logits(model, split.test_id_x, cfg.eval_batch_size, device)
        )
        s_ood = discrepancy_score(
            *predict_logits(model, split.test_ood_x, cfg.eval_batch_size, device)
        )
        run = {
            "strategy": strategy,
            "seconds": train_s,
            "ms_per_step": 1000 * train_s / args.steps,
            "images_per_s": args.steps * 3 * args.batch / train_s,  # Step A: B images, Step B: 2B
            "eval_seconds": eval_s,
            "val_auroc": hist.val_auroc[-1],
            "test_auroc": ood_metrics(s_id, s_ood)["auroc"],
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else None,
        }
        info["runs"].append(run)
        mem = f" | peak {run['peak_mem_gib']:.2f} GiB" if run["peak_mem_gib"] is not None else ""
        print(
            f"{strategy:>8}: {args.steps} steps in {train_s:.2f} s = "
            f"{run['ms_per_step']:.1f} ms/step, "
            f"{run['images_per_s']:,.0f} images/s (Step A + Step B) | val AUROC "
            f"{100 * run['val_auroc']:.2f}% | test AUROC {100 * run['test_auroc']:.2f}%{mem}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(info, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
