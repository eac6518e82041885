"""The package's layout: the library at the top never imports the experiments subpackage, no import
cycle (imports inside functions counted too), a lazy face whose core modules load nothing else, the
import paths that code outside the repository calls, and the formatter's limits (no line over 100
characters, no function over 60 lines)."""

import ast
import graphlib
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mcd_helpers"
MODULES = {
    str(p.relative_to(PACKAGE).with_suffix("")).replace("/", "."): p for p in PACKAGE.rglob("*.py")
}


def imports_of(name: str) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its text, as dotted names
    relative to the package (``experiments.loop``); a package's ``__init__`` counts as the
    package."""
    here = name.split(".")[:-1]  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            parts = base + (node.module.split(".") if node.module else [])
            names = [".".join(parts + [a.name]) for a in node.names] + [".".join(parts)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mcd_helpers"):
            parts = node.module.split(".")[1:]
            names = [".".join(parts + [a.name]) for a in node.names] + [".".join(parts)]
        elif isinstance(node, ast.Import):
            names = [
                a.name.split(".", 1)[1] for a in node.names if a.name.startswith("mcd_helpers.")
            ]
        else:
            continue
        found |= {n for n in names if n in MODULES or f"{n}.__init__" in MODULES}
    return found - {name}


def test_no_module_at_the_top_imports_the_experiments_subpackage():
    # __main__ is the command line's door: it hands over to experiments.cli, and nothing imports it
    top = [m for m in MODULES if "." not in m and m != "__main__"]
    reaching = {
        m: sorted(i for i in imports_of(m) if i.split(".")[0] == "experiments") for m in top
    }
    assert {m: found for m, found in reaching.items() if found} == {}


def test_no_import_cycle():
    graph = {m: imports_of(m) for m in MODULES}
    # the reader sees the imports: of a sibling, of a parent's module, and inside a function
    assert {"experiments.ddp", "strategies", "losses"} <= graph["experiments.loop"]
    assert "experiments.benchmark" in graph["experiments.cli"]
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


@pytest.mark.parametrize("module", ["metrics", "models", "losses"])
def test_a_core_module_loads_nothing_else_of_the_package(module):
    # Run in a fresh interpreter: the test process has imported everything already.
    code = (
        f"import sys, mcd_helpers.{module}; "
        "print(sorted(m for m in sys.modules if m.startswith('mcd_helpers')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    loaded = set(eval(out))
    assert loaded <= {
        "mcd_helpers",
        "mcd_helpers.metrics",
        "mcd_helpers.models",
        "mcd_helpers.losses",
    }
    assert f"mcd_helpers.{module}" in loaded


def test_the_face_loads_a_module_on_first_touch_only():
    code = (
        "import sys, mcd_helpers; before = 'mcd_helpers.compare' in sys.modules; "
        "f = mcd_helpers.compare_forwards; print(before, 'mcd_helpers.compare' in sys.modules, "
        "f.__module__, any(m.startswith('mcd_helpers.experiments') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert out.split() == ["False", "True", "mcd_helpers.compare", "False"]


def test_the_import_paths_outside_code_calls():
    import mcd_helpers
    import mcd_helpers.data
    import mcd_helpers.losses
    import mcd_helpers.metrics
    import mcd_helpers.models

    for name in ("TwoHeadNet", "small_cnn", "densenet_bc_100", "wrn_28_10"):
        assert getattr(mcd_helpers.models, name) is getattr(mcd_helpers, name)
    for name in ("entropy", "supervised_loss", "discrepancy_loss", "discrepancy_score"):
        assert getattr(mcd_helpers, name) is getattr(mcd_helpers.losses, name)
    assert mcd_helpers.ood_metrics is mcd_helpers.metrics.ood_metrics
    assert callable(mcd_helpers.data.infinite_loader)
    assert {"compare_strategies", "compare_forwards", "draw_graph", "mcd_step"} <= set(
        dir(mcd_helpers)
    )
    with pytest.raises(AttributeError, match="'nothing_here'"):
        mcd_helpers.nothing_here


def test_no_function_runs_over_60_lines():
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_every_benchmark_script_imports_the_package_where_it_now_lives(script, monkeypatch, capsys):
    # in this process (a subprocess per script spent its 7 s importing torch): the script's
    # imports run, then argparse prints the usage and exits 0
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the repository first
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(script), run_name="__main__")
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
