"""Validated model configuration, named presets and reproducibility switches.

A `GPTConfig` is checked when it is made: a width that the heads cannot
share, a non-positive size or a dropout outside [0, 1) raises a `ValueError`
(pydantic's `ValidationError` is one) whose message names the field and the
rule it broke, long before a tensor of the wrong shape could.
"""

from __future__ import annotations

import os
import random
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The GPT-2 family (Radford et al., 2019): name -> (n_layers, d_model, n_heads).
GPT2_SIZES: dict[str, tuple[int, int, int]] = {
    "small": (12, 768, 12),
    "medium": (24, 1024, 16),
    "large": (36, 1280, 20),
    "xl": (48, 1600, 25),
}


class GPTConfig(BaseModel):
    """Every number that fixes the shape of a GPT.

    Attributes:
        vocab_size: V, the number of token ids the model reads and predicts.
        context_length: T_max, the longest sequence the model accepts.
        d_model: D, the width of every residual-stream vector.
        n_heads: H, attention heads per layer; each has width d_k = D / H.
        n_layers: L, the number of decoder blocks.
        d_ff: width of the feed-forward hidden layer (GPT-2: 4 D, the default).
        dropout: probability used by every dropout layer, in [0, 1).
        bias: whether linear layers and layer norms carry a bias.
        tie_weights: share the token embedding with the output head (GPT-2 does).
        positional: "learned" (GPT-2), "sinusoidal" (the original transformer) or
            "rope" (rotary: queries and keys rotated by their position, nothing added to
            the residual stream).
        layer_norm_eps: epsilon inside the square root of every normalisation.
        activation: the feed-forward non-linearity: "gelu_tanh", GPT-2's tanh
            approximation of GELU (needed to reproduce GPT-2's logits), "gelu", the
            exact x * Phi(x) (cheaper on a CPU; the CPU preset's choice), "relu2",
            max(0, x)^2, or "swiglu", SiLU(x W_g) * (x W_1) with a third matrix (its
            default d_ff is 8D/3, rounded up to a multiple of 8, for GPT-2's parameters).
        norm: "layernorm" (GPT-2) or "rmsnorm" (no centring, no bias).
        norm_weight: whether each normalisation has a learned gain (False: parameter-free).
        qk_norm: normalise each head's queries and keys over d_k (with ``norm``'s kind, no
            parameters) before their dot product, which bounds the attention logits.
        n_kv_heads: H_kv, key-value heads (grouped-query attention); None means H (GPT-2's
            multi-head attention), 1 is multi-query attention. Must divide n_heads.
        rope_base: the base of the rotary frequencies, theta_i = base^(-2i/d_k).
        zero_init: initialise each residual branch's output projection (``c_proj``) and,
            when untied, the head to zero, so that every block starts as the identity.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    context_length: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    d_ff: int = Field(gt=0, json_schema_extra={"derived_default": True})  # from D
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    bias: bool = True
    tie_weights: bool = True
    positional: Literal["learned", "sinusoidal", "rope"] = "learned"
    layer_norm_eps: float = Field(default=1e-5, gt=0.0)
    activation: Literal["gelu_tanh", "gelu", "relu2", "swiglu"] = "gelu_tanh"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_weight: bool = True
    qk_norm: bool = False
    n_kv_heads: int | None = Field(default=None, gt=0)
    rope_base: float = Field(default=10000.0, gt=1.0)
    zero_init: bool = False

    @model_validator(mode="before")
    @classmethod
    def _default_d_ff(cls, data: Any) -> Any:
        # GPT-2's feed-forward layer is four times as wide as the model.
        if isinstance(data, dict) and data.get("d_ff") is None:
            data = dict(data)
            d_model = data.get("d_model")
            if isinstance(d_model, int) and not isinstance(d_model, bool):
                # SwiGLU has three matrices, not two: 2/3 of the width keeps the count.
                swiglu = data.get("activation") == "swiglu"
                data["d_ff"] = -(-8 * d_model // 24) * 8 if swiglu else 4 * d_model
            else:
                data.pop("d_ff", None)
        return data

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model (={self.d_model}) must be divisible by n_heads (={self.n_heads}): "
                f"every head gets d_model / n_heads features"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_kv_heads (={self.n_kv_heads}) must divide n_heads (={self.n_heads}): "
                "each key-value head serves the same number of query heads"
            )
        if self.positional == "rope" and self.d_head % 2 != 0:
            raise ValueError(f"positional='rope' rotates pairs of features, so d_model / "
                             f"n_heads (={self.d_head}) must be even")
        return self

    @property
    def d_head(self) -> int:
        """d_k = d_v = D / H, the width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """H_kv, the number of key-value heads (H unless grouped-query attention)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    # ----- presets -----------------------------------------------------------------
    @classmethod
    def debug(cls, vocab_size: int = 16, **overrides: Any) -> GPTConfig:
        """The book's tiny configuration: T = 8, D = 4, H = 2, L = 2."""
        values: dict[str, Any] = dict(
            vocab_size=vocab_size, context_length=8, d_model=4, n_heads=2, n_layers=2
        )
        return cls(**(values | overrides))

    @classmethod
    def gpt2(cls, size: str = "small", **overrides: Any) -> GPTConfig:
        """One of the four GPT-2 models: "small" (124M), "medium", "large" or "xl"."""
        if size not in GPT2_SIZES:
            raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {sorted(GPT2_SIZES)}")
        n_layers, d_model, n_heads = GPT2_SIZES[size]
        values: dict[str, Any] = dict(
            vocab_size=50257, context_length=1024, d_model=d_model, n_heads=n_heads,
            n_layers=n_layers, dropout=0.1,
        )
        return cls(**(values | overrides))

    @classmethod
    def shakespeare_cpu(cls, vocab_size: int, **overrides: Any) -> GPTConfig:
        """The CPU recipe for character-level Shakespeare: L = 4, H = 4, D = 128, T = 64,
        exact GELU."""
        values: dict[str, Any] = dict(
            vocab_size=vocab_size, context_length=64, d_model=128, n_heads=4, n_layers=4,
            dropout=0.0, activation="gelu",
        )
        return cls(**(values | overrides))

    @classmethod
    def modern(cls, vocab_size: int, **overrides: Any) -> GPTConfig:
        """The modern layout at the CPU preset's size (`MODERN_LAYOUT` on top of
        `shakespeare_cpu`): rotary positions, parameter-free norms, QK-norm, ReLU^2,
        no biases, an untied head and zero-initialised output projections."""
        return cls.shakespeare_cpu(vocab_size, **(MODERN_LAYOUT | overrides))


#: What the modern layout changes in GPT-2's, field by field (`GPTConfig.modern`). Its norms
#: are LayerNorm without parameters, not RMSNorm: on a CPU PyTorch has a fused kernel for
#: LayerNorm and none for RMSNorm, which makes RMSNorm the slower of the two here, and the
#: loss they reach is the same to within a seed's spread.
MODERN_LAYOUT: dict[str, Any] = dict(
    positional="rope", norm="layernorm", norm_weight=False, qk_norm=True,
    activation="relu2", bias=False, tie_weights=False, zero_init=True,
)


def seed_all(seed: int, *, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and PyTorch's generators.

    With ``deterministic=True`` PyTorch also refuses operations that have no
    deterministic implementation (on a GPU some kernels are slower this way;
    on the CPU the cost is usually nil).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - the legacy global generator is what users call
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
