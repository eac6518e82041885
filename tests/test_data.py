import gzip
import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mcd_helpers.data.sets as data
from mcd_helpers.data.sets import (DataNotFoundError, infinite_loader, load_fashion_mnist, load_ood,
                              normalize, transductive_split)


def _fail_download(*args, **kwargs):
    raise RuntimeError("no network in tests")


def test_missing_fashion_mnist_names_all_three_places(tmp_data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "no-debian")
    import torchvision.datasets
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", _fail_download)
    with pytest.raises(DataNotFoundError) as err:
        load_fashion_mnist(train=False)
    msg = str(err.value)
    assert str(tmp_data_dir) in msg and "no-debian" in msg and "apt-get install dataset-fashion-mnist" in msg
    assert "download" in msg and "no network in tests" in msg


def _write_idx(path, array, kind):
    # IDX format by hand: magic (0, 0, type 0x08 = ubyte, ndim), sizes big-endian, raw bytes.
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_debian_layout_is_extracted_and_read(tmp_data_dir, tmp_path, monkeypatch):
    deb = tmp_path / "debian"
    deb.mkdir()
    rng = np.random.RandomState(0)
    imgs = {"train": rng.randint(0, 256, (5, 28, 28)), "t10k": rng.randint(0, 256, (3, 28, 28))}
    labels = {"train": np.array([0, 1, 2, 3, 9]), "t10k": np.array([4, 5, 6])}
    for split in ("train", "t10k"):
        _write_idx(deb / f"{split}-images-idx3-ubyte.gz", imgs[split], "images")
        _write_idx(deb / f"{split}-labels-idx1-ubyte.gz", labels[split], "labels")
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", deb)
    x, y = load_fashion_mnist(train=False)
    assert x.shape == (3, 1, 28, 28) and y.tolist() == [4, 5, 6]
    torch.testing.assert_close(x[:, 0], normalize(torch.from_numpy(imgs["t10k"]).float() / 255))
    # Read in memory: nothing extracted, so no half-written file can stay behind (finding 3).
    assert not tmp_data_dir.exists() or list(tmp_data_dir.rglob("*")) == []


def _fake_fmnist(folder, gz, rng=None):
    """The four IDX files in ``folder`` (gzipped or not); returns the test images and labels."""
    rng = rng or np.random.RandomState(1)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train-images-idx3-ubyte": rng.randint(0, 256, (4, 28, 28)), "train-labels-idx1-ubyte": np.array([0, 1, 2, 3]),
              "t10k-images-idx3-ubyte": rng.randint(0, 256, (2, 28, 28)), "t10k-labels-idx1-ubyte": np.array([7, 8])}
    for name, array in arrays.items():
        header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
        blob = header + array.astype(np.uint8).tobytes()
        if gz:
            with gzip.open(folder / f"{name}.gz", "wb") as f:
                f.write(blob)
        else:
            (folder / name).write_bytes(blob)
    return arrays["t10k-images-idx3-ubyte"], arrays["t10k-labels-idx1-ubyte"]


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "extracted"])
def test_documented_layout_in_mcd_data_dir_is_read(tmp_data_dir, tmp_path, monkeypatch, gz):
    # Finding 1: the .gz files in $MCD_DATA_DIR/FashionMNIST/raw/ (as the README says) ended in
    # torchvision's "Dataset not found"; both forms must be read, without the Debian package or a download.
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "no-debian")
    imgs, labels = _fake_fmnist(tmp_data_dir / "FashionMNIST" / "raw", gz)
    x, y = load_fashion_mnist(train=False)
    assert y.tolist() == labels.tolist()
    torch.testing.assert_close(x[:, 0], normalize(torch.from_numpy(imgs).float() / 255))


def test_missing_data_dir_falls_back_to_the_debian_package(tmp_data_dir, tmp_path, monkeypatch):
    # Finding 1: an $MCD_DATA_DIR without Fashion-MNIST must fall back to the Debian package.
    imgs, labels = _fake_fmnist(tmp_path / "debian", gz=True)
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "debian")
    (tmp_data_dir / "FashionMNIST" / "raw").mkdir(parents=True)  # an empty raw/ folder, as a user may leave it
    x, y = load_fashion_mnist(train=False)
    assert y.tolist() == labels.tolist()


@pytest.mark.parametrize("damage, problem", [
    (lambda b: b[:len(b) // 2], "cut short"),
    (lambda b: b"\x00\x00\x09\x03" + b[4:], "not an IDX file"),
    (lambda b: b + b"\x00" * 5, "longer than its header says"),
])
def test_a_damaged_idx_file_is_named_with_the_problem_and_the_fix(tmp_data_dir, tmp_path, monkeypatch, damage, problem):
    # Finding 8: a truncated or wrong-magic file raised a bare AssertionError or a reshape error naming no file.
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", tmp_path / "no-debian")
    raw = tmp_data_dir / "FashionMNIST" / "raw"
    _fake_fmnist(raw, gz=False)
    path = raw / "t10k-images-idx3-ubyte"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(data.CorruptDataError, match=f"{path}.*{problem}.*Delete it"):
        load_fashion_mnist(train=False)


def test_a_corrupt_debian_gzip_is_named_and_leaves_nothing_behind(tmp_data_dir, tmp_path, monkeypatch):
    # Finding 8: a corrupt Debian .gz raised a raw error and left a 47 MB .tmp file in the cache.
    deb = tmp_path / "debian"
    _fake_fmnist(deb, gz=True)
    gz_path = deb / "t10k-images-idx3-ubyte.gz"
    blob = gz_path.read_bytes()
    gz_path.write_bytes(blob[:len(blob) - 30])  # cut inside the deflate stream
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", deb)
    with pytest.raises(data.CorruptDataError, match=f"{gz_path}.*cut short.*apt-get install --reinstall"):
        load_fashion_mnist(train=False)
    assert not tmp_data_dir.exists() or list(tmp_data_dir.rglob("*")) == []


def test_a_second_run_starting_mid_read_of_the_debian_package_does_not_crash(tmp_data_dir, tmp_path, monkeypatch):
    # Finding 3: each run extracted Debian's files through the fixed name <file>.tmp, so a second run
    # starting while the first was extracting renamed the first's file away: FileNotFoundError ... .tmp.
    # Here the second run starts exactly then: when the first reads its first compressed byte.
    deb = tmp_path / "debian"
    _, labels = _fake_fmnist(deb, gz=True)
    monkeypatch.setattr(data, "DEBIAN_FMNIST_DIR", deb)
    real_open, second, started = gzip.open, [], []

    class FirstReadStartsAnotherRun:
        def __init__(self, f):
            self.f = f

        def read(self, *args):
            if not started:
                started.append(True)
                second.append(load_fashion_mnist(train=False)[1].tolist())  # the other run, start to end
            return self.f.read(*args)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(gzip, "open", lambda *a, **k: FirstReadStartsAnotherRun(real_open(*a, **k)))
    assert load_fashion_mnist(train=False)[1].tolist() == labels.tolist()
    assert second == [labels.tolist()]
    assert not tmp_data_dir.exists() or not list(tmp_data_dir.rglob("*.tmp"))


def test_data_and_cifar_do_not_import_each_other():
    # data.py imported cifar.py (load_cifar) and cifar.py imported data.py (cache_root, ...): a cycle.
    import ast
    import mcd_helpers.data.cifar as cifar_module

    tree = ast.parse(open(cifar_module.__file__).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "data" not in imported and "mcd_helpers.data.sets" not in imported
    from mcd_helpers.data import sets as d
    from mcd_helpers.data import cifar as c
    assert d.DataNotFoundError is c.DataNotFoundError and d.cache_root is c.cache_root  # old import paths
    assert d.odin_noise is c.odin_noise


@pytest.mark.skipif(not data.DEBIAN_FMNIST_DIR.exists(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist_test_set():
    x, y = load_fashion_mnist(train=False)
    assert x.shape == (10_000, 1, 28, 28) and y.shape == (10_000,)
    assert torch.bincount(y).tolist() == [1000] * 10  # Fashion-MNIST's test set is balanced
    raw = x * data.FMNIST_STD + data.FMNIST_MEAN
    assert raw.min() >= -1e-6 and raw.max() <= 1 + 1e-6


@pytest.mark.parametrize("name", data.OFFLINE_OOD_SETS)
def test_offline_ood_sets(name):
    x = load_ood(name, n=50, seed=1)
    raw = x * data.FMNIST_STD + data.FMNIST_MEAN
    assert x.shape[1:] == (1, 28, 28) and x.dtype == torch.float32
    assert len(x) == (1797 if name == "digits" else 50)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5
    torch.testing.assert_close(load_ood(name, n=50, seed=1), x)  # reproducible


def test_odin_noise_definitions():
    g = data.FMNIST_STD * load_ood("gaussian", n=2000, seed=0) + data.FMNIST_MEAN
    u = data.FMNIST_STD * load_ood("uniform", n=2000, seed=0) + data.FMNIST_MEAN
    # clamp(N(0.5, 1), 0, 1): P(clamped at 0) = P(Z < -0.5) = 0.3085
    assert (g < 1e-6).float().mean().item() == pytest.approx(0.3085, abs=0.01)
    assert u.mean().item() == pytest.approx(0.5, abs=0.01) and u.var().item() == pytest.approx(1 / 12, abs=0.005)


def test_digits_keep_sklearn_content():
    from sklearn.datasets import load_digits
    x = data.FMNIST_STD * load_ood("digits") + data.FMNIST_MEAN
    # upsampling keeps the mean intensity of each 8x8 image (0..16 scaled to 0..1) approximately
    want = torch.from_numpy(load_digits().images / 16.0).float().mean(dim=(1, 2))
    torch.testing.assert_close(x.mean(dim=(1, 2, 3)), want, atol=0.03, rtol=0)


def test_unknown_ood_set():
    with pytest.raises(ValueError, match="photo_crops"):
        load_ood("svhn")


def test_mnist_missing_gives_clear_error(tmp_data_dir, monkeypatch):
    import torchvision.datasets
    monkeypatch.setattr(torchvision.datasets, "MNIST", _fail_download)
    with pytest.raises(DataNotFoundError, match="MNIST"):
        load_ood("mnist")


def test_transductive_split_follows_official_permutation():
    id_x = torch.arange(1200).view(-1, 1, 1, 1).float()
    id_y = torch.arange(1200) % 10
    ood_x = -torch.arange(1500).view(-1, 1, 1, 1).float() - 1
    s = transductive_split(id_x, id_y, ood_x)
    np.random.seed(3)
    p1 = np.random.permutation(1200)
    np.random.seed(3)
    p2 = np.random.permutation(1500)
    assert s.val_id_x.flatten().long().tolist() == p1[:1000].tolist()
    assert s.test_id_x.flatten().long().tolist() == p1[1000:].tolist()
    assert s.test_id_y.tolist() == (p1[1000:] % 10).tolist()
    assert (-s.val_ood_x.flatten() - 1).long().tolist() == p2[:1000].tolist()
    assert len(s.test_ood_x) == 500
    (u,) = s.unlabeled().tensors
    assert len(u) == 200 + 500  # the test split is also the unlabeled fine-tuning set
    assert set(u.flatten().long().tolist()) == set(p1[1000:].tolist()) | set((-p2[1000:] - 1).tolist())


def test_transductive_split_too_small():
    with pytest.raises(ValueError, match="n_val=1000"):
        transductive_split(torch.zeros(1000, 1, 2, 2), torch.zeros(1000).long(), torch.zeros(2000, 1, 2, 2))


def test_infinite_loader_reshuffles_and_never_stops():
    ds = TensorDataset(torch.arange(6))
    loader = DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))
    passes = [b[0].tolist() for b in itertools.islice(infinite_loader(loader), 5)]
    assert all(sorted(p) == list(range(6)) for p in passes)  # each pass is a full permutation
    assert len({tuple(p) for p in passes}) > 1  # reshuffled, unlike itertools.cycle
    cyc = [b[0].tolist() for b in itertools.islice(itertools.cycle(loader), 5)]
    assert len({tuple(p) for p in cyc}) == 1  # the trap it avoids: cycle replays the first pass


def test_infinite_loader_pairs_with_a_longer_loader():
    short = DataLoader(TensorDataset(torch.arange(3)), batch_size=1)
    long = DataLoader(TensorDataset(torch.arange(10)), batch_size=1)
    assert len(list(zip(long, short))) == 3  # zip stops at the shorter loader
    pairs = list(zip(long, infinite_loader(short)))
    assert len(pairs) == 10 and [p[1][0].item() for p in pairs] == [0, 1, 2] * 3 + [0]


def test_infinite_loader_on_empty_loader_raises():
    empty = DataLoader(TensorDataset(torch.arange(3)), batch_size=5, drop_last=True)
    with pytest.raises(ValueError, match="no batches"):
        next(infinite_loader(empty))


def test_odin_noise_follows_odins_definitions_at_any_shape():
    from mcd_helpers.data.sets import odin_noise

    g = odin_noise("gaussian", 4000, (1, 8, 8), seed=5)
    # clamp(N(0.5, 1), 0, 1): P(x == 0) = P(z < -0.5) = Phi(-0.5) ~ 0.3085, P(x == 1) = P(z > 0.5) ~ 0.3085
    assert g.shape == (4000, 1, 8, 8) and g.min() == 0.0 and g.max() == 1.0
    assert abs((g == 0).float().mean().item() - 0.3085) < 0.01
    assert abs((g == 1).float().mean().item() - 0.3085) < 0.01
    u = odin_noise("uniform", 4000, (3, 4, 4), seed=5)
    assert u.shape == (4000, 3, 4, 4) and abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(odin_noise("uniform", 3, (1, 2, 2), 7), odin_noise("uniform", 3, (1, 2, 2), 7))
    with pytest.raises(ValueError, match="gaussian, uniform"):
        odin_noise("salt", 3, (1, 2, 2))
    with pytest.raises(ValueError, match="at least one"):
        odin_noise("uniform", 0, (1, 2, 2))
