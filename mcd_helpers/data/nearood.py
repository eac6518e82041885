"""Near-OOD tasks with held-out classes (6 known / 4 unknown) and the protocols they are evaluated under.

As in open-set recognition, a class split divides Fashion-MNIST's ten classes into ID classes (known,
labelled in pre-training) and OOD classes (unknown, never labelled anywhere). Labels of the ID
classes are relabelled ``0..5`` in the order the split lists them.

Protocols (:func:`protocol_split`), which differ in where the unlabeled fine-tuning set comes from:

* ``transductive``: the paper's and the official loader's (``utils/loader.py``): the unlabeled set
  *is* the test set.
* ``disjoint``: the unlabeled set comes from training images that are neither labelled nor tested.
* ``unseen-ood``: as ``disjoint``, but its OOD part comes from another source (far-OOD images) than
  the test OOD (the held-out classes).

Model selection (``SELECTIONS``) is an orthogonal setting: ``ood-labels`` (official) picks the epoch
with OOD-labelled validation data; ``last-epoch`` uses no OOD labels. This module only provides the
data; ``val_ood_x`` is meant to be used with ``ood-labels`` only.

Shapes: images ``x`` ``(N, C, H, W)`` float (Fashion-MNIST ``(N, 1, 28, 28)``), labels ``y`` ``(N,)``
int64 in ``0..9``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..errors import ConfigError

__all__ = ["FMNIST_CLASSES", "CLASS_SPLITS", "PROTOCOLS", "SELECTIONS", "ProtocolSplit",
           "check_class_split", "class_split", "protocol_split"]

FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                  "Bag", "Ankle boot")

CLASS_SPLITS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "a": ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9)),
    "b": ((0, 2, 3, 5, 7, 9), (1, 4, 6, 8)),
    "c": ((1, 3, 4, 6, 8, 9), (0, 2, 5, 7)),
}
"""Fixed class splits of Fashion-MNIST, ``name -> (id_classes, ood_classes)``, 6 known / 4 unknown.

* ``"a"`` (mandated by issue 12): ID T-shirt/top, Trouser, Pullover, Dress, Coat, Sandal;
  OOD Shirt, Sneaker, Bag, Ankle boot. The hardest: Shirt is held out while its look-alikes
  T-shirt/top, Pullover and Coat are known. Measured earlier on ``"a"`` with ``small_cnn``:
  MSP AUROC 63.9%, MCD 88-90% (transductive).
* ``"b"``: ID T-shirt/top, Pullover, Dress, Sandal, Sneaker, Ankle boot;
  OOD Trouser, Coat, Shirt, Bag (Coat and Shirt held out beside known T-shirt/top and Pullover).
* ``"c"``: ID Trouser, Dress, Coat, Shirt, Bag, Ankle boot;
  OOD T-shirt/top, Pullover, Sandal, Sneaker (footwear split: Ankle boot known, Sandal and Sneaker not).
"""

PROTOCOLS = ("transductive", "disjoint", "unseen-ood")
SELECTIONS = ("ood-labels", "last-epoch")


def _names(classes: Iterable[int]) -> str:
    return ", ".join(f"{c} {FMNIST_CLASSES[c]}" if 0 <= c < len(FMNIST_CLASSES) else str(c) for c in classes)


def _known_splits() -> str:
    return "; ".join(f"{k!r}: ID ({_names(i)}) OOD ({_names(o)})" for k, (i, o) in CLASS_SPLITS.items())


def check_class_split(id_classes, ood_classes, num_classes: int = 10) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate an ID/OOD class list and return it as two tuples of ``int`` (order kept).

    Args:
        id_classes: the known classes; their order defines the relabelling (``id_classes[i] -> i``).
        ood_classes: the held-out classes.
        num_classes: classes of the data set (valid values ``0..num_classes-1``).

    Raises:
        ConfigError (field ``class_split``): a list that is empty or not a list of integers,
            a class out of range, a class listed twice, or a class both ID and OOD. The message
            lists the valid values and the known splits of :data:`CLASS_SPLITS`.
    """
    valid = f"valid classes are 0..{num_classes - 1}"
    if num_classes == len(FMNIST_CLASSES):
        valid += f" ({_names(range(num_classes))})"
    hint = f"; {valid}. Known splits (class_split(name)): {_known_splits()}."
    out = []
    for which, classes in (("id_classes", id_classes), ("ood_classes", ood_classes)):
        if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
            raise ConfigError("class_split", f"{which} must be a list of class indices, got {classes!r}{hint}")
        classes = list(classes)
        if not classes:
            raise ConfigError("class_split", f"{which} is empty{hint}")
        bad = [c for c in classes if isinstance(c, bool) or not isinstance(c, (int, np.integer))]
        if bad:
            raise ConfigError("class_split", f"{which} holds non-integer value(s) {bad}{hint}")
        classes = tuple(int(c) for c in classes)
        outside = [c for c in classes if not 0 <= c < num_classes]
        if outside:
            raise ConfigError("class_split", f"{which} holds class(es) {outside} out of range{hint}")
        twice = sorted({c for c in classes if classes.count(c) > 1})
        if twice:
            raise ConfigError("class_split", f"{which} lists class(es) {twice} more than once{hint}")
        out.append(classes)
    both = sorted(set(out[0]) & set(out[1]))
    if both:
        raise ConfigError("class_split", f"class(es) {both} are both ID and OOD (overlap){hint}")
    return out[0], out[1]


def class_split(name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(id_classes, ood_classes)`` of a named split of :data:`CLASS_SPLITS`, or of a written one.

    A written split lists the ID class digits, a slash, the OOD class digits: ``"012345/6789"``
    is split ``"a"``; ``"0123/45"`` leaves classes 6-9 out of the task. It is checked by
    :func:`check_class_split`.

    Raises:
        ConfigError (field ``class_split``): an unknown name, a written split that is not
            ``digits/digits``, or one that :func:`check_class_split` refuses (empty, overlapping,
            a class twice); the message names the known splits.
    """
    if name in CLASS_SPLITS:
        return CLASS_SPLITS[name]
    if isinstance(name, str) and name.count("/") == 1:
        id_part, ood_part = name.split("/")
        if all(c.isdigit() for c in id_part + ood_part):
            return check_class_split([int(c) for c in id_part], [int(c) for c in ood_part])
    raise ConfigError("class_split", f"unknown class split {name!r}; give a known name or the ID and OOD class "
                                     f"digits as 'IDS/OODS' (e.g. '012345/6789'). Known splits: {_known_splits()}.")


@dataclass
class ProtocolSplit:
    """The data of one protocol: labelled, unlabeled, validation and test images.

    Shapes: ``x_*`` ``(N_*, C, H, W)``; ``y_*`` ``(N_*,)`` int64, ID classes relabelled ``0..k-1``
    (``0..5`` for the named 6/4 splits) in the order of ``id_classes``. Held-out (OOD) classes never carry a label.

    Fields:
        x_sup, y_sup: labelled ID training images (pre-training and the supervised stream).
        x_unsup: the unlabeled fine-tuning set (ID and OOD mixed, no labels).
        val_id_x, val_id_y, val_ood_x: model-selection data; ``val_ood_x`` is for selection
            ``ood-labels`` only.
        test_id_x, test_id_y, test_ood_x: the test data.
        protocol: one of :data:`PROTOCOLS`.
    """
    x_sup: torch.Tensor
    y_sup: torch.Tensor
    x_unsup: torch.Tensor
    val_id_x: torch.Tensor
    val_id_y: torch.Tensor
    val_ood_x: torch.Tensor
    test_id_x: torch.Tensor
    test_id_y: torch.Tensor
    test_ood_x: torch.Tensor
    protocol: str

    def unlabeled(self) -> TensorDataset:
        """The unlabeled fine-tuning set as a one-tensor dataset, ``(N_u, C, H, W)``."""
        return TensorDataset(self.x_unsup)


def _check_data(x: torch.Tensor, y: torch.Tensor, name: str, num_classes: int) -> None:
    if not torch.is_tensor(x) or not torch.is_tensor(y) or x.ndim != 4 or y.ndim != 1:
        raise ConfigError(f"x_{name}", f"x_{name} must be a tensor (N, C, H, W) and y_{name} a tensor (N,), got "
                                       f"shapes {tuple(getattr(x, 'shape', ()))} and {tuple(getattr(y, 'shape', ()))}.")
    if len(x) != len(y):
        raise ConfigError(f"y_{name}", f"x_{name} has {len(x)} images but y_{name} has {len(y)} labels; "
                                       "pass one label per image.")
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ConfigError(f"y_{name}", f"y_{name} must hold integer class labels, got dtype {y.dtype}.")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ConfigError(f"y_{name}", f"y_{name} holds labels in {int(y.min())}..{int(y.max())}; "
                                       f"valid labels are 0..{num_classes - 1}.")


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(name, f"{name} must be an integer >= 1, got {value!r}.")
    return int(value)


def _too_large(name: str, value: int, have: int, what: str, need: str) -> ConfigError:
    return ConfigError(name, f"{name}={value} is too large: the {what} has {have} images and {need}; "
                             f"pass a smaller {name}.")


def _pool_ood(n_holdout: int, n_id_te: int, n_ood_te: int, available: int) -> int:
    """OOD images in the unlabeled pool: ``n_holdout`` times the test set's OOD:ID ratio, at most ``available``."""
    return min(available, round(n_holdout * n_ood_te / n_id_te))


def protocol_split(protocol: str, x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor,
                   y_test: torch.Tensor, id_classes, ood_classes, *, n_val: int, seed: int, n_holdout: int,
                   far_ood_train: torch.Tensor | None = None) -> ProtocolSplit:
    """Split the data of a held-out-class task under one protocol.

    Every permutation is ``np.random.RandomState(seed).permutation`` (a fresh generator per set, as
    the official loader). ID labels are relabelled ``id_classes[i] -> i``; OOD-class labels are
    dropped. Let ID_tr / OOD_tr be the training images of the ID / OOD classes, ID_te / OOD_te those
    of the test set.

    * ``transductive`` (paper, official ``utils/loader.py``): ``x_sup`` = all of ID_tr. ID_te and
      OOD_te are each permuted; the first ``n_val`` of each are ``val_id`` / ``val_ood``, the rest
      ``test_id`` / ``test_ood``; ``x_unsup = cat(test_id_x, test_ood_x)``: the test set itself.
      ``n_holdout`` is not used.
    * ``disjoint``: everything trained on comes from the training set. ID_tr is permuted; its first
      ``n_holdout`` go to the unlabeled pool (without labels), the rest are ``x_sup``. OOD_tr is
      permuted and its first ``min(len(OOD_tr), round(n_holdout * |OOD_te| / |ID_te|))`` join the
      pool, so the pool has the test set's ID:OOD ratio (6:4 for Fashion-MNIST's 6/4 splits), as
      the transductive unlabeled set has. The first ``n_val`` of the pool's ID part and of its OOD
      part are ``val_id`` / ``val_ood`` and are removed from the pool; the rest is ``x_unsup`` (ID
      part first).
    * ``unseen-ood``: as ``disjoint`` for ``x_sup``, the pool's ID part and ``val_id``, but the
      pool's OOD part (and ``val_ood``) come from ``far_ood_train`` (permuted, the same count);
      OOD_tr is not used.

    The test set is the same under every protocol: the transductive ``test_id`` / ``test_ood``
    (the permuted test set without its first ``n_val`` of each part, which under ``disjoint`` and
    ``unseen-ood`` are left unused), so the protocols are compared on the same images. It is never
    trained on under ``disjoint`` and ``unseen-ood``.

    Args:
        protocol: one of :data:`PROTOCOLS`.
        x_train, y_train: training images ``(N, C, H, W)`` float and labels ``(N,)`` in ``0..9``.
        x_test, y_test: test images and labels, same layout.
        id_classes, ood_classes: a class split (see :func:`check_class_split`, :func:`class_split`).
        n_val: validation images of each of ID and OOD (official: 1,000).
        seed: seed of the permutations (official: 3).
        n_holdout: ID training images held out of the labelled set for the unlabeled pool
            (``disjoint`` / ``unseen-ood``).
        far_ood_train: far-OOD images ``(M, C, H, W)`` (digits, noise, ...) for ``unseen-ood``.

    Returns:
        a :class:`ProtocolSplit`.

    Raises:
        ConfigError: before any work, for an unknown protocol (lists :data:`PROTOCOLS`), a class
            split that fails :func:`check_class_split`, images and labels of different lengths or
            shapes, labels outside ``0..9``, ``n_val`` / ``n_holdout`` below 1 or too large for the
            data (the message says how many images there are), or ``far_ood_train`` missing or of
            another image shape under ``unseen-ood``.
    """
    # ---- validate everything before any work --------------------------------------------------
    if protocol not in PROTOCOLS:
        raise ConfigError("protocol", f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}.")
    num_classes = len(FMNIST_CLASSES)
    id_classes, ood_classes = check_class_split(id_classes, ood_classes, num_classes)
    _check_data(x_train, y_train, "train", num_classes)
    _check_data(x_test, y_test, "test", num_classes)
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ConfigError("x_test", f"training images are {tuple(x_train.shape[1:])} but test images "
                                    f"{tuple(x_test.shape[1:])}; pass images of one shape.")
    n_val = _count(n_val, "n_val")
    is_id_tr, is_ood_tr = (torch.isin(y_train, torch.tensor(c)) for c in (id_classes, ood_classes))
    is_id_te, is_ood_te = (torch.isin(y_test, torch.tensor(c)) for c in (id_classes, ood_classes))
    n_id_tr, n_ood_tr = int(is_id_tr.sum()), int(is_ood_tr.sum())
    n_id_te, n_ood_te = int(is_id_te.sum()), int(is_ood_te.sum())
    if n_id_tr == 0:
        raise ConfigError("class_split", f"the training set holds no image of the ID classes {list(id_classes)}.")
    for n, what in ((n_id_te, "test set's ID-class part"), (n_ood_te, "test set's OOD-class part")):
        if n == 0:
            raise ConfigError("class_split", f"the {what} is empty; check the labels and the class split.")
    for n, what in ((n_id_te, "test set's ID-class part"), (n_ood_te, "test set's OOD-class part")):
        if n <= n_val:  # every protocol tests on the transductive test images
            raise _too_large("n_val", n_val, n, what, "the first n_val are left out of the test set (validation "
                             "under transductive), at least one must be left for testing")
    if protocol != "transductive":
        n_holdout = _count(n_holdout, "n_holdout")
        if n_holdout >= n_id_tr:
            raise _too_large("n_holdout", n_holdout, n_id_tr, "training set's ID-class part",
                             "at least one must stay labelled")
        if protocol == "unseen-ood":
            if far_ood_train is None:
                raise ConfigError("far_ood_train", "protocol 'unseen-ood' takes the unlabeled OOD images from "
                                                   "far_ood_train (digits, noise, ...); pass that tensor.")
            if not torch.is_tensor(far_ood_train) or far_ood_train.shape[1:] != x_train.shape[1:]:
                raise ConfigError("far_ood_train", f"far_ood_train must be a tensor of images "
                                  f"{('N',) + tuple(x_train.shape[1:])} like x_train, got shape "
                                  f"{tuple(getattr(far_ood_train, 'shape', ()))}.")
        n_ood_src = n_ood_tr if protocol == "disjoint" else len(far_ood_train)
        src = "training set's OOD-class part" if protocol == "disjoint" else "far_ood_train set"
        n_pool_ood = _pool_ood(n_holdout, n_id_te, n_ood_te, n_ood_src)
        for n, what in ((n_holdout, f"unlabeled pool's ID part (n_holdout={n_holdout})"),
                        (n_pool_ood, f"unlabeled pool's OOD part (the {src}, n_holdout times the test set's "
                                     "OOD:ID ratio, at most all of it)")):
            if n <= n_val:
                raise _too_large("n_val", n_val, n, what, "the first n_val go to validation, at least one "
                                 "must be left in the unlabeled set")

    # ---- split --------------------------------------------------------------------------------
    relabel = torch.full((num_classes,), -1, dtype=torch.int64)
    relabel[list(id_classes)] = torch.arange(len(id_classes))

    def perm(n: int) -> torch.Tensor:
        return torch.from_numpy(np.random.RandomState(seed).permutation(n))

    x_id_tr, y_id_tr = x_train[is_id_tr], relabel[y_train[is_id_tr]]
    x_id_te, y_id_te = x_test[is_id_te], relabel[y_test[is_id_te]]
    x_ood_te = x_test[is_ood_te]
    p_id, p_ood = perm(n_id_te), perm(n_ood_te)  # the test set of every protocol
    test_id_x, test_id_y, test_ood_x = x_id_te[p_id[n_val:]], y_id_te[p_id[n_val:]], x_ood_te[p_ood[n_val:]]
    if protocol == "transductive":
        return ProtocolSplit(x_sup=x_id_tr, y_sup=y_id_tr, x_unsup=torch.cat([test_id_x, test_ood_x]),
                             val_id_x=x_id_te[p_id[:n_val]], val_id_y=y_id_te[p_id[:n_val]],
                             val_ood_x=x_ood_te[p_ood[:n_val]], test_id_x=test_id_x, test_id_y=test_id_y,
                             test_ood_x=test_ood_x, protocol=protocol)

    p_tr = perm(n_id_tr)
    pool_id, sup = p_tr[:n_holdout], p_tr[n_holdout:]
    ood_src = x_train[is_ood_tr] if protocol == "disjoint" else far_ood_train
    pool_ood = perm(len(ood_src))[:_pool_ood(n_holdout, n_id_te, n_ood_te, len(ood_src))]  # the test set's ratio
    return ProtocolSplit(x_sup=x_id_tr[sup], y_sup=y_id_tr[sup],
                         x_unsup=torch.cat([x_id_tr[pool_id[n_val:]], ood_src[pool_ood[n_val:]]]),
                         val_id_x=x_id_tr[pool_id[:n_val]], val_id_y=y_id_tr[pool_id[:n_val]],
                         val_ood_x=ood_src[pool_ood[:n_val]], test_id_x=test_id_x, test_id_y=test_id_y,
                         test_ood_x=test_ood_x, protocol=protocol)
