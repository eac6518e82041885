"""Autograd graphs of a loss: draw them with torchviz, count their nodes, find where forwards meet.

torchviz's ``make_dot`` (github.com/szagoruyko/pytorchviz, 0.0.3) walks ``loss.grad_fn`` back to the
leaves and returns a ``graphviz.Digraph``: grey boxes are backward functions, blue boxes parameters
(``AccumulateGrad`` leaves, named when ``params`` is given). Rendering needs Graphviz's ``dot``
program; the DOT text does not. torchviz imports ``distutils``, which Python 3.12 removed:
setuptools (a dependency) provides it.
"""

import shutil
import warnings
from collections import Counter

import torch
from torch import nn


class GraphTooLargeError(ValueError):
    """The graph has more nodes than a readable drawing can show; the message says how many."""


class GraphvizMissingWarning(UserWarning):
    """Graphviz's ``dot`` is not installed: DOT source returned instead of a picture."""


def graph_nodes(loss) -> list:
    """Every backward node reachable from ``loss.grad_fn`` (a tensor or a tuple of them), once each,
    breadth first, ``AccumulateGrad`` leaves included.

    Raises:
        TypeError: not a tensor; ValueError: a tensor without ``grad_fn`` (no_grad, detached).
    """
    losses = list(loss) if isinstance(loss, (tuple, list)) else [loss]
    if not losses or not all(isinstance(t, torch.Tensor) for t in losses):
        raise TypeError("loss must be a tensor or a non-empty tuple of tensors.")
    if any(t.grad_fn is None for t in losses):
        raise ValueError(
            "this tensor has no autograd graph (grad_fn is None): it was computed under "
            "torch.no_grad(), from inputs that do not require grad, or it was detached."
        )
    order, queue = {}, [t.grad_fn for t in losses]  # order: an insertion-ordered set
    while queue:
        if (fn := queue.pop(0)) is not None and fn not in order:
            order[fn] = None
            queue.extend(nxt for nxt, _ in fn.next_functions)
    return list(order)


def graph_stats(loss) -> dict:
    """Size of the graph:
    ``{"nodes": int, "leaves": int (AccumulateGrad), "by_type": {name: count}}``."""
    by_type = Counter(type(fn).__name__ for fn in graph_nodes(loss))
    return {
        "nodes": sum(by_type.values()),
        "leaves": by_type.get("AccumulateGrad", 0),
        "by_type": dict(by_type.most_common()),
    }


def param_consumers(loss, model: nn.Module) -> dict[str, int]:
    """Parameter name -> number of backward nodes that feed gradient into its ``AccumulateGrad``
    leaf.

    Separate forwards use each parameter once per forward: two consumers, where the two graphs meet;
    one concatenated forward gives one. Parameters the loss does not reach get 0.
    """
    by_id = {id(p): name for name, p in model.named_parameters()}
    counts = Counter(
        by_id[id(nxt.variable)]
        for fn in graph_nodes(loss)
        for nxt, _ in fn.next_functions
        if type(nxt).__name__ == "AccumulateGrad" and id(nxt.variable) in by_id
    )
    return {name: counts[name] for name in by_id.values()}


def draw_graph(
    loss,
    model: nn.Module | None = None,
    *,
    max_nodes: int | None = 150,
    show_attrs: bool = False,
    show_saved: bool = False,
):
    """Draw the autograd graph of ``loss`` (a tensor, or a list/tuple drawn jointly) with torchviz's
    ``make_dot(loss, params=dict(model.named_parameters()), show_attrs=, show_saved=)``.

    Args:
        model: names the parameter leaves (``F1.weight``, ...); None leaves them unnamed.
        max_nodes: refuse graphs with more nodes (a DenseNet-BC-100 Step B has about 1,000); None:
        any.

    Returns:
        a ``graphviz.Digraph`` (SVG in Jupyter), or, without Graphviz's ``dot``, the DOT source as a
        ``str`` with a :class:`GraphvizMissingWarning` giving the install commands.

    Raises:
        GraphTooLargeError: (a ValueError) more than ``max_nodes`` nodes; the message gives the
        count. ValueError: ``loss`` has no graph. ImportError: torchviz (or setuptools on Python >=
        3.12) missing.
    """
    n = len(graph_nodes(loss))
    if max_nodes is not None and n > max_nodes:
        raise GraphTooLargeError(
            f"the autograd graph of this loss has {n} nodes, more than max_nodes={max_nodes}, too "
            "many to read: see graph_stats(loss), draw a smaller model, or pass max_nodes=None."
        )
    try:
        from torchviz import make_dot
    # torchviz itself, or distutils (gone in Python 3.12; setuptools provides it)
    except ImportError as err:
        raise ImportError(
            "draw_graph needs torchviz and, on Python >= 3.12, setuptools (for "
            f"distutils): `pip install torchviz setuptools` ({err})."
        ) from err
    with warnings.catch_warnings():  # torchviz 0.0.3 compares versions with distutils' LooseVersion
        warnings.filterwarnings(
            "ignore", "distutils Version classes are deprecated", DeprecationWarning
        )
        dot = make_dot(
            tuple(loss) if isinstance(loss, list) else loss,
            show_attrs=show_attrs,
            show_saved=show_saved,
            params=None if model is None else dict(model.named_parameters()),
        )
    if shutil.which("dot") is None:
        warnings.warn(
            "Graphviz's `dot` program was not found on PATH; returning the DOT source. To "
            "render it: `sudo "
            "apt-get install graphviz`, `conda install -c conda-forge graphviz` or `brew "
            "install graphviz`.",
            GraphvizMissingWarning,
            stacklevel=2,
        )
        return dot.source
    return dot
