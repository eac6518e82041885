"""environment.yml (conda route) and pyproject.toml (pip route) name the same packages."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}  # conda-forge names that differ from PyPI's
CONDA_ONLY = {"python", "pip"}  # the interpreter and installer, not project dependencies


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _env_packages():
    conda, pip = set(), set()
    in_deps = in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        text = line.split("#", 1)[0].rstrip()
        if not text.strip():
            continue
        if not text.startswith((" ", "-")):  # a top-level key: name, channels, dependencies
            in_deps, in_pip = text.startswith("dependencies:"), False
            continue
        if not in_deps:
            continue
        if text.strip() == "- pip:":
            in_pip = True
            continue
        m = re.match(r"^(\s*)- (.+)$", text)
        if not m:
            in_pip = False if not text.startswith(" ") else in_pip
            continue
        indent, spec = len(m.group(1)), m.group(2)
        if in_pip and indent > 2:
            if not spec.startswith("-e"):
                pip.add(_name(spec))
        else:
            in_pip = False
            conda.add(_name(spec))
    return conda, pip


def _pyproject_packages():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = list(meta["dependencies"]) + [d for extra in meta["optional-dependencies"].values() for d in extra]
    return {_name(d) for d in deps}


def test_environment_and_pyproject_name_the_same_packages():
    conda, pip = _env_packages()
    env = {CONDA_TO_PIP.get(n, n) for n in conda - CONDA_ONLY} | pip
    # Graphviz appears twice in environment.yml: the `dot` program (conda) and the Python binding (pip).
    assert env == _pyproject_packages()


def test_torch_pins():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.14.1" in meta["dependencies"] and "torchvision==0.29.1" in meta["dependencies"]
    assert "python=3.11" in (ROOT / "environment.yml").read_text()


def test_parser_sees_both_sections():
    conda, pip = _env_packages()
    assert {"pytorch", "graphviz", "python"} <= conda and {"jupyterlab", "pytest"} <= pip
