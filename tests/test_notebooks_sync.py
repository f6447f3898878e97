"""The stored notebooks that nbval runs (tests/notebooks/) match the chapters.

nbval compares every chapter's fresh outputs with the outputs stored in
`tests/notebooks/X.ipynb`. Those would be worthless if the stored notebook ran
other code than `book/X.md`: this test fails as soon as a chapter's code cells
(source and tags) differ from its stored notebook's, a chapter has no stored
notebook, or a stored notebook has no chapter. The fix is always the same:
re-baseline with `make baseline` and review the diff.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from helpers import load_baseline_tool

ROOT = Path(__file__).resolve().parents[1]
REBASELINE = (
    "re-baseline with `make baseline` (or `.venv/bin/python tools/baseline.py {name}` "
    "for this chapter only) and review the diff of tests/notebooks/"
)



baseline = load_baseline_tool()
CHAPTERS = baseline.notebook_chapters()


def test_toc_has_notebook_chapters() -> None:
    assert CHAPTERS, "_toc.yml lists no notebook chapter (MyST file with a kernelspec)"


def test_every_chapter_file_is_in_the_toc() -> None:
    """A chapter missing from _toc.yml would be neither built nor tested."""
    listed = {baseline.source_path(entry) for entry in baseline.toc_files()}
    on_disk = set(baseline.BOOK_DIR.rglob("*.md")) | set(baseline.BOOK_DIR.rglob("*.ipynb"))
    on_disk = {p for p in on_disk if ".ipynb_checkpoints" not in p.parts}
    missing = sorted(str(p.relative_to(ROOT)) for p in on_disk - listed)
    assert not missing, f"files in book/ that _toc.yml does not list: {missing}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_stored_notebook_matches_chapter(chapter: Path) -> None:
    stored = baseline.stored_path(chapter)
    hint = REBASELINE.format(name=chapter.stem)
    assert stored.exists(), f"{chapter.relative_to(ROOT)} has no stored notebook {stored}; {hint}"

    nb = nbformat.read(stored, as_version=4)
    expected = baseline.code_cells(baseline.read_chapter(chapter))
    actual = baseline.code_cells(nb)
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        assert got == want, (
            f"code cell {index} of {chapter.relative_to(ROOT)} differs from "
            f"{stored.relative_to(ROOT)}:\n--- chapter ---\n{want[0]}\n--- stored ---\n"
            f"{got[0]}\n(tags {want[1]} vs {got[1]}); {hint}"
        )
    assert len(actual) == len(expected), (
        f"{chapter.relative_to(ROOT)} has {len(expected)} code cells, "
        f"{stored.relative_to(ROOT)} has {len(actual)}; {hint}"
    )
    assert nb.metadata.get(baseline.METADATA_KEY, {}).get("chapter") == (
        chapter.relative_to(ROOT).as_posix()
    ), f"{stored.relative_to(ROOT)} was not made from {chapter.relative_to(ROOT)}; {hint}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_stored_cells_are_compared(chapter: Path) -> None:
    """nbval silently skips the comparison of a cell whose execution count is empty."""
    stored = baseline.stored_path(chapter)
    if not stored.exists():
        pytest.fail(f"{stored} is missing; {REBASELINE.format(name=chapter.stem)}")
    nb = nbformat.read(stored, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not unrun, (
        f"{stored.relative_to(ROOT)}: code cells {unrun} have no execution count, so nbval "
        f"would not compare their outputs; {REBASELINE.format(name=chapter.stem)}"
    )


def test_no_stored_notebook_without_chapter() -> None:
    stale = [str(p.relative_to(ROOT)) for p in baseline.orphans()]
    assert not stale, (
        f"stored notebooks without a chapter in _toc.yml: {stale}; delete them or run "
        "`make baseline`, which removes them"
    )


# --------------------------------------------------------------------------
# The sanitiser masks volatile text and nothing else.
# --------------------------------------------------------------------------


def _sanitize(text: str) -> str:
    """Apply tests/notebooks/sanitize.cfg the way nbval does (in order, re.sub)."""
    from nbval.plugin import get_sanitize_patterns

    config = (ROOT / "tests" / "notebooks" / "sanitize.cfg").read_text(encoding="utf-8")
    patterns = dict(get_sanitize_patterns(config))
    assert len(patterns) >= 8, "sanitize.cfg lost its patterns"
    for regex, replace in patterns.items():
        text = re.sub(regex, replace, text)
    return text


def _stderr_as_nbval_sees_it(*chunks: str) -> str:
    """Join stream chunks and resolve carriage returns as nbval does before comparing."""
    from nbval.plugin import coalesce_streams

    outputs = [nbformat.v4.new_output("stream", name="stderr", text=c) for c in chunks]
    return str(coalesce_streams(outputs)[0].text)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("training: 100%|##########| 20/20 [00:01<00:00, 13.37it/s]\n",
         "training: 100%|##########| 20/20 [00:02<00:00, 9.10it/s, loss=2.31]\n"),
        ("took 0.049 s, 43,650 tokens/s\n", "took 1.5 s, 1,234 tokens/s\n"),
        ("Wall time: 3.21 ms\n", "Wall time: 12 ms\n"),
        ("<object object at 0x7f6170b4f2a0>\n", "<object object at 0x7f0012345678>\n"),
        ("cached in /tmp/tmpab12cd/model.pt\n", "cached in /tmp/tmpzz99xx/model.pt\n"),
        ("/work/main/src/minigpt/nn.py:12: UserWarning\n",
         "/ci/clone/src/minigpt/nn.py:12: UserWarning\n"),
        ("at 2026-11-22 06:09:14.123\n", "at 2026-12-01 23:59:59.999\n"),
    ],
)
def test_sanitiser_masks_volatile_text(first: str, second: str) -> None:
    assert _sanitize(first) == _sanitize(second)


def test_sanitiser_masks_progress_bars_as_nbval_joins_them() -> None:
    fast = _stderr_as_nbval_sees_it(
        "\reval:   0%|          | 0/50 [00:00<?, ?it/s]",
        "\reval:  78%|#######8  | 39/50 [00:00<00:00, 379.60it/s]",
        "\r" + " " * 54 + "\r",
    )
    slow = _stderr_as_nbval_sees_it(
        "\reval:  40%|####      | 20/50 [00:01<00:01, 9.60it/s]",
        "\r" + " " * 52 + "\r",
    )
    assert _sanitize(fast) == _sanitize(slow)


@pytest.mark.parametrize(
    "text",
    [
        "eval loss 1.2345\n",
        "tensor([[0.1000, 0.2000],\n        [0.3000, 0.4000]])\n",
        "logits shape: torch.Size([2, 8, 65]), 4 heads, 128 dims\n",
        "ids[0:10] = [18, 47, 56, 57, 58, 1, 15, 47, 58, 47]\n",
        "parameters: 0.80M (803,904)\n",
        "vocabulary: 65 characters, 1,115,394 in the corpus\n",
    ],
)
def test_sanitiser_leaves_results_alone(text: str) -> None:
    assert _sanitize(text) == text


def test_stored_streams_are_merged_in_order() -> None:
    """A re-baseline's diff shows changed outputs, not how the kernel split a cell's printing."""
    out = nbformat.v4.new_output
    pieces = [out("stream", name="stdout", text="a\n"), out("stream", name="stdout", text="b\n"),
              out("stream", name="stderr", text="w\n"), out("stream", name="stdout", text="c\n"),
              out("execute_result", data={"text/plain": "1"}, execution_count=1)]
    merged = baseline._merge_streams(pieces)
    assert [(o.output_type, o.get("name"), o.get("text")) for o in merged] == [
        ("stream", "stdout", "a\nb\n"), ("stream", "stderr", "w\n"), ("stream", "stdout", "c\n"),
        ("execute_result", None, None)]
