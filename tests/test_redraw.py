"""tools/redraw.py: a chapter runs to its end past a failing cell, and the report names the line
that failed and every number the prose quotes that a cell printed differently."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from helpers import load_tool

tool = load_tool("redraw")

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


def _chapter(path: Path, *cells: str) -> Path:
    path.write_text(HEADER + "\n".join(cells), encoding="utf-8")
    return path


def _code(source: str) -> str:
    return f"```{{code-cell}} ipython3\n{source}\n```\n"


def _nb(*printed: str) -> nbformat.NotebookNode:
    """A notebook of code cells, each of which printed one of ``printed``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("", outputs=[nbformat.v4.new_output(
        "stream", name="stdout", text=text)]) for text in printed]
    return nb


def test_a_chapter_runs_to_its_end_past_a_failing_assert_which_the_report_names(
        tmp_path: Path) -> None:
    chapter = _chapter(tmp_path / "claims.md",
                       _code("loss = [0.5, 0.4, 0.45]\nprint(loss)"),
                       _code("x = 1\nassert all(a > b for a, b in zip(loss, loss[1:])), "
                             "'falls at every step'\nprint('never')"),
                       _code("print('the end')"))
    settings = tool.execute_chapters.book_settings() | {"allow_errors": True}
    nb, _, _ = tool.execute_chapters.execute(chapter, settings)
    (failure,) = tool.failures(nb)
    assert failure.cell == 1
    assert failure.line == ("assert all(a > b for a, b in zip(loss, loss[1:])), "
                            "'falls at every step'")
    assert failure.message == "AssertionError: falls at every step"
    assert tool.output_text(tool.code_cells(nb)[2]) == "the end\n"  # ran on to the end


def test_a_quoted_number_moves_only_if_its_cell_prints_it_differently_at_its_place() -> None:
    quoted = [("0.844", "spread from 0.844", 3), ("0.950", "to 0.950", 3),
              ("1.5", "ratio 1.5", 3), ("12345.6", "tokens 12,345.6", 3),
              ("0.25", "a number no cell printed", 3)]  # prose after the three cells
    stored = tool.code_cells(_nb("seeds 0.844 0.950\n", "ratio 1.5 then 1.5\n",
                                 "tokens 12,345.6\n"))
    redrawn = tool.code_cells(_nb("seeds 0.739 0.950\n", "ratio 1.4 then 1.5\n",
                                  "tokens 12345.6\n"))
    printed, moved = tool.compare(quoted, stored, redrawn)
    assert printed == 4  # 0.25 is printed by no cell: not compared
    # 0.844 moved; 0.950 held; 1.5 held at one of its two places; 12,345.6 is 12345.6
    # (the prose's numbers come canonical from prose_numbers)
    assert [(m.number, m.redrawn, m.cell) for m in moved] == [("0.844", "0.739", 0)]


def test_a_quoted_number_is_compared_where_its_paragraph_quotes_it_from() -> None:
    # 0.50 printed by cells 0 and 2; the draw moves it in cell 2 only
    stored = tool.code_cells(_nb("loss 0.50\n", "other 1.00\n", "seed loss 0.50\n"))
    redrawn = tool.code_cells(_nb("loss 0.50\n", "other 1.00\n", "seed loss 0.61\n"))
    after_cell_2 = [("0.50", "the seed's loss, 0.50", 3)]
    after_cell_0 = [("0.50", "the loss, 0.50", 1)]
    before_any = [("0.50", "a loss of 0.50, below", 0)]
    assert [(m.redrawn, m.cell) for m in tool.compare(after_cell_2, stored, redrawn)[1]] \
        == [("0.61", 2)]
    assert tool.compare(after_cell_0, stored, redrawn) == (1, [])
    assert tool.compare(before_any, stored, redrawn) == (1, [])  # the first cell after it
    assert tool.nearest([0, 2, 5], 4) == 2 and tool.nearest([5, 7], 4) == 5
    # quoted with 0.90, which cell 0 alone printed: the table row of cell 0 is the quote
    stored = tool.code_cells(_nb("a 0.90 b 0.50\n", "c 0.50\n"))
    redrawn = tool.code_cells(_nb("a 0.91 b 0.50\n", "c 0.52\n"))
    row = [("0.90", "0.90 and 0.50", 2), ("0.50", "0.90 and 0.50", 2)]
    assert [(m.number, m.cell) for m in tool.compare(row, stored, redrawn)[1]] == [("0.90", 0)]


def test_a_cell_that_printed_less_under_the_draw_moves_its_numbers_to_nothing() -> None:
    printed, moved = tool.compare([("2.50", "x", 1)], tool.code_cells(_nb("a 1.00 b 2.50\n")),
                                  tool.code_cells(_nb("a 1.00\n")))
    assert printed == 1 and [(m.number, m.redrawn) for m in moved] == [("2.50", None)]


def test_the_prose_numbers_are_the_decimals_of_its_text_not_of_its_code(
        tmp_path: Path) -> None:
    chapter = _chapter(tmp_path / "prose.md", "The loss falls from 4.17 to 1.88 in 2000 steps, "
                       "−0.11 of it late.\n", _code("print(3.14)"))
    assert [(n, at) for n, _, at in tool.prose_numbers(chapter)] == [
        ("4.17", 0), ("1.88", 0), ("-0.11", 0)]


def test_a_draw_replaces_its_own_section_of_the_report_and_keeps_the_others(
        tmp_path: Path) -> None:
    report = tmp_path / "redraw.md"
    tool.write_report("native", "<!-- draw: native -->\nfirst\n<!-- end of draw: native -->\n",
                      report)
    tool.write_report("seed", "<!-- draw: seed -->\nseed\n<!-- end of draw: seed -->\n", report)
    tool.write_report("native", "<!-- draw: native -->\nagain\n<!-- end of draw: native -->\n",
                      report)
    text = report.read_text(encoding="utf-8")
    assert text.startswith(tool.HEADER)
    assert "again" in text and "first" not in text and "seed\n" in text
    assert text.index("draw: seed") < text.index("draw: native")  # the order of DRAWS


@pytest.mark.parametrize(("argv", "message"), [
    (["seed", "--shift", "0"], "--shift must be from 1 to 4294967295, got 0"),
    (["seed", "native", "--cache", "x"], "--cache names one draw's cache"),
    (["native", "--jobs", "0"], "--jobs must be at least 1, got 0"),
    (["retrain"], "the retrain draw is a re-read's working list, not a redraw: give it a "
                  "--report of its own (not docs/redraw.md)"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tool.main(argv)
    assert message in capsys.readouterr().err


def _git(root: Path, *args: str) -> str:
    import subprocess
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_only_what_a_kept_chapter_does_not_run_may_change_after_it_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _git(tmp_path, "init", "-q")
    for name, text in (("book/a.md", "a"), ("book/b.md", "b"), ("src/m.py", "x = 1"),
                       ("tests/notebooks/a.ipynb", "{}"), ("docs/redraw.md", ""),
                       ("README.md", "")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    # the report is written by a draw while another draw runs: the commit stays clean
    (tmp_path / "docs/redraw.md").write_text("changed", encoding="utf-8")
    assert tool.head() == sha and tool.commit() == sha[:12]
    # the chapter run again, its stored notebook, the report and the README: nothing a kept
    # chapter runs
    for name in ("book/a.md", "tests/notebooks/a.ipynb", "docs/redraw.md", "README.md"):
        (tmp_path / name).write_text("changed", encoding="utf-8")
    assert tool.changed_since(sha, ["book/a.md"]) == []
    # another chapter, or the package: the kept chapters' runs no longer describe this commit
    assert tool.changed_since(sha, ["book/b.md"]) == ["book/a.md"]
    (tmp_path / "src/m.py").write_text("x = 2", encoding="utf-8")
    assert tool.changed_since(sha, ["book/a.md"]) == ["src/m.py"]
    assert tool.head() == "" and tool.commit().endswith("(with uncommitted changes)")


def test_only_is_refused_without_an_earlier_run_or_with_another_shift(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tool, "WORK", tmp_path)
    with pytest.raises(SystemExit):
        tool.main(["seed", "--only", "intro"])
    assert "draw 'seed' has no earlier run" in capsys.readouterr().err
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / tool.RUNS).write_text(
        '{"chapters": {}, "shift": 1, "setup_seconds": 60}', encoding="utf-8")
    with pytest.raises(SystemExit):
        tool.main(["seed", "--shift", "7", "--only", "intro"])
    assert "ran with --shift 1, not 7" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["seed", "--only", "no_such_chapter"])
    assert "no such chapter(s) ['no_such_chapter']" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the other chapters never ran in that draw
        tool.main(["seed", "--only", "intro"])
    assert "was not run at a commit in the last 'seed' draw" in capsys.readouterr().err


def test_the_report_says_which_chapters_ran_again_and_at_which_commit() -> None:
    reports = [tool.ChapterReport(name, 3, 60.0) for name in ("a", "b", "c")]
    text = tool.section("native", 1, reports, 600.0, "2026-11-29 12:00 UTC", "bbb",
                        {"a": "aaa", "b": "bbb", "c": "aaa"},
                        dates={"aaa": "2026-11-29 10:00 UTC"})
    assert text.count("The book of commit bbb: each chapter ran at a commit where") == 1
    assert "Most ran at aaa (2026-11-29 10:00 UTC); run again at bbb (2026-11-29 12:00 UTC): b." \
        in text
    alone = tool.section("native", 1, reports, 600.0, "2026-11-29 10:00 UTC", "aaa")
    assert "Commit aaa, 2026-11-29 10:00 UTC. Set-up (every model trained" in alone
    kept = tool.section("native", 1, reports, 6.0, "2026-11-29 10:00 UTC", "aaa",
                        trained=False)
    assert "were kept in the draw's cache from an earlier set-up, and verified" in kept


def test_a_quoted_number_s_context_is_cut_between_words() -> None:
    text = "the held-out loss rises by 0.415 while the training loss keeps falling to 1.512"
    at = text.index("0.415")
    assert tool.around(text, at, at + 5, before=12, after=10) == "rises by 0.415 while"
    assert tool.around(text, 0, 3, before=12, after=200) == text  # the whole text: as it is
    assert tool.around("abcx0.415yzw", 4, 9, before=2, after=1) == "0.415"  # no space near


def test_report_only_writes_the_section_from_the_last_run_and_executes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _git(tmp_path, "init", "-q")
    for folder in ("book", "docs"):
        (tmp_path / folder).mkdir()
    chapter = _chapter(tmp_path / "book" / "a.md", "The loss is 0.50 here.\n",
                       _code("print(0.50)"))
    stored = tmp_path / "tests" / "notebooks"
    stored.mkdir(parents=True)
    nbformat.write(_nb("0.50\n"), stored / "a.ipynb")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    sha = _git(tmp_path, "rev-parse", "HEAD")
    work = tmp_path / "_build" / "redraw"
    (work / "native").mkdir(parents=True)
    nbformat.write(_nb("0.75\n"), work / "native" / "a.ipynb")  # what the draw printed
    record = {"chapters": {"a": {"commit": sha, "at": sha[:12], "seconds": 60.0,
                                 "date": "2026-11-29 10:00 UTC"}},
              "shift": 1, "setup_seconds": 0.0, "trained": False,
              "setup_note": "Set-up was made in two parts"}
    (work / "native" / tool.RUNS).write_text(tool.json.dumps(record), encoding="utf-8")
    for name, value in (("ROOT", tmp_path), ("WORK", work)):
        monkeypatch.setattr(tool, name, value)
    monkeypatch.setattr(tool.baseline, "STORED_DIR", stored)
    monkeypatch.setattr(tool.baseline, "notebook_chapters", lambda: [chapter])
    monkeypatch.setattr(tool, "set_up", lambda env: pytest.fail("set-up ran"))
    monkeypatch.setattr(tool, "execute_all", lambda chapters, out, jobs: (
        {} if not chapters else pytest.fail(f"executed {chapters}")))
    report = tmp_path / "docs" / "redraw.md"
    assert tool.main(["native", "--report-only", "--report", str(report)]) == 0
    text = report.read_text(encoding="utf-8")
    assert f"Commit {sha[:12]}, " in text and "Set-up was made in two parts" in text
    assert '- 0.50 → **0.75** (cell 1): "…The loss is 0.50 here.…"' in text
    with pytest.raises(SystemExit):
        tool.main(["native", "--report-only", "--only", "a"])
    assert "give one" in capsys.readouterr().err
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("x = 1", encoding="utf-8")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    with pytest.raises(SystemExit):  # the package changed since the chapter ran
        tool.main(["native", "--report-only"])
    assert "--report-only: chapter a ran at" in capsys.readouterr().err
