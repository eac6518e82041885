"""Atomic writes, the rolling pair of checkpoints (last.pt / last.prev.pt) and RNG states."""
import json
import random

import numpy as np
import pytest
import torch

from mcd_helpers.checkpoint import (CorruptCheckpointError, RollingCheckpoint, atomic_write_json,
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
    with pytest.raises(Exception):
        save_checkpoint(path, {"step": 2, "bad": lambda: None})  # lambdas cannot be pickled
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
