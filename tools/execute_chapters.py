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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402  (tools/baseline.py: the chapter list and the hash seed)

ROOT = baseline.ROOT
CONFIG = ROOT / "_config.yml"
# Seconds each chapter took in a fresh `make test` on a 2-core AMD EPYC, two at a time
# (the build's "executed in" lines; a chapter not listed goes last).
MEASURED_SECONDS = {"experiments": 186, "modern_gpt": 96, "assistant": 92, "training": 76,
                    "sampling": 27, "implementation": 20, "tokenisation": 17,
                    "attention_heatmaps": 16, "positional_encodings": 7, "concept": 6,
                    "notations": 5, "intro": 5}
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


def execute(chapter: Path, settings: dict[str, Any]) -> tuple[Any, float, str | None]:
    """(executed notebook, seconds, error text or None): run in a worker process."""
    from jupyter_cache.executors.utils import single_nb_execution

    os.environ["PYTHONHASHSEED"] = baseline.HASH_SEED  # inherited by the kernel
    nb = read_chapter(chapter, settings["extensions"])
    result = single_nb_execution(nb, cwd=str(chapter.parent), timeout=settings["timeout"],
                                 allow_errors=settings["allow_errors"], meta_override=True)
    error = None if result.err is None else (result.exc_string or repr(result.err))
    return nb, result.time, error


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
    settings = book_settings()

    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(settings["cache"])
    failed: list[str] = []
    start = time.perf_counter()
    waiting = longest_first(chapters)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures: dict[Future[Any], Path] = {}
        while waiting or futures:
            while len(futures) < args.jobs:
                chapter = next_chapter(waiting, list(futures.values()))
                if chapter is None:
                    break
                waiting.remove(chapter)
                futures[pool.submit(execute, chapter, settings)] = chapter
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for future in done:
                chapter = futures.pop(future)
                name = chapter.relative_to(ROOT)
                nb, seconds, error = future.result()
                if error is not None:
                    failed.append(str(name))
                    print(f"{name}: FAILED after {seconds:.1f} s\n{error}", flush=True)
                    continue
                record = cache.add_nb_to_project(
                    str(chapter), read_data={"type": "plugin", "name": "myst_nb_md"})
                cache.cache_notebook_bundle(
                    CacheBundleIn(nb, record.uri, data={"execution_seconds": seconds}),
                    check_validity=False, overwrite=True)
                print(f"{name}: executed in {seconds:.1f} s", flush=True)
    print(f"{len(chapters)} chapters in {time.perf_counter() - start:.1f} s "
          f"({args.jobs} at a time)", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
