"""The same bits on an Intel CPU as on an AMD one, proven under `qemu-user`'s emulated CPUs.

`qemu-x86_64 -cpu MODEL` runs the project's venv as that CPU would: its instruction set and
its CPUID, which is what MKL reads to choose its code paths. `tools/same_bits.py` takes one
optimiser step of each kind of training set-up runs (the book recipe, its draft, the modern
recipe with Muon, SFT, DPO, the rewards chapter's supervised, GRPO and rejection-sampling
steps, a copier) and, with the cached book model's weights, a greedy sample and one forward
pass's attention weights; it runs here natively, as an Intel CPU (Haswell) and as an AMD one
(EPYC), and every kind it trains must give the same sha256 on the three. MKL's own product of
inner dimension 256, which the two makers' CPUs sum in different orders, shows that the
comparison can fail; it compares the two emulated CPUs, so that the tests hold on an Intel
host as on an AMD one. Emulation is some 60 times slower than the CPU, and more for Python
code (importing PyTorch and what its optimisers import takes most of it): the runs are one
step of two sequences each, about a minute of one core per emulated CPU. They cover the
kinds of step, not every shape the book computes (the README's "What reproduces where").

`make test` installs Debian's `qemu-user` (`make system-deps`); on Linux x86-64 without it
these tests fail and say so. Elsewhere (arm64, macOS, Windows) they do not apply.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT

import minigpt
from minigpt import pretrained

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                       reason="emulates x86-64 CPUs with qemu-user on Linux x86-64; other "
                              "platforms make other bits (the README's 'What reproduces where')"),
]

QEMU = "qemu-x86_64"
#: An Intel CPU and an AMD one, both AVX2 without AVX-512, as qemu-user names them.
CPUS = ("Haswell", "EPYC")
TOOL = ROOT / "tools" / "same_bits.py"
#: The tool's output that is not a trained model's sha256.
NOT_TRAINED = {"cpu kernels", "raw mkl", "greedy sample", "attention sha256",
               "attention[layer 1, head 0, last row, first column]"}


def _qemu() -> str:
    path = shutil.which(QEMU)
    if path is None:
        pytest.fail(f"{QEMU} is not installed: `make system-deps` installs Debian's qemu-user "
                    "(apt-get install qemu-user), which these tests run the venv under")
    return path


def _run(cpu: str | None, *args: str, **env: str) -> dict[str, Any]:
    """tools/same_bits.py's output, natively (cpu None) or under qemu as ``cpu``, in an
    environment without the kernel pins but ``env``: importing minigpt sets them, as in a
    reader's process."""
    clean = {k: v for k, v in os.environ.items() if k not in minigpt.PINNED_CPU_KERNELS} | env
    command = [sys.executable, str(TOOL), *args]
    if cpu is not None:
        command = [_qemu(), "-cpu", cpu, *command]
    done = subprocess.run(command, env=clean, capture_output=True, text=True, timeout=1200)
    # qemu warns of CPUID features its translator lacks (pcid, x2apic...): not an error.
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cached book model's weights, for the chapter-like checks."""
    model, tokenizer, _ = pretrained.book_model()
    path = tmp_path_factory.mktemp("same-bits") / "book.pt"
    torch.save({"config": model.config.model_dump(), "state": model.state_dict(),
                "tokenizer": tokenizer.to_dict()}, path)
    return path


@pytest.fixture(scope="module")
def runs(trained_model: Path) -> dict[str | None, dict[str, Any]]:
    """The tool's output natively and under each emulated CPU, run side by side."""
    _qemu()
    with ThreadPoolExecutor(len(CPUS) + 1) as pool:
        futures = {cpu: pool.submit(_run, cpu, "--model", str(trained_model))
                   for cpu in (None, *CPUS)}
        return {cpu: future.result() for cpu, future in futures.items()}


@pytest.mark.parametrize("cpu", CPUS)
def test_every_kind_of_training_makes_the_same_bits_as_natively(
        runs: dict[str | None, dict[str, Any]], cpu: str) -> None:
    native, emulated = runs[None], runs[cpu]
    assert native["cpu kernels"] == emulated["cpu kernels"] == "AVX2"
    kinds = set(native) - NOT_TRAINED  # every kind the tool trains, the draft included
    assert {"book", "draft", "modern", "sft", "dpo", "rhymes sft", "grpo", "rft",
            "copier"} <= kinds
    for kind in sorted(kinds):
        assert emulated[kind] == native[kind], f"{kind}: {cpu} trained other weights"


@pytest.mark.parametrize("cpu", CPUS)
def test_a_trained_model_samples_and_attends_as_natively(
        runs: dict[str | None, dict[str, Any]], cpu: str) -> None:
    native, emulated = runs[None], runs[cpu]
    chapter = [k for k in native if k.startswith(("greedy", "attention"))]
    assert len(chapter) == 3
    assert len(native["greedy sample"]) == 60
    for key in chapter:
        assert emulated[key] == native[key], key


def test_the_two_emulated_cpus_can_be_told_apart(
        runs: dict[str | None, dict[str, Any]]) -> None:
    # MKL's own product of inner dimension 256 differs between the emulated Intel and AMD
    # CPUs (64 and 192 agree): the comparisons above would see a part of MKL's that sums by
    # the CPU's maker. Emulated against emulated, so it holds on either maker's host.
    intel, amd = (json.loads(runs[cpu]["raw mkl"]) for cpu in CPUS)
    assert intel["64"] == amd["64"] and intel["192"] == amd["192"]
    assert intel["256"] != amd["256"]
