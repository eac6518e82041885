import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The suite never reads or writes the user's cache (~/.cache/mcd_helpers): data, networks and
# results of every test, notebook and browser run go to a folder of its own inside the checkout
# (kept between runs of `make test`, removed by `make clean`). Set here, before any test imports
# mcd_helpers, so subprocesses, notebook kernels and the JupyterLab server inherit it.
TEST_CACHE = ROOT / "build" / "test-cache"
os.environ["MCD_DATA_DIR"] = str(TEST_CACHE)
os.environ["XDG_CACHE_HOME"] = str(TEST_CACHE / "xdg")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    if "mcd_helpers.pipeline" in sys.modules:  # each test scores its baselines itself (evaluate's memo)
        sys.modules["mcd_helpers.pipeline"]._MEMO.clear()
    yield


@pytest.fixture
def tmp_data_dir(tmp_path, monkeypatch):
    """An empty $MCD_DATA_DIR for tests that must not see the suite's shared cache."""
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"
