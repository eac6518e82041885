"""Checkpoints and result files written atomically: a temporary file in the same folder, then rename.

A run killed mid-write leaves the previous file intact (``os.replace`` is atomic on POSIX), so
nothing is ever half-written. Loading checks that the file is a complete checkpoint and says which
file is broken and what to do.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "save_checkpoint",
           "load_checkpoint", "CorruptCheckpointError"]


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
