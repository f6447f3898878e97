"""Publish the book's models beside its site: every model set-up trained, named by its hash.

    .venv/bin/python tools/publish.py _build/html/models

Each model of `minigpt.recipes.catalogue.MODELS` is loaded from the cache set-up filled (and
verified), compared with what `tests/notebooks/models.json` holds for it, and copied into
the folder (`minigpt.recipes.published.publish`): ``<weights sha256>.safetensors``,
``<record sha256>.json`` and an ``index.json`` of them all. A model that is not the one
`models.json` holds is not published: the command says which and fails, so a site never
serves models its chapters were not made with (``--unless-stale``: nor fails). `make book`
runs it, so the site the workflow publishes carries its models; a reader's set-up then
fetches from there (`minigpt.recipes.published`). Files are hard links into the cache where it can
(no second copy), else copies. The chapters' kept runs (`minigpt.recipes.runs`) listed in
`tests/notebooks/runs.json` are published the same way, with a ``runs.json`` of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minigpt.files import MANIFEST_NAME
from minigpt.recipes import published
from minigpt.recipes.catalogue import MODELS
from minigpt.recipes.pretrained import plural
from minigpt.recipes.runs import run_folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the published models")
    parser.add_argument("--unless-stale", action="store_true",
                        help="if a cached model is not the one models.json holds (the code "
                             "that trains it changed), say so and publish nothing, without "
                             "failing (make book)")
    args = parser.parse_args(argv)
    if args.folder.exists() and not args.folder.is_dir():
        parser.error(f"{args.folder} is a file, not a folder")
    stored = published.index()
    if sorted(stored) != sorted(MODELS):
        parser.error(f"{published.INDEX} does not list the book's models: `make baseline` "
                     "writes it from set-up's cache")
    folders = {name: load()[2].path for name, load in MODELS.items()}
    index = {name: published.entry(folder) for name, folder in folders.items()}
    differ = [name for name in index if index[name] != stored[name]]
    if differ:  # checked before anything is written: a stale cache publishes nothing
        print(f"models not published: {', '.join(differ)} differ from "
              f"{published.INDEX.relative_to(published.ROOT)} (the cache holds other models "
              "than the chapters were made with)", file=sys.stderr)
        return 0 if args.unless_stale else 1
    runs = published.runs_index()
    kept = {key: run_folder(key) for key in runs}
    stale = [key for key, folder in kept.items() if not (folder / MANIFEST_NAME).is_file()
             or {"chapter": runs[key]["chapter"], **published.entry(folder)} != runs[key]]
    if stale:  # the chapters' runs of the cache are not those of the stored outputs
        print(f"{plural(len(stale), 'kept run')} not published: missing from the cache or "
              f"not the one {published.RUNS.relative_to(published.ROOT)} holds (build the book "
              "first: its chapters keep their runs)", file=sys.stderr)
        return 0 if args.unless_stale else 1
    for name, folder in folders.items():
        published.publish(folder, args.folder, index[name])
    for key, folder in kept.items():
        published.publish(folder, args.folder, runs[key])
    (args.folder / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n",
                                            encoding="utf-8")
    (args.folder / "runs.json").write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n",
                                           encoding="utf-8")
    size = sum(e["weights_bytes"] for e in index.values())
    run_size = sum(e["weights_bytes"] for e in runs.values())
    print(f"{len(index)} models ({size / 1e6:.1f} MB) and {plural(len(runs), 'kept run')} "
          f"({run_size / 1e6:.1f} MB) published in {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
