"""Who is labeled, unlabeled, validated and tested: the official transductive split, held-out
classes and the protocols of the near-OOD benchmark.

* :func:`transductive_split` -- the official loader's (github.com/YU1ut/UOOD-MCD
  ``utils/loader.py``): the ID test set and the OOD set are each permuted with
  ``np.random.RandomState(3)``; the first 1,000 of each are validation, the rest is both the
  unlabeled fine-tuning set and the test set.
* Held-out classes (as in open-set recognition, Neal et al., ECCV 2018): a class split
  (:data:`CLASS_SPLITS`) divides Fashion-MNIST's ten classes into 6 ID classes, relabelled ``0..5``
  in the order listed, and 4 OOD classes that are never labelled. :func:`protocol_split` says where
  the unlabeled set comes from (:data:`PROTOCOLS`): ``transductive`` (the test set itself, as in the
  paper), ``disjoint`` (training images that are neither labelled nor tested) or ``unseen-ood``
  (as disjoint, but its OOD part from another source than the test OOD).

Shapes: images ``(N, C, H, W)`` float, labels ``(N,)`` int64.
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from .errors import ConfigError

FMNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
# Fashion-MNIST class splits, ``name -> (id_classes, ood_classes)``, 6 known / 4 held out
CLASS_SPLITS = {
    # Shirt held out beside its look-alikes T-shirt, Pullover, Coat
    "a": ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9)),
    "b": ((0, 2, 3, 5, 7, 9), (1, 4, 6, 8)),  # Coat and Shirt held out beside T-shirt and Pullover
    "c": ((1, 3, 4, 6, 8, 9), (0, 2, 5, 7)),  # footwear: Ankle boot known, Sandal and Sneaker not
}
PROTOCOLS = ("transductive", "disjoint", "unseen-ood")
HELD_OUT = "heldout"  # the OOD "set" of a near-OOD task: the held-out classes of a class split


@dataclass
class Split:
    """One experiment's data. ``x_sup, y_sup``: labeled ID training images (pre-training and the
    supervised stream); ``x_unsup``: the unlabeled fine-tuning set (ID and OOD, no labels);
    ``val_*``: model selection (``val_ood_x`` only for selection ``ood-labels``); ``test_*``: the
    test."""

    x_sup: torch.Tensor
    y_sup: torch.Tensor
    x_unsup: torch.Tensor
    val_id_x: torch.Tensor
    val_id_y: torch.Tensor
    val_ood_x: torch.Tensor
    test_id_x: torch.Tensor
    test_id_y: torch.Tensor
    test_ood_x: torch.Tensor


def _perm(n: int, seed: int) -> torch.Tensor:  # a fresh generator per set, as the official loader
    return torch.from_numpy(np.random.RandomState(seed).permutation(n))


def transductive_split(
    x_sup: torch.Tensor,
    y_sup: torch.Tensor,
    id_x: torch.Tensor,
    id_y: torch.Tensor,
    ood_x: torch.Tensor,
    n_val: int = 1000,
    seed: int = 3,
) -> Split:
    """The official split: ``id_x`` (the ID test set) and ``ood_x`` permuted with
    ``RandomState(seed)``; the first ``n_val`` of each are validation, the rest the test set and,
    concatenated, the unlabeled set.

    Raises:
        ConfigError: (field ``n_val``) a set with no more than ``n_val`` samples.
        ValueError: images and labels of different lengths.
    """
    if len(id_x) != len(id_y) or len(x_sup) != len(y_sup):
        raise ValueError(
            f"images and labels differ in length: {len(x_sup)}/{len(y_sup)} labeled, "
            f"{len(id_x)}/{len(id_y)} ID test."
        )
    for name, x in (("ID test set", id_x), ("OOD set", ood_x)):
        if len(x) <= n_val:
            raise ConfigError(
                "n_val", f"n_val={n_val} is too large: the {name} has {len(x)} images; lower it."
            )
    p_id, p_ood = _perm(len(id_x), seed), _perm(len(ood_x), seed)
    test_id_x, test_ood_x = id_x[p_id[n_val:]], ood_x[p_ood[n_val:]]
    return Split(
        x_sup,
        y_sup,
        torch.cat([test_id_x, test_ood_x]),
        id_x[p_id[:n_val]],
        id_y[p_id[:n_val]],
        ood_x[p_ood[:n_val]],
        test_id_x,
        id_y[p_id[n_val:]],
        test_ood_x,
    )


def class_split(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(id_classes, ood_classes)`` of a named split, or of a written one: the ID class digits, a
    slash, the OOD digits (``"012345/6789"`` is split ``a``; ``"0123/45"`` leaves 6-9 out).

    Raises:
        ConfigError: (field ``class_split``) an unknown name, or a written split that is not
            ``digits/digits``, has an empty side, a class twice or a class on both sides.
    """
    if name in CLASS_SPLITS:
        return CLASS_SPLITS[name]
    known = "; ".join(f"{k!r}: ID {list(i)} OOD {list(o)}" for k, (i, o) in CLASS_SPLITS.items())
    parts = name.split("/") if isinstance(name, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(
            "class_split",
            f"unknown class split {name!r}; give a known name or the ID and OOD class "
            f"digits as 'IDS/OODS' (e.g. '012345/6789'). Known splits: {known}.",
        )
    id_c, ood_c = (tuple(int(c) for c in p) for p in parts)
    if len(set(id_c + ood_c)) < len(id_c + ood_c):  # a class twice on one side or on both
        raise ConfigError(
            "class_split",
            f"class split {name!r} lists a class twice or on both sides; valid classes "
            f"are {', '.join(f'{c} {n}' for c, n in enumerate(FMNIST_CLASSES))}.",
        )
    return id_c, ood_c


def random_class_splits(n: int, seed: int = 0) -> tuple[str, ...]:
    """``n`` distinct random 6/4 class splits, written ``"IDS/OODS"`` (digits ascending on each
    side): the first ``n`` of the C(10, 4) = 210 possible splits, in
    ``np.random.RandomState(seed)``'s order.

    Raises:
        ValueError: ``n`` outside 1..210.
    """
    every = [tuple(c) for c in itertools.combinations(range(10), 4)]
    if not 1 <= n <= len(every):
        raise ValueError(
            f"n={n} random class splits asked; there are {len(every)} distinct 6/4 splits "
            "of 10 classes."
        )
    picked = [every[i] for i in np.random.RandomState(seed).permutation(len(every))[:n]]
    return tuple(
        "".join(str(c) for c in range(10) if c not in o) + "/" + "".join(map(str, o))
        for o in picked
    )


def keep_classes(x: torch.Tensor, y: torch.Tensor, classes) -> tuple[torch.Tensor, torch.Tensor]:
    """The images of ``classes`` and their labels relabelled ``classes[i] -> i``."""
    relabel = torch.full((int(max(y.max(), max(classes))) + 1,), -1, dtype=torch.long)
    relabel[list(classes)] = torch.arange(len(classes))
    keep = relabel[y] >= 0
    return x[keep], relabel[y[keep]]


def _pool(
    x_id_tr, y_id_tr, ood_src, test: Split, n_holdout, n_ood, n_val, seed, ood_fraction
) -> Split:
    """The split of disjoint and unseen-ood: ``n_holdout`` ID and ``n_ood`` OOD training images in
    the unlabeled pool, its first ``n_val`` of each for validation; ``test``'s test set. ConfigError
    when the sizes cannot be met."""
    if not 1 <= n_holdout < len(x_id_tr):
        raise ConfigError(
            "n_holdout",
            f"n_holdout={n_holdout} must be >= 1 and below the {len(x_id_tr)} ID-class training "
            "images (at least one must stay labelled).",
        )
    if min(n_holdout, n_ood) <= n_val:
        raise ConfigError(
            "n_val",
            f"n_val={n_val} is too large: the unlabeled pool has {n_holdout} ID and {n_ood} OOD "
            "images, the first n_val of each go to validation and one must be left.",
        )
    p_tr, pool_ood = _perm(len(x_id_tr), seed), _perm(len(ood_src), seed)[:n_ood]
    pool_id, sup = p_tr[:n_holdout], p_tr[n_holdout:]
    unsup_ood = pool_ood[n_val:][: round(ood_fraction * (n_ood - n_val))]
    x_unsup = torch.cat([x_id_tr[pool_id[n_val:]], ood_src[unsup_ood]])  # the ID part first
    val = (x_id_tr[pool_id[:n_val]], y_id_tr[pool_id[:n_val]], ood_src[pool_ood[:n_val]])
    return Split(
        x_id_tr[sup], y_id_tr[sup], x_unsup, *val, test.test_id_x, test.test_id_y, test.test_ood_x
    )


def protocol_split(
    protocol: str,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    id_classes,
    ood_classes,
    *,
    n_val: int,
    seed: int,
    n_holdout: int,
    far_ood_train: torch.Tensor | None = None,
    ood_fraction: float = 1.0,
) -> Split:
    """The split of a held-out-class task under ``protocol``, each permutation
    ``RandomState(seed)``'s.

    The test set is :func:`transductive_split`'s of the ID and OOD classes' test images under every
    protocol. ``transductive`` trains on it; ``disjoint`` holds ``n_holdout`` ID training images out
    into an unlabeled pool with the OOD classes' training images in the test set's ID:OOD ratio (the
    first ``n_val`` of each part validate; of the rest's OOD part the first ``ood_fraction`` is
    kept); ``unseen-ood`` takes the pool's OOD part from ``far_ood_train``.

    Raises:
        ConfigError: before any work: an unknown protocol, ``n_val`` or ``n_holdout`` too large for
            the data (the message says how many images there are), ``far_ood_train`` missing under
            unseen-ood, ``ood_fraction`` outside [0, 1].
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(
            "protocol", f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}."
        )
    if not 0 <= ood_fraction <= 1:
        raise ConfigError(
            "unlabeled_ood_fraction", f"ood_fraction must be in [0, 1], got {ood_fraction}."
        )
    if protocol == "unseen-ood" and far_ood_train is None:
        raise ConfigError(
            "unlabeled_ood", "protocol 'unseen-ood' needs far_ood_train, the unlabeled OOD images."
        )
    x_id_tr, y_id_tr = keep_classes(x_train, y_train, id_classes)
    x_id_te, y_id_te = keep_classes(x_test, y_test, id_classes)
    x_ood_te = keep_classes(x_test, y_test, ood_classes)[0]
    test = transductive_split(x_id_tr, y_id_tr, x_id_te, y_id_te, x_ood_te, n_val, seed)
    if protocol == "transductive":
        return test
    ood_src = (
        keep_classes(x_train, y_train, ood_classes)[0] if protocol == "disjoint" else far_ood_train
    )
    n_ood = min(len(ood_src), round(n_holdout * len(x_ood_te) / len(x_id_te)))  # the test ratio
    return _pool(x_id_tr, y_id_tr, ood_src, test, n_holdout, n_ood, n_val, seed, ood_fraction)
