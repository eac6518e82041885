"""Helpers for the MCD notebooks (Yu & Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum
Classifier Discrepancy", ICCV 2019, arXiv 1908.04951): one module per concept, loaded on first use.

The face is lazy (PEP 562): ``import mcd_helpers.metrics`` loads the metrics alone, and
``mcd_helpers.compare_strategies`` imports :mod:`mcd_helpers.compare` when first touched.
"""
import importlib

__version__ = "0.1.0"
_NAMES = {"TwoHeadNet": "models", "small_cnn": "models", "densenet_bc_100": "models", "wrn_28_10": "models",
          "entropy": "losses", "supervised_loss": "losses", "discrepancy_loss": "losses", "discrepancy_score": "losses",
          "ood_metrics": "metrics", "compare_strategies": "compare", "compare_forwards": "compare", "draw_graph": "graphs"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    try:
        return importlib.import_module(f".{name}", __name__)  # a module: mcd_helpers.data, mcd_helpers.train, ...
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
