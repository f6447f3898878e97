"""minigpt.checkpoint: written atomically and durably, without a second copy in memory, and
read safely, refusing a damaged file (and only a damaged file) with the reason."""

from __future__ import annotations

import os
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from minigpt import checkpoint, files
from minigpt.checkpoint import load_checkpoint, save_checkpoint


def _payload() -> dict[str, Any]:
    return {"model": {"w": torch.arange(1 << 18, dtype=torch.float32)}, "optimizer": {},
            "model_config": {}, "train_config": {}, "step": 3, "rng": {}, "history": {},
            "tokenizer": None}


def test_a_checkpoint_round_trips(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c.pt", _payload())
    ckpt = load_checkpoint(tmp_path / "c.pt")
    assert torch.equal(ckpt["model"]["w"], _payload()["model"]["w"]) and ckpt["step"] == 3
    assert ckpt["world_size"] == 1 and [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_saving_streams_to_the_file_and_syncs_the_folder_after_the_rename(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    payload = _payload()  # 1 MiB of weights
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path / "c.pt", payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024  # serialised into memory first, it would be 2 MiB and more
    assert events == ["fsync file", "rename", "fsync folder"]
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 3


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_file(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "c.pt", _payload())
    with pytest.raises(Exception, match="pickle|lambda"):
        save_checkpoint(tmp_path / "c.pt", _payload() | {"rng": {"f": lambda: 0}})
    assert load_checkpoint(tmp_path / "c.pt")["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_file_is_refused_with_the_reason(tmp_path: Path, damage: str) -> None:
    save_checkpoint(tmp_path / "c.pt", _payload())
    data = (tmp_path / "c.pt").read_bytes()
    damaged = {"truncate": data[: len(data) // 2], "garbage": b"not a checkpoint",
               "empty": b""}[damage]
    (tmp_path / "c.pt").write_bytes(damaged)
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        load_checkpoint(tmp_path / "c.pt")


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"),
                                   OSError(5, "Input/output error"), MemoryError()])
def test_what_is_not_about_the_file_is_not_called_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    save_checkpoint(tmp_path / "c.pt", _payload())

    def failing_load(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(checkpoint.torch, "load", failing_load)
    with pytest.raises(type(error)):
        load_checkpoint(tmp_path / "c.pt")


def test_atomic_file_is_what_both_writers_use() -> None:
    assert checkpoint.atomic_file is files.atomic_file


def test_a_failure_before_the_first_byte_closes_the_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refuse)  # setting the mode, by name or by descriptor
    monkeypatch.setattr(os, "fchmod", refuse)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PermissionError):
        files.atomic_write(tmp_path / "c.txt", b"x")
    assert set(os.listdir("/proc/self/fd")) <= before  # no descriptor left open
    assert list(tmp_path.iterdir()) == []
