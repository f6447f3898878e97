"""The census of the matrix products the book computes, for the same-bits proof.

Two parts, each a sorted list of distinct products (`minigpt.products.census`: kind, each
operand's shape and strides, dtype, threads, alpha and beta):
- ``set-up``: what training every cached model computed, as each model's manifest records it
  (the products of a model trained inside another's training, as a fine-tuning trains its
  base, are in both);
- ``chapters``: what the chapters computed when the build executed them (`make book` sets
  ``MINIGPT_CENSUS=_build/census``, where each process journals what it computes).

    .venv/bin/python tools/census.py            # write tests/notebooks/products.json
    .venv/bin/python tools/census.py --check    # exit 1 if it differs from what ran

after `make book` (which trains or loads every model and executes every chapter).
`tests/test_same_bits.py` replays the file under emulated Intel and AMD CPUs and checks that
it is current.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402  (tools/baseline.py: the repository's root)

from minigpt.recipes import catalogue  # noqa: E402

ROOT = baseline.ROOT
STORED = ROOT / "tests" / "notebooks" / "products.json"
BUILD = ROOT / "_build" / "census"


def gather(build: Path = BUILD) -> dict[str, list[Any]]:
    """The census of every cached model (each loaded, so trained if missing) and of the
    chapters' execution recorded under ``build``."""
    setup: list[Any] = []
    for name, load in catalogue.MODELS.items():
        manifest = load()[-1].manifest
        if "products" not in manifest:
            raise SystemExit(f"{name}: its manifest has no census of products; retrain it")
        setup += manifest["products"]
    files = sorted(build.rglob("*.jsonl"))  # a folder a chapter
    if not files:
        raise SystemExit(f"no census of the chapters in {build}: run `make book` first")
    chapters = [json.loads(line) for path in files
                for line in path.read_text(encoding="utf-8").splitlines()]
    return {"set-up": _distinct(setup), "chapters": _distinct(chapters)}


def _distinct(entries: list[Any]) -> list[Any]:
    """The entries without repeats, sorted by their JSON."""
    return [json.loads(e) for e in sorted({json.dumps(e) for e in entries})]


def text(census: dict[str, list[Any]]) -> str:
    """The file's text: one entry a line, so that a diff shows which products changed."""
    parts = []
    for name, entries in census.items():
        lines = ",\n  ".join(json.dumps(e, separators=(",", ":")) for e in entries)
        parts.append(f'"{name}": [\n  {lines}\n]')
    return "{" + ",\n".join(parts) + "}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"compare with {STORED.relative_to(ROOT)} instead of writing it")
    args = parser.parse_args(argv)
    fresh = text(gather())
    if args.check:
        stale = STORED.read_text(encoding="utf-8") != fresh
        print(f"{STORED.relative_to(ROOT)} is {'stale' if stale else 'current'}")
        return int(stale)
    STORED.write_text(fresh, encoding="utf-8")
    census = json.loads(fresh)
    print(f"wrote {STORED.relative_to(ROOT)}: "
          + ", ".join(f"{len(v)} {k} products" for k, v in census.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
