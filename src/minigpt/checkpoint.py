"""Checkpoints: everything a resumed run needs, written atomically and read safely.

Training writes them (`minigpt.train`) and sampling reads them (`minigpt.sample`), so they
live in a module of their own that imports neither.

A checkpoint is one file holding only tensors and plain containers (configurations are
stored as dicts), so that `load_checkpoint` can use ``torch.load(weights_only=True)``,
which executes no code from the file.
"""

from __future__ import annotations

import errno
import pickle
from pathlib import Path
from typing import Any

import torch

from minigpt.files import atomic_file

CHECKPOINT_NAME = "checkpoint.pt"
#: 2 added ``world_size`` and one random state per process; format 1 files read as one process.
CHECKPOINT_FORMAT = 2
READABLE_FORMATS = (1, 2)
#: What torch.load raises for a truncated or corrupted file (found by flipping and cutting
#: bytes of a checkpoint; its zip reader also raises OSError EINVAL); anything else (a failing
#: disk, a permission, memory) is not about the file's content.
DAMAGED = (RuntimeError, ValueError, EOFError, KeyError, IndexError, TypeError)
_ENTRIES = {"format", "model", "optimizer", "model_config", "train_config", "step", "rng",
            "history", "tokenizer"}


def save_checkpoint(path: Path | str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (the entries listed in `_ENTRIES` but ``format``) to ``path``.

    The bytes go to a temporary file in the same folder, are flushed to disk, and replace
    ``path`` in one rename, so a crash mid-write never leaves a torn checkpoint
    (`minigpt.files.atomic_file`).
    """
    assert _ENTRIES - {"format"} <= set(payload), f"missing {_ENTRIES - set(payload)}"
    path = Path(path)
    with atomic_file(path) as f:  # straight to the file: no second copy in memory
        torch.save({"format": CHECKPOINT_FORMAT} | payload, f)
    return path


def load_checkpoint(path: Path | str, *, map_location: str | torch.device = "cpu",
                    ) -> dict[str, Any]:
    """Read a checkpoint (a file, or a directory holding ``checkpoint.pt``).

    Raises FileNotFoundError when it is missing and ValueError with the reason when it is
    truncated, damaged, not a torch file, or not a minigpt checkpoint of a format this
    version reads. A format-1 checkpoint is returned with ``world_size`` 1.
    """
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if torch.device(map_location).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"cannot load {path} onto {map_location!s}: CUDA is not available "
                         "on this machine; load it onto the CPU")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} is not a readable checkpoint: not a torch file, or one "
                         "holding objects that safe (weights_only) loading refuses") from None
    except (*DAMAGED, OSError) as err:
        if isinstance(err, OSError) and err.errno != errno.EINVAL:
            raise  # a disk or permission problem, not the file's content
        # The first sentence says what failed; torch goes on with generic advice.
        reason = str(err).splitlines()[0].split(". ")[0] if str(err) else type(err).__name__
        raise ValueError(f"{path} is not a readable checkpoint (damaged or truncated? "
                         f"{reason})") from None
    if not isinstance(ckpt, dict) or not _ENTRIES <= set(ckpt):
        raise ValueError(f"{path} is not a minigpt checkpoint (missing entries)")
    if ckpt["format"] not in READABLE_FORMATS:
        raise ValueError(f"{path} has checkpoint format {ckpt['format']!r}; this version of "
                         f"minigpt reads formats {', '.join(map(str, READABLE_FORMATS))}")
    ckpt.setdefault("world_size", 1)
    return ckpt
