"""Execute the book's chapters two at a time into the build's execution cache: `make book`.

myst-nb (execute_notebooks: cache in _config.yml) executes each chapter while Sphinx reads
it, one chapter after another, and keeps the executed notebook in jupyter-cache. Each chapter
runs on one thread, so on a machine with two cores half of it waits. This tool fills the same
cache first, with the chapters executed side by side, and the build then finds every chapter
there ("Using cached notebook") and executes nothing. What runs is what myst-nb would run:
the chapter read by myst-nb's own reader with the book's MyST extensions, executed by the
function myst-nb calls (jupyter-cache's `single_nb_execution`) in a fresh `python3` kernel
whose working directory is the chapter's folder, with _config.yml's timeout and
allow_errors, and cached under the chapter's path as myst-nb caches it.

    .venv/bin/python tools/execute_chapters.py [--jobs 2] [CHAPTER ...]

The chapters start longest first (the order below, from measured execution times), so that
the last one to finish is a short one; of the chapters that use both cores, one runs at a
time. A chapter that fails is not cached; its error is printed, the others still run, and
the exit status is 1 (the build would fail on it too).

A chapter whose inputs are those of an execution already done is not executed again: each
executed chapter is kept in the cache (`tools/kept.py`) under a key over everything its
execution reads (`memo_key`): its code cells (not its prose), the package's code (not its
comments or docstrings, as the cached models' keys read it), the book's data files, the
stored models' hashes, the installed distributions, Python, the machine, the environment
variables that steer the kernels, and this tool. With the executed notebook it keeps the
census of matrix products the kernel journalled and the list of the kept runs it used
(`minigpt.recipes.runs`), which it writes back into the build's census folder. `--fresh` executes every chapter whatever is kept, and an empty cache (as `make
reproduce` has) keeps nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from minigpt.recipes.runs import RUNS_JOURNAL

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402  (tools/baseline.py: the chapter list and the hash seed)
import kept  # noqa: E402  (tools/kept.py: what is kept between builds, and its keys)

ROOT = baseline.ROOT
CONFIG = ROOT / "_config.yml"
# Seconds each chapter took to execute in a `make test` on a 2-core AMD EPYC, two at a time
# (2026-11-28; the build's "executed in" lines; a chapter not listed goes last).
MEASURED_SECONDS = {"experiments": 442, "assistant": 408, "modern_gpt": 333, "training": 170,
                    "rewards": 106, "sampling": 103, "implementation": 55,
                    "induction_heads": 43, "tokenisation": 43, "attention_heatmaps": 41,
                    "positional_encodings": 17, "concept": 15, "intro": 13, "notations": 12}
# Chapters that keep both cores busy for part of their run (the modern chapter's and the
# experiments chapter's sweeps run two trainings at once). Two of them side by side took
# longer than one after the other (110 s against 87 s), so at most one of them runs at a
# time; every other chapter computes on one thread and runs beside them.
TWO_CORES = {"experiments", "modern_gpt"}


def book_settings(config_path: Path = CONFIG) -> dict[str, Any]:
    """The execution settings and MyST extensions of the book's _config.yml."""
    config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    execute = config.get("execute", {})
    if execute.get("execute_notebooks") != "cache":
        raise SystemExit(f"{config_path}: execute.execute_notebooks must be 'cache' for this "
                         "tool (it fills the execution cache the build reads)")
    return {
        "cache": ROOT / execute.get("cache", "_build/.jupyter_cache"),
        "timeout": int(execute.get("timeout", 30)),
        "allow_errors": bool(execute.get("allow_errors", False)),
        "extensions": list(config.get("parse", {}).get("myst_enable_extensions", [])),
    }


def read_chapter(chapter: Path, extensions: list[str]) -> Any:
    """The chapter as the notebook myst-nb builds from it in Sphinx (create_nb_reader)."""
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    config = MdParserConfig(enable_extensions=set(extensions))
    return read_myst_markdown_notebook(chapter.read_text(encoding="utf-8"), config=config,
                                       add_source_map=True, path=str(chapter))


def execute(chapter: Path, settings: dict[str, Any],
            census: Path | None = None) -> tuple[Any, float, str | None]:
    """(executed notebook, seconds, error text or None): run in a worker process. With
    ``census``, a folder, the kernel journals the matrix products it computes there."""
    from jupyter_cache.executors.utils import single_nb_execution

    variables = {"PYTHONHASHSEED": baseline.HASH_SEED}  # inherited by the kernel
    if census is not None:
        variables["MINIGPT_CENSUS"] = str(census)
    nb = read_chapter(chapter, settings["extensions"])
    with baseline.kernel_environment(**variables):
        result = single_nb_execution(nb, cwd=str(chapter.parent), timeout=settings["timeout"],
                                     allow_errors=settings["allow_errors"], meta_override=True)
    error = None if result.err is None else (result.exc_string or repr(result.err))
    return nb, result.time, error


def memo_key(nb: Any, settings: dict[str, Any], files: str,
             environ: dict[str, str] | None = None) -> str:
    """The key an execution of the chapter ``nb`` (as `read_chapter` gives it) is kept under
    (`kept.key`): its code cells and kernel, the execution settings, the files its execution
    reads (``files``, `kept.files_digest` of `kept.inputs` of its code: the package's
    modules it imports and the book's data), whether the kernel journals its census, and
    the settings every key reads, with the hash seed every chapter runs under."""
    environ = {**(os.environ if environ is None else environ),
               "PYTHONHASHSEED": baseline.HASH_SEED}
    return kept.key({
        "code cells": json.dumps([c.source for c in nb.cells if c.cell_type == "code"]),
        "kernel": json.dumps(nb.metadata.get("kernelspec", {}), sort_keys=True),
        "settings": json.dumps({k: settings[k] for k in ("timeout", "allow_errors",
                                                         "extensions")}, sort_keys=True),
        "files": files,
        "tool": (ROOT / "tools" / "execute_chapters.py").read_text(encoding="utf-8"),
        "census": str("MINIGPT_CENSUS" in environ)}, environ)


def journal(folder: Path) -> list[str]:
    """The census lines the kernels journalled into ``folder``."""
    return [line for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text(encoding="utf-8").splitlines()]


def runs_used(folder: Path) -> list[str]:
    """The keys of the kept runs (`minigpt.recipes.runs`) the chapter journalled into
    ``folder``, in the order it used them."""
    path = folder / RUNS_JOURNAL
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []


def longest_first(chapters: list[Path]) -> list[Path]:
    return sorted(chapters, key=lambda c: -MEASURED_SECONDS.get(c.stem, 0))


def next_chapter(waiting: list[Path], running: list[Path]) -> Path | None:
    """The first waiting chapter (longest first) that may start beside ``running``: any,
    unless it uses two cores and a chapter that does is already running."""
    busy = any(c.stem in TWO_CORES for c in running)
    return next((c for c in waiting if not (busy and c.stem in TWO_CORES)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="*", help="chapter names (default: every chapter)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="chapters executed at once (default: 2)")
    parser.add_argument("--fresh", action="store_true",
                        help="execute every chapter, also one whose inputs are those of an "
                        "execution kept in the cache")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    chapters = baseline.notebook_chapters()
    if args.chapters:
        by_name = {c.stem: c for c in chapters}
        unknown = [n for n in args.chapters if n not in by_name]
        if unknown:
            parser.error(f"no chapter named {', '.join(unknown)}; the chapters are "
                         f"{', '.join(by_name)}")
        chapters = [by_name[n] for n in args.chapters]
    census = os.environ.get("MINIGPT_CENSUS")
    return run(chapters, book_settings(), jobs=args.jobs, fresh=args.fresh,
               census=Path(census) if census else None)


def run(chapters: list[Path], settings: dict[str, Any], jobs: int = 2, fresh: bool = False,
        census: Path | None = None, root: Path = ROOT) -> int:
    """Fill the execution cache with ``chapters``, executing those whose inputs are not
    those of an execution kept (all of them if ``fresh``), ``jobs`` at a time; with
    ``census``, each chapter's journal of products goes to ``census/<chapter>/``. The exit
    status: 1 if a chapter failed."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(settings["cache"])

    def store(chapter: Path, nb: Any, seconds: float) -> None:
        record = cache.add_nb_to_project(
            str(chapter), read_data={"type": "plugin", "name": "myst_nb_md"})
        cache.cache_notebook_bundle(
            CacheBundleIn(nb, record.uri, data={"execution_seconds": seconds}),
            check_validity=False, overwrite=True)

    def folder(chapter: Path) -> Path | None:
        if census is None:
            return None
        path = census / chapter.stem
        shutil.rmtree(path, ignore_errors=True)  # what an earlier run journalled here
        path.mkdir(parents=True)
        return path

    failed: list[str] = []
    start = time.perf_counter()
    keys: dict[Path, str] = {}
    waiting: list[Path] = []
    for chapter in longest_first(chapters):
        nb = read_chapter(chapter, settings["extensions"])
        # The package's files the chapter imports (kept.imported_files), the book's data.
        cells = [c.source for c in nb.cells if c.cell_type == "code"]
        keys[chapter] = memo_key(nb, settings, kept.files_digest(root, kept.inputs(root, cells)))
        record = None if fresh else kept.recall("chapters", chapter.stem, keys[chapter])
        if record is None:
            waiting.append(chapter)
            continue
        store(chapter, nbformat.from_dict(record["notebook"]), record["seconds"])
        journalled = folder(chapter)
        if journalled is not None:
            (journalled / "kept.jsonl").write_text(
                "".join(line + "\n" for line in record["census"]), encoding="utf-8")
            (journalled / RUNS_JOURNAL).write_text(
                "".join(line + "\n" for line in record["runs"]), encoding="utf-8")
        print(f"{chapter.relative_to(root)}: kept from an execution with the same inputs "
              f"({record['seconds']:.1f} s)", flush=True)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures: dict[Future[Any], tuple[Path, Path | None]] = {}
        while waiting or futures:
            while len(futures) < jobs:
                chapter = next_chapter(waiting, [c for c, _ in futures.values()])
                if chapter is None:
                    break
                waiting.remove(chapter)
                journalled = folder(chapter)
                futures[pool.submit(execute, chapter, settings, journalled)] = (
                    chapter, journalled)
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                chapter, journalled = futures.pop(future)
                name = chapter.relative_to(root)
                nb, seconds, error = future.result()
                if error is not None:
                    failed.append(str(name))
                    print(f"{name}: FAILED after {seconds:.1f} s\n{error}", flush=True)
                    continue
                store(chapter, nb, seconds)
                kept.keep("chapters", chapter.stem, keys[chapter], {
                    "seconds": seconds, "notebook": nb,
                    "census": [] if journalled is None else journal(journalled),
                    "runs": [] if journalled is None else runs_used(journalled)})
                print(f"{name}: executed in {seconds:.1f} s", flush=True)
    print(f"{len(chapters)} chapters in {time.perf_counter() - start:.1f} s "
          f"({jobs} at a time)", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
