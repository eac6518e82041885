"""The static site (``make site``, docs/build_site.py) built and read in headless Chromium.

Built from the notebooks tests/test_notebooks.py executed (build/executed/; a missing one is
executed first), served on 127.0.0.1 from build/site/ and opened page by page, as a reader
without an install would: every page answers 200 and raises no script error, and no request for
one of the site's own files fails or answers 400 or more (outside scripts, e.g. MathJax's CDN, are
not this test's to reach offline); every image on it decodes; every link into the site reaches a
built file, and a ``#fragment`` an element on that page; each notebook page shows as many pictures
as its executed notebook has PNG/SVG outputs (figures, torchviz graphs) among its cell outputs, and
its "Predict before you run" exercises as ``<details>`` whose summary starts "Answer". Needs what
tests/test_browser.py needs (Chromium, Playwright) plus Sphinx and myst-nb (the ``dev`` extra);
skipped, saying why, without the browser.
"""

from __future__ import annotations

import functools
import http.server
import threading
from urllib.parse import unquote, urldefrag, urlparse

import build_site
import nbformat
import pytest
from browser_lab import CHROMIUM, CHROMIUM_ARGS, ROOT, browser_skip_reason, expectations

pytestmark = pytest.mark.browser
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = sorted((ROOT / "docs").glob("*.md"))
PICTURES = {"image/png", "image/svg+xml", "image/jpeg"}

# What one page shows: status, script errors, images (decoded width), links, ids, exercises.
_READ_JS = r"""() => ({
  images: [...document.querySelectorAll('.cell_output img')]
    .map(i => ({src: i.src, w: i.naturalWidth})),
  allImages: [...document.images].map(i => ({src: i.src, w: i.naturalWidth})),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  details: [...document.querySelectorAll('details')].filter(d => {
    const s = d.querySelector('summary');
    return s && s.innerText.trim().startsWith('Answer');
  }).length,
  text: (document.querySelector('article, .bd-article') || document.body).innerText,
})"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log in the test output
        pass


@pytest.fixture(scope="module")
def site():
    reason = browser_skip_reason()
    if reason:
        pytest.skip(reason)
    out = build_site.build()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(out))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield out, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def pages(site):
    """Every built HTML page, opened once: {relative path: what it shows}."""
    from playwright.sync_api import sync_playwright

    out, base = site
    shown = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        errors: list[str] = []  # script errors, and requests for the site's own files that fail

        # the browser's own guess
        def own(url):
            return url.startswith(base) and not url.endswith("/favicon.ico")

        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on(
            "console",
            lambda m: (
                errors.append(f"console: {m.text}")
                if m.type == "error" and own(m.location.get("url", ""))
                else None
            ),
        )
        page.on(
            "requestfailed", lambda r: errors.append(f"failed: {r.url}") if own(r.url) else None
        )
        page.on(
            "response",
            lambda r: (
                errors.append(f"{r.status}: {r.url}") if own(r.url) and r.status >= 400 else None
            ),
        )
        for html in sorted(out.rglob("*.html")):
            rel = html.relative_to(out).as_posix()
            if rel.startswith(("_static/", "_sources/")):
                continue  # the theme's templates and the page sources, not pages of the site
            errors.clear()
            response = page.goto(base + rel, wait_until="load")
            # requests and errors after "load" count for this page
            page.wait_for_load_state("networkidle")
            shown[rel] = {
                "status": response.status,
                "errors": list(errors),
                **page.evaluate(_READ_JS),
            }
        browser.close()
    return shown


def test_a_page_for_the_landing_page_each_notebook_and_each_doc(site, pages):
    out, _ = site
    expected = (
        {"index.html"}
        | {f"notebooks/{p.stem}.html" for p in NOTEBOOKS}
        | {f"docs/{p.stem}.html" for p in DOCS}
    )
    assert expected <= set(pages), f"missing pages: {sorted(expected - set(pages))}"
    # the landing page is the README: its title and its short answer are on it
    readme = (ROOT / "README.md").read_text()
    title = readme.splitlines()[0].lstrip("# ").strip()
    assert title in pages["index.html"]["text"]
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"site: {len(pages)} pages, {size / 1e6:.1f} MB")


def test_every_page_loads_without_script_errors_and_its_images_decode(pages):
    bad = {rel: s["status"] for rel, s in pages.items() if s["status"] != 200}
    assert not bad, bad
    errors = {rel: s["errors"] for rel, s in pages.items() if s["errors"]}
    assert not errors, errors
    broken = [(rel, i["src"]) for rel, s in pages.items() for i in s["allImages"] if i["w"] == 0]
    assert not broken, f"images that do not decode: {broken[:5]}"


def test_every_link_into_the_site_reaches_a_page_and_its_anchor(site, pages):
    out, base = site
    broken = []
    for rel, s in pages.items():
        for href in s["links"]:
            if not href.startswith(base):
                continue  # outside links (GitHub, papers) are not this site's to check offline
            url, fragment = urldefrag(href)
            target = urlparse(url).path.lstrip("/") or "index.html"
            if target.endswith("/"):
                target += "index.html"
            if not (out / target).is_file():
                broken.append(f"{rel}: {href} (no file {target})")
            elif fragment and target in pages and unquote(fragment) not in pages[target]["ids"]:
                broken.append(f"{rel}: {href} (no element #{fragment} on {target})")
    assert not broken, "\n".join(broken[:20])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_each_notebook_page_shows_its_figures_graphs_and_exercises(path, pages):
    executed = nbformat.read(build_site.EXECUTED / path.name, as_version=4)
    pictures = sum(
        bool(PICTURES & set(o.get("data", {})))
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
    )
    exercises = sum(
        c.cell_type == "markdown" and c.source.startswith("**Predict before you run.**")
        for c in executed.cells
    )
    shown = pages[f"notebooks/{path.stem}.html"]
    decoded = [i for i in shown["images"] if i["w"] > 0]
    print(
        f"{path.stem}: {pictures} picture outputs, {len(decoded)} images shown, "
        f"{shown['details']} <details>"
    )
    assert len(decoded) >= pictures, (
        f"{len(decoded)} images on the page, {pictures} picture outputs"
    )
    # what the source draws (matplotlib, torchviz): at least one picture
    promised = expectations(path)
    assert pictures >= 1 or not (promised["figures"] or promised["graphs"])
    assert shown["details"] >= exercises >= 2
    assert "Traceback (most recent call last)" not in shown["text"]


def test_an_executed_copy_counts_only_while_its_sources_are_the_notebooks(tmp_path, monkeypatch):
    monkeypatch.setattr(build_site, "EXECUTED", tmp_path / "executed")
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("x = 1")]
    )
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    assert not build_site._executed_copy_is_current(path)  # no copy yet
    (tmp_path / "executed").mkdir()
    # executed: outputs differ, sources not
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1")]
    nbformat.write(nb, tmp_path / "executed" / "n.ipynb")
    assert build_site._executed_copy_is_current(path)
    nb.cells[1].source = "x = 2"  # the notebook changed since
    nbformat.write(nb, path)
    assert not build_site._executed_copy_is_current(path)
