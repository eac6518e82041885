"""An interrupted ``python -m mcd_helpers reproduce`` resumes to exactly the numbers of an
uninterrupted run.

The interruptions are real signals that the run sends itself at a chosen training step: a wrapper
counts the calls of a loss the loop calls once per step (``supervised_loss`` in pre-training,
``mcd_step`` in fine-tuning) and sends the signal on call ``k``. SIGTERM and SIGINT: the step
finishes, a checkpoint is saved, the run exits with 143 or 130. SIGKILL: the process dies at once
and the run resumes from the last periodic checkpoint. Every run has its own fresh cache.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcd_helpers.experiments.cli import main

ROOT = Path(__file__).resolve().parents[1]
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
    "separate",
    "--pretrain-epochs",
    "2",
    "--pretrain-milestones",
    "1",
    "--pretrain-batch-size",
    "64",
    "--finetune-epochs",
    "2",
    "--steps-per-epoch",
    "4",
    "--batch-size-sup",
    "32",
    "--batch-size-unsup",
    "32",
    "--checkpoint-every",
    "3",
    "--eval-batch-size",
    "500",
    "--odin-temperatures",
    "1000",
    "--odin-epsilons",
    "0,0.002",
]
DRIVER = f"""
import signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import mcd_helpers.experiments.loop as train
from signal_on_call import signal_on_call
signal_on_call(train, sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3]))
from mcd_helpers.experiments.cli import main
sys.exit(main(sys.argv[4:]))
"""
METRICS = ("fpr95", "detection_error", "auroc", "aupr_in", "aupr_out", "id_accuracy", "val_auroc")
STAGE = Path("checkpoints") / "mcd-gaussian-separate.pt"


def run_here(out: Path, cache: Path, *extra: str) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MCD_DATA_DIR", str(cache))
        return main(["reproduce", "--out", str(out), *ARGS, *extra])


def interrupted(out: Path, cache: Path, loss: str, k: int, sig: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess that sends itself ``sig`` on the ``k``-th call of
    ``mcd_helpers.experiments.loop.<loss>``."""
    env = {**os.environ, "MCD_DATA_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, loss, str(k), sig, "reproduce", "--out", str(out), *ARGS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def metrics(out: Path) -> list:
    return [[r.get(k) for k in METRICS] for r in json.loads((out / "results.json").read_text())]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    assert run_here(tmp / "out", tmp / "cache") == 0
    return metrics(tmp / "out")


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, k, sig, code, checkpoint",
    [
        ("mcd_step", 5, "SIGTERM", 143, STAGE),  # fine-tuning epoch 2, step 1
        # pre-training epoch 1, step 4
        ("supervised_loss", 4, "SIGINT", 130, Path("checkpoints") / "pretrain.pt"),
    ],
)
def test_a_signal_saves_the_step_exits_128_plus_it_and_resume_gives_the_same_numbers(
    loss, k, sig, code, checkpoint, reference, tmp_path, capsys
):
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = interrupted(out, cache, loss, k, sig)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert (
        f"interrupted: {sig} in " in proc.stderr
        and "Continue with the same command and --resume." in proc.stderr
    )
    assert (out / checkpoint).exists() and json.loads((out / "run.json").read_text())[
        "status"
    ] == "interrupted"
    before = (out / checkpoint).read_bytes()
    assert run_here(out, cache) == 2  # a rerun without --resume deletes nothing and says what to do
    assert (
        "Pass --resume to continue it" in capsys.readouterr().err
        and (out / checkpoint).read_bytes() == before
    )
    assert run_here(out, cache, "--resume") == 0
    assert metrics(out) == reference  # exactly: the same steps on the same CPU and thread count
    assert not (out / checkpoint).exists()


@pytest.mark.slow
def test_sigkill_loses_only_the_steps_after_the_last_periodic_checkpoint(reference, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    # killed in step 4; the periodic checkpoint of step 3 is there
    proc = interrupted(out, cache, "mcd_step", 4, "SIGKILL")
    assert proc.returncode == -signal.SIGKILL
    saved = torch.load(out / STAGE, weights_only=True)
    assert (saved["epoch"], saved["step"]) == (0, 3)  # epoch 1 (from 0), after its third step
    assert run_here(out, cache, "--resume") == 0
    assert metrics(out) == reference


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused_with_the_flag_named(tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    assert interrupted(out, cache, "mcd_step", 2, "SIGTERM").returncode == 143
    assert run_here(out, cache, "--resume", "--margin", "0.8") == 2
    err = capsys.readouterr().err
    assert (
        "--resume: the checkpoint" in err
        and "the settings changed" in err
        and (out / STAGE).exists()
    )
