"""Small helpers shared by several test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_baseline_tool() -> ModuleType:
    """Import tools/baseline.py (not a package) as a module."""
    spec = importlib.util.spec_from_file_location("baseline", ROOT / "tools" / "baseline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
