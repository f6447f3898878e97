"""Single-thread speed of src/minigpt/gemm.h against PyTorch's own products (MKL).

    .venv/bin/python tools/gemm_bench.py [--path avx2] [--rounds 7] [--least 0.2]

Compiles tests/gemm/check.cpp (-O3 -ffp-contract=off) and keeps it running in its `serve`
mode; then, round after round, times each of the book's main products by the checker and by
PyTorch in this process (one thread, MINIGPT_PRODUCTS=native: MKL, as pinned by minigpt's
MKL_CBWR), one after the other, and prints each one's median GFLOP/s over the rounds. Each
timing runs the product for at least --least seconds. The shapes are the largest of
tests/notebooks/products.json: a linear layer's forward pass (X W^T, "nt", with its bias), its
gradients (dY W, "nn"; dY^T X, "tn"), one head of attention (Q K^T and P V: a bmm's
per-batch product; PyTorch runs it as a bmm of BATCH heads and is credited per head), and
decoding's thin products (one row, eight rows).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["MINIGPT_PRODUCTS"] = "native"  # PyTorch's own products, before minigpt loads

import torch  # noqa: E402

import minigpt  # noqa: E402, F401  (pins MKL's and ATen's CPU kernels as the book runs them)

ROOT = Path(__file__).resolve().parents[1]
#: (label, M, N, K, layouts, bias): float32, as the checker reads them.
SHAPES = [
    ("fwd  (768x128)(128x384)", 768, 384, 128, "nt", "row"),
    ("fwd  (768x128)(128x512)", 768, 512, 128, "nt", "row"),
    ("fwd  (768x512)(512x128)", 768, 128, 512, "nt", "row"),
    ("dX   (768x384)(384x128)", 768, 128, 384, "nn", "none"),
    ("dX   (768x512)(512x128)", 768, 128, 512, "nn", "none"),
    ("dX   (768x128)(128x512)", 768, 512, 128, "nn", "none"),
    ("dW   (384x768)^T(768x128)", 384, 128, 768, "tn", "none"),
    ("dW   (512x768)^T(768x128)", 512, 128, 768, "tn", "none"),
    ("dW   (128x768)^T(768x512)", 128, 512, 768, "tn", "none"),
    ("attn (256x32)(32x256) QK^T", 256, 256, 32, "nt", "none"),
    ("attn (256x256)(256x32) PV", 256, 32, 256, "nn", "none"),
    ("dec  (1x128)(128x384)", 1, 384, 128, "nt", "row"),
    ("dec  (8x128)(128x512)", 8, 512, 128, "nt", "row"),
]
BATCH = 16


def operand(rows: int, cols: int, layout: str) -> torch.Tensor:
    """A (rows, cols) matrix laid out as the checker's letter says (n, or t: a transposed view)."""
    if layout == "n":
        return torch.rand(rows, cols) * 2 - 1
    return (torch.rand(cols, rows) * 2 - 1).t()


def torch_seconds(m: int, n: int, k: int, layouts: str, bias: str, batched: bool,
                  least: float) -> float:
    """Seconds of one product by PyTorch (per head for attention)."""
    if batched:
        a = torch.rand(BATCH, m, k) * 2 - 1
        if layouts[1] == "t":
            b = (torch.rand(BATCH, n, k) * 2 - 1).transpose(1, 2)
        else:
            b = torch.rand(BATCH, k, n) * 2 - 1
        out = torch.empty(BATCH, m, n)

        def step() -> None:
            torch.bmm(a, b, out=out)
        per = BATCH
    else:
        a, b = operand(m, k, layouts[0]), operand(k, n, layouts[1])
        out = torch.empty(m, n)
        if bias == "row":
            vector = torch.rand(n)

            def step() -> None:
                torch.addmm(vector, a, b, out=out)
        else:
            def step() -> None:
                torch.mm(a, b, out=out)
        per = 1
    step()
    runs, start = 0, time.perf_counter()
    while True:
        step()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= least:
            return elapsed / runs / per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", default="avx2", help="the gemm path: avx2, avx512, portable")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--least", type=float, default=0.2, help="seconds per timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checker = Path(tmp) / "check"
        subprocess.run(["g++", "-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math",
                        f"-I{ROOT / 'src'}", str(ROOT / "tests" / "gemm" / "check.cpp"),
                        "-o", str(checker)], check=True)
        serve = subprocess.Popen([str(checker), "serve", args.path, str(args.least)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ours: dict[str, list[float]] = {s[0]: [] for s in SHAPES}
        theirs: dict[str, list[float]] = {s[0]: [] for s in SHAPES}
        for _ in range(args.rounds):
            for label, m, n, k, layouts, bias in SHAPES:
                serve.stdin.write(f"float32 {m} {n} {k} {layouts} {bias} 1 1\n")
                serve.stdin.flush()
                ours[label].append(float(serve.stdout.readline()))
                theirs[label].append(torch_seconds(m, n, k, layouts, bias,
                                                   label.startswith("attn"), args.least))
        serve.stdin.close()
        serve.wait()
    print(f"single thread, float32, medians of {args.rounds} interleaved rounds; "
          f"gemm path {args.path}, torch {torch.__version__} (MINIGPT_PRODUCTS=native, "
          f"MKL_CBWR={os.environ.get('MKL_CBWR')})")
    print(f"{'product':30} {'ours GFLOP/s':>13} {'torch GFLOP/s':>14} {'ratio':>6}")
    for label, m, n, k, _layouts, _bias in SHAPES:
        flops = 2 * m * n * k
        mine = flops / statistics.median(ours[label]) * 1e-9
        native = flops / statistics.median(theirs[label]) * 1e-9
        print(f"{label:30} {mine:13.1f} {native:14.1f} {mine / native:6.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
