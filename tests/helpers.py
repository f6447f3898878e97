"""Small helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py (the tools folder is not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (a dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def load_baseline_tool() -> ModuleType:
    """Import tools/baseline.py as a module."""
    return load_tool("baseline")


class SeedRecorder:
    """Records every seed given to torch's global generator and to new CPU generators
    (``torch.Generator().manual_seed(s)``) while it is installed (`record_seeds`)."""

    def __init__(self) -> None:
        self.seeds: list[int] = []

    def take(self) -> set[int]:
        """The seeds recorded since the last call, as a set; forgets them."""
        taken, self.seeds = set(self.seeds), []
        return taken


def record_seeds(monkeypatch: Any) -> SeedRecorder:
    """Install a `SeedRecorder` for the rest of the test (``monkeypatch``: pytest's)."""
    recorder, real_manual_seed = SeedRecorder(), torch.manual_seed

    class Generator(torch.Generator):
        def manual_seed(self, seed: int) -> torch.Generator:  # type: ignore[override]
            recorder.seeds.append(int(seed))
            return super().manual_seed(seed)

    def manual_seed(seed: int) -> torch.Generator:
        recorder.seeds.append(int(seed))
        return real_manual_seed(seed)

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch, "manual_seed", manual_seed)
    return recorder
