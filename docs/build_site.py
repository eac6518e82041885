"""Build the static site: README as the landing page, the notebooks executed in quick mode, docs/.

    python docs/build_site.py          (what ``make site`` runs; writes build/site/index.html)

The notebooks are the copies ``make test`` executed (tests/test_notebooks.py writes them to
build/executed/); a notebook whose executed copy is missing or older (other cell sources) is
executed here first, the same way (nbclient, MCD_QUICK=1). The pages are assembled in
build/site-src/ with the repository's layout, so every relative link and image in README.md and
docs/ means on the site what it means on GitHub, and Sphinx with myst-nb renders them
(docs/conf.py), warnings as errors. Sphinx + myst-nb rather than Jupyter Book: Jupyter Book 1 is a
wrapper around exactly these two, and Jupyter Book 2 needs Node.js; this way the site is one pip
install and one conf.py.

Run on its own, a notebook executed here reads and fills your data and network cache
($MCD_DATA_DIR, else ~/.cache/mcd_helpers; docs/data.md), as ``make lab`` does; under ``make test``
it uses the test suite's own cache (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = ROOT / "build" / "executed"
SRC, OUT = ROOT / "build" / "site-src", ROOT / "build" / "site"
# What the landing page (README.md) links to besides docs/ and notebooks/, copied as they are.
COPIED = [
    *("docs", "LICENSE", "CITATION.cff", "CHANGELOG.md"),
    *("benchmarks/results/*/splits.png", "benchmarks/results/*/decomposition.png"),
]
TOCTREE = """

```{toctree}
:hidden:
:caption: Notebooks
:glob:

notebooks/*
```

```{toctree}
:hidden:
:caption: Reference
:glob:

docs/*
CHANGELOG
```
"""

NOTE = (
    "> This page is the notebook executed headless in quick mode (`MCD_QUICK=1`), as `make "
    "test` runs it, "
    "so its numbers are quick mode's. Widgets show their last state; to move them, run the "
    "notebook "
    "yourself: `make lab` opens it in JupyterLab (full mode). The page reads offline except its "
    "maths (MathJax) and widgets, whose scripts come from a CDN and need a network."
)


def execute(
    notebook: Path, out_dir: Path | None = None, timeout: int = 900, quick: bool = True
) -> float:
    """Run ``notebook`` top to bottom in quick mode (``quick=False``: full mode, what ``make lab``
    runs), write the executed copy to ``out_dir`` (None: ``EXECUTED`` as it is when the copy is
    written); ``timeout`` is seconds per cell.

    Returns the wall time in seconds. Raises ``nbclient.exceptions.CellExecutionError`` (the
    failing cell and its traceback) when a cell raises; nothing is written then.
    """
    from nbclient import NotebookClient

    env = {k: v for k, v in os.environ.items() if k != "MCD_QUICK"}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    if quick:
        env["MCD_QUICK"] = "1"
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    start = time.time()
    client.execute(env=env)  # the kernel's environment; ours stays as it is
    seconds = time.time() - start
    out_dir = EXECUTED if out_dir is None else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (notebook.name + ".part")
    nbformat.write(nb, tmp)
    tmp.replace(out_dir / notebook.name)  # never a half-written copy
    return seconds


def _executed_copy_is_current(notebook: Path) -> bool:
    """An executed copy exists and its cells' sources are the notebook's (not an older
    version's)."""
    copy = EXECUTED / notebook.name

    def sources(path):
        return [c.source for c in nbformat.read(path, as_version=4).cells]

    return copy.exists() and sources(copy) == sources(notebook)


def assemble() -> list[Path]:
    """Fill build/site-src/ (executing the notebooks without a current executed copy); return the
    notebooks."""
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for nb in notebooks:
        if not _executed_copy_is_current(nb):
            print(f"executing {nb.name} (quick mode) ...", flush=True)
            print(f"  {execute(nb):.0f} s", flush=True)
    shutil.rmtree(SRC, ignore_errors=True)
    (SRC / "notebooks").mkdir(parents=True)
    (SRC / "index.md").write_text((ROOT / "README.md").read_text() + TOCTREE)
    for src in (path for pattern in COPIED for path in ROOT.glob(pattern)):
        dst = SRC / src.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        else:
            shutil.copy2(src, dst)
    for nb in notebooks:  # below each title: what the reader is looking at
        executed = nbformat.read(EXECUTED / nb.name, as_version=4)
        title, _, rest = executed.cells[0].source.partition("\n")
        executed.cells[0].source = f"{title}\n\n{NOTE}\n{rest}"
        nbformat.write(executed, SRC / "notebooks" / nb.name)
    return notebooks


def build() -> Path:
    """Assemble and render the site; returns build/site/. Raises SystemExit on a Sphinx warning."""
    from sphinx.cmd.build import build_main

    assemble()
    shutil.rmtree(OUT, ignore_errors=True)
    rc = build_main(
        ["-q", "-W", "--keep-going", "-b", "html", "-c", str(ROOT / "docs"), str(SRC), str(OUT)]
    )
    if rc:
        raise SystemExit(
            f"sphinx-build failed (exit {rc}); the warnings above say which page and line"
        )
    return OUT


if __name__ == "__main__":
    out = build()
    pages = sorted(out.rglob("*.html"))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"site: {len(pages)} pages, {size / 1e6:.1f} MB in {out.relative_to(ROOT)}/ (open "
        f"{out.relative_to(ROOT)}/index.html)"
    )
    sys.exit(0)
