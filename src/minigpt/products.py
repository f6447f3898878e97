"""Matrix products summed in one order, the package's own, on every CPU.

A matrix product C = A B sums, for each entry, K products along the inner dimension, and
floating-point addition is not associative: the order of that sum decides the last bits, and
a training run that rounds one product differently trains other weights. PyTorch hands its
products to MKL, whose order depends on the CPU's maker and instructions, on the shape of the
product (a row's bits depend on how many rows are computed with it) and on the thread count.

So `install` replaces PyTorch's CPU kernels of every matrix-product operator (`mm`, `addmm`,
`bmm`, `baddbmm`, `mv`, `addmv`, `dot`, and their out=, in-place and ``.dtype`` overloads:
what `nn.Linear` and its gradients, `matmul`, `@`, `einsum`, attention's products, Muon's
Newton-Schulz products and `torch.compile`'s products all come down to) with the kernels of
``products.cpp``, compiled once per machine (`build`: at set-up, or by the first process that
finds no library, saying so). Each entry of a float32 or float64 product is one chain
(``gemm.h``, `chain_order`)::

    acc = +0;  for p = 0 .. K-1:  acc = fma(a[i, p], b[p, j], acc);  then alpha, then the bias

A fused multiply-add rounds once on every CPU that has one, so the chain's result depends on
its inputs alone: the AVX-512, AVX2 and portable kernels give the same bits, and so do any
number of threads (they split rows and columns, never p) and any neighbouring rows. A
bfloat16 or float16 product (bf16 autocast) is the float32 product of its operands, rounded
once; a complex one is refused.

PyTorch's fused attention kernel calls MKL without these operators, so on a CPU the package
computes attention with its own products (`minigpt.attention`), and its softmax with a fused
kernel of its own (``softmax_over_keys``: one pass a row, summed left to right, its exp the
same arithmetic on every CPU, with its backward); `attention` makes the scaling, the two
products and the softmax one call, with the same bits. `relu_squared` is the modern
recipe's activation, max(0, x)^2, in one pass forward and one back, with the bits of
``F.relu(x).square()`` (which takes two passes, and four back); `fuses` says where these
fused kernels compute.

`census` records every distinct product a block of code computes (kind, each operand's shape
and strides, dtype, threads, alpha and beta); `tools/same_bits.py --census` replays a census
natively and under emulated CPUs (`tests/test_same_bits.py`); with ``MINIGPT_CENSUS`` set to a
folder, every process appends each new product to ``<folder>/<pid>.jsonl`` (the build records
the chapters' census so). Setting ``MINIGPT_PRODUCTS=native`` before importing minigpt leaves
PyTorch's kernels alone (other bits than the book's models). Elsewhere than Linux x86-64 the
products are PyTorch's own for now (the kernels' core builds for arm64, tests/test_gemm.py).
"""


from __future__ import annotations

import hashlib
import json
import math
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

SOURCE = Path(__file__).with_name("products.cpp")
#: The kernels' core, plain C++ that `SOURCE` includes (and tests/gemm/check.cpp builds alone).
CORE = Path(__file__).with_name("gemm.h")
#: The compiler's flags: no fused multiply-adds but the kernels' own (a*b+c rounded once on
#: one CPU and twice on another would part), nor any licence to reorder sums.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math")

#: How long a process waits for another that is compiling the products before it gives up
#: (a compile takes 20-90 s; a process that dies while compiling frees the lock at once).
LOCK_WAIT = 600.0

_loaded: list[Path] = []


def tell(line: str) -> None:
    """A line of what the build does, on stderr (a chapter's output stays its own)."""
    print(line, file=sys.stderr, flush=True)


def applies() -> bool:
    """Whether this platform gets the package's products: Linux on x86-64, unless
    ``MINIGPT_PRODUCTS=native``."""
    choice = os.environ.get("MINIGPT_PRODUCTS", "chains")
    if choice not in ("chains", "native"):
        raise ValueError(f"MINIGPT_PRODUCTS={choice!r}: use 'chains' (the default: the "
                         "package's products, the same bits on every CPU) or 'native' "
                         "(PyTorch's own products)")
    return choice == "chains" and sys.platform == "linux" and platform.machine() == "x86_64"


def build_key() -> str:
    """What the compiled kernels depend on: the sources, the flags and PyTorch's version."""
    material = SOURCE.read_bytes() + CORE.read_bytes() + repr((FLAGS, torch.__version__)).encode()
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
    _register_softmax()
    _loaded.append(library)


def _register_softmax() -> None:
    """Attention's fused softmax (``products.cpp``): its gradient, and its shape for
    `torch.compile`'s tracing."""
    name = "minigpt_products::softmax_over_keys"
    torch.library.register_fake(name)(lambda scores, mask: torch.empty_like(scores))
    torch.library.register_fake(f"{name}_backward")(
        lambda weights, grad: torch.empty_like(weights))

    def keep(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weights,) = ctx.saved_tensors  # a masked key's weight is 0: so is its gradient
        return torch.ops.minigpt_products.softmax_over_keys_backward(weights, grad), None

    torch.library.register_autograd(name, backward, setup_context=keep)
    _register_attention()
    _register_relu_squared()


def _register_attention() -> None:
    """Attention's one call (``products.cpp``, `attention`): its shape for `torch.compile`'s
    tracing, and its gradient: the products and the softmax's backward that the calls one by
    one would run (each as `bmm`'s and the division's autograd computes it: the same bits)."""
    name = "minigpt_products::attention"

    def shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, causal: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return (q.new_empty(*q.shape[:-1], v.shape[-1]),
                q.new_empty(*q.shape[:-1], k.shape[-2]))

    torch.library.register_fake(name)(shapes)

    def keep(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        q, k, v = inputs[:3]
        ctx.save_for_backward(q, k, v, output[1])
        ctx.set_materialize_grads(False)  # the weights' gradient, if none: None, not zeros

    def backward(ctx: Any, grad_context: torch.Tensor | None, grad_weights: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, weights = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        *lead, length, keys = weights.shape
        w = weights.view(-1, length, keys)  # the heads as one batch: bmm, no copies
        grad_q = grad_k = grad_v = None
        grad = None if grad_weights is None else grad_weights.reshape(w.shape)
        if grad_context is not None:
            grad_context = grad_context.reshape(w.shape[0], length, -1)
            if need_v:
                grad_v = torch.bmm(w.transpose(1, 2), grad_context).view(*lead, keys, -1)
            values = v.reshape(w.shape[0], keys, -1)
            from_context = torch.bmm(grad_context, values.transpose(1, 2))
            grad = from_context if grad is None else from_context + grad
        if grad is not None and (need_q or need_k):
            scores = torch.ops.minigpt_products.softmax_over_keys_backward(w, grad)
            scale = math.sqrt(q.shape[-1])
            if need_q:
                grad_q = (torch.bmm(scores, k.reshape(w.shape[0], keys, -1)) / scale
                          ).view(*lead, length, -1)
            if need_k:
                # as the gradient of k^T, transposed: a reduction after it (a normalised
                # key's backward) sums in an order that follows the layout
                scaled = (q / scale).reshape(w.shape[0], length, -1)
                grad_k = torch.bmm(scaled.transpose(1, 2), scores).transpose(1, 2).view(
                    *lead, keys, -1)
        return grad_q, grad_k, grad_v, None, None

    torch.library.register_autograd(name, backward, setup_context=keep)


def _register_relu_squared() -> None:
    """ReLU squared in one pass (``products.cpp``, `relu_squared`): its shape for
    `torch.compile`'s tracing, and its gradient (the kernel's backward, from the input)."""
    name = "minigpt_products::relu_squared"
    torch.library.register_fake(name)(lambda x: torch.empty_like(x))
    torch.library.register_fake(f"{name}_backward")(lambda x, grad: torch.empty_like(x))

    def keep(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        grad_x: torch.Tensor = torch.ops.minigpt_products.relu_squared_backward(x, grad)
        return grad_x

    torch.library.register_autograd(name, backward, setup_context=keep)


def fuses(tensor: torch.Tensor) -> bool:
    """Whether the package's fused kernels (`attention`, `relu_squared`) compute on
    ``tensor``: float32 on a CPU that runs the package's products, outside autocast (whose
    products round to bfloat16) and outside `torch.export` (whose graph keeps operations ONNX
    can read)."""
    return (tensor.dtype == torch.float32 and computes(tensor)
            and not torch.is_autocast_enabled(tensor.device.type)
            and not torch.compiler.is_exporting())


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """max(0, x)^2 in one pass of the package's kernel, for x float32 on a CPU that `fuses`:
    the bits of ``F.relu(x).square()``, and of its gradient (`minigpt.nn.relu2`)."""
    out: torch.Tensor = torch.ops.minigpt_products.relu_squared(x)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, causal: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d_k)) v over every head in one call of the package's kernels, for
    q (..., T, d_k), k (..., P + T, d_k) and v (..., P + T, d_v), float32 on a CPU that
    `computes`; with ``causal``, query i (at position P + i, ``past`` P) sees keys 0 .. P + i.
    Returns the context (..., T, d_v) and the weights (..., T, P + T): the bits of
    `minigpt.attention.scaled_dot_product_attention` with its causal mask (and no dropout),
    which computes the same division, products and softmax one call at a time."""
    context, weights = torch.ops.minigpt_products.attention(q, k, v, past, causal)
    return context, weights


def chain_order(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A B (float32) summed as the package's kernels sum it, written out with elementwise
    operations (slowly: for the tests and the implementation chapter): entry (i, j) starts at
    +0 and takes the terms p = 0, 1, ..., K-1 in order, each by a fused multiply-add,
    ``acc = fma(a[i, p], b[p, j], acc)``, rounded once.

    PyTorch has no fused multiply-add, so each step is made exact in float64 (a float32
    product is exact there; `_two_sum` gives the sum's rounding error), rounded to float64
    toward an odd last bit, then to float32: two roundings that give the one of an fma.

    a: (..., M, K); b: (..., K, N), float32. Returns (..., M, N)."""
    assert a.dtype == b.dtype == torch.float32
    acc = torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=torch.float64)
    for p in range(a.shape[-1]):
        term = a[..., p:p + 1].double() * b[..., p:p + 1, :].double()  # exact
        total, error = _two_sum(acc, term)
        even = (total.view(torch.int64) & 1) == 0
        odd = torch.where(even & (error != 0), torch.nextafter(total, total + error), total)
        acc = odd.float().double()  # the fma's one rounding, to float32
    return acc.float()


def _two_sum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y rounded, and what the rounding lost (exactly: the two add up to x + y)."""
    total = x + y
    back = total - x
    return total, (x - (total - back)) + (y - back)


def computes(tensor: torch.Tensor) -> bool:
    """Whether the package's products compute ``tensor``'s (it is on a CPU, and they are
    installed): then PyTorch's fused attention kernel, which calls MKL itself, is not used."""
    return bool(_loaded) and tensor.device.type == "cpu"


def mode() -> str:
    """What this process's products run: ``"fma chains"`` (the package's, whatever the
    CPU's vector path: the same bits) or ``"native"``."""
    return "fma chains" if _loaded else "native"


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
