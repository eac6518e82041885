"""Helpers for the MCD notebooks: models, losses, metrics, data, training.

Layout (one concept a module):

* core, imported with the package: ``models`` (TwoHeadNet and its builders), ``losses`` (entropy,
  CE, discrepancy loss and score), ``metrics`` (AUROC, FPR95, ...), ``steps`` (Step A / Step B
  losses of one iteration), ``errors`` (every exception and its exit code);
* ``data``: the data sets, files and splits;
* ``training``: the training loop, batch order, checkpoints, DDP (never imported by the core);
* ``experiments``: configs, presets, the one pipeline, its cache, baselines, reports, the benchmark;
* ``teaching``: what the notebooks show (strategy comparisons, graphs, BatchNorm statistics, ...).

Yu & Aizawa, "Unsupervised Out-of-Distribution Detection by Maximum Classifier Discrepancy",
ICCV 2019 (arXiv 1908.04951).
"""
from . import data, losses, metrics, models
from .teaching.compare import compare_strategies
from .teaching.forwards import compare_forwards
from .teaching.graphs import draw_graph  # torchviz itself is imported on the first drawing
from .losses import discrepancy_loss, discrepancy_score, entropy, supervised_loss
from .metrics import ood_metrics
from .models import TwoHeadNet, densenet_bc_100, small_cnn, wrn_28_10

__version__ = "0.1.0"
__all__ = ["data", "losses", "metrics", "models", "TwoHeadNet", "small_cnn", "densenet_bc_100",
           "wrn_28_10", "entropy", "supervised_loss", "discrepancy_loss", "discrepancy_score",
           "ood_metrics", "compare_strategies", "compare_forwards", "draw_graph"]
