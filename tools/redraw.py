"""The book under another draw of its bits: `make redraw`, the check of the chapters' claims.

The stored notebooks (tests/notebooks/) hold what one draw printed: the models and kept runs
trained with the book's seeds, on Linux x86-64 with the package's own matrix products. A
reader with other bits (another platform, another BLAS, a GPU) trains other models, and the
chapters must still run for them and their prose must still be true. This tool makes such a
reader's book from an empty cache and reports what happened:

    .venv/bin/python tools/redraw.py seed      # every random stream redrawn (MINIGPT_SEED_SHIFT)
    .venv/bin/python tools/redraw.py native    # PyTorch's own products (MINIGPT_PRODUCTS=native)
    .venv/bin/python tools/redraw.py seed native --shift 7
    .venv/bin/python tools/redraw.py retrain   # nothing redrawn: the book's own draw, afresh

The third is the re-read's list after a change that moves the models' bits (a new kernel, a
changed recipe): the book as this commit trains it, against the stored notebooks the last
baseline wrote; it is not kept in the report (``--report`` names a file of its own).

Each draw is a fresh set-up: an empty cache of its own (``_build/redraw/<draw>-cache``, or
``--cache``; ``--again`` keeps what it holds, to run the chapters again on the draw's models),
nothing fetched, every model trained in the lanes `make book-model` uses, then every chapter
executed (two at a time, as `make book` does) with ``allow_errors``: a cell that
fails is recorded and the chapter runs on to its end, so one run lists every failure. The
executed chapters are kept in ``_build/redraw/<draw>/<chapter>.ipynb``.

After a fix to one chapter, ``--only CHAPTER...`` executes only those chapters again (on the
draw's kept cache) and keeps the others' executed notebooks from the draw's last run. That is
refused unless nothing a kept chapter runs has changed since the commit it ran at (a file of
the repository other than the other chapters' pages, the tests, the docs, the README and
this tool): the report still describes the book of one commit, and says which chapters were
run again at which commit. ``--report-only`` executes nothing and writes the draw's section
again from its last run (after a change to this tool), under the same check.

The report, docs/redraw.md, has a section for each draw (the commit and the date it ran at;
a new run of a draw replaces that draw's section, the other draw's stays), and in it, per
chapter:

* every cell that failed: the line that raised (an assert's own line) and the message;
* every number the prose quotes that moved: a decimal of the chapter's prose that a code cell
  printed in the stored notebook, and which that cell, at the same place of its output,
  printed differently under the draw (stored beside redrawn, as printed: a number that moves
  within its printed digits does not move).

Not part of `make test`: each draw trains every model (about 40 CPU-minutes on a 2-core
machine) and executes every chapter. The weekly workflow (reproduce.yml) runs both draws and
keeps the report and the executed chapters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402  (tools/baseline.py: the chapter list, the stored notebooks)
import execute_chapters  # noqa: E402  (how the build executes a chapter)

ROOT = baseline.ROOT
REPORT = ROOT / "docs" / "redraw.md"
WORK = ROOT / "_build" / "redraw"
#: The redraws: name -> what it sets, given the seed shift.
DRAWS = {
    "seed": lambda shift: {"MINIGPT_SEED_SHIFT": str(shift)},
    "native": lambda shift: {"MINIGPT_PRODUCTS": "native"},
    "retrain": lambda shift: {},
}
DESCRIPTIONS = {
    "seed": "another seed: every random stream of every model and kept run redrawn "
            "(`MINIGPT_SEED_SHIFT={shift}`)",
    "native": "other rounding: PyTorch's own matrix products (`MINIGPT_PRODUCTS=native`), "
              "what a reader off Linux x86-64 computes, in kind",
    "retrain": "the book's own draw, trained afresh by this commit's code: after a change "
               "that moves the models' bits, the list its re-read works from",
}
#: A number as the chapters print and quote it: a sign, digits with thousands' commas, a
#: decimal part. Only numbers with a decimal point are compared (counts and years are not
#: what a draw moves, and integers match too much by chance).
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d{1,3}(?:,\d{3})*\.\d+|(?<![\w.])[-+−]?\d+\.\d+")
SECTION = re.compile(r"^<!-- draw: (\w+) -->$.*?^<!-- end of draw: \1 -->$\n?",
                     re.MULTILINE | re.DOTALL)


def canonical(number: str) -> str:
    """A printed number without its sign's spelling and thousands' commas."""
    return number.replace("−", "-").lstrip("+").replace(",", "")


def output_text(cell: Any) -> str:
    """What a code cell printed, as text: its streams, its results' and displays' plain text
    and its errors' names and messages, in order."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "".join(parts)


def numbers(text: str) -> list[str]:
    return [canonical(m.group()) for m in NUMBER.finditer(text)]


@dataclass
class Moved:
    number: str          # as the prose quotes it
    context: str         # the prose around it
    cell: int            # the code cell that printed it (0-based among code cells)
    redrawn: str | None  # what that cell printed there under the draw (None: nothing)


@dataclass
class Failure:
    cell: int
    line: str
    message: str


@dataclass
class ChapterReport:
    chapter: str
    cells: int
    seconds: float
    failures: list[Failure] = field(default_factory=list)
    quoted: int = 0
    moved: list[Moved] = field(default_factory=list)
    error: str | None = None  # the chapter could not be executed at all


def prose_numbers(chapter: Path) -> list[tuple[str, str, int]]:
    """Each decimal the chapter's prose quotes (markdown cells, not code), with its context
    and the number of code cells before its paragraph."""
    nb = execute_chapters.read_chapter(chapter, execute_chapters.book_settings()["extensions"])
    found = []
    before = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            before += 1
        if cell.cell_type != "markdown":
            continue
        text = " ".join(cell.source.split())
        for m in NUMBER.finditer(text):
            found.append((canonical(m.group()), around(text, m.start(), m.end()), before))
    return found


def around(text: str, start: int, end: int, before: int = 50, after: int = 30) -> str:
    """``text[start:end]`` with about ``before`` and ``after`` characters of its context,
    cut between words (a word cut in two would read as a misspelling)."""
    left = max(0, start - before)
    if left > 0:
        left = text.find(" ", left, start) + 1  # 0 if no space: from the number itself
        left = left or start
    right = min(len(text), end + after)
    if right < len(text):
        right = max(text.rfind(" ", end, right), end)
    return text[left:right]


def code_cells(nb: Any) -> list[Any]:
    return [c for c in nb.cells if c.cell_type == "code"]


def nearest(cells: list[int], before: int) -> int:
    """Of the code cells that printed a quoted number, the nearest to its paragraph: the
    nearest before it (``before`` code cells precede it), else the nearest after."""
    earlier = [i for i in cells if i < before]
    return max(earlier) if earlier else min(cells)


def quoted_cell(cells: list[int], before: int, others: set[str],
                printed: list[set[str]]) -> int:
    """Of the code cells that printed a quoted number, the one its paragraph quotes it from:
    the one that printed most of the other numbers the same prose quotes (``others``; a
    table's row is quoted together), then the `nearest`."""
    most = max(len(others & printed[i]) for i in cells)
    return nearest([i for i in cells if len(others & printed[i]) == most], before)


def compare(quoted: list[tuple[str, str, int]], stored: list[Any],
            redrawn: list[Any]) -> tuple[int, list[Moved]]:
    """(how many quoted numbers a stored cell printed, those of them that moved): a quoted
    number holds if a place that printed it in the stored notebook prints it again, the same
    place (cell, and the number's rank among the cell's printed numbers) under the draw. The
    places are those of the cell the prose quotes it from (`quoted_cell`): ``quoted`` gives
    each number, its context and the code cells before its prose (`prose_numbers`; the same
    for the numbers of one stretch of prose)."""
    stored_numbers = [numbers(output_text(c)) for c in stored]
    redrawn_numbers = [numbers(output_text(c)) for c in redrawn]
    printed_sets = [set(nums) for nums in stored_numbers]
    stretch: dict[int, set[str]] = {}  # the numbers quoted by each stretch of prose
    for number, _, before in quoted:
        stretch.setdefault(before, set()).add(number)
    printed = 0
    moved = []
    for number, context, before in quoted:
        places = [(i, j) for i, nums in enumerate(stored_numbers)
                  for j, n in enumerate(nums) if n == number]
        if not places:
            continue
        cell = quoted_cell(sorted({i for i, _ in places}), before, stretch[before] - {number},
                           printed_sets)
        places = [(i, j) for i, j in places if i == cell]
        printed += 1
        again = [redrawn_numbers[i][j] if i < len(redrawn_numbers)
                 and j < len(redrawn_numbers[i]) else None for i, j in places]
        if number not in again:
            moved.append(Moved(number, context, places[0][0], again[0]))
    return printed, moved


def failures(nb: Any) -> list[Failure]:
    """Every code cell of an executed notebook that raised: the line that raised (the last
    frame in the cell's own code) and the exception."""
    found = []
    for i, cell in enumerate(code_cells(nb)):
        for out in cell.get("outputs", []):
            if out.get("output_type") != "error":
                continue
            line = raising_line(cell.source, out.get("traceback", []))
            found.append(Failure(i, line, f"{out.get('ename')}: {out.get('evalue')}"))
    return found


ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: IPython's traceback marks the line that raised with an arrow and its number.
ARROW = re.compile(r"^-*>\s*(\d+)", re.MULTILINE)


def raising_line(source: str, traceback: list[str]) -> str:
    """The line of the cell's ``source`` that raised, from IPython's ``traceback`` (the first
    frame is the cell's own)."""
    for frame in traceback:
        match = ARROW.search(ANSI.sub("", frame))
        if match:
            lines = source.splitlines()
            number = int(match.group(1))
            if 1 <= number <= len(lines):
                return lines[number - 1].strip()
    return "(the raising line is not in the cell)"


def set_up(env: dict[str, str]) -> float:
    """Train every model of set-up in an empty cache (`make book-model`): seconds taken."""
    start = time.perf_counter()
    subprocess.run(["make", "--no-print-directory", "book-model"], cwd=ROOT, env=env,
                   check=True)
    return time.perf_counter() - start


def execute_all(chapters: list[Path], out: Path, jobs: int) -> dict[str, tuple[Any, float,
                                                                            str | None]]:
    """Execute ``chapters`` as the build does, ``jobs`` at a time, on past failing cells;
    each executed notebook is written to ``out``. Runs in this process's environment."""
    settings = execute_chapters.book_settings() | {"allow_errors": True}
    results: dict[str, tuple[Any, float, str | None]] = {}
    waiting = execute_chapters.longest_first(chapters)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures: dict[Future[Any], Path] = {}
        while waiting or futures:
            while len(futures) < jobs:
                chapter = execute_chapters.next_chapter(waiting, list(futures.values()))
                if chapter is None:
                    break
                waiting.remove(chapter)
                futures[pool.submit(execute_chapters.execute, chapter, settings)] = chapter
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                chapter = futures.pop(future)
                nb, seconds, error = future.result()
                nbformat.write(nb, out / f"{chapter.stem}.ipynb")
                results[chapter.stem] = (nb, seconds, error)
                print(f"{chapter.stem}: executed in {seconds:.0f} s, "
                      f"{len(failures(nb))} failed cell(s)", flush=True)
    return results


def chapter_report(chapter: Path, nb: Any, seconds: float, error: str | None) -> ChapterReport:
    stored = nbformat.read(baseline.STORED_DIR / f"{chapter.stem}.ipynb", as_version=4)
    report = ChapterReport(chapter.stem, len(code_cells(nb)), seconds, failures(nb),
                           error=error if error and not failures(nb) else None)
    report.quoted, report.moved = compare(prose_numbers(chapter), code_cells(stored),
                                          code_cells(nb))
    return report


def commit() -> str:
    """HEAD's short hash, said to have uncommitted changes if a file a chapter runs has
    (not one of `NOT_RUN`: this report, written by a draw while another runs, is not)."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                            ".", *(f":(exclude){path}" for path in NOT_RUN)], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + (" (with uncommitted changes)" if dirty else "")


def section(draw: str, shift: int, reports: list[ChapterReport], setup_seconds: float,
            when: str, at: str, runs: dict[str, str] | None = None,
            trained: bool = True, dates: dict[str, str] | None = None,
            setup_note: str | None = None) -> str:
    """The draw's section of the report; ``runs`` gives the commit each chapter ran at, where
    some were run again (`--only`) after the others (default: all at ``at``), and ``dates``
    the date of each such commit's run (default: ``when``); ``trained``: whether set-up
    trained the models (else it found them in the draw's cache, `--again`); ``setup_note``:
    what set-up was, in words, in place of what ``trained`` says (from the draw's record:
    a set-up made in parts, or at another commit with the same models' code)."""
    failed = sum(len(r.failures) + (r.error is not None) for r in reports)
    moved = sum(len(r.moved) for r in reports)
    quoted = sum(r.quoted for r in reports)
    runs = runs or {r.chapter: at for r in reports}
    dates = dates or {}
    first = max(set(runs.values()), key=list(runs.values()).count)  # most chapters ran here
    again: dict[str, list[str]] = {}
    for chapter, commit_at in runs.items():
        if commit_at != first:
            again.setdefault(commit_at, []).append(chapter)
    if again:  # `--only` checked that every kept chapter is as at ``at``
        ran = (f"The book of commit {at}: each chapter ran at a commit where its page and "
               f"everything it runs were as in {at} (they differ only in other chapters' "
               f"pages, the tests, the docs, the README and this tool). Most ran at "
               f"{first} ({dates.get(first, when)}); "
               + "; ".join(f"run again at {c} ({dates.get(c, when)}): {', '.join(names)}"
                           for c, names in again.items()) + ".")
    else:
        ran = f"Commit {first}, {when}."
    lines = [f"<!-- draw: {draw} -->", f"## {DESCRIPTIONS[draw].format(shift=shift)}", "",
             f"{ran} "
             + (setup_note if setup_note else
                f"Set-up (every model trained, nothing fetched) took {setup_seconds / 60:.0f}"
                " min" if trained else "The models were kept in the draw's cache from an "
                f"earlier set-up, and verified ({setup_seconds / 60:.0f} min)")
             + "; the chapters, two at a time, "
             f"{sum(r.seconds for r in reports) / 60:.0f} CPU-min.", "",
             f"**{failed} failed cell(s)**; of the {quoted} decimals the prose quotes that a "
             f"cell prints, **{moved} moved**.", "",
             "| chapter | code cells | failed | quoted and printed | moved |",
             "| --- | --- | --- | --- | --- |"]
    for r in reports:
        lines.append(f"| {r.chapter} | {r.cells} | {len(r.failures) + (r.error is not None)} "
                     f"| {r.quoted} | {len(r.moved)} |")
    for r in reports:
        if not (r.failures or r.moved or r.error):
            continue
        lines += ["", f"### {r.chapter}", ""]
        if r.error:
            lines.append(f"- could not be executed: `{r.error.splitlines()[-1][:200]}`")
        for f in r.failures:
            lines.append(f"- cell {f.cell + 1} failed at `{f.line}`: {f.message[:300]}")
        for m in r.moved:
            shown = "nothing" if m.redrawn is None else f"**{m.redrawn}**"
            lines.append(f"- {m.number} → {shown} (cell {m.cell + 1}): \"…{m.context}…\"")
    lines += ["", f"<!-- end of draw: {draw} -->", ""]
    return "\n".join(lines)


HEADER = """# The book under another draw

What a reader with other bits gets: the whole book built from an empty cache under another
draw, every chapter run to its end (`tools/redraw.py`, `make redraw`). A failed cell is a
claim that one draw made true; a moved number is one the prose quotes that a reader with
other bits sees printed differently, to be read against what the prose says of it.

"""


def write_report(draw: str, text: str, path: Path = REPORT) -> None:
    """Replace ``draw``'s section of the report with ``text`` (the other draws' stay)."""
    old = path.read_text(encoding="utf-8") if path.exists() else HEADER
    sections = {m.group(1): m.group() for m in SECTION.finditer(old)}
    sections[draw] = text
    body = "".join(sections[d] + ("" if sections[d].endswith("\n") else "\n")
                   for d in DRAWS if d in sections)
    path.write_text(HEADER + body, encoding="utf-8")


#: What a draw's last run executed: chapter -> the commit it ran at, seconds, date.
RUNS = "runs.json"
#: What a kept chapter's execution does not depend on: files that may change between the
#: commit it ran at and a run of other chapters (`--only`): the tests and the stored
#: notebooks, the docs and the README (no chapter reads either) and this report's own
#: writer (a chapter is executed by tools/execute_chapters.py, which stays in).
NOT_RUN = ("tests", "docs", "README.md", "tools/redraw.py")


def head() -> str:
    """The full hash of HEAD, or '' if the work tree has uncommitted changes."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    return "" if commit().endswith("changes)") else sha


def changed_since(sha: str, keep: list[str]) -> list[str]:
    """The files of the work tree that differ from commit ``sha``, but for ``keep`` and
    `NOT_RUN`: what may have changed what a chapter run at ``sha`` would do."""
    excluded = [f":(exclude){path}" for path in [*keep, *NOT_RUN]]
    out = subprocess.run(["git", "diff", "--name-only", sha, "--", ".", *excluded], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def kept_runs(draw: str, only: list[str], shift: int) -> dict[str, Any]:
    """The draw's last run, for `--only`: its record, checked to still describe this commit
    for every chapter not in ``only`` (a ValueError says what stops it)."""
    record_path = WORK / draw / RUNS
    if not record_path.is_file():
        raise ValueError(f"draw '{draw}' has no earlier run in {WORK / draw} to keep: "
                         "run the whole draw first")
    record: dict[str, Any] = json.loads(record_path.read_text(encoding="utf-8"))
    if draw == "seed" and record["shift"] != shift:
        raise ValueError(f"the last '{draw}' draw ran with --shift {record['shift']}, not "
                         f"{shift}")
    chapters = {c.stem for c in baseline.notebook_chapters()}
    unknown = sorted(set(only) - chapters)
    if unknown:
        raise ValueError(f"no such chapter(s) {unknown}; the chapters are {sorted(chapters)}")
    for name in sorted(chapters - set(only)):
        # a chapter's execution reads its own page, not the other chapters' pages
        keep = [f"book/{other}.md" for other in sorted(chapters) if other != name]
        run = record["chapters"].get(name)
        if run is None or not run["commit"]:
            raise ValueError(f"chapter {name} was not run at a commit in the last '{draw}' "
                             "draw: run it too, or the whole draw")
        changed = changed_since(run["commit"], keep)
        if changed:
            raise ValueError(f"chapter {name} ran at {run['commit'][:12]}, and since then "
                             f"{', '.join(changed[:5])} changed: run it too, or the whole "
                             "draw")
    return record


def run_draw(draw: str, shift: int, jobs: int, cache: Path | None, report: Path,
             again: bool = False, only: list[str] | None = None,
             report_only: bool = False) -> int:
    """Make the draw (or, ``only``, run those chapters again; ``report_only``, none) and
    write its section of the report: 1 if a cell failed, else 0."""
    work = WORK / draw
    if report_only:
        only = []
    record = kept_runs(draw, only, shift) if only is not None else {"chapters": {}}
    if only is None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    if cache is None:
        cache = WORK / f"{draw}-cache"
        if not again and only is None:
            shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "MINIGPT_CACHE": str(cache), "MINIGPT_MODELS_URL": "off",
           **DRAWS[draw](shift)}
    env.pop("MINIGPT_CENSUS", None)
    print(f"redraw '{draw}': {DESCRIPTIONS[draw].format(shift=shift)}; cache {cache}",
          flush=True)
    at, when = commit(), datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    setup_seconds = 0.0 if report_only else set_up(env)
    if only is not None:  # what set-up took when the draw trained every model
        setup_seconds = record["setup_seconds"]
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernels inherit the draw
    chapters = baseline.notebook_chapters()
    try:
        results = execute_all([c for c in chapters if only is None or c.stem in only],
                              work, jobs)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    sha = head()
    for name, (_, seconds, _) in results.items():
        record["chapters"][name] = {"commit": sha, "at": at, "seconds": seconds,
                                    "date": when}
    for c in chapters:  # the kept chapters, as the draw's last run executed them
        if c.stem not in results:
            run = record["chapters"][c.stem]
            nb = nbformat.read(work / f"{c.stem}.ipynb", as_version=4)
            results[c.stem] = (nb, run["seconds"], None)
    trained = record.get("trained", False) if only is not None else not again
    record |= {"draw": draw, "shift": shift, "setup_seconds": setup_seconds,
               "trained": trained}
    (work / RUNS).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    reports = [chapter_report(c, *results[c.stem]) for c in chapters]
    runs = {c.stem: record["chapters"][c.stem]["at"] for c in chapters}
    dates = {record["chapters"][c.stem]["at"]: record["chapters"][c.stem]["date"]
             for c in chapters}
    write_report(draw, section(draw, shift, reports, setup_seconds, when, at, runs,
                               trained=trained, dates=dates,
                               setup_note=record.get("setup_note")), report)
    failed = sum(len(r.failures) + (r.error is not None) for r in reports)
    print(f"redraw '{draw}': {failed} failed cell(s), "
          f"{sum(len(r.moved) for r in reports)} quoted number(s) moved; {report}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("draws", nargs="+", choices=sorted(DRAWS), help="the draws to make")
    parser.add_argument("--shift", type=int, default=1,
                        help="the seed draw's MINIGPT_SEED_SHIFT (default: 1)")
    parser.add_argument("--jobs", type=int, default=2, help="chapters executed at once")
    parser.add_argument("--cache", type=Path,
                        help="the draw's cache (default: _build/redraw/<draw>-cache, emptied "
                        "first unless --again)")
    parser.add_argument("--again", action="store_true",
                        help="keep what the draw's cache holds (after a chapter changed: its "
                        "models and kept runs are not trained again, only verified)")
    parser.add_argument("--only", nargs="+", metavar="CHAPTER",
                        help="execute only these chapters again, on the draw's cache, and keep "
                        "the others from the draw's last run (refused if anything they run "
                        "changed since)")
    parser.add_argument("--report-only", action="store_true",
                        help="execute nothing: write the draw's section of the report again "
                        "from its last run (refused if anything a chapter runs changed since)")
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    if args.shift < 1 or args.shift >= 2**32:
        parser.error(f"--shift must be from 1 to {2**32 - 1}, got {args.shift}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.cache is not None and len(args.draws) > 1:
        parser.error("--cache names one draw's cache: give one draw with it")
    if args.only and args.report_only:
        parser.error("--only runs chapters again, --report-only runs none: give one")
    if "retrain" in args.draws and args.report.resolve() == REPORT:
        parser.error(f"the retrain draw is a re-read's working list, not a redraw: give it a "
                     f"--report of its own (not {REPORT.relative_to(ROOT)})")
    if args.only or args.report_only:
        for draw in dict.fromkeys(args.draws):  # before anything runs
            try:
                kept_runs(draw, args.only or [], args.shift)
            except ValueError as err:
                parser.error(f"--{'only' if args.only else 'report-only'}: {err}")
    status = 0
    for draw in dict.fromkeys(args.draws):
        status |= run_draw(draw, args.shift, args.jobs, args.cache, args.report, args.again,
                           args.only, args.report_only)
    return status


if __name__ == "__main__":
    sys.exit(main())
