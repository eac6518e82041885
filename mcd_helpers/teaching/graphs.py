"""Autograd graphs of a loss: draw them with torchviz, count their nodes, find where forwards meet.

torchviz's ``make_dot`` (github.com/szagoruyko/pytorchviz, 0.0.3) walks ``loss.grad_fn`` back to
the leaves and returns a ``graphviz.Digraph``: grey boxes are backward functions, blue boxes the
parameters (``AccumulateGrad`` leaves, named when ``params`` is given). Rendering the picture
needs Graphviz's ``dot`` program (Debian/Ubuntu: ``apt-get install graphviz``; conda:
``conda install -c conda-forge graphviz``); the DOT text itself does not.

torchviz imports ``distutils``, which Python 3.12 removed from the standard library; importing
``setuptools`` first puts its copy in place (setuptools is one of this package's dependencies).
"""
from __future__ import annotations

import shutil
import warnings
from collections import Counter

import torch
from torch import nn

from ..errors import GraphTooLargeError, GraphvizMissingWarning

__all__ = ["draw_graph", "graph_nodes", "graph_stats", "param_consumers", "GraphTooLargeError",
           "GraphvizMissingWarning", "DOT_INSTALL_HINT"]

DOT_INSTALL_HINT = ("Install Graphviz's `dot` program to render the graph: `sudo apt-get install graphviz` "
                    "(Debian/Ubuntu), `conda install -c conda-forge graphviz` (conda), `brew install graphviz` "
                    "(macOS). Meanwhile the DOT source is returned; paste it into any Graphviz viewer.")


def _import_make_dot():
    """``torchviz.make_dot``, importing ``setuptools`` first when ``distutils`` is missing (Python >= 3.12)."""
    try:
        from torchviz import make_dot
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("distutils"):
            raise ImportError("draw_graph needs torchviz: `pip install torchviz`.") from err
        try:
            import setuptools  # noqa: F401  (its distutils shim stands in for the removed module)
        except ImportError:
            raise ImportError("torchviz imports distutils, which Python 3.12 removed; "
                              "`pip install setuptools` provides it.") from err
        from torchviz import make_dot
    return make_dot


def _dot_available() -> bool:
    return shutil.which("dot") is not None


def _roots(loss) -> list:
    losses = list(loss) if isinstance(loss, (tuple, list)) else [loss]
    if not losses:
        raise ValueError("loss must be a tensor or a non-empty tuple of tensors.")
    roots = []
    for t in losses:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor (or a tuple of them), got {type(t).__name__}.")
        if t.grad_fn is None:
            raise ValueError("this tensor has no autograd graph (grad_fn is None): it was computed under "
                             "torch.no_grad(), from inputs that do not require grad, or it was detached.")
        roots.append(t.grad_fn)
    return roots


def graph_nodes(loss) -> list:
    """All backward nodes reachable from ``loss.grad_fn`` (each once), breadth first.

    ``loss`` may be a tensor or a tuple of tensors. Includes the ``AccumulateGrad`` leaves.

    Raises:
        ValueError: if a tensor has no ``grad_fn``.
    """
    seen, order, queue = set(), [], _roots(loss)
    while queue:
        fn = queue.pop(0)
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        order.append(fn)
        queue.extend(nxt for nxt, _ in fn.next_functions)
    return order


def graph_stats(loss) -> dict:
    """Size of the autograd graph: ``{"nodes": int, "leaves": int, "by_type": {name: count}}``.

    ``leaves`` counts ``AccumulateGrad`` nodes (one per parameter or leaf input that needs grad).
    """
    nodes = graph_nodes(loss)
    by_type = Counter(type(fn).__name__ for fn in nodes)
    return {"nodes": len(nodes), "leaves": by_type.get("AccumulateGrad", 0),
            "by_type": dict(by_type.most_common())}


def param_consumers(loss, model: nn.Module) -> dict[str, int]:
    """Parameter name -> number of backward nodes that feed gradient into its ``AccumulateGrad`` leaf.

    With separate forwards each parameter is used once per forward, so its leaf has (at least)
    two consumers: this is where the two graphs meet. With one concatenated forward it has one.
    Parameters the loss does not reach get 0.
    """
    by_id = {id(p): name for name, p in model.named_parameters()}
    counts = {name: 0 for name in by_id.values()}
    for fn in graph_nodes(loss):
        for nxt, _ in fn.next_functions:
            if nxt is not None and type(nxt).__name__ == "AccumulateGrad" and id(nxt.variable) in by_id:
                counts[by_id[id(nxt.variable)]] += 1
    return counts


def draw_graph(loss, model: nn.Module | None = None, *, max_nodes: int | None = 150,
               show_attrs: bool = False, show_saved: bool = False):
    """Draw the autograd graph of ``loss`` with torchviz, parameters named after ``model``.

    Wraps ``torchviz.make_dot(loss, params=dict(model.named_parameters()), ...)``.

    Args:
        loss: a tensor with a ``grad_fn``, or a list or tuple of them (drawn jointly into one picture:
            shared nodes appear once).
        model: names the parameter leaves (e.g. ``F1.weight``); None leaves them unnamed.
        max_nodes: refuse graphs with more backward nodes than this (a DenseNet-BC-100 Step B
            has ~1,000 nodes; no drawing of that is readable); None draws any size.
        show_attrs, show_saved: passed to ``make_dot`` (attributes and saved tensors of each node).

    Returns:
        a ``graphviz.Digraph`` (shown as SVG in Jupyter) when Graphviz's ``dot`` is installed;
        otherwise the DOT source as a ``str``, with a :class:`GraphvizMissingWarning` giving
        install commands.

    Raises:
        GraphTooLargeError: (a ``ValueError``) when the graph has more than ``max_nodes`` nodes;
            the message gives the count and how to draw it anyway.
        ValueError: if ``loss`` has no autograd graph.
        ImportError: if torchviz (or, on Python >= 3.12, setuptools) is not installed.
    """
    n = len(graph_nodes(loss))
    if max_nodes is not None and n > max_nodes:
        raise GraphTooLargeError(
            f"the autograd graph of this loss has {n} nodes, more than max_nodes={max_nodes}: drawn, its "
            "boxes would be too small to read. Call graph_stats(loss) for a count by node type, draw a "
            "smaller model (e.g. one block, or small_cnn), or pass max_nodes=None to draw it anyway.")
    make_dot = _import_make_dot()
    if isinstance(loss, list):
        loss = tuple(loss)  # make_dot draws a tuple of outputs into one picture; a list is unhashable there
    params = dict(model.named_parameters()) if model is not None else None
    with warnings.catch_warnings():
        # torchviz 0.0.3 compares versions with distutils' LooseVersion, which warns on every call.
        warnings.filterwarnings("ignore", message="distutils Version classes are deprecated", category=DeprecationWarning)
        dot = make_dot(loss, params=params, show_attrs=show_attrs, show_saved=show_saved)
    if not _dot_available():
        warnings.warn("Graphviz's `dot` program was not found on PATH. " + DOT_INSTALL_HINT,
                      GraphvizMissingWarning, stacklevel=2)
        return dot.source
    return dot
