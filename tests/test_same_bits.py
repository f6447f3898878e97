"""The same bits on an Intel CPU as on an AMD one, proven under `qemu-user`'s emulated CPUs.

`qemu-x86_64 -cpu MODEL` runs the project's venv as that CPU would: its instruction set and
its CPUID, which is what MKL reads to choose its code paths. `tools/same_bits.py` runs here
natively, as an Intel CPU (Haswell) and as an AMD one (EPYC), one process each, and every
output but MKL's own products must be the same on the three:

- the census (`tests/notebooks/products.json`): every distinct product set-up's models and
  the chapters compute, through the package's kernels (`minigpt.products`), on seeded
  random operands with the census's strides and every inner term (`tools/same_bits.py`);
- one optimiser step of each kind of training set-up runs (the book recipe, its draft and
  SFT at their recipes' batches, the modern recipe with Muon, DPO, the rewards chapter's
  supervised, GRPO and rejection-sampling steps, a copier), and, with the cached book
  model's weights, a greedy sample and one forward pass's attention weights;
- each kind of random draw a run makes.

MKL's own products (of inner dimension 256 and 299, of two rows, of eight columns), which the
two makers' CPUs sum in different orders, show that the comparison can fail; the test
compares the two emulated CPUs, so that it holds on an Intel host as on an AMD one. The
census is checked to be what the book computes (`tools/census.py`).

Each emulated CPU's output is kept in the cache (`tools/kept.py`) under a key over
everything the emulated run reads (`emulation_key`): the tool, the package's code, the book's
data and stored models' hashes, the census, the model's weights, the installed distributions,
Python, the steering environment and qemu itself. It is emulated again whenever one of them
changes (a comment or docstring is not code); the native run is run every time and compared
with it. An empty cache (`make reproduce`) emulates both CPUs.

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
from helpers import ROOT, load_tool

import minigpt
from minigpt.files import sha256_file
from minigpt.recipes import pretrained

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                       reason="emulates x86-64 CPUs with qemu-user on Linux x86-64; other "
                              "platforms make other bits (docs/reproducibility.md)"),
]

QEMU = "qemu-x86_64"
#: An Intel CPU and an AMD one, both AVX2 without AVX-512, as qemu-user names them.
CPUS = ("Haswell", "EPYC")
TOOL = ROOT / "tools" / "same_bits.py"
CENSUS = ROOT / "tests" / "notebooks" / "products.json"
#: Seconds one emulated run may take (about 60 times the native run, more for Python).
TIMEOUT = 2700
#: tools/kept.py: the emulated runs' outputs are kept in the cache under its keys.
kept = load_tool("kept")
#: The tool's output that is not a trained model's sha256.
NOT_TRAINED = {"cpu kernels", "products", "census", "random", "raw mkl", "greedy sample",
               "attention sha256",
               "attention[layer 1, head 0, last row, first column]"}


def _qemu() -> str:
    path = shutil.which(QEMU)
    if path is None:
        pytest.fail(f"{QEMU} is not installed: `make system-deps` installs Debian's qemu-user "
                    "(apt-get install qemu-user), which these tests run the venv under")
    return path


def _clean(**env: str) -> dict[str, str]:
    """The environment of a run: without the kernel pins (importing minigpt sets them, as in
    a reader's process) but ``env``."""
    return {k: v for k, v in os.environ.items() if k not in minigpt.PINNED_CPU_KERNELS} | env


def emulation_key(cpu: str, model: Path, environ: dict[str, str], files: str) -> str:
    """The key (`tools/kept.py`) of what `tools/same_bits.py` reads when emulated as ``cpu``
    with the weights ``model`` in the environment ``environ``: the tool, the files the
    package's runs read (``files``, `kept.files_digest`), the census, the weights, qemu, and
    what every key reads."""
    return str(kept.key({"cpu": cpu, "tool": sha256_file(TOOL), "files": files,
                         "census": sha256_file(CENSUS), "weights": sha256_file(model),
                         "qemu": sha256_file(Path(_qemu()))}, environ))


def _emulated(cpu: str, model: Path, key: str) -> dict[str, Any]:
    """The tool's output under qemu as ``cpu``: the one kept under ``key``, or a new run's,
    then kept."""
    output = kept.recall("same-bits", cpu, key)
    if output is None:
        output = _run(cpu, "--model", str(model), "--census", str(CENSUS))
        kept.keep("same-bits", cpu, key, output)
    return dict(output)


def _run(cpu: str | None, *args: str, **env: str) -> dict[str, Any]:
    """tools/same_bits.py's output, natively (cpu None) or under qemu as ``cpu``, in the
    environment `_clean` gives with ``env``."""
    clean = _clean(**env)
    command = [sys.executable, str(TOOL), *args]
    if cpu is not None:
        command = [_qemu(), "-cpu", cpu, *command]
    done = subprocess.run(command, env=clean, capture_output=True, text=True, timeout=TIMEOUT)
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
    """The tool's output natively and under each emulated CPU (kept or run), side by side."""
    _qemu()
    # The keys first, in this thread: Python 3.11's parser is not safe to run in two threads
    # at once (kept.files_digest parses the package), and they are the same files anyway:
    # the package's modules the tool imports (kept.imported_files), the book's data.
    files = kept.files_digest(paths=kept.inputs(cells=[TOOL.read_text(encoding="utf-8")]))
    keys = {cpu: emulation_key(cpu, trained_model, _clean(), files) for cpu in CPUS}
    with ThreadPoolExecutor(len(CPUS)) as pool:
        futures = {cpu: pool.submit(_emulated, cpu, trained_model, keys[cpu]) for cpu in CPUS}
        native = _run(None, "--model", str(trained_model), "--census", str(CENSUS))
        return {None: native} | {cpu: future.result() for cpu, future in futures.items()}


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


@pytest.mark.parametrize("cpu", CPUS)
def test_every_product_of_the_census_and_every_random_draw_is_the_same_as_natively(
        runs: dict[str | None, dict[str, Any]], cpu: str) -> None:
    native, emulated = runs[None], runs[cpu]
    assert native["products"] == emulated["products"] == "fma chains"
    census = json.loads(CENSUS.read_text(encoding="utf-8"))
    assert len(census["set-up"]) > 100 and len(census["chapters"]) > 100
    assert len(native["census"]) == len(emulated["census"]) > 100
    differ = [i for i, (a, b) in enumerate(zip(native["census"], emulated["census"],
                                               strict=True)) if a != b]
    if differ:
        calls = load_tool("same_bits").census_calls(CENSUS)
        pytest.fail(f"{cpu} computed other bits for {[calls[i] for i in differ[:10]]}")
    assert emulated["random"] == native["random"]


def test_the_two_emulated_cpus_can_be_told_apart(
        runs: dict[str | None, dict[str, Any]]) -> None:
    # MKL's own products, bypassing minigpt.products: within one block of at least four rows
    # and twelve columns (64 and 192 inner terms) the emulated Intel and AMD CPUs agree; past
    # a block, and for two rows or eight columns, they do not. The comparisons above would
    # see such a difference. Emulated against emulated, so it holds on either maker's host.
    intel, amd = (json.loads(runs[cpu]["raw mkl"]) for cpu in CPUS)
    assert intel["64"] == amd["64"] and intel["192"] == amd["192"]
    for part in ("256", "299", "2 rows", "8 columns"):
        assert intel[part] != amd[part], part


@pytest.mark.book
def test_the_census_is_what_the_book_computes() -> None:
    # What set-up's models (their manifests) and this build's chapters (_build/census)
    # computed is what the stored census holds: `tools/census.py` rewrites it.
    tool = load_tool("census")
    assert tool.text(tool.gather()) == CENSUS.read_text(encoding="utf-8"), (
        "tests/notebooks/products.json is stale: run .venv/bin/python tools/census.py")


def test_an_emulated_run_is_kept_under_what_it_reads(tmp_path: Path) -> None:
    model = tmp_path / "book.pt"
    model.write_bytes(b"weights")
    environ = {"HOME": "/root"}
    key = emulation_key("Haswell", model, environ, "files")
    assert emulation_key("EPYC", model, environ, "files") != key
    assert emulation_key("Haswell", model, {**environ, "TERM": "dumb"}, "files") == key
    for steering in ("MKL_CBWR", "MINIGPT_PRODUCTS", "ATEN_CPU_CAPABILITY"):
        assert emulation_key("Haswell", model, {**environ, steering: "x"}, "files") != key
    assert emulation_key("Haswell", model, environ, "other files") != key
    model.write_bytes(b"other weights")
    assert emulation_key("Haswell", model, environ, "files") != key
