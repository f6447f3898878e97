"""The playground's export (`minigpt.recipes.export`) into a folder, kept between builds
(`make book`).

    .venv/bin/python tools/playground.py OUT [--fresh]

The export of the cached book, modern and assistant models to ONNX, each checked with
onnxruntime against the package, is kept in the cache (`tools/kept.py`) under a key over the
package's code, the stored models' hashes, the installed distributions, Python, the machine
and the steering environment; with the same key the kept export is copied to OUT, otherwise
(or with ``--fresh``) the models are exported afresh and the export kept. OUT must not exist.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kept  # noqa: E402  (tools/kept.py: what is kept between builds, and its keys)

from minigpt.recipes import export  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--fresh", action="store_true",
                        help="export afresh even if an export with the same inputs is kept")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists: remove it first (the export fills a new folder)")
    key = kept.key({"files": kept.files_digest(),
                    "tool": Path(__file__).read_text(encoding="utf-8")})
    if not args.fresh and kept.recall_folder("playground", key, args.out):
        print(f"playground: kept from an export with the same inputs, copied to {args.out}")
        return 0
    status = export.main([str(args.out)])
    if status == 0:
        kept.keep_folder("playground", key, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
