"""Re-baseline the stored notebooks that nbval compares against: `make baseline`.

Every chapter of the book is a MyST-markdown notebook `book/X.md`. nbval reads
only `.ipynb`, so each chapter has a stored, executed copy `tests/notebooks/X.ipynb`
holding the outputs the chapter printed when it was last baselined. `make test`
re-executes every stored notebook with nbval and compares the new outputs with
the stored ones; `tests/test_notebooks_sync.py` fails as soon as a chapter's code
cells and its stored notebook's disagree, so the stored outputs cannot drift
from the chapters.

The stored outputs come with `tests/notebooks/models.json`: for every model
set-up trains, its cache key, the sha256 and size of its weights and the sha256
of its record (`minigpt.recipes.published`): the chapters print what those models say,
and a published model is fetched only if it is that one. `tests/notebooks/runs.json`
holds the same for every kept run of a sweep the chapters train (`minigpt.recipes.runs`),
written by `--from-build` from the build's record of the runs each chapter used. The CPU kernels are
pinned (`minigpt.PINNED_CPU_KERNELS`), so set-up trains the same bits on every
x86-64 CPU and a re-baseline on any of them changes nothing.

After an intended change of a chapter (or of package code whose printed
results a chapter shows), run

    make baseline                                  # every chapter
    .venv/bin/python tools/baseline.py tokenisation concept   # only these

and review the diff of `tests/notebooks/` before committing it.

A stored notebook keeps only the code cells (prose does not change outputs, so
editing it needs no re-baseline), with deterministic cell ids, no timing
metadata and no image data (nbval compares a figure's text, not its pixels), so
that a re-baseline's diff shows only outputs that really changed. Each chapter
is executed the way the book build executes it: a fresh `python3` kernel whose
working directory is the chapter's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jupytext
import nbformat
import yaml
from nbclient import NotebookClient

# Importing minigpt pins the CPU kernels (minigpt.PINNED_CPU_KERNELS) in this process's
# environment, which every kernel it starts inherits.
from minigpt.recipes import published
from minigpt.recipes.catalogue import MODELS
from minigpt.recipes.runs import RUNS_JOURNAL, run_folder

ROOT = Path(__file__).resolve().parents[1]
TOC = ROOT / "_toc.yml"
BOOK_DIR = ROOT / "book"
STORED_DIR = ROOT / "tests" / "notebooks"
METADATA_KEY = "minigpt_book"
DEFAULT_TIMEOUT = 600  # seconds a cell may take, as in _config.yml
# Outputs nbval does not compare without nbdime; dropped to keep the files small.
DROPPED_MIME_PREFIXES = ("image/",)
HASH_SEED = "0"  # the same in the build, in nbval and here (set iteration order)

#: The sha256 of every cached model's weights, as set-up trained them: a re-baseline writes
#: it, tests/test_reproducible.py checks the cache against it.
MODEL_HASHES = STORED_DIR / "models.json"
#: key -> what each kept run the chapters train must be (`minigpt.recipes.runs`).
RUN_HASHES = STORED_DIR / "runs.json"
#: Where `make book` records what each chapter's execution computed and which kept runs it
#: used (``MINIGPT_CENSUS``): one folder a chapter.
CENSUS = ROOT / "_build" / "census"
#: The execution cache the site's build fills (_config.yml's execute.cache).
BUILD_CACHE = ROOT / "_build" / ".jupyter_cache"


def toc_files(toc_path: Path = TOC) -> list[str]:
    """Every `file:` entry of a jb-book `_toc.yml`, in reading order, root first."""
    toc = yaml.safe_load(toc_path.read_text(encoding="utf-8"))
    if not isinstance(toc, dict) or "root" not in toc:
        raise ValueError(f"{toc_path}: expected a jb-book table of contents with a 'root' key")

    def walk(entries: Any) -> Iterator[str]:
        for entry in entries or []:
            if "file" in entry:
                yield str(entry["file"])
            for key in ("parts", "chapters", "sections"):
                yield from walk(entry.get(key))

    return [str(toc["root"]), *walk(toc.get("parts")), *walk(toc.get("chapters"))]


def source_path(toc_entry: str) -> Path:
    """The source file of a toc entry (`book/intro` -> `<root>/book/intro.md`)."""
    for suffix in (".md", ".ipynb"):
        path = ROOT / (toc_entry if toc_entry.endswith(suffix) else toc_entry + suffix)
        if path.exists():
            return path
    raise FileNotFoundError(f"_toc.yml lists {toc_entry!r} but no .md or .ipynb file exists")


def is_notebook(path: Path) -> bool:
    """A MyST page is a notebook when its front matter names a kernel (jupytext header)."""
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n"):
        return False
    end = text.find("\n---", 4)
    if end < 0:
        return False
    front = yaml.safe_load(text[4:end]) or {}
    return isinstance(front, dict) and "kernelspec" in front


def notebook_chapters() -> list[Path]:
    """The chapters in `_toc.yml` that are notebooks, i.e. that have code to run."""
    return [p for p in map(source_path, toc_files()) if is_notebook(p)]


def stored_path(chapter: Path) -> Path:
    """`book/X.md` -> `tests/notebooks/X.ipynb` (sub-folders of book/ are kept)."""
    return (STORED_DIR / chapter.relative_to(BOOK_DIR)).with_suffix(".ipynb")


def read_chapter(chapter: Path) -> nbformat.NotebookNode:
    """The chapter as a notebook, exactly as jupytext (and so Jupyter) reads it."""
    return jupytext.read(chapter)


def code_cells(nb: nbformat.NotebookNode) -> list[tuple[str, list[str]]]:
    """(source, tags) of every code cell: what the sync test compares."""
    return [
        (cell.source, list(cell.get("metadata", {}).get("tags", [])))
        for cell in nb.cells
        if cell.cell_type == "code"
    ]


@contextmanager
def kernel_environment(**values: str) -> Iterator[None]:
    """Set ``values`` in this process's environment, which a kernel started inside inherits,
    and put back what was there after: a caller that executes a chapter in its own process
    (a test does) keeps the environment it had. A variable left behind would reach every
    later key taken in that process (`kept.key` reads the steering variables, the hash seed
    among them)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int) -> nbformat.NotebookNode:
    """Run every cell in a fresh `python3` kernel started in `cwd`; errors propagate."""
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        record_timing=False,  # timestamps would make every re-baseline a diff
        allow_errors=False,  # a cell tagged raises-exception may still raise
    )
    with kernel_environment(PYTHONHASHSEED=HASH_SEED):  # inherited by the kernel process
        client.execute()
    return nb


def _clean_output(output: nbformat.NotebookNode) -> nbformat.NotebookNode:
    if "data" in output:
        output["data"] = {
            mime: value
            for mime, value in output["data"].items()
            if not mime.startswith(DROPPED_MIME_PREFIXES)
        }
        output["metadata"] = {}
    output.pop("transient", None)
    return output


def _merge_streams(outputs: list[nbformat.NotebookNode]) -> list[nbformat.NotebookNode]:
    """Consecutive pieces of one stream joined: how the kernel split a cell's printing into
    messages varies from run to run (nbval and the output test merge streams anyway)."""
    merged: list[nbformat.NotebookNode] = []
    for output in outputs:
        last = merged[-1] if merged else None
        if (last is not None and output.output_type == last.output_type == "stream"
                and output.name == last.name):
            last.text += output.text
        else:
            merged.append(output)
    return merged


def stored_notebook(executed: nbformat.NotebookNode, chapter: Path) -> nbformat.NotebookNode:
    """The executed notebook reduced to what nbval compares, with stable ids."""
    stored = nbformat.v4.new_notebook()
    stored.metadata = {
        "kernelspec": executed.metadata.get("kernelspec", {"name": "python3"}),
        "language_info": {"name": "python"},
        METADATA_KEY: {
            "chapter": chapter.relative_to(ROOT).as_posix(),
            "generated_by": "make baseline (tools/baseline.py); do not edit by hand",
        },
    }
    for index, cell in enumerate(c for c in executed.cells if c.cell_type == "code"):
        if cell.execution_count is None:
            # nbval never compares a cell without an execution count.
            raise RuntimeError(f"{chapter}: code cell {index} was not executed")
        new = nbformat.v4.new_code_cell(source=cell.source)
        new.id = f"code-{index:03d}"
        new.metadata = {k: v for k, v in cell.metadata.items() if k != "execution"}
        new.execution_count = cell.execution_count
        new.outputs = [_clean_output(o) for o in _merge_streams(cell.outputs)]
        stored.cells.append(new)
    nbformat.validate(stored)
    return stored


def baseline(chapter: Path, timeout: int = DEFAULT_TIMEOUT) -> Path:
    """Execute one chapter and write its stored notebook; returns the path written."""
    return store(execute(read_chapter(chapter), cwd=chapter.parent, timeout=timeout), chapter)


def model_hashes() -> dict[str, dict[str, Any]]:
    """name -> what a published copy of each model in `minigpt.recipes.catalogue.MODELS` must be
    (`minigpt.recipes.published.entry`: its cache key, its weights' sha256 and size, its record's
    sha256), read from the cache that set-up filled (each model loaded and verified)."""
    return {name: published.entry(load()[2].path) for name, load in MODELS.items()}


def run_hashes(census: Path = CENSUS) -> dict[str, dict[str, Any]]:
    """key -> the chapter and what a published copy must be (`minigpt.recipes.published.entry`)
    of every kept run the last `make book` used, as its chapters journalled them
    (``runs.txt`` in each chapter's census folder), read from the cache (each run was loaded
    and verified by its chapter)."""
    journals = sorted(census.glob(f"*/{RUNS_JOURNAL}"))
    if not journals:
        raise SystemExit(f"no chapter's list of kept runs in {census}: run `make book` first")
    return {key: {"chapter": path.parent.name, **published.entry(run_folder(key))}
            for path in journals for key in path.read_text(encoding="utf-8").splitlines()}


def store_run_hashes() -> Path:
    """Write `run_hashes()` to `RUN_HASHES`."""
    text = json.dumps(run_hashes(), indent=1, sort_keys=True) + "\n"
    RUN_HASHES.write_text(text, encoding="utf-8")
    return RUN_HASHES


def store_model_hashes() -> Path:
    """Write `model_hashes()` to `MODEL_HASHES`."""
    text = json.dumps(model_hashes(), indent=1, sort_keys=True) + "\n"
    MODEL_HASHES.write_text(text, encoding="utf-8")
    return MODEL_HASHES


def built_notebook(chapter: Path) -> tuple[nbformat.NotebookNode, float]:
    """The chapter as the last `make book` executed it, from the build's execution cache,
    and when it was executed (a timestamp); `LookupError` says what to build."""
    from jupyter_cache import get_cache

    if not (BUILD_CACHE / "global.db").is_file():
        raise LookupError(f"{BUILD_CACHE} is missing: build the book first (make book)")
    cache = get_cache(BUILD_CACHE)
    records = [r for r in cache.list_cache_records() if Path(r.uri) == chapter]
    if not records:
        raise LookupError(f"the build executed no {chapter.relative_to(ROOT)}: build the "
                          "book again (make book)")
    record = max(records, key=lambda r: r.created)
    return cache.get_cache_bundle(record.pk).nb, record.created.timestamp()


def store(executed: nbformat.NotebookNode, chapter: Path) -> Path:
    """Write the stored notebook of an executed chapter; returns the path written."""
    target = stored_path(chapter)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".ipynb.tmp")
    nbformat.write(stored_notebook(executed, chapter), tmp)
    tmp.replace(target)  # never leave a half-written notebook behind
    return target


def orphans() -> list[Path]:
    """Stored notebooks whose chapter is no longer a notebook listed in `_toc.yml`."""
    expected = {stored_path(c) for c in notebook_chapters()}
    return sorted(p for p in STORED_DIR.rglob("*.ipynb") if p not in expected)


def _select(names: Sequence[str]) -> list[Path]:
    chapters = notebook_chapters()
    by_name = {c.stem: c for c in chapters} | {str(c.relative_to(ROOT)): c for c in chapters}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(
            f"baseline: unknown chapter(s) {', '.join(unknown)}; "
            f"choose from: {', '.join(c.stem for c in chapters)}"
        )
    return [by_name[n] for n in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "chapters", nargs="*", help="chapter names (e.g. concept); default: every chapter"
    )
    parser.add_argument(
        "--timeout", type=int, default=DEFAULT_TIMEOUT, help="seconds a cell may take"
    )
    parser.add_argument(
        "--from-build", action="store_true",
        help="store what the last `make book` executed instead of executing the chapters "
             "again (the same kernel and settings; a chapter changed since is refused)")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")

    chapters = _select(args.chapters) if args.chapters else notebook_chapters()
    print(store_model_hashes().relative_to(ROOT))
    if args.from_build and not args.chapters:  # the runs the whole build used
        print(store_run_hashes().relative_to(ROOT))
    for chapter in chapters:
        start = time.perf_counter()
        if args.from_build:
            try:
                executed = built_notebook(chapter)[0]
            except LookupError as why:
                raise SystemExit(f"baseline: {why}") from None
            if code_cells(executed) != code_cells(read_chapter(chapter)):
                raise SystemExit(f"baseline: {chapter.relative_to(ROOT)} changed since the "
                                 "build executed it: build the book again (make book)")
            target = store(executed, chapter)
        else:
            target = baseline(chapter, timeout=args.timeout)
        print(f"{target.relative_to(ROOT)}  ({time.perf_counter() - start:.1f} s)")
    if not args.chapters:
        for stale in orphans():
            stale.unlink()
            print(f"removed {stale.relative_to(ROOT)} (its chapter is not in _toc.yml)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
