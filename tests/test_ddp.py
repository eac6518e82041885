"""DDP through ``torchrun`` on 2 CPU ranks: the training loop equals one process where that is exact
(float64, no BatchNorm), BatchNorm buffers are averaged, scores gathered, errors and stops agreed
over the ranks; and the command line interrupted by SIGTERM to the launcher resumes to an
uninterrupted 2-rank run's numbers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ddp_setup import engine_split, tiny_model

from mcd_helpers.experiments.loop import train

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
ARGS = [
    "--quiet",
    "--num-threads",
    "1",
    "--train-subset",
    "600",
    "--test-subset",
    "400",
    "--n-val",
    "40",
    "--ood-size",
    "200",
    "--ood-sets",
    "gaussian",
    "--strategies",
    "separate,concat",
    "--pretrain-epochs",
    "1",
    "--pretrain-milestones=",
    "--pretrain-batch-size",
    "64",
    "--finetune-epochs",
    "2",
    "--steps-per-epoch",
    "8",
    "--batch-size-sup",
    "32",
    "--batch-size-unsup",
    "32",
    "--checkpoint-every",
    "1",
    "--eval-batch-size",
    "500",
    "--odin-temperatures",
    "1000",
    "--odin-epsilons",
    "0,0.002",
]
METRICS = ("fpr95", "detection_error", "auroc", "aupr_in", "aupr_out", "id_accuracy", "val_auroc")


def env(cache: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MCD_DATA_DIR": str(cache)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = subprocess.run(
        [*TORCHRUN, str(ROOT / "tests" / "ddp_script.py"), str(out)],
        env=env(out / "cache"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("strategy", ["separate", "concat"])
def test_the_loop_on_two_ranks_equals_one_process_without_batchnorm(ranks, strategy):
    split, cfg = engine_split()
    net = tiny_model("none")
    # one process, the whole batches
    hist = train(net, split, cfg, strategy, progress=False)["history"]
    # the replicas are identical
    assert ranks[0][strategy]["params"] == ranks[1][strategy]["params"]
    gap = max(
        max(abs(a - b) for a, b in zip(ranks[0][strategy]["params"][k], v.reshape(-1).tolist()))
        for k, v in net.state_dict().items()
    )
    assert gap < 1e-10 and ranks[0][strategy]["val_auroc"] == pytest.approx(
        hist.val_auroc, abs=1e-12
    )
    assert len(ranks[0][strategy]["ce"]) == len(hist.ce) == 12  # 2 epochs of 48 / 8 steps


def test_buffers_are_averaged_and_the_first_batchnorm_equals_one_process(ranks):
    for rank, r in enumerate(ranks):
        # mean of 1 and 2; ints untouched
        assert r["average"] == {"running_mean": [1.5] * 4, "tracked": 7 + rank}
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    one = tiny_model("batch").train()
    with torch.no_grad():
        one(x)  # one process forwards the global batch
    # the mean of the ranks' shard means is the global mean: exact for the first layer
    for r in ranks:
        assert (
            max(abs(a - b) for a, b in zip(r["first_bn_mean"], one.G[1].running_mean.tolist()))
            < 1e-15
        )


def test_gather_stop_and_errors_are_agreed_over_the_ranks(ranks):
    x = torch.arange(15.0).view(5, 3)
    for r in ranks:
        assert r["gather"] == [(x * 2).tolist(), x.sum(1).tolist()]  # fn(x) of the whole, in order
        assert r["reduce_max"] == 13  # max(0 * 10 + 3, 1 * 10 + 3)
        assert r["rank0_first"] == ["n_val", "rank 0 found a setting that cannot work"]
        # rank 1's signal stops rank 0 too
        assert r["stop"]["signal"] == signal.SIGTERM and r["stop"]["steps"] == 3
        assert "SIGTERM in fine-tuning (separate) 1/2 step 3/6" in r["stop"]["message"]
    assert ranks[0]["saved"] == [0, 3]  # rank 0 saved the agreed step


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_after_one_step_and_resume_matches(tmp_path):
    cut, full, cache = tmp_path / "cut", tmp_path / "full", tmp_path / "cache"
    launcher = subprocess.Popen(
        [*TORCHRUN, "-m", "mcd_helpers", "reproduce", "--out", str(cut), *ARGS],
        env=env(cache),
        stderr=subprocess.PIPE,
        text=True,
    )
    stage = cut / "checkpoints" / "mcd-gaussian-separate.pt"
    for _ in range(1200):  # fine-tuning has begun once its first checkpoint is there
        if stage.exists() or launcher.poll() is not None:
            break
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    err = launcher.communicate(timeout=120)[1]
    # torchrun forwards SIGTERM to the ranks, which stop after the same step and exit 143; torchrun
    # itself then re-raises the signal as SignalException and exits 1 (torch 2.14.1,
    # torch/distributed/launcher/api.py)
    assert launcher.returncode != 0
    stops = [
        line.split("interrupted: ")[1]
        for line in err.splitlines()
        if "interrupted: SIGTERM in fine-tuning" in line
    ]
    assert len(stops) == 2 and stops[0] == stops[1], err[-3000:]
    run = json.loads((cut / "run.json").read_text())
    assert (
        run["status"] == "interrupted"
        and "SIGTERM in fine-tuning" in run["error"]
        and stage.exists()
    )
    resumed = subprocess.run(
        [*TORCHRUN, "-m", "mcd_helpers", "reproduce", "--out", str(cut), *ARGS, "--resume"],
        env=env(cache),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fresh = subprocess.run(
        [*TORCHRUN, "-m", "mcd_helpers", "reproduce", "--out", str(full), *ARGS],
        env=env(tmp_path / "c2"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    rows = json.loads((cut / "results.json").read_text())
    assert [[r.get(k) for k in METRICS] for r in rows] == [
        [r.get(k) for k in METRICS] for r in json.loads((full / "results.json").read_text())
    ]
    # each row once
    assert [(r["method"], r["strategy"]) for r in rows] == [
        ("msp", None),
        ("odin", None),
        ("energy", None),
        ("mcd", "separate"),
        ("mcd", "concat"),
    ]
    assert {r["world_size"] for r in rows} == {2}


def test_the_benchmark_under_torchrun_refuses_at_once_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *TORCHRUN,
            "-m",
            "mcd_helpers",
            "benchmark",
            "--preset",
            "near-ood-tiny",
            "--out",
            str(out),
        ],
        env=env(tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "benchmark runs in one process" in proc.stderr
    assert "WORLD_SIZE=2" in proc.stderr and "--seeds 0-9" in proc.stderr
    assert not out.exists() and not (tmp_path / "cache").exists()  # no data loaded, no folder made
