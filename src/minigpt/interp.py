"""Inside a trained model: what its heads do, read and changed through hooks.

A GPT's residual stream is a sum: the embeddings, then what every head and every MLP adds
(`residual_parts`). This module reads that stream and the heads' outputs, and replaces them,
through hooks that are removed when their block is left (`hooked`):

* repeated sequences and the two scores of a head on them: the **induction score**, the
  attention from a token of the second copy to the token after its first occurrence, and
  the **previous-token score** (`repeated`, `head_scores`), and the loss on each copy
  (`copy_losses`);
* **ablation**: a head's output replaced by zeros or by its mean (`ablated`, `head_means`),
  through a forward pre-hook on its layer's output projection, which reads the heads side
  by side (head h is columns h d_k .. (h + 1) d_k - 1 of its input);
* the **logit lens** (`logit_lens`): the residual stream after each block read through the
  final norm and the head; **activation patching** (`patched_logits`, `patching_grid`):
  one position of the stream after one block copied from a clean run into a corrupted one,
  or one head's output at every position (`head_patching`, through `ablated`);
* a head's **circuits** (`circuits`): W_QK = W_Q^T W_K and W_OV = W_O W_V, and how much a
  later head's keys, queries or values read an earlier head's output (`composition`);
  whether its OV circuit, from tokens to logits, **copies** (`full_ov_circuit`,
  `effective_embedding`, `copying_scores`);
* the **copiers**: small models trained on text in which stretches repeat, where copying
  pays, with snapshots of their scores as they train (`CopyRecipe`, `copier`), cached
  like the book's other models.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from minigpt import pretrained
from minigpt.attention import attention_mass
from minigpt.config import GPTConfig
from minigpt.data import Batch, get_batch, split_text
from minigpt.losses import lm_loss
from minigpt.model import GPT
from minigpt.nn import Block, LayerNorm
from minigpt.optim import configure_optimizer
from minigpt.pretrained import Built, ModelInfo
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train_step

#: The package's modules that train a copier: its cache key covers their source.
COPIER_MODULES = (*pretrained.TRAINING_MODULES, "interp")

Head = tuple[int, int]  # (layer, head)


def blocks(model: GPT) -> list[Block]:
    """The model's blocks, typed (``model.h`` is a ModuleList)."""
    return cast(list[Block], list(model.h))


# ------------------------------------------------------------------ repeated sequences

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


# ----------------------------------------------------------------------- ablation

def _head_slice(model: GPT, head: int) -> slice:
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
                z[..., _head_slice(model, head)] = 0.0 if means is None else means[layer, head]
        return (z,)

    with hooked([block.attn.c_proj.register_forward_pre_hook(partial(replace, layer))
                 for layer, block in enumerate(blocks(model))]):
        yield model


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


# ------------------------------------------------------------------ the residual stream

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
                columns = proj.weight[:, _head_slice(model, head)]  # (D, d_k)
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


# ---------------------------------------------------------------- activation patching

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
                  right: int, wrong: int) -> Tensor:
    """(L + 1, T): how much of the clean run's preference for token ``right`` over ``wrong``
    at position ``answer`` each patch restores, one position of the stream after each block
    copied from the clean run into the corrupted one.

    With d = logit(right) - logit(wrong) at ``answer``, a patch's entry is
    (d_patched - d_corrupt) / (d_clean - d_corrupt), averaged over the batch: 0 changes
    nothing, 1 restores the clean run's preference. ``clean_ids`` and ``corrupt_ids`` are
    (B, T).
    """
    def preference(logits: Tensor) -> Tensor:
        return logits[:, answer, right] - logits[:, answer, wrong]

    clean = residual_stream(model, clean_ids)
    with torch.no_grad():
        d_clean, d_corrupt = preference(model(clean_ids)), preference(model(corrupt_ids))
    if not bool((d_clean != d_corrupt).all()):
        raise ValueError("the corrupted ids must change the preference for right over wrong "
                         "in every row: a row where it does not has nothing to restore")
    grid = torch.empty(len(blocks(model)) + 1, clean_ids.shape[1])
    for after in range(len(blocks(model)) + 1):
        for position in range(clean_ids.shape[1]):
            d = preference(patched_logits(model, corrupt_ids, clean, after, position))
            grid[after, position] = ((d - d_corrupt) / (d_clean - d_corrupt)).mean()
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

    with torch.no_grad(), recorded_heads(model) as clean:
        d_clean = preference(model(clean_ids))
    with torch.no_grad():
        d_corrupt = preference(model(corrupt_ids))
    moved = float((d_clean - d_corrupt).mean())
    if moved == 0.0:
        raise ValueError("the corruption leaves the mean preference for right over wrong "
                         "unchanged: there is nothing to restore")
    written = torch.stack(clean).movedim(3, 1)  # (L, H, B, T, d_k): the clean outputs
    grid = torch.empty(len(clean), model.config.n_heads)
    for layer in range(len(clean)):
        for head in range(model.config.n_heads):
            with torch.no_grad(), ablated(model, [(layer, head)], written):
                d = preference(model(corrupt_ids))
            grid[layer, head] = (d - d_corrupt).mean() / moved
    return grid


# ------------------------------------------------------------------------ circuits

def circuits(model: GPT, layer: int, head: int) -> tuple[Tensor, Tensor]:
    """A head's QK and OV circuits, (D, D) each, as maps of its layer's normalised input.

    W_QK = W_Q^T W_K: the score of query x_t and key x_s is x_t^T W_QK x_s / sqrt(d_k)
    (biases aside). W_OV = W_O W_V: a key x_s that gets all the attention adds W_OV x_s to
    the stream (the value bias and the projection's bias aside). Both have rank at most d_k.
    """
    attn = blocks(model)[layer].attn
    D, cols = model.config.d_model, _head_slice(model, head)
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
    return x if gain is None else x * gain.to(x.dtype)


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
    attn, cols = blocks(model)[layer].attn, _head_slice(model, head)
    w_v = torch.split(attn.c_attn.weight, list(attn.sizes), dim=0)[2][cols]  # (d_k, D)
    w_o = attn.c_proj.weight[:, cols]  # (D, d_k)
    with torch.no_grad():
        read = _norm_linear(blocks(model)[layer].ln_1, inputs.double())  # (V, D)
        into = w_v.double() @ read.T  # (d_k, V)
        written = _norm_linear(model.ln_f, w_o.double().T)  # (d_k, D): each column's write
        out = model.lm_head.weight.double() @ written.T  # (V, d_k)
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


# ------------------------------------------------------------------------ the copiers

#: The held-out probes: repeated rows for the scores and losses (`repeated`, seed 1) and
#: the short one whose attention the snapshots keep (12 ids twice).
PROBE_SEED, SHOWN_HALF = 1, 12


class CopyRecipe(BaseModel):
    """A small model trained on the training text with repeated stretches, where copying
    what came before pays: its shape, its rows, its run and its snapshots.

    Each training row is a window of ``context_length`` + 1 ids of the text; in a share
    ``repeat_fraction`` of the rows, a stretch of ``shortest`` to ``longest`` ids at a
    random place is written again right after itself (over the text that followed it).
    ``fixed_offset`` instead repeats the row's first half in its second half, always 32
    positions back at context 64: a task a head can solve by position alone. AdamW at a
    constant rate, no weight decay; every ``snapshot_every`` steps the scores and losses on
    repeated held-out rows are recorded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    d_model: int = Field(default=64, gt=0)
    #: The MLP's width: 3 D, where the chapter measured its copiers (with GPT-2's 4 D the
    #: copying was shared among more heads of layer 1).
    d_ff: int = Field(default=192, gt=0)
    context_length: int = Field(default=64, gt=1)
    batch_size: int = Field(default=16, gt=0)
    steps: int = Field(default=2400, gt=0)
    lr: float = Field(default=3e-3, gt=0.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    seed: int = Field(default=0, ge=0)
    repeat_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    shortest: int = Field(default=16, gt=0)
    longest: int = Field(default=32, gt=0)
    fixed_offset: bool = False
    snapshot_every: int = Field(default=50, gt=0)
    probe_rows: int = Field(default=32, gt=0)
    train_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    threads: int = Field(default=1, ge=1, strict=True)

    @model_validator(mode="after")
    def _stretches_fit(self) -> CopyRecipe:
        if not self.shortest <= self.longest <= (self.context_length + 1) // 2:
            raise ValueError(f"stretches of {self.shortest} to {self.longest} ids must satisfy "
                             f"shortest <= longest <= {(self.context_length + 1) // 2}, so that "
                             f"one fits twice in a row of {self.context_length + 1}")
        if self.context_length % 2 or self.context_length < 2 * SHOWN_HALF:
            raise ValueError(f"context_length must be even (two halves) and at least "
                             f"{2 * SHOWN_HALF} (the row the snapshots show), got "
                             f"{self.context_length}")
        self.gpt_config(vocab_size=2)  # GPTConfig's own checks: the heads divide D
        return self

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model's GPT-2-layout `GPTConfig` for a vocabulary of `vocab_size` tokens."""
        return GPTConfig.shakespeare_cpu(
            vocab_size, n_layers=self.n_layers, n_heads=self.n_heads, d_model=self.d_model,
            d_ff=self.d_ff, context_length=self.context_length, activation="gelu_tanh")


def training_rows(ids: Tensor, recipe: CopyRecipe, generator: torch.Generator) -> Tensor:
    """A batch of `CopyRecipe`'s training rows (B, T + 1) from the stream ``ids``."""
    B, T = recipe.batch_size, recipe.context_length
    starts = torch.randint(0, len(ids) - T - 1, (B,), generator=generator)
    rows = ids[starts[:, None] + torch.arange(T + 1)]
    if recipe.fixed_offset:
        length, place = torch.full((B,), T // 2), torch.zeros(B, dtype=torch.long)
    else:
        length = torch.randint(recipe.shortest, recipe.longest + 1, (B,), generator=generator)
        place = (torch.rand(B, generator=generator) * (T + 2 - 2 * length)).long()
    chosen = torch.rand(B, generator=generator) < recipe.repeat_fraction
    j = torch.arange(T + 1)[None, :]
    again = chosen[:, None] & (j >= (place + length)[:, None]) & (
        j < (place + 2 * length)[:, None])
    return rows.gather(1, torch.where(again, j - length[:, None], j))


def _split_ids(text: str, recipe: CopyRecipe) -> tuple[CharTokenizer, Tensor, Tensor]:
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text, recipe.train_fraction)
    return (tokenizer, torch.tensor(tokenizer.encode_ordinary(train_text)),
            torch.tensor(tokenizer.encode_ordinary(val_text)))


def probe_rows(model: GPT, val: Tensor, count: int) -> Tensor:
    """``count`` repeated rows of held-out ids, half a context each: the same on every call."""
    half = model.config.context_length // 2
    return repeated(val, count, half, torch.Generator().manual_seed(PROBE_SEED))


def _train_copier(recipe: CopyRecipe, text: str, say: Any, folder: Path) -> Built:
    say(f"training a copier once ({pretrained.plural(recipe.n_layers, 'layer')}, "
        f"{recipe.steps} steps, repeats in {recipe.repeat_fraction:.0%} of rows); it is "
        f"cached in {folder}")
    return train_copier(recipe, text)


def train_copier(recipe: CopyRecipe, text: str) -> Built:
    """Train the copier of ``recipe`` on the first part of ``text`` (its character
    tokenizer's ids; the rest is held out): the model in eval mode, its metrics and its
    history with the snapshots (what `copier` caches)."""
    tokenizer, train_ids, val_ids = _split_ids(text, recipe)
    config = recipe.gpt_config(tokenizer.vocab_size)
    start = time.perf_counter()
    with pretrained.threads(recipe.threads):
        torch.manual_seed(recipe.seed)
        model = GPT(config)
        optimizer = configure_optimizer(model, lr=recipe.lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(recipe.seed)
        probes = probe_rows(model, val_ids, recipe.probe_rows)
        history: dict[str, list[Any]] = {k: [] for k in (
            "step", "first", "second", "induction", "previous")}
        snapshots, losses = [], []
        for step in range(recipe.steps + 1):
            if step % recipe.snapshot_every == 0 or step == recipe.steps:
                model.eval()
                copies, scores = copy_losses(model, probes), head_scores(model, probes)
                model.train()
                history["step"].append(step)
                history["first"].append(round(copies.first, 4))
                history["second"].append(round(copies.second, 4))
                history["induction"].append(np.round(scores.induction.numpy(), 4).tolist())
                history["previous"].append(np.round(scores.previous.numpy(), 4).tolist())
                snapshots.append(copy.deepcopy(model.state_dict()))
            if step == recipe.steps:
                break
            rows = training_rows(train_ids, recipe, generator)
            batch = Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
            losses.append(train_step(model, optimizer, [batch],
                                     grad_clip=recipe.grad_clip).loss)
        seconds = time.perf_counter() - start
        model.eval()
        history["loss"] = [round(v, 4) for v in torch.stack(losses).tolist()]
        final = Scores(torch.tensor(history["induction"][-1]),
                       torch.tensor(history["previous"][-1]))
        history |= _patterns(model, snapshots, final.top(), val_ids, tokenizer)
        plain_x, plain_y = get_batch(val_ids.numpy(), 64, config.context_length,
                                     generator=torch.Generator().manual_seed(PROBE_SEED))
        with torch.no_grad():  # plain held-out text, nothing repeated on purpose
            plain = float(lm_loss(model, plain_x, plain_y))
    crossed = [s for s, grid in zip(history["step"], history["induction"], strict=True)
               if max(map(max, grid)) >= 0.5]
    metrics = {"first": history["first"][-1], "second": history["second"][-1],
               "induction": round(float(final.induction.max()), 4),
               "previous": round(float(final.previous.max()), 4),
               "top_induction": list(final.top()), "top_previous": list(final.top("previous")),
               "crossed_at": crossed[0] if crossed else None, "plain_loss": round(plain, 4),
               "train_seconds": seconds}
    return model, metrics, history


def _patterns(model: GPT, snapshots: list[dict[str, Tensor]], head: Head, val: Tensor,
              tokenizer: CharTokenizer) -> dict[str, Any]:
    """The attention of ``head`` at every snapshot on one short repeated held-out row."""
    row = repeated(val, 1, SHOWN_HALF, torch.Generator().manual_seed(PROBE_SEED))
    final = copy.deepcopy(model.state_dict())
    patterns = []
    for state in snapshots:
        model.load_state_dict(state)
        with torch.no_grad():
            _, maps = model.forward_with_attention(row[:, :-1])
        patterns.append(np.round(maps[head[0]][0, head[1]].numpy(), 3).tolist())
    model.load_state_dict(final)
    return {"pattern": patterns, "pattern_head": list(head),
            "pattern_text": tokenizer.decode(row[0, :-1].tolist())}


def copier(recipe: CopyRecipe, *, progress: bool = False, cache: Path | None = None,
           ) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The copier ``recipe`` trains on the corpus, its tokenizer and a `ModelInfo` whose
    metrics hold its final scores and losses and whose history holds its snapshots; trained
    once and cached (the key covers the recipe, the corpus, PyTorch and `COPIER_MODULES`)."""
    text = pretrained.corpus()
    tokenizer = CharTokenizer.from_text(text)
    material = pretrained.model_material(COPIER_MODULES, recipe.gpt_config(tokenizer.vocab_size),
                                         recipe=recipe.model_dump(),
                                         corpus_sha256=pretrained.corpus_sha256(text))
    model, info = pretrained.cached_model(material, partial(_train_copier, recipe, text),
                                          progress=progress, cache=cache)
    return model, tokenizer, info


#: The copiers set-up trains: three seeds of the two-layer model where every row repeats a
#: stretch; one layer; repeats at a fixed offset; and shares of repeated rows.
RECIPES: dict[str, CopyRecipe] = {
    **{f"copy-{seed}": CopyRecipe(seed=seed) for seed in (0, 1, 2)},
    "copy-1layer": CopyRecipe(n_layers=1),
    "copy-fixed": CopyRecipe(n_layers=1, fixed_offset=True, steps=800),
    "copy-plain": CopyRecipe(repeat_fraction=0.0),
    "copy-mix-25": CopyRecipe(repeat_fraction=0.25),
    "copy-mix-50": CopyRecipe(repeat_fraction=0.5),
}
MODELS: dict[str, pretrained.Loader] = {
    name: partial(copier, recipe) for name, recipe in RECIPES.items()}


def copy_opportunity(text: str, context: int, match: int, positions: int,
                     generator: torch.Generator) -> tuple[float, float]:
    """How often copying could help in ``text`` with a window of ``context`` characters: at
    ``positions`` random places, whether the ``match`` characters ending there occurred
    earlier in the window, and whether the character after that earlier occurrence (the
    latest one) is the next one. Returns the two shares: matched, and matched and right."""
    if not 0 < match < context < len(text) - 1:
        raise ValueError(f"a match fits in a window of the text: 0 < match < context < "
                         f"len(text) - 1, got {match}, {context}, {len(text) - 1}")
    ends = torch.randint(context - 1, len(text) - 1, (positions,), generator=generator)
    matched = right = 0
    for end in ends.tolist():
        gram = text[end - match + 1:end + 1]
        earlier = text.rfind(gram, end - context + 1, end)  # ends before position `end`
        if earlier >= 0:
            matched += 1
            right += text[earlier + match] == text[end + 1]
    return matched / positions, right / positions
