"""The mechanism study's two recalibrated evaluations, redone with shuffled images.

The registered run (``benchmarks/results/mechanism``, commit tag ``mechanism-plan``) took the
images for statistics recalibrated on the unlabeled pool and on the 2 : 1 mixture in the pool's
stored order, ID images first: its ``recalibrated-unlabeled`` batches were pure ID, then pure OOD,
and its ``recalibrated-mixture`` held no OOD image. This script evaluates the same networks again,
MCD only, with the images drawn as ``mcd_helpers.experiments.stages.recalibration_images`` draws
them since the fix (shuffled). It runs against the plan's commit, whose cache keys the study's
networks carry, so nothing is trained:

    git worktree add build/mechanism-plan mechanism-plan
    PYTHONPATH=build/mechanism-plan python benchmarks/mechanism_recalibration.py \\
        --out benchmarks/results/mechanism-recalibration

The output folder is a benchmark run of its own (``results.json``, ``scores/``, ``run.json``): the
MCD rows with running statistics (which must equal the study's, bit for bit: the same networks)
and with the two corrected recalibrations.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from mcd_helpers.experiments import benchmark, stages

RECALIBRATION_IMAGES = 10_000


def recalibration_images(split, source: str = "labeled", seed: int = 0) -> torch.Tensor:
    """``stages.recalibration_images`` as fixed after the run (tests/test_stages.py checks the two
    agree): the labeled images in their random order; the unlabeled pool and the mixture's share of
    it shuffled with ``seed``."""
    if source == "labeled":
        return split.x_sup[:RECALIBRATION_IMAGES]
    g = torch.Generator().manual_seed(seed)
    pool = split.x_unsup[torch.randperm(len(split.x_unsup), generator=g)]
    if source == "unlabeled":
        return pool[:RECALIBRATION_IMAGES]
    n_unsup = min(len(pool), RECALIBRATION_IMAGES // 3, len(split.x_sup) // 2)
    x = torch.cat([split.x_sup[: 2 * n_unsup], pool[:n_unsup]])
    return x[torch.randperm(len(x), generator=g)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--seeds", default="20-29", help="the study's seeds")
    args = p.parse_args(argv)
    stages.recalibration_images = recalibration_images  # the fixed draw
    benchmark.METHODS = ("mcd",)  # the networks' MCD scores only: no baseline, no ODIN search
    name = "mechanism-recalibration"
    benchmark.BENCHMARK_PRESETS[name] = dataclasses.replace(
        benchmark.BENCHMARK_PRESETS["mechanism"],
        recalibrated=("unlabeled", "mixture"),
        about="the mechanism study's networks, MCD only, recalibrated on the shuffled unlabeled "
        "pool and mixture",
    )
    benchmark.run_benchmark(name, args.out, seeds=args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
