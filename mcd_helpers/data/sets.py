"""Data for MCD on CPU: Fashion-MNIST as the ID set, offline OOD sets, the transductive split.

* ID: Fashion-MNIST (Xiao et al. 2017), looked for in three places, in order:
  1. ``$MCD_DATA_DIR/FashionMNIST/raw/`` (torchvision's layout; each of the four IDX files
     ``.gz`` or extracted), then the same folder in the writable fallback cache
     (:func:`~mcd_helpers.data.files.writable_cache_root`);
  2. the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/``, ``.gz``);
  3. torchvision's download into the cache root (into a private folder, then renamed into place).
  The cache root is ``$MCD_DATA_DIR`` when set, else ``~/.cache/mcd_helpers``. Files are read in
  memory (:func:`~mcd_helpers.data.files.read_idx`), never extracted to disk; a damaged file raises
  :class:`CorruptDataError` naming the file, what is wrong and the fix.
* OOD sets that need no network, all 28x28 grayscale in [0, 1]: ``digits`` (scikit-learn's
  1,797 handwritten 8x8 digits, upsampled), ``photo_crops`` (random crops of scikit-learn's two
  sample photos, the analog of the paper's TinyImageNet/LSUN "crop" sets), ``gaussian`` and
  ``uniform`` noise as ODIN defines them (Liang et al. 2018, arXiv 1706.02690); ``mnist``
  through torchvision when it can be had.
* The transductive split of the official code (github.com/YU1ut/UOOD-MCD ``utils/loader.py``):
  the ID test set and the OOD set are each permuted with ``np.random.seed(3)``; the first 1,000 of
  each are validation, the rest is both the unlabeled fine-tuning set and the test set.

All image tensors are ``(N, 1, 28, 28)`` float32, normalised with Fashion-MNIST's mean and std.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from .cifar import load_cifar, load_cifar_ood
from .files import (cache_root, check_writable, data_roots, move_into_place, odin_noise, private_folder,
                        read_idx, writable_cache_root)
from ..errors import CorruptDataError, DataNotFoundError

__all__ = ["load_id", "odin_noise", "ID_DATASETS", "FMNIST_MEAN", "FMNIST_STD", "DEBIAN_FMNIST_DIR", "OFFLINE_OOD_SETS", "OOD_SETS",
           "DataNotFoundError", "CorruptDataError", "cache_root", "writable_cache_root", "check_writable",
           "load_fashion_mnist", "load_ood", "ood_set_size", "normalize",
           "TransductiveSplit", "transductive_split", "infinite_loader", "IMAGE_SHAPE"]

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530  # over the 60k training images, pixels in [0, 1]
DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
IMAGE_SHAPE = (1, 28, 28)
OFFLINE_OOD_SETS = ("digits", "photo_crops", "gaussian", "uniform")
OOD_SETS = OFFLINE_OOD_SETS + ("mnist",)
_FMNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                 "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_MNIST_TEST_FILES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Map pixels in [0, 1] to Fashion-MNIST's standardised scale: (x - mean) / std."""
    return (x - FMNIST_MEAN) / FMNIST_STD


def _find(folder: Path, names: tuple[str, ...]) -> dict[str, Path] | None:
    """``{name: path}`` when every file is in ``folder``, extracted or as ``.gz`` (extracted preferred)."""
    found = {}
    for name in names:
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
        else:
            return None
    return found


def _has_fmnist(root: Path) -> bool:
    return _find(root / "FashionMNIST" / "raw", _FMNIST_FILES) is not None


def _download_idx(cls_name: str, folder_name: str, names: tuple[str, ...]) -> dict[str, Path]:
    """torchvision's download of ``cls_name`` into a private folder, its raw files then renamed into place."""
    import torchvision.datasets

    root, _ = writable_cache_root()
    raw = root / folder_name / "raw"
    with private_folder(root) as tmp:
        getattr(torchvision.datasets, cls_name)(str(tmp), train=False, download=True)
        for f in sorted((tmp / folder_name / "raw").iterdir()):
            move_into_place(f, raw / f.name)
    found = _find(raw, names)
    if found is None:
        raise DataNotFoundError(f"torchvision's download of {cls_name} left no complete set of files in {raw}.")
    return found


def _fmnist_files() -> tuple[dict[str, Path], str]:
    """Fashion-MNIST's four IDX files (``{name: path}``) and the fix to print if one is damaged."""
    env = os.environ.get("MCD_DATA_DIR")
    for root in data_roots():
        found = _find(root / "FashionMNIST" / "raw", _FMNIST_FILES)
        if found is not None:
            return found, ("Delete it and put a good copy there (from github.com/zalandoresearch/fashion-mnist), "
                           "or delete it to let torchvision download it.")
    found = _find(DEBIAN_FMNIST_DIR, _FMNIST_FILES)
    if found is not None:
        return found, "Reinstall the package: `sudo apt-get install --reinstall dataset-fashion-mnist`."
    try:
        found = _download_idx("FashionMNIST", "FashionMNIST", _FMNIST_FILES)
    except Exception as err:  # no network, a proxy, a full disk, a read-only folder: all end the same way
        root = cache_root()
        raise DataNotFoundError(
            "Fashion-MNIST (the ID set) was not found. Looked in:\n"
            f"  1. $MCD_DATA_DIR = {env or '(not set)'}: put the four IDX files (.gz or extracted) "
            f"in {root / 'FashionMNIST' / 'raw'}/;\n"
            f"  2. {DEBIAN_FMNIST_DIR}: install the Debian package with "
            "`sudo apt-get install dataset-fashion-mnist`;\n"
            f"  3. torchvision's download into {root}: failed with {type(err).__name__}: {err}. "
            "Connect to the internet, or fill place 1 or 2.") from err
    return found, "Delete it to let torchvision download it again."


def _read_images_labels(images: Path, labels: Path, fix: str, n_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = read_idx(images, fix), read_idx(labels, fix)
    if x.dim() != 3 or tuple(x.shape[1:]) != (28, 28):
        raise CorruptDataError(f"{images} holds images of shape {tuple(x.shape[1:])}, expected 28x28. {fix}")
    if y.dim() != 1 or len(y) != len(x):
        raise CorruptDataError(f"{labels} holds {tuple(y.shape)} labels for the {len(x)} images of {images}; "
                               f"the two files do not belong together. {fix}")
    if len(y) and int(y.max()) >= n_classes:
        raise CorruptDataError(f"{labels} holds the label {int(y.max())}, expected 0-{n_classes - 1}. {fix}")
    return x, y


def load_fashion_mnist(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST as normalised tensors.

    The IDX files are read in memory (``.gz`` or extracted, :func:`~mcd_helpers.data.files.read_idx`);
    nothing is extracted to disk.

    Returns:
        ``(x, y)``: ``x`` of shape ``(N, 1, 28, 28)`` float32 (normalised), ``y`` of shape ``(N,)``
        int64 in [0, 10); N = 60,000 (train) or 10,000 (test).

    Raises:
        DataNotFoundError: when none of the three places holds the data (see the module docstring).
        CorruptDataError: (a DataNotFoundError) when a file is cut short, not gzip or not IDX, or
            images and labels do not match; the message names the file and the fix.
    """
    files, fix = _fmnist_files()
    split = "train" if train else "t10k"
    x, y = _read_images_labels(files[f"{split}-images-idx3-ubyte"], files[f"{split}-labels-idx1-ubyte"], fix)
    x = x.unsqueeze(1).float().div_(255.0)  # (N, 1, 28, 28) in [0, 1]
    return normalize(x), y.long()


ID_DATASETS = ("fashion_mnist", "cifar10", "cifar100")


def load_id(name: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An ID data set by name as normalised tensors ``x: (N, C, H, W)``, ``y: (N,)``.

    ``fashion_mnist``: ``(N, 1, 28, 28)``; ``cifar10``/``cifar100``: ``(N, 3, 32, 32)``
    (:func:`mcd_helpers.data.cifar.load_cifar`).

    Raises:
        ValueError: on an unknown name.
        DataNotFoundError: when the data cannot be found (the message says where it looked).
    """
    if name == "fashion_mnist":
        return load_fashion_mnist(train)
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, train)
    raise ValueError(f"unknown ID data set {name!r}; choose from {', '.join(ID_DATASETS)}.")


# ----------------------------------------------------------------------------------------------
# OOD sets
# ----------------------------------------------------------------------------------------------

def _digits() -> torch.Tensor:
    from sklearn.datasets import load_digits
    from torchvision.transforms.functional import resize

    x = torch.from_numpy(load_digits().images).float().div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8)
    return resize(x, [28, 28], antialias=True).clamp_(0.0, 1.0)


def _photo_crops(n: int, generator: torch.Generator) -> torch.Tensor:
    from sklearn.datasets import load_sample_images
    from torchvision.transforms.functional import rgb_to_grayscale

    photos = [rgb_to_grayscale(torch.from_numpy(np.array(img)).permute(2, 0, 1)).float().div_(255.0)
              for img in load_sample_images().images]  # two (1, 427, 640) grayscale photos
    which = torch.randint(len(photos), (n,), generator=generator)
    crops = []
    for i in which.tolist():
        _, h, w = photos[i].shape
        top = int(torch.randint(h - 27, (1,), generator=generator))
        left = int(torch.randint(w - 27, (1,), generator=generator))
        crops.append(photos[i][:, top:top + 28, left:left + 28])
    return torch.stack(crops)  # (n, 1, 28, 28)


def _mnist() -> torch.Tensor:
    """MNIST's 10,000 test images ``(10000, 1, 28, 28)`` in [0, 1]: from the cache folders, else downloaded."""
    for root in data_roots():
        found = _find(root / "MNIST" / "raw", _MNIST_TEST_FILES)
        if found is not None:
            fix = f"Delete it to let torchvision download it again (or put a good copy in {root / 'MNIST' / 'raw'})."
            break
    else:
        try:
            found = _download_idx("MNIST", "MNIST", _MNIST_TEST_FILES)
        except Exception as err:
            root = cache_root()
            raise DataNotFoundError(
                f"MNIST was not found in {root}/MNIST/raw/ and torchvision's download failed "
                f"({type(err).__name__}). Put MNIST's IDX files there (set $MCD_DATA_DIR to choose "
                "the folder) or connect to the internet; the offline OOD sets are "
                f"{', '.join(OFFLINE_OOD_SETS)}.") from err
        fix = "Delete it to let torchvision download it again."
    x, _ = _read_images_labels(found["t10k-images-idx3-ubyte"], found["t10k-labels-idx1-ubyte"], fix)
    return x.unsqueeze(1).float().div_(255.0)


def load_ood(name: str, n: int = 10_000, seed: int = 0, id_dataset: str = "fashion_mnist") -> torch.Tensor:
    """An OOD set as a tensor ``(N, C, H, W)`` float32, normalised like the ID set ``id_dataset``.

    For ``id_dataset="fashion_mnist"``, ``(N, 1, 28, 28)``:

    Args:
        name: one of ``digits`` (N = 1,797 always), ``photo_crops``, ``gaussian``, ``uniform``
            (N = ``n``, drawn with ``seed``) or ``mnist`` (N = 10,000, the MNIST test set).
        n: size of the generated sets (ODIN uses 10,000).
        seed: seed of the generated sets.

    For ``cifar10``/``cifar100``, ``(N, 3, 32, 32)``: ODIN's folders ``Imagenet``,
    ``Imagenet_resize``, ``LSUN``, ``LSUN_resize``, ``iSUN`` or noise ``gaussian``, ``uniform``
    (:func:`mcd_helpers.data.cifar.load_cifar_ood`).

    Raises:
        ValueError: on an unknown name or ``n < 1``.
        DataNotFoundError: for ``mnist`` or an ODIN folder when it is neither on disk nor
            downloadable (:class:`mcd_helpers.data.cifar.ChecksumError` for a corrupt archive).
    """
    if id_dataset in ("cifar10", "cifar100"):
        return load_cifar_ood(name, n, seed)
    if id_dataset != "fashion_mnist":
        raise ValueError(f"no OOD sets defined for ID data set {id_dataset!r}; "
                         "known: fashion_mnist, cifar10, cifar100.")
    if name not in OOD_SETS:
        raise ValueError(f"unknown OOD set {name!r}; choose from {', '.join(OOD_SETS)}.")
    if n < 1:
        raise ValueError(f"an OOD set needs at least one sample, got n={n}.")
    g = torch.Generator().manual_seed(seed)
    if name == "digits":
        x = _digits()
    elif name == "photo_crops":
        x = _photo_crops(n, g)
    elif name in ("gaussian", "uniform"):
        x = odin_noise(name, n, IMAGE_SHAPE, seed)
    else:
        x = _mnist()
    return normalize(x)


def ood_set_size(name: str, n: int = 10_000, id_dataset: str = "fashion_mnist") -> int:
    """The number of images :func:`load_ood` would return, making sure the set can be had (cheap).

    Files are looked for (and downloaded or extracted when missing) but generated sets are not
    drawn and ODIN's images not decoded, so a run can check every OOD set before training.

    Raises:
        ValueError: on an unknown name; DataNotFoundError (or ChecksumError, CorruptDataError):
            when the set cannot be had.
    """
    if id_dataset in ("cifar10", "cifar100"):
        from .cifar import ood_set_size as cifar_ood_set_size

        return cifar_ood_set_size(name, n)
    if name not in OOD_SETS:
        raise ValueError(f"unknown OOD set {name!r}; choose from {', '.join(OOD_SETS)}.")
    if name == "digits":
        return 1797
    if name == "mnist":
        return len(_mnist())
    return n


# ----------------------------------------------------------------------------------------------
# The transductive split and loaders
# ----------------------------------------------------------------------------------------------

@dataclass
class TransductiveSplit:
    """ID test set + OOD set split as the official code does it.

    ``val_*`` are the first ``n_val`` of each permuted set (model selection); ``test_*`` the rest,
    which is both the unlabeled fine-tuning data and the test data (the paper's transductive
    setting). Shapes: ``x`` ``(N, 1, 28, 28)``, ``y`` ``(N,)`` (ID labels).
    """
    val_id_x: torch.Tensor
    val_id_y: torch.Tensor
    val_ood_x: torch.Tensor
    test_id_x: torch.Tensor
    test_id_y: torch.Tensor
    test_ood_x: torch.Tensor

    def unlabeled(self) -> TensorDataset:
        """The unlabeled fine-tuning set: test ID + test OOD images, ``(N_id + N_ood, 1, 28, 28)``."""
        return TensorDataset(torch.cat([self.test_id_x, self.test_ood_x]))


def transductive_split(id_x: torch.Tensor, id_y: torch.Tensor, ood_x: torch.Tensor,
                       n_val: int = 1000, seed: int = 3) -> TransductiveSplit:
    """Permute the ID test set and the OOD set with ``np.random.seed(seed)`` and split each.

    Follows ``utils/loader.py`` of the official code (seed 3, 1,000 validation samples of each).

    Raises:
        ValueError: if either set has no more than ``n_val`` samples (nothing would be left to
            test on) or the ID images and labels differ in length.
    """
    if len(id_x) != len(id_y):
        raise ValueError(f"id_x has {len(id_x)} images but id_y {len(id_y)} labels.")
    for name, x in (("ID test set", id_x), ("OOD set", ood_x)):
        if len(x) <= n_val:
            raise ValueError(f"the {name} has {len(x)} samples, but the first n_val={n_val} go to "
                             "validation and at least one must be left for testing; "
                             "pass a smaller n_val or a larger set.")
    p_id = torch.from_numpy(np.random.RandomState(seed).permutation(len(id_x)))
    p_ood = torch.from_numpy(np.random.RandomState(seed).permutation(len(ood_x)))
    return TransductiveSplit(
        val_id_x=id_x[p_id[:n_val]], val_id_y=id_y[p_id[:n_val]], val_ood_x=ood_x[p_ood[:n_val]],
        test_id_x=id_x[p_id[n_val:]], test_id_y=id_y[p_id[n_val:]], test_ood_x=ood_x[p_ood[n_val:]])


def infinite_loader(loader: DataLoader) -> Iterator:
    """Yield batches forever, iterating ``loader`` again each time it runs out.

    A new pass starts a new iterator, so a shuffling loader reshuffles and nothing is stored.
    Use it to pair a labeled loader with an unlabeled one of another length (the official code
    restarts its unlabeled iterator the same way). Not ``itertools.cycle`` (it stores the first
    pass and replays it unshuffled), not ``zip`` (stops at the shorter loader), and never
    ``loader[i]`` (a DataLoader is not subscriptable).

    Raises:
        ValueError: if the loader yields no batch at all (it would loop forever).
    """
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("infinite_loader got a loader that yields no batches "
                             "(empty data set, or drop_last=True with fewer samples than batch_size).")
