"""Atomic writes, the rolling pair of checkpoints (last.pt / last.prev.pt) and RNG states."""
import json
import random

import numpy as np
import pytest
import torch

import errno
import os
import subprocess
import sys

import mcd_helpers.training.checkpoint as checkpoint
from mcd_helpers.training.checkpoint import (CorruptCheckpointError, RollingCheckpoint, atomic_write_json,
                                    load_checkpoint, rng_state, save_checkpoint, set_rng_state)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_json_refuses_nan_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "results.json"
    atomic_write_json(path, {"auroc": 0.5})
    with pytest.raises(ValueError):
        atomic_write_json(path, {"auroc": float("nan")})
    assert json.loads(path.read_text()) == {"auroc": 0.5}
    assert _leftovers(tmp_path) == []


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"step": 1})
    with pytest.raises(TypeError, match=r"state\['bad'\] is a function; a checkpoint holds only tensors"):
        save_checkpoint(path, {"step": 2, "bad": lambda: None})  # not loadable with weights_only=True
    assert load_checkpoint(path)["step"] == 1
    assert _leftovers(tmp_path) == []


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")
    save_checkpoint(tmp_path / "c.pt", {"model": 1})
    with pytest.raises(CorruptCheckpointError, match=r"lacks \['optimizer'\]"):
        load_checkpoint(tmp_path / "c.pt", required=("model", "optimizer"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CorruptCheckpointError, match="junk.pt cannot be read"):
        load_checkpoint(tmp_path / "junk.pt")


def test_rolling_checkpoint_keeps_the_last_two(tmp_path):
    ckpt = RollingCheckpoint(tmp_path / "stage")
    assert ckpt.load() is None  # nothing saved yet
    for step in (1, 2, 3):
        ckpt.save({"step": step, "w": torch.full((3,), float(step))})
    assert load_checkpoint(ckpt.last)["step"] == 3
    assert load_checkpoint(ckpt.prev)["step"] == 2
    state = ckpt.load(required=("step",))
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((3,), 3.0))
    ckpt.clear()
    assert not (tmp_path / "stage").exists()


def test_rolling_checkpoint_cut_short_falls_back_to_the_previous_one(tmp_path):
    ckpt = RollingCheckpoint(tmp_path / "stage")
    ckpt.save({"step": 10})
    ckpt.save({"step": 20})
    data = ckpt.last.read_bytes()
    ckpt.last.write_bytes(data[:len(data) // 3])  # cut short on disk
    with pytest.warns(UserWarning, match=r"last\.pt cannot be read .*cut short.*last\.prev\.pt instead"):
        state = ckpt.load()
    assert state["step"] == 10
    assert ckpt.broken.exists() and not ckpt.last.exists()  # the broken file is set aside
    # The next save must not rotate the broken file in: the good step-10 checkpoint stays as prev.
    ckpt.save({"step": 11})
    assert load_checkpoint(ckpt.prev)["step"] == 10 and load_checkpoint(ckpt.last)["step"] == 11


def test_rolling_checkpoint_all_broken_is_an_error_naming_the_folder(tmp_path):
    ckpt = RollingCheckpoint(tmp_path / "stage")
    ckpt.folder.mkdir()
    ckpt.last.write_bytes(b"x")
    ckpt.prev.write_bytes(b"y")
    with pytest.raises(CorruptCheckpointError, match="No readable checkpoint is left in .*stage"):
        ckpt.load()


def _draws():
    return (random.random(), float(np.random.rand()), torch.rand(3).tolist())


def test_rng_state_round_trip_restores_every_generator():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = rng_state()
    first = _draws()
    _draws()  # move on
    set_rng_state(state)
    assert _draws() == first


def test_rng_state_survives_a_checkpoint_file(tmp_path):
    torch.manual_seed(1)
    save_checkpoint(tmp_path / "r.pt", {"rng": rng_state()})
    expected = _draws()
    _draws()
    set_rng_state(load_checkpoint(tmp_path / "r.pt")["rng"])
    assert _draws() == expected


class _Planted:
    """Unpickling this object would call os.system (what a planted cache file could do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_file_is_refused_and_runs_no_code(tmp_path):
    # Finding 6: every .pt was loaded with weights_only=False: unpickling could run any code.
    marker = tmp_path / "code-ran"
    torch.save({"model": _Planted(str(marker))}, tmp_path / "pretrain.pt")
    with pytest.raises(CorruptCheckpointError, match=r"pretrain\.pt holds .*system.*Delete it"):
        load_checkpoint(tmp_path / "pretrain.pt")
    assert not marker.exists()


def test_checkpoints_with_rng_states_load_with_weights_only(tmp_path):
    # The RNG states (NumPy's included) are tensors and lists, so weights_only=True loads them.
    save_checkpoint(tmp_path / "c.pt", {"rng": rng_state(), "w": torch.ones(2)})
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(state["w"], torch.ones(2)) and isinstance(state["rng"]["numpy"]["key"], torch.Tensor)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_follow_the_umask(tmp_path, umask):
    # Finding 6: result, checkpoint and cache files were created 0600 whatever the umask.
    code = ("import os, sys; os.umask(int(sys.argv[2], 8)); from pathlib import Path; "
            "from mcd_helpers.training.checkpoint import save_checkpoint, atomic_write_json; "
            "save_checkpoint(Path(sys.argv[1]) / 'c.pt', {'a': 1}); atomic_write_json(Path(sys.argv[1]) / 'r.json', [1])")
    subprocess.run([sys.executable, "-c", code, str(tmp_path), oct(umask)[2:]], check=True,
                   cwd=os.path.dirname(os.path.dirname(__file__)))
    want = 0o666 & ~umask  # what open() creates
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"c.pt": want, "r.json": want}


def test_a_full_disk_is_a_clear_error_and_leaves_the_old_file(tmp_path, monkeypatch):
    # Finding 8: a full disk ended in torch's "unexpected pos 542592 vs 542480" and a partial file.
    path = tmp_path / "c.pt"
    save_checkpoint(path, {"step": 1})

    def full(f, data):
        f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint, "_write_bytes", full, raising=False)
    from mcd_helpers.errors import DiskFullError
    with pytest.raises(DiskFullError, match=r"no space left on the device while writing .*c\.pt.*previous file"):
        save_checkpoint(path, {"step": 2, "w": torch.zeros(1000)})
    assert load_checkpoint(path)["step"] == 1
    assert _leftovers(tmp_path) == []


def test_output_lock_one_run_per_folder_and_stale_locks(tmp_path):
    # Finding 4: nothing kept two runs off one --out.
    from mcd_helpers.training.checkpoint import OutputLock
    from mcd_helpers.errors import OutputLockedError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mcd_helpers.training.checkpoint import OutputLock; "
                               "OutputLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputLockedError, match=f"another run \\(pid={holder.pid} .*choose another --out"):
            OutputLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock file (with its PID) is left, and recognised as stale.
    assert f"pid={holder.pid}" in (tmp_path / ".lock").read_text()
    with OutputLock(tmp_path) as lock:
        assert lock.stale_pid == holder.pid
    assert not (tmp_path / ".lock").exists()  # released
