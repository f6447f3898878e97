"""The matrix-product core src/minigpt/gemm.h: every path computes every entry in the one
order that file states, bit for bit, on the shapes the book computes.

The checker tests/gemm/check.cpp is compiled with g++ (and, for the aarch64 test, with
aarch64-linux-gnu-g++ and run under qemu-aarch64; both builds are kept in the cache under
the hash of their sources, flags and compiler, `Build`); it makes each product's inputs from
the product's line alone, so two builds on two machines see the same inputs.

The shapes are the census's (tests/notebooks/products.json, "set-up" and "chapters": every
product the book computes), reduced so that the whole module runs in well under a minute on a
busy two-core machine:

- a bmm is its per-batch product (each batch is a product of its own, in the same order);
- each operand's strides become its layout: contiguous rows (n), a transposed view (t), rows
  or columns padded past the shape (p, q: the checker pads by 3), rows of stride 0 (z); the
  bias is a row vector broadcast over rows (the census has no other);
- the products that then have the same dtype, N, K, layouts, bias, alpha and beta are one
  entry: every K the book uses (the length of an entry's chain, which decides its bits) is
  kept, with its layouts, bias and dtype;
- an entry's columns N are kept whole where B has at most WIDE entries; a wider entry (the
  weight gradients, K up to 7,936 tokens by 512 columns: 140 of them alone would cost
  minutes under qemu) keeps 32 + N mod 32 columns, the same last tile in every path (32 is a
  multiple of every tile width), as `cap_cols` says;
- its rows M are the smallest M the census has for it and the largest, each capped by
  `cap_rows`: at most ROWS (not a multiple of any tile height, so the last tile of rows is
  cut short), fewer where N x K is large, down to MIN_ROWS (again cut short).

Rows and columns can be cut because an entry's bits depend on neither (each entry is its own
chain): test_rows_and_rectangles_are_independent checks that on every path.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

from minigpt.files import cache_dir

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "gemm" / "check.cpp"
HEADER = ROOT / "src" / "minigpt" / "gemm.h"
CENSUS = ROOT / "tests" / "notebooks" / "products.json"
#: The flags gemm.h needs: IEEE arithmetic, and no fused epilogue (-ffp-contract=off).
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math", f"-I{ROOT / 'src'}"]
#: The most rows an entry of the reduced census keeps, the fewest a large one is cut to, and
#: the arithmetic one product may cost (multiply-adds) before its rows are cut.
ROWS, MIN_ROWS, BUDGET = 299, 7, 200_000
#: The largest B (K x N entries) kept whole; a larger one keeps K and N mod 32 (module docstring).
WIDE = 50_000

pytestmark = pytest.mark.slow


def layout(shape: list[int], strides: list[int]) -> str:
    """An operand's layout letter (tests/gemm/check.cpp) from its last two dims' strides."""
    rows, cols = shape[-2:]
    row_stride, col_stride = strides[-2:]
    unit_cols = col_stride == 1 or cols == 1
    unit_rows = row_stride == 1 or rows == 1
    if unit_cols and (row_stride == cols or rows == 1):
        return "n"
    if unit_rows and (col_stride == rows or cols == 1):
        return "t"
    if unit_cols and row_stride > cols:
        return "p"
    if unit_rows and col_stride > rows:
        return "q"
    if row_stride == 0 and unit_cols:
        return "z"
    raise AssertionError(f"a census layout the checker has no letter for: {shape} {strides}")


def bias_kind(shape: list[int] | None, strides: list[int] | None, n: int) -> str:
    if shape is None:
        return "none"
    if len(shape) == 1 and shape[0] == n and strides in ([1], [0]):
        return "row"
    raise AssertionError(f"a census bias the checker has no kind for: {shape} {strides}")


def cap_cols(n: int, k: int) -> int:
    """Columns kept of an entry with n columns: all, unless B would have more than WIDE
    entries; then 32 + n % 32, the same last tile on every path (32 is a multiple of every
    tile width: 4, 8, 16, 32)."""
    return n if n * k <= WIDE else min(n, 32 + n % 32)


def cap_rows(m: int, n: int, k: int) -> int:
    """Rows kept of an entry with m rows: at most ROWS, and fewer (not below MIN_ROWS) where
    one product would cost more than BUDGET multiply-adds."""
    return min(m, ROWS, max(MIN_ROWS, BUDGET // max(n * k, 1)))


@cache
def reduced_census() -> tuple[str, ...]:
    """The census as checker lines, one or two per distinct entry (module docstring)."""
    census = json.loads(CENSUS.read_text())
    entries: dict[tuple, set[int]] = {}
    for part in ("set-up", "chapters"):
        for kind, a_shape, a_strides, b_shape, b_strides, bias_shape, bias_strides, dtype, \
                _threads, alpha, beta in census[part]:
            assert kind in ("mm", "bmm"), kind
            m, k = a_shape[-2:]
            n = b_shape[-1]
            key = (dtype, n, k, layout(a_shape, a_strides) + layout(b_shape, b_strides),
                   bias_kind(bias_shape, bias_strides, n), alpha, beta)
            entries.setdefault(key, set()).add(m)
    lines = {}
    for (dtype, n, k, layouts, bias, alpha, beta), rows in sorted(entries.items()):
        n = cap_cols(n, k)
        for m in sorted({cap_rows(min(rows), n, k), cap_rows(max(rows), n, k)}):
            lines[f"{dtype} {m} {n} {k} {layouts} {bias} {alpha} {beta}"] = None
    return tuple(lines)


#: Products beyond the census: alpha and beta other than 1 (the epilogue's roundings), beta 0
#: with a NaN bias, no steps (K = 0), a column and a full bias, C as its own bias (an in-place
#: addmm), every layout (s: neither rows nor columns contiguous), float64.
EXTRA = (
    "float32 7 5 3 tt full 0.7 0.3",
    "float32 29 33 0 nn full 0.5 2",
    "float32 19 47 129 pz col 1 0.25",
    "float32 19 47 129 zp nan 1 0",
    "float32 61 70 513 qn row -2 1",
    "float32 50 100 300 nq full 1 -0.5",
    "float64 31 17 513 tt full -1.5 0.3",
    "float64 13 37 300 pn row 1 1",
    "float64 64 64 257 tq none 0.5 0",
    "float32 1 1 1 nn none 1 1",
    "float32 1 1000 7 tn row 1 1",
    "float32 1000 1 7 nt row 1 1",
    # thin products (at most THIN_ROWS rows, B transposed: read in place), with the last
    # columns and p's that an 8 x 8 block leaves
    "float32 3 13 21 nt row 1 1",
    "float32 2 9 17 tq full 0.5 2",
    "float32 4 40 300 pt row 1 1",
    "float32 1 8 8 nt none 1 1",
    "float32 50 40 300 ss full 1 1",
    "float64 30 20 260 sn row 1 1",
    "float32 37 45 600 nn self 1 1",
    "float32 20 33 17 tn self 0.5 -1",
    "float64 25 19 300 nt self 1 0.5",
)


class Build:
    """A compilation of the checker, started at once and waited for when its binary is
    wanted: the native and the aarch64 builds run side by side. The binary is kept in the
    cache (gemm-check/ under $MINIGPT_CACHE) under the hash of all that makes it (the
    compiler's version, the flags, gemm.h and check.cpp): the next run with the same sources
    takes it from there instead of compiling again."""

    def __init__(self, compiler: str, extra: list[str]) -> None:
        self.compiler, self.process = compiler, None
        found = shutil.which(compiler)
        if found is None:
            self.binary = None
            return
        command = [found, *FLAGS, *extra, str(SOURCE)]
        version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
        digest = hashlib.sha256("\0".join([version, *command]).encode()
                                + HEADER.read_bytes() + SOURCE.read_bytes()).hexdigest()
        self.binary = cache_dir() / "gemm-check" / f"{compiler}-{digest[:20]}"
        if not self.binary.exists():
            self.binary.parent.mkdir(parents=True, exist_ok=True)
            self.partial = self.binary.with_suffix(f".{os.getpid()}.partial")
            self.process = subprocess.Popen([*command, "-o", str(self.partial)],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)

    def wait(self) -> Path:
        if self.binary is None:
            package = ("g++-aarch64-linux-gnu (`make system-deps`)"
                       if "aarch64" in self.compiler else "g++")
            pytest.fail(f"{self.compiler} is not installed: the gemm checker needs it; install "
                        f"Debian's {package}")
        if self.process is not None:
            output, _ = self.process.communicate()
            assert self.process.returncode == 0, f"{self.compiler} failed:\n{output}"
            os.replace(self.partial, self.binary)
            self.process = None
        return self.binary


@pytest.fixture(scope="module")
def builds() -> dict[str, Build]:
    started = {"native": Build("g++", [])}
    if X86:
        started["aarch64"] = Build("aarch64-linux-gnu-g++", ["-static"])
    return started


@pytest.fixture(scope="module")
def checker(builds: dict[str, Build]) -> Path:
    return builds["native"].wait()


def run(binary: Path | list[str], mode: str, path: str, lines: tuple[str, ...]) -> list[str]:
    """The checker's output lines, one per product; a non-zero exit fails with its output."""
    command = [str(binary)] if isinstance(binary, Path) else binary
    done = subprocess.run([*command, mode, path], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=600)
    out = done.stdout.splitlines()
    failed = [line for line in out if " FAIL" in line]
    assert done.returncode == 0 and not failed, (
        f"{mode} {path}: exit {done.returncode}\n" + "\n".join(failed[:10]) + done.stderr)
    assert len(out) == len(lines), (len(out), len(lines), done.stderr)
    return out


def cpu_paths(binary: Path) -> list[str]:
    """The paths this CPU runs, and "avx512-tiles" where AVX2 runs: the AVX-512 path's tile
    shape and blocks run by AVX2 instructions (tests/gemm/check.cpp), which tests all of that
    path but its instructions on a CPU without AVX-512."""
    paths = subprocess.run([str(binary), "paths"], check=True, capture_output=True,
                           text=True).stdout.split()
    return paths + ["avx512-tiles"] * ("avx2" in paths)


X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512", "avx512-tiles"])
def test_path_equals_reference(checker: Path, path: str) -> None:
    """Each path the CPU runs equals the naive loop bit for bit on the reduced census and the
    extra products (an x86 path this CPU lacks fails on x86 CI machines only if it is AVX2)."""
    paths = cpu_paths(checker)
    if path not in paths:
        if path in ("avx2", "avx512-tiles") and X86:
            pytest.fail("this x86-64 CPU has no AVX2 + FMA: the AVX2 path went untested")
        pytest.skip(f"the {path} path cannot run here: this CPU lacks it "
                    f"(__builtin_cpu_supports); it is compiled but NOT tested on this machine")
    lines = reduced_census() + EXTRA
    out = run(checker, "check", path, lines)
    assert all(line.endswith(" ok") for line in out)


def test_reduced_census_keeps_shapes() -> None:
    """The reduction keeps every (dtype, K, layouts, bias) of the census, every N of a B of
    at most WIDE entries, N mod 32 of a larger one, and cuts rows short."""
    census = json.loads(CENSUS.read_text())
    wanted = set()
    for part in ("set-up", "chapters"):
        for _kind, a_shape, a_strides, b_shape, b_strides, bias_shape, bias_strides, dtype, \
                *_ in census[part]:
            n, k = b_shape[-1], a_shape[-1]
            wanted.add((dtype, n if n * k <= WIDE else 32 + n % 32, k,
                        layout(a_shape, a_strides) + layout(b_shape, b_strides),
                        bias_kind(bias_shape, bias_strides, n)))
    lines = [line.split() for line in reduced_census()]
    assert {(d, int(n), int(k), lay, bias) for d, _m, n, k, lay, bias, *_ in lines} == wanted
    rows = {int(m) for _d, m, *_ in lines}
    assert ROWS in rows and MIN_ROWS in rows and max(rows) == ROWS


def sample(lines: tuple[str, ...], count: int) -> tuple[str, ...]:
    """Every len/count-th line: the rectangle and split tests run a spread of the census."""
    step = max(1, len(lines) // count)
    return lines[::step]


@pytest.mark.parametrize("mode", ["rects", "split"])
def test_rows_and_rectangles_are_independent(checker: Path, mode: str) -> None:
    """A row alone, a band, a column range, a rectangle (rects), and C split into 1, 2 and 3
    rectangles for threads (split), each equal the full product's entries, on every path this
    CPU runs; nothing outside a rectangle is written."""
    lines = sample(reduced_census(), 150) + EXTRA
    for path in cpu_paths(checker):
        out = run(checker, mode, path, lines)
        assert all(" ok " in line for line in out)


def test_aarch64_hashes_equal_x86(checker: Path, builds: dict[str, Build]) -> None:
    """The checker cross-compiled for aarch64 (static) and run under qemu-aarch64 prints the
    same hashes, on the reduced census, as this machine's portable path, and on x86-64 as
    each of its vector paths; its portable path equals the reference there too (g++ fuses an
    unfenced epilogue on aarch64, where fma is a baseline instruction)."""
    if not X86:
        pytest.skip("the cross-build test runs on x86-64 hosts")
    arm = builds["aarch64"].wait()
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.fail("qemu-aarch64 is not installed (`make system-deps` installs qemu-user)")
    lines = reduced_census() + EXTRA
    arm_hashes = run([qemu, str(arm)], "hash", "portable", lines)
    for path in cpu_paths(checker):
        assert run(checker, "hash", path, lines) == arm_hashes, path
    run([qemu, str(arm)], "check", "portable", EXTRA)


def test_env_forces_path(checker: Path) -> None:
    """MINIGPT_GEMM_PATH picks the path; an unknown or unsupported one is an error."""
    line = ("float32 13 37 300 nn row 1 1",)
    for path in set(cpu_paths(checker)) - {"avx512-tiles"}:
        env = {**os.environ, "MINIGPT_GEMM_PATH": path}
        done = subprocess.run([str(checker), "check", "env"], input=line[0] + "\n",
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0 and done.stdout.endswith(" ok\n"), done.stderr
    for bad in ("avx1024", "avx512-tiles", *({"avx512", "avx2"} - set(cpu_paths(checker)))):
        env = {**os.environ, "MINIGPT_GEMM_PATH": bad}
        done = subprocess.run([str(checker), "check", "env"], input=line[0] + "\n",
                              capture_output=True, text=True, env=env)
        assert done.returncode == 2 and bad in done.stderr
