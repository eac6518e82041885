"""Checkpoints and result files written atomically, kept in pairs, with the RNG states to resume exactly.

* Atomic writes: a temporary file in the same folder, ``fsync``, then ``os.replace`` (atomic on
  POSIX). A run killed mid-write leaves the previous file intact, so nothing is half-written.
* :class:`RollingCheckpoint`: a training stage's folder holding ``last.pt`` and the one before
  it, ``last.prev.pt``. Loading tries ``last.pt`` first; a file cut short (a full disk, a copy
  interrupted, a file system without atomic rename) is reported with its name and the previous
  one is used.
* :func:`rng_state` / :func:`set_rng_state`: Python's, NumPy's, PyTorch's CPU and CUDA generators,
  so that anything random after a resume (dropout masks, say) is what it would have been.
* Loading is safe: ``torch.load(..., weights_only=True)``, so a planted ``.pt`` file cannot run
  code. Checkpoints hold only tensors and primitive containers (the RNG states too).
* Files follow the umask (``0o666 & ~umask``, as ``open`` would create them), not ``mkstemp``'s 0600,
  so a cache shared by a group stays readable.
* A full disk raises :class:`~mcd_helpers.errors.DiskFullError` naming the file; the previous file
  stays and no temporary file is left.
* :class:`OutputLock`: one run at a time per output folder (``<out>/.lock`` holds the owner's PID,
  locked with ``fcntl.flock``; a lock file whose owner died is recognised as stale and taken over).
"""
from __future__ import annotations

import errno
import io
import json
import os
import random
import re
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, DiskFullError, OutputLockedError

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "save_checkpoint",
           "load_checkpoint", "CorruptCheckpointError", "RollingCheckpoint", "rng_state",
           "set_rng_state", "file_mode", "OutputLock", "DiskFullError", "OutputLockedError"]




def file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask: ``0o666 & ~umask``."""
    try:  # Linux >= 4.7 reports the umask without changing it
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_bytes(f, data: bytes) -> None:
    """Write, flush and fsync (a function of its own so tests can simulate a full disk)."""
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``: a unique temporary file in the same folder, fsync, rename.

    Raises:
        DiskFullError: when the device is full (ENOSPC, EDQUOT); the old ``path`` is untouched and
            the temporary file removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600 files; follow the umask instead
        with os.fdopen(fd, "wb") as f:
            _write_bytes(f, data)
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(err.errno, f"no space left on the device while writing {path} "
                                f"({len(data) / 1e6:.1f} MB; {err.strerror}). Nothing was half-written: the "
                                "previous file (if any) is intact. Free some space or choose another folder "
                                "(--out, or MCD_DATA_DIR / MCD_CACHE_DIR for the cache), then rerun "
                                "(with --resume to continue from the last checkpoint).") from err
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    _atomic(path, data)


def atomic_write_text(path: Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` via a temporary file and a rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and a rename.

    Raises:
        ValueError: if ``obj`` holds NaN or inf (not valid JSON); nothing is written then.
    """
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_plain(obj, where: str) -> None:
    """Raise TypeError unless ``obj`` holds only tensors, numbers, strings and plain containers."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"{where} has a key of type {type(k).__name__}; checkpoint keys must be "
                                "strings or numbers.")
            _check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__name__}; a checkpoint holds only tensors, numbers, strings, "
                    "None and lists/tuples/dicts of them (what torch.load(weights_only=True) loads). "
                    "Convert it (NumPy arrays with torch.from_numpy, objects with their state_dict()).")


def save_checkpoint(path: Path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically (serialised in memory first, then written).

    ``state`` should hold only tensors and primitive containers (what ``weights_only`` loads).

    Raises:
        TypeError: when ``state`` holds anything else (the message names where); nothing is written.
        DiskFullError: when the device is full (nothing half-written is left).
    """
    _check_plain(state, "state")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _atomic(path, buffer.getvalue())


def load_checkpoint(path: Path, required: tuple[str, ...] = ()) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` onto the CPU, with ``weights_only=True``.

    Only tensors and primitive containers are unpickled, so a planted file cannot run code.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        CorruptCheckpointError: if the file is cut short, not a checkpoint, or lacks a key in
            ``required``; the message names the file and says to delete it or rerun.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found:
            name = found.group(1)
            raise CorruptCheckpointError(
                f"checkpoint {path} holds {name}, an object other than tensors and plain containers, which is not "
                "loaded (a file written by an older version of this package, or not by it at all: loading "
                "it could run code). Delete it to start that stage again.") from err
        raise CorruptCheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {str(err).split('WeightsUnpickler error:')[-1].strip()[:200]}); it was probably cut "
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
    """The states of Python's, NumPy's and PyTorch's global generators (CUDA when initialised).

    Only tensors, lists and numbers, so a checkpoint holding it loads with ``weights_only=True``:
    Python's state as a list, NumPy's MT19937 key as an int64 tensor.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if cuda else None}


def set_rng_state(state: dict) -> None:
    """Restore generator states saved by :func:`rng_state` (CUDA only when saved and available)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    if isinstance(npst, dict):
        np.random.set_state((npst["kind"], npst["key"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached_gaussian"]))
    else:  # a state from before tensors (kept in memory, not from a file)
        np.random.set_state(npst)
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class OutputLock:
    """One run at a time per output folder: ``<folder>/.lock``, ``fcntl.flock``-ed, holding the owner's PID.

    The kernel drops a ``flock`` when its process dies, so a lock file left by a killed run is
    not locked: it is recognised as stale (``stale_pid`` is the dead owner's PID) and taken over.
    Use as a context manager or with :meth:`acquire` / :meth:`release`.

    Raises:
        OutputLockedError: (from :meth:`acquire`) while another live process holds the lock; the
            message names its PID and host.
    """

    def __init__(self, folder: Path):
        self.path = Path(folder) / ".lock"
        self._fd: int | None = None
        self.stale_pid: int | None = None

    def acquire(self) -> "OutputLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputLockedError(
                    f"another run ({owner}) is using the output folder {self.path.parent}: one run at a time per "
                    "folder. Wait for it to finish, or choose another --out. (If no such process exists, "
                    f"delete {self.path}.)") from None
            try:  # the file may have been released (deleted) between our open and flock: lock the new one
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = os.pread(fd, 200, 0).decode(errors="replace").split()
        if previous and previous[0].startswith("pid=") and previous[0][4:].isdigit():
            self.stale_pid = int(previous[0][4:])
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
