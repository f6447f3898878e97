"""Changing a model as it runs: heads ablated (zero or mean), and activation
patching of positions and of single heads."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor

from minigpt.interp.heads import (
    Head,
    blocks,
    head_slice,
    hooked,
    recorded_heads,
)
from minigpt.interp.stream import residual_stream
from minigpt.model import GPT


@contextmanager
def ablated(model: GPT, heads: Sequence[Head], means: Tensor | None = None,
            ) -> Iterator[GPT]:
    """Inside the block, each head of ``heads`` writes nothing of its own: its output (the
    d_k values that its layer's output projection reads for it) is replaced by zeros
    (zero-ablation) or, with ``means`` (L, H, d_k) from `head_means`, by its mean output
    (mean-ablation). ``means[layer, head]`` may be any values that broadcast to the
    head's output (B, T, d_k): `head_patching` writes a clean run's. Every layer's
    projection is hooked, whether or not it has a head to ablate (`hooked`)."""
    def replace(layer: int, _module: Any, inputs: tuple[Tensor, ...]) -> tuple[Tensor]:
        z = inputs[0].clone()
        for where, head in heads:
            if where == layer:
                z[..., head_slice(model, head)] = 0.0 if means is None else means[layer, head]
        return (z,)

    with hooked([block.attn.c_proj.register_forward_pre_hook(partial(replace, layer))
                 for layer, block in enumerate(blocks(model))]):
        yield model


def head_means(model: GPT, rows: Tensor) -> Tensor:
    """Each head's mean output over the rows and positions of ``rows`` (B, T + 1), fed as
    rows[:, :-1]: (L, H, d_k), what mean-ablation writes in its place."""
    with torch.no_grad(), recorded_heads(model) as seen:
        model(rows[:, :-1])
    return torch.stack([z.mean(dim=(0, 1)) for z in seen])


@contextmanager
def read_ablated(model: GPT, ids: Tensor, heads: Sequence[Head], means: Tensor | None,
                 part: Literal["q", "k", "v"]) -> Iterator[GPT]:
    """Inside the block, on ``ids`` (B, T) only, the layers after the heads' own read their
    queries, keys or values (``part``) from the stream as it is when ``heads`` are ablated
    (`ablated`), and everything else from the intact stream: a path from those heads into one
    input of the later heads is cut, and only that path."""
    if not heads:
        raise ValueError("read_ablated needs at least one head to ablate")
    first = min(layer for layer, _ in heads) + 1  # the layers that read the heads' writes
    recorded: list[Tensor] = []

    def record(_module: Any, _inputs: Any, output: Tensor) -> None:
        recorded.append(output.detach())

    recording = hooked([block.attn.c_attn.register_forward_hook(record)
                        for block in blocks(model)])
    with recording, torch.no_grad(), ablated(model, heads, means):
        model(ids)
    index = "qkv".index(part)

    def splice(layer: int, _module: Any, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        if inputs[0].shape[:2] != ids.shape:
            raise ValueError(f"inside read_ablated the model reads ids of shape "
                             f"{tuple(ids.shape)}, those the ablated run read; got "
                             f"{tuple(inputs[0].shape[:2])}")
        sizes = list(_sizes(model, layer))
        parts = list(torch.split(output, sizes, dim=-1))
        parts[index] = torch.split(recorded[layer], sizes, dim=-1)[index]
        return torch.cat(parts, dim=-1)

    with hooked([blocks(model)[layer].attn.c_attn.register_forward_hook(partial(splice, layer))
                 for layer in range(first, len(blocks(model)))]):
        yield model


def _sizes(model: GPT, layer: int) -> tuple[int, int, int]:
    return blocks(model)[layer].attn.sizes


@contextmanager
def _stream_replaced(model: GPT, after: int, position: int, value: Tensor) -> Iterator[None]:
    """Inside the block the stream after ``after`` blocks (0: the embeddings) holds
    ``value`` (B, D) at ``position``."""
    def patch(_module: Any, _inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):  # a block: (stream, attention weights)
            x = output[0].clone()
            x[:, position] = value
            return (x, *output[1:])
        x = output.clone()
        x[:, position] = value
        return x

    module = model.drop if after == 0 else blocks(model)[after - 1]
    with hooked([module.register_forward_hook(patch)]):
        yield


def patched_logits(model: GPT, ids: Tensor, clean: Tensor, after: int, position: int,
                   ) -> Tensor:
    """The logits (B, T, V) of ``ids`` when the stream after ``after`` blocks holds, at
    ``position``, the clean run's value there (``clean``: `residual_stream` of the clean
    ids)."""
    with torch.no_grad(), _stream_replaced(model, after, position, clean[after][:, position]):
        logits: Tensor = model(ids)
    return logits


def patching_grid(model: GPT, clean_ids: Tensor, corrupt_ids: Tensor, answer: int,
                  right: int | Tensor, wrong: int | Tensor) -> Tensor:
    """(L + 1, T): how much of the clean runs' preference for token ``right`` over ``wrong``
    at position ``answer`` each patch restores, one position of the stream after each block
    copied from the clean run into the corrupted one.

    With d = logit(right) - logit(wrong) at ``answer`` in each row, a patch's entry is
    mean(d_patched - d_corrupt) / mean(d_clean - d_corrupt), means over the rows (as in
    `head_patching`): 0 changes nothing, 1 restores the clean preference on average.

    Args:
        clean_ids, corrupt_ids: (B, T) ids, the same shape.
        answer: the position whose prediction is read, 0 <= answer < T.
        right, wrong: the two tokens compared, one id for every row or (B,) ids.
    """
    preference = _preference(clean_ids, corrupt_ids, answer, right, wrong)
    clean = residual_stream(model, clean_ids)
    with torch.no_grad():
        d_clean, d_corrupt = preference(model(clean_ids)), preference(model(corrupt_ids))
    moved = _moved(d_clean, d_corrupt)
    grid = torch.empty(len(blocks(model)) + 1, clean_ids.shape[1])
    for after in range(len(blocks(model)) + 1):
        for position in range(clean_ids.shape[1]):
            d = preference(patched_logits(model, corrupt_ids, clean, after, position))
            grid[after, position] = (d - d_corrupt).mean() / moved
    return grid


def head_patching(model: GPT, clean_ids: Tensor, corrupt_ids: Tensor, answer: int,
                  right: int | Tensor, wrong: int | Tensor) -> Tensor:
    """(L, H): how much of the clean runs' preference for ``right`` over ``wrong`` at
    position ``answer`` comes back when one head's output, at every position, is copied
    from the clean run into the corrupted one (every other head and layer as corrupted).

    With d = logit(right) - logit(wrong) at ``answer`` in each row, a head's entry is
    mean(d_patched - d_corrupt) / mean(d_clean - d_corrupt), means over the rows: 0
    changes nothing, 1 restores the clean preference on average. A ratio of means, not a
    mean of ratios, so that a row the corruption hardly moves cannot dominate.

    Args:
        clean_ids, corrupt_ids: (B, T) ids, the same shape.
        answer: the position whose prediction is read, 0 <= answer < T.
        right, wrong: the two tokens compared, one id for every row or (B,) ids.
    """
    preference = _preference(clean_ids, corrupt_ids, answer, right, wrong)
    with torch.no_grad(), recorded_heads(model) as clean:
        d_clean = preference(model(clean_ids))
    with torch.no_grad():
        d_corrupt = preference(model(corrupt_ids))
    moved = _moved(d_clean, d_corrupt)
    written = torch.stack(clean).movedim(3, 1)  # (L, H, B, T, d_k): the clean outputs
    grid = torch.empty(len(clean), model.config.n_heads)
    for layer in range(len(clean)):
        for head in range(model.config.n_heads):
            with torch.no_grad(), ablated(model, [(layer, head)], written):
                d = preference(model(corrupt_ids))
            grid[layer, head] = (d - d_corrupt).mean() / moved
    return grid


def _preference(clean_ids: Tensor, corrupt_ids: Tensor, answer: int, right: int | Tensor,
                wrong: int | Tensor) -> Callable[[Tensor], Tensor]:
    """The patching functions' inputs checked, and their measure: logits (B, T, V) to
    logit(right) - logit(wrong) at ``answer`` in each row, (B,)."""
    if clean_ids.ndim != 2 or clean_ids.shape != corrupt_ids.shape:
        raise ValueError(f"clean_ids and corrupt_ids must be (B, T) ids of one shape, got "
                         f"{tuple(clean_ids.shape)} and {tuple(corrupt_ids.shape)}")
    B, T = clean_ids.shape
    if not 0 <= answer < T:
        raise ValueError(f"answer must be a position 0 <= answer < {T}, got {answer}")
    tokens = []
    for name, value in (("right", right), ("wrong", wrong)):
        ids = torch.as_tensor(value)
        if ids.dtype not in (torch.int32, torch.int64) or ids.shape not in ((), (B,)):
            raise ValueError(f"{name} must be one token id or {B} ids (one a row), got "
                             f"{value!r}")
        tokens.append(ids.expand(B))
    rows = torch.arange(B)

    def preference(logits: Tensor) -> Tensor:
        return logits[rows, answer, tokens[0]] - logits[rows, answer, tokens[1]]

    return preference


def _moved(d_clean: Tensor, d_corrupt: Tensor) -> float:
    """mean(d_clean - d_corrupt), refused when 0: a corruption that leaves the mean
    preference unchanged leaves nothing to restore."""
    moved = float((d_clean - d_corrupt).mean())
    if moved == 0.0:
        raise ValueError("the corruption leaves the mean preference for right over wrong "
                         "unchanged: there is nothing to restore")
    return moved
