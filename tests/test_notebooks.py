"""Every notebook in notebooks/ runs top to bottom headless in quick mode (MCD_QUICK=1).

Each notebook's asserts are its claims; a failing assert fails this test. Wall times are written
to build/notebook_times.json (a record, not a timed test), executed copies to build/executed/.
A notebook that tests/test_browser.py ran in JupyterLab earlier in the session is not run again.
"""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from browser_lab import EXECUTED_IN_BROWSER
from build_site import EXECUTED, execute

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def readme_table() -> str:  # the README's section listing the notebooks
    return (ROOT / "README.md").read_text().split("## The notebooks", 1)[1].split("\n## ", 1)[0]


def test_readme_lists_exactly_the_notebooks():
    # The README's table of notebooks is how a reader finds them: no notebook missing, none
    # invented.
    table = readme_table()
    listed = set(re.findall(r"^\| \[`(\d\d_\w+)`\]\(notebooks/\1\.ipynb\) \|", table, flags=re.M))
    assert listed == {p.stem for p in NOTEBOOKS} and len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_first_cell_says_what_it_needs_builds_and_takes_as_the_readme_does(path):
    first = nbformat.read(path, as_version=4).cells[0].source
    said = re.search(
        r"\*\*Before you start\.\*\* Needs: .+?\. Builds: .+?\. Time on 2 CPU cores: "
        r"(.+?) in quick mode \(.+?\), (.+?) in full mode",
        first,
        flags=re.S,
    )
    assert said, (
        f"{path.name}: the first cell has no 'Before you start' paragraph (needs, builds, times)"
    )
    row = re.search(
        rf"^\| \[`{path.stem}`\]\([^)]*\) \| ([^|]+?) \| ([^|]+?) \|", readme_table(), flags=re.M
    )
    assert row and said.groups() == row.groups(), (said.groups(), row and row.groups())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs_and_with_a_python_kernelspec(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", path.name
    raw = json.loads(path.read_text())["cells"]  # as committed (nbformat.read would add ids)
    assert all("id" in c for c in raw), f"{path.name}: a cell without an id"
    with_out = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count)
    ]
    assert not with_out, (
        f"{path.name}: cells {with_out} carry outputs; clear them before committing"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_notebook_has_two_exercises_whose_answers_are_executed(path):
    # "Predict before you run": the answer hidden in <details>, and the next code cell asserts it
    # (every exercise, not only two of them)
    cells = nbformat.read(path, as_version=4).cells
    exercises = [
        i
        for i, c in enumerate(cells)
        if c.cell_type == "markdown" and c.source.startswith("**Predict before you run.**")
    ]
    unanswered = [
        i
        for i in exercises
        if "<details>" not in cells[i].source
        or "<summary>Answer" not in cells[i].source
        or i + 1 == len(cells)
        or cells[i + 1].cell_type != "code"
        or "assert" not in cells[i + 1].source
    ]
    assert len(exercises) >= 2 and not unanswered, (
        f"{path.name}: {len(exercises)} exercises, cells {unanswered} unanswered"
    )


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_headless(path):
    # execute() raises CellExecutionError (cell and traceback) on the first failing cell; the
    # executed copy goes to build/executed/, where the site (tests/test_site.py) is built from.
    # MCD_FULL=1 (make test-full): full mode instead, copies in build/executed-full/.
    full = os.environ.get("MCD_FULL") == "1"
    if path.name in EXECUTED_IN_BROWSER and not full:
        pytest.skip("run in JupyterLab by tests/test_browser.py in this session (copy saved)")
    out = EXECUTED.with_name("executed-full") if full else EXECUTED
    seconds = execute(path, out, timeout=7200 if full else 900, quick=not full)
    nb = nbformat.read(out / path.name, as_version=4)
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors[0]
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code" and c.source.strip())
    times_file = ROOT / "build" / ("notebook_times_full.json" if full else "notebook_times.json")
    times_file.parent.mkdir(exist_ok=True)
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    times[path.name] = round(seconds, 1)
    times_file.write_text(json.dumps(times, indent=2))
    print(f"{path.name}: {seconds:.0f} s")
