"""Small helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str) -> ModuleType:
    """Import tools/<name>.py (the tools folder is not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_baseline_tool() -> ModuleType:
    """Import tools/baseline.py as a module."""
    return load_tool("baseline")
