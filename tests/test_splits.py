"""mcd_helpers.splits: which original image lands where, recomputed here.

Every synthetic image is constant with a unique pixel value (its id), read back by ``ids(x)``:
training ids 0..99 with label ``id % 10``, test ids 1000..1099 likewise, far-OOD ids 5000..5029.
"""

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from mcd_helpers.errors import ConfigError
from mcd_helpers.splits import (
    CLASS_SPLITS,
    FMNIST_CLASSES,
    PROTOCOLS,
    class_split,
    keep_classes,
    protocol_split,
    transductive_split,
)


def images(ids):
    return torch.tensor(ids, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 1, 3, 3).clone()


def ids(x):
    return [int(v) for v in x[:, 0, 0, 0]]


def official_perm(n, seed=3):
    """The official loader's permutation: ``np.random.seed(3)`` then ``np.random.permutation``
    (global state)."""
    np.random.seed(seed)
    return np.random.permutation(n).tolist()


def of_classes(all_ids, classes):
    return [i for i in all_ids if i % 10 in classes]


TRAIN_IDS, TEST_IDS, FAR_IDS = list(range(100)), list(range(1000, 1100)), list(range(5000, 5030))
X_TR, Y_TR = images(TRAIN_IDS), torch.tensor([i % 10 for i in TRAIN_IDS])
X_TE, Y_TE = images(TEST_IDS), torch.tensor([i % 10 for i in TEST_IDS])
FAR = images(FAR_IDS)


# ---- transductive_split --------------------------------------------------------------------------


@pytest.mark.parametrize("n_val, seed", [(1000, 3), (7, 11)])
def test_transductive_split_follows_the_official_permutation(n_val, seed):
    id_ids, ood_ids = list(range(1200)), list(range(-1, -1501, -1))
    id_x, id_y, ood_x = images(id_ids), torch.tensor(id_ids) % 10, images(ood_ids)
    sup_x, sup_y = images([7, 8]), torch.tensor([1, 2])
    s = transductive_split(sup_x, sup_y, id_x, id_y, ood_x, n_val=n_val, seed=seed)
    # a fresh seed per set, as the loader
    p_id, p_ood = (official_perm(1200, seed), official_perm(1500, seed))
    assert ids(s.val_id_x) == p_id[:n_val] and ids(s.test_id_x) == p_id[n_val:]
    assert s.val_id_y.tolist() == [i % 10 for i in p_id[:n_val]] and s.test_id_y.tolist() == [
        i % 10 for i in p_id[n_val:]
    ]
    assert ids(s.val_ood_x) == [ood_ids[j] for j in p_ood[:n_val]]
    assert ids(s.test_ood_x) == [ood_ids[j] for j in p_ood[n_val:]]
    # the test set is the unlabeled set
    assert ids(s.x_unsup) == ids(s.test_id_x) + ids(s.test_ood_x)
    assert s.x_sup is sup_x and s.y_sup is sup_y


def test_transductive_split_errors():
    z = torch.zeros
    with pytest.raises(ConfigError, match=r"n_val=1000\b.*\b1000 images") as err:
        transductive_split(
            z(5, 1, 2, 2), z(5).long(), z(1000, 1, 2, 2), z(1000).long(), z(2000, 1, 2, 2)
        )
    assert err.value.field == "n_val"
    with pytest.raises(ConfigError, match=r"n_val=10\b.*\b10 images"):
        transductive_split(
            z(5, 1, 2, 2), z(5).long(), z(20, 1, 2, 2), z(20).long(), z(10, 1, 2, 2), n_val=10
        )
    with pytest.raises(ValueError, match="5/5.*20/19"):
        transductive_split(
            z(5, 1, 2, 2), z(5).long(), z(20, 1, 2, 2), z(19).long(), z(30, 1, 2, 2), n_val=10
        )
    with pytest.raises(ValueError, match=r"\b5/4\b"):
        transductive_split(
            z(5, 1, 2, 2), z(4).long(), z(20, 1, 2, 2), z(20).long(), z(30, 1, 2, 2), n_val=10
        )


# ---- class splits --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, known, held_out",
    [
        # Shirt held out beside its look-alikes
        ("a", {"T-shirt/top", "Pullover", "Coat"}, {"Shirt"}),
        ("b", {"T-shirt/top", "Pullover"}, {"Coat", "Shirt"}),
        # footwear: Ankle boot known, Sandal and Sneaker not
        ("c", {"Ankle boot"}, {"Sandal", "Sneaker"}),
    ],
)
def test_named_class_splits(name, known, held_out):
    id_c, ood_c = class_split(name)
    assert (id_c, ood_c) == CLASS_SPLITS[name] and len(id_c) == 6 and len(ood_c) == 4
    assert sorted(id_c + ood_c) == list(range(10))
    assert known <= {FMNIST_CLASSES[c] for c in id_c} and held_out <= {
        FMNIST_CLASSES[c] for c in ood_c
    }


@pytest.mark.parametrize(
    "text, want",
    [
        ("012345/6789", ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9))),
        ("0123/45", ((0, 1, 2, 3), (4, 5))),
        ("90/1", ((9, 0), (1,))),
    ],
)
def test_a_written_class_split(text, want):
    assert class_split(text) == want


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "z",
            r"'z'.*'IDS/OODS'.*'012345/6789'.*'a': ID \[0, 1, 2, 3, 4, 5\] OOD \[6, 7, 8, 9\]; 'b'",
        ),
        ("01a/23", "'01a/23'"),
        ("01/23/45", "'01/23/45'"),
        ("/0123", "'/0123'"),  # an empty side
        ("0123/", "'0123/'"),
        (None, r"\bNone\b"),
        (
            "012/2345",
            r"'012/2345'.*0 T-shirt/top, 1 Trouser, .*9 Ankle boot",
        ),
        ("0113/45", "'0113/45'.*0 T-shirt/top"),
        ("01/233", "'01/233'.*0 T-shirt/top"),
    ],
)
def test_class_split_errors(text, match):
    with pytest.raises(ConfigError, match=match) as err:
        class_split(text)
    assert err.value.field == "class_split"


def test_keep_classes_relabels_in_the_order_given():
    x, y = images(list(range(20))), torch.tensor([i % 10 for i in range(20)])
    kx, ky = keep_classes(x, y, (7, 2, 12))  # a class absent from y is allowed
    assert ids(kx) == [2, 7, 12, 17] and ky.tolist() == [1, 0, 1, 0] and ky.dtype == torch.int64


# ---- protocol_split ------------------------------------------------------------------------------


def split(protocol, name="b", n_val=3, seed=3, n_holdout=20, far=FAR, ood_fraction=1.0):
    id_c, ood_c = class_split(name)
    return protocol_split(
        protocol,
        X_TR,
        Y_TR,
        X_TE,
        Y_TE,
        id_c,
        ood_c,
        n_val=n_val,
        seed=seed,
        n_holdout=n_holdout,
        far_ood_train=far,
        ood_fraction=ood_fraction,
    )


def test_transductive_protocol_where_each_image_lands():
    s = split("transductive")
    id_c, ood_c = CLASS_SPLITS["b"]
    relabel = {c: k for k, c in enumerate(id_c)}  # (0, 2, 3, 5, 7, 9) -> 0..5
    assert ids(s.x_sup) == of_classes(TRAIN_IDS, id_c)  # every ID-class training image, in order
    assert s.y_sup.tolist() == [relabel[i % 10] for i in ids(s.x_sup)]
    id_te, ood_te = of_classes(TEST_IDS, id_c), of_classes(TEST_IDS, ood_c)
    p_id, p_ood = official_perm(60), official_perm(40)
    assert ids(s.val_id_x) == [id_te[j] for j in p_id[:3]] and ids(s.test_id_x) == [
        id_te[j] for j in p_id[3:]
    ]
    assert ids(s.val_ood_x) == [ood_te[j] for j in p_ood[:3]] and ids(s.test_ood_x) == [
        ood_te[j] for j in p_ood[3:]
    ]
    assert s.test_id_y.tolist() == [relabel[i % 10] for i in ids(s.test_id_x)]
    assert s.val_id_y.tolist() == [relabel[i % 10] for i in ids(s.val_id_x)]
    assert ids(s.x_unsup) == ids(s.test_id_x) + ids(s.test_ood_x)


@pytest.mark.parametrize("protocol", ["disjoint", "unseen-ood"])
def test_disjoint_and_unseen_ood_where_each_image_lands(protocol):
    s, t = split(protocol), split("transductive")
    id_c, ood_c = CLASS_SPLITS["b"]
    id_tr = of_classes(TRAIN_IDS, id_c)
    p = official_perm(60)
    assert ids(s.x_sup) == [id_tr[j] for j in p[20:]]  # n_holdout = 20 of the 60 go to the pool
    assert ids(s.val_id_x) == [id_tr[j] for j in p[:3]]
    relabel = {c: k for k, c in enumerate(id_c)}
    assert s.y_sup.tolist() == [relabel[i % 10] for i in ids(s.x_sup)]
    assert s.val_id_y.tolist() == [relabel[i % 10] for i in ids(s.val_id_x)]
    src = of_classes(TRAIN_IDS, ood_c) if protocol == "disjoint" else FAR_IDS
    # round(20 * 40 / 60) = 13: the test set's ID:OOD
    pool_ood = [src[j] for j in official_perm(len(src))[:13]]
    assert ids(s.val_ood_x) == pool_ood[:3]
    assert ids(s.x_unsup) == [id_tr[j] for j in p[3:20]] + pool_ood[3:]  # ID part first
    # the test set is the transductive protocol's, and nothing tested is trained on or validated
    # with
    assert ids(s.test_id_x) == ids(t.test_id_x) and ids(s.test_ood_x) == ids(t.test_ood_x)
    assert torch.equal(s.test_id_y, t.test_id_y)
    seen = ids(s.x_sup) + ids(s.x_unsup) + ids(s.val_id_x) + ids(s.val_ood_x)
    assert len(seen) == len(set(seen)) and not set(seen) & set(TEST_IDS)
    if protocol == "unseen-ood":
        assert not set(seen) & set(of_classes(TRAIN_IDS, ood_c))


@pytest.mark.parametrize("n_holdout, n_ood_pool", [(20, 13), (25, 17), (50, 33), (59, 39)])
def test_the_pool_keeps_the_test_sets_id_to_ood_ratio(n_holdout, n_ood_pool):
    s = split("disjoint", name="a", n_val=2, n_holdout=n_holdout)  # test set: 60 ID, 40 OOD
    assert (
        len(s.x_sup) == 60 - n_holdout
        and len(s.val_id_x) + len(s.x_unsup) - (n_ood_pool - 2) == n_holdout
    )
    ood = ids(s.val_ood_x) + ids(s.x_unsup)[n_holdout - 2 :]
    assert len(ood) == n_ood_pool == round(n_holdout * 40 / 60) and {i % 10 for i in ood} <= {
        6,
        7,
        8,
        9,
    }


@pytest.mark.parametrize("fraction, kept", [(0.0, 0), (0.25, 2), (0.5, 5), (1.0, 10)])
def test_the_unlabeled_set_keeps_the_first_fraction_of_its_ood_images(fraction, kept):
    # 17 ID + 10 OOD unlabeled (3 OOD validate)
    full, s = (split("disjoint"), split("disjoint", ood_fraction=fraction))
    # round(fraction * 10), the ID part whole
    assert ids(s.x_unsup) == ids(full.x_unsup)[: 17 + kept]
    for name in ("x_sup", "val_id_x", "val_ood_x", "test_id_x", "test_ood_x"):
        assert ids(getattr(s, name)) == ids(getattr(full, name)), name


def test_the_pool_takes_at_most_every_far_ood_image():
    # 33 wanted, the far set has 30: all of it
    u = split("unseen-ood", name="a", n_val=2, n_holdout=50)
    assert sorted(ids(u.val_ood_x) + ids(u.x_unsup)[48:]) == FAR_IDS


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_split_follows_the_seed(protocol):
    a, b, c = split(protocol, seed=7), split(protocol, seed=7), split(protocol, seed=8)
    for f in ("x_sup", "y_sup", "x_unsup", "val_id_x", "val_ood_x", "test_id_x", "test_ood_x"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert ids(a.test_id_x) == [
        of_classes(TEST_IDS, CLASS_SPLITS["b"][0])[j] for j in official_perm(60, 7)[3:]
    ]
    assert ids(a.test_id_x) != ids(c.test_id_x)


@pytest.mark.parametrize(
    "kw, field, match",
    [
        (
            dict(protocol="inductive"),
            "protocol",
            "'inductive'.*transductive, disjoint, unseen-ood",
        ),
        (
            dict(protocol="unseen-ood", far=None),
            "unlabeled_ood",
            "'unseen-ood'.*far_ood_train",
        ),
        (
            dict(n_holdout=60),
            "n_holdout",
            r"n_holdout=60\b.*\b60 ID-class",
        ),
        (dict(n_holdout=0), "n_holdout", r"n_holdout=0\b"),
        (
            dict(n_val=13, n_holdout=20),
            "n_val",
            r"n_val=13\b.*\b20 ID\b.*\b13 OOD\b",
        ),
        (dict(n_val=20, n_holdout=20), "n_val", r"n_val=20\b.*\b20 ID\b.*\b13 OOD\b"),
        (
            dict(protocol="unseen-ood", n_val=30, n_holdout=50),
            "n_val",
            r"n_val=30\b.*\b50 ID\b.*\b30 OOD\b",
        ),
        (
            dict(protocol="transductive", n_val=40),
            "n_val",
            r"n_val=40\b.*\b40 images",
        ),
        (
            dict(n_val=60, n_holdout=50),
            "n_val",
            r"n_val=60\b.*\b60 images",
        ),
        (
            dict(ood_fraction=-0.5),
            "unlabeled_ood_fraction",
            r"ood_fraction.*\[0, 1\].*-0\.5",
        ),
        (
            dict(ood_fraction=1.5),
            "unlabeled_ood_fraction",
            r"ood_fraction.*\[0, 1\].*1\.5",
        ),
    ],
)
def test_protocol_split_errors(kw, field, match):
    kw = dict(kw)
    protocol = kw.pop("protocol", "disjoint")
    with pytest.raises(ConfigError, match=match) as err:
        split(protocol, **kw)
    assert err.value.field == field


def test_transductive_needs_neither_n_holdout_nor_far_ood():
    assert len(split("transductive", n_holdout=10_000, far=None).x_sup) == 60


FMNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(
    not (FMNIST / "train-labels-idx1-ubyte.gz").exists(), reason="Fashion-MNIST not installed"
)
def test_real_fashion_mnist_counts_of_split_a():
    def labels(name):  # an IDX label file: 8 header bytes, then one byte per label
        with gzip.open(FMNIST / name) as f:
            return torch.from_numpy(np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64))

    y_tr, y_te = labels("train-labels-idx1-ubyte.gz"), labels("t10k-labels-idx1-ubyte.gz")
    # the index as the image
    x_tr, x_te = (images(list(range(len(y_tr)))), images(list(range(len(y_te)))))
    id_c, ood_c = class_split("a")
    t = protocol_split(
        "transductive", x_tr, y_tr, x_te, y_te, id_c, ood_c, n_val=1000, seed=3, n_holdout=6000
    )
    assert [
        len(v) for v in (t.x_sup, t.val_id_x, t.test_id_x, t.val_ood_x, t.test_ood_x, t.x_unsup)
    ] == [36_000, 1000, 5000, 1000, 3000, 8000]
    d = protocol_split(
        "disjoint", x_tr, y_tr, x_te, y_te, id_c, ood_c, n_val=1000, seed=3, n_holdout=6000
    )
    # pool: 6,000 ID + 4,000 OOD (the test set's 6,000:4,000), 1,000 of each to validation
    assert [len(v) for v in (d.x_sup, d.x_unsup, d.val_ood_x, d.test_id_x)] == [
        30_000,
        8000,
        1000,
        5000,
    ]
    assert torch.equal(d.y_sup, y_tr[ids(d.x_sup)])  # split a keeps labels 0..5 as they are
