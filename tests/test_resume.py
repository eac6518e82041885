"""Interrupted runs of ``python -m mcd_helpers reproduce`` resume to the numbers of an uninterrupted run.

Runs use tiny settings (``ARGS``). An interrupted run is a subprocess; the interruptions are
real signals that the process sends itself at a chosen training step: a wrapper counts the calls
of a function of ``mcd_helpers.training.loop`` (``supervised_loss`` in pre-training, ``step_b_loss`` in
fine-tuning) and sends the signal on call ``k``, so the test knows which step was cut. SIGTERM:
the step finishes, a checkpoint is saved and the process exits with 143. SIGKILL: the process
dies at once and the run resumes from the last periodic checkpoint. Uninterrupted and resumed
runs call the CLI's ``main`` in this process (importing torch in a subprocess costs seconds).
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcd_helpers.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "quick", "--quiet", "--num-threads", "1",
        "--train-subset", "1000", "--test-subset", "1200", "--n-val", "200",
        "--ood-sets", "gaussian", "--ood-size", "1500", "--strategies", "separate",
        "--pretrain-epochs", "2", "--pretrain-milestones", "1", "--pretrain-batch-size", "64",
        "--finetune-epochs", "2", "--steps-per-epoch", "8", "--batch-size-sup", "32",
        "--batch-size-unsup", "32", "--checkpoint-every", "3"]
PRETRAIN_STEPS = 1000 // 64  # per epoch: 15
FINETUNE_STEPS = 8  # per epoch
STAGE = Path("checkpoints") / "mcd-gaussian-separate"

# Runs the CLI after wrapping mcd_helpers.training.loop.<name> so that its k-th call sends <signal> first.
DRIVER = f"""
import signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import mcd_helpers.training.loop as train
from signal_on_call import signal_on_call
signal_on_call(train, sys.argv[1], int(sys.argv[2]), getattr(signal, sys.argv[3]))
from mcd_helpers.__main__ import main
sys.exit(main(sys.argv[4:]))
"""
METRICS = ("fpr95", "detection_error", "auroc", "aupr_in", "aupr_out", "id_accuracy", "val_auroc")


@pytest.fixture(scope="module")
def fmnist_dir(tmp_path_factory):
    """A folder holding Fashion-MNIST's raw files (linked from $MCD_DATA_DIR, or unpacked once)."""
    root = tmp_path_factory.mktemp("fmnist")
    given = os.environ.get("MCD_DATA_DIR")
    if given and (Path(given) / "FashionMNIST" / "raw").is_dir():
        (root / "FashionMNIST").symlink_to(Path(given) / "FashionMNIST")
    else:
        subprocess.run([sys.executable, "-c", "from mcd_helpers.data.sets import load_fashion_mnist as f; f(True)"],
                       env=_env(root), cwd=ROOT, check=True)
    return root


def _env(data_dir: Path) -> dict:
    return {**os.environ, "MCD_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT)}


def _cache(tmp_path: Path, fmnist_dir: Path) -> Path:
    """A fresh cache root (no pre-trained network) that sees Fashion-MNIST."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "FashionMNIST").symlink_to(fmnist_dir / "FashionMNIST")
    return cache


def _interrupted(out: Path, cache: Path, name: str, k: int, sig: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess that sends itself ``sig`` on the ``k``-th call of ``train.<name>``."""
    for done in (cache / "cache").glob("finetune-*.pt"):  # the reference run's fine-tunings: train them again
        done.unlink()
    cmd = [sys.executable, "-c", DRIVER, name, str(k), sig, "reproduce", "--out", str(out), *ARGS]
    return subprocess.run(cmd, env=_env(cache), cwd=ROOT, capture_output=True, text=True, timeout=600)


def _run(out: Path, cache: Path, *extra: str) -> int:
    """The CLI's ``main`` in this process with ``MCD_DATA_DIR=cache``; returns its exit code."""
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MCD_DATA_DIR", str(cache))
            return main(["reproduce", "--out", str(out), *ARGS, *extra])
    finally:
        torch.set_num_threads(threads)


def _metrics(out: Path) -> list[dict]:
    rows = json.loads((out / "results.json").read_text())
    return [{k: r.get(k) for k in ("ood_dataset", "method", "strategy", *METRICS)} for r in rows]


def _assert_same(got: list[dict], want: list[dict]) -> None:
    assert [(r["ood_dataset"], r["method"], r["strategy"]) for r in got] == \
        [(r["ood_dataset"], r["method"], r["strategy"]) for r in want]
    for g, w in zip(got, want):
        for k in METRICS:
            if w[k] is not None:
                assert g[k] == pytest.approx(w[k], abs=1e-6), (g["method"], k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, fmnist_dir):
    """An uninterrupted run; its cache (with the pre-trained network) is reused by other tests."""
    tmp = tmp_path_factory.mktemp("reference")
    cache = _cache(tmp, fmnist_dir)
    assert _run(tmp / "out", cache) == 0
    return {"metrics": _metrics(tmp / "out"), "cache": cache}


def test_two_uninterrupted_runs_give_identical_metrics(reference, tmp_path, fmnist_dir):
    # A fresh cache: pre-training runs again too.
    assert _run(tmp_path / "out", _cache(tmp_path, fmnist_dir)) == 0
    got = _metrics(tmp_path / "out")
    assert got == reference["metrics"]  # exactly equal, not just to 1e-6
    assert not (tmp_path / "out" / STAGE).exists()  # rolling checkpoints cleared after the stage


def test_sigterm_mid_finetuning_saves_exits_143_and_resumes_exactly(reference, tmp_path):
    out = tmp_path / "out"
    # step_b_loss call 11 = epoch 2, step 3: the best weights of epoch 1 must survive too.
    proc = _interrupted(out, reference["cache"], "step_b_loss", 11, "SIGTERM")
    assert proc.returncode == 143, proc.stderr
    assert "--resume" in proc.stderr
    state = torch.load(out / STAGE / "last.pt", weights_only=False)
    assert (state["epoch"], state["step"]) == (1, 3)  # saved right after the step in progress
    assert len(state["history"]["ce"]) == FINETUNE_STEPS + 3 and state["best_model"] is not None
    assert not (out / "results.json").exists()
    assert _run(out, reference["cache"], "--resume") == 0
    _assert_same(_metrics(out), reference["metrics"])


def test_sigkill_mid_pretraining_resumes_exactly(reference, tmp_path, fmnist_dir):
    out, cache = tmp_path / "out", _cache(tmp_path, fmnist_dir)
    # supervised_loss call 21 = pre-training epoch 2, step 6 (after the lr decay at epoch 1).
    proc = _interrupted(out, cache, "supervised_loss", PRETRAIN_STEPS + 6, "SIGKILL")
    assert proc.returncode == -signal.SIGKILL
    state = torch.load(out / "checkpoints" / "pretrain" / "last.pt", weights_only=False)
    # Periodic checkpoints every 3 steps: the last one before the kill is after global step 18.
    assert (state["epoch"], state["step"]) == (1, 3)
    assert state["scheduler"]["last_epoch"] == 1
    assert not list(cache.glob("checkpoints/pretrain-*.pt"))  # nothing cached before pre-training ends
    assert _run(out, cache, "--resume") == 0
    _assert_same(_metrics(out), reference["metrics"])


def test_checkpoint_cut_short_is_reported_and_the_previous_one_used(reference, tmp_path):
    out = tmp_path / "out"
    # SIGKILL before fine-tuning step 7: checkpoints after steps 3 (last.prev.pt) and 6 (last.pt).
    proc = _interrupted(out, reference["cache"], "step_b_loss", 7, "SIGKILL")
    assert proc.returncode == -signal.SIGKILL
    last = out / STAGE / "last.pt"
    assert torch.load(last, weights_only=False)["step"] == 6
    assert torch.load(out / STAGE / "last.prev.pt", weights_only=False)["step"] == 3
    data = last.read_bytes()
    last.write_bytes(data[:len(data) // 2])  # a checkpoint cut short on disk
    with pytest.warns(UserWarning, match=r"last\.pt cannot be read .*/last\.prev\.pt instead"):
        assert _run(out, reference["cache"], "--resume") == 0
    assert (out / STAGE).exists() is False  # stage finished: its checkpoints (and the broken file) cleared
    _assert_same(_metrics(out), reference["metrics"])


def test_sigint_mid_finetuning_saves_exits_130_and_resumes_exactly(reference, tmp_path):
    # Finding 2: Ctrl-C printed a traceback, saved nothing at that moment and gave no resume hint.
    out = tmp_path / "out"
    proc = _interrupted(out, reference["cache"], "step_b_loss", 11, "SIGINT")  # epoch 2, step 3
    assert proc.returncode == 130, proc.stderr
    assert "SIGINT in fine-tuning (separate) 2/2 step 3/8" in proc.stderr and "--resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    state = torch.load(out / STAGE / "last.pt", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 3)  # saved right after the step in progress
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert not (out / "results.json").exists()
    assert _run(out, reference["cache"], "--resume") == 0
    _assert_same(_metrics(out), reference["metrics"])
    assert _metrics(out) == reference["metrics"]  # exactly equal


def test_a_rerun_without_resume_keeps_the_checkpoints_and_says_what_to_do(reference, tmp_path, capsys):
    # Finding 2: the same command without --resume deleted the checkpoints without a word.
    out = tmp_path / "out"
    proc = _interrupted(out, reference["cache"], "step_b_loss", 11, "SIGTERM")
    assert proc.returncode == 143, proc.stderr
    before = (out / STAGE / "last.pt").read_bytes()
    assert _run(out, reference["cache"]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds checkpoints of an unfinished run" in err and "--resume" in err and "--fresh" in err
    assert (out / STAGE / "last.pt").read_bytes() == before  # nothing deleted
    # --fresh deletes them and starts over: the numbers of an uninterrupted run.
    assert _run(out, reference["cache"], "--fresh") == 0
    assert _metrics(out) == reference["metrics"]
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
