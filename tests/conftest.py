"""Fixtures shared by the package tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's tensors on one thread.

    Tensors this small gain nothing from intra-op threads, and on a busy machine idle
    OpenMP workers waiting for a core make each step many times slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
