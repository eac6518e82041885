"""The notebooks with widgets or autograd graphs opened in JupyterLab in headless Chromium, run from
the Run menu, and looked at (MCD_BROWSER_NOTEBOOKS=notebooks/*.ipynb: every notebook).

For each such notebook (one test each, id = the notebook's stem), in quick mode (MCD_QUICK=1):
Run > Run All Cells, wait for the kernel, then check what a reader would see:

- no cell shows an error (an ``error`` output; JupyterLab renders its traceback as stderr text,
  so a traceback printed inside an Output widget counts too);
- every output the kernel sent is rendered as such: widget views as ipywidgets (not the
  "VBox(...)" text that shows when the JupyterLab widgets extension is missing), SVG (torchviz
  graphs) as decoded images with graph nodes, PNG (matplotlib figures) as decoded images;
- what the source promises is there: a notebook that imports ipywidgets shows widgets, and (in
  every notebook that shows widgets) a change to one of its controls (a dropdown: another option;
  where controls act only through a button, the button is pressed too) changes an output; one that
  draws autograd graphs shows an SVG graph with nodes; one that uses matplotlib shows a figure.

The page is saved once Run All is checked, before a control is changed, and copied to
build/executed/ (the site's copy): tests/test_notebooks.py then does not run it headless again.
A tall screenshot of a notebook whose check failed goes to build/screenshots/NAME.png (of every
notebook when MCD_SCREENSHOT_DIR is set: stitching one takes about 10 s), the wall times to
build/browser_times.json. JupyterLab serves a temporary copy of the
notebooks (see tests/browser_lab.py), so the committed ones stay without outputs.

Needs Debian's Chromium (``apt-get install chromium``; .ci/run installs it) and Playwright for
Python (the ``dev`` extra); without them every test here is skipped, saying why.
Environment: MCD_BROWSER_NOTEBOOKS (paths or globs, ``os.pathsep``-separated) runs other
notebooks instead; MCD_SCREENSHOT_DIR (a folder) screenshots every notebook there;
MCD_BROWSER_TIMEOUT (seconds per notebook, default 480); MCD_CHROMIUM (the browser, default
/usr/bin/chromium).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from browser_lab import (
    CHROMIUM,
    CHROMIUM_ARGS,
    EXECUTED_IN_BROWSER,
    ROOT,
    WIDGET_MIME,
    LabServer,
    browser_skip_reason,
    expectations,
)
from browser_page import NotebookPage
from build_site import EXECUTED  # the executed copies the site is built from

pytestmark = pytest.mark.browser
PICTURE_MIMES = {"image/svg+xml", "image/png", "image/jpeg"}


def _notebooks() -> list[Path]:
    """The notebooks that show what only a browser can check: widgets (a control changes an
    output) or autograd graphs (SVG); every kind of output they show, figures included, is drawn
    by the same JupyterLab renderer in the others, which tests/test_notebooks.py runs headless."""
    spec = os.environ.get("MCD_BROWSER_NOTEBOOKS")
    if not spec:
        every = sorted((ROOT / "notebooks").glob("*.ipynb"))
        return [p for p in every if (e := expectations(p))["widgets"] or e["graphs"]]
    return sorted({Path(p).resolve() for part in spec.split(os.pathsep) for p in glob.glob(part)})


NOTEBOOKS = _notebooks()
TIMEOUT_S = float(os.environ.get("MCD_BROWSER_TIMEOUT", "480"))
SCREENSHOTS = Path(os.environ.get("MCD_SCREENSHOT_DIR", ROOT / "build" / "screenshots"))
EVERY_SCREENSHOT = "MCD_SCREENSHOT_DIR" in os.environ  # else only a failed notebook's


@pytest.fixture(scope="module")
def lab():
    reason = browser_skip_reason()
    if reason:
        pytest.skip(reason)
    server = LabServer(NOTEBOOKS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _rendering_problems(cells: list[dict]) -> list[str]:
    """Outputs the kernel sent (JupyterLab's model) that the page does not show as such."""
    problems = []
    for c in cells:
        mimes = [m for o in c["outputs"] for m in o["mimes"]]
        where = f"cell {c['index']} [{c['count']}]"
        if WIDGET_MIME in mimes and not c["widgets"]:
            problems.append(
                f"{where}: a widget view was sent but no ipywidgets rendered "
                "(is @jupyter-widgets/jupyterlab-manager enabled?)"
            )
        if c["widgetProblems"]:
            problems.append(f"{where}: {c['widgetProblems'][0][:300]}")
        pictures = sum(bool(PICTURE_MIMES & set(o["mimes"])) for o in c["outputs"])
        shown = sum(s["w"] > 0 for s in c["svgs"]) + sum(i["w"] > 0 for i in c["images"])
        if pictures > shown:
            problems.append(
                f"{where}: {pictures} SVG/PNG outputs were sent but {shown} rendered as images "
                f"(SVGs {c['svgs']}, images {c['images']})"
            )
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_in_jupyterlab(path, lab, browser):
    expect, committed = expectations(path), hashlib.sha256(path.read_bytes()).digest()
    start = time.monotonic()
    nb, checked = NotebookPage(lab, browser, path.name), False
    try:
        nb.open()
        snap = nb.run_all(timeout_s=TIMEOUT_S)
        run_s = time.monotonic() - start
        cells = snap["cells"]
        slow = sorted((c for c in cells if c["seconds"]), key=lambda c: -c["seconds"])[:3]
        print(
            f"{path.name}: kernel time {sum(c['seconds'] or 0 for c in cells):.0f} s; "
            "slowest cells " + ", ".join(f"[{c['count']}] {c['seconds']:.1f} s" for c in slow)
        )
        # what a reader sees, tracebacks inside Output widgets included (which a headless run
        # does not raise)
        errors = [(c["index"], c["count"], e) for c in cells for e in c["errors"]]
        assert not errors, "error output in cell {} [{}]:\n{}".format(*errors[0])
        assert not (problems := _rendering_problems(cells)), "\n".join(problems)

        svgs = [s for c in cells for s in c["svgs"]]
        images = [i for c in cells for i in c["images"]]
        if expect["graphs"]:
            assert any(s["w"] > 0 and s["nodes"] > 0 for s in svgs), (
                "the notebook draws autograd graphs, but no SVG graph with nodes is in "
                f"the page: {svgs}"
            )
        if expect["figures"]:
            assert any(i["w"] > 0 and i["h"] > 0 for i in images), (
                "the notebook uses matplotlib, but no figure image is in the page"
            )
        _keep_executed_copy(nb, path)  # before a control changes an output
        # a notebook may show widgets built in mcd_helpers without importing ipywidgets itself
        sent_widgets = any(WIDGET_MIME in o["mimes"] for c in cells for o in c["outputs"])
        if expect["widgets"] or sent_widgets:
            assert sum(c["widgets"] for c in cells), (
                "the notebook uses ipywidgets, but no widget is in the page"
            )
            tried = nb.change_controls(timeout_s=TIMEOUT_S)
            print(f"{path.name}: controls changed: {tried}")
            assert tried, "the notebook uses ipywidgets, but the page has no control to change"
            assert any(t["updated"] for t in tried), (
                f"changing a control updated no output: {tried}"
            )
            after = nb.snapshot()["cells"]
            late = [(c["index"], e) for c in after for e in c["errors"]]
            assert not late, "error output after changing a control, cell {}:\n{}".format(*late[0])
        assert hashlib.sha256(path.read_bytes()).digest() == committed, (
            f"{path} changed during the run (written back by JupyterLab, or edited meanwhile)"
        )
        print(
            f"{path.name}: open + Run All {run_s:.0f} s, {len(images)} images, {len(svgs)} SVGs, "
            f"{sum(c['widgets'] for c in cells)} widget elements; expected {expect}; "
            f"dialogs {nb.dialogs}; browser console errors: {nb.console_errors[:3]}"
        )
        checked = True
    finally:
        try:
            if EVERY_SCREENSHOT or not checked:
                size = nb.screenshot(SCREENSHOTS / f"{path.stem}.png")
                print(f"screenshot {SCREENSHOTS / (path.stem + '.png')}: {size[0]}x{size[1]} px")
        except Exception as err:  # noqa: BLE001  (a failed check already says more)
            if checked:
                raise
            print(f"no screenshot of {path.name}: {err}")
        finally:
            nb.close()
        _record_time(path.name, time.monotonic() - start)


def _keep_executed_copy(nb: NotebookPage, path: Path):
    """Save the notebook as Run All left it to build/executed/, where the site is built from, and
    spare tests/test_notebooks.py a second, headless run of it."""
    saved = nb.save()  # returns once JupyterLab has written it
    cells = json.loads(saved.read_text())["cells"]
    assert any(c.get("outputs") for c in cells), f"{path.name}: saved without outputs"
    EXECUTED.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(saved, EXECUTED / path.name)
    EXECUTED_IN_BROWSER.add(path.name)


def _record_time(name: str, seconds: float):
    times_file = ROOT / "build" / "browser_times.json"
    times_file.parent.mkdir(exist_ok=True)
    times = json.loads(times_file.read_text()) if times_file.exists() else {}
    times[name] = round(seconds, 1)
    times_file.write_text(json.dumps(times, indent=2))
