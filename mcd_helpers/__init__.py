"""Helpers for the MCD notebooks (Yu & Aizawa, "Unsupervised Out-of-Distribution Detection by
Maximum Classifier Discrepancy", ICCV 2019, arXiv 1908.04951).

The modules at the top are what the notebooks teach: the model (``models``), its losses and scores
(``losses``), the metrics (``metrics``), how a step feeds its batches (``strategies``: the strategy
table and one MCD iteration), BatchNorm's variants and statistics (``norms``, ``running_stats``),
the comparisons, graphs and memory of the two strategies (``compare``, ``graphs``, ``memory``,
``multisource``), the data (``data``, ``splits``), ODIN (``odin``), figures and tables (``plots``,
``tables``). ``mcd_helpers.experiments`` runs experiments (config, the resumable loop, cache,
stages, reproduce, benchmark, report); no module at the top imports it.

The face is lazy (PEP 562): ``import mcd_helpers.metrics`` loads the metrics alone, and
``mcd_helpers.compare_strategies`` imports :mod:`mcd_helpers.compare` when first touched.
"""

import importlib

__version__ = "0.1.0"
_NAMES = {
    "TwoHeadNet": "models",
    "small_cnn": "models",
    "resnet_20": "models",
    "densenet_bc_100": "models",
    "wrn_28_10": "models",
    "entropy": "losses",
    "supervised_loss": "losses",
    "discrepancy_loss": "losses",
    "discrepancy_score": "losses",
    "ood_metrics": "metrics",
    "STRATEGIES": "strategies",
    "mcd_step": "strategies",
    "compare_strategies": "compare",
    "compare_forwards": "compare",
    "draw_graph": "graphs",
}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    try:  # a module: mcd_helpers.data, mcd_helpers.experiments, ...
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])
