"""The building blocks of a GPT besides attention, each small enough to read in one go:
embeddings, positional encodings (learned, sinusoidal, rotary), norms and activations, the
feed-forward network, and the decoder block that joins them to `attention.MultiHeadAttention`.

Shapes use the book's notation: B batch, T positions, D model width, H heads,
d_k = D / H per-head width, d_ff feed-forward width, V vocabulary size.
Positions are 0..T-1 in code (1..T in the maths).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt import products
from minigpt.attention import LayerKVCache, MultiHeadAttention

# ----------------------------------------------------------------------------------
# Embeddings and positions
# ----------------------------------------------------------------------------------


class TokenEmbedding(nn.Module):
    """Look up one learned D-vector per token id: row ``x`` of ``W_e``.

    Args:
        vocab_size: V, the number of rows of ``W_e``.
        d_model: D, the width of each row.

    Shapes: ids (B, T) int64 -> (B, T, D); ``weight`` is W_e with shape (V, D).
    """

    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw W_e from N(0, 0.02^2), GPT-2's rule (`GPT` draws it again once the
        model is built: GPT-2's initialisation runs over every module, nn.Linear's)."""
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


def one_hot_embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """The same lookup written as a matrix product: one_hot(ids) @ W_e.

    Args:
        ids: (..., T) int64 token ids in [0, V).
        weight: W_e, (V, D).

    Returns: (..., T, D); equal to `TokenEmbedding` (each row of the one-hot
    matrix selects exactly one row of W_e).
    """
    one_hot = F.one_hot(ids, num_classes=weight.shape[0]).to(weight.dtype)
    return one_hot @ weight


def sinusoidal_encoding(num_positions: int, d_model: int, base: float = 10000.0) -> Tensor:
    """The fixed encoding of the original transformer, positions 0..T-1.

    P[p, 2i] = sin(p / base^(2i/D)) and P[p, 2i+1] = cos(p / base^(2i/D)).

    Args:
        num_positions: T, how many positions (rows).
        d_model: D, how many dimensions (columns).
        base: the geometric progression's base (10000 in the paper).

    Returns: P with shape (T, D), float32.
    """
    if num_positions < 1 or d_model < 1:
        raise ValueError(
            f"num_positions and d_model must be positive, got {num_positions} and {d_model}"
        )
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # 0, 2, 4, ...
    angle = position / base ** (two_i / d_model)  # (T, ceil(D/2))
    encoding = torch.zeros(num_positions, d_model, dtype=torch.float64)
    encoding[:, 0::2] = torch.sin(angle)
    encoding[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return encoding.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids in a non-persistent buffer: never trained, moved with the
    model (``.to(device)``), not saved in the state dict (they are recomputed).

    Shapes: positions (T,) int64 -> (T, D).
    """

    encoding: Tensor

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.register_buffer("encoding", sinusoidal_encoding(context_length, d_model),
                             persistent=False)

    def forward(self, positions: Tensor) -> Tensor:
        return self.encoding[positions]


class LearnedPositionalEmbedding(nn.Module):
    """One trained D-vector per position, GPT-2's choice.

    Shapes: positions (T,) int64 -> (T, D); ``weight`` is (T_max, D).
    """

    def __init__(self, context_length: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(context_length, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the table from N(0, 0.02^2), GPT-2's rule (`GPT` draws it again)."""
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, positions: Tensor) -> Tensor:
        return F.embedding(positions, self.weight)


# ----------------------------------------------------------------------------------
# Normalisation and activation
# ----------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """Layer normalisation written out: (x - mean) / sqrt(var + eps) * gamma + beta.

    Each of the B x T vectors is normalised over its own D features with the
    population variance (divide by D, not D - 1); eps sits inside the square
    root. gamma (``weight``) and beta (``bias``) are shared by all positions.

    Shapes: (..., D) -> (..., D).

    ``use_fused`` (the default) hands the same computation to PyTorch's one
    kernel, `torch.nn.functional.layer_norm`, which is faster than the ten
    separate operations below and their backward passes. Set it to False to
    run the formula as written; the two agree to float rounding, and both
    with `torch.nn.LayerNorm`.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None
        self.use_fused = True

    def forward(self, x: Tensor) -> Tensor:
        if self.use_fused:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        x_hat = (x - mean) * torch.rsqrt(var + self.eps)
        out = x_hat * self.weight
        return out + self.bias if self.bias is not None else out


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU(x) = x * Phi(x), Phi the standard normal CDF.

    ``approximate="none"`` uses erf exactly; ``"tanh"`` uses GPT-2's
    approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    """
    if approximate == "none":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


class RMSNorm(nn.Module):
    """Root-mean-square normalisation: x / sqrt(mean(x^2) + eps) * gamma.

    Layer normalisation without the centring and without beta: each vector is divided by
    its root mean square over its D features, so it comes out with RMS 1 (up to eps).
    Rescaling the input by any c > 0 leaves the output unchanged. With
    ``weight=False`` there is no gamma either and the norm has no parameters.

    Shapes: (..., D) -> (..., D).
    """

    def __init__(self, d_model: int, eps: float = 1e-5, weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model)) if weight else None

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * self.weight if self.weight is not None else x


def make_norm(kind: str, d_model: int, *, eps: float = 1e-5, bias: bool = True,
              weight: bool = True) -> nn.Module:
    """A `LayerNorm` (``kind="layernorm"``) or an `RMSNorm` (``"rmsnorm"``) of width D.

    Without ``weight`` the norm has no learned gain (and, for LayerNorm, no bias either).
    """
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps, weight=weight)
    norm = LayerNorm(d_model, eps=eps, bias=bias and weight)
    if not weight:
        norm.weight.requires_grad_(False)  # a constant gain of 1
    return norm


def relu2(x: Tensor) -> Tensor:
    """ReLU squared, max(0, x)^2: zero for x < 0, then a parabola."""
    if products.fuses(x):  # the same bits in one pass, forward and back
        return products.relu_squared(x)
    return F.relu(x).square()


# ----------------------------------------------------------------------------------
# Rotary positions
# ----------------------------------------------------------------------------------


def rope_angles(num_positions: int, d_head: int, base: float = 10000.0
                ) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles p omega_i, each (T, d_k / 2), float32.

    omega_i = base^(-2i / d_k) for i = 0 .. d_k/2 - 1 (``d_head`` = d_k): the frequencies
    of the sinusoidal encoding over a head's features, one per pair.
    """
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (T, 1)
    omega = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angle = position * omega  # (T, d_k / 2)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pair i of each vector, (x_i, x_{i + d_k/2}), by the angle p omega_i.

    Args:
        x: queries or keys, (B, H, T, d_k).
        cos, sin: (T, d_k / 2), the angles of the T positions of x.

    Returns: (B, H, T, d_k); each pair is turned, its length kept.
    """
    x1, x2 = x.chunk(2, dim=-1)  # the two coordinates of each pair, (B, H, T, d_k / 2)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class RotaryEmbedding(nn.Module):
    """The rotary angles of positions 0..T_max-1 in non-persistent buffers (recomputed,
    never saved), and their application to queries or keys at positions P..P+T-1.

    Shapes: x (B, H, T, d_k), offset P -> (B, H, T, d_k).
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, context_length: int, d_head: int, base: float = 10000.0) -> None:
        super().__init__()
        cos, sin = rope_angles(context_length, d_head, base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        end = offset + x.shape[-2]
        return apply_rope(x, self.cos[offset:end], self.sin[offset:end])


# ----------------------------------------------------------------------------------
# Feed-forward network and the decoder block
# ----------------------------------------------------------------------------------


_GELU_FORMS = {"gelu_tanh": "tanh", "gelu": "none"}  # activation -> nn.GELU's approximate
ACTIVATIONS = ("gelu_tanh", "gelu", "relu2", "swiglu")


class FeedForward(nn.Module):
    """Position-wise MLP: act(x W_1 + b_1) W_2 + b_2, applied to each position alone.

    Names follow GPT-2: ``c_fc`` (D -> d_ff) and ``c_proj`` (d_ff -> D). The activation
    is GPT-2's tanh approximation of GELU, `gelu(x, "tanh")` (``"gelu_tanh"``), the exact
    `gelu(x)` (``"gelu"``) or `relu2` (``"relu2"``). ``"swiglu"`` adds a gate
    ``c_gate`` (D -> d_ff): SiLU(x W_g) * (x W_1), then W_2.

    Shapes: (B, T, D) -> (B, T, D).
    """

    def __init__(self, d_model: int, d_ff: int, *, dropout: float = 0.0, bias: bool = True,
                 activation: str = "gelu_tanh") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got "
                             f"{activation!r}")
        self.activation = activation
        self.c_fc = nn.Linear(d_model, d_ff, bias=bias)
        if activation in _GELU_FORMS:
            self.gelu = nn.GELU(approximate=_GELU_FORMS[activation])
        if activation == "swiglu":
            self.c_gate = nn.Linear(d_model, d_ff, bias=bias)
        self.c_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "relu2":
            hidden = relu2(self.c_fc(x))
        elif self.activation == "swiglu":
            hidden = F.silu(self.c_gate(x)) * self.c_fc(x)
        else:
            hidden = self.gelu(self.c_fc(x))
        out: Tensor = self.dropout(self.c_proj(hidden))
        return out


class Block(nn.Module):
    """One pre-LN decoder block: x + Attn(LN(x)), then x + FFN(LN(x)).

    Normalising the input of each sub-layer (not its output, as the original
    transformer's post-LN did) keeps an identity path from the block's input
    to its output, which is what lets deep GPT-2s train stably.

    Shapes: (B, T, D) -> (B, T, D), plus attention weights (B, H, T, T) when
    asked for.

    The keyword arguments after ``activation`` choose the modern layout's parts:
    ``norm`` and ``norm_weight`` (see `make_norm`), and ``n_kv_heads``, ``qk_norm`` and
    ``rope`` (see `MultiHeadAttention`).
    """

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, *, dropout: float = 0.0,
        bias: bool = True, eps: float = 1e-5, activation: str = "gelu_tanh",
        norm: str = "layernorm", norm_weight: bool = True, n_kv_heads: int | None = None,
        qk_norm: bool = False, rope: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.ln_1 = make_norm(norm, d_model, eps=eps, bias=bias, weight=norm_weight)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias,
                                       n_kv_heads=n_kv_heads, qk_norm=qk_norm, norm=norm,
                                       rope=rope)
        self.ln_2 = make_norm(norm, d_model, eps=eps, bias=bias, weight=norm_weight)
        self.mlp = FeedForward(d_model, d_ff, dropout=dropout, bias=bias,
                               activation=activation)

    def forward(
        self, x: Tensor, need_weights: bool = False, cache: LayerKVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        attended, weights = self.attn(self.ln_1(x), need_weights=need_weights, cache=cache)
        x = x + attended
        x = x + self.mlp(self.ln_2(x))
        return x, weights


class PostLNBlock(Block):
    """The original transformer's post-LN ordering: LN(x + Attn(x)), then LN(x + FFN(x)).

    Kept for comparison only (GPT uses the pre-LN `Block`): here every path
    from input to output passes through a layer norm, so no sub-layer can be
    skipped by an identity map.
    """

    def forward(
        self, x: Tensor, need_weights: bool = False, cache: LayerKVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        attended, weights = self.attn(x, need_weights=need_weights, cache=cache)
        x = self.ln_1(x + attended)
        x = self.ln_2(x + self.mlp(x))
        return x, weights
