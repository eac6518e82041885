"""The output folder of a run (``reproduce``, ``benchmark``): its lock, ``run.json`` and unfinished work.

``<out>/.lock`` holds the PID of the run using the folder (:class:`~mcd_helpers.training.checkpoint.OutputLock`);
``<out>/run.json`` says ``"status"``: ``running``, then ``finished``, ``partial``, ``interrupted`` or
``failed``. Work an unfinished run left (rolling checkpoints, finished stages, finished benchmark
cells) is never deleted silently: :func:`prepare_out` stops with
:class:`~mcd_helpers.errors.UnfinishedRunError` unless told to resume or to start fresh.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

from ..data.files import check_writable
from ..errors import UnfinishedRunError
from ..training.checkpoint import OutputLock, atomic_write_json

__all__ = ["read_run", "write_run", "unfinished_work", "prepare_out", "CELLS", "OUTPUTS"]

CELLS = "cells"  # <out>/cells/<cell>.json: the rows of a finished benchmark cell


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def read_run(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def unfinished_work(out_dir: Path) -> list[Path]:
    """Files in ``out_dir`` that an unfinished run left (empty when none).

    Rolling checkpoints (``checkpoints/<stage>/last*.pt``) always count; finished stages'
    ``checkpoints/*.pt`` and finished benchmark cells (``cells/*.json``) count unless ``run.json``
    (or, for folders from before ``run.json``, a ``results.json`` with no rolling checkpoint) says
    the run finished.
    """
    ckpt = Path(out_dir) / "checkpoints"
    rolling = sorted(ckpt.glob("*/last*.pt")) if ckpt.is_dir() else []
    finals = (sorted(ckpt.glob("*.pt")) if ckpt.is_dir() else []) + sorted((Path(out_dir) / CELLS).glob("*.json"))
    status = read_run(Path(out_dir)).get("status")
    if status == "finished" or (status is None and (Path(out_dir) / "results.json").exists()):
        return rolling
    return rolling + finals


def write_run(out_dir: Path, **fields) -> None:
    atomic_write_json(out_dir / "run.json", {**read_run(out_dir), **fields,
                                             "updated": datetime.datetime.now().isoformat(timespec="seconds")})


OUTPUTS = ("results.json", "results.md", "summary.md", "config.json", "forest.png", "by_protocol.png")
"""What a finished run leaves in ``--out`` besides ``checkpoints/``, ``cells/`` and ``scores/``
(``--fresh`` deletes these too, with the ``hist_*.png`` / ``roc_*.png`` plots of ``reproduce``)."""


def prepare_out(out_dir: Path, lock: OutputLock, settings: dict, resume: bool, fresh: bool, quiet: bool) -> None:
    """Rank 0: ``--out`` writable, locked, no unfinished run in the way; ``run.json`` says running.

    ``settings`` (plain JSON data) are stored in ``run.json``; fields of an earlier run's
    ``run.json`` that describe how it ended (``error``, ``seconds``, counts) are dropped.

    Raises:
        NotWritableError, OutputLockedError, UnfinishedRunError (nothing deleted).
    """
    check_writable(out_dir, "--out", "choose another --out")
    lock.acquire()
    if lock.stale_pid is not None:
        _log(f"note: {lock.path} was left by PID {lock.stale_pid}, which no longer runs; taken over.", quiet)
    left = unfinished_work(out_dir)
    if left and not resume:
        if not fresh:
            shown = ", ".join(str(p.relative_to(out_dir)) for p in left[:4]) + (" ..." if len(left) > 4 else "")
            raise UnfinishedRunError(
                f"{out_dir} holds checkpoints of an unfinished run ({shown}). Pass --resume to continue it "
                "(same settings), or --fresh to delete them and start over, or choose another --out. "
                "Nothing was deleted.")
        _log(f"--fresh: deleting the checkpoints, finished cells and results of the earlier run in {out_dir}", quiet)
    if fresh:
        for folder in (out_dir / "checkpoints", out_dir / CELLS, out_dir / "scores"):
            if folder.exists():
                shutil.rmtree(folder)
        for path in [out_dir / name for name in OUTPUTS + ("run.json",)] + sorted(out_dir.glob("hist_*.png")) + sorted(
                out_dir.glob("roc_*.png")):
            path.unlink(missing_ok=True)
    ended = ("error", "seconds", "cells", "rows", "failures")
    atomic_write_json(out_dir / "run.json", {k: v for k, v in read_run(out_dir).items() if k not in ended})
    write_run(out_dir, status="running", pid=os.getpid(), resumed=bool(resume),
              started=datetime.datetime.now().isoformat(timespec="seconds"), config=settings, failures={})
