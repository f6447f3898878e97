"""The same bits on an Intel CPU as on an AMD one, proven under `qemu-user`'s emulated CPUs.

`qemu-x86_64 -cpu MODEL` runs the project's venv as that CPU would: its instruction set and
its CPUID, which is what MKL reads to choose its code paths. `tools/same_bits.py` takes one
optimiser step of each kind of training set-up runs (the book recipe, the modern recipe with
Muon, SFT, DPO, GRPO, rejection sampling) and, with the cached book model's weights, a
greedy sample and one forward pass's attention weights; it runs here natively, as an Intel
CPU (Haswell) and as an AMD one (EPYC), and the three must print the same sha256s. Without
MKL's strict reproducible mode (`MKL_CBWR=AVX2`, no `,STRICT`), the emulated Intel CPU
computes other gradients: the last test shows that the first ones can fail. Emulation is
some 60 times slower than the CPU, and more for Python code (importing PyTorch and what its
optimisers import takes most of it): the runs are one step of two sequences each, about a
minute of one core per emulated CPU.

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
TRAINING_KINDS = ("book", "modern", "sft", "dpo", "rhymes sft", "grpo", "rft", "copier")


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
    for kind in TRAINING_KINDS:
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


def test_without_the_strict_mode_an_intel_cpu_computes_other_gradients() -> None:
    # MKL's conditional-numerical-reproducibility branch alone (AVX2) still lets it choose
    # its code path by the CPU's maker: the pin needs ",STRICT". One forward and backward
    # pass of the book model shows it (an emulated Intel CPU's gradients differ from the
    # native AMD ones): what the tests above would catch if the package's pin lost it.
    assert minigpt.PINNED_CPU_KERNELS["MKL_CBWR"] == "AVX2,STRICT"
    native, intel = (_run(cpu, "--only", "gradients", MKL_CBWR="AVX2") for cpu in (None, "Haswell"))
    assert intel["book gradients"] != native["book gradients"]
