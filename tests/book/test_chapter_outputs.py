"""What every chapter printed in the site build equals its stored outputs.

`make book` executes every chapter once, from a fresh kernel, and myst-nb keeps each
executed notebook, as the kernel printed it, in the execution cache `_build/.jupyter_cache`
(jupyter-cache); the pages show those outputs. This test compares them, cell by cell, with
the stored notebook
`tests/notebooks/X.ipynb` (written by `make baseline`), with nbval's rules: a cell's
streams are merged (carriage returns resolved), every output key but images and metadata
is compared, and volatile text (timings, addresses, temporary paths) is masked by the same
sanitiser file, `tests/notebooks/sanitize.cfg`. So `make test` executes each chapter once,
not once for the site and again for the comparison; `make nbval` still re-executes the
stored notebooks under nbval itself.

A build older than a chapter or than any file of the package would compare stale
outputs: the test refuses it and asks for `make book`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import ROOT, load_baseline_tool
from nbval.plugin import coalesce_streams, get_sanitize_patterns

baseline = load_baseline_tool()
CHAPTERS = baseline.notebook_chapters()
CACHE = baseline.BUILD_CACHE
SANITIZE = get_sanitize_patterns((ROOT / "tests/notebooks/sanitize.cfg").read_text())
SKIPPED_KEYS = {"metadata", "traceback", "prompt_number", "output_type", "name",
                "execution_count", "transient"}

pytestmark = pytest.mark.book


def _sanitize(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for pattern, replacement in SANITIZE:
        value = re.sub(pattern, replacement, value)
    return value


def comparable(outputs: list[Any]) -> dict[str, list[Any]]:
    """nbval's view of a cell's outputs: key (stream name or MIME type) -> sanitised values,
    in order; images are not compared."""
    view: dict[str, list[Any]] = defaultdict(list)
    for out in coalesce_streams([nbformat.from_dict(o) for o in outputs]):
        if out.output_type == "stream":
            view[out.name].append(_sanitize(out.text))
            continue
        for key, value in out.items():
            if key == "data":
                for mime, data in value.items():
                    if not mime.startswith("image/"):
                        view[mime].append(_sanitize(data))
            elif key not in SKIPPED_KEYS:
                view[key].append(_sanitize(value))
    return dict(view)


def _newest_input(chapter: Path) -> tuple[float, Path]:
    inputs = [chapter, *sorted((ROOT / "src" / "minigpt").rglob("*.py"))]
    return max((p.stat().st_mtime, p) for p in inputs)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_built_outputs_equal_the_stored_ones(chapter: Path) -> None:
    stored_path = baseline.stored_path(chapter)
    notebook, executed = baseline.built_notebook(chapter)
    newest, what = _newest_input(chapter)
    assert executed >= newest, (
        f"{chapter.relative_to(ROOT)} was executed before {what.relative_to(ROOT)} changed: "
        "the build's outputs may not be those of the current code; build again (make book)")
    built = [c for c in notebook.cells if c.cell_type == "code"]
    stored = [c for c in nbformat.read(stored_path, as_version=4).cells
              if c.cell_type == "code"]
    assert [c.source for c in built] == [c.source for c in stored], (
        f"the build ran other code for {chapter.relative_to(ROOT)} than "
        f"{stored_path.relative_to(ROOT)} holds; re-baseline (make baseline) and build again")
    for index, (new, old) in enumerate(zip(built, stored, strict=True)):
        tags = old.metadata.get("tags", [])
        if old.execution_count is None or "nbval-ignore-output" in tags:
            continue  # as nbval: unrun reference cells and ignored outputs are not compared
        got, want = comparable(new.outputs), comparable(old.outputs)
        assert got == want, (
            f"{chapter.relative_to(ROOT)}, code cell {index}: the built output differs from "
            f"the stored one\n--- stored ---\n{_show(want)}\n--- built ---\n{_show(got)}\n"
            "If the change is intended: make baseline CHAPTERS=" + chapter.stem)


def test_the_build_executed_each_chapter_once() -> None:
    """`make book` executes the chapters two at a time (tools/execute_chapters.py) before
    Sphinx reads them; Sphinx must then find each one in the cache. A second execution
    means the two read a chapter into different notebooks, and every build pays twice."""
    from jupyter_cache import get_cache

    assert (CACHE / "global.db").is_file(), f"{CACHE} is missing: build the book (make book)"
    runs: dict[Path, int] = defaultdict(int)
    for record in get_cache(CACHE).list_cache_records():
        runs[Path(record.uri)] += 1
    twice = {c.relative_to(ROOT).as_posix(): runs[c] for c in CHAPTERS if runs[c] > 1}
    assert not twice, (
        f"executed more than once in the build (times): {twice}. If the book was built by "
        "hand (jupyter-book build) after an edit, run make book; otherwise "
        "tools/execute_chapters.py reads these chapters differently from myst-nb")


def _show(view: dict[str, list[Any]]) -> str:
    return "\n".join(f"[{key}]\n" + "\n".join(map(str, values)) for key, values in view.items())


def test_comparable_follows_nbval() -> None:
    """The rules themselves: merged streams, masked timings, images ignored."""
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "step 1 took 3.2 s\n"},
        {"output_type": "stream", "name": "stdout", "text": "50%\rdone\n"},
        {"output_type": "display_data", "metadata": {},
         "data": {"text/plain": "<Figure size 640x480 with 1 Axes>", "image/png": "iVBO..."}},
    ]
    assert comparable(outputs) == {"stdout": ["step 1 took TIME \ndone\n"],
                                   "text/plain": ["<Figure size 640x480 with 1 Axes>"]}
    changed = [dict(outputs[0], text="step 2 took 3.2 s\n"), *outputs[1:]]
    assert comparable(changed) != comparable(outputs)
    # A masked number takes the padding of its column along: a slower machine's wider
    # timing reads the same, the numbers beside it are still compared.
    table = [{"output_type": "stream", "name": "stdout", "text": t} for t in
             ("BPE  200   12.7 ms    2.57 s   4.348\n", "BPE  200   55.9 ms   11.47 s   4.348\n",
              "BPE  200   55.9 ms   11.47 s   4.349\n")]
    views = [comparable([t]) for t in table]
    assert views[0] == views[1] == {"stdout": ["BPE  200 TIME  TIME 4.348\n"]}
    assert views[2] != views[0]
