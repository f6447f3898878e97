"""Attention: the causal mask, scaled dot-product attention, multi-head (and grouped-query)
attention, the key-value cache that generation keeps, and two measures of what trained heads
attend to (how far back they look, and how much weight a chosen set of keys receives).

Shapes use the book's notation: B batch, L layers, H heads, H_kv key-value heads, T
positions (queries), P positions already in a cache, D model width, d_k = D / H per-head
width. Positions are 0..T-1 in code (1..T in the maths).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt import products
from minigpt.config import check_heads

# ----------------------------------------------------------------------------------
# Scaled dot-product attention
# ----------------------------------------------------------------------------------


def causal_mask(
    num_positions: int, device: torch.device | str | None = None, *, past: int = 0
) -> Tensor:
    """Boolean mask of shape (1, 1, T, P + T): True where query i may attend to key j.

    Without a cache (``past`` P = 0) it is the lower triangle, j <= i. When P
    earlier positions are already stored (a `KVCache`), the T new queries sit
    at positions P..P+T-1 and query i may see keys 0..P+i. The two leading
    axes broadcast over the batch and the heads.
    """
    if past < 0:
        raise ValueError(f"past counts cached positions: an int >= 0, got {past}")
    keep = torch.ones(num_positions, past + num_positions, dtype=torch.bool, device=device)
    return torch.tril(keep, diagonal=past).view(1, 1, num_positions, past + num_positions)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(Q K^T / sqrt(d_k)) V, returning the context and the weights.

    Args:
        q: queries, (..., T_q, d_k).
        k: keys, (..., T_k, d_k).
        v: values, (..., T_k, d_v).
        mask: boolean, broadcastable to (..., T_q, T_k); True where attention is
            allowed. Every query must be allowed at least one key.
        dropout_p: probability of dropping an attention weight (training only).

    Returns:
        context (..., T_q, d_v) and weights (..., T_q, T_k), each row of the
        weights a probability distribution over the keys.
    """
    d_k = q.shape[-1]
    # Q K^T / sqrt(d_k), the queries scaled first: T_q d_k divisions, not T_q T_k.
    scores = (q / math.sqrt(d_k)) @ k.transpose(-2, -1)  # (..., T_q, T_k)
    weights = softmax_over_keys(scores, mask)  # a masked key gets exactly zero weight
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
    return attended @ v, weights


def softmax_over_keys(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax over the last dimension, a key where ``mask`` (boolean, broadcastable to the
    scores) is False getting weight exactly 0, whose bits do not depend on how many masked
    keys follow the allowed ones: the maximum (exact), exp of each score (elementwise), and
    the sum taken left to right (to which a masked key adds an exact zero). `torch.softmax`
    sums with vector lanes whose layout follows the row's length, so a query decoded alone
    with a key-value cache (P + 1 keys) would get other last bits than the same query in a
    training forward (T keys, the later ones masked).

    Where the package's products compute (float32 on a CPU), one fused kernel a row does it,
    mask included (``products.cpp``; its exp is the same arithmetic on every CPU); elsewhere
    the same order in PyTorch's operations (exp(-inf) = 0 for a masked key; cumsum's last
    entry is the left-to-right sum)."""
    if scores.dtype == torch.float32 and products.computes(scores):
        weights: Tensor = torch.ops.minigpt_products.softmax_over_keys(scores, mask)
        return weights
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    exps = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    return exps / exps.cumsum(dim=-1)[..., -1:]


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, D) -> (B, H, T, d_k): view D as H blocks of d_k, move heads forward."""
    batch, length, width = x.shape
    return x.view(batch, length, n_heads, width // n_heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, d_k) -> (B, T, D): the inverse of `split_heads` (concatenate the heads)."""
    batch, n_heads, length, d_head = x.shape
    return x.transpose(1, 2).contiguous().view(batch, length, n_heads * d_head)


# ----------------------------------------------------------------------------------
# The key-value cache
# ----------------------------------------------------------------------------------


class LayerKVCache:
    """The keys and values one attention layer has computed so far, for generation.

    Buffers of shape (B, H, T_max, d_k) are allocated at the first `append`
    (batch size, dtype and device come from the first keys); ``length`` is
    how many positions they hold. Appending T new positions writes them at
    ``length``..``length + T - 1`` and returns views of everything stored.
    `GPT.embed` refuses positions past T_max; the batch size stays the first one's.
    """

    def __init__(self, max_length: int) -> None:
        assert max_length >= 1, "a cache holds at least one position"
        self.max_length = max_length
        self.length = 0
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, H, T, d_k); return all keys and values so far, (B, H, length, d_k)."""
        end = self.length + k.shape[2]
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.max_length, k.shape[3])
            # Unwritten: a slot is read only once a token has been stored in it.
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        assert k.shape[0] == self.keys.shape[0], "the cache holds another batch: reset() it"
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """A key-value cache for a whole GPT: one `LayerKVCache` per block.

    Passing it to ``GPT.forward(ids, cache=cache)`` makes every attention
    layer store the keys and values of ``ids`` and attend over everything
    stored, so the next call need only read the new tokens: generating N
    tokens then runs N one-token forward passes instead of N passes over the
    whole sequence. Make one with ``GPT.new_cache()``.
    """

    def __init__(self, n_layers: int, max_length: int) -> None:
        assert n_layers >= 1, "a cache has a layer per block"
        self.layers = [LayerKVCache(max_length) for _ in range(n_layers)]

    @property
    def max_length(self) -> int:
        """How many positions each layer can hold (the model's T_max)."""
        return self.layers[0].max_length

    @property
    def length(self) -> int:
        """Positions stored, P: the next token fed to the model sits at position P."""
        return self.layers[0].length

    @property
    def batch_size(self) -> int | None:
        """B of the stored sequences, or None while the cache is empty."""
        keys = self.layers[0].keys
        return None if keys is None else int(keys.shape[0])

    def reset(self) -> None:
        """Forget every stored position (the buffers are dropped too)."""
        for layer in self.layers:
            layer.length, layer.keys, layer.values = 0, None, None

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (speculative decoding drops the keys and
        values of rejected draft tokens); the next token fed sits at position ``length``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"a cache of {self.length} positions keeps 0 to {self.length} of "
                             f"them, not {length}: a longer crop would expose unwritten slots")
        for layer in self.layers:
            layer.length = length

    def reorder(self, index: Tensor) -> None:
        """Keep sequence ``index[b]`` as the new sequence b (beam search), in every layer.

        ``index`` is a 1-D tensor of batch positions; it may repeat some and
        drop others, so the batch size may change.
        """
        for layer in self.layers:
            if layer.keys is None or layer.values is None:
                continue
            index = index.to(layer.keys.device)
            stored = layer.length
            for name in ("keys", "values"):
                old: Tensor = getattr(layer, name)
                new = old.new_empty((index.shape[0], *old.shape[1:]))
                new[:, :, :stored] = old[:, :, :stored].index_select(0, index)  # only what is used
                setattr(layer, name, new)


# ----------------------------------------------------------------------------------
# Multi-head attention
# ----------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Masked multi-head self-attention, GPT-2 style, with the modern options.

    One linear map ``c_attn`` makes Q, K and V for all heads at once (D -> 3D);
    the heads attend independently; their outputs are concatenated and mixed
    by ``c_proj``, the W^O of the paper, with shape (H d_v) x D (``c_proj.weight``,
    like every ``nn.Linear`` weight, stores its transpose).

    Args:
        d_model: D.
        n_heads: H; must divide D.
        dropout: dropout on the attention weights and on the output.
        bias: whether the two linear maps carry biases.
        causal: mask the future (a decoder); False gives full attention.
        n_kv_heads: H_kv key-value heads, each shared by H / H_kv query heads
            (grouped-query attention; ``c_attn`` is then D -> (H + 2 H_kv) d_k).
        qk_norm: normalise each head's queries and keys over their d_k features (no
            parameters), with ``norm``: "rmsnorm" (RMS 1) or "layernorm" (mean 0, then
            RMS 1; PyTorch has one fused CPU kernel for it, none for RMSNorm).
        rope: rotate queries and keys by their positions: ``rope(x, P)`` turns x, at
            positions P..P+T-1, by their angles (an `nn.RotaryEmbedding`).

    Shapes: x (B, T, D) -> y (B, T, D), and with ``need_weights`` the weights
    (B, H, T, T).

    ``use_fused`` picks PyTorch's `scaled_dot_product_attention` kernel when
    the weights are not asked for, except on a CPU that runs the package's
    own matrix products (`minigpt.products`: the fused kernel would bypass
    them). There `products.attention` computes the explicit path in one call,
    with its bits; with dropout on the weights, under autocast or in another
    dtype the explicit path runs one step at a time. All compute the same
    function.

    With a ``cache`` (a `LayerKVCache` holding P earlier positions) x holds
    only the T new positions: their keys and values are stored (H_kv heads,
    keys already rotated), and their queries attend over all P + T keys (the
    weights are then (B, H, T, P + T)).
    """

    def __init__(
        self, d_model: int, n_heads: int, *, dropout: float = 0.0, bias: bool = True,
        causal: bool = True, n_kv_heads: int | None = None, qk_norm: bool = False,
        norm: str = "rmsnorm", rope: Callable[[Tensor, int], Tensor] | None = None,
    ) -> None:
        super().__init__()
        check_heads(d_model, n_heads, n_kv_heads)
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.dropout = dropout
        self.causal = causal
        self.use_fused = True
        d_kv = self.n_kv_heads * (d_model // n_heads)
        self.sizes = (d_model, d_kv, d_kv)  # widths of Q, K and V in c_attn's output
        self.c_attn = nn.Linear(d_model, d_model + 2 * d_kv, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.qk_norm: Callable[[Tensor, list[int]], Tensor] | None = None
        if qk_norm:
            self.qk_norm = F.rms_norm if norm == "rmsnorm" else F.layer_norm
        self.rope = rope

    def forward(
        self, x: Tensor, need_weights: bool = False, cache: LayerKVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        q, k, v = self.c_attn(x).split(self.sizes, dim=-1)
        q = split_heads(q, self.n_heads)  # (B, H, T, d_k)
        k, v = split_heads(k, self.n_kv_heads), split_heads(v, self.n_kv_heads)
        if self.qk_norm is not None:  # every query and key gets RMS 1: |q . k| <= d_k
            q, k = self.qk_norm(q, [q.shape[-1]]), self.qk_norm(k, [k.shape[-1]])
        past = 0 if cache is None else cache.length
        if self.rope is not None:  # rotate by the positions P..P+T-1
            q, k = self.rope(q, past), self.rope(k, past)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, H_kv, P + T, d_k): the stored ones and the new
        context, weights = self._attend(q, k, v, past, need_weights)
        y = self.resid_dropout(self.c_proj(merge_heads(context)))
        return y, weights

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, past: int, need_weights: bool
                ) -> tuple[Tensor, Tensor | None]:
        dropout_p = self.dropout if self.training else 0.0
        new = q.shape[2]
        grouped = self.n_kv_heads != self.n_heads
        if need_weights or not self.use_fused or products.computes(q):
            if grouped:  # key-value head j serves query heads j r .. j r + r - 1
                r = self.n_heads // self.n_kv_heads
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
            if dropout_p == 0.0 and products.fuses(q):  # the same bits in one call
                context, weights = products.attention(q, k, v, past, self.causal)
                return context, weights if need_weights else None
            # One new query (a decoded token) may see every key: no mask to make or read.
            mask = causal_mask(new, q.device, past=past) if self.causal and new > 1 else None
            context, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p)
            return context, weights if need_weights else None
        mask, is_causal = None, self.causal and past == 0
        if self.causal and past > 0 and new > 1:  # one new query sees every stored key
            mask = causal_mask(new, q.device, past=past)
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
            enable_gqa=grouped)
        return context, None


# ----------------------------------------------------------------------------------
# What trained heads attend to
# ----------------------------------------------------------------------------------

_WEIGHT_TOLERANCE = 1e-6  # float rounding of a softmax, not a licence to clamp


def _float64(values: Any) -> np.ndarray:
    """A float64 NumPy copy of a tensor or array-like."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


def _layers(weights: Any) -> tuple[np.ndarray, bool]:
    """(L, B, H, T, T) float64 from one layer's (B, H, T, T), a stack or a list of layers;
    also whether the input was a stack (so the result keeps its L axis)."""
    if isinstance(weights, list | tuple):
        layers = [_float64(w) for w in weights]
        if len({w.shape for w in layers}) != 1:
            raise ValueError("each layer's weights must have the same shape (B, H, T, T), "
                             f"got {[w.shape for w in layers]}")
        array, stacked = np.stack(layers), True
    else:
        array = _float64(weights)
        stacked = array.ndim == 5
    shape = array.shape
    array = array if stacked else array[None]
    if array.ndim != 5 or array.shape[-1] != array.shape[-2] or 0 in array.shape:
        raise ValueError(f"weights must have shape (B, H, T, T) or (L, B, H, T, T), or be a "
                         f"list of L (B, H, T, T); got shape {shape}")
    low, high = float(array.min()), float(array.max())
    if low < -_WEIGHT_TOLERANCE or high > 1 + _WEIGHT_TOLERANCE:
        raise ValueError(f"weights must lie in [0, 1] (they are probabilities), found values "
                         f"in [{low:.4g}, {high:.4g}]; pass softmax outputs, not raw scores")
    return array, stacked


def mean_attention_distance(weights: Any) -> torch.Tensor:
    """How far back (or ahead) each head looks, on average, in positions.

    For query i the expected distance is sum_j w[i, j] |i - j|; it is averaged over
    the T queries (each query counts once) and the B sequences.

    Args:
        weights: (B, H, T, T) for one layer, or (L, B, H, T, T) / a list of L
            (B, H, T, T) tensors (what `GPT.forward_with_attention` returns) for a
            stack. Each row must be a probability distribution (entries in [0, 1],
            summing to 1).

    Returns: (H,) for one layer, (L, H) for a stack; float64.
    """
    array, stacked = _layers(weights)
    length = array.shape[-1]
    idx = np.arange(length)
    distance = np.abs(idx[:, None] - idx[None, :])  # (T, T): |i - j|
    per_query = (array * distance).sum(axis=-1)  # (L, B, H, T)
    result = torch.from_numpy(per_query.mean(axis=(1, 3)))  # (L, H)
    return result if stacked else result[0]


def _key_mask(keys: Any, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`keys` as a (B, T, T) boolean mask, and which (B, T) queries have a key in it."""
    mask = keys.detach().cpu().numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    try:
        mask = np.broadcast_to(mask, (batch, length, length))
    except ValueError:
        raise ValueError(f"keys has shape {mask.shape}, which does not broadcast to "
                         f"(B, T, T) = {(batch, length, length)}") from None
    has_key = np.asarray(mask.any(axis=-1))
    if not has_key.any():
        raise ValueError("keys selects no key for any query")
    return mask, has_key


def attention_mass(weights: Any, keys: Any) -> torch.Tensor:
    """The share of attention each head gives to a chosen set of keys, on average.

    For sequence b and query i, the mass is sum_j w[i, j] over the selected keys j;
    it is averaged over every (b, i) that has at least one selected key (a query
    with none, e.g. query 0 when the keys are "the previous position", is left out
    rather than counted as 0).

    Args:
        weights: as for `mean_attention_distance`: (B, H, T, T), (L, B, H, T, T) or
            a list of L (B, H, T, T).
        keys: boolean, broadcastable to (B, T, T) (sequence, query, key): (T, T) for
            a pattern of positions such as "the previous position", (B, 1, T) for a
            property of the key tokens such as "is a space", (B, T, T) for anything
            else.

    Returns: (H,) for one layer, (L, H) for a stack; float64, each in [0, 1].
    """
    array, stacked = _layers(weights)
    _, batch, _, length, _ = array.shape
    mask, has_key = _key_mask(keys, batch, length)  # (B, T, T), (B, T)
    mass = (array * mask[None, :, None]).sum(axis=-1)  # (L, B, H, T)
    mean = (mass * has_key[None, :, None]).sum(axis=(1, 3)) / has_key.sum()
    result = torch.from_numpy(mean)
    return result if stacked else result[0]
