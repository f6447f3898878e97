"""The residual stream as a sum of writes, and the logit lens."""

from __future__ import annotations

import torch
from torch import Tensor

from minigpt.interp.heads import (
    blocks,
    head_slice,
    recorded_heads,
)
from minigpt.model import GPT


def residual_stream(model: GPT, ids: Tensor) -> Tensor:
    """(L + 1, B, T, D): the stream the blocks read and write, after the embeddings and
    after each block (the last one is what the final norm reads)."""
    with torch.no_grad():
        x = model.embed(ids)
        states = [x]
        for block in blocks(model):
            x, _ = block(x)
            states.append(x)
    return torch.stack(states)


def residual_parts(model: GPT, ids: Tensor) -> tuple[list[str], Tensor]:
    """The stream after the last block as a sum of parts: names and (P, B, T, D) values.

    The parts are the embeddings (token and position), then for each layer l every head's
    write (its d_k outputs times its d_k columns of the output projection: "l.h"), the
    projection's bias ("l.bias") and the MLP's write ("l.mlp"). Their sum is the stream
    up to float rounding: `residual_stream`'s last entry.
    """
    names, parts = ["embed"], []
    with torch.no_grad():
        x = model.embed(ids)
        parts.append(x)
        for layer, block in enumerate(blocks(model)):
            with recorded_heads(model) as seen:
                attended, _ = block.attn(block.ln_1(x))
            z = seen[0]  # (B, T, H, d_k)
            proj = block.attn.c_proj
            for head in range(model.config.n_heads):
                columns = proj.weight[:, head_slice(model, head)]  # (D, d_k)
                parts.append(z[..., head, :] @ columns.T)
                names.append(f"{layer}.{head}")
            if proj.bias is not None:
                parts.append(proj.bias.expand_as(x))
                names.append(f"{layer}.bias")
            x = x + attended
            mlp = block.mlp(block.ln_2(x))
            parts.append(mlp)
            names.append(f"{layer}.mlp")
            x = x + mlp
    return names, torch.stack(parts)


def logit_lens(model: GPT, ids: Tensor) -> Tensor:
    """(L + 1, B, T, V): the stream after the embeddings and after each block, each read as
    if it were the last (through the final norm and the head)."""
    with torch.no_grad():
        logits: Tensor = model.lm_head(model.ln_f(residual_stream(model, ids)))
    return logits
