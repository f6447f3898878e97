"""A chapter opened as a notebook where `minigpt` is not installed can still run.

Every chapter starts with the same cell (hidden on the site): where the package is
missing, it installs it from the repository checkout that holds the chapter (a clone
on Binder, or one without `make setup`) and fetches the corpus; where the package is
installed it does nothing. Binder's image is built by `postBuild`, which installs the
package the same way and makes JupyterLab open MyST chapters as notebooks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import load_baseline_tool

ROOT = Path(__file__).resolve().parents[1]
baseline = load_baseline_tool()
CHAPTERS = baseline.notebook_chapters()


def _first_cells() -> dict[str, tuple[str, list[str]]]:
    return {ch.stem: baseline.code_cells(baseline.read_chapter(ch))[0] for ch in CHAPTERS}


def test_every_chapter_starts_with_the_same_hidden_launch_cell() -> None:
    first = _first_cells()
    sources = {source for source, _ in first.values()}
    assert len(sources) == 1, (
        "the chapters' first code cells differ; each chapter starts with the same "
        f"launch cell: {sorted(name for name, (s, _) in first.items())}")
    source = sources.pop()
    assert 'find_spec("minigpt") is None' in source
    for name, (_, tags) in first.items():
        assert "remove-cell" in tags, f"{name}: the launch cell is not hidden on the site"


def test_launch_cell_without_the_package_or_a_checkout_says_what_to_do(tmp_path: Path) -> None:
    """`-S` hides site-packages, so `minigpt` is not importable; the folder is outside any
    checkout, so there is nothing to install from: a clear error, and pip never runs."""
    source = next(iter(_first_cells().values()))[0]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", source], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "minigpt is not installed" in done.stderr
    assert "not inside the book's repository" in done.stderr
    assert "make setup" in done.stderr


def test_launch_cell_does_nothing_where_the_package_is_installed(tmp_path: Path) -> None:
    source = next(iter(_first_cells().values()))[0]
    done = subprocess.run([sys.executable, "-c", source], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_binder_postbuild_installs_the_package_and_opens_chapters_as_notebooks(
        tmp_path: Path) -> None:
    script = ROOT / "postBuild"
    assert os.access(script, os.X_OK), "repo2docker runs postBuild only if it is executable"
    lines = [ln for ln in script.read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "set -euo pipefail"
    assert "python -m pip install --quiet --no-deps -e ." in lines
    assert "python -m minigpt assets" in lines
    viewer = [ln for ln in lines if ln.startswith("jupytext-config ")]
    assert len(viewer) == 1
    # Run that line as Binder would, with a scratch home, and read what JupyterLab will.
    env = {**os.environ, "HOME": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(viewer[0].split(), env=env, check=True, capture_output=True, timeout=60)
    written = list(tmp_path.rglob("*.json"))
    assert len(written) == 1, written
    viewers = json.loads(written[0].read_text())[
        "@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers == {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}
