"""The losses a GPT trains on and is scored by, in one place.

`lm_loss` is next-token cross-entropy, the pre-training loss; `masked_lm_loss` counts only
the targets a mask selects (an assistant's answers in supervised fine-tuning). The scores of
a model: `estimate_loss` averages the loss over a fixed sample of batches (what the training
loop logs), `full_loss` scores every token of a split once, and `bits_per_character` turns
that into a measure two tokenizers can be compared by. The post-training losses live with
their data: DPO's in `minigpt.posttrain.dpo`, GRPO's in `minigpt.posttrain.rl`, classification's in
`minigpt.posttrain.classify`; the log-probability of each answer token, which DPO and GRPO both
read, is `token_logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.data import ExampleSet
from minigpt.model import GPT, eval_mode
from minigpt.parallel import DistContext, mean_over_ranks, rank_batch, sum_over_ranks
from minigpt.tokenizer import Tokenizer

#: A loss other than next-token cross-entropy (e.g. `minigpt.posttrain.dpo.preference_loss`):
#: the mean loss of one micro-batch, given the module to call and the batch its data set draws.
LossFn = Callable[[nn.Module, Any], Tensor]


class MicroBatch(Protocol):
    """What a training step needs of any batch: its inputs ``x``, on the model's device (a
    `Batch`, or a data set's own batch type that a `LossFn` reads)."""

    @property
    def x(self) -> Tensor: ...
SINGLE = DistContext()  # one process, on the CPU


def autocast(device: torch.device, bf16: bool) -> Any:
    """bf16 autocast on ``device`` if ``bf16``, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def lm_loss(model: nn.Module, x: Tensor, y: Tensor, mask: Tensor | None = None, *,
            reduction: Literal["mean", "sum"] = "mean") -> Tensor:
    """Mean next-token cross-entropy: x, y (B, T) -> scalar.

    The logits (B, T, V) are flattened to (B T, V): every position counts once. With a
    ``mask`` (B, T) only the targets where it is True count (`masked_lm_loss`).
    """
    logits = model(x)
    if mask is not None:
        return masked_lm_loss(logits, y, mask, reduction=reduction)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction=reduction)


def masked_lm_loss(logits: Tensor, targets: Tensor, mask: Tensor, *,
                   reduction: Literal["mean", "sum"] = "mean") -> Tensor:
    """Next-token cross-entropy over the targets where ``mask`` is True (e.g. the answer's
    tokens): their mean (``"mean"``) or sum (``"sum"``); the other targets do not count.

    Args:
        logits: (B, T, V) next-token scores.
        targets: (B, T) token ids.
        mask: (B, T) bool, True where a target counts; at least one must for the mean
            (a mean over none is NaN).
    """
    if not targets.shape == logits.shape[:-1] == mask.shape:
        raise ValueError(f"logits (B, T, V), targets and mask (B, T); got "
                         f"{tuple(logits.shape)}, {tuple(targets.shape)}, {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"the mask says which targets count: True or False (torch.bool), got "
                        f"{mask.dtype}")
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    total = losses.masked_select(mask.flatten()).sum()
    return total if reduction == "sum" else total / mask.sum()


def token_logprobs(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """log p(y_t | x_1..x_t) of each target y_t where ``mask``, 0 elsewhere: what DPO's
    sequence log-probabilities sum (`minigpt.posttrain.dpo.sequence_logprobs`) and GRPO's loss reads
    token by token (`minigpt.posttrain.rl.rollout_loss`).

    Args:
        logits: (N, L, V) next-token scores. targets: (N, L) token ids.
        mask: (N, L) bool, True on the answer's targets.
    Returns: (N, L) float32.
    """
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, logp, 0.0)


@torch.no_grad()
def estimate_loss(model: nn.Module, splits: dict[str, np.ndarray | ExampleSet], *,
                  batch_size: int, context_length: int, eval_steps: int, seed: int = 0,
                  bf16: bool = False, ctx: DistContext = SINGLE,
                  loss_fn: LossFn | None = None) -> dict[str, float]:
    """Mean loss over ``eval_steps`` batches of each split, in eval mode (no dropout).

    The batches come from a generator seeded with ``seed`` at every call, so successive
    evaluations of a run score the model on the same windows (their differences are the
    model's, not the sampling's) and evaluating never disturbs the training batches.
    Several processes each score their ``batch_size`` rows of every global batch
    (collective: every rank calls it), and the result is the one process with
    ``batch_size * world_size`` would get, to float rounding: the ranks' means are averaged,
    and for masked batches each global batch's summed loss is divided by all its counted
    targets (token-weighted), however the ranks share them. ``loss_fn`` replaces `lm_loss`
    (as in `minigpt.train.train_step`).
    """
    device = next(model.parameters()).device
    ctx = ctx if ctx.distributed else DistContext(device=device)  # batches where the model is
    out = {}
    with eval_mode(model):
        for name, data in splits.items():
            gen = torch.Generator().manual_seed(seed)
            total = torch.zeros((), device=device)
            counted = []  # masked batches: (summed loss, counted targets) of each
            for _ in range(eval_steps):
                batch = rank_batch(data, batch_size, context_length, ctx, generator=gen)
                with autocast(device, bf16):
                    if loss_fn is not None:
                        total += loss_fn(model, batch).float()
                    elif batch.mask is None:
                        total += lm_loss(model, batch.x, batch.y).float()
                    else:
                        summed = lm_loss(model, *batch, reduction="sum").float()
                        counted.append(torch.stack([summed, batch.mask.sum().float()]))
            if counted:
                for summed, count in sum_over_ranks(torch.stack(counted), ctx):
                    total += summed / count
                out[name] = total.item() / eval_steps
            else:
                out[name] = mean_over_ranks(total, ctx).item() / eval_steps
    return out


@torch.no_grad()
def full_loss(model: GPT, data: np.ndarray, *, batch_size: int = 32,
              bf16: bool = False) -> float:
    """Mean next-token loss over all of ``data``, not a sample of it.

    The ids are cut into consecutive windows of T = context_length tokens (x = data[i:i+T],
    y = data[i+1:i+T+1], i = 0, T, 2T, ...; a last partial window is dropped), so every
    token is predicted once, from the 0 to T-1 tokens before it in its window. Slower than
    `estimate_loss` but free of its sampling noise (about 0.015 for 20 batches of 12 x 64
    characters), which is what comparing two runs needs.
    """
    device = next(model.parameters()).device
    T: int = model.config.context_length
    n_windows = (len(data) - 1) // T
    if n_windows < 1:
        raise ValueError(f"data has {len(data)} tokens; full_loss needs more than T={T}")
    ids = torch.from_numpy(np.asarray(data[: n_windows * T + 1]).astype(np.int64))
    x_all = ids[:-1].view(n_windows, T)  # (windows, T)
    y_all = ids[1:].view(n_windows, T)
    total = torch.zeros((), dtype=torch.float64)  # on the CPU: MPS has no float64
    with eval_mode(model):
        for k in range(0, n_windows, batch_size):
            x, y = x_all[k:k + batch_size].to(device), y_all[k:k + batch_size].to(device)
            with autocast(device, bf16):
                logits = model(x)
            total += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1),
                                     reduction="sum").cpu().double()
    return float(total.item()) / (n_windows * T)


def bits_per_character(model: GPT, ids: np.ndarray, tokenizer: Tokenizer, *,
                       batch_size: int = 32) -> float:
    """The model's loss over the text that ``ids`` encodes, in bits per character.

    Per-token losses of two tokenizers are not comparable (a BPE token carries several
    characters); the total information over the same text is. The tokens are scored as in
    `full_loss` (consecutive windows; the first token and a last partial window are not
    predicted), the summed loss in nats is converted to bits (divided by ln 2) and divided
    by the number of characters the predicted tokens decode to.
    """
    T = model.config.context_length
    n_scored = (len(ids) - 1) // T * T
    nats = full_loss(model, ids, batch_size=batch_size) * n_scored
    ids = np.asarray(ids[:n_scored + 1])
    chars = len(tokenizer.decode(ids.tolist())) - len(tokenizer.decode(ids[:1].tolist()))
    return nats / chars / math.log(2)
