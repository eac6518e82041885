"""A throw-away JupyterLab server for tests/test_browser.py, and what each notebook promises to
show.

``LabServer`` starts ``python -m jupyterlab`` (the interpreter running the tests) on 127.0.0.1
with a free port and a random token, in a throw-away workspace: the notebooks are *copied* into
``WORKSPACE/notebooks/`` and every other top-level entry of the repository (``mcd_helpers``,
``build``, ...) is symlinked beside them, so ``../build`` and ``sys.path.insert(0, "..")`` in a
notebook mean what they mean in the repository while the committed notebooks (kept without
outputs) are never written to. Settings for the run (a temporary ``JUPYTERLAB_SETTINGS_DIR``):
windowing off, so every cell is in the DOM; cell timing recorded; autosave off; no news or update
checks. The kernels get ``MCD_QUICK=1`` and the inline matplotlib backend. The browser is Debian's
Chromium through Playwright's ``executable_path`` (no ``playwright install``); tests/browser_page.py
drives one notebook in it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("MCD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
# JupyterLab user settings for the run: plugin id -> settings (checked against the 4.x schemas).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "recordTiming": True},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # a saved copy keeps its widgets' state, as nbclient's headless copies do (the site shows it)
    "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
}
# The notebooks that tests/test_browser.py ran and saved to build/executed/ in this pytest session:
# tests/test_notebooks.py does not run them headless a second time.
EXECUTED_IN_BROWSER: set[str] = set()
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def browser_skip_reason() -> str | None:
    """Why the browser tests cannot run here, or None when Chromium and Playwright are present."""
    if not Path(CHROMIUM).exists():
        return f"Chromium not found at {CHROMIUM}: apt-get install chromium"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return (
            "Playwright for Python not installed: pip install -e '.[dev]' (no browser download "
            "needed)"
        )
    return None


def expectations(notebook: Path) -> dict[str, bool]:
    """What the notebook's code cells promise to show, read from their source.

    ``widgets``: imports ipywidgets, calls ``interact`` or the package's ``rerun_widget``;
    ``graphs``: draws an autograd graph (``draw_graph``/``make_dot``/graphviz); ``figures``: uses
    matplotlib or ``mcd_helpers.experiments.plots``.
    """
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    code = "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in cells
        if c["cell_type"] == "code"
    )
    code = re.sub(r"#.*", "", code)  # comments promise nothing
    return {
        "widgets": bool(
            re.search(r"\bipywidgets\b|\binteract(ive|_manual)?\s*\(|\brerun_widget\s*\(", code)
        ),
        "graphs": bool(re.search(r"\bdraw_graph\s*\(|\bmake_dot\s*\(|\bgraphviz\b", code)),
        "figures": bool(
            re.search(r"\bplt\.|\bmatplotlib\b|\bmcd_helpers\.plots\b|\bplot_\w+\s*\(", code)
        ),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """JupyterLab on 127.0.0.1 serving a temporary copy-and-symlink workspace; ``stop()`` always
    cleans up."""

    def __init__(self, notebooks: list[Path], startup_timeout: float = 180):
        self.tmp = Path(tempfile.mkdtemp(prefix="mcd-browser-"))
        self.workspace = self.tmp / "workspace"
        self.notebooks_dir = self.workspace / "notebooks"
        self.notebooks_dir.mkdir(parents=True)
        (ROOT / "build").mkdir(exist_ok=True)
        for entry in ROOT.iterdir():
            if entry.name not in {"notebooks", ".git", ".venv"}:
                (self.workspace / entry.name).symlink_to(entry)
        for nb in notebooks:
            shutil.copy2(nb, self.notebooks_dir / nb.name)
        self.runtime_dir = self.tmp / "runtime"
        self._write_settings()
        self.port, self.token = _free_port(), secrets.token_hex(24)
        self.log_path = self.tmp / "jupyterlab.log"
        self.proc = None
        try:
            self._start(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _write_settings(self):
        for plugin, values in LAB_SETTINGS.items():
            path = self.tmp / "settings" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def _start(self, timeout: float):
        env = dict(
            os.environ,
            MCD_QUICK="1",
            MPLBACKEND="module://matplotlib_inline.backend_inline",
            JUPYTERLAB_SETTINGS_DIR=str(self.tmp / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.tmp / "workspaces"),
            JUPYTER_RUNTIME_DIR=str(self.runtime_dir),
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.workspace}",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--ServerApp.open_browser=False",
        ]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.workspace,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lab_url(self, notebook: str) -> str:
        """URL opening ``notebooks/<notebook>`` in a fresh workspace of its own (no restored
        tabs)."""
        ws = re.sub(r"[^A-Za-z0-9_-]", "-", Path(notebook).stem)
        return f"{self.url}/lab/workspaces/{ws}/tree/notebooks/{notebook}?reset&token={self.token}"

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def kernel_states(self) -> list[str]:
        return [k["execution_state"] for k in self.api("GET", "/api/kernels")]

    def shutdown_kernels(self):
        """Shut every kernel down (sessions first, so JupyterLab does not restart them), then kill
        what the kernels left running in their process groups (e.g. a torchrun a cell launched)."""
        groups = set()
        for pid in self._kernel_pids():
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        for s in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{s['id']}", timeout=30)
        for k in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{k['id']}", timeout=30)
        for group in groups - {os.getpgid(0)}:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def _kernel_pids(self) -> list[int]:
        """Kernel processes (each in a session of its own, outside the server's process group):
        those started with a connection file in our runtime dir."""
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    if str(self.runtime_dir).encode() in (proc / "cmdline").read_bytes():
                        pids.append(int(proc.name))
                except OSError:
                    pass
        return pids

    def stop(self):
        """Stop the kernels and the server (API, then SIGTERM, then SIGKILL) and delete the
        workspace."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.shutdown_kernels()
                self.api("POST", "/api/shutdown")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                if self.proc.poll() is not None:
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(timeout=wait)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        for pid in self._kernel_pids():  # kernels the server could not stop, with their children
            try:
                group = os.getpgid(pid)
                os.killpg(group, signal.SIGKILL) if group != os.getpgid(0) else os.kill(
                    pid, signal.SIGKILL
                )
            except ProcessLookupError:
                pass
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
