"""Data: Fashion-MNIST and CIFAR as ID sets, the OOD sets, and where the files live.

* Folders: data is looked for in :func:`data_dir` (``$MCD_DATA_DIR``, else ``~/.cache/mcd_helpers``)
  and, when that cannot be written, in :func:`cache_dir`, where downloads and cached results go
  (``$MCD_CACHE_DIR``, else the user cache).
* Fashion-MNIST (Xiao et al. 2017), the CPU-sized ID set: ``<folder>/FashionMNIST/raw/``
  (torchvision's layout; the four IDX files ``.gz`` or extracted), then the Debian package
  ``dataset-fashion-mnist`` (read in place), then torchvision's download (into a private folder,
  renamed into place, so concurrent runs never see half-written files). Files are read in memory,
  never extracted.
* CIFAR-10/100 (Krizhevsky 2009) through torchvision's classes (download and MD5 checks), ODIN's
  OOD folders (Liang et al., ICLR 2018, arXiv 1706.02690; github.com/facebookresearch/odin) from
  their MD5-checked archives, read in ``ImageFolder`` order as the official loader does
  (github.com/YU1ut/UOOD-MCD ``utils/loader.py``), RGB, ``Resize(32)`` as it does, then a
  ``CenterCrop(32)`` it does not have (so that a non-square image is 32x32 too).
* Offline OOD sets for Fashion-MNIST (28x28): ``digits`` (scikit-learn's 1,797 8x8 digits,
  upsampled), ``photo_crops`` (random crops of scikit-learn's two sample photos, the analog of the
  paper's "crop" sets), ODIN's ``gaussian`` (``clamp(N(0.5, 1), 0, 1)``) and ``uniform`` noise;
  ``mnist`` when it can be had.

Images come back as ``(N, C, H, W)`` float32, normalised as the official code does (Fashion-MNIST
with its training set's mean and std; CIFAR with mean (125.3, 123.0, 113.9)/255, std (63.0, 62.1,
66.7)/255). Missing or damaged data raises :class:`~mcd_helpers.errors.DataNotFoundError` naming
where it looked and the fix.
"""

import gzip
import os
import random
import tempfile
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .errors import DataNotFoundError

FMNIST_MEAN, FMNIST_STD = 0.2860, 0.3530  # over the 60k training images, pixels in [0, 1]
# official code
CIFAR_MEAN, CIFAR_STD = (
    (125.3 / 255, 123.0 / 255, 113.9 / 255),
    (63.0 / 255, 62.1 / 255, 66.7 / 255),
)
DEBIAN_FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
ID_DATASETS = ("fashion_mnist", "cifar10", "cifar100")
OFFLINE_OOD_SETS = ("digits", "photo_crops", "gaussian", "uniform")
# name -> (archive MD5 as pytorch-ood records it, URL from ODIN's README, the paper's name)
ODIN_ARCHIVES = {
    name: (md5, f"https://www.dropbox.com/s/{key}/{name}.tar.gz", paper)
    for name, md5, key, paper in (
        ("Imagenet", "7c0827e4246c3718a5ee076e999e52e5", "avgm2u562itwpkl", "TINc"),
        ("Imagenet_resize", "0f9ff11d45babf2eff5fe12281d1ac31", "kp3my3412u5k9rl", "TINr"),
        ("LSUN", "458a0a0ab8e5f1cb4516d7400568e460", "fhtsw1m3qxlwj6h", "LSUNc"),
        ("LSUN_resize", "278b7b31c8cb7e804a1465a8ce03a2dc", "moqh2wh8696c3yl", "LSUNr"),
        ("iSUN", "be77b0f2c26fda898afac5f99645ee70", "ssz7qxfqae0cca5", "iSUN"),
    )
}
OOD_SETS = {
    "fashion_mnist": OFFLINE_OOD_SETS + ("mnist",),
    "cifar10": (*ODIN_ARCHIVES, "gaussian", "uniform"),
    "cifar100": (*ODIN_ARCHIVES, "gaussian", "uniform"),
}
_IDX = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


# ---- folders ------------------------------------------------------------------------------------


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcd_helpers"


def data_dir() -> Path:
    """``$MCD_DATA_DIR`` when set, else ``~/.cache/mcd_helpers`` (``$XDG_CACHE_HOME`` respected)."""
    return (
        Path(os.environ["MCD_DATA_DIR"]).expanduser()
        if os.environ.get("MCD_DATA_DIR")
        else _user_cache()
    )


def writable(folder: Path) -> bool:
    """Whether ``folder`` exists or can be made, and a file can be created in it (a probe, gone when
    closed)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        return True
    except OSError:
        return False


def cache_dir() -> Path:
    """Where downloads and cached stages go: :func:`data_dir` when writable, else ``$MCD_CACHE_DIR``
    or the user cache. Raises ``PermissionError`` naming both when neither can be written."""
    fallback = Path(os.environ.get("MCD_CACHE_DIR") or _user_cache()).expanduser()
    if found := next(
        (folder for folder in dict.fromkeys([data_dir(), fallback]) if writable(folder)), None
    ):
        return found
    raise PermissionError(
        f"neither the data folder {data_dir()} nor the cache folder {fallback} can be written; "
        "set MCD_CACHE_DIR to a writable folder."
    )


def _roots() -> list[Path]:
    return list(dict.fromkeys([data_dir(), cache_dir()]))


# ---- IDX files: Fashion-MNIST and MNIST ----------------------------------------------------------


def read_idx(path: Path, fix: str = "") -> torch.Tensor:
    """An IDX file of unsigned bytes (MNIST's format, yann.lecun.com/exdb/mnist), ``.gz`` or not,
    read in memory.

    Returns a uint8 tensor of the header's shape: ``(N, H, W)`` images or ``(N,)`` labels.

    Raises:
        DataNotFoundError: not gzip or cut short, a magic number other than 00000803/00000801, or a
            length other than the header's; the message names the file, the problem and ``fix``.
    """
    path = Path(path)
    try:
        data = gzip.open(path).read() if path.name.endswith(".gz") else path.read_bytes()
    # BadGzipFile is an OSError; a cut gzip an EOFError
    except (OSError, EOFError, zlib.error) as err:
        raise DataNotFoundError(
            f"{path} is cut short or not gzip ({type(err).__name__}: {err}). {fix}"
        ) from err
    if len(data) < 4 or data[:3] != b"\0\0\x08" or data[3] not in (1, 3):
        raise DataNotFoundError(
            f"{path} is not an IDX file of images or labels: its first bytes are "
            f"{data[:4].hex() or 'missing'}, not 00000803 (images) or 00000801 (labels). {fix}"
        )
    head = 4 + 4 * data[3]
    dims = tuple(np.frombuffer(data[4:head], ">u4").tolist()) if len(data) >= head else None
    if len(data) != (want := head + int(np.prod(dims)) if dims is not None else head):
        raise DataNotFoundError(
            f"{path} is {'cut short' if len(data) < want else 'longer than its header says'}: "
            f"{len(data)} bytes, its header's shape {dims} needs {want}. {fix}"
        )
    return torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8).view(*dims)


def _find(folder: Path, names) -> dict[str, Path] | None:
    """``{name: path}`` when every file is in ``folder``, extracted or ``.gz`` (extracted
    preferred)."""
    found = {
        n: next((p for p in (folder / n, folder / f"{n}.gz") if p.is_file()), None) for n in names
    }
    return None if None in found.values() else found


def _read_split(
    cls_name: str, split: str, debian: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``split`` of torchvision's ``cls_name`` IDX files: in a root's ``<cls_name>/raw``, else in
    ``debian``, else downloaded. Returns ``x (N, 1, 28, 28)`` in [0, 1], ``y (N,)`` int64;
    DataNotFoundError names the fix."""
    names = _IDX["train"] + _IDX["test"] if debian else _IDX["test"]
    folders = [r / cls_name / "raw" for r in _roots()]
    places = [
        (f, f"Delete it and put a good copy in {f}, or delete it to download it again.")
        for f in folders
    ]
    places += (
        [(debian, "Reinstall it: `sudo apt-get install --reinstall dataset-fashion-mnist`.")]
        if debian
        else []
    )
    files, fix = next(
        ((found, fix) for folder, fix in places if (found := _find(folder, names))), (None, "")
    )
    if files is None:
        import torchvision.datasets

        raw = cache_dir() / cls_name / "raw"
        try:
            with tempfile.TemporaryDirectory(prefix=".partial-", dir=cache_dir()) as tmp:
                getattr(torchvision.datasets, cls_name)(tmp, train=False, download=True)
                raw.mkdir(parents=True, exist_ok=True)
                for f in sorted((Path(tmp) / cls_name / "raw").iterdir()):
                    os.replace(f, raw / f.name)  # atomic: a concurrent run sees whole files or none
        except Exception as err:  # no network, a proxy, a full disk: all end the same way
            looked = [f"{f}/ (.gz or extracted)" for f in folders]
            looked += [f"{debian} (`sudo apt-get install dataset-fashion-mnist`)"] if debian else []
            raise DataNotFoundError(
                f"{cls_name} was not found. Looked in: {'; '.join(looked)} ($MCD_DATA_DIR = "
                f"{os.environ.get('MCD_DATA_DIR') or '(not set)'}); torchvision's download failed "
                f"({type(err).__name__}: {err}). Go online or put the files there."
            ) from err
        files, fix = _find(raw, names), "Delete it to download it again."
    images, labels = (files[n] for n in _IDX[split])
    x, y = read_idx(images, fix), read_idx(labels, fix)
    if (
        x.dim() != 3
        or tuple(x.shape[1:]) != (28, 28)
        or y.dim() != 1
        or len(y) != len(x)
        or (len(y) and y.max() > 9)
    ):
        raise DataNotFoundError(
            f"{images} ({tuple(x.shape)}) and {labels} ({tuple(y.shape)}, labels up to "
            f"{int(y.max()) if len(y) else '-'}) are not 28x28 images with a label 0-9 each. {fix}"
        )
    return x.unsqueeze(1).float().div_(255.0), y.long()  # (N, 1, 28, 28) in [0, 1]


def load_fashion_mnist(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST: ``x (N, 1, 28, 28)`` float32 normalised, ``y (N,)`` int64 in [0, 10); N =
    60,000 or 10,000.

    Raises:
        DataNotFoundError: when no place holds it (the message names them) or a file is damaged.
    """
    x, y = _read_split("FashionMNIST", "train" if train else "test", DEBIAN_FMNIST_DIR)
    return (x - FMNIST_MEAN) / FMNIST_STD, y


# ---- CIFAR and ODIN's folders (torchvision) ------------------------------------------------------


def normalize_cifar(x: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] ``(N, 3, H, W)`` -> ``(x - mean_c) / std_c`` with the official code's
    constants."""
    return (x - torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR_STD).view(
        1, 3, 1, 1
    )


def _archive(folder: str, filename: str, md5: str, url: str, what: str) -> Path:
    """The root holding ``folder``; when no root does, the MD5-checked archive (found, else
    downloaded) is extracted into a private folder of :func:`cache_dir` and renamed into place
    (never seen half-written). Raises DataNotFoundError naming the file, its MD5 and the URL."""
    if found := next((root for root in _roots() if (root / folder).is_dir()), None):
        return found
    from torchvision.datasets.utils import check_integrity, download_and_extract_archive

    src = next((r for r in _roots() if (r / filename).exists()), None)
    if src is not None and not check_integrity(str(src / filename), md5):
        raise DataNotFoundError(
            f"{src / filename} is corrupt (MD5 not {md5}); delete it and download {url} again."
        )
    try:
        with tempfile.TemporaryDirectory(prefix=".partial-", dir=cache_dir()) as tmp:
            download_and_extract_archive(
                url, src or tmp, extract_root=tmp, filename=filename, md5=md5
            )
            if not (cache_dir() / folder).is_dir():  # another run may have put it there meanwhile
                os.replace(Path(tmp) / folder, cache_dir() / folder)
    except Exception as err:
        raise DataNotFoundError(
            f"{what} was not found: looked for {folder}/ and {filename} in "
            f"{', '.join(map(str, _roots()))}; fetching {url} failed ({type(err).__name__}: {err})."
            f" Put {filename} (MD5 {md5}) in {data_dir()} ($MCD_DATA_DIR)."
        ) from err
    return cache_dir()


def load_cifar(name: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 or CIFAR-100 (fine labels): ``x (N, 3, 32, 32)`` float32 normalised, ``y (N,)``
    int64.

    Raises:
        ValueError: an unknown name. DataNotFoundError: missing, undownloadable, or a corrupt batch
        file.
    """
    from torchvision.datasets import CIFAR10, CIFAR100

    if name not in ("cifar10", "cifar100"):
        raise ValueError(
            f"{name!r} is no CIFAR data set (cifar10, cifar100; load_id also takes fashion_mnist)."
        )
    cls = CIFAR10 if name == "cifar10" else CIFAR100
    root = _archive(cls.base_folder, cls.filename, cls.tgz_md5, cls.url, cls.__name__)
    try:
        ds = cls(str(root), train=train, download=False)
    # torchvision: "Dataset not found or corrupted" (a batch file's MD5)
    except RuntimeError as err:
        raise DataNotFoundError(
            f"{root / cls.base_folder} is incomplete or corrupt ({err}). Delete it and "
            f"{cls.filename} to download {cls.url} (MD5 {cls.tgz_md5}) again."
        ) from err
    # (N, 3, 32, 32)
    x = torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).float().div_(255.0)
    return normalize_cifar(x), torch.as_tensor(ds.targets, dtype=torch.long)


def load_odin_folder(name: str) -> torch.Tensor:
    """One of ODIN's OOD sets (:data:`ODIN_ARCHIVES`) as ``(N, 3, 32, 32)`` float32, normalised like
    CIFAR."""
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    md5, url, _ = ODIN_ARCHIVES[name]
    root = _archive(name, f"{name}.tar.gz", md5, url, f"ODIN's {name} set")
    tf = transforms.Compose(
        [transforms.Resize(32), transforms.CenterCrop(32), transforms.PILToTensor()]
    )
    try:
        # official order, RGB
        images = [img for img, _ in ImageFolder(str(root / name), transform=tf)]
    except (FileNotFoundError, RuntimeError) as err:
        raise DataNotFoundError(
            f"no images in the sub-folders of {root / name} ({err}); delete it and extract "
            f"{name}.tar.gz (from {url}) again."
        ) from err
    return normalize_cifar(torch.stack(images).float().div_(255.0))


def data_present(id_dataset: str, ood_sets=ODIN_ARCHIVES) -> bool:
    """Whether a CIFAR ID set and ODIN's folders in ``ood_sets`` are on disk (folders or archives;
    no checksums): can a notebook run the paper's protocol here?"""
    base = {"cifar10": "cifar-10", "cifar100": "cifar-100"}[id_dataset]
    names = [
        (
            f"{base}-batches-py" if id_dataset == "cifar10" else "cifar-100-python",
            f"{base}-python.tar.gz",
        )
    ]
    names += [(o, f"{o}.tar.gz") for o in ood_sets if o in ODIN_ARCHIVES]
    return all(any((r / a).is_dir() or (r / b).exists() for r in _roots()) for a, b in names)


# ---- the data sets by name -----------------------------------------------------------------------


def load_id(name: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An ID set of :data:`ID_DATASETS`: ``x (N, C, H, W)`` normalised, ``y (N,)``. ValueError on
    another name (:func:`load_cifar`'s)."""
    return load_fashion_mnist(train) if name == "fashion_mnist" else load_cifar(name, train)


def odin_noise(name: str, n: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """ODIN's noise sets, pixels in [0, 1] (not normalised), ``(n, *shape)`` float32 from a
    generator seeded with ``seed``: ``gaussian`` ``clamp(N(0.5, 1), 0, 1)``, ``uniform`` ``U[0, 1]``
    per pixel."""
    if name not in ("gaussian", "uniform") or n < 1:
        raise ValueError(
            f"a noise set is gaussian or uniform with n >= 1 samples, got {name!r}, n={n}."
        )
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn((n, *shape), generator=g)
        if name == "gaussian"
        else torch.rand((n, *shape), generator=g)
    )
    return torch.clamp(x + 0.5, 0.0, 1.0) if name == "gaussian" else x


def load_ood(
    name: str, n: int = 10_000, seed: int = 0, id_dataset: str = "fashion_mnist"
) -> torch.Tensor:
    """An OOD set for ``id_dataset`` (:data:`OOD_SETS`), normalised like it: ``(N, C, H, W)``
    float32.

    Fashion-MNIST, ``(N, 1, 28, 28)``: ``digits`` (N = 1,797), ``photo_crops``, ``gaussian``,
    ``uniform`` (N = ``n``, drawn with ``seed``), ``mnist`` (its 10,000 test images). CIFAR,
    ``(N, 3, 32, 32)``: ODIN's folders (N fixed by the folder) or ``gaussian``/``uniform``.

    Raises:
        ValueError: an unknown name or ``n < 1``. DataNotFoundError: ``mnist`` or an ODIN folder
            that is neither on disk nor downloadable.
    """
    if name not in OOD_SETS.get(id_dataset, ()):
        raise ValueError(
            f"unknown OOD set {name!r} for {id_dataset}; choose from "
            f"{', '.join(OOD_SETS.get(id_dataset, ())) or 'none (unknown ID set)'}."
        )
    if n < 1:
        raise ValueError(f"an OOD set needs at least one sample, got n={n}.")
    if name in ODIN_ARCHIVES:
        return load_odin_folder(name)
    if name in ("gaussian", "uniform"):
        x = odin_noise(name, n, (1, 28, 28) if id_dataset == "fashion_mnist" else (3, 32, 32), seed)
    elif name == "digits":
        from sklearn.datasets import load_digits
        from torchvision.transforms.functional import resize

        # (1797, 1, 8, 8)
        x8 = torch.from_numpy(load_digits().images).float().div_(16.0).unsqueeze(1)
        x = resize(x8, [28, 28], antialias=True).clamp_(0.0, 1.0)
    elif name == "photo_crops":  # windows of scikit-learn's two (1, 427, 640) photos, in grayscale
        from sklearn.datasets import load_sample_images
        from torchvision.transforms.functional import rgb_to_grayscale

        photos = [
            rgb_to_grayscale(torch.from_numpy(np.array(img)).permute(2, 0, 1)).float().div_(255.0)
            for img in load_sample_images().images
        ]
        g, crops = torch.Generator().manual_seed(seed), []
        for i in torch.randint(len(photos), (n,), generator=g).tolist():
            # h, w
            top, left = (
                int(torch.randint(size - 27, (1,), generator=g)) for size in photos[i].shape[1:]
            )
            crops.append(photos[i][:, top : top + 28, left : left + 28])
        x = torch.stack(crops)  # (n, 1, 28, 28)
    else:  # mnist
        x = _read_split("MNIST", "test")[0]
    return normalise(x, id_dataset)


def normalise(x: torch.Tensor, id_dataset: str) -> torch.Tensor:
    """Images ``(N, C, H, W)`` in [0, 1] normalised as ``id_dataset``'s are (Fashion-MNIST's one
    mean and std, or CIFAR's per channel)."""
    return (x - FMNIST_MEAN) / FMNIST_STD if id_dataset == "fashion_mnist" else normalize_cifar(x)


def pixel_std(id_dataset: str):
    """The std (pixel units) that normalises ``id_dataset``'s images: one number or one per
    channel."""
    return FMNIST_STD if id_dataset == "fashion_mnist" else CIFAR_STD


def normalised_black(id_dataset: str) -> torch.Tensor:
    """The normalised value of a black pixel of ``id_dataset``'s images, per channel, ``(C,)``:
    what torchvision's padding, applied before normalising, becomes after it."""
    channels = 1 if id_dataset == "fashion_mnist" else 3
    return normalise(torch.zeros(1, channels, 1, 1), id_dataset).flatten()


def crop_flip(
    x: torch.Tensor,
    generator: torch.Generator,
    pad: int = 4,
    fill: torch.Tensor | float = 0.0,
    share: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """Each image of ``x`` padded by ``pad`` pixels of ``fill`` on every side, cropped back to its
    size at a random offset, and flipped left-right with probability 1/2: the CIFAR augmentation of
    the unofficial reproduction (``RandomHorizontalFlip()``, ``RandomCrop(32, padding=4)``; its
    ``main.py`` lines 37-42), on images already normalised (``fill``: :func:`normalised_black`, the
    value torchvision's padding has after normalisation, one per channel or one number). The random
    numbers come from ``generator`` (a CPU generator), so a batch's augmentation can be drawn again.
    ``share=(rank, world)``: ``x`` is rows ``[rank::world]`` of a global batch of ``N * world``
    images (under torchrun); the random numbers are drawn for the global batch and this share's
    taken, so that every image gets what it would get in one process.

    Shapes: ``(N, C, H, W)`` -> ``(N, C, H, W)``.

    Raises:
        ValueError: ``x`` not 4-d, or ``pad`` < 0.
    """
    if x.dim() != 4 or pad < 0:
        raise ValueError(
            f"crop_flip takes images (N, C, H, W) and pad >= 0, got shape {tuple(x.shape)} and "
            f"pad={pad}."
        )
    n, c, h, w = x.shape
    fill = torch.as_tensor(fill, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)
    padded = fill.expand(c, h + 2 * pad, w + 2 * pad).repeat(n, 1, 1, 1)
    padded[:, :, pad : pad + h, pad : pad + w] = x
    rank, world = share
    top, left = (torch.randint(2 * pad + 1, (n * world,), generator=generator) for _ in range(2))
    flip = torch.rand(n * world, generator=generator) < 0.5
    top, left, flip = (t[rank::world] for t in (top, left, flip))  # this share of the global batch
    rows = (top[:, None] + torch.arange(h)).to(x.device)  # (n, h)
    cols = (left[:, None] + torch.arange(w)).to(x.device)  # (n, w)
    flip = flip.to(x.device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch, channel = torch.arange(n, device=x.device), torch.arange(c, device=x.device)
    index = (
        batch[:, None, None, None],
        channel[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    )
    return padded[index]


def infinite_loader(loader) -> Iterator:
    """Yield batches forever, iterating ``loader`` again each time it runs out.

    Each pass starts a new iterator, so a shuffling loader reshuffles and nothing is stored. Use it
    to pair a labeled loader with an unlabeled one of another length (the official code restarts its
    unlabeled iterator each epoch). Not ``itertools.cycle`` (it stores the first pass and replays it
    unshuffled), not ``zip`` (it stops at the shorter loader), never ``loader[i]`` (not
    subscriptable).

    Raises:
        ValueError: if the loader yields no batch at all (it would loop forever).
    """
    while True:
        yielded = 0
        for yielded, batch in enumerate(loader, 1):
            yield batch
        if not yielded:
            raise ValueError(
                "the loader yields no batch (empty data set, or drop_last=True and < "
                "batch_size samples)."
            )


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's generators (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
