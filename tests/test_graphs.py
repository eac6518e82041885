"""draw_graph and the autograd-graph counters, with and without Graphviz's `dot`."""
import builtins
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import mcd_helpers
from mcd_helpers.teaching import graphs
from mcd_helpers.teaching.graphs import (GraphTooLargeError, GraphvizMissingWarning, draw_graph, graph_nodes, graph_stats,
                                param_consumers)
from mcd_helpers.training.loop import step_b_loss
from tiny_models import TinyTwoHead

HAS_DOT = shutil.which("dot") is not None


def tiny_losses():
    model = TinyTwoHead("none")
    x_sup, y_sup, x_unsup = torch.randn(3, 1, 4, 4), torch.tensor([0, 1, 2]), torch.randn(2, 1, 4, 4)
    sep, _ = step_b_loss(model, x_sup, y_sup, x_unsup, "separate")
    cat, _ = step_b_loss(model, x_sup, y_sup, x_unsup, "concat")
    return model, sep, cat


def test_graph_nodes_counts_a_hand_built_graph():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    loss = (a * b).sum()  # SumBackward0 <- MulBackward0 <- AccumulateGrad(a), AccumulateGrad(b)
    names = sorted(type(fn).__name__ for fn in graph_nodes(loss))
    assert names == ["AccumulateGrad", "AccumulateGrad", "MulBackward0", "SumBackward0"]
    stats = graph_stats(loss)
    assert stats == {"nodes": 4, "leaves": 2, "by_type": {"AccumulateGrad": 2, "SumBackward0": 1, "MulBackward0": 1}}


def test_param_consumers_separate_two_concat_one():
    model, sep, cat = tiny_losses()
    assert param_consumers(sep, model) == {n: 2 for n, _ in model.named_parameters()}
    assert param_consumers(cat, model) == {n: 1 for n, _ in model.named_parameters()}
    # Concat slices its outputs; separate forwards never slice.
    assert "SliceBackward0" in graph_stats(cat)["by_type"]
    assert "SliceBackward0" not in graph_stats(sep)["by_type"]


def test_param_consumers_counts_zero_for_unused_parameters():
    model = TinyTwoHead()
    loss = model(torch.randn(2, 1, 4, 4))[0].sum()  # head_b not used
    counts = param_consumers(loss, model)
    assert counts["head_b.weight"] == 0 and counts["head_a.weight"] == 1


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz's dot is not installed")
def test_draw_graph_names_parameters_and_renders_svg():
    model, sep, _ = tiny_losses()
    dot = draw_graph(sep, model)
    import graphviz
    assert isinstance(dot, graphviz.Digraph)
    for name, p in model.named_parameters():
        assert name in dot.source
    svg = dot.pipe(format="svg").decode()
    assert "<svg" in svg and "head_a.weight" in svg


def test_draw_graph_without_dot_returns_source_and_warns(monkeypatch):
    model, sep, _ = tiny_losses()
    monkeypatch.setattr(graphs.shutil, "which", lambda name, *a, **k: None)
    with pytest.warns(GraphvizMissingWarning) as record:
        out = draw_graph(sep, model)
    assert isinstance(out, str) and out.lstrip().startswith("digraph")
    assert "conv.weight" in out and out.count("AccumulateGrad") == 6  # 6 parameters, each leaf once
    msg = str([r for r in record if r.category is GraphvizMissingWarning][0].message)
    assert "apt-get install graphviz" in msg and "conda install -c conda-forge graphviz" in msg


def test_draw_graph_without_dot_in_the_graphviz_backend(monkeypatch):
    """Rendering itself fails without dot; draw_graph must not try to render when dot is missing."""
    import graphviz

    def no_dot(*args, **kwargs):
        raise graphviz.ExecutableNotFound(["dot"])

    monkeypatch.setattr(graphs.shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(graphviz.Digraph, "pipe", no_dot)
    model, sep, _ = tiny_losses()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = draw_graph(sep, model)
    assert isinstance(out, str) and any(issubclass(x.category, GraphvizMissingWarning) for x in w)


def test_large_graph_is_declined_with_the_count():
    model, sep, _ = tiny_losses()
    n = graph_stats(sep)["nodes"]
    with pytest.raises(GraphTooLargeError, match=f"has {n} nodes, more than max_nodes=10"):
        draw_graph(sep, model, max_nodes=10)
    with pytest.raises(ValueError, match="max_nodes=None"):  # a ValueError, so callers catching those see it
        draw_graph(sep, model, max_nodes=10)
    # No limit: drawn, every node present (a DOT source string when Graphviz's dot is missing).
    assert _drawn_ids(draw_graph(sep, model, max_nodes=None)) == _expected_boxes(sep, 1)


def _drawn_ids(out) -> int:
    """Node declarations in torchviz's DOT source (`<id> [label=...]`)."""
    import re

    source = out if isinstance(out, str) else out.source
    return len(set(re.findall(r"^\s*(\d+) \[", source, re.M)))


def _expected_boxes(loss, outputs: int) -> int:
    # torchviz draws every backward node, a box per parameter next to its AccumulateGrad, one per output tensor.
    stats = graph_stats(loss)
    return stats["nodes"] + stats["leaves"] + outputs


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_or_tuple_of_losses_is_drawn_jointly(container):
    # Finding 8: draw_graph([a, b]) raised "TypeError: unhashable type: 'list'" inside torchviz.
    model, sep, cat = tiny_losses()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphvizMissingWarning)
        out = draw_graph(container([sep, cat]), model)
    # Shared parameters appear once: the joint drawing has the union of both graphs' nodes.
    assert _drawn_ids(out) == _expected_boxes((sep, cat), 2)
    assert _expected_boxes((sep, cat), 2) < _expected_boxes(sep, 1) + _expected_boxes(cat, 1)


def test_densenet_step_b_is_declined_by_default():
    model = mcd_helpers.densenet_bc_100(in_channels=1, num_classes=3)
    x = torch.randn(2, 1, 8, 8)
    loss, _ = step_b_loss(model, x, torch.tensor([0, 1]), x, "separate")
    # 3 dense blocks x 16 bottleneck layers, each with 2 convs and 2 BNs: hundreds of nodes.
    assert graph_stats(loss)["nodes"] > 500
    with pytest.raises(GraphTooLargeError, match="max_nodes=None"):
        draw_graph(loss, model)


def test_no_graph_raises():
    with pytest.raises(ValueError, match="no autograd graph"):
        draw_graph(torch.tensor(1.0))
    with torch.no_grad():
        loss = TinyTwoHead()(torch.randn(2, 1, 4, 4))[0].sum()
    with pytest.raises(ValueError, match="torch.no_grad"):
        draw_graph(loss)
    with pytest.raises(TypeError):
        draw_graph(1.0)


def test_missing_distutils_without_setuptools_gives_a_hint(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "torchviz":
            raise ModuleNotFoundError("No module named 'distutils'", name="distutils")
        if name == "setuptools":
            raise ImportError("No module named 'setuptools'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install setuptools"):
        graphs._import_make_dot()


def test_missing_distutils_with_setuptools_retries(monkeypatch):
    real_import = builtins.__import__
    calls = {"torchviz": 0, "setuptools": 0}

    def fake_import(name, *args, **kwargs):
        if name in calls:
            calls[name] += 1
        if name == "torchviz" and calls["setuptools"] == 0:
            raise ModuleNotFoundError("No module named 'distutils'", name="distutils")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    make_dot = graphs._import_make_dot()
    assert make_dot.__name__ == "make_dot" and calls == {"torchviz": 2, "setuptools": 1}


def test_importing_the_package_does_not_import_torchviz():
    code = ("import sys, mcd_helpers; assert 'torchviz' not in sys.modules; f = mcd_helpers.draw_graph; "
            "assert 'torchviz' not in sys.modules; print(f.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(graphs.__file__).rsplit("/mcd_helpers/", 1)[0])
    assert out.stdout.strip() == "mcd_helpers.teaching.graphs"
