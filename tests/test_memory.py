"""Importing minigpt keeps freed memory for the next step (`minigpt.keep_freed_memory`).

A training step frees and allocates the same megabyte-sized tensors again and again. Left to
its defaults, glibc's malloc hands some of them back to the system and maps them afresh, and
the kernel then faults in and zeroes every page on its first write. With the package's
settings a step reuses what the last one freed: no fresh pages.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

import minigpt

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
pytestmark = pytest.mark.skipif(not GLIBC, reason="sets glibc's malloc, which this platform "
                                "does not use: the package leaves its malloc as it is")

#: The page faults of three forward and backward passes of the modern recipe's model at its
#: training batch (48 x 64 tokens; its MLP's activations are 6 MiB a tensor), after five
#: that warm up, in a fresh process that imports minigpt.
FAULTS_OF_A_STEP = """
import resource
import torch
from minigpt.config import GPTConfig
from minigpt.model import GPT
torch.set_num_threads(1)
torch.manual_seed(0)
model = GPT(GPTConfig.modern(65))
x = torch.randint(65, (48, 64))
def step():
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_a_step(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in minigpt.MALLOC_SETTINGS} | env
    return int(subprocess.run([sys.executable, "-c", FAULTS_OF_A_STEP], env=clean, check=True,
                              capture_output=True, text=True).stdout)


def test_importing_minigpt_sets_glibcs_malloc() -> None:
    assert minigpt.keep_freed_memory()


def test_a_training_step_reuses_the_memory_the_last_one_freed() -> None:
    kept = _faults_of_a_step()
    # The environment wins: glibc's initial threshold (128 KiB), fixed, maps every large
    # tensor afresh, and its pages fault in on every pass. This measures what the package's
    # settings remove: about 370,000 faults in the three passes here. With the settings most
    # processes fault in no page at all, and a few (where the heap still grows once) about
    # 1,150 (19 processes: at most 1,153); glibc's defaults, 18,525 to 36,672 (6 processes).
    mapped = _faults_of_a_step(MALLOC_MMAP_THRESHOLD_="131072")
    assert kept < 3_000 < 30_000 < mapped, (kept, mapped)
