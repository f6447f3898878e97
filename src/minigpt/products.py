"""Matrix products that sum in the same order on every x86-64 CPU, Intel or AMD.

A matrix product C = A B sums, for each entry, K products along the inner dimension, and
floating-point addition is not associative: the order of that sum decides the last bits, and
a training run that rounds one product differently trains other weights. PyTorch hands its
products to MKL, and MKL chooses its kernels by the CPU's maker as well as its instructions:
with `MKL_CBWR=AVX2,STRICT` (`minigpt.PINNED_CPU_KERNELS`) every Intel CPU runs MKL's AVX2
kernels, but an AMD CPU runs another branch. Measured under `qemu-x86_64 -cpu Haswell` and
`-cpu EPYC` (docs/reproducibility.md), the two agree on a product only if

- its inner dimension is at most 192 (`BLOCK`): MKL's Intel kernels sum it in blocks of 192,
  adding each block's partial product into C, the AMD branch in other blocks;
- it has at least 4 rows (`MIN_ROWS`) and 12 columns (`MIN_COLS`): thinner products go to
  kernels MKL picks by maker, whatever the inner dimension.

So `install` replaces PyTorch's CPU kernels of every matrix-product operator (`mm`, `addmm`,
`bmm`, `baddbmm`, `mv`, `addmv`, `dot`: what `nn.Linear` and its gradients, `matmul`, `@`,
`einsum`, attention's products and Muon's Newton-Schulz products all come down to) with the
kernels of ``products.cpp``, compiled once per machine (`build`: at set-up, or by the first
process that finds no library, saying so):

- a float32 product of at least `MIN_ROWS` rows and `MIN_COLS` columns goes to MKL in blocks
  of at most `BLOCK` along its inner dimension, added left to right (the bias after the first
  block): MKL's own Intel order, so a product that already agreed keeps its bits;
- a thinner product, and every float64 one, is summed by the extension itself, in an order
  of its own (`thin_order`: eight interleaved partial sums, then a fixed tree), in code built
  without fused multiply-adds: the same IEEE operations on every x86-64 CPU.

PyTorch's fused attention kernel calls MKL without these operators, so on a CPU the package
computes attention with its own products (`minigpt.attention`).

`census` records every distinct product a block of code computes (kind, each operand's shape
and strides, dtype, threads, alpha and beta); `tools/same_bits.py --census` replays a census
natively and under the two emulated CPUs (`tests/test_same_bits.py`); with ``MINIGPT_CENSUS``
set to a folder, every process appends each new product to ``<folder>/<pid>.jsonl`` (the
build records the chapters' census so). Setting
``MINIGPT_PRODUCTS=native`` before importing minigpt leaves PyTorch's kernels alone (faster
on a large model; not the same bits on both makers' CPUs). Elsewhere than Linux x86-64
(arm64, macOS, Windows) the products are PyTorch's own: bits are promised on Linux x86-64.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

#: The longest inner dimension MKL is given: the block MKL's Intel AVX2 kernels sum at a time.
BLOCK = 192
#: The fewest rows and columns of a product MKL is given; thinner ones are summed here.
MIN_ROWS, MIN_COLS = 4, 12
#: The partial sums a thin product's entry is summed in (`thin_order`).
LANES = 8

SOURCE = Path(__file__).with_name("products.cpp")
#: The compiler's flags: the constants above, and no fused multiply-adds (a*b+c rounded once
#: on one CPU and twice on another would part), nor any licence to reorder sums.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", f"-DMINIGPT_BLOCK={BLOCK}",
         f"-DMINIGPT_MIN_ROWS={MIN_ROWS}", f"-DMINIGPT_MIN_COLS={MIN_COLS}",
         f"-DMINIGPT_LANES={LANES}")

#: How long a process waits for another that is compiling the products before it gives up
#: (a compile takes 20-90 s; a process that dies while compiling frees the lock at once).
LOCK_WAIT = 600.0

_loaded: list[Path] = []


def tell(line: str) -> None:
    """A line of what the build does, on stderr (a chapter's output stays its own)."""
    print(line, file=sys.stderr, flush=True)


def applies() -> bool:
    """Whether this platform gets the package's products: Linux on x86-64 with PyTorch's MKL
    build, unless ``MINIGPT_PRODUCTS=native``."""
    choice = os.environ.get("MINIGPT_PRODUCTS", "blocks")
    if choice not in ("blocks", "native"):
        raise ValueError(f"MINIGPT_PRODUCTS={choice!r}: use 'blocks' (the default: the same "
                         "bits on every x86-64 CPU) or 'native' (PyTorch's own products)")
    return (choice == "blocks" and sys.platform == "linux" and platform.machine() == "x86_64"
            and torch.backends.mkl.is_available())  # type: ignore[no-untyped-call]


def build_key() -> str:
    """What the compiled kernels depend on: the source, the flags and PyTorch's version."""
    material = SOURCE.read_bytes() + repr((FLAGS, torch.__version__)).encode()
    return hashlib.sha256(material).hexdigest()[:16]


def library_path() -> Path:
    """Where this machine keeps the compiled products: PyTorch's extensions folder
    (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``), one file a `build_key`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return Path(root) / "minigpt" / f"minigpt_products_{build_key()}.so"


def build(say: Callable[[str], None] = tell) -> Path:
    """The compiled products, compiled first if this machine has not (``say`` tells so, and
    how long it took). Set-up calls it (`make setup`); `install` too, so a process that
    finds no library compiles one, saying so.

    One process compiles at a time, under a lock the operating system frees when its holder
    ends, however it ends: a killed compile leaves no lock to wait on. Another process
    waits for it (saying whose compile it waits for) at most `LOCK_WAIT` seconds. The
    library is written under a temporary name and renamed into place, so no process ever
    loads a half-written one."""
    library = library_path()
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(library.with_suffix(".lock"))
    owner = library.with_suffix(".pid")  # who holds the lock, for the waiting line
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = owner.read_text().strip() if owner.is_file() else "another process"
        say(f"minigpt: waiting for {holder} to compile its matrix products ({library})")
        try:
            lock.acquire(timeout=LOCK_WAIT)
        except Timeout:
            raise RuntimeError(
                f"minigpt: {holder} has been compiling the package's matrix products for "
                f"{LOCK_WAIT:.0f} s and has not finished ({lock.lock_file} is held). Let "
                "it finish or stop it, then try again.") from None
    try:
        if library.is_file():  # the process waited for compiled it
            return library
        owner.write_text(f"process {os.getpid()}\n")
        say("minigpt: compiling its matrix products for this machine (once per PyTorch "
            f"version; about half a minute) into {library.parent}")
        began = time.perf_counter()
        part = library.with_name(f"{library.name}.{os.getpid()}.part")
        try:
            compile_library(part)
            os.replace(part, library)
        finally:
            part.unlink(missing_ok=True)
        say(f"minigpt: compiled its matrix products in {time.perf_counter() - began:.0f} s")
        return library
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def compile_library(out: Path) -> None:
    """Compile ``products.cpp`` with the machine's C++ compiler (``$CXX``, else ``g++``)
    against PyTorch's headers and libraries into ``out``."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "g++")
    command = [compiler, "-shared", "-fPIC", "-std=c++17", *FLAGS,
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               *(f"-I{folder}" for folder in cpp_extension.include_paths()), str(SOURCE),
               "-o", str(out), *(f"-L{folder}" for folder in cpp_extension.library_paths()),
               "-lc10", "-ltorch_cpu", "-ltorch"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        said = f"{compiler} could not be run: {error}"
    else:
        if done.returncode == 0:
            return
        said = f"{compiler} said:\n{done.stderr.strip()[-3000:]}"
    raise RuntimeError(
        "minigpt could not compile its matrix products (minigpt/products.cpp), which make a "
        "seeded run train the same bits on every x86-64 CPU. It needs a C++ compiler: on "
        "Debian, `apt-get install g++` (or name another in $CXX); or set "
        "MINIGPT_PRODUCTS=native to use PyTorch's own products (other bits than the book's "
        f"models). {said}")


def install(say: Callable[[str], None] = tell) -> None:
    """Load the compiled products into PyTorch, once a process (`build` compiles them if
    this machine has not). A library that will not load (a disk error, a copy cut short) is
    compiled again, once; then a clear error. A no-op where `applies` is false."""
    if _loaded or not applies():
        return
    if os.environ.get("MINIGPT_CENSUS"):  # the folder the kernels journal the census into
        Path(os.environ["MINIGPT_CENSUS"]).mkdir(parents=True, exist_ok=True)
    library = build(say)
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError) as error:
        say(f"minigpt: {library} would not load ({error}); compiling it again")
        library.unlink(missing_ok=True)
        library = build(say)
        try:
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        except (OSError, RuntimeError) as again:
            raise RuntimeError(f"minigpt: its matrix products, compiled again into {library}, "
                               f"still will not load: {again}") from None
    torch.ops.minigpt_products.install()
    _loaded.append(library)


def thin_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A B summed as the package sums a thin product, written out with elementwise
    operations (slowly: for the tests and the implementation chapter): entry (i, j) is
    ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))``, where lane s_r adds the terms
    a[i, p] b[p, j] with p = r, r + 8, r + 16, ... left to right, from zero.

    a: (..., M, K); b: (..., K, N). Returns (..., M, N)."""
    lanes = [torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype) for _ in range(LANES)]
    for p in range(a.shape[-1]):
        lanes[p % LANES] = lanes[p % LANES] + a[..., p:p + 1] * b[..., p:p + 1, :]
    s = lanes
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


def computes(tensor: torch.Tensor) -> bool:
    """Whether the package's products compute ``tensor``'s (it is on a CPU, and they are
    installed): then PyTorch's fused attention kernel, which calls MKL itself, is not used."""
    return bool(_loaded) and tensor.device.type == "cpu"


def mode() -> str:
    """What this process's products run: ``"blocks of 192"`` or ``"native"``."""
    return f"blocks of {BLOCK}" if _loaded else "native"


@contextmanager
def census() -> Iterator[list[Any]]:
    """Record every distinct product the block computes; the list is filled when the block
    ends, sorted, one entry a product: [kind ("mm" or "bmm"), a's shape, a's strides, b's
    shape, b's strides, the bias's shape and strides (or None), dtype, torch threads, alpha,
    beta]. Censuses may nest; each records all. Empty where the products are PyTorch's own."""
    entries: list[Any] = []
    if not _loaded:
        yield entries
        return
    handle = torch.ops.minigpt_products.census_open()
    try:
        yield entries
    finally:
        recorded = torch.ops.minigpt_products.census_close(handle)
        entries += sorted((json.loads(line) for line in recorded), key=json.dumps)
