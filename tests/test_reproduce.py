"""``reproduce`` into an output folder: one run per folder, unfinished work never deleted silently,
run.json telling how a run ended, results written together, a failed OOD set recorded, a shared
fresh cache."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcd_helpers.errors import CheckpointError
from mcd_helpers.experiments.cli import main
from mcd_helpers.experiments.reproduce import results_markdown

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--quiet",
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
    "1",
    "--pretrain-milestones",
    "",
    "--pretrain-batch-size",
    "64",
    "--steps-per-epoch",
    "3",
    "--batch-size-sup",
    "32",
    "--batch-size-unsup",
    "32",
    "--eval-batch-size",
    "500",
    "--odin-temperatures",
    "1000",
    "--odin-epsilons",
    "0,0.002",
    "--num-threads",
    "1",
]
HOLD_LOCK = (
    "import sys, time, filelock; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
    "print('held', flush=True); time.sleep(60)"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty cache for this test (Fashion-MNIST still comes from the Debian package)."""
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def reproduce(out: Path, *extra: str) -> int:
    return main(["reproduce", "--out", str(out), *TINY, *extra])


def run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_a_finished_run_writes_its_three_files_together_and_says_finished(tmp_path, cache):
    out = tmp_path / "out"
    assert reproduce(out) == 0
    rows, cfg = (
        json.loads((out / "results.json").read_text()),
        json.loads((out / "config.json").read_text()),
    )
    assert [(r["method"], r["strategy"]) for r in rows] == [
        ("msp", None),
        ("odin", None),
        ("energy", None),
        ("mcd", "separate"),
    ]
    # config.json describes these results
    assert cfg["train_subset"] == 600 and cfg["ood_sets"] == ["gaussian"]
    md = (out / "results.md").read_text()
    assert f"| fashion_mnist | gaussian | mcd | separate | {100 * rows[3]['fpr95']:.2f} |" in md
    assert run_json(out)["status"] == "finished" and run_json(out)["failures"] == {}
    from mcd_helpers.experiments.config import native_bf16

    # what trained
    assert cfg["amp"] == "auto" and run_json(out)["amp"] == (
        "bf16" if native_bf16("cpu") else "none"
    )
    # stage checkpoints deleted once the stage is in the cache
    assert not list(out.glob("checkpoints/*.pt"))
    assert {p.name for p in out.glob("*.png")} == {"hist_gaussian.png", "roc_gaussian.png"}
    # where it trained: torch and the CPU kernels it ran (AVX2 or AVX-512 ones on a CPU that has
    # AVX2, as /proc/cpuinfo lists it, unless ATEN_CPU_CAPABILITY asks for less)
    import torch

    machine = run_json(out)["machine"]
    assert machine["torch"] == torch.__version__ and machine["threads"] >= 1
    cpuinfo = Path("/proc/cpuinfo")
    if (
        cpuinfo.exists()
        and " avx2 " in cpuinfo.read_text()
        and "ATEN_CPU_CAPABILITY" not in os.environ
    ):
        assert machine["cpu_capability"] in ("AVX2", "AVX512")


def test_run_json_profiles_each_stage(tmp_path, cache, monkeypatch, capsys):
    from mcd_helpers.experiments import evaluation, pipeline

    real = evaluation.tune_odin

    def slow_search(*args, **kwargs):  # a search known to take at least 0.4 s
        time.sleep(0.4)
        return real(*args, **kwargs)

    real_evaluate, evaluated = pipeline.evaluate, []

    def clocked(*args, **kwargs):  # evaluate's wall time, taken from outside
        t0 = time.perf_counter()
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            evaluated.append(time.perf_counter() - t0)

    monkeypatch.setattr(evaluation, "tune_odin", slow_search)
    monkeypatch.setattr(pipeline, "evaluate", clocked)
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *TINY[1:]]) == 0
    seconds = run_json(out)["seconds"]
    stages = seconds["gaussian"]
    assert set(seconds) == {"data", "gaussian", "figures", "total"}
    assert set(stages) == {
        "pre-training",
        "fine-tuning separate",
        "odin search",
        "evaluation",
    }
    # evaluation is evaluate() without the search: the two add up to it
    assert stages["odin search"] >= 0.4
    assert abs(stages["evaluation"] + stages["odin search"] - evaluated[0]) < 0.05
    parts = seconds["data"] + sum(stages.values()) + seconds["figures"]
    rounding = 0.005 * (len(stages) + 3)  # each of the parts and the total is rounded to 0.01 s
    # nothing left out
    assert (
        all(v >= 0 for v in stages.values()) and parts - rounding <= seconds["total"] < parts + 1.0
    )
    assert f'"odin search": {stages["odin search"]}' in capsys.readouterr().out  # and printed


def test_unfinished_work_stops_a_run_without_resume_or_fresh_and_fresh_deletes_it(
    tmp_path, cache, capsys
):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    left = out / "checkpoints" / "pretrain.pt"
    left.write_bytes(b"an unfinished stage")
    (out / "results.md").write_text("an earlier run's results")
    assert reproduce(out) == 2
    err = capsys.readouterr().err
    assert "--resume:" in err and "checkpoints/pretrain.pt" in err and "nothing was deleted." in err
    assert left.read_bytes() == b"an unfinished stage" and (out / "results.md").exists()
    assert reproduce(out, "--fresh") == 0
    assert not left.exists() and "an earlier run" not in (out / "results.md").read_text()


def test_a_second_run_on_a_busy_folder_is_refused_and_a_dead_owners_lock_is_taken_over(
    tmp_path, cache, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert reproduce(out) == 2
        err = capsys.readouterr().err
        assert "--out: another run" in err and "one run at a time per folder" in err
        assert not (out / "run.json").exists()  # nothing of the refused run was written
    finally:
        holder.send_signal(signal.SIGKILL)  # the owner dies: the kernel drops its lock
        holder.wait()
    assert reproduce(out) == 0 and run_json(out)["status"] == "finished"


@pytest.mark.parametrize(
    "error, status, code",
    [
        (CheckpointError("a broken checkpoint"), "failed", 1),
        (KeyboardInterrupt(), "interrupted", 130),
    ],
)
def test_run_json_says_how_a_run_ended(error, status, code, tmp_path, cache, monkeypatch):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr("mcd_helpers.experiments.reproduce.run_ood_set", fail)
    out = tmp_path / "out"
    assert reproduce(out) == code
    assert run_json(out)["status"] == status and run_json(out)["pid"] == os.getpid()
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("error", [OSError, RuntimeError])
def test_rows_are_kept_when_a_later_ood_set_fails(error, tmp_path, cache, monkeypatch, capsys):
    import mcd_helpers.experiments.reproduce as run

    real, calls = run.run_ood_set, []

    def second_fails(cfg, split, ood, **kwargs):
        calls.append(ood)
        if ood == "uniform":
            raise error("the disk went away while uniform trained")
        return real(cfg, split, ood, **kwargs)

    monkeypatch.setattr(run, "run_ood_set", second_fails)
    out = tmp_path / "out"
    assert reproduce(out, "--ood-sets", "gaussian,uniform") == 1
    assert calls == ["gaussian", "uniform"]
    assert {r["ood_dataset"] for r in json.loads((out / "results.json").read_text())} == {
        "gaussian"
    }
    assert run_json(out)["status"] == "partial" and "uniform" in run_json(out)["failures"]
    assert "**Failed OOD sets**" in (out / "results.md").read_text()
    assert (
        f"1 of 2 OOD sets failed: uniform: {error.__name__}: the disk went away"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "error", [CheckpointError("the cached network does not fit"), FloatingPointError("diverged")]
)
def test_an_error_the_run_cannot_go_on_from_stops_every_ood_set(
    error, tmp_path, cache, monkeypatch, capsys
):
    calls = []

    def first_fails(cfg, split, ood, **kwargs):
        calls.append(ood)
        raise error

    monkeypatch.setattr("mcd_helpers.experiments.reproduce.run_ood_set", first_fails)
    out = tmp_path / "out"
    assert reproduce(out, "--ood-sets", "gaussian,uniform") == 1
    # not recorded as one OOD set's failure
    assert calls == ["gaussian"] and not (out / "results.json").exists()
    assert run_json(out)["status"] == "failed" and str(error) in run_json(out)["error"]
    assert f"error: {error}" in capsys.readouterr().err


def test_a_failure_while_preparing_the_folder_frees_it_for_the_next_run(
    tmp_path, cache, monkeypatch, capsys
):
    import mcd_helpers.experiments.files as files

    def full_disk(path, obj):
        raise OSError(28, f"no space left on the device while writing {path}")

    real = files.write_json
    monkeypatch.setattr(files, "write_json", full_disk)  # the first write: run.json, "running"
    out = tmp_path / "out"
    assert reproduce(out) == 1
    assert "no space left on the device while writing" in capsys.readouterr().err
    monkeypatch.setattr(files, "write_json", real)
    assert reproduce(out) == 0  # the lock was released: not "another run is using --out"
    assert run_json(out)["status"] == "finished"


@pytest.mark.parametrize("how", ["a file", "read-only"])
def test_an_out_folder_that_cannot_be_written_fails_before_training(
    how, tmp_path, cache, monkeypatch, capsys
):
    monkeypatch.setattr(
        "mcd_helpers.experiments.stages.load_id",
        lambda *a, **k: pytest.fail("data loaded before the check"),
    )
    out = tmp_path / "out"
    if how == "a file":
        out.write_text("not a folder")
    else:
        monkeypatch.setattr(
            "mcd_helpers.experiments.files.writable", lambda folder: Path(folder) != out
        )
    assert reproduce(out) == 2
    assert (
        f"--out: {out} is {'a file' if how == 'a file' else 'not writable'}"
        in capsys.readouterr().err
    )


def test_a_read_only_data_folder_sends_the_caches_to_the_fallback(
    tmp_path, cache, monkeypatch, capsys
):
    fallback = tmp_path / "fallback"
    monkeypatch.setenv("MCD_CACHE_DIR", str(fallback))
    monkeypatch.setattr("mcd_helpers.data.writable", lambda folder: Path(folder) != cache)
    assert (
        main(["reproduce", "--out", str(tmp_path / "out"), *[f for f in TINY if f != "--quiet"]])
        == 0
    )
    assert f"{cache} is read-only" in capsys.readouterr().out
    # pretrain, finetune
    assert len(list((fallback / "cache").glob("*.pt"))) == 2 and not (cache / "cache").exists()


@pytest.mark.slow
def test_two_runs_sharing_a_fresh_cache_at_once_finish_alike(tmp_path):
    env = {**os.environ, "MCD_DATA_DIR": str(tmp_path / "shared"), "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mcd_helpers",
                "reproduce",
                "--out",
                str(tmp_path / f"out{i}"),
                *TINY,
            ],
            env=env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    codes = [r.wait(timeout=600) for r in runs]
    assert codes == [0, 0], [r.stderr.read()[-2000:] for r in runs]
    a, b = (json.loads((tmp_path / f"out{i}" / "results.json").read_text()) for i in range(2))
    keys = ("fpr95", "detection_error", "auroc", "aupr_in", "aupr_out", "id_accuracy")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert not [
        p
        for p in (tmp_path / "shared").rglob("*")
        if p.name.endswith(".tmp") or ".partial-" in p.name
    ]


def metrics(fpr95, det, auroc, aupr_in, aupr_out, acc):
    return dict(
        fpr95=fpr95,
        detection_error=det,
        auroc=auroc,
        aupr_in=aupr_in,
        aupr_out=aupr_out,
        id_accuracy=acc,
    )


def test_results_markdown():
    rows = [
        {
            "id_dataset": "fashion_mnist",
            "class_split": "b",
            "ood_dataset": "heldout",
            "method": "mcd",
            "strategy": "separate",
            **metrics(0.1234, 0.05, 0.98765, 0.9, 0.875, 0.91),
        },
        {
            "id_dataset": "cifar10",
            "ood_dataset": "LSUN",
            "method": "msp",
            "strategy": None,
            **metrics(0.5, 0.25, 0.8, 0.7, 0.6, 0.95),
        },
    ]
    text = results_markdown(rows)
    assert text.splitlines()[:4] == [
        "| ID | OOD | method | strategy | FPR95 | det. error | AUROC | AUPR-In | AUPR-Out "
        "| ID acc. |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        "| fashion_mnist b | heldout | mcd | separate | 12.34 | 5.00 | 98.77 | 90.00 | "
        "87.50 | 91.00 |",
        "| cifar10 | LSUN | msp | - | 50.00 | 25.00 | 80.00 | 70.00 | 60.00 | 95.00 |",
    ]
    assert "All numbers in %" in text and "Failed" not in text
    failed = results_markdown(rows, {"mnist": "DataNotFoundError: MNIST was not found"})
    assert failed.endswith(
        "**Failed OOD sets** (no rows):\n\n- mnist: DataNotFoundError: MNIST was not found\n"
    )
