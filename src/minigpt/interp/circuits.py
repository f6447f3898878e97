"""A head's QK and OV circuits, composition between heads, and whether a head copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import Tensor

from minigpt.interp.heads import (
    Head,
    blocks,
    head_slice,
)
from minigpt.model import GPT
from minigpt.nn import LayerNorm


def circuits(model: GPT, layer: int, head: int) -> tuple[Tensor, Tensor]:
    """A head's QK and OV circuits, (D, D) each, as maps of its layer's normalised input.

    W_QK = W_Q^T W_K: the score of query x_t and key x_s is x_t^T W_QK x_s / sqrt(d_k)
    (biases aside). W_OV = W_O W_V: a key x_s that gets all the attention adds W_OV x_s to
    the stream (the value bias and the projection's bias aside). Both have rank at most d_k.
    """
    attn = blocks(model)[layer].attn
    D, cols = model.config.d_model, head_slice(model, head)
    w_q, w_k, w_v = torch.split(attn.c_attn.weight, list(attn.sizes), dim=0)
    with torch.no_grad():
        qk = w_q[cols].T @ w_k[cols]
        ov = attn.c_proj.weight[:, cols] @ w_v[cols]
    assert qk.shape == ov.shape == (D, D)
    return qk, ov


def composition(model: GPT, earlier: Head, later: Head,
                kind: Literal["q", "k", "v"] = "k") -> float:
    """How much the ``later`` head's queries, keys or values read what the ``earlier`` head
    writes (Elhage et al.'s composition score, in [0, 1]):
    ||M W_OV|| / (||M|| ||W_OV||) in Frobenius norms, with M = W_QK^T (queries), W_QK
    (keys) or W_OV (values) of the later head, whose norm's gain is folded into it (the
    norm's centring and per-position scale are left out)."""
    if not earlier[0] < later[0]:
        raise ValueError(f"the earlier head's layer comes first: got earlier={earlier}, "
                         f"later={later}")
    qk, ov_later = circuits(model, *later)
    _, ov = circuits(model, *earlier)
    gain = cast(Tensor | None, blocks(model)[later[0]].ln_1.weight)
    if gain is not None:  # the later head reads gain * x / scale (+ bias)
        qk, ov_later = gain[:, None] * qk * gain[None, :], ov_later * gain[None, :]
    reader = {"q": qk.T, "k": qk, "v": ov_later}[kind]
    with torch.no_grad():
        return float(torch.linalg.norm(reader @ ov)
                     / (torch.linalg.norm(reader) * torch.linalg.norm(ov)))


def _norm_linear(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """The linear part of a norm on rows x (..., D): LayerNorm's centring, then the gain
    (the per-row scale and the bias left out; an RMSNorm does not centre)."""
    if isinstance(norm, LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    gain = cast(Tensor | None, norm.weight)
    return x if gain is None else x * gain.to(x.device, x.dtype)


def _wide(x: Tensor) -> Tensor:
    """``x`` in float64 on the CPU (where any device's weights can go: MPS has no float64)."""
    return x.to("cpu", torch.float64)


def effective_embedding(model: GPT) -> Tensor:
    """(V, D): each token's embedding plus what the MLP of layer 0 adds to it, the stream at
    a position holding the token as the later layers read it, attention and positions
    aside (row t: W_E[t] + MLP_0(norm_2(W_E[t])))."""
    first = blocks(model)[0]
    with torch.no_grad():
        embedding = model.wte.weight
        effective: Tensor = embedding + first.mlp(first.ln_2(embedding))
    return effective


def full_ov_circuit(model: GPT, layer: int, head: int, inputs: Tensor | None = None,
                    ) -> tuple[Tensor, Tensor]:
    """A head's OV circuit from tokens to logits, as two float64 factors (V, d_k) and
    (d_k, V): their product's column t holds the logits the head adds when it attends with
    all its weight to a position holding token t (Elhage et al.'s W_U W_OV W_E).

    ``inputs`` (V, D) is the stream at a position holding each token (by default the token
    embeddings; `effective_embedding` adds what layer 0's MLP writes). Each column goes
    through the linear part of the layer's norm, the head's values and output columns, the
    linear part of the final norm and the unembedding. Left out: the norms' per-vector
    scales (a positive factor per column, which changes no column's ranking) and every
    bias (a vector added to every column alike).

    Args:
        layer, head: the head, 0 <= layer < L and 0 <= head < H.
        inputs: (V, D) or None.
    """
    c = model.config
    if not (0 <= layer < c.n_layers and 0 <= head < c.n_heads):
        raise ValueError(f"no head ({layer}, {head}): layers 0 to {c.n_layers - 1}, heads 0 "
                         f"to {c.n_heads - 1}")
    if c.kv_heads != c.n_heads:
        raise ValueError(f"a head's own value map needs one key-value head a head (GPT-2's "
                         f"attention); this model shares {c.kv_heads} among {c.n_heads}")
    if inputs is None:
        inputs = model.wte.weight
    if inputs.shape != (c.vocab_size, c.d_model):
        raise ValueError(f"inputs must be (V, D) = ({c.vocab_size}, {c.d_model}): one "
                         f"stream vector a token, got {tuple(inputs.shape)}")
    attn, cols = blocks(model)[layer].attn, head_slice(model, head)
    w_v = torch.split(attn.c_attn.weight, list(attn.sizes), dim=0)[2][cols]  # (d_k, D)
    w_o = attn.c_proj.weight[:, cols]  # (D, d_k)
    with torch.no_grad():
        read = _norm_linear(blocks(model)[layer].ln_1, _wide(inputs))  # (V, D)
        into = _wide(w_v) @ read.T  # (d_k, V)
        written = _norm_linear(model.ln_f, _wide(w_o).T)  # (d_k, D): each column's write
        out = _wide(model.lm_head.weight) @ written.T  # (V, d_k)
    return out, into


@dataclass(frozen=True)
class Copying:
    """How much a map from tokens to logits, M = out @ into (V, V), copies: ``own_top``, the
    share of tokens t whose own logit is the highest of column t (chance 1 / V); ``eigen``,
    the sum of M's eigenvalues over the sum of their absolute values, in [-1, 1] (Elhage et
    al.'s summary: 1 when every eigenvalue is positive, near 0 for a random map; 0 for
    the zero map)."""

    own_top: float
    eigen: float


def copying_scores(out: Tensor, into: Tensor) -> Copying:
    """The `Copying` of the map ``out`` @ ``into``: (V, k) and (k, V), e.g. the factors of
    `full_ov_circuit`. The eigenvalues are those of the k x k product into @ out, which are
    M's nonzero ones."""
    if out.ndim != 2 or into.ndim != 2 or out.shape != into.shape[::-1]:
        raise ValueError(f"out and into must be (V, k) and (k, V), got {tuple(out.shape)} "
                         f"and {tuple(into.shape)}")
    with torch.no_grad():
        M = out.double() @ into.double()
        own = (M.argmax(dim=0) == torch.arange(len(M))).double().mean()
        eigenvalues = torch.linalg.eigvals(into.double() @ out.double())
        size = float(eigenvalues.abs().sum())
        eigen = float(eigenvalues.sum().real) / size if size > 0 else 0.0
    return Copying(float(own), eigen)
