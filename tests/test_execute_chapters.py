"""tools/execute_chapters.py: it executes what the build would execute, keyed as the build
looks it up, longest chapters first; a failing chapter is reported, not cached."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, load_baseline_tool, load_tool

tool = load_tool("execute_chapters")
kept = load_tool("kept")
baseline = load_baseline_tool()
CHAPTERS = baseline.notebook_chapters()
SETTINGS = tool.book_settings()

HEADER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---
"""


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_is_read_into_the_code_jupyter_reads(chapter: Path) -> None:
    ours = [c.source for c in tool.read_chapter(chapter, SETTINGS["extensions"]).cells
            if c.cell_type == "code"]
    jupyter = [c.source for c in baseline.read_chapter(chapter).cells
               if c.cell_type == "code"]
    assert ours == jupyter


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_gets_the_cache_key_myst_nb_looks_up(chapter: Path, tmp_path: Path) -> None:
    from jupyter_cache import get_cache
    from myst_nb.core.read import myst_nb_reader_plugin

    cache = get_cache(tmp_path)
    ours = cache.create_hashed_notebook(tool.read_chapter(chapter, SETTINGS["extensions"]))
    mystnb = cache.create_hashed_notebook(myst_nb_reader_plugin(str(chapter)))
    assert ours[1] == mystnb[1]


def test_the_longest_chapters_start_first() -> None:
    order = [c.stem for c in tool.longest_first(CHAPTERS)]
    measured = [stem for stem in order if stem in tool.MEASURED_SECONDS]
    assert measured == sorted(measured, key=lambda s: -tool.MEASURED_SECONDS[s])
    assert order[:len(measured)] == measured  # the unmeasured ones come after
    assert set(tool.MEASURED_SECONDS) <= {c.stem for c in CHAPTERS}, "a stale name"


def test_two_chapters_that_use_both_cores_never_run_together() -> None:
    by_stem = {c.stem: c for c in CHAPTERS}
    assert tool.TWO_CORES <= set(by_stem)
    heavy = [by_stem[s] for s in sorted(tool.TWO_CORES)]
    light = [c for c in tool.longest_first(CHAPTERS) if c.stem not in tool.TWO_CORES]
    waiting = tool.longest_first(CHAPTERS)
    assert tool.next_chapter(waiting, []) == waiting[0]
    # Beside a two-core chapter the next one to start is the longest light one...
    assert tool.next_chapter(waiting, heavy[:1]) == light[0]
    # ...and with only two-core chapters waiting, none starts until it ends.
    assert tool.next_chapter(heavy[1:], heavy[:1]) is None
    assert tool.next_chapter(heavy[1:], light[:1]) == heavy[1]


def test_execution_returns_outputs_or_the_error(tmp_path: Path) -> None:
    good = tmp_path / "good.md"
    good.write_text(HEADER + "```{code-cell} ipython3\nimport os\n"
                    "print(6 * 7, os.environ['PYTHONHASHSEED'])\n```\n", "utf-8")
    before = dict(os.environ)
    nb, seconds, error = tool.execute(good, SETTINGS, census=tmp_path / "census")
    # The kernel ran with the hash seed and the census; this process keeps its environment
    # (a variable left behind would reach every key it takes later: the steering ones).
    assert dict(os.environ) == before
    assert error is None and seconds > 0
    assert nb.cells[0].outputs[0]["text"] == f"42 {baseline.HASH_SEED}\n"
    bad = tmp_path / "bad.md"
    bad.write_text(HEADER + "```{code-cell} ipython3\n1 / 0\n```\n", "utf-8")
    _, _, error = tool.execute(bad, SETTINGS)
    assert error is not None and "ZeroDivisionError" in error


def test_the_kernels_environment_is_put_back_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIGPT_SET_BEFORE", "before")
    monkeypatch.delenv("MINIGPT_UNSET_BEFORE", raising=False)
    with baseline.kernel_environment(MINIGPT_SET_BEFORE="inside", MINIGPT_UNSET_BEFORE="x"):
        assert os.environ["MINIGPT_SET_BEFORE"] == "inside"
        assert os.environ["MINIGPT_UNSET_BEFORE"] == "x"
    assert os.environ["MINIGPT_SET_BEFORE"] == "before"
    assert "MINIGPT_UNSET_BEFORE" not in os.environ
    with pytest.raises(RuntimeError), baseline.kernel_environment(MINIGPT_SET_BEFORE="x"):
        raise RuntimeError("a cell failed")
    assert os.environ["MINIGPT_SET_BEFORE"] == "before"


@pytest.mark.parametrize(("argv", "message"), [
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["no_such_chapter"], "no chapter named no_such_chapter; the chapters are "),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tool.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_book_that_does_not_cache_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "_config.yml"
    config.write_text("execute:\n  execute_notebooks: force\n", "utf-8")
    with pytest.raises(SystemExit, match="execute_notebooks must be 'cache'"):
        tool.book_settings(config)


def test_the_book_is_built_with_it() -> None:
    makefile = (ROOT / "Makefile").read_text("utf-8")
    book = makefile[makefile.index("\nbook:"):makefile.index("\n\n", makefile.index("\nbook:"))]
    assert "$(PY) tools/execute_chapters.py" in book.split("jupyter-book build")[0]


# A chapter whose output differs at each execution (a fresh random number), which computes
# one matrix product for the census and lists a kept run as `minigpt.recipes.runs` does.
DRAW = ("```{code-cell} ipython3\nimport os, pathlib, random, torch, minigpt\n"
        "torch.ones(5, 20) @ torch.ones(20, 13)\nprint(random.random())\n"
        "if 'MINIGPT_CENSUS' in os.environ:\n"
        "    pathlib.Path(os.environ['MINIGPT_CENSUS'], 'runs.txt').write_text('a run\\n')\n"
        "```\n")


def _drawn(chapter: Path) -> str:
    record = json.loads(kept.record_path("chapters", chapter.stem).read_text("utf-8"))
    (cell,) = [c for c in record["record"]["notebook"]["cells"] if c["cell_type"] == "code"]
    return str(cell["outputs"][0]["text"])


def test_a_chapter_is_executed_again_only_when_its_code_or_inputs_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MINIGPT_CENSUS", str(tmp_path / "census"))
    # The worker process finds `execute` by its module's name, as when the tool is run.
    monkeypatch.setitem(sys.modules, "execute_chapters", tool)
    root = tmp_path / "root"
    (root / "book").mkdir(parents=True)
    chapter = root / "book" / "draw.md"
    chapter.write_text(HEADER + "# Draws\n\n" + DRAW, "utf-8")
    settings = {**SETTINGS, "cache": tmp_path / "jupyter_cache"}

    def run(**kwargs: Any) -> str:
        assert tool.run([chapter], settings, jobs=1, census=tmp_path / "census", root=root,
                        **kwargs) == 0
        return _drawn(chapter)

    first = run()
    journalled = tool.journal(tmp_path / "census" / "draw")
    assert len(journalled) == 1 and json.loads(journalled[0])[0] == "mm"
    assert tool.runs_used(tmp_path / "census" / "draw") == ["a run"]
    assert "executed in" in capsys.readouterr().out
    assert run() == first  # kept: an execution would have drawn another number
    assert "kept from an execution with the same inputs" in capsys.readouterr().out
    assert tool.journal(tmp_path / "census" / "draw") == journalled  # its census written back
    assert tool.runs_used(tmp_path / "census" / "draw") == ["a run"]  # and its kept runs
    from jupyter_cache import get_cache
    (record,) = get_cache(settings["cache"]).list_cache_records()
    assert Path(record.uri) == chapter  # where the build looks it up
    chapter.write_text(HEADER + "# Draws, retitled\n\nProse only.\n\n" + DRAW, "utf-8")
    assert run() == first  # prose is not an input
    (root / "book" / "data").mkdir()
    (root / "book" / "data" / "table.json").write_text("[]", "utf-8")
    second = run()
    assert second != first  # a data file is
    assert run(fresh=True) != second
    chapter.write_text(HEADER + DRAW.replace("print(", "print('drawn', "), "utf-8")
    assert run().startswith("drawn")  # and so is code


def test_the_key_reads_the_code_cells_the_settings_and_whether_a_census_is_kept(
        tmp_path: Path) -> None:
    chapter = tmp_path / "c.md"
    chapter.write_text(HEADER + "Prose.\n\n" + DRAW, "utf-8")
    nb = tool.read_chapter(chapter, SETTINGS["extensions"])
    environ = {"HOME": "/root", "MINIGPT_CENSUS": "/a"}
    key = tool.memo_key(nb, SETTINGS, "files", environ)
    chapter.write_text(HEADER + "Other prose.\n\n" + DRAW, "utf-8")
    assert tool.memo_key(tool.read_chapter(chapter, SETTINGS["extensions"]), SETTINGS,
                         "files", environ) == key
    chapter.write_text(HEADER + DRAW + DRAW, "utf-8")
    assert tool.memo_key(tool.read_chapter(chapter, SETTINGS["extensions"]), SETTINGS,
                         "files", environ) != key
    assert tool.memo_key(nb, SETTINGS, "other files", environ) != key
    assert tool.memo_key(nb, {**SETTINGS, "timeout": 1}, "files", environ) != key
    assert tool.memo_key(nb, SETTINGS, "files", {**environ, "MINIGPT_CENSUS": "/b"}) == key
    assert tool.memo_key(nb, SETTINGS, "files", {"HOME": "/root"}) != key  # no census kept
