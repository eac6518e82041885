"""mcd_helpers.data: folders, IDX files, the Fashion-MNIST lookup order, CIFAR and ODIN's folders on
stand-ins written here (torchvision's pickles, tar.gz of PNGs), the OOD sets and the loader helper.
No network: every download is cut (urllib, and torchvision's IDX classes replaced)."""

import gzip
import hashlib
import itertools
import math
import os
import pickle
import re
import tarfile
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import CIFAR10, CIFAR100

import mcd_helpers.data as data
from mcd_helpers.data import (
    DataNotFoundError,
    data_present,
    infinite_loader,
    load_id,
    load_ood,
    odin_noise,
    pixel_std,
    read_idx,
)

# the docstrings' Fashion-MNIST statistics (checked on the raw pixels below)
FM_MEAN, FM_STD = (0.2860, 0.3530)
CIFAR_MEAN = np.array([125.3, 123.0, 113.9]) / 255
CIFAR_STD = np.array([63.0, 62.1, 66.7]) / 255
# P(Z < -0.5) = 0.3085: clamp(N(0.5, 1), 0, 1) at 0 (and at 1)
PHI_MINUS_HALF = 0.5 * math.erfc(0.5 / math.sqrt(2))
REAL_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _no_network(*args, **kwargs):
    raise OSError("no network in tests")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)


@pytest.fixture
def no_debian(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "no-debian")
    return tmp_path / "no-debian"


# ---- folders ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, want",
    [
        ({"MCD_DATA_DIR": "~/mine", "XDG_CACHE_HOME": "/x"}, Path.home() / "mine"),
        ({"MCD_DATA_DIR": "", "XDG_CACHE_HOME": "/x/cache"}, Path("/x/cache/mcd_helpers")),
        ({"MCD_DATA_DIR": None, "XDG_CACHE_HOME": None}, Path.home() / ".cache" / "mcd_helpers"),
    ],
)
def test_data_dir(monkeypatch, env, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v) if v is not None else monkeypatch.delenv(k, raising=False)
    assert data.data_dir() == want


def test_writable_makes_the_folder_and_leaves_no_probe(tmp_path):
    folder = tmp_path / "a" / "b"
    assert data.writable(folder) and folder.is_dir() and list(folder.iterdir()) == []
    (tmp_path / "file").write_text("x")
    # under a file: no folder can be made (even as root)
    assert not data.writable(tmp_path / "file" / "sub")


def test_cache_dir_is_the_data_folder_then_the_fallback(tmp_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback"))
    assert data.cache_dir() == tmp_data_dir
    real = data.writable
    # a read-only data folder
    monkeypatch.setattr(data, "writable", lambda f: Path(f) != tmp_data_dir and real(f))
    assert data.cache_dir() == tmp_path / "fallback"
    monkeypatch.setattr(data, "writable", lambda f: False)
    with pytest.raises(
        PermissionError,
        match=f"{re.escape(str(tmp_data_dir))}.*{re.escape(str(tmp_path / 'fallback'))}.*"
        "MCD_CACHE_DIR",
    ):
        data.cache_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into chmod-555 folders")
def test_a_really_read_only_data_folder_falls_back(tmp_data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback"))
    tmp_data_dir.mkdir()
    tmp_data_dir.chmod(0o555)
    try:
        assert data.cache_dir() == tmp_path / "fallback"
    finally:
        tmp_data_dir.chmod(0o755)


# ---- IDX files -----------------------------------------------------------------------------------


def idx_bytes(array):
    """MNIST's IDX format by hand: 0, 0, type 0x08 (ubyte), ndim; each size as 4 bytes big-endian;
    the bytes."""
    return (
        bytes([0, 0, 8, array.ndim])
        + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
        + array.astype(np.uint8).tobytes()
    )


def write_idx(path, array, gz):
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = idx_bytes(array)
    if gz:
        with gzip.open(f"{path}.gz", "wb") as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


def fake_set(folder, gz=True, seed=0, names=("train", "t10k"), n=(4, 3)):
    """Four (or two) IDX files of a stand-in Fashion-MNIST in ``folder``; returns {split: (images,
    labels)}."""
    rng, out = np.random.RandomState(seed), {}
    for split, k in zip(names, n):
        out[split] = rng.randint(0, 256, (k, 28, 28)), rng.randint(0, 10, k)
        write_idx(folder / f"{split}-images-idx3-ubyte", out[split][0], gz)
        write_idx(folder / f"{split}-labels-idx1-ubyte", out[split][1], gz)
    return out


def normalised(images):
    return (torch.from_numpy(images).float().unsqueeze(1) / 255 - FM_MEAN) / FM_STD


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "extracted"])
@pytest.mark.parametrize(
    "array",
    [np.arange(2 * 3 * 5).reshape(2, 3, 5) * 7 % 256, np.array([9, 0, 255, 3])],
    ids=["images", "labels"],
)
def test_read_idx(tmp_path, gz, array):
    write_idx(tmp_path / "f", array, gz)
    x = read_idx(tmp_path / ("f.gz" if gz else "f"))
    assert x.dtype == torch.uint8 and x.tolist() == array.tolist()


# (file name, bytes written, the problem the message names); the file: 16 header + 160 bytes
DAMAGES = [
    ("f", lambda b: b[:-5], r"\b171 bytes\b.*\(5, 4, 8\).*\b176\b"),
    ("f", lambda b: b[:6], r"\b6 bytes\b.*\bNone\b.*\b16\b"),
    ("f", lambda b: b + b"\0" * 3, r"\b179 bytes\b.*\(5, 4, 8\).*\b176\b"),
    ("f", lambda b: b"\0\0\x09\x03" + b[4:], r"\b00000903\b"),
    ("f", lambda b: b"", r"\bmissing\b"),
    ("f.gz", lambda b: b, r"\bBadGzipFile\b"),
    ("f.gz", lambda b: gzip.compress(b)[:-30], r"\bEOFError\b"),
]


@pytest.mark.parametrize("name, damage, problem", DAMAGES)
def test_read_idx_names_the_damage_and_the_fix(tmp_path, name, damage, problem):
    (tmp_path / name).write_bytes(
        damage(idx_bytes(np.random.RandomState(0).randint(0, 256, (5, 4, 8))))
    )
    with pytest.raises(
        DataNotFoundError, match=f"{re.escape(str(tmp_path / name))}.*{problem}.*Do this"
    ):
        read_idx(tmp_path / name, fix="Do this.")


# ---- Fashion-MNIST: where it is looked for, in order ---------------------------------------------


def test_lookup_order_data_folder_then_debian_then_download(tmp_data_dir, tmp_path, monkeypatch):
    import torchvision.datasets

    deb = tmp_path / "debian"
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", deb)
    downloaded = []

    # torchvision's FashionMNIST(root, train=False, download=True)
    def download(root, train, download):
        downloaded.append(Path(root))
        fake_set(Path(root) / "FashionMNIST" / "raw", seed=3)

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", download)
    raw = tmp_data_dir / "FashionMNIST" / "raw"
    sets = {"data": fake_set(raw, seed=1), "debian": fake_set(deb, seed=2)}
    x, y = data.load_fashion_mnist(train=False)  # 1. $MCD_DATA_DIR/FashionMNIST/raw
    torch.testing.assert_close(x, normalised(sets["data"]["t10k"][0]))
    (raw / "train-labels-idx1-ubyte.gz").unlink()  # an incomplete folder is passed over
    x, y = data.load_fashion_mnist(train=True)  # 2. the Debian package, read in place
    torch.testing.assert_close(x, normalised(sets["debian"]["train"][0]))
    assert y.tolist() == sets["debian"]["train"][1].tolist() and y.dtype == torch.int64
    # nothing extracted or copied
    assert sorted(p.name for p in raw.iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
        "train-images-idx3-ubyte.gz",
    ]
    assert downloaded == []
    for p in deb.iterdir():
        p.unlink()
    # 3. torchvision's download, in a private folder, renamed into raw
    x, y = data.load_fashion_mnist(train=False)
    assert (
        len(downloaded) == 1
        and downloaded[0].parent == tmp_data_dir
        and downloaded[0].name.startswith(".partial-")
    )
    assert y.tolist() == fake_set(tmp_path / "again", seed=3)["t10k"][1].tolist()
    # the private folder is gone
    assert sorted(p.name for p in tmp_data_dir.iterdir()) == ["FashionMNIST"]
    # the downloaded four, three of them over the files there were
    assert len(list(raw.iterdir())) == 4
    data.load_fashion_mnist(train=False)
    assert len(downloaded) == 1  # found in place next time


def test_extracted_files_are_preferred_to_gz(tmp_data_dir, no_debian):
    raw = tmp_data_dir / "FashionMNIST" / "raw"
    fake_set(raw, gz=True, seed=1)
    want = fake_set(raw, gz=False, seed=2)["t10k"]
    x, y = data.load_fashion_mnist(train=False)
    torch.testing.assert_close(x, normalised(want[0]))
    assert y.tolist() == want[1].tolist()


def test_missing_fashion_mnist_names_every_place_and_the_download_error(
    tmp_data_dir, no_debian, monkeypatch
):
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", lambda *a, **k: _no_network())
    with pytest.raises(
        DataNotFoundError,
        match=(
            f"FashionMNIST.*{re.escape(str(tmp_data_dir / 'FashionMNIST' / 'raw'))}/.*"
            f"{re.escape(str(no_debian))}.*sudo apt-get install dataset-fashion-mnist.*"
            rf"\$MCD_DATA_DIR = {re.escape(str(tmp_data_dir))}.*OSError: no network in tests"
        ),
    ):
        data.load_fashion_mnist(train=False)


@pytest.mark.parametrize("where", ["data", "debian"])
@pytest.mark.parametrize(
    "damage, problem",
    [
        # t10k images: 3 of 28x28, 16 + 3 * 784 = 2368 bytes
        (lambda b: b[:-100], r"\b2268 bytes\b.*\(3, 28, 28\).*\b2368\b"),
        (lambda b: b"\1" + b[1:], r"\b01000803\b"),
        (lambda b: b + b"\0", r"\b2369 bytes\b.*\(3, 28, 28\).*\b2368\b"),
    ],
)
def test_a_damaged_fashion_mnist_file_is_named_with_the_fix(
    tmp_data_dir, tmp_path, monkeypatch, where, damage, problem
):
    folder = tmp_data_dir / "FashionMNIST" / "raw" if where == "data" else tmp_path / "debian"
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "debian")
    fake_set(folder)
    path = folder / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(damage(gzip.decompress(path.read_bytes()))))
    fix = (
        re.escape(str(folder))
        if where == "data"
        else "sudo apt-get install --reinstall dataset-fashion-mnist"
    )
    with pytest.raises(DataNotFoundError, match=f"{re.escape(str(path))}.*{problem}.*{fix}"):
        data.load_fashion_mnist(train=False)


@pytest.mark.parametrize(
    "images, labels, shapes",
    [
        (np.zeros((3, 27, 28)), np.zeros(3), r"\(3, 27, 28\).*\(3,\)"),
        (np.zeros((3, 28, 28)), np.array([0, 10, 1]), r"\(3, 28, 28\).*\(3,\).*\b10\b"),
        (np.zeros((3, 28, 28)), np.zeros(2), r"\(3, 28, 28\).*\(2,\)"),
    ],
)
def test_files_of_another_shape_are_refused(tmp_data_dir, no_debian, images, labels, shapes):
    raw = tmp_data_dir / "FashionMNIST" / "raw"
    fake_set(raw)
    # the extracted files are read first
    write_idx(raw / "t10k-images-idx3-ubyte", images, gz=False)
    write_idx(raw / "t10k-labels-idx1-ubyte", labels, gz=False)
    with pytest.raises(DataNotFoundError, match=f"{shapes}.*28x28.*0-9"):
        data.load_fashion_mnist(train=False)


@pytest.mark.skipif(not REAL_FMNIST.exists(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist(tmp_data_dir):
    # the Debian package: the suite's data dir is replaced by an empty one
    x, y = load_id("fashion_mnist", train=True)
    assert x.shape == (60_000, 1, 28, 28) and x.dtype == torch.float32
    assert x.mean().item() == pytest.approx(0.0, abs=5e-4) and x.std().item() == pytest.approx(
        1.0, abs=5e-4
    )
    assert torch.bincount(y).tolist() == [6000] * 10
    x, y = load_id("fashion_mnist", train=False)
    with gzip.open(REAL_FMNIST / "t10k-images-idx3-ubyte.gz") as f:
        first = np.frombuffer(f.read(16 + 784), np.uint8)[16:].reshape(28, 28).copy()
    torch.testing.assert_close(x[0, 0], normalised(first[None])[0, 0])
    assert len(y) == 10_000 and y[0].item() == 9  # the first test image is an ankle boot


@pytest.mark.skipif(not REAL_FMNIST.exists(), reason="dataset-fashion-mnist not installed")
def test_normalisation_constants_are_the_training_pixels_statistics():
    # notebook 01's claim, from the raw bytes of the Debian package (numpy and gzip, not the
    # package's reader)
    with gzip.open(REAL_FMNIST / "train-images-idx3-ubyte.gz") as f:
        pixels = np.frombuffer(f.read(), np.uint8)[16:] / 255.0  # 60,000 x 784 values in [0, 1]
    assert pixels.size == 60_000 * 784
    assert (
        abs(pixels.mean() - data.FMNIST_MEAN) < 5e-5 and abs(pixels.std() - data.FMNIST_STD) < 5e-5
    )


# ---- MNIST, the fifth Fashion-MNIST OOD set ------------------------------------------------------


def test_mnist_is_read_from_the_data_folder_and_its_absence_is_named(tmp_data_dir, monkeypatch):
    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "MNIST", lambda *a, **k: _no_network())
    with pytest.raises(
        DataNotFoundError,
        match=rf"MNIST.*{re.escape(str(tmp_data_dir / 'MNIST' / 'raw'))}/.*\$MCD_DATA_DIR",
    ):
        load_ood("mnist")
    want = fake_set(tmp_data_dir / "MNIST" / "raw", names=("t10k",), n=(5,))["t10k"][0]
    torch.testing.assert_close(load_ood("mnist"), normalised(want))


# ---- CIFAR through torchvision -------------------------------------------------------------------


def md5(path):
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def write_cifar(root, cls, sizes, seed, monkeypatch):
    """Pickled batches in torchvision's layout, their MD5s made the expected ones; returns {file:
    (data, labels)}."""
    folder, rng, written = root / cls.base_folder, np.random.RandomState(seed), {}
    folder.mkdir(parents=True)
    n_classes, key = (10, "labels") if cls is CIFAR10 else (100, "fine_labels")
    for (name, _), n in zip([*cls.train_list, *cls.test_list], sizes):
        written[name] = (
            rng.randint(0, 256, (n, 3072)).astype(np.uint8),
            rng.randint(0, n_classes, n).tolist(),
        )
        with open(folder / name, "wb") as f:
            pickle.dump(
                {"data": written[name][0], key: written[name][1], "coarse_labels": [0] * n}, f
            )
    with open(folder / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: [f"class{i}" for i in range(n_classes)]}, f)
    monkeypatch.setattr(cls, "train_list", [[f, md5(folder / f)] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, md5(folder / f)] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5(folder / cls.meta["filename"])})
    return written


def cifar_by_hand(rows):
    """(n, 3072) uint8: 1024 red, 1024 green, 1024 blue values, each 32x32 row-major -> normalised
    (n, 3, 32, 32)."""
    x = rows.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    return (x - CIFAR_MEAN[None, :, None, None]) / CIFAR_STD[None, :, None, None]


@pytest.mark.parametrize(
    "cls, name, train, sizes",
    [
        (CIFAR10, "cifar10", False, [2, 2, 2, 2, 2, 5]),
        (CIFAR10, "cifar10", True, [1, 2, 3, 1, 2, 1]),
        (CIFAR100, "cifar100", False, [4, 3]),
        (CIFAR100, "cifar100", True, [4, 3]),
    ],
)
def test_cifar_from_its_folder(tmp_data_dir, monkeypatch, cls, name, train, sizes):
    written = write_cifar(tmp_data_dir, cls, sizes, 0, monkeypatch)
    # training batches in order
    files = [f for f, _ in (cls.train_list if train else cls.test_list)]
    x, y = load_id(name, train=train)
    assert x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.tolist() == sum((written[f][1] for f in files), [])  # CIFAR-100: the fine labels
    np.testing.assert_allclose(
        x.numpy(), cifar_by_hand(np.concatenate([written[f][0] for f in files])), atol=1e-5
    )


def test_a_corrupt_cifar_batch_names_the_folder_and_the_archive(tmp_data_dir, monkeypatch):
    write_cifar(tmp_data_dir, CIFAR10, [1] * 6, 1, monkeypatch)
    with open(tmp_data_dir / CIFAR10.base_folder / "test_batch", "ab") as f:
        f.write(b"garbage")
    with pytest.raises(
        DataNotFoundError,
        match=f"{re.escape(str(tmp_data_dir / CIFAR10.base_folder))}.*"
        rf"cifar-10-python\.tar\.gz.*{re.escape(CIFAR10.url)}.*c58f30108f718f92721af3b95e74349a",
    ):
        load_id("cifar10", train=False)


@pytest.mark.parametrize(
    "read_only", [False, True], ids=["extracted-in-place", "read-only-data-folder"]
)
def test_a_cifar_archive_is_checked_and_extracted_into_the_cache(
    tmp_data_dir, tmp_path, monkeypatch, read_only
):
    written = write_cifar(tmp_path / "staging", CIFAR10, [1, 1, 1, 1, 1, 3], 2, monkeypatch)
    tmp_data_dir.mkdir()
    with tarfile.open(tmp_data_dir / CIFAR10.filename, "w:gz") as tar:
        tar.add(tmp_path / "staging" / CIFAR10.base_folder, arcname=CIFAR10.base_folder)
    monkeypatch.setattr(CIFAR10, "tgz_md5", md5(tmp_data_dir / CIFAR10.filename))
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback"))
    if read_only:  # as root chmod would not stop writes: the data folder's probe fails instead
        real = data.writable
        monkeypatch.setattr(data, "writable", lambda f: Path(f) != tmp_data_dir and real(f))
    into = tmp_path / "fallback" if read_only else tmp_data_dir
    assert load_id("cifar10", train=False)[1].tolist() == written["test_batch"][1]
    assert (into / CIFAR10.base_folder / "data_batch_5").is_file()
    assert (tmp_data_dir / CIFAR10.base_folder).exists() != read_only
    # found there next time
    assert load_id("cifar10", train=False)[1].tolist() == written["test_batch"][1]


def test_cifar_archive_errors(tmp_data_dir):
    with pytest.raises(
        DataNotFoundError,
        match=(
            f"CIFAR100.*{re.escape(CIFAR100.url)}.*OSError: no network in tests.*"
            r"cifar-100-python\.tar\.gz.*eb9058c3a382ffc7106e4002c42a8d85.*"
            f"{re.escape(str(tmp_data_dir))}"
        ),
    ):
        load_id("cifar100", train=False)
    (tmp_data_dir / "cifar-10-python.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(
        DataNotFoundError,
        match=f"{re.escape(str(tmp_data_dir / 'cifar-10-python.tar.gz'))}.*"
        f"c58f30108f718f92721af3b95e74349a.*{re.escape(CIFAR10.url)}",
    ):
        load_id("cifar10", train=True)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: load_id("cifar1000", train=True),
            "'cifar1000'.*cifar10, cifar100.*fashion_mnist",
        ),
        (
            lambda: data.load_cifar("svhn", train=True),
            "'svhn'.*cifar10, cifar100",
        ),
        (
            lambda: load_ood("svhn"),
            "'svhn'.*fashion_mnist.*digits, photo_crops, gaussian, uniform, mnist",
        ),
        (
            lambda: load_ood("digits", id_dataset="cifar10"),
            "'digits'.*cifar10.*Imagenet, Imagenet_resize, LSUN, LSUN_resize, iSUN, gaussian, "
            "uniform",
        ),
        (
            lambda: load_ood("gaussian", id_dataset="svhn"),
            r"'gaussian'.*svhn.*none \(unknown ID set\)",
        ),
        (lambda: load_ood("uniform", n=0), r"\bn=0\b"),
        (
            lambda: odin_noise("salt", 3, (1, 2, 2)),
            "gaussian.*uniform.*n >= 1.*'salt', n=3",
        ),
        (lambda: odin_noise("uniform", 0, (1, 2, 2)), r"'uniform', n=0\b"),
    ],
)
def test_bad_names_and_sizes(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- ODIN's folders ------------------------------------------------------------------------------


def image(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    # PNG: lossless, so the pixels read back exactly
    Image.fromarray(arr.astype(np.uint8)).save(path)


def test_an_odin_archive_is_md5_checked_extracted_and_read_in_imagefolder_order(
    tmp_data_dir, tmp_path, monkeypatch
):
    rng, staging = np.random.RandomState(5), tmp_path / "staging" / "Imagenet"
    sq = {k: rng.randint(0, 256, (32, 32, 3)) for k in ("b/0", "a/9", "a/10")}
    wide, gray = rng.randint(0, 256, (32, 48, 3)), rng.randint(0, 256, (32, 32))
    for k, arr in sq.items():
        image(staging / f"{k}.png", arr)
    # 48 x 32: Resize(32) keeps it, CenterCrop(32) takes columns 8..39
    image(staging / "a" / "5.png", wide)
    image(staging / "c" / "0.png", gray)  # grayscale: read as RGB, three equal channels
    # constant: any resize keeps its colour
    image(staging / "c" / "1.png", np.full((96, 64, 3), (10, 200, 30)))
    tmp_data_dir.mkdir()
    with tarfile.open(tmp_data_dir / "Imagenet.tar.gz", "w:gz") as tar:
        tar.add(staging, arcname="Imagenet")
    url = data.ODIN_ARCHIVES["Imagenet"][1]
    monkeypatch.setitem(
        data.ODIN_ARCHIVES, "Imagenet", (md5(tmp_data_dir / "Imagenet.tar.gz"), url, "TINc")
    )
    x = load_ood("Imagenet", id_dataset="cifar10")
    # ImageFolder: sub-folders sorted, then file names sorted as strings ("10" before "5" before
    # "9")
    want = [
        sq["a/10"],
        wide[:, 8:40],
        sq["a/9"],
        sq["b/0"],
        np.repeat(gray[..., None], 3, 2),
        np.broadcast_to(np.array([10, 200, 30]), (32, 32, 3)),
    ]
    raw = np.stack(want).transpose(0, 3, 1, 2).reshape(len(want), -1)
    np.testing.assert_allclose(x.numpy(), cifar_by_hand(raw), atol=1e-5)
    # extracted into the cache (the data folder here)
    assert (tmp_data_dir / "Imagenet" / "c" / "1.png").is_file()


def test_an_archive_fetched_half_way_leaves_nothing_in_place_and_a_whole_one_is_renamed_in(
    tmp_data_dir, monkeypatch
):
    import torchvision.datasets.utils as tv_utils

    def fetch(url, download_root, extract_root, filename, md5, fail):
        # extraction under way
        image(Path(extract_root) / "iSUN" / "x" / "0.png", np.full((32, 32, 3), 7))
        if fail:
            raise OSError("the connection dropped")

    monkeypatch.setattr(
        tv_utils, "download_and_extract_archive", lambda *a, **k: fetch(*a, **k, fail=True)
    )
    with pytest.raises(DataNotFoundError, match="iSUN.*OSError: the connection dropped"):
        load_ood("iSUN", id_dataset="cifar10")
    # no half folder
    assert not (tmp_data_dir / "iSUN").exists() and not list(tmp_data_dir.glob(".partial-*"))
    monkeypatch.setattr(
        tv_utils, "download_and_extract_archive", lambda *a, **k: fetch(*a, **k, fail=False)
    )
    assert load_ood("iSUN", id_dataset="cifar10").shape == (1, 3, 32, 32)
    assert (tmp_data_dir / "iSUN" / "x" / "0.png").is_file() and not list(
        tmp_data_dir.glob(".partial-*")
    )


def test_odin_folder_errors(tmp_data_dir):
    md5_isun, url_isun, _ = data.ODIN_ARCHIVES["iSUN"]
    with pytest.raises(
        DataNotFoundError,
        match=(
            f"iSUN.*{re.escape(str(tmp_data_dir))}.*{re.escape(url_isun)}.*"
            rf"OSError: no network in tests.*iSUN\.tar\.gz.*{md5_isun}"
        ),
    ):
        load_ood("iSUN", id_dataset="cifar100")
    (tmp_data_dir / "LSUN_resize.tar.gz").write_bytes(b"cut short")
    with pytest.raises(
        DataNotFoundError,
        match=r"LSUN_resize\.tar\.gz.*278b7b31c8cb7e804a1465a8ce03a2dc.*"
        + re.escape(data.ODIN_ARCHIVES["LSUN_resize"][1]),
    ):
        load_ood("LSUN_resize", id_dataset="cifar10")
    # a folder without images: no checksum, none read
    (tmp_data_dir / "LSUN" / "empty").mkdir(parents=True)
    with pytest.raises(
        DataNotFoundError,
        match=rf"{re.escape(str(tmp_data_dir / 'LSUN'))}.*LSUN\.tar\.gz",
    ):
        load_ood("LSUN", id_dataset="cifar10")


def test_data_present_looks_for_folders_or_archives(tmp_data_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback"))
    assert not data_present("cifar10", ("gaussian",))
    (tmp_data_dir / "cifar-10-batches-py").mkdir(parents=True)
    assert data_present("cifar10", ("gaussian", "uniform")) and not data_present("cifar100", ())
    assert not data_present("cifar10")  # every ODIN folder by default
    for name in data.ODIN_ARCHIVES:
        (tmp_data_dir / f"{name}.tar.gz").write_bytes(b"")  # archives count, unchecked
    assert data_present("cifar10")
    (tmp_path / "fallback").mkdir()
    (tmp_path / "fallback" / "cifar-100-python.tar.gz").write_bytes(b"")
    # the fallback is one of the roots only when the data folder cannot be written
    real = data.writable
    assert not data_present("cifar100")
    monkeypatch.setattr(data, "writable", lambda f: Path(f) != tmp_data_dir and real(f))
    assert data_present("cifar100", ("iSUN",))


# ---- noise, the offline sets, pixel_std ----------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 4, 4)])
def test_odin_noise_definitions(shape):
    g, u = odin_noise("gaussian", 4000, shape, seed=5), odin_noise("uniform", 4000, shape, seed=5)
    assert g.shape == u.shape == (4000, *shape) and g.dtype == u.dtype == torch.float32
    assert (g == 0).float().mean().item() == pytest.approx(PHI_MINUS_HALF, abs=0.01)
    assert (g == 1).float().mean().item() == pytest.approx(PHI_MINUS_HALF, abs=0.01)
    inner = g[(g > 0) & (g < 1)]  # N(0.5, 1) truncated to (0, 1): mean 0.5 by symmetry
    assert inner.mean().item() == pytest.approx(0.5, abs=0.01)
    assert u.min() >= 0 and u.max() < 1 and u.mean().item() == pytest.approx(0.5, abs=0.01)
    assert u.var().item() == pytest.approx(1 / 12, abs=0.002)
    assert torch.equal(odin_noise("uniform", 3, shape, 7), odin_noise("uniform", 3, shape, 7))
    assert not torch.equal(odin_noise("uniform", 3, shape, 7), odin_noise("uniform", 3, shape, 8))


@pytest.mark.parametrize(
    "id_dataset, mean",
    [("fashion_mnist", FM_MEAN), ("cifar10", CIFAR_MEAN), ("cifar100", CIFAR_MEAN)],
)
@pytest.mark.parametrize("name", ["gaussian", "uniform"])
def test_noise_sets_are_normalised_with_pixel_std(id_dataset, mean, name):
    shape = (1, 28, 28) if id_dataset == "fashion_mnist" else (3, 32, 32)
    std = pixel_std(id_dataset)
    assert np.allclose(
        std, FM_STD if id_dataset == "fashion_mnist" else CIFAR_STD, rtol=0, atol=1e-12
    )
    x = load_ood(name, n=6, seed=2, id_dataset=id_dataset).double()
    view = (-1, 1, 1) if id_dataset != "fashion_mnist" else (1,)
    raw = x * torch.tensor(std, dtype=torch.float64).view(view) + torch.tensor(
        mean, dtype=torch.float64
    ).view(view)
    torch.testing.assert_close(raw.float(), odin_noise(name, 6, shape, 2), atol=2e-6, rtol=0)


def bilinear(n_in, n_out):
    """(n_out, n_in) interpolation matrix, half-pixel centres (align_corners=False), edges
    clamped."""
    m = np.zeros((n_out, n_in))
    for o in range(n_out):
        src = min(max((o + 0.5) * n_in / n_out - 0.5, 0.0), n_in - 1)
        lo = int(src)
        hi = min(lo + 1, n_in - 1)
        m[o, lo] += 1 - (src - lo)
        m[o, hi] += src - lo
    return m


def test_digits_are_sklearns_upsampled_bilinearly():
    from sklearn.datasets import load_digits

    x = load_ood("digits", n=5)  # n does not apply: all 1,797
    m = bilinear(8, 28)
    want = np.clip(np.einsum("oi,nij,pj->nop", m, load_digits().images / 16.0, m), 0, 1)
    assert x.shape == (1797, 1, 28, 28)
    np.testing.assert_allclose(x[:, 0].double().numpy() * FM_STD + FM_MEAN, want, atol=1e-5)


def test_photo_crops_are_windows_of_the_two_sample_photos():
    from sklearn.datasets import load_sample_images

    x = load_ood("photo_crops", n=20, seed=4)
    assert x.shape == (20, 1, 28, 28) and torch.equal(x, load_ood("photo_crops", n=20, seed=4))
    crops = x[:, 0].double().numpy() * FM_STD + FM_MEAN
    grays = [
        np.asarray(p, np.float64) @ [0.2989, 0.587, 0.114] / 255
        for p in load_sample_images().images
    ]
    tol, used = 1.5 / 255, set()
    for c in crops:  # brute force: every 28x28 window, screened on five pixels, then compared whole
        hits = []
        for k, g in enumerate(grays):
            h, w = g.shape[0] - 27, g.shape[1] - 27
            ok = np.ones((h, w), bool)
            for i, j in ((0, 0), (27, 27), (0, 27), (27, 0), (13, 14)):
                ok &= np.abs(g[i : i + h, j : j + w] - c[i, j]) <= tol
            hits += [
                k
                for t, left in zip(*np.nonzero(ok))
                if np.abs(g[t : t + 28, left : left + 28] - c).max() <= tol
            ]
        assert hits, "a crop is no window of either photo"
        used.update(hits)
    assert used == {0, 1}


@pytest.mark.parametrize("name", data.OFFLINE_OOD_SETS)
def test_offline_sets_shape_range_and_seed(name):
    x = load_ood(name, n=40, seed=1)
    assert x.dtype == torch.float32 and x.shape == (1797 if name == "digits" else 40, 1, 28, 28)
    raw = x * FM_STD + FM_MEAN
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5
    assert torch.equal(x, load_ood(name, n=40, seed=1))
    assert torch.equal(x, load_ood(name, n=40, seed=2)) == (name == "digits")


# ---- infinite_loader -----------------------------------------------------------------------------


def test_infinite_loader_reshuffles_each_pass_and_never_stops():
    loader = DataLoader(
        TensorDataset(torch.arange(6)),
        batch_size=6,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    passes = [b[0].tolist() for b in itertools.islice(infinite_loader(loader), 6)]
    assert all(sorted(p) == list(range(6)) for p in passes) and len({tuple(p) for p in passes}) > 1
    short = DataLoader(TensorDataset(torch.arange(3)), batch_size=1)
    pairs = list(zip(range(10), infinite_loader(short)))  # longer than the loader: it starts again
    assert [b[0].item() for _, b in pairs] == [0, 1, 2] * 3 + [0]


def test_infinite_loader_refuses_an_empty_loader():
    empty = DataLoader(TensorDataset(torch.arange(3)), batch_size=5, drop_last=True)
    with pytest.raises(
        ValueError,
        match="drop_last=True.*batch_size",
    ):
        next(infinite_loader(empty))


def test_crop_flip_takes_a_window_of_the_padded_image_and_flips_half():
    from mcd_helpers.data import crop_flip

    x = torch.arange(180, dtype=torch.float64).view(2, 3, 5, 6)  # distinct pixel values
    x = x.repeat(200, 1, 1, 1)  # 400 images, so that every offset and both flips occur
    out = crop_flip(
        x, torch.Generator().manual_seed(0), pad=2, fill=torch.tensor([-1.0, -2.0, -3.0])
    )
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), value=0.0)
    for ch, value in enumerate((-1.0, -2.0, -3.0)):  # the fill, channel by channel
        border = torch.ones(5 + 4, 6 + 4, dtype=torch.bool)
        border[2:-2, 2:-2] = False
        padded[:, ch][:, border] = value
    found, flipped = set(), 0

    def window(src, top, left, flip):
        w = src[:, top : top + 5, left : left + 6]
        return w.flip(-1) if flip else w

    for img, src in zip(out, padded):  # brute force: the one window (and flip) it is
        windows = [
            (top, left, flip)
            for top in range(5)
            for left in range(5)
            for flip in (False, True)
            if torch.equal(img, window(src, top, left, flip))
        ]
        assert windows, "an output that is no window of the padded image"
        found.add(windows[0][:2])
        flipped += windows[0][2]
    assert found == {(top, left) for top in range(5) for left in range(5)}
    assert 150 < flipped < 250
    again = crop_flip(
        x, torch.Generator().manual_seed(0), pad=2, fill=torch.tensor([-1.0, -2.0, -3.0])
    )
    assert torch.equal(out, again)  # the generator decides everything
    # under torchrun: rank r's rows [r::2] get what they get in the global batch
    whole = crop_flip(x[:8], torch.Generator().manual_seed(5), pad=2)
    for rank in (0, 1):
        part = crop_flip(x[rank:8:2], torch.Generator().manual_seed(5), pad=2, share=(rank, 2))
        assert torch.equal(part, whole[rank::2])
    with pytest.raises(ValueError, match=r"pad >= 0.*\(3, 5, 6\)"):
        crop_flip(x[0], torch.Generator(), pad=2)
