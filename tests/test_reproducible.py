"""Seeded runs train the same bits on every x86-64 CPU: the kernels are pinned.

PyTorch picks its CPU kernels by the widest instructions the CPU has, and AVX-512 kernels
sum in another order than AVX2 ones. Importing minigpt pins them (`PINNED_CPU_KERNELS`), the
Makefile exports the same values, and the models set-up trains are compared with the sha256
stored beside the chapters' outputs (`tests/notebooks/models.json`, written by
`make baseline`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, load_baseline_tool

import minigpt
from minigpt.recipes import catalogue, pretrained

KERNEL_VARIABLES = sorted(minigpt.PINNED_CPU_KERNELS)
LINUX_X86_64 = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _capability(code: str, **env: str) -> str:
    """The ATen kernel set a fresh Python runs after ``code``, with none of the pinning
    variables in its environment but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES} | env
    script = f"{code}\nimport torch\nprint(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", script], env=clean, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_makefile_exports_the_kernels_the_package_pins() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    exported = dict(re.findall(r"^export (\w+) \?= (\S+)$", makefile, flags=re.MULTILINE))
    assert exported == minigpt.PINNED_CPU_KERNELS


def test_importing_minigpt_pins_the_kernels_before_torch_runs_anything() -> None:
    native = _capability("")
    pinned = _capability("import minigpt")
    # At most AVX2 where the CPU has more; a CPU with less (or another architecture) keeps
    # what it has.
    assert pinned == ("AVX2" if native in ("AVX2", "AVX512") else native)
    # Read at the first operation, not at `import torch`: importing torch first is fine.
    assert _capability("import torch\nimport minigpt") == pinned


def test_a_kernel_setting_in_the_environment_wins() -> None:
    assert _capability("import minigpt", ATEN_CPU_CAPABILITY="default") == "DEFAULT"


def test_the_cache_key_records_the_kernels() -> None:
    material = pretrained.key_material(pretrained.DRAFT_RECIPE, "to be or not to be")
    assert material["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert material["torch"] == torch.__version__
    # MKL's mode too: without ",STRICT" an Intel CPU trains other bits (test_same_bits.py).
    # The setting in force: the package's pin, or a value the environment gave first (the
    # README's override for speed).
    assert material["kernel_settings"] == {"MKL_CBWR": os.environ["MKL_CBWR"],
                                           "ONEDNN_MAX_CPU_ISA": os.environ["ONEDNN_MAX_CPU_ISA"]}
    # and how the products were summed (minigpt.products; the README's override: native).
    native = os.environ.get("MINIGPT_PRODUCTS") == "native"
    assert material["products"] == ("native" if native else "fma chains")


def _mkl_recorded(code: str, **env: str) -> str:
    """What a fresh Python's cache key records of MKL's mode after ``code``, with none of
    the pinning variables in its environment but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_VARIABLES} | env
    script = (f"{code}\nfrom minigpt.recipes import pretrained\n"
              "print(pretrained.environment()['kernel_settings']['MKL_CBWR'])")
    return subprocess.run([sys.executable, "-c", script], env=clean, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not LINUX_X86_64 or not torch.backends.mkl.is_available(),
                    reason="MKL's mode is read from PyTorch's Linux x86-64 build")
def test_the_cache_key_records_the_mode_mkl_runs_not_the_variable() -> None:
    assert _mkl_recorded("import minigpt") == "AVX2,STRICT"
    assert _mkl_recorded("import minigpt", MKL_CBWR="AUTO") == "AUTO"
    # A matrix product before minigpt sets the variable: MKL has read none and runs
    # without a reproducible branch, whatever the environment says afterwards.
    early = "import torch\ntorch.ones(64, 64) @ torch.ones(64, 64)\nimport minigpt"
    assert _mkl_recorded(early) == "mkl 0x1"


@pytest.mark.skipif(not LINUX_X86_64, reason="the stored sha256 are those of PyTorch's Linux "
                    "x86-64 build; elsewhere the weights agree only to float precision")
def test_set_up_trained_the_stored_models_bit_for_bit() -> None:
    # Every model the chapters load (trained by set-up, loaded and verified here) is the one
    # the stored outputs were made with, whichever x86-64 CPU this is: the same key, the
    # same weights (sha256 and size) and the same record (losses, evaluations, census).
    stored = json.loads((ROOT / "tests/notebooks/models.json").read_text(encoding="utf-8"))
    assert sorted(stored) == sorted(catalogue.MODELS)
    made = load_baseline_tool().model_hashes()
    for name in sorted(stored):
        assert made[name] == stored[name], f"{name}: set-up made another model"


@pytest.mark.book
@pytest.mark.skipif(not LINUX_X86_64, reason="the stored sha256 are those of PyTorch's Linux "
                    "x86-64 build; elsewhere the weights agree only to float precision")
def test_the_chapters_used_the_stored_runs_bit_for_bit() -> None:
    # Every kept run of a sweep the build's chapters used (trained by them, loaded from the
    # cache or fetched) is the one stored beside their outputs: the same chapter, key,
    # weights and record. After `make reproduce` (an empty cache) each was trained here.
    stored = json.loads((ROOT / "tests/notebooks/runs.json").read_text(encoding="utf-8"))
    made = load_baseline_tool().run_hashes()
    assert sorted(made) == sorted(stored)
    for key in sorted(stored):
        assert made[key] == stored[key], f"{stored[key]['chapter']}: run {key[:12]} differs"
