"""What each head does on repeated text: its scores, the loss on each copy,
and what it writes (read through hooks)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from minigpt.attention import attention_mass
from minigpt.model import GPT
from minigpt.nn import Block

Head = tuple[int, int]  # (layer, head)


def blocks(model: GPT) -> list[Block]:
    """The model's blocks, typed (``model.h`` is a ModuleList)."""
    return cast(list[Block], list(model.h))


def repeated(ids: Tensor, count: int, half: int, generator: torch.Generator) -> Tensor:
    """``count`` rows of 2 ``half`` ids: a stretch of ``half`` consecutive ids of ``ids``
    (1-D, a random start each), written twice."""
    if ids.ndim != 1 or len(ids) <= half:
        raise ValueError(f"ids must be a 1-D stream longer than half={half}, got shape "
                         f"{tuple(ids.shape)}")
    starts = torch.randint(0, len(ids) - half, (count,), generator=generator)
    stretch = ids[starts[:, None] + torch.arange(half)]  # (count, half)
    return torch.cat([stretch, stretch], dim=1)


def induction_keys(length: int, half: int) -> Tensor:
    """(T, T) boolean, T = ``length``: query i of the second copy (i >= half) and key
    i - half + 1, the position after the token's first occurrence."""
    query = torch.arange(length)[:, None]
    key = torch.arange(length)[None, :]
    return (query >= half) & (key == query - half + 1)


def previous_keys(length: int) -> Tensor:
    """(T, T) boolean: query i and key i - 1."""
    query = torch.arange(length)[:, None]
    return torch.arange(length)[None, :] == query - 1


@dataclass(frozen=True)
class Scores:
    """Each head's induction and previous-token score, (L, H) float64 each: the mean
    attention weight on the key `induction_keys` or `previous_keys` picks (over the
    queries that have one, and the rows)."""

    induction: Tensor
    previous: Tensor

    def top(self, which: Literal["induction", "previous"] = "induction",
            layer: int | None = None) -> Head:
        """The (layer, head) with the highest score of ``which`` (in ``layer`` if given)."""
        grid = getattr(self, which)
        if layer is not None:
            return layer, int(grid[layer].argmax())
        flat = int(grid.argmax())
        return flat // grid.shape[1], flat % grid.shape[1]


def head_scores(model: GPT, rows: Tensor) -> Scores:
    """Every head's `Scores` on ``rows`` (B, 2 half) of repeated ids (`repeated`), read
    from the attention of the model's forward pass on rows[:, :-1]."""
    half = rows.shape[1] // 2
    with torch.no_grad():
        _, maps = model.forward_with_attention(rows[:, :-1])
    length = rows.shape[1] - 1
    return Scores(attention_mass(maps, induction_keys(length, half)),
                  attention_mass(maps, previous_keys(length)))


@dataclass(frozen=True)
class CopyLosses:
    """Cross-entropy (nats) on repeated rows: per target position (T - 1,), averaged over
    the rows, and its means over the first copy's targets (ids 1 .. half - 1) and the
    second copy's (ids half + 1 .. 2 half - 1: each one a copy of an id seen before)."""

    per_position: Tensor
    first: float
    second: float


def copy_losses(model: GPT, rows: Tensor) -> CopyLosses:
    """The model's `CopyLosses` on ``rows`` (B, 2 half) of repeated ids."""
    half = rows.shape[1] // 2
    with torch.no_grad():
        logits = model(rows[:, :-1])
    nll = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none").mean(0)
    return CopyLosses(nll, float(nll[:half - 1].mean()), float(nll[half:].mean()))


def head_slice(model: GPT, head: int) -> slice:
    d_k = model.config.d_head
    return slice(head * d_k, (head + 1) * d_k)


@contextmanager
def hooked(hooks: Sequence[RemovableHandle]) -> Iterator[None]:
    """Inside the block the ``hooks`` (what a module's ``register_forward_hook`` and
    ``register_forward_pre_hook`` return) run; they are removed on leaving, however the
    block is left."""
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def recorded_heads(model: GPT) -> Iterator[list[Tensor]]:
    """Inside the block, each forward pass appends to the list every layer's head outputs,
    (B, T, H, d_k), layer after layer (what the output projections read)."""
    seen: list[Tensor] = []
    H = model.config.n_heads

    def record(_module: Any, inputs: tuple[Tensor, ...]) -> None:
        z = inputs[0]
        seen.append(z.detach().view(*z.shape[:-1], H, -1))

    with hooked([block.attn.c_proj.register_forward_pre_hook(record)
                 for block in blocks(model)]):
        yield seen
