"""mcd_helpers.graphs: node counts on hand-built graphs, where separate forwards meet, draw_graph
with and without `dot`."""

import builtins
import re
import shutil

import graphviz
import pytest
import torch
from tiny_models import TinyTwoHead

from mcd_helpers import graphs
from mcd_helpers.graphs import (
    GraphTooLargeError,
    GraphvizMissingWarning,
    draw_graph,
    graph_nodes,
    graph_stats,
    param_consumers,
)
from mcd_helpers.models import densenet_bc_100
from mcd_helpers.strategies import step_b_loss

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz's dot is not installed"
)


def step_b_losses():
    model = TinyTwoHead("none")
    x_sup, y_sup, x_unsup = (
        torch.randn(3, 1, 4, 4),
        torch.tensor([0, 1, 2]),
        torch.randn(2, 1, 4, 4),
    )
    return (
        model,
        step_b_loss(model, x_sup, y_sup, x_unsup, "separate")[0],
        step_b_loss(model, x_sup, y_sup, x_unsup, "concat")[0],
    )


def drawn_nodes(out):
    """Node declarations (`<id> [label=...]`) in torchviz's DOT source."""
    return set(re.findall(r"^\s*(\d+) \[", out if isinstance(out, str) else out.source, re.M))


def test_graph_nodes_walks_a_hand_built_graph_breadth_first_once_per_node():
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    y = a * b
    # Add <- (Sum, Mean) <- Mul (reached twice, listed once) <- two AccumulateGrad
    loss = y.sum() + y.mean()
    assert [type(fn).__name__ for fn in graph_nodes(loss)] == [
        "AddBackward0",
        "SumBackward0",
        "MeanBackward0",
        "MulBackward0",
        "AccumulateGrad",
        "AccumulateGrad",
    ]
    assert graph_stats(loss) == {
        "nodes": 6,
        "leaves": 2,
        "by_type": {
            "AccumulateGrad": 2,
            "AddBackward0": 1,
            "SumBackward0": 1,
            "MeanBackward0": 1,
            "MulBackward0": 1,
        },
    }
    # two losses sharing the Mul: the union, every node once
    assert len(graph_nodes((y.sum(), y.mean()))) == 5


@pytest.mark.parametrize(
    "loss, error, match",
    [
        (1.0, TypeError, "loss must be a tensor or a non-empty tuple of tensors"),
        ((), TypeError, "loss must be a tensor or a non-empty tuple of tensors"),
        (
            torch.tensor(1.0),
            ValueError,
            r"grad_fn is None.*torch.no_grad\(\)",
        ),
        (
            (torch.ones(1, requires_grad=True) * 2, torch.tensor(1.0)),
            ValueError,
            "no autograd graph",
        ),
    ],
)
def test_graph_nodes_refuses_what_has_no_graph(loss, error, match):
    for fn in (graph_nodes, graph_stats, draw_graph):
        with pytest.raises(error, match=match):
            fn(loss)


def test_separate_forwards_meet_at_each_parameter_concat_uses_it_once():
    model, sep, cat = step_b_losses()
    assert param_consumers(sep, model) == {n: 2 for n, _ in model.named_parameters()}
    assert param_consumers(cat, model) == {n: 1 for n, _ in model.named_parameters()}
    unused = model(torch.randn(2, 1, 4, 4))[0].sum()  # head_b not reached
    counts = param_consumers(unused, model)
    assert counts["head_b.weight"] == counts["head_b.bias"] == 0 and counts["head_a.weight"] == 1


@needs_dot
def test_draw_graph_names_every_parameter_and_renders_svg():
    model, sep, _ = step_b_losses()
    dot = draw_graph(sep, model)
    assert isinstance(dot, graphviz.Digraph)
    stats = graph_stats(sep)
    # torchviz: a box per backward node, one per parameter beside its AccumulateGrad, one for the
    # output
    assert len(drawn_nodes(dot)) == stats["nodes"] + stats["leaves"] + 1
    svg = dot.pipe(format="svg").decode()
    assert "<svg" in svg and all(name in svg for name, _ in model.named_parameters())


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_or_tuple_of_losses_is_drawn_jointly(container):
    model, sep, cat = step_b_losses()
    stats = graph_stats((sep, cat))  # the union: shared parameters once
    assert (
        len(drawn_nodes(draw_graph(container([sep, cat]), model)))
        == stats["nodes"] + stats["leaves"] + 2
    )


def test_without_dot_the_source_is_returned_with_the_install_commands(monkeypatch):
    model, sep, _ = step_b_losses()
    monkeypatch.setattr(graphs.shutil, "which", lambda name, *a, **k: None)
    with pytest.warns(
        GraphvizMissingWarning,
        match=r"`dot` program was not found on PATH.*apt-get install graphviz.*"
        r"conda install -c conda-forge graphviz.*brew install graphviz",
    ):
        out = draw_graph(sep, model)
    assert isinstance(out, str) and out.lstrip().startswith("digraph")
    assert "conv.weight" in out and out.count("AccumulateGrad") == 6  # 6 parameters, each leaf once


@needs_dot
def test_a_graph_larger_than_max_nodes_is_declined_with_its_count():
    model, sep, _ = step_b_losses()
    n = graph_stats(sep)["nodes"]
    with pytest.raises(GraphTooLargeError, match=f"{n} nodes.*max_nodes={n - 1}.*max_nodes=None"):
        draw_graph(sep, model, max_nodes=n - 1)
    assert issubclass(GraphTooLargeError, ValueError)
    # the limit itself is allowed
    assert isinstance(draw_graph(sep, model, max_nodes=n), graphviz.Digraph)


def test_densenet_step_b_is_declined_by_default_and_drawn_on_request():
    model = densenet_bc_100(in_channels=1, num_classes=3)
    x = torch.randn(2, 1, 8, 8)
    loss = step_b_loss(model, x, torch.tensor([0, 1]), x, "separate")[0]
    n = graph_stats(loss)["nodes"]
    assert 800 < n < 1300  # "about 1,000"
    with pytest.raises(GraphTooLargeError, match=f"{n} nodes.*max_nodes=150"):
        draw_graph(loss, model)
    assert len(drawn_nodes(draw_graph(loss, model, max_nodes=None))) > n


@pytest.mark.parametrize("missing", ["torchviz", "distutils"])
def test_a_missing_import_is_named_with_the_fix(monkeypatch, missing):
    real_import = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "torchviz":
            raise ModuleNotFoundError(f"No module named '{missing}'", name=missing)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(
        ImportError,
        match=rf"torchviz.*setuptools.*'{missing}'",
    ):
        draw_graph(torch.ones(2, requires_grad=True).sum())


def test_a_linear_weights_consumers_are_its_transposed_views_one_per_forward():
    # notebook 04: under separate forwards the weight's AccumulateGrad is reached through two
    # TBackward0 nodes
    lin = torch.nn.Linear(3, 2)
    loss = lin(torch.randn(4, 3)).sum() + lin(torch.randn(5, 3)).sum()
    found, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is lin.weight:
                found.append(type(node).__name__)
            stack.append(child)
    assert found == ["TBackward0", "TBackward0"]
    assert param_consumers(loss, lin)["weight"] == 2
