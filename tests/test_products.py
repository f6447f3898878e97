"""The package's matrix products (minigpt.products): what each kernel computes, bit for bit.

Each product is compared with the order the module promises, computed here another way: each
entry the chain of fused multiply-adds over its inner dimension in order, then alpha, then
the bias (`minigpt.products.chain_order`, written with elementwise float64 operations that
round as one fma does). That the order gives the same bits on every CPU path and thread count
is tests/test_gemm.py's part (the kernels' core alone) and tests/test_same_bits.py's (whole
runs under emulated CPUs); here the same for the products PyTorch hands the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minigpt import products
from minigpt.attention import (
    LayerKVCache,
    MultiHeadAttention,
    causal_mask,
    scaled_dot_product_attention,
    softmax_over_keys,
)
from minigpt.nn import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    products.mode() == "native",
    reason="the package's products run on Linux x86-64 (elsewhere PyTorch's own)")


def _random(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _chains(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
            alpha: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """The package's order, written out: the chains, then alpha, then beta times the bias."""
    out = products.chain_order(a, b)
    if alpha != 1.0:
        out = out * alpha
    if bias is not None and beta != 0.0:
        out = out + (bias if beta == 1.0 else beta * bias)
    return out


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (1, 64, 384), (2, 200, 3),
                                           (7, 300, 13), (24, 193, 40), (50, 64, 97)])
def test_a_product_is_its_chains(m: int, k: int, n: int) -> None:
    a, b, bias = _random(m, k, seed=1), _random(k, n, seed=2), _random(n, seed=3)
    assert torch.equal(a @ b, _chains(a, b))
    assert torch.equal(torch.addmm(bias, a, b), _chains(a, b, bias))
    # nn.Linear's layout: x W^T, the weight read transposed
    w = b.t().contiguous()
    assert torch.equal(F.linear(a, w, bias), _chains(a, b, bias))
    # a batch of matrices, and a batch read transposed
    x, y = _random(3, m, k, seed=4), _random(3, k, n, seed=5)
    assert torch.equal(torch.bmm(x, y), _chains(x, y))
    yt = y.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(torch.bmm(x, yt), _chains(x, y))
    base = _random(3, m, n, seed=6)
    assert torch.equal(torch.baddbmm(base, x, y), _chains(x, y, base))


def test_alpha_scales_the_chain_and_beta_the_bias() -> None:
    a, b, bias = _random(8, 300, seed=1), _random(300, 16, seed=2), _random(8, 16, seed=3)
    assert torch.equal(torch.addmm(bias, a, b, beta=2.0, alpha=0.5),
                       _chains(a, b, bias, alpha=0.5, beta=2.0))
    # beta 0 ignores the bias, NaN or not, as BLAS does
    nan = torch.full((8, 16), float("nan"))
    assert torch.equal(torch.addmm(nan, a, b, beta=0), _chains(a, b))


def test_a_row_is_the_same_bits_alone_or_with_others() -> None:
    # One order for every shape: a row computed alone (a token decoded with a key-value
    # cache) has the bits it has among 1, 5 or 300 rows (the same token in a training batch).
    x, w, bias = _random(300, 128, seed=1), _random(384, 128, seed=2), _random(384, seed=3)
    full = F.linear(x, w, bias)
    for rows in (1, 5, 300):
        assert torch.equal(F.linear(x[:rows], w, bias), full[:rows])
    assert all(torch.equal(F.linear(x[i:i + 1], w, bias)[0], full[i]) for i in range(0, 300, 7))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_thread_count_changes_no_bit(threads: int) -> None:
    a, b = _random(600, 384, seed=1), _random(384, 512, seed=2)
    x, y = _random(12, 64, 32, seed=3), _random(12, 32, 64, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = (a @ b, torch.bmm(x, y))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0][:40], _chains(a[:40], b)) and torch.equal(got[1], _chains(x, y))


def test_vectors_and_float64_are_summed_in_the_packages_own_order() -> None:
    a, x, y = _random(20, 50, seed=1), _random(50, seed=2), _random(50, seed=3)
    assert torch.equal(torch.mv(a, x), _chains(a, x[:, None])[:, 0])
    assert torch.equal(a @ x, _chains(a, x[:, None])[:, 0])
    bias = _random(20, seed=4)
    assert torch.equal(torch.addmv(bias, a, x), _chains(a, x[:, None], bias[:, None])[:, 0])
    assert torch.equal(torch.dot(x, y), _chains(x[None], y[:, None]).reshape(()))
    # float64: the same chains, in float64 (the kernels' core checks them against its own
    # reference); here a row alone against the whole.
    d, e = _random(30, 400, dtype=torch.float64), _random(400, 30, seed=1, dtype=torch.float64)
    assert torch.equal((d @ e)[7], (d[7:8] @ e)[0])
    # other dtypes have no rounding to order: PyTorch's own kernels
    ints = torch.arange(6).reshape(2, 3)
    assert torch.equal(ints @ ints.t(), torch.tensor([[5, 14], [14, 50]]))


def test_gradients_are_summed_the_same_way() -> None:
    # A weight's gradient sums over the batch's tokens: 300 of them.
    x = _random(300, 64, seed=1).requires_grad_()
    w = _random(48, 64, seed=2).requires_grad_()
    grad = _random(300, 48, seed=3)
    F.linear(x, w).backward(grad)
    assert w.grad is not None and x.grad is not None
    assert torch.equal(w.grad, _chains(grad.t(), x.detach()))
    assert torch.equal(x.grad, _chains(grad, w.detach()))


def test_pytorchs_own_errors_for_what_is_not_a_product() -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.mm(torch.ones(2, 3), torch.ones(4, 5))
    with pytest.raises(RuntimeError, match="1D tensors expected"):
        torch.dot(torch.ones(2, 3), torch.ones(3))
    with pytest.raises(RuntimeError, match="inconsistent tensor size"):
        torch.dot(torch.ones(2), torch.ones(3))
    assert torch.mm(torch.ones(0, 4), torch.ones(4, 2)).shape == (0, 2)
    assert torch.equal(torch.mm(torch.ones(3, 0), torch.ones(0, 2)), torch.zeros(3, 2))


def test_attention_on_a_cpu_takes_the_explicit_path() -> None:
    # PyTorch's fused kernel would hand its products to MKL past the package's kernels.
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4).eval()
    x = _random(2, 9, 32)
    assert products.computes(x)
    with torch.no_grad():
        y, weights = attention(x)
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2)
                   for t in attention.c_attn(x).split(32, dim=-1))
        context, _ = scaled_dot_product_attention(q, k, v, causal_mask(9))
        expected = attention.c_proj(context.transpose(1, 2).flatten(2))
    assert weights is None and torch.equal(y, expected)


def _attention_run(attention: MultiHeadAttention, x: torch.Tensor, *, steps: tuple[int, ...],
                   need_weights: bool) -> list[torch.Tensor]:
    """Outputs and gradients of ``attention`` over ``x`` (B, T, D) in one step; or its outputs
    (as generation computes them, without gradients) fed ``steps`` positions at a time through
    a key-value cache."""
    x = x.detach().requires_grad_()
    attention.zero_grad()
    cache = LayerKVCache(x.shape[1]) if len(steps) > 1 else None
    outputs, start = [], 0
    with torch.set_grad_enabled(cache is None):
        for step in steps:
            y, weights = attention(x[:, start:start + step], need_weights=need_weights,
                                   cache=cache)
            outputs += [y] + ([weights] if need_weights else [])
            start += step
    if cache is not None:
        return outputs
    loss = sum((o * _random(*o.shape, seed=i)).sum() for i, o in enumerate(outputs))
    loss.backward()
    grads = [x.grad] + [p.grad for p in attention.parameters()]
    return [o.detach() for o in outputs] + [g for g in grads if g is not None]


LAYOUTS = [dict(), dict(n_kv_heads=2), dict(qk_norm=True), dict(rope=RotaryEmbedding(32, 8)),
           dict(n_kv_heads=1, qk_norm=True, norm="layernorm")]
STEPS = [((9,), False), ((9,), True), ((5, 1, 1, 2), False), ((4, 3, 1, 1), True)]


@pytest.mark.parametrize(("layout", "steps", "need_weights"), [
    *((layout, *steps) for layout in LAYOUTS for steps in STEPS),
    # full attention (an encoder's) keeps no cache
    (dict(causal=False), (9,), False), (dict(causal=False), (9,), True),
    # longer than a tile is wide (AVX-512: 32 columns, AVX2: 16): causal scores in bands
    (dict(), (70,), True), (dict(n_kv_heads=2), (70,), False), (dict(), (40, 30), True)])
def test_attention_in_one_call_has_the_bits_of_its_calls_one_by_one(
        layout: dict, steps: tuple[int, ...], need_weights: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # products.attention: the division, the two products and the softmax in one call, forward
    # and backward (or through a cache, forward), grouped heads, normalised or rotated queries
    # and keys; against minigpt.attention.scaled_dot_product_attention, one call at a time.
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4, **layout)
    x = _random(2, sum(steps), 32, seed=1)
    calls: list[int] = []
    one_call = products.attention
    monkeypatch.setattr(products, "attention", lambda *a: calls.append(1) or one_call(*a))
    fused = _attention_run(attention, x, steps=steps, need_weights=need_weights)
    assert len(calls) == len(steps)
    monkeypatch.setattr(products, "fuses", lambda tensor: False)
    alone = _attention_run(attention, x, steps=steps, need_weights=need_weights)
    assert len(calls) == len(steps)  # not called again
    assert len(fused) == len(alone) and all(map(torch.equal, fused, alone))


@pytest.mark.parametrize(("heads", "t", "n", "d_k", "d_v", "causal"), [
    (0, 5, 7, 8, 8, True), (3, 0, 4, 8, 8, True), (3, 5, 7, 0, 8, True),
    (3, 5, 7, 8, 0, True), (3, 4, 7, 8, 8, False)])
def test_attention_in_one_call_at_empty_edges(heads: int, t: int, n: int, d_k: int,
                                              d_v: int, causal: bool) -> None:
    # no heads, no queries, no features, no value features (the weights are still computed):
    # what the calls one by one give
    q, k, v = _random(2, heads, t, d_k), _random(2, heads, n, d_k, seed=1), _random(
        2, heads, n, d_v, seed=2)
    context, weights = products.attention(q, k, v, n - t, causal)
    mask = causal_mask(t, past=n - t) if causal else None
    expected_context, expected_weights = scaled_dot_product_attention(q, k, v, mask)
    assert context.shape == expected_context.shape and weights.shape == expected_weights.shape
    assert torch.equal(context, expected_context) and torch.equal(weights, expected_weights)


def test_attention_in_one_call_refuses_what_it_does_not_compute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = _random(2, 3, 4, 8), _random(2, 3, 6, 8)
    with pytest.raises(RuntimeError, match="with the same leading dimensions"):
        products.attention(q, k, _random(2, 3, 5, 8), 2, True)
    with pytest.raises(RuntimeError, match="float32 CPU operands"):
        products.attention(q.double(), k.double(), k.double(), 2, True)
    with pytest.raises(RuntimeError, match="4 causal queries after 1 cached positions see 5 "
                                           "keys, not 6"):
        products.attention(q, k, k, 1, True)
    with pytest.raises(RuntimeError, match="at least one key"):  # as the softmax alone
        products.attention(q, k[:, :, :0], k[:, :, :0], 0, False)
    # dropout on the weights (training), autocast (bfloat16 products) and another dtype take
    # the calls one by one
    calls: list[int] = []
    one_call = products.attention
    monkeypatch.setattr(products, "attention", lambda *a: calls.append(1) or one_call(*a))
    attention, x = MultiHeadAttention(32, 4, dropout=0.5), _random(2, 5, 32)
    attention(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention.eval()(x)
    attention.double()(x.double())
    assert calls == []
    attention.float()(x)
    assert calls == [1]


def _relu_squared_inputs() -> list[torch.Tensor]:
    """Random values with every special one among them (signed zeros, infinities, a NaN,
    subnormals, values whose square overflows or underflows), at the modern recipe's
    hidden width, contiguous and not."""
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45,
                            1e-20, 3e19, 2e19, -3e19, 1.0, -1.0])
    values = _random(6, 64, 512, seed=3) * 3
    values.view(-1)[:special.numel()] = special
    return [values, values.transpose(1, 2), values[:, ::2], _random(7, seed=4)]


@pytest.mark.parametrize("index", range(4))
def test_relu_squared_in_one_pass_has_the_bits_of_relu_then_square(index: int) -> None:
    x = _relu_squared_inputs()[index]
    grad = _random(*x.shape, seed=5)
    grad.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), -0.0])
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused, alone = products.relu_squared(a), F.relu(b).square()
    fused.backward(grad)
    alone.backward(grad)
    assert torch.equal(fused.isnan(), alone.isnan()) and torch.equal(a.grad.isnan(), b.grad.isnan())
    assert torch.equal(fused.nan_to_num(), alone.nan_to_num())
    assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())
    assert fused.is_contiguous() and fused.shape == x.shape


def test_relu2_runs_in_one_pass_where_the_package_fuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from minigpt.nn import FeedForward, relu2

    calls: list[int] = []
    one_pass = products.relu_squared
    monkeypatch.setattr(products, "relu_squared", lambda x: calls.append(1) or one_pass(x))
    torch.manual_seed(0)
    ffn, x = FeedForward(32, 128, activation="relu2"), _random(2, 5, 32)
    fused = ffn(x)
    assert calls == [1]
    # autocast (bfloat16 products), another dtype and torch.export take relu, then square
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ffn(x)
    relu2(x.double())
    torch.export.export(ffn, (x,))
    assert calls == [1]
    monkeypatch.setattr(products, "fuses", lambda tensor: False)
    assert torch.equal(ffn(x), fused)
    with pytest.raises(RuntimeError, match="must be a float32 CPU tensor, got Double"):
        one_pass(x.double())


def test_a_census_records_each_distinct_product_once() -> None:
    a, b, bias = _random(8, 300), _random(300, 16), _random(16)
    with products.census() as outer:
        a @ b
        with products.census() as inner:
            torch.addmm(bias, a, b, alpha=0.5)
            torch.addmm(bias, a, b, alpha=0.5)
        _random(2, 3, 4) @ _random(2, 4, 5)
    assert inner == [["mm", [8, 300], [300, 1], [300, 16], [16, 1], [16], [1], "float32",
                      torch.get_num_threads(), 0.5, 1]]
    assert len(outer) == 3 and inner[0] in outer
    assert ["bmm", [2, 3, 4], [12, 4, 1], [2, 4, 5], [20, 5, 1], None, None, "float32",
            torch.get_num_threads(), 1, 1] in outer


def test_a_process_journals_its_census_into_the_folder_it_is_given(tmp_path) -> None:
    code = ("import torch, minigpt; torch.set_num_threads(1); "
            "torch.ones(5, 20) @ torch.ones(20, 13); torch.ones(5, 20) @ torch.ones(20, 13)")
    env = os.environ | {"MINIGPT_CENSUS": str(tmp_path / "census")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (journal,) = (tmp_path / "census").iterdir()
    lines = [json.loads(line) for line in journal.read_text(encoding="utf-8").splitlines()]
    assert lines == [["mm", [5, 20], [20, 1], [20, 13], [13, 1], None, None, "float32", 1, 1,
                      1]]


@pytest.mark.parametrize(("value", "expected"), [("native", "native"),
                                                 ("chains", "fma chains")])
def test_the_environment_chooses_the_products(value: str, expected: str) -> None:
    code = "from minigpt import products; print(products.mode())"
    env = os.environ | {"MINIGPT_PRODUCTS": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == expected


def test_an_unknown_choice_of_products_is_refused() -> None:
    env = os.environ | {"MINIGPT_PRODUCTS": "fast"}
    done = subprocess.run([sys.executable, "-c", "import minigpt"], env=env,
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "MINIGPT_PRODUCTS='fast': use 'chains'" in done.stderr


def test_importing_minigpt_prints_nothing() -> None:
    # PyTorch warns when a kernel is replaced; the package replaces them on purpose, quietly.
    done = subprocess.run([sys.executable, "-c", "import minigpt"], capture_output=True,
                          text=True, check=True)
    assert done.stdout == done.stderr == ""


# ------------------------------------------------- every road to a product: the same order

def _roads() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each road to a product PyTorch has, beside the plain product it must equal bit for
    bit: out=, in place, matmul(out=), addbmm (PyTorch's CPU kernel adds each batch with
    addmm_), the float32 result of bfloat16 operands, addmm fused with its activation."""
    a, b = _random(2, 256), _random(256, 96, seed=1)  # thin: the package's own sums
    x, y = _random(6, 256, seed=2), _random(256, 96, seed=3)  # MKL's blocks
    bias, batch1, batch2 = _random(6, 96, seed=4), _random(3, 6, 256), _random(3, 256, 96)
    v, c = _random(256, seed=5), _random(6, seed=6)
    o: dict[str, torch.Tensor] = {}

    def out(name: str, *shape: int) -> torch.Tensor:
        o[name] = torch.empty(shape)
        return o[name]

    torch.mm(a, b, out=out("mm thin", 2, 96))
    torch.mm(x, y, out=out("mm", 6, 96))
    torch.bmm(batch1, batch2, out=out("bmm", 3, 6, 96))
    torch.addmm(bias, x, y, beta=0.5, alpha=2.0, out=out("addmm", 6, 96))
    torch.baddbmm(bias, batch1, batch2, out=out("baddbmm", 3, 6, 96))
    torch.mv(x, v, out=out("mv", 6))
    torch.addmv(c, x, v, out=out("addmv", 6))
    torch.dot(v, v, out=out("dot"))
    torch.matmul(x, y, out=out("matmul", 6, 96))
    addbmm = bias.clone()
    for i in range(3):
        addbmm = torch.addmm(addbmm, batch1[i], batch2[i])
    wide = (x.bfloat16().float(), y.bfloat16().float())
    return [
        ("mm(out=) thin", o["mm thin"], a @ b), ("mm(out=)", o["mm"], x @ y),
        ("bmm(out=)", o["bmm"], torch.bmm(batch1, batch2)),
        ("addmm(out=)", o["addmm"], torch.addmm(bias, x, y, beta=0.5, alpha=2.0)),
        ("addmm_", bias.clone().addmm_(x, y, alpha=2.0), torch.addmm(bias, x, y, alpha=2.0)),
        ("baddbmm(out=)", o["baddbmm"], torch.baddbmm(bias, batch1, batch2)),
        ("baddbmm_", bias.expand(3, 6, 96).clone().baddbmm_(batch1, batch2),
         torch.baddbmm(bias, batch1, batch2)),
        ("mv(out=)", o["mv"], torch.mv(x, v)), ("addmv(out=)", o["addmv"], torch.addmv(c, x, v)),
        ("addmv_", c.clone().addmv_(x, v), torch.addmv(c, x, v)),
        ("dot(out=)", o["dot"], torch.dot(v, v)), ("matmul(out=)", o["matmul"], x @ y),
        ("addbmm", torch.addbmm(bias, batch1, batch2), addbmm),
        ("addbmm_", bias.clone().addbmm_(batch1, batch2), addbmm),
        ("mm(out_dtype=float32) of bfloat16",
         torch.ops.aten.mm.dtype(x.bfloat16(), y.bfloat16(), torch.float32), wide[0] @ wide[1]),
        ("_addmm_activation", torch.ops.aten._addmm_activation(bias, x, y, use_gelu=True),
         F.gelu(torch.addmm(bias, x, y), approximate="tanh")),
    ]


@pytest.mark.parametrize("index", range(16))
def test_every_road_to_a_product_takes_the_packages_order(index: int) -> None:
    name, got, plain = _roads()[index]
    assert got.dtype == plain.dtype and torch.equal(got, plain), name


def test_every_road_is_in_the_census() -> None:
    # A road records the product it computes, as the plain product does: the census sees
    # compiled code's products and matmul(out=)'s.
    x, y, bias = _random(6, 256, seed=2), _random(256, 96, seed=3), _random(6, 96, seed=4)
    with products.census() as plain:
        torch.addmm(bias, x, y)
    with products.census() as road:
        torch.mm(x, y, out=torch.empty(6, 96))
        bias.clone().addmm_(x, y)
    assert len(plain) == 1 and plain[0] in road and len(road) == 2
    with products.census() as every:
        _roads()
    assert {("mm", (2, 256), (256, 96)), ("mm", (6, 256), (256, 96)),  # mm, addmm, matmul
            ("bmm", (3, 6, 256), (3, 256, 96)), ("mm", (6, 256), (256, 1)),  # bmm; mv, addmv
            ("mm", (1, 256), (256, 1))} <= {(e[0], tuple(e[1]), tuple(e[3])) for e in every}


def test_a_bfloat16_product_is_the_float32_product_rounded_once() -> None:
    # bf16 autocast (TrainConfig.bf16): the operands widen exactly, the product is summed in
    # the package's float32 order and rounded once, the same bits on every CPU.
    x, y = _random(6, 256, seed=2), _random(256, 96, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = x @ y
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.bfloat16().float() @ y.bfloat16().float()).bfloat16())


def test_a_complex_product_is_refused() -> None:
    z = torch.complex(_random(6, 20), _random(6, 20, seed=1))
    with pytest.raises(RuntimeError, match="sum real numbers in one order on every CPU; a "
                       "complex product would take PyTorch's own kernel.*MINIGPT_PRODUCTS="
                       "native"):
        z @ z.T


def test_a_compiled_function_computes_the_packages_products() -> None:
    """torch.compile on a CPU: Inductor hands its matrix products to PyTorch's out= kernels,
    which are the package's, so a compiled forward and backward's products are in the census
    and its gradient is the eager one's, bit for bit."""
    linear = torch.nn.Linear(256, 96)
    x = _random(8, 256).requires_grad_()

    def f(x: torch.Tensor) -> torch.Tensor:
        return (linear(x).relu() @ linear.weight).sum()

    with products.census() as recorded:
        torch.compile(f)(x).backward()
    compiled, x.grad = x.grad, None
    f(x).backward()
    assert len(recorded) >= 4
    assert torch.equal(compiled, x.grad)


def _scores(batch: int, heads: int, length: int, *, past: int = 0, seed: int = 0,
            scale: float = 4.0) -> torch.Tensor:
    """Causal attention scores as the book's models make them: masked keys -inf."""
    raw = _random(batch, heads, length, past + length, seed=seed) * scale
    return raw.masked_fill(~causal_mask(length, past=past)[0], float("-inf"))


def test_the_fused_softmax_is_a_softmax_and_its_gradient_one() -> None:
    # Against float64's softmax and gradient: within about ten float32 units in the last
    # place of 1 (PyTorch's own float32 softmax: about half these errors, measured).
    scores = _scores(3, 4, 50, past=7, scale=8.0).requires_grad_()
    weights = softmax_over_keys(scores)
    grad = _random(*weights.shape, seed=5)
    weights.backward(grad)
    wide = scores.detach().double().requires_grad_()
    expected = torch.softmax(wide, dim=-1)
    expected.backward(grad.double())
    assert scores.grad is not None and wide.grad is not None
    assert torch.allclose(weights.double(), expected, rtol=0, atol=1e-6)
    assert torch.allclose(scores.grad.double(), wide.grad, rtol=0, atol=2e-6)
    assert torch.equal(weights[..., 0, 8:], torch.zeros_like(weights[..., 0, 8:]))  # masked
    # a score 200 below the row's maximum has weight 0, one of 0 has weight 1 / count
    row = torch.tensor([[0.0, -200.0, 0.0, float("-inf")]])
    assert torch.equal(softmax_over_keys(row), torch.tensor([[0.5, 0.0, 0.5, 0.0]]))
    assert torch.isnan(softmax_over_keys(torch.tensor([[0.0, float("nan")]]))).all()


def test_the_fused_softmax_row_ignores_the_masked_keys_after_it() -> None:
    # A query decoded with a key-value cache (P + 1 keys) against the same query's row in a
    # training forward (T keys, the later ones masked): the same bits, weights and gradients.
    raw = _random(2, 3, 40, 40, seed=2) * 4
    whole = softmax_over_keys(raw, causal_mask(40))
    # the mask given, or the masked scores -inf: the same bits
    assert torch.equal(whole, softmax_over_keys(_scores(2, 3, 40, seed=2)))
    grad = _random(*whole.shape, seed=3)
    whole_grad = torch.ops.minigpt_products.softmax_over_keys_backward(whole, grad)
    for i in (0, 1, 9, 23, 39):
        alone = softmax_over_keys(raw[..., i:i + 1, :i + 1], causal_mask(1, past=i))
        assert torch.equal(alone, whole[..., i:i + 1, :i + 1]), i
        alone_grad = torch.ops.minigpt_products.softmax_over_keys_backward(
            alone, grad[..., i:i + 1, :i + 1])
        assert torch.equal(alone_grad, whole_grad[..., i:i + 1, :i + 1]), i
    # a mask over the batch and the heads as well, against PyTorch's masked softmax
    mask = _random(2, 3, 40, 40, seed=4) > -1.0
    mask[..., 0] = True
    assert torch.allclose(softmax_over_keys(raw, mask),
                          torch.softmax(raw.masked_fill(~mask, float("-inf")), dim=-1),
                          rtol=0, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_softmax_is_the_same_bits_on_any_threads(threads: int) -> None:
    scores = _scores(8, 6, 64, seed=4)
    grad = _random(*scores.shape, seed=6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = softmax_over_keys(scores)
        one_grad = torch.ops.minigpt_products.softmax_over_keys_backward(one, grad)
        torch.set_num_threads(threads)
        got = softmax_over_keys(scores)
        got_grad = torch.ops.minigpt_products.softmax_over_keys_backward(got, grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, one) and torch.equal(got_grad, one_grad)


SOFTMAX_DIGEST = """
import hashlib, torch
from minigpt import products
from minigpt.attention import causal_mask, softmax_over_keys
digest = hashlib.sha256()
for length, past, scale in ((1, 0, 1.0), (7, 0, 30.0), (33, 5, 4.0), (64, 0, 90.0)):
    g = torch.Generator().manual_seed(length)
    raw = torch.randn(2, 3, length, past + length, generator=g) * scale
    if past:  # query 0 sees keys 0..past: scores on both sides of exp's floor (-87)
        raw[0, 0, 0, :6] = torch.tensor([0.0, -86.99, -87.01, -60.0, -0.5, -1.0])
    scores = raw.requires_grad_()
    weights = softmax_over_keys(scores, causal_mask(length, past=past))
    weights.backward(torch.randn(weights.shape, generator=g))
    digest.update(weights.detach().numpy().tobytes() + scores.grad.numpy().tobytes())
    # attention in one call: its rows' allowed keys end at every offset of a vector
    q, k, v = (torch.randn(2, 3, n, 8, generator=g).mul(s).requires_grad_()
               for n, s in ((length, scale), (past + length, 1.0), (past + length, 1.0)))
    context, weights = products.attention(q, k, v, past, True)
    context.backward(torch.randn(context.shape, generator=g))
    for t in (context, weights, q.grad, k.grad, v.grad):
        digest.update(t.detach().numpy().tobytes())
print(digest.hexdigest())
"""


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        return any(flag in line.split() for line in info if line.startswith("flags"))


def test_the_fused_softmax_is_the_same_bits_on_every_path() -> None:
    # The AVX-512 code (on a CPU that has it), the AVX2 code and the portable code (what a CPU
    # without AVX2 runs): the same bits, the softmax alone and attention in one call.
    def digest(path: str) -> str:
        env = {**os.environ, "MINIGPT_GEMM_PATH": path}
        done = subprocess.run([sys.executable, "-c", SOFTMAX_DIGEST], env=env,
                              capture_output=True, text=True, check=True)
        return done.stdout.strip()

    paths = ["portable", "avx2"] + ["avx512"] * _cpu_has("avx512f")
    assert len({digest(path) for path in paths}) == 1


def test_the_fused_softmax_refuses_what_it_does_not_compute() -> None:
    with pytest.raises(RuntimeError, match="float32 CPU tensor with at least one key"):
        torch.ops.minigpt_products.softmax_over_keys(torch.ones(2, 0), None)
    with pytest.raises(RuntimeError, match="boolean CPU tensor"):
        softmax_over_keys(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="differ in shape"):
        torch.ops.minigpt_products.softmax_over_keys_backward(torch.ones(2, 3), torch.ones(3, 2))
    # float64 takes the same order in PyTorch's operations: a row alone has the whole's bits
    scores = _scores(1, 2, 20, seed=7).double()
    alone = softmax_over_keys(scores[..., 5:6, :6])
    assert torch.equal(alone, softmax_over_keys(scores)[..., 5:6, :6])


def test_a_compiled_attention_takes_the_fused_softmax() -> None:
    attention = MultiHeadAttention(32, 4)
    x = _random(2, 9, 32).requires_grad_()

    def f(x: torch.Tensor) -> torch.Tensor:
        return attention(x)[0].square().sum()

    torch.compile(f)(x).backward()
    compiled, x.grad = x.grad, None
    f(x).backward()
    assert torch.equal(compiled, x.grad)
