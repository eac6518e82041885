"""Faults a user meets (issue 14): bad settings, damaged or missing files, read-only folders, busy output
folders, late failures. Each is caught before any training, with a message that names the flag or the
file and the fix, and nothing already done is lost.

Runs use a stand-in Fashion-MNIST (random IDX files written here, 300 training and 400 test images) in
a fresh $MCD_DATA_DIR, so no test depends on the real data, the network or the suite's cache.
``pipeline.pretrain`` is replaced by a function that fails the test where a check must come first.
"""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mcd_helpers.experiments.run as reproduce
from mcd_helpers.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "quick", "--quiet", "--num-threads", "1", "--n-val", "100", "--ood-sets", "gaussian",
        "--ood-size", "300", "--strategies", "separate", "--pretrain-epochs", "1", "--pretrain-milestones", "1",
        "--pretrain-batch-size", "50", "--finetune-epochs", "1", "--steps-per-epoch", "3", "--batch-size-sup", "32",
        "--batch-size-unsup", "32", "--eval-batch-size", "200"]


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A fresh $MCD_DATA_DIR holding a stand-in Fashion-MNIST (.gz); the fallback cache in tmp_path too."""
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.RandomState(0)
    for split, n in (("train", 300), ("t10k", 400)):
        _write_idx(raw / f"{split}-images-idx3-ubyte.gz", rng.randint(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{split}-labels-idx1-ubyte.gz", rng.randint(0, 10, n))
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback-cache"))
    threads = torch.get_num_threads()
    yield tmp_path / "data"
    torch.set_num_threads(threads)


def _no_training(monkeypatch):
    monkeypatch.setattr("mcd_helpers.experiments.pipeline.pretrain", lambda *a, **k: pytest.fail("training started before the check"))


# ---- finding 7: every setting that can be checked is checked before training, naming the flag ----

@pytest.mark.parametrize("flags, message", [
    (["--split-seed", "-1"], "--split-seed: split_seed must be in [0, 2**32)"),
    (["--n-val", "400"], "--n-val: n_val=400 validation images are taken from the ID test set, which has only 400"),
    (["--n-val", "350", "--ood-size", "350"], "--n-val: n_val=350 validation images are taken from the OOD set gaussian"),
    (["--batch-size-sup", "500"], "--batch-size-sup: batch_size_sup=500 is larger than the 300 labeled"),
    (["--pretrain-batch-size", "301"], "--pretrain-batch-size: pretrain_batch_size=301 is larger than the 300"),
    (["--batch-size-unsup", "501"], "--batch-size-unsup: batch_size_unsup=501 is larger than the 500 unlabeled"),
    (["--ood-size", "100000000000"], "--ood-size: ood_size=100,000,000,000 generated images (gaussian) need about"),
    (["--margin", "1e39"], "--margin: margin must be at most 3.403e+38 nats"),
])
def test_settings_are_checked_before_training_with_the_flag_named(flags, message, data_dir, tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    assert main(["reproduce", "--out", str(tmp_path / "out"), *TINY, *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the error on a machine without an Apple GPU")
def test_an_unavailable_device_is_refused_before_loading_data(tmp_path, monkeypatch, capsys):
    # Finding 8: --device mps was accepted and failed with a raw error on the first tensor moved there.
    monkeypatch.setattr("mcd_helpers.experiments.pipeline.load_id", lambda *a, **k: pytest.fail("data loaded before the device check"))
    assert main(["reproduce", "--out", str(tmp_path / "out"), *TINY, "--device", "mps"]) == 2
    assert "--device: device='mps' but PyTorch sees no Apple-silicon GPU here" in capsys.readouterr().err


def test_an_unavailable_ood_set_is_found_before_training(data_dir, tmp_path, monkeypatch, capsys):
    # Finding 7: --ood-sets gaussian,mnist offline pre-trained, finished gaussian, then exited 2 without results.json.
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise OSError("no network in tests")
    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    _no_training(monkeypatch)
    assert main(["reproduce", "--out", str(tmp_path / "out"), *TINY, "--ood-sets", "gaussian,mnist"]) == 2
    err = capsys.readouterr().err
    assert "MNIST was not found" in err and "offline OOD sets are digits, photo_crops, gaussian, uniform" in err


def test_rows_are_kept_when_a_later_ood_set_fails(data_dir, tmp_path, monkeypatch, capsys):
    # Finding 7: a late failure of one OOD set lost the rows of those finished before it.
    from mcd_helpers.experiments import pipeline
    load_ood = pipeline.load_ood

    def failing(name, *args, **kwargs):
        if name == "uniform":
            raise RuntimeError("simulated failure while loading uniform")
        return load_ood(name, *args, **kwargs)
    monkeypatch.setattr("mcd_helpers.experiments.pipeline.load_ood", failing)
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *TINY, "--ood-sets", "gaussian,uniform"]) == 1
    assert "1 of 2 OOD sets failed: uniform: RuntimeError: simulated failure" in capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())
    assert [(r["ood_dataset"], r["method"]) for r in rows] == [("gaussian", m) for m in ("msp", "odin", "energy", "mcd")]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "partial" and "simulated failure" in run["failures"]["uniform"]
    assert "uniform: RuntimeError: simulated failure" in (out / "results.md").read_text()


# ---- finding 4: provenance; one run per --out ----

def test_config_json_always_describes_the_results(data_dir, tmp_path, monkeypatch):
    # Finding 4: config.json was written at the start, results.json at the end: a failed second run with
    # other settings left a config.json that the results were not made with.
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *TINY]) == 0
    assert json.loads((out / "config.json").read_text())["seed"] == 0

    def diverged(*args, **kwargs):
        from mcd_helpers.training.engine import NonFiniteLossError
        raise NonFiniteLossError("simulated divergence")
    monkeypatch.setattr("mcd_helpers.experiments.pipeline.pretrain", diverged)
    assert main(["reproduce", "--out", str(out), *TINY, "--seed", "7"]) == 1
    config, rows = json.loads((out / "config.json").read_text()), json.loads((out / "results.json").read_text())
    assert config["seed"] == 0 and {r["seed"] for r in rows} == {0}
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and run["config"]["seed"] == 7 and "simulated divergence" in run["error"]


def test_a_second_run_on_a_busy_out_folder_is_refused(data_dir, tmp_path, monkeypatch, capsys):
    from mcd_helpers.training.checkpoint import OutputLock

    _no_training(monkeypatch)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mcd_helpers.training.checkpoint import OutputLock; "
                               "OutputLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)",
                               str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["reproduce", "--out", str(out), *TINY]) == 2
        assert f"another run (pid={holder.pid} " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert OutputLock(out).acquire().stale_pid == holder.pid  # the dead holder's lock is recognised as stale


# ---- finding 5: writability checked before training; a read-only data folder falls back ----

def _read_only(monkeypatch, *folders):
    """Make probe writes in ``folders`` fail with EACCES (as root, chmod would not stop them)."""
    import mcd_helpers.data.files as datafiles

    probe = datafiles._probe

    def refusing(folder):
        if any(Path(folder) == Path(f) or Path(f) in Path(folder).parents for f in folders):
            raise PermissionError(13, "Permission denied", str(folder))
        probe(folder)
    monkeypatch.setattr(datafiles, "_probe", refusing)


def test_a_read_only_out_folder_fails_before_training(data_dir, tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    _read_only(monkeypatch, tmp_path / "out")
    assert main(["reproduce", "--out", str(tmp_path / "out"), *TINY]) == 2
    assert f"--out {tmp_path / 'out'} cannot be written (PermissionError: Permission denied)" in capsys.readouterr().err


def test_a_read_only_data_folder_falls_back_to_a_writable_cache(data_dir, tmp_path, monkeypatch, capsys):
    # Finding 5: a read-only data folder failed after pre-training, with a raw OSError, on every retry.
    _read_only(monkeypatch, data_dir)
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *TINY[:2], *TINY[3:]]) == 0  # not --quiet: the note is printed
    printed = capsys.readouterr().out
    assert f"the data folder {data_dir} is read-only" in printed and str(tmp_path / "fallback-cache") in printed
    assert list((tmp_path / "fallback-cache" / "cache").glob("pretrain-*.pt"))  # the cache went there
    assert not (data_dir / "checkpoints").exists()


def test_no_writable_cache_at_all_fails_before_training(data_dir, tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    _read_only(monkeypatch, data_dir, tmp_path / "fallback-cache")
    assert main(["reproduce", "--out", str(tmp_path / "out"), *TINY]) == 2
    assert "set MCD_CACHE_DIR to a writable folder" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_really_read_only_out_folder(data_dir, tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        assert main(["reproduce", "--out", str(tmp_path / "ro" / "out"), *TINY]) == 2
        assert "cannot be written" in capsys.readouterr().err
    finally:
        (tmp_path / "ro").chmod(0o755)


# ---- finding 8: raw tracebacks replaced by the project's errors ----

def test_out_naming_an_existing_file(data_dir, tmp_path, monkeypatch, capsys):
    _no_training(monkeypatch)
    (tmp_path / "results").write_text("not a folder")
    assert main(["reproduce", "--out", str(tmp_path / "results"), *TINY]) == 2
    assert f"--out {tmp_path / 'results'} is a file, not a folder" in capsys.readouterr().err


def test_a_cached_network_of_another_architecture_says_retrain(data_dir, tmp_path, monkeypatch, capsys):
    from mcd_helpers.training.checkpoint import save_checkpoint
    from mcd_helpers.experiments.config import MCDConfig
    from mcd_helpers.experiments.cache import cache_key
    from mcd_helpers.models import small_cnn
    from mcd_helpers.__main__ import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["reproduce", "--out", "x", *TINY]))
    assert isinstance(cfg, MCDConfig)
    path = data_dir / "cache" / f"pretrain-{cache_key(cfg, 'pretrain')}.pt"
    save_checkpoint(path, {"model": small_cnn(width=8).state_dict()})  # another width under the same name
    out = tmp_path / "out"
    assert main(["reproduce", "--out", str(out), *TINY]) == 1
    err = capsys.readouterr().err
    assert f"the cached pre-trained network {path} does not fit small_cnn" in err and "Pass --retrain" in err
    assert main(["reproduce", "--out", str(out), *TINY, "--retrain"]) == 0
    fitted = small_cnn()
    fitted.load_state_dict(torch.load(path, weights_only=True)["model"])  # replaced by a fitting network


# ---- finding 8: a notebook opened where mcd_helpers cannot be imported ----

def _import_cells():
    import nbformat

    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        cells = [c.source for c in nb.cells if c.cell_type == "code"
                 and any(line.lstrip().startswith(("import mcd_helpers", "from mcd_helpers"))
                         for line in c.source.splitlines())]
        yield pytest.param(cells[0] if cells else None, id=nb_path.stem)


@pytest.mark.parametrize("source", list(_import_cells()))
def test_a_notebook_without_the_package_says_how_to_install_it(source, tmp_path):
    # Finding 8: opened from another working directory without the package installed, a notebook's first
    # import ended in a bare ModuleNotFoundError.
    assert source is not None, "no cell imports mcd_helpers"
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]  # IPython magics
    driver = "import sys\nsys.modules['mcd_helpers'] = None  # not importable, as without the package\n" + "\n".join(lines)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "is not installed in this kernel" in proc.stderr, proc.stderr[-2000:]
