"""Data: Fashion-MNIST and the offline OOD sets (``sets``), the file helpers and cache folders
(``files``), CIFAR-10/100 from the pickled archives (``cifar``) and the near-OOD held-out-class
splits with the transductive, disjoint and unseen-ood protocols (``nearood``).

``mcd_helpers.data.infinite_loader`` and the loaders below stay importable from here (code
outside the repository calls them).
"""
from ..errors import CorruptDataError, DataNotFoundError
from .sets import (OFFLINE_OOD_SETS, OOD_SETS, infinite_loader, load_fashion_mnist, load_id, load_ood,
                   normalize, transductive_split)

__all__ = ["infinite_loader", "load_fashion_mnist", "load_id", "load_ood", "normalize", "transductive_split",
           "OFFLINE_OOD_SETS", "OOD_SETS", "DataNotFoundError", "CorruptDataError"]
