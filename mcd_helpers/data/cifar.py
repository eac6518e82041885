"""The paper's data: CIFAR-10/100 as the ID sets, ODIN's OOD folders and noise, at 3x32x32.

* ID: CIFAR-10 and CIFAR-100 (Krizhevsky 2009) read by torchvision from
  ``$MCD_DATA_DIR/cifar-10-batches-py/`` (``cifar-100-python/``), the layout torchvision's own
  download writes. When the folder is missing, the archive ``cifar-10-python.tar.gz`` in
  ``$MCD_DATA_DIR`` is checked against its MD5 and extracted; when that is missing too,
  torchvision's download is tried.
* OOD (Liang et al., "Enhancing the Reliability of Out-of-distribution Image Detection",
  ICLR 2018, arXiv 1706.02690; github.com/facebookresearch/odin): the five folders
  ``Imagenet`` (TinyImageNet crop, TINc), ``Imagenet_resize`` (TINr), ``LSUN`` (LSUNc),
  ``LSUN_resize`` (LSUNr) and ``iSUN``; 10,000 32x32 JPEGs each (iSUN 8,925). Looked for as
  ``$MCD_DATA_DIR/<name>/`` (any folder of images), else as ``$MCD_DATA_DIR/<name>.tar.gz`` (MD5
  checked, then extracted), else downloaded from the URL in ODIN's README. Images are listed as
  the official MCD loader does (``utils/loader.py``: files in the sub-folders, each folder walked
  in sorted order), converted to RGB and resized to 32 pixels (``transforms.Resize(32)``).
* ``gaussian`` (``clamp(randn + 0.5, 0, 1)``) and ``uniform`` (``rand``) noise as ODIN defines them.

Everything is returned normalised the way the official code does it: ToTensor, then Normalize
with mean (125.3, 123.0, 113.9)/255 and std (63.0, 62.1, 66.7)/255; no augmentation.

A missing archive raises :class:`~mcd_helpers.data.DataNotFoundError`, a corrupt one
:class:`ChecksumError`; both messages name the file, its expected MD5 and where to get it.
The archives' MD5 sums are those recorded by pytorch-ood (``pytorch_ood/dataset/img/odin.py``).
"""
from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .files import cache_root, data_roots, move_into_place, odin_noise, private_folder, writable_cache_root
from ..errors import ChecksumError, DataNotFoundError

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "CIFAR_IMAGE_SHAPE", "CIFAR_DATASETS", "ODIN_ARCHIVES",
           "ODIN_OOD_SETS", "NOISE_SETS", "CIFAR_OOD_SETS", "ChecksumError", "OdinArchive", "md5sum",
           "verify_md5", "normalize_cifar", "load_cifar", "load_odin_folder", "cifar_noise",
           "load_cifar_ood", "data_present", "ood_set_size"]

CIFAR_MEAN = (125.3 / 255, 123.0 / 255, 113.9 / 255)  # official code (and ODIN's)
CIFAR_STD = (63.0 / 255, 62.1 / 255, 66.7 / 255)
CIFAR_IMAGE_SHAPE = (3, 32, 32)
CIFAR_DATASETS = ("cifar10", "cifar100")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif")  # official loader's list




@dataclass(frozen=True)
class OdinArchive:
    """One of ODIN's OOD archives: file name, MD5 of the ``.tar.gz``, download URL, image count."""
    filename: str
    md5: str
    url: str
    n_images: int
    paper_name: str  # the name in the MCD paper's tables


ODIN_ARCHIVES: dict[str, OdinArchive] = {
    "Imagenet": OdinArchive("Imagenet.tar.gz", "7c0827e4246c3718a5ee076e999e52e5",
                            "https://www.dropbox.com/s/avgm2u562itwpkl/Imagenet.tar.gz", 10_000, "TINc"),
    "Imagenet_resize": OdinArchive("Imagenet_resize.tar.gz", "0f9ff11d45babf2eff5fe12281d1ac31",
                                   "https://www.dropbox.com/s/kp3my3412u5k9rl/Imagenet_resize.tar.gz",
                                   10_000, "TINr"),
    "LSUN": OdinArchive("LSUN.tar.gz", "458a0a0ab8e5f1cb4516d7400568e460",
                        "https://www.dropbox.com/s/fhtsw1m3qxlwj6h/LSUN.tar.gz", 10_000, "LSUNc"),
    "LSUN_resize": OdinArchive("LSUN_resize.tar.gz", "278b7b31c8cb7e804a1465a8ce03a2dc",
                               "https://www.dropbox.com/s/moqh2wh8696c3yl/LSUN_resize.tar.gz", 10_000, "LSUNr"),
    "iSUN": OdinArchive("iSUN.tar.gz", "be77b0f2c26fda898afac5f99645ee70",
                        "https://www.dropbox.com/s/ssz7qxfqae0cca5/iSUN.tar.gz", 8_925, "iSUN"),
}
ODIN_OOD_SETS = tuple(ODIN_ARCHIVES)
NOISE_SETS = ("gaussian", "uniform")
CIFAR_OOD_SETS = ODIN_OOD_SETS + NOISE_SETS


# ----------------------------------------------------------------------------------------------
# Checksums, archives, downloads
# ----------------------------------------------------------------------------------------------

def md5sum(path: Path, chunk: int = 1 << 20) -> str:
    """Hex MD5 digest of a file, read in 1 MiB chunks."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def verify_md5(path: Path, expected: str, url: str) -> None:
    """Raise :class:`ChecksumError` unless ``path``'s MD5 is ``expected``.

    The message names the file, both sums, the URL to fetch it again and what to delete.
    """
    actual = md5sum(path)
    if actual != expected:
        raise ChecksumError(
            f"{path} is corrupt or not the expected file: its MD5 is {actual}, expected {expected}. "
            f"Delete it and download it again from {url} (or let the loader download it).")


def _download(url: str, root: Path, filename: str, md5: str) -> None:
    """torchvision's download with MD5 check (a function of its own so tests can cut the network).

    Downloads into a private folder in ``root`` and renames the file into place, so concurrent
    runs never read each other's half-downloaded archive.
    """
    from torchvision.datasets.utils import download_url

    with private_folder(root) as tmp:
        download_url(url, str(tmp), filename=filename, md5=md5)
        move_into_place(tmp / filename, root / filename)


def _fetch_archive(root: Path, filename: str, md5: str, url: str, what: str, target: Path) -> Path:
    """The verified archive ``root/filename``: checked when present, else downloaded; errors say how to fix."""
    archive = root / filename
    if not archive.exists():
        try:
            _download(url, root, filename, md5)
        except Exception as err:  # no network, a proxy, a full disk: all end the same way
            raise DataNotFoundError(
                f"{what} was not found. Looked for the folder {target} and the archive {archive}; "
                f"the download from {url} failed ({type(err).__name__}: {err}). Download {filename} "
                f"(MD5 {md5}) from {url} and put it in {root} (set $MCD_DATA_DIR to choose the "
                "folder), or extract it there yourself.") from err
        if not archive.exists():
            raise DataNotFoundError(f"the download of {url} left no {archive}; download {filename} "
                                    f"(MD5 {md5}) by hand and put it in {root}.")
    verify_md5(archive, md5, url)
    return archive


def _extract(archive: Path, root: Path) -> None:
    """Extract ``archive`` into a private folder in ``root``, then rename each top-level entry into place.

    A run killed mid-extraction leaves only the private folder (``.partial-*``), never a
    half-filled data folder; of two concurrent extractions the first to finish is kept.
    """
    from torchvision.datasets.utils import extract_archive

    root = Path(root)
    with private_folder(root) as tmp:
        extract_archive(str(archive), str(tmp))
        for entry in sorted(tmp.iterdir()):
            move_into_place(entry, root / entry.name)


# ----------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100
# ----------------------------------------------------------------------------------------------

def normalize_cifar(x: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] -> the official code's scale: (x - mean_c) / std_c per channel.

    Shapes:
        x: ``(N, 3, H, W)`` -> same shape.
    """
    mean = torch.tensor(CIFAR_MEAN, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def _cifar_class(name: str):
    from torchvision.datasets import CIFAR10, CIFAR100

    if name not in CIFAR_DATASETS:
        raise ValueError(f"unknown CIFAR data set {name!r}; choose from {', '.join(CIFAR_DATASETS)}.")
    return CIFAR10 if name == "cifar10" else CIFAR100


def _extract_somewhere(archive: Path, root: Path) -> Path:
    """Extract ``archive`` into ``root``; when ``root`` is read-only, into the writable fallback cache.

    Returns the folder it was extracted into.
    """
    try:
        _extract(archive, root)
        return root
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        dest, _ = writable_cache_root()
        if dest == Path(root):
            raise
        _extract(archive, dest)
        return dest


def _ensure_cifar(cls, root: Path) -> Path:
    """Make sure torchvision's batch files are in ``root`` (or, extracted from a read-only ``root``, in
    the writable fallback cache), each with its published MD5. Returns the folder holding them."""
    folder = root / cls.base_folder
    expected = [*cls.train_list, *cls.test_list, [cls.meta["filename"], cls.meta["md5"]]]
    if not all((folder / f).exists() for f, _ in expected):
        archive = _fetch_archive(root, cls.filename, cls.tgz_md5, cls.url, f"{cls.__name__}", folder)
        root = _extract_somewhere(archive, root)
        folder = root / cls.base_folder
    for f, md5 in expected:
        if not (folder / f).exists():
            raise DataNotFoundError(f"{folder / f} is missing after extracting {root / cls.filename}; "
                                    f"delete both and download {cls.url} (MD5 {cls.tgz_md5}) again.")
        actual = md5sum(folder / f)
        if actual != md5:
            raise ChecksumError(
                f"{folder / f} is corrupt: its MD5 is {actual}, expected {md5}. Delete {folder} and "
                f"{root / cls.filename}, then download {cls.url} (MD5 {cls.tgz_md5}) again.")
    return root


def load_cifar(name: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 or CIFAR-100 from ``cache_root()`` as normalised tensors (see the module docstring).

    Args:
        name: ``"cifar10"`` or ``"cifar100"``.
        train: the 50,000 training images, else the 10,000 test images.

    Returns:
        ``(x, y)``: ``x`` of shape ``(N, 3, 32, 32)`` float32, normalised with the official
        mean/std; ``y`` of shape ``(N,)`` int64 in [0, 10) or [0, 100) (CIFAR-100's fine labels).

    Raises:
        ValueError: on an unknown name.
        DataNotFoundError: when neither the folder nor the archive is there and the download fails.
        ChecksumError: when the archive or a batch file has the wrong MD5.
    """
    cls = _cifar_class(name)
    roots = data_roots()
    root = next((r for r in roots if (r / cls.base_folder).is_dir()), roots[0])
    root = _ensure_cifar(cls, root)
    ds = cls(str(root), train=train, download=False)
    x = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).float().div_(255.0)  # (N, 3, 32, 32)
    return normalize_cifar(x), torch.as_tensor(ds.targets, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# ODIN's OOD folders and noise
# ----------------------------------------------------------------------------------------------

def _image_files(folder: Path) -> list[Path]:
    """Image files under ``folder``, every directory walked in sorted order (official make_dataset)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        files += [Path(dirpath) / f for f in sorted(filenames) if f.lower().endswith(IMAGE_EXTENSIONS)]
    return files


def _odin_folder(name: str, root: Path | None = None) -> tuple[Path, Path]:
    """``(root, folder)`` of ODIN's set ``name``: found, else its archive fetched and extracted.

    Without ``root``, the data folder is searched first, then the writable fallback cache; a
    read-only data folder's archive is extracted into the fallback cache.
    """
    spec = ODIN_ARCHIVES[name]
    if root is None:
        roots = data_roots()
        root = next((r for r in roots if (r / name).is_dir() and _image_files(r / name)), roots[0])
    root = Path(root)
    folder = root / name
    if not (folder.is_dir() and _image_files(folder)):
        archive = _fetch_archive(root, spec.filename, spec.md5, spec.url, f"ODIN's {name} set", folder)
        root = _extract_somewhere(archive, root)
        folder = root / name
    return root, folder


def load_odin_folder(name: str, root: Path | None = None) -> torch.Tensor:
    """One of ODIN's OOD sets as ``(N, 3, 32, 32)`` float32, normalised like CIFAR.

    Args:
        name: ``Imagenet``, ``Imagenet_resize``, ``LSUN``, ``LSUN_resize`` or ``iSUN``.
        root: where to look (default ``cache_root()``): ``root/<name>/`` or ``root/<name>.tar.gz``.

    Returns:
        the images in the official loader's order, RGB, shorter side resized to 32 pixels and
        centre-cropped to 32x32 (a no-op for ODIN's square 32x32 JPEGs).

    Raises:
        ValueError: on an unknown name.
        DataNotFoundError: folder and archive missing and the download failed, or no images found.
        ChecksumError: when the archive's MD5 is not the published one.
    """
    from PIL import Image
    from torchvision.transforms import functional as TF

    if name not in ODIN_ARCHIVES:
        raise ValueError(f"unknown ODIN OOD set {name!r}; choose from {', '.join(ODIN_OOD_SETS)}.")
    spec = ODIN_ARCHIVES[name]
    root, folder = _odin_folder(name, root)
    files = _image_files(folder)
    if not files:
        raise DataNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {folder}; "
                                f"delete it and extract {spec.filename} (from {spec.url}) into {root}.")
    images = []
    for path in files:
        with Image.open(path) as img:
            img = TF.center_crop(TF.resize(img.convert("RGB"), 32), [32, 32])
            images.append(TF.pil_to_tensor(img))  # (3, 32, 32) uint8
    return normalize_cifar(torch.stack(images).float().div_(255.0))


def cifar_noise(name: str, n: int = 10_000, seed: int = 0) -> torch.Tensor:
    """ODIN's noise sets at 3x32x32, normalised like CIFAR.

    ``gaussian``: ``clamp(N(0.5, 1), 0, 1)`` per pixel; ``uniform``: ``U[0, 1]`` per pixel.

    Shapes:
        returns ``(n, 3, 32, 32)`` float32.

    Raises:
        ValueError: on an unknown name or ``n < 1``.
    """
    return normalize_cifar(odin_noise(name, n, CIFAR_IMAGE_SHAPE, seed))


def data_present(id_dataset: str, ood_sets=CIFAR_OOD_SETS, root: Path | None = None) -> bool:
    """Whether a CIFAR ID set and the ODIN folders in ``ood_sets`` are on disk (folders or archives).

    Checks only that the files exist (no MD5, no download), to decide quickly whether a notebook
    can run the paper's protocol. Noise sets need no files.
    """
    root = Path(root) if root is not None else cache_root()
    cls = _cifar_class(id_dataset)
    if not ((root / cls.base_folder).is_dir() or (root / cls.filename).exists()):
        return False
    return all((root / name).is_dir() or (root / ODIN_ARCHIVES[name].filename).exists()
               for name in ood_sets if name in ODIN_ARCHIVES)


def ood_set_size(name: str, n: int = 10_000) -> int:
    """The number of images :func:`load_cifar_ood` would return; an ODIN folder is fetched and
    extracted when missing, its images counted, not decoded.

    Raises:
        ValueError, DataNotFoundError, ChecksumError: as :func:`load_cifar_ood`.
    """
    if name in NOISE_SETS:
        return n
    if name not in ODIN_ARCHIVES:
        raise ValueError(f"unknown OOD set {name!r} for a CIFAR ID set; choose from {', '.join(CIFAR_OOD_SETS)}.")
    return len(_image_files(_odin_folder(name)[1]))


def load_cifar_ood(name: str, n: int = 10_000, seed: int = 0) -> torch.Tensor:
    """An OOD set for a CIFAR ID set: an ODIN folder (N fixed by the folder) or noise (N = ``n``).

    Raises:
        ValueError: on an unknown name (the message lists the known ones).
        DataNotFoundError, ChecksumError: as :func:`load_odin_folder`.
    """
    if name in NOISE_SETS:
        return cifar_noise(name, n, seed)
    if name in ODIN_ARCHIVES:
        return load_odin_folder(name)
    raise ValueError(f"unknown OOD set {name!r} for a CIFAR ID set; choose from {', '.join(CIFAR_OOD_SETS)}.")
