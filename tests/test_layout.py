"""The package's layout: no import cycle, a core that does not load the training loop, every error
class in errors.py, and the import paths that code outside the repository calls."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mcd_helpers"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Package modules that ``path`` imports anywhere (module level or inside a function)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mcd_helpers")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("mcd_helpers"):
                continue
            for a in node.names:  # `from . import x` may name a submodule
                sub = f"{target}.{a.name}"
                found.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (PKG.parent / sub.replace(".", "/")).is_dir() else target)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in modules} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t] if t in stack else [m, t]
            if t not in state:
                found = visit(t, stack + [t])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_counting_imports_inside_functions_too():
    graph = import_graph()
    assert len(graph) > 25 and "mcd_helpers.experiments.pipeline" in graph
    assert "mcd_helpers.training.loop" in graph["mcd_helpers.experiments.pipeline"]  # the walk sees imports
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_core_modules_do_not_load_training_checkpointing_or_ddp():
    code = ("import sys, mcd_helpers.models, mcd_helpers.losses, mcd_helpers.metrics, mcd_helpers.errors\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('mcd_helpers.'))\n"
            "bad = [m for m in loaded if m.split('.')[1] in ('training', 'experiments')]\n"
            "assert not bad, bad\n"
            "print(' '.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "mcd_helpers.metrics" in out.stdout.split()


def test_every_error_class_lives_in_errors_py():
    defined = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if any(b.endswith(("Error", "Exception", "Interrupted")) for b in bases):
                    defined[node.name] = path.relative_to(ROOT).as_posix()
    assert defined and set(defined.values()) == {"mcd_helpers/errors.py"}, defined


@pytest.mark.parametrize("module, names", [
    ("mcd_helpers.models", ["TwoHeadNet", "small_cnn", "densenet_bc_100", "wrn_28_10"]),
    ("mcd_helpers.losses", ["entropy", "supervised_loss", "discrepancy_loss", "discrepancy_score"]),
    ("mcd_helpers.metrics", ["ood_metrics"]),
    ("mcd_helpers.data", ["infinite_loader"]),
    ("mcd_helpers", ["compare_strategies", "draw_graph"]),
])
def test_the_import_paths_outside_code_calls(module, names):
    import importlib

    mod = importlib.import_module(module)
    for name in names:
        assert callable(getattr(mod, name)), f"{module}.{name}"
