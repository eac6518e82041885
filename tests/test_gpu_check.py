"""benchmarks/gpu_check.py: on a machine without a GPU it refuses cuda, saying why; with
``--device cpu --tiny`` it runs every check a CPU can and writes its report; its commands are ones
the package's command line accepts."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

from mcd_helpers.experiments.cli import build_parser  # noqa: E402
from mcd_helpers.experiments.config import PRESETS, get_preset  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_without_a_gpu_it_exits_2_naming_the_check(capsys):
    assert gpu_check.main(["--out", "unused"]) == 2
    out = capsys.readouterr().out
    assert "torch.cuda.is_available() is False" in out and "--device cpu" in out


def test_its_commands_are_valid_reproduce_commands(tmp_path):
    one = gpu_check.reproduce_command(tmp_path / "one", 1, "cuda", tiny=False)
    two = gpu_check.reproduce_command(tmp_path / "two", 2, "cuda", tiny=True)
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for command in (one, two):
        args = command[command.index("mcd_helpers") + 1 :]
        parsed = build_parser(args).parse_args(args)
        assert (parsed.command, parsed.preset, parsed.device) == ("reproduce", "quick", "cuda")
    assert "--sync-bn" in two and "--sync-bn" not in one


def test_every_paper_preset_is_timed_unless_fewer_are_named(capsys):
    assert gpu_check.parse_args([]).presets == [n for n in PRESETS if n.startswith("paper-")]
    assert gpu_check.parse_args(["--presets", "paper-cifar10-wrn"]).presets == ["paper-cifar10-wrn"]
    with pytest.raises(SystemExit) as err:
        gpu_check.parse_args(["--presets", "quick"])
    assert err.value.code == 2 and "'quick'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_cpu_run_writes_the_report_with_each_skip_explained(tmp_path):
    # one paper preset keeps the run short (the WRN presets take 20 s each on a CPU)
    argv = ["--device", "cpu", "--tiny", "--steps", "1", "--out", str(tmp_path)]
    argv += ["--presets", "paper-cifar10-densenet"]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report) == {"machine", "checks", "hours"} and "torch" in report["machine"]
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status["one device"] == "passed"
    assert status["two GPUs (NCCL, SyncBatchNorm)"] == "skipped"
    two = next(c for c in report["checks"] if c["name"].startswith("two GPUs"))
    assert "needs two or more CUDA devices" in two["detail"]
    assert set(report["hours"]) == {"paper-cifar10-densenet"}
    # the projection by hand: 300 epochs of 50,000 // 128 steps; 10 such epochs per OOD set and
    # strategy
    cfg = get_preset("paper-cifar10-densenet")
    dense = report["hours"]["paper-cifar10-densenet"]
    runs = len(cfg.ood_sets) * len(cfg.strategies)
    assert dense["steps"] == {"pretrain": 300 * 390, "finetune": runs * 10 * 390}
    s = dense["seconds_per_step"]
    want = (300 * 390 * s["pretrain"] + runs * 10 * 390 * s["finetune"]) / 3600
    assert dense["hours"] == pytest.approx(want, abs=0.01) and dense["hours"] > 0
