"""Validated configurations, named presets and reproducibility switches.

A model's shape is a `GPTConfig`, a training run's settings a `TrainConfig`. Both are
checked when they are made: a width that the heads cannot share, a non-positive size, a
dropout outside [0, 1) or a warm-up longer than the decay raises a `ValueError`
(pydantic's `ValidationError` is one) whose message names the field and the rule it
broke, long before a tensor of the wrong shape could.
"""

from __future__ import annotations

import numbers
import os
import random
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

#: The GPT-2 family (Radford et al., 2019): name -> (n_layers, d_model, n_heads).
GPT2_SIZES: dict[str, tuple[int, int, int]] = {
    "small": (12, 768, 12),
    "medium": (24, 1024, 16),
    "large": (36, 1280, 20),
    "xl": (48, 1600, 25),
}


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Check a user's integer where it enters: ``value`` must be an int (not a bool) from
    ``low`` to ``high`` (None: no upper bound); else ValueError naming ``name``, what is
    allowed and what was given."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not low <= int(value) <= (int(value) if high is None else high)):
        allowed = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")


def check_positive(name: str, value: object) -> None:
    """`check_int` for a count: an int >= 1."""
    check_int(name, value, 1)


def check_heads(d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
    """The heads share the width: ValueError unless n_heads divides d_model and n_kv_heads
    (None: n_heads) divides n_heads."""
    if d_model % n_heads != 0:
        raise ValueError(f"d_model (={d_model}) must be divisible by n_heads (={n_heads}): "
                         "every head gets d_model / n_heads features")
    if n_kv_heads is not None and n_heads % n_kv_heads != 0:
        raise ValueError(f"n_kv_heads (={n_kv_heads}) must divide n_heads (={n_heads}): "
                         "each key-value head serves the same number of query heads")


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
        rope_base: the base of the rotary frequencies, omega_i = base^(-2i/d_k).
        zero_init: initialise each residual branch's output projection (``c_proj``) and,
            when untied, the head to zero, so that every block starts as the identity.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(gt=0)
    context_length: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    d_ff: int = Field(gt=0)  # default: from d_model and activation
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
        check_heads(self.d_model, self.n_heads, self.n_kv_heads)
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


def check_device(device: str) -> str:
    """``device`` if a model can run on it here: cpu, cuda or cuda:N (N below the number of
    GPUs), or mps where there is one; otherwise ValueError saying what is allowed."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{device!r} is not a torch device; use cpu, cuda or cuda:N"
                         ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{device!r}: CUDA is not available on this machine; use cpu")
        if dev.index is not None and dev.index >= (n := torch.cuda.device_count()):
            raise ValueError(f"{device!r}: this machine has {n} GPU(s), cuda:0 to "
                             f"cuda:{n - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{device!r}: MPS is not available on this machine; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"{device!r}: models run on cpu, cuda or cuda:N (or mps)")
    return device


#: A device given by a person (a setting, a command-line flag), checked where it enters.
Device = Annotated[str, AfterValidator(check_device)]


class TrainConfig(BaseModel):
    """Every setting of a training run except the model's shape (that is a `GPTConfig`).

    The defaults are nanoGPT's CPU recipe for character-level Shakespeare.

    Attributes:
        batch_size: B, sequences per micro-batch (of each process).
        grad_accum: micro-batches whose gradients add up to one optimiser step; a step
            sees B * grad_accum sequences.
        max_steps: optimiser steps of the whole run.
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: the floor the cosine decays to (0 <= min_lr <= lr).
        warmup_steps: steps of linear warm-up from lr / warmup_steps to lr (by default
            100, cut to decay_steps, so that a short run needs no flag).
        decay_steps: the step at which the cosine reaches min_lr (default: max_steps).
        weight_decay: AdamW's decoupled weight decay, applied to matrices only.
        beta1, beta2: AdamW's moment decay rates, in [0, 1).
        grad_clip: largest global gradient norm; 0 turns clipping off.
        eval_interval: evaluate (and checkpoint) every this many steps, and at the end.
        eval_steps: batches per split in each evaluation.
        eval_full: score the validation loss of each evaluation on the whole validation
            split (`minigpt.losses.full_loss`) instead of on ``eval_steps`` batches: slower, free of
            sampling noise (what comparing the time two recipes take to a loss needs).
        seed: seeds the initial weights, the batches, dropout and the evaluation's
            batches, each its own stream (`stream_seed`).
        bf16: run forward passes under bf16 autocast.
        device: "cpu", "cuda", "cuda:1", ...
        optimizer: "adamw" for every parameter, or "muon": Muon for the hidden matrices
            (the 2-D weights inside the blocks) and AdamW for the rest.
        muon_lr: Muon's peak learning rate (it follows the same schedule as lr).
        muon_momentum: Muon's momentum (Nesterov).
        schedule: "cosine" (warm-up, then a cosine decay to min_lr at decay_steps) or
            "trapezoid" (warm-up, a constant lr, then a linear cool-down to min_lr over
            the last ``cooldown_fraction`` of decay_steps).
        cooldown_fraction: the trapezoid's cool-down, as a fraction of decay_steps.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(default=12, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    max_steps: int = Field(default=2000, ge=0)
    lr: float = Field(default=1e-3, gt=0.0)
    min_lr: float = Field(default=1e-4, ge=0.0)
    warmup_steps: int = Field(default=100, ge=0)
    decay_steps: int | None = Field(default=None, ge=0)
    weight_decay: float = Field(default=0.1, ge=0.0)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    eval_interval: int = Field(default=250, ge=1)
    eval_steps: int = Field(default=20, ge=1)
    eval_full: bool = False
    seed: int = Field(default=1337, ge=0)
    bf16: bool = False
    device: Device = "cpu"
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = Field(default=0.02, gt=0.0)
    muon_momentum: float = Field(default=0.95, ge=0.0, lt=1.0)
    schedule: Literal["cosine", "trapezoid"] = "cosine"
    cooldown_fraction: float = Field(default=0.4, gt=0.0, le=1.0)

    @model_validator(mode="before")
    @classmethod
    def _default_schedule(cls, data: Any) -> Any:
        # Resolved once, here, so that a checkpoint keeps the schedule it was trained with
        # even if a resumed run is given more steps. The default warm-up is cut to the
        # decay steps, so a short run (max_steps=2) works without naming the warm-up.
        if isinstance(data, dict):
            data = dict(data)
            if data.get("decay_steps") is None:
                data["decay_steps"] = data.get("max_steps", cls.model_fields["max_steps"].default)
            if "warmup_steps" not in data and isinstance(data["decay_steps"], int):
                default = cls.model_fields["warmup_steps"].default
                data["warmup_steps"] = max(0, min(default, data["decay_steps"]))
        return data

    @model_validator(mode="after")
    def _check_relations(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr (={self.min_lr}) must not exceed lr (={self.lr})")
        assert self.decay_steps is not None
        if self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"warmup_steps (={self.warmup_steps}) must not exceed decay_steps "
                f"(={self.decay_steps}, by default max_steps): the cosine decay starts after "
                "the warm-up; lower warmup_steps or raise max_steps"
            )
        return self

    @classmethod
    def modern(cls, **overrides: Any) -> TrainConfig:
        """The modern recipe's settings (`MODERN_TRAINING`) under ``overrides``; a run
        shorter than the recipe's warm-up warms up over the whole run."""
        values = MODERN_TRAINING | overrides
        if "warmup_steps" not in overrides and "max_steps" in overrides:
            values["warmup_steps"] = min(values["warmup_steps"], overrides["max_steps"])
        return cls(**values)

    @property
    def schedule_end(self) -> int:
        """The step at which the cosine reaches min_lr (decay_steps, resolved)."""
        return self.max_steps if self.decay_steps is None else self.decay_steps


#: The modern recipe's training settings (`python -m minigpt train --recipe modern`, with
#: `minigpt.config.MODERN_LAYOUT`): Muon on the hidden matrices, AdamW without weight decay
#: on the rest, a short warm-up, a constant rate and a linear cool-down to 0, and larger
#: batches than GPT-2's CPU recipe (Muon's orthogonalisation costs the same per step
#: whatever the batch, so it pays with more tokens a step).
MODERN_TRAINING: dict[str, Any] = dict(
    optimizer="muon", muon_lr=0.02, lr=2e-2, min_lr=0.0, beta2=0.95, weight_decay=0.0,
    warmup_steps=10, schedule="trapezoid", cooldown_fraction=0.4, batch_size=48,
)


#: The environment variable that redraws every random stream of every run: a whole number
#: added to each run's seed in `stream_seed`, so that the book can be trained and read under
#: another draw of its random numbers (`make redraw`, docs/redraw.md). Unset or 0, nothing
#: moves.
SEED_SHIFT_VARIABLE = "MINIGPT_SEED_SHIFT"


def read_seed_shift(environ: Mapping[str, str] = os.environ) -> int:
    """The redraw `SEED_SHIFT_VARIABLE` asks for in ``environ``: 0 when it is unset or empty,
    else the whole number it holds, from 0 to 2**32 - 1."""
    text = environ.get(SEED_SHIFT_VARIABLE, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) >= 2**32:
        raise ValueError(f"{SEED_SHIFT_VARIABLE}={text!r}: use a whole number from 0 to "
                         f"{2**32 - 1} (another draw of every random stream), or leave it "
                         "unset (the book's own draw)")
    return int(text)


#: This process's redraw, read once when the package is imported (a cached model's key
#: holds it: `minigpt.recipes.pretrained.environment`).
SEED_SHIFT = read_seed_shift()


def stream_seed(seed: int, name: str, *index: int, shift: int = SEED_SHIFT) -> int:
    """The seed of the random stream ``name`` (and ``index``, e.g. a process's rank) of a
    run seeded ``seed``: a 64-bit number NumPy's `~numpy.random.SeedSequence` derives from
    them all, so that every stream of a run is independent of its others and of every
    stream of another seed's run. A run that seeded each stream with ``seed`` itself would
    draw its batches from the very numbers that drew its initial weights (PyTorch's CPU
    generators are one algorithm), and ``seed + 1`` for a second stream would be the next
    seed's first. Names in use: ``"init"``, ``"dropout"`` (and the rank), ``"batches"`` and
    ``"eval"`` (`minigpt.train.train`); the book's recipes name their own. Under a redraw
    (`SEED_SHIFT`, or ``shift``) the run's seed and the shift together seed every stream:
    other numbers for every run, still independent of each other."""
    assert seed >= 0 and all(i >= 0 for i in index), (seed, index)
    key = (len(name), *name.encode(), *index)  # one key a (name, index): no two alike
    entropy = seed if shift == 0 else [seed, shift]  # [seed, 0] would be seed's own entropy
    return int(np.random.SeedSequence(entropy, spawn_key=key).generate_state(1, np.uint64)[0])


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
