"""environment.yml (conda route) and pyproject.toml (pip route) install the same packages, pinned
alike."""

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PIP = {"pytorch": "torch"}  # conda-forge names that differ from PyPI's
# the interpreter, the installer, Graphviz's `dot` program
CONDA_ONLY = {"python", "pip", "graphviz"}


def _split(spec: str) -> tuple[str, str]:
    """``"torch==2.14.1  # why"`` -> ``("torch", "==2.14.1")``; names normalised as pip does."""
    spec = spec.split("#", 1)[0].strip()
    name = re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]
    return name.lower().replace("_", "-"), spec[len(name) :].strip()


def env_packages(text: str) -> tuple[dict, dict]:
    """The conda and the pip requirements of an environment.yml text, as
    ``{name: version spec}``."""
    conda, pip = {}, {}
    section = None
    for line in text.splitlines():
        body = line.split("#", 1)[0].rstrip()
        if not body.strip():
            continue
        if not body.startswith((" ", "-")):  # a top-level key: name, channels, dependencies
            section = "conda" if body.startswith("dependencies:") else None
            continue
        m = re.match(r"^(\s*)- (.+)$", body)
        if section is None or not m:
            continue
        indent, item = len(m.group(1)), m.group(2).strip()
        if item == "pip:":
            section = "pip"
            continue
        if section == "pip" and indent <= 2:
            section = "conda"
        if item.startswith("-e"):
            continue
        name, pin = _split(
            item.replace("=", "==", 1) if section == "conda" and "==" not in item else item
        )
        (pip if section == "pip" else conda)[CONDA_TO_PIP.get(name, name)] = pin
    return conda, pip


def pyproject_packages() -> dict:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = list(meta["dependencies"]) + [
        d for extra in meta["optional-dependencies"].values() for d in extra
    ]
    return dict(_split(d) for d in deps)


def test_parser_on_a_known_file():
    text = (
        "name: x\nchannels:\n  - conda-forge\ndependencies:\n  - python=3.11  # the interpreter\n"
        "  - graphviz\n  - pip:\n      - torch==2.14.1  # pinned\n      - scikit_learn\n   "
        "   - -e .\n  - nodejs\n"
    )
    conda, pip = env_packages(text)
    assert conda == {"python": "==3.11", "graphviz": "", "nodejs": ""}
    assert pip == {"torch": "==2.14.1", "scikit-learn": ""}


def test_environment_and_pyproject_install_the_same_pins():
    conda, pip = env_packages((ROOT / "environment.yml").read_text())
    assert set(conda) - CONDA_ONLY == set(), (
        f"conda packages with no pip counterpart: {set(conda) - CONDA_ONLY}"
    )
    # graphviz is both the `dot` program (conda) and the Python binding (pip).
    assert pip == pyproject_packages()
    assert conda["python"] == "==3.11"


def test_installed_torch_is_the_pinned_one():
    # The pins are what this environment runs: a venv built from other versions fails here.
    pins = pyproject_packages()
    for name in ("torch", "torchvision"):
        assert pins[name].startswith("=="), f"{name} must be pinned exactly, found {pins[name]!r}"
        assert version(name).split("+")[0] == pins[name][2:], (name, version(name), pins[name])
