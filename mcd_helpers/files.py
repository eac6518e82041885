"""Files written whole or not at all: checkpoints, cached stages and results.

A file is written to a temporary name in its folder, flushed to disk, then renamed over the target
(atomic on POSIX): a run killed mid-write (SIGKILL, power loss) leaves the previous file intact, and
concurrent runs sharing a cache never read a half-written one. New files follow the umask. Loading
uses ``torch.load(..., weights_only=True)``, so a planted ``.pt`` file cannot run code.
"""

import errno
import io
import json
import os
from pathlib import Path

import torch

from .errors import CheckpointError


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` via a temporary file, ``fsync`` and a rename.

    Raises:
        OSError: with a message naming the file when the disk is full (the old file is intact and no
            temporary file is left), or the error of the file system.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err.errno, f"no space left on the device while writing {path} ({len(data) / 1e6:.1f} MB); "
                                     "the previous file is intact. Free some space or choose another folder (--out, "
                                     "MCD_CACHE_DIR), then rerun (with --resume to continue).") from err
        raise


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON, atomically. ``ValueError`` (nothing written) if it holds NaN or inf."""
    atomic_write(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def write_buffered(path: Path, write) -> None:
    """``write(file)`` into memory (``torch.save``, ``np.savez``, ``fig.savefig``), then to ``path`` atomically."""
    buffer = io.BytesIO()
    write(buffer)
    atomic_write(path, buffer.getvalue())


def save_state(path: Path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically; ``state`` holds tensors and plain containers only."""
    write_buffered(path, lambda f: torch.save(state, f))


def load_state(path: Path) -> dict:
    """A file of :func:`save_state`, onto the CPU, with ``weights_only=True``.

    Raises:
        CheckpointError: the file is cut short, not a checkpoint or holds other objects; the message
            names it and says to delete it.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path} cannot be read as a checkpoint ({type(err).__name__}: {str(err)[:200]}): cut short"
                              " or foreign (loading other objects could run code). Delete it to recompute it.") from err
