"""Run chapters as a reader does: opened as notebooks in a real JupyterLab, top to bottom.

    .venv/bin/python tools/run_in_jupyterlab.py                 # every chapter
    .venv/bin/python tools/run_in_jupyterlab.py training sampling --timeout 600

Starts `jupyter lab` from `.venv` on a free local port, with a scratch configuration
directory in which the chapters (MyST markdown) open as notebooks through jupytext and
autosave is off (nothing is written back to `book/`). For each chapter it opens
`book/NAME.md` in headless Chromium (Debian's chromium and chromedriver, as the browser
test), runs every cell in a fresh kernel, waits for the kernel to go idle, and reports the
code cells, those left unrun and every error output. Exit status 1 if any chapter had an
error or an unrun cell. The build and nbval execute the chapters through nbclient; this is
the JupyterLab front end, its jupytext contents manager and its kernel session on top.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import baseline  # noqa: E402  (the chapter list of _toc.yml)

TOKEN = "minigpt-book-check"
_READY = """const app = window.jupyterapp; if (!app) return null;
const w = app.shell.currentWidget;
if (!(w && w.context && w.content && w.content.widgets && w.sessionContext.session
      && w.sessionContext.session.kernel)) return null;
return w.context.path;"""
_RUN_ALL = """window.__minigptDone = false;
window.jupyterapp.commands.execute('notebook:run-all-cells').then(
  () => { window.__minigptDone = true; },
  (e) => { window.__minigptError = String(e); window.__minigptDone = true; });"""
_STATE = """const w = window.jupyterapp.shell.currentWidget;
const busy = w.content.widgets.filter((c) => c.model.type === 'code' && c.promptNode
  && c.promptNode.textContent.includes('*')).length;
return [w.sessionContext.session.kernel.status, busy, window.__minigptDone];"""
_RESULT = """const w = window.jupyterapp.shell.currentWidget;
const code = w.content.widgets.filter((c) => c.model.type === 'code');
const errors = []; let unrun = 0;
code.forEach((c, i) => {
  if (c.model.executionCount === null) unrun++;
  c.model.outputs.toJSON().forEach((o) => {
    if (o.output_type === 'error') errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`); });
});
return [code.length, unrun, errors];"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_lab(config_dir: Path, port: int) -> subprocess.Popen[bytes]:
    overrides = config_dir / "labconfig" / "default_setting_overrides.json"
    overrides.parent.mkdir(parents=True)
    overrides.write_text(json.dumps({"@jupyterlab/docmanager-extension:plugin": {
        "autosave": False,
        "defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}))
    lab = Path(sys.executable).parent / "jupyter-lab"
    process = subprocess.Popen(
        [str(lab), "--no-browser", f"--port={port}", f"--IdentityProvider.token={TOKEN}",
         "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={ROOT}",
         "--allow-root"],
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}",
                                   timeout=2)
            return process
        except OSError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError("jupyter lab did not answer within 60 s")


def _wait(driver: webdriver.Chrome, script: str, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(1)
    return None


def run_chapter(driver: webdriver.Chrome, port: int, name: str, timeout: float) -> bool:
    driver.get(f"http://127.0.0.1:{port}/lab/tree/book/{name}.md?token={TOKEN}&reset")
    opened = _wait(driver, _READY, 90)
    if opened != f"book/{name}.md":
        print(f"{name}: JupyterLab did not open book/{name}.md as a notebook ({opened!r})")
        return False
    start = time.monotonic()
    driver.execute_script(_RUN_ALL)
    while time.monotonic() - start < timeout:
        status, busy, done = driver.execute_script(_STATE)
        if status == "idle" and busy == 0 and done:
            break
        time.sleep(2)
    else:
        print(f"{name}: still running after {timeout:.0f} s")
        return False
    cells, unrun, errors = driver.execute_script(_RESULT)
    print(f"{name}: {cells} code cells, {unrun} not run, {len(errors)} errors, "
          f"{time.monotonic() - start:.0f} s")
    for error in errors:
        print(f"  {error[:300]}")
    return unrun == 0 and not errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    chapters = [path.stem for path in baseline.notebook_chapters()]
    parser.add_argument("chapters", nargs="*", metavar="CHAPTER",
                        help=f"default: all of {', '.join(chapters)}")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a chapter may run (default 600)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.chapters) - set(chapters))
    if unknown:
        parser.error(f"unknown chapter(s) {', '.join(unknown)}; choose from {', '.join(chapters)}")
    port = _free_port()
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1400,1000"):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory() as config_dir:
        lab = _start_lab(Path(config_dir), port)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            results = [run_chapter(driver, port, name, args.timeout)
                       for name in args.chapters or chapters]
        finally:
            driver.quit()
            lab.terminate()
            lab.wait(timeout=30)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
