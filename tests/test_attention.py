"""Scaled dot-product and multi-head attention: parity and invariants; the measures of what
heads attend to (mean distance, mass on chosen keys)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minigpt import products
from minigpt.attention import (
    MultiHeadAttention,
    attention_mass,
    causal_mask,
    mean_attention_distance,
    merge_heads,
    scaled_dot_product_attention,
    split_heads,
)

shapes = st.tuples(
    st.integers(1, 3),  # B
    st.integers(1, 4),  # H
    st.integers(1, 9),  # T
    st.integers(1, 8),  # d_k
)


def _qkv(batch, heads, length, d_k, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, d_k, generator=generator) * scale for _ in range(3)]


@given(shape=shapes, seed=st.integers(0, 2**16), scale=st.sampled_from([0.1, 1.0, 10.0]),
       causal=st.booleans())
def test_weights_are_distributions(shape, seed, scale, causal):
    q, k, v = _qkv(*shape, seed, scale)
    mask = causal_mask(shape[2]) if causal else None
    context, weights = scaled_dot_product_attention(q, k, v, mask)
    assert context.shape == v.shape
    assert weights.shape == (*shape[:3], shape[2])
    assert torch.all(weights >= 0) and torch.all(weights <= 1)
    assert torch.allclose(weights.sum(-1), torch.ones(shape[:3]), atol=1e-5)
    if causal:
        upper = torch.triu(torch.ones(shape[2], shape[2], dtype=torch.bool), diagonal=1)
        assert torch.all(weights[..., upper] == 0)


@given(shape=shapes, seed=st.integers(0, 2**16), causal=st.booleans())
def test_explicit_equals_pytorch_kernel(shape, seed, causal):
    q, k, v = _qkv(*shape, seed)
    mask = causal_mask(shape[2]) if causal else None
    ours, _ = scaled_dot_product_attention(q, k, v, mask)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(ours, theirs, atol=1e-5)


@given(length=st.integers(2, 10), seed=st.integers(0, 2**16))
def test_permutation_equivariance_without_positions(length, seed):
    # Unmasked attention with no positional information: permuting the tokens
    # permutes the output rows the same way (equivariance, not invariance).
    torch.manual_seed(seed)
    attention = MultiHeadAttention(8, 2, causal=False).eval()
    x = torch.randn(1, length, 8)
    perm = torch.randperm(length)
    out, _ = attention(x)
    out_perm, _ = attention(x[:, perm])
    assert torch.allclose(out_perm, out[:, perm], atol=1e-5)


@given(length=st.integers(2, 10), t=st.integers(0, 8), seed=st.integers(0, 2**16))
def test_causal_output_ignores_the_future(length, t, seed):
    t = t % (length - 1)
    torch.manual_seed(seed)
    attention = MultiHeadAttention(8, 2, causal=True).eval()
    x = torch.randn(1, length, 8)
    changed = x.clone()
    changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:]) * 5
    before, _ = attention(x)
    after, _ = attention(changed)
    assert torch.allclose(before[:, : t + 1], after[:, : t + 1], atol=1e-6)
    assert not torch.allclose(before[:, t + 1:], after[:, t + 1:], atol=1e-3)


def test_exact_match_example():
    # Keys [1,0], [0,1], [1,1] and query [1,0]: scores 1, 0, 1 before scaling.
    q = torch.tensor([[1.0, 0.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = torch.tensor([[10.0], [20.0], [30.0]])
    context, weights = scaled_dot_product_attention(q, k, v)
    s = 1 / math.sqrt(2)
    expected = torch.softmax(torch.tensor([s, 0.0, s]), dim=-1)
    assert torch.allclose(weights[0], expected)
    assert context.item() == pytest.approx((expected * torch.tensor([10.0, 20.0, 30.0])).sum())


def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    # head h holds features h*d_k .. (h+1)*d_k - 1
    assert torch.equal(heads[:, 1], x[..., 4:8])
    assert torch.equal(merge_heads(heads), x)


@pytest.mark.parametrize("causal", [True, False])
def test_multi_head_fast_path_matches_explicit(causal):
    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4, causal=causal).eval()
    x = torch.randn(3, 7, 16)
    fast, none = attention(x)
    slow, weights = attention(x, need_weights=True)
    assert none is None and weights.shape == (3, 4, 7, 7)
    assert torch.allclose(fast, slow, atol=1e-5)
    attention.use_fused = False
    assert torch.allclose(attention(x)[0], slow, atol=0)
    # PyTorch's fused kernel computes the same function as the explicit path, which is what
    # a CPU runs under the package's products (minigpt.products.computes).
    q, k, v = (split_heads(t, 4) for t in attention.c_attn(x).split(16, dim=-1))
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(attention.c_proj(merge_heads(fused)), slow, atol=1e-5)
    assert products.computes(x) == (products.mode() != "native")


def test_multi_head_refuses_a_width_the_heads_do_not_share():
    # the same rule and words as GPTConfig's (minigpt.config.check_heads)
    with pytest.raises(ValueError, match=r"d_model \(=10\) must be divisible by n_heads \(=3\)"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"n_kv_heads \(=3\) must divide n_heads \(=4\)"):
        MultiHeadAttention(16, 4, n_kv_heads=3)


def test_scaling_keeps_the_scores_at_unit_variance():
    # Unit-normal q and k with d_k = 512: q . k has variance d_k, and the function's
    # 1/sqrt(d_k) brings the scores back to variance 1. The scores are read back from the
    # weights it returns: within a row, log w_j = s_j - logsumexp(s), so the centred log
    # weights are the centred scores.
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 8, 32, 512, generator=generator, dtype=torch.float64)
               for _ in range(3))
    _, weights = scaled_dot_product_attention(q, k, v)
    log_w = weights.log()
    scores = log_w - log_w.mean(dim=-1, keepdim=True)
    # The centred row of 32 entries has variance (31/32) sigma^2; unscaled it would be ~496.
    assert scores.var(dim=-1, unbiased=False).mean().item() == pytest.approx(31 / 32, rel=0.05)


# ------------------------------------------------------------ what trained heads attend to

def _weights(batch: int, heads: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, heads, length, length, generator=generator), dim=-1)


def test_mean_attention_distance_of_known_patterns():
    length = 6
    identity = torch.eye(length)  # every query looks at itself: distance 0
    previous = torch.zeros(length, length)  # query i looks at i-1 (query 0 at itself)
    previous[0, 0] = 1.0
    previous[torch.arange(1, length), torch.arange(length - 1)] = 1.0
    first = torch.zeros(length, length)  # every query looks at position 0: distance i
    first[:, 0] = 1.0
    weights = torch.stack([identity, previous, first])[None]  # (1, 3, T, T)
    got = mean_attention_distance(weights)
    expected = torch.tensor([0.0, (length - 1) / length, sum(range(length)) / length],
                            dtype=torch.float64)
    assert got.shape == (3,)
    torch.testing.assert_close(got, expected)


def test_mean_attention_distance_of_uniform_causal_rows():
    length = 5
    causal = torch.tril(torch.ones(length, length))
    uniform = causal / causal.sum(dim=-1, keepdim=True)
    # Query i spreads over 0..i: mean distance i/2; averaged over i: (T-1)/4.
    got = mean_attention_distance(uniform.expand(3, 2, length, length))
    torch.testing.assert_close(got, torch.full((2,), (length - 1) / 4, dtype=torch.float64))


def test_mean_attention_distance_stacks_layers():
    layers = [_weights(2, 4, 7, seed=s) for s in range(3)]
    got = mean_attention_distance(layers)
    assert got.shape == (3, 4)
    torch.testing.assert_close(got, mean_attention_distance(torch.stack(layers)))
    torch.testing.assert_close(got[1], mean_attention_distance(layers[1]))


def test_mean_attention_distance_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        mean_attention_distance(torch.rand(3, 3))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # raw scores, not weights
        mean_attention_distance(torch.full((1, 1, 2, 2), 2.0))


def test_attention_mass_on_positions_and_tokens():
    length = 4
    previous = torch.zeros(length, length)
    previous[0, 0] = 1.0
    previous[torch.arange(1, length), torch.arange(length - 1)] = 1.0
    causal = torch.tril(torch.ones(length, length))
    uniform = causal / causal.sum(dim=-1, keepdim=True)
    weights = torch.stack([previous, uniform])[None]  # (1, 2, T, T)
    prev_key = torch.diag(torch.ones(length - 1), -1).bool()  # key j = i - 1
    got = attention_mass(weights, prev_key)
    # Query 0 has no previous key and is left out; the uniform head gives 1/(i+1) to it.
    expected = torch.tensor([1.0, (1 / 2 + 1 / 3 + 1 / 4) / 3], dtype=torch.float64)
    torch.testing.assert_close(got, expected)
    # A property of the key tokens, (B, 1, T): position 2 is "a space".
    is_space = torch.tensor([[False, False, True, False]])[:, None, :]
    got = attention_mass(weights, is_space)
    # Every query counts (each has a key selected, even if it cannot see it yet).
    torch.testing.assert_close(got, torch.tensor([0.25, (1 / 3 + 1 / 4) / 4],
                                                 dtype=torch.float64))
    stacked = attention_mass([weights, weights], prev_key)
    assert stacked.shape == (2, 2)


def test_attention_mass_rejects_bad_masks():
    weights = _weights(2, 1, 3)
    with pytest.raises(ValueError, match="broadcast"):
        attention_mass(weights, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no key"):
        attention_mass(weights, torch.zeros(3, 3, dtype=torch.bool))
