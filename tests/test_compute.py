"""The FLOP count of a training step (minigpt.compute) against a count by hand."""

from __future__ import annotations

import torch

from minigpt import GPT, GPTConfig
from minigpt.compute import matmul_weights, training_flops_per_token


def test_matmul_weights_are_the_linear_layers_weights_only() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3),
                                torch.nn.LayerNorm(3), torch.nn.Linear(3, 2, bias=False))
    assert matmul_weights(model) == 4 * 3 + 3 * 2  # no embedding, bias or norm


def test_a_gpt2_layout_step_is_six_times_its_products_plus_causal_attention() -> None:
    V, T, D, L = 70, 64, 64, 2
    model = GPT(GPTConfig(vocab_size=V, context_length=T, d_model=D, n_heads=4, n_layers=L))
    d_ff = model.config.d_ff
    per_block = 3 * D * D + D * D + D * d_ff + d_ff * D  # q, k, v; out; the two of the MLP
    by_hand = 6 * (L * per_block + V * D) + 6 * L * T * D  # the tied head is a product too
    assert training_flops_per_token(model) == by_hand
