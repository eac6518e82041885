"""Files written whole or not at all (checkpoints, cached stages, results), and an output folder.

A file is written to a temporary name in its folder, flushed to disk, then renamed over the target
(atomic on POSIX): a run killed mid-write (SIGKILL, power loss) leaves the previous file intact, and
concurrent runs sharing a cache never read a half-written one. New files follow the umask. Loading
uses ``torch.load(..., weights_only=True)``, so a planted ``.pt`` file cannot run code.

An output folder (:func:`output_folder`, of ``reproduce`` and ``benchmark``) holds one run at a time
(``<out>/.lock``, a ``filelock.FileLock``); ``<out>/run.json`` says ``"status"``: ``running``, then
``finished``, ``partial``, ``interrupted`` or ``failed``. Work an unfinished run left (stage
checkpoints in ``checkpoints/``, finished benchmark cells in ``cells/``) is never deleted silently:
without ``--resume`` (continue it) or ``--fresh`` (delete it and the earlier results) the run stops.
"""

import contextlib
import datetime
import errno
import io
import json
import os
import shutil
from pathlib import Path

import torch

from ..data import writable
from ..errors import CheckpointError, ConfigError, TrainingInterrupted
from . import ddp


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
            raise OSError(
                err.errno,
                f"no space left on the device while writing {path} ({len(data) / 1e6:.1f} MB); "
                "the previous file is intact. Free some space or choose another folder (--out, "
                "MCD_CACHE_DIR), then rerun (with --resume to continue).",
            ) from err
        raise


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON, atomically. ``ValueError`` (nothing written) if it holds NaN or
    inf."""
    atomic_write(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def write_buffered(path: Path, write) -> None:
    """``write(file)`` into memory (``torch.save``, ``np.savez``, ``fig.savefig``), then to ``path``
    atomically."""
    buffer = io.BytesIO()
    write(buffer)
    atomic_write(path, buffer.getvalue())


def save_state(path: Path, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically; ``state`` holds tensors and plain containers
    only."""
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
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint ({type(err).__name__}: {str(err)[:200]}): cut "
            "short or foreign (loading other objects could run code). Delete it to recompute it."
        ) from err


# ---- an output folder ----------------------------------------------------------------------------

OUTPUTS = (
    "results.json",
    "results.md",
    "summary.md",
    "config.json",
    "forest.png",
    "by_protocol.png",
)


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def read_run(out: Path) -> dict:
    """``out/run.json`` as a dict; empty when it is missing or unreadable."""
    try:
        return json.loads((Path(out) / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def _unfinished(out: Path) -> list[Path]:
    """What an unfinished run left in ``out``: stage checkpoints always, finished benchmark cells
    unless the run finished."""
    left = sorted(out.glob("checkpoints/**/*.pt"))
    if read_run(out).get("status") != "finished":
        left += sorted(out.glob("cells/*.json"))
    return left


def _delete_earlier_run(out: Path) -> None:
    earlier = [out / "checkpoints", out / "cells", out / "scores", out / "run.json"]
    earlier += [out / name for name in OUTPUTS] + [*out.glob("hist_*.png"), *out.glob("roc_*.png")]
    for path in earlier:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _take(out: Path, lock, settings: dict, resume: bool, fresh: bool, quiet: bool) -> None:
    """Rank 0's part of :func:`output_folder`: check ``out``, take its lock, deal with an earlier
    run's work and write ``run.json``."""
    from filelock import Timeout

    if out.exists() and not out.is_dir() or not writable(out):
        what = "a file" if out.is_file() else "not writable"
        raise ConfigError("out", f"{out} is {what}: use another folder.")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        pid = read_run(out).get("pid", "?")
        raise ConfigError(
            "out",
            f"another run (PID {pid}) is using --out {out}: one run at a time per folder. Wait "
            "for it, or choose another --out.",
        ) from None
    left = _unfinished(out)
    if left and not resume and not fresh:  # (output_folder releases the lock)
        shown = ", ".join(str(p.relative_to(out)) for p in left[:4]) + (
            " ..." if len(left) > 4 else ""
        )
        raise ConfigError(
            "resume",
            f"{out} holds unfinished work ({shown}); nothing was deleted. Pass --resume to "
            "continue it (same settings), --fresh to delete it, or another --out.",
        )
    if fresh:
        if left and not quiet:
            print(
                f"--fresh: deleting the earlier run's checkpoints, cells and results in {out}",
                flush=True,
            )
        _delete_earlier_run(out)
    started = {"status": "running", "pid": os.getpid(), "resumed": resume, "started": _now()}
    if resume and (earlier := read_run(out)):  # keep when and where the earlier sessions ran
        kept = {
            k: earlier[k]
            for k in ("started", "updated", "status", "commit", "machine")
            if k in earlier
        }
        started["earlier_sessions"] = [*earlier.get("earlier_sessions", []), kept]
    write_json(out / "run.json", {**started, "machine": machine(), **settings})


def machine() -> dict:
    """What float32 results depend on beyond the code: torch's version, the CPU kernels it
    dispatches to (``"AVX512"``, ``"AVX2"``, ...) and its thread count. Two CPUs with other kernels
    train other networks from the same seed (docs/near-ood.md, the generality rerun)."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def output_folder(
    out: Path, settings: dict, resume: bool = False, fresh: bool = False, quiet: bool = False
):
    """Lock ``out`` for this run, refuse to bury unfinished work, keep ``run.json``; yields a dict
    whose entries (``status``, ``failures``, counts) go into ``run.json`` when the run ends. Rank 0
    does the work.

    Raises:
        ConfigError: ``--resume`` with ``--fresh``; ``out`` a file, not writable, in use by another
            run (field ``out``), or holding an unfinished run without ``--resume`` or ``--fresh``
            (nothing deleted).
    """
    from filelock import FileLock

    if resume and fresh:
        raise ConfigError(
            "fresh", "--resume continues the work in --out and --fresh deletes it: pass one."
        )
    out = Path(out)
    lock = FileLock(out / ".lock")
    info = {"status": "finished"}  # what run.json gets when the run ends; the run adds to it
    prepared = False
    try:
        ddp.rank0_first(
            lambda: _take(out, lock, settings, resume, fresh, quiet) if ddp.is_main() else None
        )
        prepared = True  # from here on, run.json records how the run ends
        yield info
    except BaseException as err:
        stopped = isinstance(err, (KeyboardInterrupt, TrainingInterrupted))
        info.update(  # beside what the run recorded so far
            status="interrupted" if stopped else "failed", error=f"{type(err).__name__}: {err}"
        )
        raise
    finally:
        try:
            if prepared and ddp.is_main():  # a failed _take leaves run.json as it was
                write_json(out / "run.json", {**read_run(out), **info, "updated": _now()})
        finally:
            if lock.is_locked:  # also when a deletion or a write of _take failed: free the folder
                lock.release()
