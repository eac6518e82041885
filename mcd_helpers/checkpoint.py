"""Checkpoints and result files written atomically, kept in pairs, with the RNG states to resume exactly.

* Atomic writes: a temporary file in the same folder, ``fsync``, then ``os.replace`` (atomic on
  POSIX). A run killed mid-write leaves the previous file intact, so nothing is half-written.
* :class:`RollingCheckpoint`: a training stage's folder holding ``last.pt`` and the one before
  it, ``last.prev.pt``. Loading tries ``last.pt`` first; a file cut short (a full disk, a copy
  interrupted, a file system without atomic rename) is reported with its name and the previous
  one is used.
* :func:`rng_state` / :func:`set_rng_state`: Python's, NumPy's, PyTorch's CPU and CUDA generators,
  so that anything random after a resume (dropout masks, say) is what it would have been.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "save_checkpoint",
           "load_checkpoint", "CorruptCheckpointError", "RollingCheckpoint", "rng_state",
           "set_rng_state"]


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be read (cut short, or not a checkpoint)."""


def _atomic(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    _atomic(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` via a temporary file and a rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and a rename.

    Raises:
        ValueError: if ``obj`` holds NaN or inf (not valid JSON); nothing is written then.
    """
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def save_checkpoint(path: Path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically."""
    _atomic(path, lambda f: torch.save(state, f))


def load_checkpoint(path: Path, required: tuple[str, ...] = ()) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CorruptCheckpointError: if the file is cut short, not a checkpoint, or lacks a key in
            ``required``; the message names the file and says to delete it or rerun.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CorruptCheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); it was probably cut "
            "short. Delete it to start that stage again.") from err
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise CorruptCheckpointError(f"checkpoint {path} lacks {missing}; it was written by another "
                                     "program or version. Delete it to start that stage again.")
    return state


class RollingCheckpoint:
    """The checkpoints of one training stage: ``DIR/last.pt`` and the previous one, ``DIR/last.prev.pt``.

    :meth:`save` moves ``last.pt`` to ``last.prev.pt`` (a rename), then writes the new
    ``last.pt`` atomically; at every instant at least one complete checkpoint is on disk.
    :meth:`load` returns the newest readable one.

    Args:
        folder: the stage's folder (created on the first save).
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.last = self.folder / "last.pt"
        self.prev = self.folder / "last.prev.pt"
        self.broken = self.folder / "last.broken.pt"

    def __repr__(self) -> str:
        return f"RollingCheckpoint({str(self.folder)!r})"

    def save(self, state: dict) -> None:
        """Keep the current ``last.pt`` as ``last.prev.pt`` and write ``state`` as ``last.pt``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.last.exists():
            os.replace(self.last, self.prev)
        save_checkpoint(self.last, state)

    def load(self, required: tuple[str, ...] = ()) -> dict | None:
        """The newest readable checkpoint of the stage, or ``None`` when there is none.

        A ``last.pt`` that cannot be read is reported with a :class:`UserWarning` naming the file
        and the reason, moved aside to ``last.broken.pt``, and ``last.prev.pt`` is used instead.

        Raises:
            CorruptCheckpointError: if checkpoint files exist but none can be read (the message
                names both; delete the folder to start the stage again).
        """
        errors = []
        for path in (self.last, self.prev):
            if not path.exists():
                continue
            try:
                state = load_checkpoint(path, required)
            except CorruptCheckpointError as err:
                errors.append(str(err))
                continue
            if errors:  # keep the broken file aside, so that the next save does not rotate it in
                os.replace(self.last, self.broken)
                reason = errors[0].split(" Delete it")[0]  # the error without its advice
                warnings.warn(f"{reason} Using the previous checkpoint {path} instead (the broken file is "
                              f"kept as {self.broken}).", stacklevel=2)
            return state
        if errors:
            raise CorruptCheckpointError(" ".join(errors) + f" No readable checkpoint is left in {self.folder}: "
                                         "delete that folder to start the stage again.")
        return None

    def clear(self) -> None:
        """Delete the stage's checkpoint files (after its final result is safely written)."""
        for path in (self.last, self.prev, self.broken):
            path.unlink(missing_ok=True)
        if self.folder.exists() and not any(self.folder.iterdir()):
            self.folder.rmdir()


def rng_state() -> dict:
    """The states of Python's, NumPy's and PyTorch's global generators (CUDA when initialised)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if cuda else None}


def set_rng_state(state: dict) -> None:
    """Restore generator states saved by :func:`rng_state` (CUDA only when saved and available)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
