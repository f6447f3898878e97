"""Compute accounting: the floating-point operations (FLOPs) of a training step.

A multiply-add is two FLOPs. In the forward pass each weight of a matrix product is used
once a token, 2 N_W FLOPs with N_W the weights of the model's `torch.nn.Linear` layers (the
tied output head included); the backward pass computes two products of the same size (the
gradients with respect to the input and to the weights), so training costs 6 N_W a token
(Kaplan et al., 2020). Causal attention adds its two products with the context, Q K^T and
the weights times V, over (T + 1) / 2 keys a query on average: about 6 L T D a token for
training. The modern GPT chapter derives both terms; `training_flops_per_token` adds them.
"""

from __future__ import annotations

from torch import nn

from minigpt.model import GPT


def matmul_weights(model: nn.Module) -> int:
    """N_W: the weights of the model's matrix products (its `torch.nn.Linear` layers)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def training_flops_per_token(model: GPT) -> int:
    """6 N_W + 6 L T D: the FLOPs of a training step (forward and backward) a token, at the
    model's full context T."""
    config = model.config
    return (6 * matmul_weights(model)
            + 6 * config.n_layers * config.context_length * config.d_model)
