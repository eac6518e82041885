"""Held-out-class splits and protocols: which original image lands where, counted by hand.

Every synthetic image is constant with a unique pixel value (its id), so an image is identified
by ``x[:, 0, 0, 0]``: training ids 0..99 with label ``id % 10``, test ids 1000..1099 likewise,
far-OOD ids 5000..5029.
"""
import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from mcd_helpers.errors import ConfigError
from mcd_helpers.data.nearood import (CLASS_SPLITS, FMNIST_CLASSES, PROTOCOLS, SELECTIONS, ProtocolSplit,
                                 check_class_split, class_split, protocol_split)


def images(ids):
    return torch.tensor(ids, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 1, 4, 4).clone()


def ids(x):
    return [int(v) for v in x[:, 0, 0, 0]]


TRAIN_IDS, TEST_IDS, FAR_IDS = list(range(100)), list(range(1000, 1100)), list(range(5000, 5030))
X_TR, Y_TR = images(TRAIN_IDS), torch.tensor([i % 10 for i in TRAIN_IDS])
X_TE, Y_TE = images(TEST_IDS), torch.tensor([i % 10 for i in TEST_IDS])
FAR = images(FAR_IDS)


def split(protocol, name="a", n_val=2, seed=3, n_holdout=20, far=FAR, **kw):
    id_c, ood_c = class_split(name)
    return protocol_split(protocol, X_TR, Y_TR, X_TE, Y_TE, id_c, ood_c, n_val=n_val, seed=seed,
                          n_holdout=n_holdout, far_ood_train=far, **kw)


def of_classes(all_ids, classes):
    return [i for i in all_ids if i % 10 in classes]


def perm(n, seed=3):
    return list(np.random.RandomState(seed).permutation(n))


# ---- class splits ------------------------------------------------------------------------------

def test_class_splits_are_six_known_four_unknown_and_cover_all_classes():
    assert len(CLASS_SPLITS) >= 3 and len(FMNIST_CLASSES) == 10
    assert CLASS_SPLITS["a"] == ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9))
    assert [FMNIST_CLASSES[c] for c in CLASS_SPLITS["a"][1]] == ["Shirt", "Sneaker", "Bag", "Ankle boot"]
    for name, (id_c, ood_c) in CLASS_SPLITS.items():
        assert check_class_split(id_c, ood_c) == (id_c, ood_c)
        assert len(id_c) == 6 and len(ood_c) == 4 and sorted(id_c + ood_c) == list(range(10))
    assert len({v for v in CLASS_SPLITS.values()}) == len(CLASS_SPLITS)
    assert PROTOCOLS == ("transductive", "disjoint", "unseen-ood") and SELECTIONS == ("ood-labels", "last-epoch")


def test_check_class_split_accepts_numpy_ints_and_keeps_order():
    assert check_class_split(np.array([5, 0]), [np.int64(9)]) == ((5, 0), (9,))


@pytest.mark.parametrize("id_c, ood_c, match", [
    ([], [6, 7], "id_classes is empty"),
    ([0, 1], [], "ood_classes is empty"),
    ([0, 1, 2], [2, 3], r"\[2\] are both ID and OOD"),
    ([0, 10], [6], r"\[10\] out of range; valid classes are 0..9 \(0 T-shirt/top"),
    ([-1, 0], [6], r"\[-1\] out of range"),
    ([0, 0, 1], [6], r"\[0\] more than once"),
    ([0, 1.5], [6], "non-integer"),
    ([0, True], [6], "non-integer"),
    ("a", [6], "must be a list of class indices.*Known splits"),
    (None, [6], "must be a list"),
])
def test_check_class_split_errors(id_c, ood_c, match):
    with pytest.raises(ConfigError, match=match) as err:
        check_class_split(id_c, ood_c)
    assert err.value.field == "class_split"
    assert "'a': ID (0 T-shirt/top" in str(err.value)  # the known splits are listed


def test_check_class_split_other_num_classes():
    assert check_class_split([0, 1], [2], num_classes=3) == ((0, 1), (2,))
    with pytest.raises(ConfigError, match=r"valid classes are 0..2\."):
        check_class_split([0, 3], [2], num_classes=3)


def test_class_split_unknown_name():
    assert class_split("b") == ((0, 2, 3, 5, 7, 9), (1, 4, 6, 8))
    with pytest.raises(ConfigError, match=r"unknown class split 'z'; give .* Known splits: 'a': .*'b': .*'c': "):
        class_split("z")


def test_a_written_class_split_is_parsed_and_checked():
    assert class_split("012345/6789") == CLASS_SPLITS["a"]
    assert class_split("0123/45") == ((0, 1, 2, 3), (4, 5))  # classes 6-9 left out of the task
    for text, match in (("012/2345", r"class\(es\) \[2\] are both ID and OOD \(overlap\)"),
                        ("/0123", r"id_classes is empty"), ("0123/", r"ood_classes is empty"),
                        ("0113/45", r"id_classes lists class\(es\) \[1\] more than once"),
                        ("01a/23", r"unknown class split '01a/23'; give a known name or the ID and OOD class digits"),
                        ("01/23/45", r"unknown class split '01/23/45'")):
        with pytest.raises(ConfigError, match=match):
            class_split(text)


# ---- transductive ------------------------------------------------------------------------------

def test_transductive_where_each_image_lands():
    s = split("transductive", n_val=2)
    assert isinstance(s, ProtocolSplit) and s.protocol == "transductive"
    assert ids(s.x_sup) == of_classes(TRAIN_IDS, range(6))  # all 60 ID-class training images, in order
    assert s.y_sup.tolist() == [i % 10 for i in ids(s.x_sup)]  # split "a": labels 0..5 unchanged
    id_te, ood_te = of_classes(TEST_IDS, range(6)), of_classes(TEST_IDS, range(6, 10))
    p_id, p_ood = perm(60), perm(40)  # official loader: RandomState(seed) per set
    assert ids(s.val_id_x) == [id_te[j] for j in p_id[:2]]
    assert ids(s.test_id_x) == [id_te[j] for j in p_id[2:]]
    assert ids(s.val_ood_x) == [ood_te[j] for j in p_ood[:2]]
    assert ids(s.test_ood_x) == [ood_te[j] for j in p_ood[2:]]
    assert s.val_id_y.tolist() == [i % 10 for i in ids(s.val_id_x)]
    assert s.test_id_y.tolist() == [i % 10 for i in ids(s.test_id_x)]
    # the unlabeled set is the test set itself (transductive)
    assert ids(s.x_unsup) == ids(s.test_id_x) + ids(s.test_ood_x)
    assert (len(s.x_sup), len(s.val_id_x), len(s.test_id_x), len(s.val_ood_x), len(s.test_ood_x),
            len(s.x_unsup)) == (60, 2, 58, 2, 38, 96)
    assert torch.equal(s.unlabeled().tensors[0], s.x_unsup)


def test_relabelling_follows_id_class_order():
    s = split("transductive", name="b")  # ID (0, 2, 3, 5, 7, 9) -> 0..5
    mapping = {0: 0, 2: 1, 3: 2, 5: 3, 7: 4, 9: 5}
    assert s.y_sup.tolist() == [mapping[i % 10] for i in ids(s.x_sup)]
    assert s.test_id_y.tolist() == [mapping[i % 10] for i in ids(s.test_id_x)]
    assert s.y_sup.dtype == torch.int64 and set(s.y_sup.tolist()) == set(range(6))
    assert not {i % 10 for i in ids(s.x_sup)} & {1, 4, 6, 8}  # held-out classes never labelled


# ---- disjoint and unseen-ood ---------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["disjoint", "unseen-ood"])
def test_disjoint_and_unseen_where_each_image_lands(protocol):
    s = split(protocol, name="b", n_val=3, n_holdout=20)
    id_c, ood_c = CLASS_SPLITS["b"]
    id_tr = of_classes(TRAIN_IDS, id_c)
    p = perm(60)
    assert ids(s.x_sup) == [id_tr[j] for j in p[20:]]  # 40 labelled
    assert ids(s.val_id_x) == [id_tr[j] for j in p[:3]]
    ood_src = of_classes(TRAIN_IDS, ood_c) if protocol == "disjoint" else FAR_IDS
    p_ood = perm(len(ood_src))[:13]  # the test set's OOD:ID ratio 40:60 times n_holdout = 20, rounded
    assert ids(s.val_ood_x) == [ood_src[j] for j in p_ood[:3]]
    assert ids(s.x_unsup) == [id_tr[j] for j in p[3:20]] + [ood_src[j] for j in p_ood[3:]]
    # the test set is the transductive one (the permuted test set without its first n_val of each
    # part), so every protocol is tested on the same images, none of them trained on
    t = split("transductive", name="b", n_val=3)
    assert ids(s.test_id_x) == ids(t.test_id_x) and ids(s.test_ood_x) == ids(t.test_ood_x)
    assert ids(s.test_id_x) == [of_classes(TEST_IDS, id_c)[j] for j in perm(60)[3:]]
    assert ids(s.test_ood_x) == [of_classes(TEST_IDS, ood_c)[j] for j in perm(40)[3:]]
    assert torch.equal(s.test_id_y, t.test_id_y)
    trained = set(ids(s.x_sup)) | set(ids(s.x_unsup)) | set(ids(s.val_id_x)) | set(ids(s.val_ood_x))
    assert not trained & set(TEST_IDS)
    assert not set(ids(s.x_sup)) & set(ids(s.x_unsup))
    assert not (set(ids(s.val_id_x)) | set(ids(s.val_ood_x))) & (set(ids(s.x_sup)) | set(ids(s.x_unsup)))
    assert not {i % 10 for i in ids(s.x_sup)} & set(ood_c)
    mapping = {c: k for k, c in enumerate(id_c)}
    assert s.y_sup.tolist() == [mapping[i % 10] for i in ids(s.x_sup)]
    assert s.val_id_y.tolist() == [mapping[i % 10] for i in ids(s.val_id_x)]
    assert (len(s.x_sup), len(s.x_unsup), len(s.val_id_x), len(s.val_ood_x), len(s.test_id_x),
            len(s.test_ood_x)) == (40, 17 + 10, 3, 3, 57, 37)  # pool: 20 ID + 13 OOD, 3 + 3 to validation
    if protocol == "unseen-ood":  # no held-out-class training image used anywhere
        assert not trained & set(of_classes(TRAIN_IDS, ood_c))
        assert set(ids(s.val_ood_x)) | set(ids(s.x_unsup)[17:]) <= set(FAR_IDS)


def test_the_pool_has_the_test_ratio_capped_by_the_images_there_are():
    s = split("disjoint", n_val=2, n_holdout=50)  # 60 ID: 50 pooled; OOD: round(50 * 40 / 60) = 33 of 40
    assert (len(s.x_sup), len(s.val_id_x), len(s.val_ood_x), len(s.x_unsup)) == (10, 2, 2, 48 + 31)
    ood_tr = of_classes(TRAIN_IDS, range(6, 10))
    assert ids(s.val_ood_x) + ids(s.x_unsup)[48:] == [ood_tr[j] for j in perm(40)[:33]]
    u = split("unseen-ood", n_val=2, n_holdout=50)  # the far set has only 30: all of it
    assert sorted(ids(u.val_ood_x) + ids(u.x_unsup)[48:]) == FAR_IDS


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_deterministic_with_the_seed(protocol):
    a, b, c = split(protocol, seed=7), split(protocol, seed=7), split(protocol, seed=8)
    for f in ("x_sup", "y_sup", "x_unsup", "val_id_x", "val_ood_x", "test_id_x", "test_ood_x"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert ids(a.val_id_x) != ids(c.val_id_x)


# ---- errors, raised before any work ---------------------------------------------------------------

def call(protocol="disjoint", x_tr=X_TR, y_tr=Y_TR, x_te=X_TE, y_te=Y_TE, id_c=(0, 1, 2, 3, 4, 5),
         ood_c=(6, 7, 8, 9), n_val=2, n_holdout=20, far=FAR):
    return protocol_split(protocol, x_tr, y_tr, x_te, y_te, id_c, ood_c, n_val=n_val, seed=0,
                          n_holdout=n_holdout, far_ood_train=far)


@pytest.mark.parametrize("kw, field, match", [
    (dict(protocol="inductive"), "protocol", "unknown protocol 'inductive'; choose from transductive, disjoint, unseen-ood"),
    (dict(id_c=[0, 1], ood_c=[1, 2]), "class_split", "both ID and OOD"),
    (dict(id_c=[]), "class_split", "id_classes is empty"),
    (dict(y_tr=Y_TR[:99]), "y_train", "x_train has 100 images but y_train has 99 labels"),
    (dict(y_te=Y_TE + 1), "y_test", r"labels in 1..10; valid labels are 0..9"),
    (dict(y_tr=Y_TR.float()), "y_train", "integer class labels"),
    (dict(x_te=X_TE[:, :, :2]), "x_test", r"training images are \(1, 4, 4\) but test images \(1, 2, 4\)"),
    (dict(x_tr=X_TR[:, 0]), "x_train", r"must be a tensor \(N, C, H, W\)"),
    (dict(n_val=0), "n_val", "n_val must be an integer >= 1, got 0"),
    (dict(n_holdout=2.5), "n_holdout", "n_holdout must be an integer >= 1, got 2.5"),
    (dict(n_holdout=60), "n_holdout", "n_holdout=60 is too large: the training set's ID-class part has 60 images"),
    (dict(n_val=20), "n_val", r"n_val=20 is too large: the unlabeled pool's ID part \(n_holdout=20\) has 20 images"),
    (dict(n_val=13, n_holdout=20), "n_val", "n_val=13 is too large: the unlabeled pool's OOD part .*has 13 images"),
    (dict(n_val=40, n_holdout=50), "n_val", "n_val=40 is too large: the test set's OOD-class part has 40 images"),
    (dict(protocol="transductive", n_val=40), "n_val", "n_val=40 is too large: the test set's OOD-class part has 40"),
    (dict(protocol="transductive", n_val=60), "n_val", "test set's ID-class part has 60 images"),
    (dict(protocol="unseen-ood", far=None), "far_ood_train", "'unseen-ood' takes .* pass that tensor"),
    (dict(protocol="unseen-ood", far=FAR[:, :, :2]), "far_ood_train", r"tensor of images \('N', 1, 4, 4\)"),
    (dict(protocol="unseen-ood", n_val=30, n_holdout=50), "n_val", r"far_ood_train set, n_holdout times the test set's OOD:ID ratio, at most all of it\) has 30 images"),
    (dict(y_te=torch.where(Y_TE >= 6, 0, Y_TE)), "class_split", "test set's OOD-class part is empty"),
])
def test_protocol_split_errors(kw, field, match):
    with pytest.raises(ConfigError, match=match) as err:
        call(**kw)
    assert err.value.field == field


def test_transductive_ignores_n_holdout_and_far_ood():
    s = call(protocol="transductive", n_holdout=10_000, far=None)
    assert len(s.x_sup) == 60


# ---- the real Fashion-MNIST (cheap: two gzip reads) ----------------------------------------------

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def read_idx(name):
    with gzip.open(FMNIST / name) as f:
        data = f.read()
    offset = 16 if "images" in name else 8
    arr = np.frombuffer(data, dtype=np.uint8, offset=offset)
    return torch.from_numpy(arr.copy())


@pytest.mark.skipif(not (FMNIST / "train-labels-idx1-ubyte.gz").exists(), reason="Fashion-MNIST not installed")
def test_real_fashion_mnist_counts_split_a():
    y_tr, y_te = read_idx("train-labels-idx1-ubyte.gz").long(), read_idx("t10k-labels-idx1-ubyte.gz").long()
    # stand-in images (index as pixel) keep the test fast; the split depends only on the labels
    x_tr, x_te = images(list(range(len(y_tr)))), images(list(range(len(y_te))))
    id_c, ood_c = class_split("a")
    t = protocol_split("transductive", x_tr, y_tr, x_te, y_te, id_c, ood_c, n_val=1000, seed=3, n_holdout=6000)
    assert (len(t.x_sup), len(t.val_id_x), len(t.test_id_x), len(t.val_ood_x), len(t.test_ood_x),
            len(t.x_unsup)) == (36_000, 1000, 5000, 1000, 3000, 8000)
    d = protocol_split("disjoint", x_tr, y_tr, x_te, y_te, id_c, ood_c, n_val=1000, seed=3, n_holdout=6000)
    # pool: 6,000 ID + 4,000 OOD (the test set's 6:4), 1,000 of each to validation; the test set is t's
    assert (len(d.x_sup), len(d.x_unsup), len(d.test_id_x), len(d.test_ood_x)) == (30_000, 8000, 5000, 3000)
    assert torch.equal(torch.bincount(d.y_sup, minlength=6), torch.bincount(y_tr[ids(d.x_sup)], minlength=6)[:6])
