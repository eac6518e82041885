"""Data files shared by the Fashion-MNIST and CIFAR loaders: where they live, how they are read and written.

* :func:`cache_root`: ``$MCD_DATA_DIR`` when set, else ``~/.cache/mcd_helpers``; where data is looked
  for and, when it is writable, where downloads and caches go. :func:`writable_cache_root` falls
  back to ``$MCD_CACHE_DIR`` (else ``$XDG_CACHE_HOME/mcd_helpers``, ``~/.cache/mcd_helpers``) when
  the data folder is read-only (a shared, read-only copy of the data sets, say).
* :func:`check_writable`: a folder can be written (a probe file is created and deleted).
* :func:`read_idx`: an IDX file (MNIST's format; ``.gz`` or extracted) read in memory and checked:
  magic number, sizes against the length; a bad file is named with what is wrong and the fix.
  Nothing is extracted to disk, so no partial extraction can stay behind.
* :func:`private_folder` / :func:`move_into_place`: downloads and extractions happen in a folder
  of a unique name next to their target and are renamed into place (atomic on POSIX), so
  concurrent runs sharing a cache never see, or trip over, each other's half-written files.
* :func:`odin_noise`: ODIN's noise OOD sets (used by both loaders).

This module imports neither :mod:`mcd_helpers.data.sets` nor :mod:`mcd_helpers.data.cifar`; both import it.
"""
from __future__ import annotations

import gzip
import os
import shutil
import struct
import tempfile
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import CorruptDataError, DataNotFoundError, NotWritableError

__all__ = ["cache_root", "writable_cache_root", "check_writable", "read_idx", "private_folder",
           "move_into_place", "odin_noise", "DataNotFoundError", "CorruptDataError"]

_IDX_NDIM = {1: "labels", 3: "images"}


def cache_root() -> Path:
    """``$MCD_DATA_DIR`` when set, else ``~/.cache/mcd_helpers`` (``$XDG_CACHE_HOME`` respected)."""
    if os.environ.get("MCD_DATA_DIR"):
        return Path(os.environ["MCD_DATA_DIR"]).expanduser()
    return _user_cache()


def _user_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mcd_helpers"


def _probe(folder: Path) -> None:
    """Create ``folder`` (with parents) and a probe file in it, then delete the probe; OSError if impossible."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
    os.close(fd)
    os.unlink(name)


def check_writable(folder: Path, what: str, fix: str = "") -> Path:
    """Make sure ``folder`` exists (created if needed) and a file can be written in it. Returns it.

    Raises:
        NotWritableError: naming ``what`` (e.g. ``"--out"``), the folder, the reason and ``fix``.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotWritableError(f"{what} {folder} is a file, not a folder. Choose a folder path "
                               f"(it is created if missing){', or ' + fix if fix else ''}.")
    try:
        _probe(folder)
    except OSError as err:
        raise NotWritableError(f"{what} {folder} cannot be written ({type(err).__name__}: {err.strerror or err}). "
                               f"Make it writable{', or ' + fix if fix else ''}.") from err
    return folder


def writable_cache_root() -> tuple[Path, str | None]:
    """The folder downloads and caches go to, and a note when it is not :func:`cache_root`.

    :func:`cache_root` when it can be written; else ``$MCD_CACHE_DIR`` when set, else the user's
    cache (``$XDG_CACHE_HOME/mcd_helpers`` or ``~/.cache/mcd_helpers``). Data is still read from
    :func:`cache_root` (it is looked for in both).

    Raises:
        NotWritableError: when neither can be written (the message names both and the fix).
    """
    root = cache_root()
    try:
        _probe(root)
        return root, None
    except OSError as first:
        fallback = Path(os.environ["MCD_CACHE_DIR"]).expanduser() if os.environ.get("MCD_CACHE_DIR") else _user_cache()
        if fallback == root:
            raise NotWritableError(f"the cache folder {root} cannot be written ({first.strerror or first}); make it "
                                   "writable or set MCD_CACHE_DIR to a writable folder.") from first
        try:
            _probe(fallback)
        except OSError as err:
            raise NotWritableError(
                f"the data folder {root} cannot be written ({first.strerror or first}) and neither can the "
                f"fallback cache {fallback} ({err.strerror or err}); set MCD_CACHE_DIR to a writable folder.") from err
        return fallback, (f"the data folder {root} is read-only ({first.strerror or first}): data is read from "
                          f"it, downloads and caches go to {fallback} (set MCD_CACHE_DIR to choose another folder).")


def data_roots() -> list[Path]:
    """The folders data and caches are looked for in: :func:`cache_root`, then, when that cannot be
    written, the fallback cache that :func:`writable_cache_root` writes to instead."""
    roots = [cache_root()]
    try:
        _probe(roots[0])
    except OSError:
        fallback = Path(os.environ["MCD_CACHE_DIR"]).expanduser() if os.environ.get("MCD_CACHE_DIR") else _user_cache()
        if fallback not in roots:
            roots.append(fallback)
    return roots


def read_idx(path: Path, fix: str) -> torch.Tensor:
    """Read an IDX file of unsigned bytes (MNIST's format), ``.gz`` or not, in memory.

    Format (yann.lecun.com/exdb/mnist): bytes 0-1 zero, byte 2 the type (0x08 = unsigned byte),
    byte 3 the number of dimensions d, then d big-endian 32-bit sizes, then the data row-major.

    Returns:
        a uint8 tensor of the header's shape: ``(N, H, W)`` images or ``(N,)`` labels.

    Raises:
        CorruptDataError: when the file is not gzip (or cut short inside the gzip stream), its magic
            number is not an unsigned-byte IDX one, or its length differs from what the header says;
            the message names the file, the problem and ``fix``.
    """
    path = Path(path)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError; a cut gzip an EOFError
        raise CorruptDataError(f"{path} cannot be read ({type(err).__name__}: {err}): it is cut short or not "
                               f"a gzip file. {fix}") from err
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08 or data[3] not in _IDX_NDIM:
        raise CorruptDataError(f"{path} is not an IDX file of images or labels: its first bytes are "
                               f"{data[:4].hex() or 'missing'}, expected 00000803 (images) or 00000801 "
                               f"(labels). {fix}")
    ndim = data[3]
    head = 4 + 4 * ndim
    if len(data) < head:
        raise CorruptDataError(f"{path} is cut short: {len(data)} bytes, not even its {head}-byte header. {fix}")
    dims = struct.unpack(f">{ndim}I", data[4:head])
    want = head + int(torch.tensor(dims).prod())
    if len(data) != want:
        raise CorruptDataError(f"{path} is {'cut short' if len(data) < want else 'longer than its header says'}: "
                               f"{len(data)} bytes, its header's shape {dims} needs {want}. {fix}")
    return torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8).view(*dims)


@contextmanager
def private_folder(parent: Path):
    """A new folder of a unique name in ``parent`` (created with its parents), deleted on exit."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(src: Path, dst: Path) -> None:
    """Rename ``src`` (file or folder) to ``dst`` atomically; when another process got there first, keep theirs.

    Files replace each other atomically (``os.replace``). A folder is renamed only if ``dst`` does
    not exist yet (a concurrent run that finished first wins; ``src`` is left to be cleaned up).
    """
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        try:
            os.rename(src, dst)
        except OSError:
            if not dst.is_dir():
                raise
        return
    os.replace(src, dst)


def odin_noise(name: str, n: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """ODIN's noise OOD sets (Liang et al. 2018), pixels in [0, 1], not normalised.

    ``gaussian``: ``clamp(N(0.5, 1), 0, 1)`` per pixel; ``uniform``: ``U[0, 1]`` per pixel. Drawn
    from a generator seeded with ``seed``, so the same arguments give the same images.

    Shapes:
        returns ``(n, *shape)`` float32, e.g. ``shape = (1, 28, 28)`` or ``(3, 32, 32)``.

    Raises:
        ValueError: on a name other than ``gaussian``/``uniform`` or ``n < 1``.
    """
    if name not in ("gaussian", "uniform"):
        raise ValueError(f"unknown noise set {name!r}; choose from gaussian, uniform.")
    if n < 1:
        raise ValueError(f"a noise set needs at least one sample, got n={n}.")
    g = torch.Generator().manual_seed(seed)
    if name == "gaussian":
        return torch.clamp(torch.randn((n, *shape), generator=g) + 0.5, 0.0, 1.0)
    return torch.rand((n, *shape), generator=g)
