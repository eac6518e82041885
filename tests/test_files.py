"""mcd_helpers.files: writes are whole or absent, a full disk is named, loading runs no code, the
umask holds."""

import errno
import json
import os
import re

import pytest
import torch

import mcd_helpers.experiments.files as files
from mcd_helpers.experiments.files import atomic_write, load_state, save_state, write_json


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize(
    "payload, want", [("AUROC ± 1 % é\n", "AUROC ± 1 % é\n".encode()), (b"\x00\xff", b"\x00\xff")]
)
def test_atomic_write_writes_str_as_utf8_and_bytes_as_they_are(tmp_path, payload, want):
    path = tmp_path / "new" / "sub" / "f"  # folders made as needed
    atomic_write(path, "old")
    atomic_write(path, payload)
    assert path.read_bytes() == want and leftovers(path.parent) == []


def fail_fsync_with(code):
    def fsync(fd):
        raise OSError(code, os.strerror(code))

    return fsync


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch, code):
    path = tmp_path / "c.pt"
    atomic_write(path, b"previous")
    monkeypatch.setattr(files.os, "fsync", fail_fsync_with(code))
    with pytest.raises(
        OSError,
        match=rf"{re.escape(str(path))} \(2\.0 MB\).*--out, MCD_CACHE_DIR",
    ) as err:
        atomic_write(path, b"x" * 2_000_000)
    assert err.value.errno == code
    assert path.read_bytes() == b"previous" and leftovers(tmp_path) == []


def test_a_disk_full_in_the_middle_of_the_write(tmp_path, monkeypatch):
    # The write itself fails after half the bytes, as on a real full disk.
    path = tmp_path / "r.json"
    write_json(path, {"auroc": 0.5})
    real_open = open

    class HalfFull:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr("builtins.open", lambda *a, **k: HalfFull(real_open(*a, **k)))
    with pytest.raises(OSError, match=re.escape(str(path))):
        write_json(path, {"auroc": 0.75, "rows": list(range(100))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"auroc": 0.5} and leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), KeyboardInterrupt()])
def test_other_failures_propagate_unchanged_and_leave_the_old_file(tmp_path, monkeypatch, error):
    path = tmp_path / "f"
    atomic_write(path, "old")

    def fsync(fd):
        raise error

    monkeypatch.setattr(files.os, "fsync", fsync)
    with pytest.raises(type(error)) as err:
        atomic_write(path, "new")
    assert err.value is error  # not rewritten as a full disk
    assert path.read_text() == "old" and leftovers(tmp_path) == []


def test_write_json_indents_and_refuses_nan_and_inf_keeping_the_old_file(tmp_path):
    path = tmp_path / "results.json"
    write_json(path, [{"auroc": 0.5, "method": "mcd"}])
    assert path.read_text() == '[\n {\n  "auroc": 0.5,\n  "method": "mcd"\n }\n]\n'
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            write_json(path, [{"auroc": bad}])
    assert (
        json.loads(path.read_text()) == [{"auroc": 0.5, "method": "mcd"}]
        and leftovers(tmp_path) == []
    )


def test_save_and_load_state_round_trip(tmp_path):
    state = {
        "model": {"w": torch.arange(6.0).view(2, 3), "n": torch.tensor(3)},
        "step": 7,
        "lr": 0.01,
        "history": [0.5, 0.25],
        "name": "pretrain",
        "rng": (torch.ByteTensor([1, 2]), None),
        "done": True,
    }
    save_state(tmp_path / "s.pt", state)
    got = load_state(tmp_path / "s.pt")
    assert got.keys() == state.keys() and (
        got["step"],
        got["lr"],
        got["history"],
        got["name"],
        got["done"],
    ) == (7, 0.01, [0.5, 0.25], "pretrain", True)
    assert (
        torch.equal(got["model"]["w"], state["model"]["w"])
        and got["model"]["w"].device.type == "cpu"
    )
    assert torch.equal(got["rng"][0], torch.ByteTensor([1, 2])) and got["rng"][1] is None


class Planted:
    """Unpickling this object would run ``touch marker`` (what a planted cache file could do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_planted_file_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model": Planted(marker)}, tmp_path / "pretrain.pt")
    with pytest.raises(
        RuntimeError,
        match=rf"{re.escape(str(tmp_path / 'pretrain.pt'))}.*UnpicklingError",
    ):
        load_state(tmp_path / "pretrain.pt")
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage", [lambda b: b[: len(b) // 3], lambda b: b"not a checkpoint"], ids=["cut", "junk"]
)
def test_a_damaged_state_file_is_named(tmp_path, damage):
    path = tmp_path / "s.pt"
    save_state(path, {"w": torch.zeros(100)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(RuntimeError, match=re.escape(str(path))):
        load_state(path)


def test_a_missing_state_file_is_named(tmp_path):
    with pytest.raises(
        RuntimeError, match=rf"{re.escape(str(tmp_path / 'missing.pt'))}.*FileNotFoundError"
    ):
        load_state(tmp_path / "missing.pt")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_new_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.txt", "x")
        write_json(tmp_path / "r.json", [1])
        save_state(tmp_path / "c.pt", {"a": torch.ones(1)})
    finally:
        os.umask(old)
    want = 0o666 & ~umask  # what open() creates
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {
        "a.txt": want,
        "r.json": want,
        "c.pt": want,
    }


def test_a_resumed_run_keeps_what_its_earlier_session_recorded(tmp_path):
    from mcd_helpers.experiments.files import output_folder, read_run

    out = tmp_path / "out"
    with (
        pytest.raises(KeyboardInterrupt),
        output_folder(out, {"commit": "aaa"}, quiet=True) as info,
    ):
        info["cells"] = 3  # what the run recorded before it was stopped
        (out / "cells").mkdir()
        (out / "cells" / "one.json").write_text("{}")  # unfinished work
        raise KeyboardInterrupt
    first = read_run(out)
    assert (first["status"], first["cells"], first["commit"]) == ("interrupted", 3, "aaa")
    with output_folder(out, {"commit": "bbb"}, resume=True, quiet=True):
        pass
    run = read_run(out)
    assert (run["status"], run["commit"], run["resumed"]) == ("finished", "bbb", True)
    kept = ("started", "updated", "status", "commit", "machine")
    assert run["earlier_sessions"] == [{k: first[k] for k in kept}]
