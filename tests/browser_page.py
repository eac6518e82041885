"""One notebook opened in JupyterLab in headless Chromium: run all, read what rendered, screenshot.

``NotebookPage`` opens a notebook served by ``browser_lab.LabServer``, runs all cells from the
Run menu, waits for the kernel, reads each cell from JupyterLab's model (what the kernel sent)
and from the DOM (what was rendered: tracebacks, ipywidgets, SVG graphs, images), changes widget
controls, and stitches a screenshot of the whole notebook panel with Pillow.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

from browser_lab import LabServer

_OVERLAP = 16  # px that stitched screenshot tiles overlap
NOTEBOOK = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook tab on show


# One JS function reading the notebook at `path` from JupyterLab's model (what the kernel sent)
# and from the DOM (what was rendered), cell by cell. Needs --LabApp.expose_app_in_browser.
_SNAPSHOT_JS = r"""
(path) => {
  if (!window.jupyterapp) return null;
  const panel = [...window.jupyterapp.shell.widgets('main')]
    .find(w => w.context && w.context.path === path);
  if (!panel || !panel.content.widgets) return null;
  const svgNodes = (src) => {
    const body = src.slice(src.indexOf(',') + 1);
    const text = src.includes(';base64,') ? atob(body) : decodeURIComponent(body);
    return (text.match(/class="node"/g) || []).length;
  };
  const cells = panel.content.widgets.map((w, i) => {
    const m = w.model, node = w.node, q = (s) => [...node.querySelectorAll(s)];
    const outputs = [], errors = [];
    if (m.type === 'code') for (let j = 0; j < m.outputs.length; j++) {
      const o = m.outputs.get(j), json = o.toJSON();
      outputs.push({type: o.type, mimes: Object.keys(o.data)});
      const trace = (json.traceback || []).join('\n').replace(/\x1b\[[0-9;]*m/g, '');
      if (o.type === 'error') errors.push(`${json.ename}: ${json.evalue}\n` + trace);
    }
    // JupyterLab renders a traceback as stderr text: find those too (also inside Output widgets).
    q('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"], ' +
      '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]').map(e => e.innerText)
      .filter(t => /Traceback \(most recent call last\)|^\w+(Error|Exception): /m.test(t))
      .forEach(t => {
        if (!errors.some(x => x.includes(t.trim().split('\n').pop()))) errors.push(t);
      });
    return {
      index: i, type: m.type, empty: m.sharedModel.getSource().trim() === '',
      head: m.sharedModel.getSource().trim().split('\n')[0].slice(0, 100),
      count: m.type === 'code' ? m.executionCount : null,
      seconds: (() => { const t = m.getMetadata && m.getMetadata('execution');  // recordTiming
        return t && t['shell.execute_reply'] && t['iopub.execute_input'] ?
          (Date.parse(t['shell.execute_reply']) - Date.parse(t['iopub.execute_input'])) / 1000
          : null; })(),
      prompt: (node.querySelector('.jp-InputArea-prompt') || {innerText: ''}).innerText.trim(),
      outputs,
      errors,
      widgets: q('.jp-OutputArea-output .jupyter-widgets').length,
      widgetProblems: q('.jp-OutputArea-output').map(e => e.innerText)
        .filter(t => /Error displaying widget|Error rendering widget|Loading widget\.\.\./.test(t)),
      svgs: q('.jp-RenderedSVG img')
        .map(e => ({w: e.naturalWidth, h: e.naturalHeight, nodes: svgNodes(e.src)})),
      images: q('.jp-RenderedImage img').map(e => ({w: e.naturalWidth, h: e.naturalHeight})),
    };
  });
  return {kernel: panel.sessionContext.kernelDisplayStatus, cells};
}
"""
# What the reader sees of the outputs (text, tables, images), excluding the controls themselves
# (a slider's readout changes when it moves); a change of this string is an updated output.
_FINGERPRINT_JS = r"""
(path) => {
  const panel = [...window.jupyterapp.shell.widgets('main')]
    .find(w => w.context && w.context.path === path);
  const sel = '.jp-RenderedText, .jp-RenderedHTMLCommon, .jp-RenderedLatex, ' +
              '.widget-html-content, .widget-htmlmath-content, .jp-RenderedImage img, ' +
              '.jp-RenderedSVG img';
  return [...panel.content.node.querySelectorAll(sel)]
    .map(e => e.src || e.innerText).join('\u0000');
}
"""
# Controls a reader changes, in the order tried: (CSS selector, kind).
CONTROLS = [
    (".widget-dropdown select, .widget-select select", "select"),
    (".widget-radio-box input[type=radio]:not(:checked)", "click"),
    (".widget-toggle-buttons button:not(.mod-active)", "click"),
    (".widget-checkbox input[type=checkbox]", "click"),
    (".widget-slider .noUi-handle", "arrow"),
]


class NotebookPage:
    """One notebook opened in JupyterLab in its own browser context; ``close()`` shuts its kernel
    down."""

    def __init__(self, lab: LabServer, browser, name: str, viewport=(1400, 1000)):
        self.lab, self.name, self.path = lab, name, f"notebooks/{name}"
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.console_errors.append(m.text))
        self.dialogs: list[str] = []

    def open(self, timeout_s: float = 120):
        """Open the notebook, accept the kernel choice (default Python 3), wait for an idle
        kernel."""
        page = self.page
        page.goto(self.lab.lab_url(self.name), timeout=timeout_s * 1000)
        page.wait_for_selector(f"{NOTEBOOK} .jp-Notebook", timeout=timeout_s * 1000)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._accept_dialogs()
            snap = self.snapshot()
            if snap and snap["kernel"] == "idle":
                break
            page.wait_for_timeout(500)
        else:
            raise AssertionError(
                f"{self.name}: kernel not idle {timeout_s:.0f} s after opening "
                f"(status {snap and snap['kernel']}); dialogs: {self.dialogs}"
            )
        page.evaluate(
            "() => { const s = window.jupyterapp.shell; s.collapseLeft(); s.collapseRight(); }"
        )

    def _accept_dialogs(self):
        """Answer dialogs, noting their text: 'Select Kernel' (a notebook without kernelspec
        metadata) gets the preferred kernel; any other (e.g. 'Build Recommended') is dismissed."""
        for dialog in self.page.locator(".jp-Dialog").all():
            try:
                text = dialog.inner_text(timeout=2000)
                if text.replace("\n", " | ") not in self.dialogs:
                    self.dialogs.append(text.replace("\n", " | "))
                button = ".jp-mod-accept" if text.startswith("Select Kernel") else ".jp-mod-reject"
                dialog.locator(button).first.click(timeout=5000)
            except Exception:  # noqa: BLE001  (the dialog closed itself meanwhile)
                pass

    def snapshot(self) -> dict | None:
        return self.page.evaluate(_SNAPSHOT_JS, self.path)

    def fingerprint(self) -> str:
        return self.page.evaluate(_FINGERPRINT_JS, self.path)

    def run_all(self, timeout_s: float = 480, poll_s: float = 1.0) -> dict:
        """Run > Run All Cells; wait until the kernel is idle and every non-empty code cell has an
        execution count (or an error stopped the run). Returns the final snapshot."""
        page = self.page
        page.locator("#jp-MainMenu .lm-MenuBar-item", has_text="Run").first.click()
        page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
        deadline, done_polls = time.monotonic() + timeout_s, 0
        while True:
            page.wait_for_timeout(poll_s * 1000)
            self._accept_dialogs()
            snap = self.snapshot()
            code = [c for c in snap["cells"] if c["type"] == "code" and not c["empty"]]
            running = [c["index"] for c in code if c["prompt"] == "[*]:"]
            counted = all(c["count"] is not None for c in code)
            errored = any(c["errors"] for c in code)
            if snap["kernel"] in ("dead", "unknown", "autorestarting", "restarting"):
                raise AssertionError(
                    f"{self.name}: kernel {snap['kernel']} during Run All; dialogs: {self.dialogs}"
                )
            done = snap["kernel"] == "idle" and not running and (counted or errored)
            done_polls = done_polls + 1 if done else 0
            if done_polls >= 2:  # idle twice in a row: not a pause between two cells
                return snap
            if time.monotonic() > deadline:
                todo = [c for c in code if c["count"] is None] or [{"index": None, "head": ""}]
                done = sorted((c for c in code if c["seconds"]), key=lambda c: -c["seconds"])[:3]
                raise AssertionError(
                    f"{self.name}: Run All not finished after {timeout_s:.0f} s (kernel "
                    f"{snap['kernel']}; first cell not done: {todo[0]['index']}, "
                    f"{todo[0]['head']!r}; slowest done: "
                    + ", ".join(f"cell {c['index']} {c['seconds']:.0f} s" for c in done)
                    + ")"
                )

    def save(self) -> Path:
        """File > Save (JupyterLab's ``docmanager:save`` command, awaited); returns the saved
        notebook in the server's temporary workspace."""
        self.page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        return self.lab.notebooks_dir / self.name

    def wait_idle(self, timeout_s: float = 120):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.page.wait_for_timeout(1000)
            if self.snapshot()["kernel"] == "idle" and self.lab.kernel_states() in ([], ["idle"]):
                return
        raise AssertionError(f"{self.name}: kernel still busy after {timeout_s:.0f} s")

    def change_controls(self, max_tries: int = 4, timeout_s: float = 480) -> list[dict]:
        """Change widget controls as a reader would until an output updates; a record per try.

        Controls are tried one at a time in ``CONTROLS`` order (another option of a dropdown, an
        unchecked radio button or toggle, the checkbox, the slider one step right). A control
        counts as having updated an output when, once the kernel is idle again, the outputs
        differ from before (``_FINGERPRINT_JS``); it is given up after 5 s of idle kernel. When
        a change updates nothing and the page has a button (``interact_manual``, "run again"),
        the button is pressed too, as a reader would, and that ends the tries.
        """
        tried = []
        buttons = self.page.locator(f"{NOTEBOOK} .jupyter-widgets button.widget-button")
        for selector, kind in CONTROLS:
            for control in self.page.locator(f"{NOTEBOOK} {selector}").all():
                if len(tried) >= max_tries:
                    return tried
                before = self.fingerprint()
                record = {"kind": kind, "label": self._label(control)}
                control.scroll_into_view_if_needed()
                if kind == "select":
                    current = control.input_value()
                    others = [
                        v
                        for v in control.locator("option").evaluate_all(
                            "os => os.map(o => o.value)"
                        )
                        if v != current
                    ]
                    if not others:
                        continue
                    control.select_option(others[0])
                    record["change"] = f"{current!r} -> {others[0]!r}"
                elif kind == "click":
                    control.click()
                else:
                    control.focus()
                    control.press("ArrowRight")
                record["updated"] = self._updated(before, timeout_s)
                tried.append(record)
                if record["updated"]:
                    return tried
                if buttons.count():
                    button = buttons.first
                    record = {"kind": "button", "label": self._label(button)}
                    button.scroll_into_view_if_needed()
                    button.click()
                    record["updated"] = self._updated(before, timeout_s)
                    return tried + [record]
        return tried

    @staticmethod
    def _label(control) -> str:
        return control.evaluate(
            "e => (e.closest('.jupyter-widgets').querySelector('.widget-label') || {}).innerText"
            " || e.innerText || e.value || ''"
        ).strip()[:60]

    def _updated(self, before: str, timeout_s: float) -> bool:
        """Wait for the outputs to change, then for the kernel to finish; True if they ended up
        different."""
        deadline, idle_since = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            self.page.wait_for_timeout(500)
            if self.fingerprint() != before:
                self.wait_idle(max(10.0, deadline - time.monotonic()))
                self.page.wait_for_timeout(1000)  # the last display messages
                return self.fingerprint() != before
            idle = self.snapshot()["kernel"] == "idle"
            idle_since = (idle_since or time.monotonic()) if idle else None
            # a control that computes keeps the kernel busy: 5 s idle without a change is none
            if idle_since and time.monotonic() - idle_since > 5:
                return False
        return False

    def screenshot(self, out: Path, max_height: int = 40000) -> tuple[int, int]:
        """Screenshot the whole notebook: the top bars once, then the notebook panel scrolled a
        screen at a time and stitched with Pillow into one tall PNG. Returns its (width, height)."""
        from PIL import Image

        page = self.page
        scroller = page.evaluate_handle(
            "(path) => { const p = [...window.jupyterapp.shell.widgets('main')].find(w => "
            "w.context && w.context.path === path); const n = p.content.node; return [n, "
            "...n.querySelectorAll('*')]"
            ".find(e => ['auto', 'scroll'].includes(getComputedStyle(e).overflowY) && "
            "e.clientHeight > 50) || n; }",
            self.path,
        ).as_element()
        box = scroller.bounding_box()
        # up to the last cell's bottom edge: JupyterLab pads the end so the last cell can scroll up
        total = min(
            max_height,
            scroller.evaluate(
                "e => { const cells = e.querySelectorAll('.jp-Cell'), last = "
                "cells[cells.length - 1]; if (!last) return e.scrollHeight; return "
                "Math.ceil(Math.min(e.scrollHeight, e.scrollTop + 24 +"
                " last.getBoundingClientRect().bottom - e.getBoundingClientRect().top)); }"
            ),
        )
        view = scroller.evaluate("e => e.clientHeight")
        width = page.viewport_size["width"]
        top = Image.open(
            io.BytesIO(page.screenshot(clip={"x": 0, "y": 0, "width": width, "height": box["y"]}))
        )
        sheet = Image.new("RGB", (width, int(box["y"]) + total), "white")
        sheet.paste(top, (0, 0))
        y, prev = 0, None
        while True:
            actual = scroller.evaluate("(e, y) => { e.scrollTop = y; return e.scrollTop; }", y)
            if prev is not None and actual <= prev:
                break
            page.wait_for_timeout(200)
            tile = Image.open(
                io.BytesIO(
                    page.screenshot(
                        clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": view}
                    )
                )
            )
            # below the first tile, drop the top rows: the toolbar's shadow falls on them
            skip = 0 if prev is None else _OVERLAP
            sheet.paste(
                tile.crop((0, skip, tile.width, tile.height)),
                (int(box["x"]), int(box["y"]) + actual + skip),
            )
            if actual + view >= total:
                break
            prev, y = actual, actual + view - _OVERLAP
        out.parent.mkdir(parents=True, exist_ok=True)
        sheet.save(out, optimize=True)
        scroller.evaluate("e => { e.scrollTop = 0; }")
        return sheet.size

    def close(self):
        try:
            self.context.close()
        finally:
            self.lab.shutdown_kernels()
