import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tmp_data_dir(tmp_path, monkeypatch):
    """An empty $MCD_DATA_DIR for tests that must not see the real cache."""
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"
