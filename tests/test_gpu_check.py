"""benchmarks/gpu_check.py on a machine without a GPU: it refuses, saying why, and the commands it
would run are ones the package's command line accepts."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

from mcd_helpers.experiments.cli import build_parser  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_without_a_gpu_it_exits_2_naming_the_check(capsys):
    assert gpu_check.main(["--out", "unused"]) == 2
    out = capsys.readouterr().out
    assert "torch.cuda.is_available() is False" in out and "CUDA build of this torch:" in out


def test_the_commands_it_runs_are_valid_reproduce_commands(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    one = gpu_check.reproduce_command(tmp_path / "one", 1)
    two = gpu_check.reproduce_command(tmp_path / "two", 2)
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for command in (one, two):
        args = command[command.index("mcd_helpers") + 1 :]
        parsed = build_parser(args).parse_args(args)
        assert (parsed.command, parsed.preset, parsed.device) == ("reproduce", "quick", "cuda")
    assert " ".join(one) in capsys.readouterr().out
