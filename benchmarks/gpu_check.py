"""Check a GPU machine end to end before the paper's runs: one command, a verdict per check, one
JSON report.

    python benchmarks/gpu_check.py --out build/gpu_check        # on the GPU machine: minutes
    python benchmarks/gpu_check.py --device cpu --tiny --presets paper-cifar10-densenet \
        --out build/gpu_check                                  # the test's run (a CPU, seconds)

1. **The machine**: torch and the CUDA version its wheel was built for, cuDNN, NCCL, the driver
   (``nvidia-smi``), each GPU and its memory, and whether float32 convolutions and matrix
   products run in TF32.
2. **One device, end to end**: ``python -m mcd_helpers reproduce --preset quick --device cuda``
   (Fashion-MNIST and the offline OOD sets: no download), checked against the demo's bounds (every
   MCD row at AUROC >= 99% and FPR95 <= 5%).
3. **Two GPUs** (when two or more are visible): the same under ``torchrun --standalone
   --nproc_per_node=2 ... --sync-bn``, DistributedDataParallel over NCCL with SyncBatchNorm, its
   rows compared with the one-GPU run's. Batch sizes are global: each of W processes takes 1/W of
   every batch (docs/gpu.md).
4. **The paper presets' hours**: one pre-training epoch and one fine-tuning epoch of each
   ``paper-*`` preset (``--presets`` names fewer) timed on random CIFAR-shaped images (the time
   of a step does not depend on the pixels), projected to the preset's epochs, OOD sets and
   strategies (evaluation left out).
5. **The paper's data**: whether CIFAR-10/100 and ODIN's OOD folders are on disk.

``--tiny`` shrinks every run to seconds (the numbers then mean nothing; the quality bounds are not
checked); ``--device cpu`` runs the checks a CPU can, each skipped one saying why. The report,
``OUT/gpu_check.json``, holds ``machine``, ``checks`` (name, status: passed / failed / skipped,
detail) and ``hours`` (per paper preset: seconds per pre-training and fine-tuning step, steps, the
projected hours). Exit code 0 when no check failed, 1 when one did, 2 when ``--device cuda`` finds
no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcd_helpers.data import data_present  # noqa: E402
from mcd_helpers.experiments.config import PRESETS, get_preset  # noqa: E402
from mcd_helpers.losses import supervised_loss  # noqa: E402
from mcd_helpers.models import build_model  # noqa: E402
from mcd_helpers.strategies import mcd_step  # noqa: E402

# the demo's bounds (README, quick start): every MCD row of the quick preset
MIN_AUROC, MAX_FPR95 = 0.99, 0.05
# --tiny: reproduce in seconds (the test suite's toy sizes)
TINY_FLAGS = [
    *("--train-subset", "600", "--test-subset", "400", "--n-val", "40", "--ood-size", "200"),
    *("--pretrain-epochs", "1", "--finetune-epochs", "1", "--steps-per-epoch", "2"),
    *("--batch-size-sup", "32", "--batch-size-unsup", "32", "--ood-sets", "gaussian"),
]
PAPER_PRESETS = tuple(name for name in PRESETS if name.startswith("paper-"))
CIFAR_TRAIN = 50_000  # images a CIFAR epoch passes over


def machine() -> dict:
    """What a GPU run depends on, as printable values."""
    info = {
        "torch": torch.__version__,
        "CUDA build of this torch": torch.version.cuda,
        "cuDNN": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "TF32 in float32 convolutions (cudnn.allow_tf32)": torch.backends.cudnn.allow_tf32,
        "TF32 in float32 matrix products (cuda.matmul.allow_tf32)": (
            torch.backends.cuda.matmul.allow_tf32
        ),
        "GPUs visible": torch.cuda.device_count(),
    }
    if torch.cuda.is_available():
        info["NCCL"] = ".".join(map(str, torch.cuda.nccl.version()))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info[f"GPU {i}"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    if smi := shutil.which("nvidia-smi"):
        query = ["--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run([smi, *query], capture_output=True, text=True)
        lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
        info["driver"] = lines[0] if lines else None
    return info


def reproduce_command(out: Path, processes: int, device: str, tiny: bool) -> list[str]:
    """The ``reproduce`` run of check 2 (one process) or 3 (``torchrun``, SyncBatchNorm)."""
    args = ["-m", "mcd_helpers", "reproduce", "--preset", "quick", "--device", device]
    args += ["--out", str(out), *(TINY_FLAGS if tiny else [])]
    if processes == 1:
        return [sys.executable, *args]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [sys.executable, *launch, *args, "--sync-bn"]


def mcd_rows(out: Path) -> dict:
    """``(ood_dataset, strategy) -> row`` of ``out/results.json``'s MCD rows."""
    rows = json.loads((out / "results.json").read_text())
    return {(r["ood_dataset"], r["strategy"]): r for r in rows if r["method"] == "mcd"}


def run_reproduce(name: str, command: list[str], out: Path, bounds: bool) -> dict:
    """Run one ``reproduce`` check; its status and what it showed."""
    print(f"\n{name}: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0:
        return {"name": name, "status": "failed", "detail": "the command exited with an error"}
    if not (rows := mcd_rows(out)):
        return {"name": name, "status": "failed", "detail": "no MCD row in results.json"}
    auroc = min(r["auroc"] for r in rows.values())
    fpr95 = max(r["fpr95"] for r in rows.values())
    detail = f"worst MCD AUROC {100 * auroc:.2f}%, worst FPR95 {100 * fpr95:.2f}%"
    ok = not bounds or (auroc >= MIN_AUROC and fpr95 <= MAX_FPR95)
    return {"name": name, "status": "passed" if ok else "failed", "detail": detail}


def step_seconds(preset: str, device: str, steps: int | None, batch_scale: float) -> dict:
    """Seconds per pre-training step and per fine-tuning iteration (official schedule, the preset's
    strategy) of ``preset``'s network on random CIFAR-shaped images: the mean over one epoch of
    each (``steps=None``: a pass over 50,000 images at the preset's batch sizes) or over ``steps``
    steps, after one warm-up step; batches scaled by ``batch_scale`` (``--tiny``)."""
    cfg = get_preset(preset)
    classes = 100 if cfg.id_dataset == "cifar100" else 10
    model = build_model(cfg.model, 3, classes).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sizes = [max(2, round(b * batch_scale)) for b in (cfg.pretrain_batch_size, cfg.batch_size_sup)]

    def images(n: int) -> torch.Tensor:
        return torch.randn(n, 3, 32, 32, device=device)

    def labels(n: int) -> torch.Tensor:
        return torch.randint(classes, (n,), device=device)

    def pretrain_step():
        loss = supervised_loss(*model(images(sizes[0])), labels(sizes[0]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def finetune_step():
        x, y, xu = images(sizes[1]), labels(sizes[1]), images(sizes[1])
        mcd_step(model, opt, x, y, xu, cfg.strategies[0], cfg.margin, cfg.schedule)

    timed = {}
    for name, step, size in (
        ("pretrain", pretrain_step, sizes[0]),
        ("finetune", finetune_step, sizes[1]),
    ):
        n = steps or CIFAR_TRAIN // size  # one epoch unless told
        step()  # warm-up: cuDNN's algorithm search, the allocator
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timed[name] = (time.perf_counter() - t0) / n
    return timed


def projected_hours(preset: str, seconds: dict) -> dict:
    """The preset's training time from its per-step seconds: every pre-training epoch, and the
    fine-tuning epochs of every OOD set and strategy (one pass over the labeled set each;
    evaluation left out)."""
    cfg = get_preset(preset)
    pre_steps = cfg.pretrain_epochs * (CIFAR_TRAIN // cfg.pretrain_batch_size)
    runs = len(cfg.ood_sets) * len(cfg.strategies)  # one fine-tuning per OOD set and strategy
    ft_steps = runs * cfg.finetune_epochs * (CIFAR_TRAIN // cfg.batch_size_sup)
    total = pre_steps * seconds["pretrain"] + ft_steps * seconds["finetune"]
    return {
        "seconds_per_step": {k: round(v, 4) for k, v in seconds.items()},
        "steps": {"pretrain": pre_steps, "finetune": ft_steps},
        "hours": round(total / 3600, 2),
    }


def data_check() -> dict:
    """Check 5: the paper's data on disk, or where it will come from."""
    missing = [
        id_set
        for id_set in ("cifar10", "cifar100")
        if not data_present(id_set, get_preset(f"paper-{id_set}-densenet").ood_sets)
    ]
    detail = (
        "every data set present"
        if not missing
        else f"{', '.join(missing)} or ODIN's folders missing: a paper preset downloads them on "
        "first use into $MCD_DATA_DIR (mcd_helpers/data.py names each archive and its MD5)"
    )
    return {"name": "paper data", "status": "passed", "detail": detail}


def run_checks(args) -> tuple[list[dict], dict]:
    """Checks 2-5 as the flags say; each skipped one says why."""
    checks = []
    one = reproduce_command(args.out / "one", 1, args.device, args.tiny)
    checks.append(run_reproduce("one device", one, args.out / "one", not args.tiny))
    if args.device.startswith("cuda") and torch.cuda.device_count() >= 2:
        two = reproduce_command(args.out / "two", 2, args.device, args.tiny)
        checks.append(run_reproduce("two GPUs (NCCL, SyncBatchNorm)", two, args.out / "two", False))
        if (
            checks[-1]["status"] == "passed"
            and mcd_rows(args.out / "two").keys() != mcd_rows(args.out / "one").keys()
        ):
            checks[-1] |= {"status": "failed", "detail": "other MCD rows than the one-GPU run's"}
    else:
        why = "needs two or more CUDA devices; this machine has " + str(torch.cuda.device_count())
        checks.append(
            {"name": "two GPUs (NCCL, SyncBatchNorm)", "status": "skipped", "detail": why}
        )
    hours = {}
    for preset in args.presets:
        seconds = step_seconds(preset, args.device, args.steps, 1 / 16 if args.tiny else 1.0)
        hours[preset] = projected_hours(preset, seconds)
    checks.append({"name": "paper presets timed", "status": "passed", "detail": str(hours)})
    checks.append(data_check())
    return checks, hours


def parse_args(argv=None) -> argparse.Namespace:
    """The command line's settings; argparse exits 2 naming a bad flag or value."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/gpu_check"), help="output folder")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes: seconds, numbers meaningless")
    p.add_argument(
        "--steps", type=int, help="timed steps per paper network (default: one epoch of each)"
    )
    p.add_argument(
        "--presets",
        nargs="+",
        choices=PAPER_PRESETS,
        default=list(PAPER_PRESETS),
        metavar="PRESET",
        help=f"the paper presets to time (default: all of {', '.join(PAPER_PRESETS)})",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    info = machine()
    for key, value in info.items():
        print(f"{key}: {value}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "\nno CUDA device is visible (torch.cuda.is_available() is False): run this on the "
            "GPU machine, in the environment `make` sets up there (docs/gpu.md), or pass "
            "--device cpu for the checks a CPU can run."
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    checks, hours = run_checks(args)
    report = {"machine": info, "checks": checks, "hours": hours}
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print()
    for c in checks:
        print(f"{c['name']}: {c['status']} ({c['detail']})")
    failed = any(c["status"] == "failed" for c in checks)
    print(f"report: {args.out / 'gpu_check.json'}; next: docs/gpu.md, section 3")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
