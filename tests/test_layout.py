"""The package's layout: no import cycle (imports inside functions counted too), a lazy face whose core
modules load nothing else, and the import paths that code outside the repository calls."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = {p.stem: p for p in (ROOT / "mcd_helpers").glob("*.py")}


def imports_of(path: Path) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its text (``from . import x`` counts ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mcd_helpers."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mcd_helpers.")}
    return found & set(MODULES)


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules that import each other round, or None (depth-first search)."""
    def visit(m, path):
        for t in sorted(graph[m]):
            if t in path:
                return path[path.index(t):] + [t]
            found = visit(t, path + [t])
            if found:
                return found
        return None
    return next((c for m in sorted(graph) if (c := visit(m, [m]))), None)


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    graph = {m: imports_of(p) - {m} for m, p in MODULES.items()}
    assert graph["train"] >= {"ddp", "forwards"}  # the reader sees what it should (a smoke check of the parser)
    assert cycle(graph) is None, cycle(graph)


@pytest.mark.parametrize("module", ["metrics", "models", "losses"])
def test_a_core_module_loads_nothing_else_of_the_package(module):
    # Run in a fresh interpreter: the test process has imported everything already.
    code = (f"import sys, mcd_helpers.{module}; "
            "print(sorted(m for m in sys.modules if m.startswith('mcd_helpers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    loaded = set(eval(out))
    assert loaded <= {"mcd_helpers", "mcd_helpers.metrics", "mcd_helpers.models", "mcd_helpers.losses"}, loaded
    assert f"mcd_helpers.{module}" in loaded


def test_the_face_loads_a_module_on_first_touch_only():
    code = ("import sys, mcd_helpers; before = 'mcd_helpers.compare' in sys.modules; f = mcd_helpers.compare_forwards; "
            "print(before, 'mcd_helpers.compare' in sys.modules, f.__module__, 'mcd_helpers.train' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
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
        assert callable(getattr(mcd_helpers.losses, name)) and getattr(mcd_helpers, name) is getattr(mcd_helpers.losses, name)
    assert mcd_helpers.ood_metrics is mcd_helpers.metrics.ood_metrics
    assert callable(mcd_helpers.data.infinite_loader)
    assert {"compare_strategies", "compare_forwards", "draw_graph"} <= set(dir(mcd_helpers))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        mcd_helpers.nothing_here
