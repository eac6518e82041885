"""ID accuracy and MSP's AUROC against pre-training length on the primary setting (part 1 of
``benchmarks/pretrain-length-plan.md``)::

    python benchmarks/pretrain_length.py --seeds 0-2 --out benchmarks/results/pretrain-length

For each seed and length E (epochs), the primary preset's network pre-trained for E epochs with the
learning rate divided by 10 at E / 2 (from the cache when it is there), then F1's accuracy on the ID
test images and MSP's AUROC of the held-out classes against them. Writes ``curve.json`` (one row
per seed and length, the plan's commit, the machine) and prints a table of the means.
"""

import argparse
import dataclasses
import json
import subprocess
import time
from pathlib import Path

from mcd_helpers.experiments.benchmark import BENCHMARK_PRESETS
from mcd_helpers.experiments.files import atomic_write, machine
from mcd_helpers.experiments.stages import RunOptions, load_data, make_split, pretrained
from mcd_helpers.losses import msp_score
from mcd_helpers.metrics import ood_metrics
from mcd_helpers.models import predict_logits
from mcd_helpers.splits import HELD_OUT

LENGTHS = (2, 5, 10, 15)
PLAN = "benchmarks/pretrain-length-plan.md"


def measure(data, seed: int, epochs: int) -> dict:
    """One pre-trained network of the primary setting on ``data`` (its ID images, the same for every
    seed and length): ID accuracy and MSP's AUROC, fractions."""
    cfg = dataclasses.replace(
        BENCHMARK_PRESETS["primary"].config,
        class_split="a",
        protocol="disjoint",
        seed=seed,
        pretrain_epochs=epochs,
        pretrain_milestones=(epochs // 2,),
    )
    split = make_split(cfg, data, HELD_OUT)
    t0 = time.perf_counter()
    net = pretrained(cfg, split, RunOptions(progress=False))
    seconds = time.perf_counter() - t0
    l1_id, _ = predict_logits(net, split.test_id_x)
    l1_ood, _ = predict_logits(net, split.test_ood_x)
    accuracy = float((l1_id.argmax(1) == split.test_id_y).float().mean())
    auroc = ood_metrics(msp_score(l1_id), msp_score(l1_ood))["auroc"]
    return {
        "seed": seed,
        "epochs": epochs,
        "id_accuracy": accuracy,
        "msp_auroc": auroc,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-2", help="a range A-B (default 0-2)")
    parser.add_argument("--out", type=Path, default=Path("build/pretrain-length"))
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
        parser.error(f"--seeds must be a range A-B with A <= B, e.g. 0-2; got {args.seeds!r}")
    first, last = int(first), int(last)
    plan = subprocess.run(
        ["git", "log", "-1", "--format=%H", "--", PLAN], capture_output=True, text=True
    ).stdout.strip()
    data = load_data(BENCHMARK_PRESETS["primary"].config)  # loaded once: no field here changes it
    rows = []
    for seed in range(first, last + 1):
        for epochs in LENGTHS:
            rows.append(measure(data, seed, epochs))
            r = rows[-1]
            print(
                f"seed {seed} E {epochs:>2}: ID accuracy {100 * r['id_accuracy']:.2f}%, "
                f"MSP AUROC {100 * r['msp_auroc']:.2f}%, {r['seconds']} s",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"plan_commit": plan, "machine": machine(), "rows": rows}
    atomic_write(args.out / "curve.json", json.dumps(report, indent=1) + "\n")
    print("\n| epochs | ID accuracy, mean | MSP AUROC, mean |\n|---:|---:|---:|")
    for epochs in LENGTHS:
        mine = [r for r in rows if r["epochs"] == epochs]
        acc = 100 * sum(r["id_accuracy"] for r in mine) / len(mine)
        auroc = 100 * sum(r["msp_auroc"] for r in mine) / len(mine)
        print(f"| {epochs} | {acc:.2f}% | {auroc:.2f}% |")


if __name__ == "__main__":
    main()
