"""nbval set-up for the stored chapter notebooks in this folder.

nbval starts each notebook's kernel in the notebook's own folder
(tests/notebooks/); the book build runs a chapter with its own folder (book/)
as working directory. So that a chapter sees the same files under nbval as in
the build, the kernel changes into the chapter's folder, recorded by
`make baseline` in the notebook's metadata, before the first cell runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from nbval.plugin import IPyNbFile

ROOT = Path(__file__).resolve().parents[2]
METADATA_KEY = "minigpt_book"  # as in tools/baseline.py
# Same set iteration order as in the build and in `make baseline`.
os.environ["PYTHONHASHSEED"] = "0"

_nbval_setup = IPyNbFile.setup


def _setup_in_chapter_folder(self: IPyNbFile) -> None:
    _nbval_setup(self)
    chapter = self.nb.metadata.get(METADATA_KEY, {}).get("chapter")
    if chapter is None:
        raise RuntimeError(
            f"{self.fspath}: no '{METADATA_KEY}.chapter' in the notebook's metadata; "
            "stored notebooks are written by `make baseline`, not by hand"
        )
    folder = (ROOT / chapter).parent
    # Silent: no output, no execution count, nothing the cells' comparison sees.
    msg_id = self.kernel.kc.execute(
        f"__import__('os').chdir({str(folder)!r})", silent=True, store_history=False
    )
    while True:
        reply = self.kernel.kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{self.fspath}: could not change the kernel's folder to {folder}")
    self.kernel.await_idle(msg_id, 60)


IPyNbFile.setup = _setup_in_chapter_folder
