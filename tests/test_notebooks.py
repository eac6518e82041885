"""Every notebook in notebooks/ runs top to bottom headless in quick mode (MCD_QUICK=1).

Each notebook's asserts are its claims; a failing assert fails this test. Wall times are written
to build/notebook_times.json (a record, not a timed test).
"""
import json
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_readme_lists_exactly_the_notebooks():
    # The README's table of notebooks is how a reader finds them: no notebook missing, none invented.
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The notebooks", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\d\d_\w+)` \|", table, flags=re.M))
    assert listed == {p.stem for p in NOTEBOOKS} and len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    with_out = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not with_out, f"{path.name}: cells {with_out} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_notebook_has_two_exercises_whose_answers_are_executed(path):
    # "Predict before you run": the answer hidden in <details>, and the next code cell asserts it
    cells = nbformat.read(path, as_version=4).cells
    answered = [i for i, c in enumerate(cells[:-1]) if c.cell_type == "markdown"
                and c.source.startswith("**Predict before you run.**") and "<details>" in c.source
                and cells[i + 1].cell_type == "code" and "assert" in cells[i + 1].source]
    assert len(answered) >= 2, f"{path.name}: {len(answered)} exercises with an executed answer"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_headless(path, monkeypatch):
    monkeypatch.setenv("MCD_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.time()
    client.execute()
    seconds = time.time() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]
    times_file = ROOT / "build" / "notebook_times.json"
    times_file.parent.mkdir(exist_ok=True)
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    times[path.name] = round(seconds, 1)
    times_file.write_text(json.dumps(times, indent=2))
    print(f"{path.name}: {seconds:.0f} s")
