import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "docs"))  # build_site: the executed notebooks the site is built from

# The suite never reads or writes the user's cache (~/.cache/mcd_helpers): data, networks and
# results of every test, notebook and browser run go to a folder of its own inside the checkout
# (kept between runs of `make test`, removed by `make clean`). Set here, before any test imports
# mcd_helpers, so subprocesses, notebook kernels and the JupyterLab server inherit it.
TEST_CACHE = ROOT / "build" / "test-cache"
os.environ["MCD_DATA_DIR"] = str(TEST_CACHE)
os.environ["XDG_CACHE_HOME"] = str(TEST_CACHE / "xdg")

# `make test` runs the suite on 2 pytest-xdist workers (on 2 cores). Each worker, and every process
# it starts (notebook kernels, torchrun ranks, the JupyterLab server), computes on one thread: two
# processes of 2 threads each on 2 cores slow each other several-fold.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Tests that hand work on through build/ run in this order on one worker: the browser tests save
# the notebooks they ran (test_notebooks then skips them), and the site is built from both.
NOTEBOOK_FILES = ("test_browser.py", "test_notebooks.py", "test_site.py")
# The files that take longest (a minute or more on 2 cores), longest first: they start first, so
# that the two workers end together; the other files follow in their usual order.
LONGEST_FIRST = (
    *NOTEBOOK_FILES,
    "test_benchmark.py",
    "test_ddp.py",
    "test_reproduce.py",
    "test_resume.py",
    "test_results.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


@pytest.hookimpl(optionalhook=True)  # an xdist hook: ignored when xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Each test file to one worker, whole and in order (its module fixtures are computed once),
    the NOTEBOOK_FILES together, in the order of collection (LONGEST_FIRST). (xdist's
    ``--dist loadgroup`` would say this with marks, but with pytest 9.2 it no longer groups:
    xdist 3.8 renames the items in a way pytest ignores.)"""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # xdist's default puts the files with most tests first

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "notebooks" if Path(file).name in NOTEBOOK_FILES else file

    return ByFile(config, log)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tmp_data_dir(tmp_path, monkeypatch):
    """An empty $MCD_DATA_DIR for tests that must not see the suite's shared cache."""
    monkeypatch.setenv("MCD_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(scope="session")
def data():
    """The toy config's ID images (tests/pipeline_setup.py)."""
    from pipeline_setup import TINY

    from mcd_helpers.experiments.stages import load_data

    return load_data(TINY)


@pytest.fixture(scope="session")
def _pipeline_run(tmp_path_factory, data):
    """run_ood_set on the toy config (two strategies, both selections) in a cache of its own:
    (result, the strategy of each training (None: pre-training), the cache folder)."""
    from pipeline_setup import TINY

    from mcd_helpers.experiments import stages
    from mcd_helpers.experiments.pipeline import run_ood_set

    cache, calls = tmp_path_factory.mktemp("pipeline-cache"), []
    real = stages.train
    # both undone before the session goes on: later tests (the notebooks among them) use the
    # suite's shared cache and the real training
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MCD_DATA_DIR", str(cache))
        patch.setattr(stages, "train", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
        split = stages.make_split(TINY, data, "gaussian")
        how = stages.RunOptions(progress=False, log=None)
        res = run_ood_set(TINY, split, "gaussian", selections=("ood-labels", "last-epoch"), how=how)
    return res, calls, cache


@pytest.fixture
def run(_pipeline_run, monkeypatch):
    """The pipeline's toy run shared by its tests, as (result, strategy of each training); during
    the test $MCD_DATA_DIR is that run's cache, so what it trained loads from there."""
    res, calls, cache = _pipeline_run
    monkeypatch.setenv("MCD_DATA_DIR", str(cache))
    return res, calls


@pytest.fixture
def no_training(monkeypatch):
    """Any training fails the test: what is asked must come from the cache."""
    from mcd_helpers.experiments import stages

    monkeypatch.setattr(stages, "train", lambda *a, **k: pytest.fail("trained instead of loading"))
