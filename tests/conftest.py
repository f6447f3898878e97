"""Fixtures shared by the package tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

from minigpt.bpe import train_bpe
from minigpt.data import shakespeare_text
from minigpt.tokenizer import BPETokenizer

# Property tests: a quick look by default (the edit-test loop), a thorough search under
# `make test` and in CI. HYPOTHESIS_PROFILE=thorough (or CI=true) selects the second.
settings.register_profile("quick", max_examples=20, deadline=None)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE",
                                     "thorough" if os.environ.get("CI") else "quick"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` run where PyTorch sees a GPU; elsewhere each is reported as
    skipped, with the reason, in pytest's summary (-ra): never a silent pass."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, and this machine has none: run "
                                   "`.venv/bin/python -m pytest -m cuda` on one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def macbeth() -> str:
    """One play's text: what the tokenizer tests train and encode."""
    return shakespeare_text(["macbeth"])


@pytest.fixture(scope="session")
def bpe(macbeth: str) -> BPETokenizer:
    """A byte-level BPE of 512 tokens learned on `macbeth`."""
    return train_bpe(macbeth, 512)
