"""CIFAR and ODIN loaders on small stand-ins made here (torchvision's pickle layout, tar.gz of JPEGs); no network."""
import hashlib
import pickle
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import CIFAR10, CIFAR100

import mcd_helpers.data.cifar as cifar
from mcd_helpers.data.cifar import ChecksumError, OdinArchive, load_odin_folder
from mcd_helpers.data.sets import DataNotFoundError, load_id, load_ood

MEAN = np.array([125.3, 123.0, 113.9]) / 255
STD = np.array([63.0, 62.1, 66.7]) / 255


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def _no_network(*args, **kwargs):
    raise OSError("no network in tests")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setattr(cifar, "_download", _no_network)


def _write_cifar(root, cls, sizes, rng):
    """Pickled batches in torchvision's layout; returns {file: (data uint8 (n, 3072), labels)}."""
    folder = root / cls.base_folder
    folder.mkdir(parents=True)
    label_key = "labels" if cls is CIFAR10 else "fine_labels"
    n_classes = 10 if cls is CIFAR10 else 100
    written = {}
    for (name, _), n in zip([*cls.train_list, *cls.test_list], sizes):
        data = rng.randint(0, 256, (n, 3072)).astype(np.uint8)
        labels = rng.randint(0, n_classes, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, label_key: labels}, f)
        written[name] = (data, labels)
    with open(folder / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: [f"class{i}" for i in range(n_classes)]}, f)
    return written


def _trust_stand_ins(monkeypatch, root, cls):
    """Make the stand-ins' MD5 sums the expected ones (as the real files' sums are for real data)."""
    folder = root / cls.base_folder
    monkeypatch.setattr(cls, "train_list", [[f, _md5(folder / f)] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, _md5(folder / f)] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": _md5(folder / cls.meta["filename"])})


def _by_hand(data):
    # (n, 3072) uint8 row = 1024 red, 1024 green, 1024 blue values, each 32x32 row-major
    x = data.reshape(-1, 3, 32, 32).astype(np.float64) / 255
    return (x - MEAN[None, :, None, None]) / STD[None, :, None, None]


def test_cifar10_test_set_matches_pickles(tmp_data_dir, monkeypatch):
    written = _write_cifar(tmp_data_dir, CIFAR10, [2, 2, 2, 2, 2, 5], np.random.RandomState(0))
    _trust_stand_ins(monkeypatch, tmp_data_dir, CIFAR10)
    x, y = load_id("cifar10", train=False)
    data, labels = written["test_batch"]
    assert x.shape == (5, 3, 32, 32) and x.dtype == torch.float32
    assert y.tolist() == labels and y.dtype == torch.int64
    np.testing.assert_allclose(x.numpy(), _by_hand(data), atol=1e-5)


def test_cifar10_train_set_concatenates_batches_in_order(tmp_data_dir, monkeypatch):
    written = _write_cifar(tmp_data_dir, CIFAR10, [1, 2, 3, 1, 2, 1], np.random.RandomState(1))
    _trust_stand_ins(monkeypatch, tmp_data_dir, CIFAR10)
    x, y = load_id("cifar10", train=True)
    names = [f for f, _ in CIFAR10.train_list]
    assert y.tolist() == sum((written[f][1] for f in names), [])
    np.testing.assert_allclose(x.numpy(), _by_hand(np.concatenate([written[f][0] for f in names])), atol=1e-5)


def test_cifar100_uses_fine_labels(tmp_data_dir, monkeypatch):
    written = _write_cifar(tmp_data_dir, CIFAR100, [4, 3], np.random.RandomState(2))
    _trust_stand_ins(monkeypatch, tmp_data_dir, CIFAR100)
    x, y = load_id("cifar100", train=False)
    assert x.shape == (3, 3, 32, 32) and y.tolist() == written["test"][1]


def test_corrupt_cifar_batch_names_file_and_checksum(tmp_data_dir, monkeypatch):
    _write_cifar(tmp_data_dir, CIFAR10, [1] * 6, np.random.RandomState(3))
    _trust_stand_ins(monkeypatch, tmp_data_dir, CIFAR10)
    expected = CIFAR10.test_list[0][1]
    with open(tmp_data_dir / CIFAR10.base_folder / "test_batch", "ab") as f:
        f.write(b"garbage")
    with pytest.raises(ChecksumError) as err:
        load_id("cifar10", train=False)
    msg = str(err.value)
    assert "test_batch" in msg and expected in msg and CIFAR10.url in msg


def _cifar10_archive(data_dir, tmp_path, monkeypatch, seed):
    """A CIFAR-10 stand-in packed as the official .tar.gz in ``data_dir`` (its MD5 trusted); the batches written."""
    staging = tmp_path / "staging"
    written = _write_cifar(staging, CIFAR10, [1, 1, 1, 1, 1, 3], np.random.RandomState(seed))
    _trust_stand_ins(monkeypatch, staging, CIFAR10)
    data_dir.mkdir(parents=True)
    archive = data_dir / CIFAR10.filename
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging / CIFAR10.base_folder, arcname=CIFAR10.base_folder)
    monkeypatch.setattr(CIFAR10, "tgz_md5", _md5(archive))
    return written


def test_cifar_archive_is_verified_and_extracted(tmp_data_dir, tmp_path, monkeypatch):
    written = _cifar10_archive(tmp_data_dir, tmp_path, monkeypatch, seed=4)
    x, y = load_id("cifar10", train=False)
    assert y.tolist() == written["test_batch"][1]
    assert (tmp_data_dir / CIFAR10.base_folder / "data_batch_5").exists()


def test_archive_in_a_read_only_data_folder_is_extracted_into_the_fallback_cache(tmp_data_dir, tmp_path, monkeypatch):
    # Finding 5: a read-only data folder ended in a raw OSError; the archive there is read, and
    # extracted into the writable fallback cache ($MCD_CACHE_DIR) instead.
    import errno

    import mcd_helpers.data.files as datafiles

    written = _cifar10_archive(tmp_data_dir, tmp_path, monkeypatch, seed=5)
    monkeypatch.setenv("MCD_CACHE_DIR", str(tmp_path / "fallback"))
    probe, extract = datafiles._probe, cifar._extract

    def read_only(folder):  # as root, chmod would not stop writes: refuse them here
        if tmp_data_dir == folder or tmp_data_dir in folder.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(folder))
        return probe(folder)

    def extract_ro(archive_path, root):
        read_only(root)
        return extract(archive_path, root)
    monkeypatch.setattr(datafiles, "_probe", read_only)
    monkeypatch.setattr(cifar, "_extract", extract_ro)
    x, y = load_id("cifar10", train=False)
    assert y.tolist() == written["test_batch"][1]
    assert (tmp_path / "fallback" / CIFAR10.base_folder / "test_batch").exists()
    assert not (tmp_data_dir / CIFAR10.base_folder).exists()
    assert load_id("cifar10", train=False)[1].tolist() == written["test_batch"][1]  # found there next time


def test_corrupt_cifar_archive_names_file_checksum_and_url(tmp_data_dir):
    tmp_data_dir.mkdir(parents=True)
    (tmp_data_dir / "cifar-10-python.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(ChecksumError) as err:
        load_id("cifar10", train=True)
    msg = str(err.value)
    assert "cifar-10-python.tar.gz" in msg and "c58f30108f718f92721af3b95e74349a" in msg  # torchvision's MD5
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg


def test_missing_cifar_says_what_to_download(tmp_data_dir):
    with pytest.raises(DataNotFoundError) as err:
        load_id("cifar100", train=False)
    msg = str(err.value)
    assert "cifar-100-python.tar.gz" in msg and "eb9058c3a382ffc7106e4002c42a8d85" in msg
    assert "cifar-100-python.tar.gz" in msg and str(tmp_data_dir) in msg and "no network in tests" in msg


# ----------------------------------------------------------------------------------------------
# ODIN's folders
# ----------------------------------------------------------------------------------------------

def _jpegs(folder, n, rng, size=(32, 32)):
    folder.mkdir(parents=True)
    for i in range(n):
        arr = rng.randint(0, 256, (*size[::-1], 3)).astype(np.uint8)
        Image.fromarray(arr).save(folder / f"{i:03d}.jpg", quality=95)


def _decoded(path):
    with Image.open(path) as img:
        arr = np.asarray(img.convert("RGB"), dtype=np.float64) / 255  # (H, W, 3)
    return (arr.transpose(2, 0, 1) - MEAN[:, None, None]) / STD[:, None, None]


def test_odin_archive_checked_extracted_and_read_in_official_order(tmp_path, monkeypatch):
    staging = tmp_path / "staging"
    _jpegs(staging / "Imagenet" / "test", 4, np.random.RandomState(5))
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(root / "Imagenet.tar.gz", "w:gz") as tar:
        tar.add(staging / "Imagenet", arcname="Imagenet")
    real = cifar.ODIN_ARCHIVES["Imagenet"]
    monkeypatch.setitem(cifar.ODIN_ARCHIVES, "Imagenet",
                        OdinArchive(real.filename, _md5(root / "Imagenet.tar.gz"), real.url, 4, "TINc"))
    x = load_odin_folder("Imagenet", root)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    files = sorted((root / "Imagenet" / "test").glob("*.jpg"))
    np.testing.assert_allclose(x.numpy(), np.stack([_decoded(f) for f in files]), atol=1e-5)


def test_odin_local_folder_without_archive_and_resize(tmp_path):
    # iSUN-like layout, images of another size: shorter side resized to 32, then a 32x32 centre crop
    _jpegs(tmp_path / "iSUN" / "iSUN_patches", 3, np.random.RandomState(6), size=(48, 40))
    x = load_odin_folder("iSUN", tmp_path)
    assert x.shape == (3, 3, 32, 32)
    raw = x * torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1) + torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5


def test_odin_files_sorted_across_subfolders(tmp_path):
    for sub in ("b", "a"):
        (tmp_path / "LSUN" / sub).mkdir(parents=True)
    rng = np.random.RandomState(7)
    for path in (tmp_path / "LSUN" / "b" / "0.jpg", tmp_path / "LSUN" / "a" / "9.jpg", tmp_path / "LSUN" / "a" / "1.png"):
        Image.fromarray(rng.randint(0, 256, (32, 32, 3)).astype(np.uint8)).save(path)
    (tmp_path / "LSUN" / "a" / "notes.txt").write_text("not an image")
    assert [p.relative_to(tmp_path / "LSUN").as_posix() for p in cifar._image_files(tmp_path / "LSUN")] == \
        ["a/1.png", "a/9.jpg", "b/0.jpg"]


def test_corrupt_odin_archive_names_file_checksum_and_url(tmp_path):
    (tmp_path / "LSUN_resize.tar.gz").write_bytes(b"cut short")
    with pytest.raises(ChecksumError) as err:
        load_odin_folder("LSUN_resize", tmp_path)
    msg = str(err.value)
    assert "LSUN_resize.tar.gz" in msg and "278b7b31c8cb7e804a1465a8ce03a2dc" in msg
    assert "https://www.dropbox.com/s/moqh2wh8696c3yl/LSUN_resize.tar.gz" in msg
    assert hashlib.md5(b"cut short").hexdigest() in msg  # the actual sum, too


def test_missing_odin_set_says_what_to_download(tmp_data_dir):
    with pytest.raises(DataNotFoundError) as err:
        load_ood("iSUN", id_dataset="cifar10")
    msg = str(err.value)
    assert "iSUN.tar.gz" in msg and "be77b0f2c26fda898afac5f99645ee70" in msg
    assert "https://www.dropbox.com/s/ssz7qxfqae0cca5/iSUN.tar.gz" in msg and str(tmp_data_dir) in msg


def test_odin_archive_table_matches_odin_readme():
    # Names, counts and Dropbox ids as listed by ODIN's README and the MCD authors' README.
    ids = {"Imagenet": "avgm2u562itwpkl", "Imagenet_resize": "kp3my3412u5k9rl", "LSUN": "fhtsw1m3qxlwj6h",
           "LSUN_resize": "moqh2wh8696c3yl", "iSUN": "ssz7qxfqae0cca5"}
    for name, spec in cifar.ODIN_ARCHIVES.items():
        assert spec.url == f"https://www.dropbox.com/s/{ids[name]}/{name}.tar.gz"
        assert spec.filename == f"{name}.tar.gz" and len(spec.md5) == 32
        assert spec.n_images == (8925 if name == "iSUN" else 10_000)


# ----------------------------------------------------------------------------------------------
# Noise at 3x32x32 and dispatch
# ----------------------------------------------------------------------------------------------

def _unnormalise(x):
    return x * torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1) + torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)


def test_cifar_noise_follows_odin():
    g = _unnormalise(load_ood("gaussian", n=500, seed=0, id_dataset="cifar10"))
    u = _unnormalise(load_ood("uniform", n=500, seed=0, id_dataset="cifar100"))
    assert g.shape == u.shape == (500, 3, 32, 32)
    # clamp(N(0.5, 1), 0, 1): P(0) = P(Z < -0.5) = 0.3085 = P(1)
    assert (g < 1e-5).float().mean().item() == pytest.approx(0.3085, abs=0.01)
    assert (g > 1 - 1e-5).float().mean().item() == pytest.approx(0.3085, abs=0.01)
    assert u.mean().item() == pytest.approx(0.5, abs=0.01) and u.var().item() == pytest.approx(1 / 12, abs=0.003)
    torch.testing.assert_close(load_ood("gaussian", n=500, seed=0, id_dataset="cifar10"), _normalised(g))


def _normalised(raw):
    return (raw - torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)) / torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)


@pytest.mark.parametrize("call, match", [
    (lambda: load_ood("digits", id_dataset="cifar10"), "Imagenet"),
    (lambda: load_ood("gaussian", n=0, id_dataset="cifar10"), "at least one"),
    (lambda: load_id("cifar1000", train=True), "cifar10"),
    (lambda: load_odin_folder("TIN"), "Imagenet_resize"),
    (lambda: load_ood("gaussian", id_dataset="svhn"), "cifar10"),
])
def test_bad_names_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_data_present_looks_for_folders_or_archives(tmp_path):
    assert not cifar.data_present("cifar10", root=tmp_path)
    (tmp_path / "cifar-10-batches-py").mkdir()
    assert cifar.data_present("cifar10", ("gaussian",), root=tmp_path)
    assert not cifar.data_present("cifar10", ("LSUN", "gaussian"), root=tmp_path)
    (tmp_path / "LSUN.tar.gz").write_bytes(b"")
    assert cifar.data_present("cifar10", ("LSUN", "gaussian"), root=tmp_path)
    assert not cifar.data_present("cifar100", ("gaussian",), root=tmp_path)


def test_reproduce_cli_pipeline_runs_on_cifar_stand_ins(tmp_data_dir, monkeypatch):
    # The whole `reproduce` pipeline with CIFAR-10 as ID and an ODIN folder as OOD, at toy size.
    from mcd_helpers.experiments.config import MCDConfig
    from mcd_helpers.experiments.run import run_reproduction

    rng = np.random.RandomState(8)
    _write_cifar(tmp_data_dir, CIFAR10, [16, 16, 16, 16, 16, 40], rng)
    _trust_stand_ins(monkeypatch, tmp_data_dir, CIFAR10)
    _jpegs(tmp_data_dir / "LSUN" / "test", 30, rng)
    cfg = MCDConfig(id_dataset="cifar10", ood_sets=("LSUN", "gaussian"), ood_size=30, n_val=10,
                    pretrain_epochs=1, pretrain_milestones=(), pretrain_batch_size=16, steps_per_epoch=2,
                    batch_size_sup=8, batch_size_unsup=8, strategies=("separate",), eval_batch_size=64)
    rows = run_reproduction(cfg, tmp_data_dir / "out", progress=False, quiet=True)
    methods = ["msp", "odin", "energy", "mcd"]  # the baselines on the pre-trained network, then MCD per strategy
    assert [(r["ood_dataset"], r["method"]) for r in rows] == [(o, m) for o in ("LSUN", "gaussian") for m in methods]
    assert all(0.0 <= r["auroc"] <= 1.0 for r in rows)
    assert (tmp_data_dir / "out" / "results.json").exists()
