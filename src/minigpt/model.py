"""The GPT: embeddings, a stack of pre-LN blocks, a final norm and a (tied) head.

GPT-2's layout by default; `GPTConfig`'s switches give the modern one (rotary positions,
RMSNorm, QK-norm, ReLU^2 or SwiGLU, grouped-query attention, untied zero-initialised
projections).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from minigpt.attention import KVCache
from minigpt.config import GPTConfig
from minigpt.nn import (
    Block,
    LayerNorm,
    LearnedPositionalEmbedding,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    make_norm,
)


class GPT(nn.Module):
    """A decoder-only transformer language model with GPT-2's layout.

    ``GPT(config)(input_ids)`` maps ids (B, T) to next-token logits (B, T, V):
    row t of the output scores every token of the vocabulary as x_{t+1} given
    x_0..x_t. Parameter names follow GPT-2 (``wte``, ``wpe``, ``h``, ``ln_f``,
    ``lm_head``) so that its weights load one to one.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.wte = TokenEmbedding(c.vocab_size, c.d_model)
        self.wpe = _positional_embedding(c)  # None with rotary positions
        self.drop = nn.Dropout(c.dropout)
        self.h = nn.ModuleList(
            Block(c.d_model, c.n_heads, c.d_ff, dropout=c.dropout, bias=c.bias,
                  eps=c.layer_norm_eps, activation=c.activation, norm=c.norm,
                  norm_weight=c.norm_weight, n_kv_heads=c.n_kv_heads, qk_norm=c.qk_norm,
                  rope=_rotary(c))
            for _ in range(c.n_layers)
        )
        self.ln_f = make_norm(c.norm, c.d_model, eps=c.layer_norm_eps, bias=c.bias,
                              weight=c.norm_weight)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_weights:
            # One matrix W_e (V, D) both embeds tokens and scores them (W_s = W_e^T).
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2: each residual branch's output projection is scaled by 1/sqrt(2L), since
        # 2L branches add their outputs into the residual stream; zero_init starts them
        # (and an untied head) at 0, so that every block begins as the identity.
        residual_std = 0.0 if c.zero_init else 0.02 / math.sqrt(2 * c.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=residual_std)
        if c.zero_init and not c.tie_weights:
            nn.init.zeros_(self.lm_head.weight)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation: weights ~ N(0, 0.02), biases 0, layer norms at identity.
        # Run over every module once the model is built, as GPT-2's is: the embeddings
        # draw their rule (reset_parameters) a second time, as nn.Linear's weights do.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, TokenEmbedding | LearnedPositionalEmbedding):
            module.reset_parameters()
        elif isinstance(module, LayerNorm | RMSNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if isinstance(module, LayerNorm) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_parameters(self, *, exclude_positional: bool = False) -> int:
        """Number of trainable values; a tied matrix counts once."""
        total = sum(p.numel() for p in self.parameters()  # parameters() de-duplicates
                    if p.requires_grad)  # (a parameter-free norm's constant gain is not)
        if exclude_positional and isinstance(self.wpe, LearnedPositionalEmbedding):
            total -= self.wpe.weight.numel()
        return total

    def kv_cache_bytes(self, length: int, batch_size: int = 1) -> int:
        """Bytes a full cache of ``length`` positions takes: 2 L T H_kv d_k values (keys and
        values, every layer) per sequence, at the parameters' element size."""
        c = self.config
        element = next(self.parameters()).element_size()
        return 2 * c.n_layers * length * c.kv_heads * c.d_head * element * batch_size

    def new_cache(self) -> KVCache:
        """An empty `KVCache` for this model: one layer cache per block, T_max positions each."""
        return KVCache(self.config.n_layers, self.config.context_length)

    def embed(self, input_ids: Tensor, past: int = 0) -> Tensor:
        """input_ids (B, T) at positions P..P+T-1 (``past`` = P) -> the blocks' input (B, T, D):
        token embeddings plus absolute positions (rotary ones act inside attention), dropped out.

        Positions run to ``context_length`` - 1 only: a longer sequence is refused here.
        """
        length = input_ids.shape[1]
        if past + length > self.config.context_length:
            raise ValueError(_too_long(past, length, self.config.context_length))
        x = self.wte(input_ids)  # (B, T, D)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(past, past + length, device=x.device))
        embedded: Tensor = self.drop(x)
        return embedded

    def forward(
        self, input_ids: Tensor, *, cache: KVCache | None = None, last_only: bool = False
    ) -> Tensor:
        """input_ids (B, T) int64 -> logits (B, T, V).

        With a ``cache`` holding P positions, ``input_ids`` are positions
        P..P+T-1 of the sequences; they are added to the cache and attend to
        everything in it, and P + T may not exceed ``context_length``.
        ``last_only`` returns the logits of the last position only, (B, 1, V),
        and skips the head's (T - 1) x D x V multiply-adds for the others.
        """
        x = self.embed(input_ids, past=0 if cache is None else cache.length)
        for i, block in enumerate(self.h):
            x, _ = block(x, cache=None if cache is None else cache.layers[i])
        if last_only:
            x = x[:, -1:, :]  # (B, 1, D): generation needs only the next token's scores
        x = self.ln_f(x)
        logits: Tensor = self.lm_head(x)  # (B, T, V)
        return logits

    def forward_with_attention(
        self, input_ids: Tensor, *, cache: KVCache | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits (B, T, V) and each layer's attention weights, a list of L tensors (B, H, T, T).

        `forward` with the written-out attention, which keeps its weights; with a cache
        holding P positions the weights are (B, H, T, P + T).
        """
        x = self.embed(input_ids, past=0 if cache is None else cache.length)
        maps: list[Tensor] = []
        for i, block in enumerate(self.h):
            x, weights = block(x, need_weights=True,
                               cache=None if cache is None else cache.layers[i])
            assert weights is not None, "need_weights returns the weights"
            maps.append(weights)
        logits: Tensor = self.lm_head(self.ln_f(x))
        return logits, maps

    def hidden_states(self, input_ids: Tensor, *, cache: KVCache | None = None) -> Tensor:
        """input_ids (B, T) -> the final norm's output (B, T, D): what the head reads.

        `forward` without the head, for heads of other tasks (`minigpt.posttrain.classify`).
        """
        x = self.embed(input_ids, past=0 if cache is None else cache.length)
        for i, block in enumerate(self.h):
            x, _ = block(x, cache=None if cache is None else cache.layers[i])
        hidden: Tensor = self.ln_f(x)
        return hidden

    # ----- loading GPT-2 weights -----------------------------------------------------
    @classmethod
    def from_gpt2_state_dict(cls, state_dict: Mapping[str, Tensor], config: GPTConfig) -> GPT:
        """Build a GPT from the tensors of a Hugging Face ``GPT2LMHeadModel``.

        Hugging Face stores GPT-2's linear maps as ``Conv1D`` with weights of
        shape (in, out); ``nn.Linear`` keeps (out, in), so those four are
        transposed. Buffers such as ``attn.bias`` (its causal mask) are ignored.
        """
        gpt2_layout = GPTConfig(**{k: v for k, v in config.model_dump().items()
                                   if k not in (*_MODERN_SWITCHES, "tie_weights")})
        changed = [f"{k}={getattr(config, k)!r} (GPT-2: {getattr(gpt2_layout, k)!r})"
                   for k in (*_MODERN_SWITCHES, "tie_weights")
                   if getattr(config, k) != getattr(gpt2_layout, k)]
        if config.activation not in ("gelu_tanh", "gelu"):
            changed.append(f"activation={config.activation!r} (GPT-2: 'gelu_tanh')")
        if changed:
            raise ValueError("GPT-2 weights need GPT-2's layout; this config sets "
                             + ", ".join(changed))
        model = cls(config)
        own = model.state_dict()
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                      "mlp.c_proj.weight")
        loaded: set[str] = set()
        for hf_name, tensor in state_dict.items():
            name = hf_name.removeprefix("transformer.")
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers, not parameters
            if name not in own:
                raise ValueError(f"unexpected tensor {hf_name!r} in the GPT-2 state dict")
            value = tensor.t() if name.endswith(transposed) else tensor
            if tuple(value.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"shape mismatch for {hf_name!r}: state dict has {tuple(tensor.shape)}, "
                    f"the config expects {tuple(own[name].shape)}"
                )
            with torch.no_grad():
                own[name].copy_(value)
            loaded.add(name)
        tied = {"lm_head.weight"} if "wte.weight" in loaded else set()
        missing = sorted(set(own) - loaded - tied)
        if missing:
            raise ValueError(f"the GPT-2 state dict lacks {missing}")
        return model


#: The fields that leave GPT-2's layout when changed from their defaults.
_MODERN_SWITCHES = ("positional", "norm", "norm_weight", "qk_norm", "n_kv_heads",
                    "zero_init")


def _positional_embedding(c: GPTConfig) -> nn.Module | None:
    if c.positional == "learned":
        return LearnedPositionalEmbedding(c.context_length, c.d_model)
    if c.positional == "sinusoidal":
        return SinusoidalPositionalEncoding(c.context_length, c.d_model)
    return None


def _rotary(c: GPTConfig) -> RotaryEmbedding | None:
    if c.positional != "rope":
        return None
    return RotaryEmbedding(c.context_length, c.d_head, c.rope_base)


def _too_long(past: int, length: int, context_length: int) -> str:
    if past == 0:
        return (f"sequence length T={length} exceeds context_length={context_length}; "
                f"crop the input to its last {context_length} tokens")
    return (f"the cache holds {past} positions and T={length} new ones would make "
            f"{past + length} > context_length={context_length}; reset() the cache and "
            f"feed the last {context_length} tokens")


@contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Run the block with ``models`` in eval mode (no dropout), then give each back the mode
    it was in, even if the block raises."""
    modes = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model, mode in zip(models, modes, strict=True):
            model.train(mode)
