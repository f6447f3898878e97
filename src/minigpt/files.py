"""The package's file helpers: where its cache lives, hashing, and writing a file whole.

Set-up's assets (`minigpt.assets`), the cached models (`minigpt.recipes.pretrained`), checkpoints
(`minigpt.checkpoint`) and the data cache (`minigpt.data`) all write through `atomic_file`,
so a reader never sees half a file and an interrupted run never leaves one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

#: The two files of a cached model's folder: its weights (safetensors) and its record.
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "manifest.json"


def cache_dir() -> Path:
    """The cache root: `$MINIGPT_CACHE` if set, else `~/.cache/minigpt` (created on demand)."""
    root = os.environ.get("MINIGPT_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "minigpt"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: the bytes go to a temporary file in the same
    folder, reach the disk, and replace ``path`` in one rename (whose folder entry is synced
    too), so readers never see half a file and a crash never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # owns the descriptor from here: closed on any error
            # mkstemp makes the file private (0600); give it the mode any new file would get.
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)
