"""Check a GPU machine end to end before the paper's runs: one command, a verdict per check.

    python benchmarks/gpu_check.py --out build/gpu_check        # a few minutes on one GPU
    python benchmarks/gpu_check.py --dry-run                    # print what it would run

1. **The machine**: torch and the CUDA version its wheel was built for, the driver
   (``nvidia-smi``), each GPU and its memory, cuDNN, NCCL, and whether float32 convolutions and
   matrix products run in TF32.
2. **One GPU, end to end**: ``python -m mcd_helpers reproduce --preset quick --device cuda``
   (Fashion-MNIST and the offline OOD sets: no download), checked against the demo's bounds
   (every MCD row at AUROC >= 99% and FPR95 <= 5%).
3. **Several GPUs** (two or more visible): the same under ``torchrun --standalone
   --nproc_per_node=2``, which runs DistributedDataParallel over NCCL. Batch sizes are global: each
   of W processes takes 1/W of every batch, so BatchNorm normalises over 1/W of it (the paper's 128
   on 16 GPUs is 8 images per GPU) unless ``--sync-bn`` is on (docs/gpu.md).
4. **The paper's data**: whether CIFAR-10/100 and ODIN's OOD folders are on disk for the
   ``paper-*`` presets, and where to put them.

For the throughput of the paper's network, and from it the hours of a paper preset, run
``benchmarks/cuda_check.py`` next (docs/gpu.md). Exit code 0 when every check passed, 1 when one
failed, 2 when no CUDA device is visible (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcd_helpers.data import data_present  # noqa: E402
from mcd_helpers.experiments.config import get_preset  # noqa: E402

# the demo's bounds (README, quick start): every MCD row of the quick preset
MIN_AUROC, MAX_FPR95 = 0.99, 0.05


def machine() -> dict:
    """What the GPU run depends on, as printable values."""
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
        info["driver"] = done.stdout.strip().splitlines()[0] if done.returncode == 0 else None
    return info


def reproduce_command(out: Path, processes: int) -> list[str]:
    """The ``reproduce`` run of check 2 (one process) or 3 (``torchrun``, ``processes`` GPUs)."""
    args = ["-m", "mcd_helpers", "reproduce", "--preset", "quick", "--device", "cuda"]
    args += ["--out", str(out)]
    if processes == 1:
        return [sys.executable, *args]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    return [sys.executable, *launch, *args]


def within_bounds(out: Path) -> tuple[bool, str]:
    """Whether ``out/results.json``'s MCD rows meet the demo's bounds, and the worst of them."""
    rows = [r for r in json.loads((out / "results.json").read_text()) if r["method"] == "mcd"]
    auroc, fpr95 = min(r["auroc"] for r in rows), max(r["fpr95"] for r in rows)
    said = f"worst MCD AUROC {100 * auroc:.2f}%, worst FPR95 {100 * fpr95:.2f}%"
    return auroc >= MIN_AUROC and fpr95 <= MAX_FPR95, said


def run_check(name: str, command: list[str], out: Path, dry_run: bool) -> bool:
    """Run one ``reproduce`` check and say whether it passed."""
    print(f"\n{name}: {' '.join(command)}", flush=True)
    if dry_run:
        return True
    if subprocess.run(command).returncode != 0:
        print(f"{name}: FAILED (the command exited with an error; its output is above)")
        return False
    ok, said = within_bounds(out)
    print(f"{name}: {'passed' if ok else 'FAILED, outside the demo bounds'} ({said})")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("build/gpu_check"), help="output folder")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    for key, value in machine().items():
        print(f"{key}: {value}")
    if not torch.cuda.is_available() and not args.dry_run:
        print(
            "\nno CUDA device is visible (torch.cuda.is_available() is False): run this on the "
            "GPU machine, in the environment `make` sets up there (docs/gpu.md)."
        )
        return 2
    gpus = torch.cuda.device_count() if not args.dry_run else 2
    results = [
        run_check("one GPU", reproduce_command(args.out / "one", 1), args.out / "one", args.dry_run)
    ]
    if gpus >= 2:
        two = reproduce_command(args.out / "two", 2)
        results.append(run_check("two GPUs (NCCL)", two, args.out / "two", args.dry_run))
    for id_set in ("cifar10", "cifar100"):
        preset = get_preset(f"paper-{id_set}-densenet")
        there = data_present(id_set, preset.ood_sets)
        print(f"\npaper data, {id_set} + ODIN's folders: {'present' if there else 'missing'}")
        if not there:
            print(
                "  a paper preset downloads them on first use into the data folder "
                "($MCD_DATA_DIR; mcd_helpers/data.py names each archive and its MD5); "
                "or copy them there first"
            )
    print("\nevery check passed" if all(results) else "\nat least one check FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
