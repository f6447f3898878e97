"""Training a GPT: the run's configuration, the loop, its losses and checkpoints.

The loop is nanoGPT's in substance: AdamW with weight decay on the matrices only, a
linear warm-up then a cosine decay to a floor, gradient clipping, optional gradient
accumulation and bf16 autocast, a periodic estimate of the train and validation loss, and
checkpoints that hold everything needed to continue the very same run (weights, optimiser
moments, the configurations, the tokenizer and the random-number generators).

    result = train(GPTConfig.shakespeare_cpu(65), TrainConfig(max_steps=500), train_ids, val_ids)
    result.model, result.history.val_loss

`python -m minigpt train --text input.txt --tokenizer char --out runs/char` does the same
from the command line (`minigpt.cli`) and writes `metrics.json` and `checkpoint.pt` into
`--out`.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn
from tqdm import tqdm  # plain text bar: works in a terminal and a notebook alike

from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from minigpt.config import GPTConfig
from minigpt.data import ExampleSet
from minigpt.decoding import eval_mode
from minigpt.files import atomic_write
from minigpt.model import GPT
from minigpt.optim import (
    Muon,
    configure_optimizer,
    lr_at,
    muon_and_adamw_parameters,
    trapezoid_lr_at,
)
from minigpt.parallel import (
    DistContext,
    barrier,
    gather,
    mean_over_ranks,
    rank_batch,
    sum_over_ranks,
    wrap_model,
)
from minigpt.tokenizer import Tokenizer, tokenizer_from_dict

METRICS_NAME = "metrics.json"
#: A loss other than next-token cross-entropy (e.g. `minigpt.dpo`'s): the mean loss of one
#: micro-batch, given the module to call and the batch its data set draws.
LossFn = Callable[[nn.Module, tuple[Tensor, ...]], Tensor]
SINGLE = DistContext()  # one process, on the CPU


class TrainConfig(BaseModel):
    """Every setting of a training run except the model's shape (that is a `GPTConfig`).

    The defaults are nanoGPT's CPU recipe for character-level Shakespeare.

    Attributes:
        batch_size: B, sequences per micro-batch.
        grad_accum: micro-batches whose gradients add up to one optimiser step; a step
            sees B * grad_accum sequences.
        max_steps: optimiser steps of the whole run.
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: the floor the cosine decays to (0 <= min_lr <= lr).
        warmup_steps: steps of linear warm-up from lr / warmup_steps to lr.
        decay_steps: the step at which the cosine reaches min_lr (default: max_steps).
        weight_decay: AdamW's decoupled weight decay, applied to matrices only.
        beta1, beta2: AdamW's moment decay rates, in [0, 1).
        grad_clip: largest global gradient norm; 0 turns clipping off.
        eval_interval: evaluate (and checkpoint) every this many steps, and at the end.
        eval_steps: batches per split in each evaluation.
        eval_full: score the validation loss of each evaluation on the whole validation
            split (`full_loss`) instead of on ``eval_steps`` batches: slower, free of
            sampling noise (what comparing the time two recipes take to a loss needs).
        seed: seeds the initial weights, the batches and dropout.
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

    batch_size: int = Field(default=12, ge=1,
                            description="B, sequences per micro-batch (per process)")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per optimiser step")
    max_steps: int = Field(default=2000, ge=0, description="optimiser steps of the whole run")
    lr: float = Field(default=1e-3, gt=0.0,
                      description="peak learning rate, reached after the warm-up")
    min_lr: float = Field(default=1e-4, ge=0.0,
                          description="the learning rate the cosine decays to")
    warmup_steps: int = Field(default=100, ge=0,
                              description="steps of linear warm-up (by default at most "
                                          "decay_steps, so that a short run needs no flag)")
    decay_steps: int | None = Field(default=None, ge=0,
                                    description="the step at which the cosine reaches min_lr "
                                                "(default: max_steps)")
    weight_decay: float = Field(default=0.1, ge=0.0,
                                description="AdamW's weight decay, on matrices only")
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0,
                         description="AdamW's first-moment decay rate")
    beta2: float = Field(default=0.99, ge=0.0, lt=1.0,
                         description="AdamW's second-moment decay rate")
    grad_clip: float = Field(default=1.0, ge=0.0,
                             description="largest gradient norm, 0 for no clipping")
    eval_interval: int = Field(default=250, ge=1,
                               description="evaluate and checkpoint every this many steps")
    eval_steps: int = Field(default=20, ge=1, description="batches per split in each evaluation")
    eval_full: bool = False
    seed: int = Field(default=1337, ge=0,
                      description="seeds the initial weights, the batches and dropout")
    bf16: bool = Field(default=False, description="bf16 autocast for forward passes")
    device: str = Field(default="cpu", description="cpu, cuda, cuda:1, ...")
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
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device {self.device!r} is not a torch device "
                             "(e.g. 'cpu', 'cuda', 'cuda:1')") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: CUDA is not available on this machine")
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

# ------------------------------------------------------------------ optimiser and schedule
# The optimisers and schedules themselves are `minigpt.optim`'s; here the run's
# configuration chooses among them.


def schedule_lr(step: int, config: TrainConfig) -> float:
    """The learning rate of step ``step`` under ``config``'s schedule."""
    c = config
    if c.schedule == "trapezoid":
        return trapezoid_lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps,
                               decay_steps=c.schedule_end,
                               cooldown_fraction=c.cooldown_fraction)
    return lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup_steps=c.warmup_steps,
                 decay_steps=c.schedule_end)


class MuonAdamW:
    """Muon on the hidden matrices and AdamW on the rest, stepped as one optimiser.

    ``param_groups`` lists both optimisers' groups; each group keeps its peak rate in
    ``"peak_lr"``, so a schedule scales them all by the same factor.
    """

    def __init__(self, model: GPT, config: TrainConfig) -> None:
        hidden, rest = muon_and_adamw_parameters(model)
        self.muon = Muon(hidden, lr=config.muon_lr, momentum=config.muon_momentum)
        self.adamw = configure_optimizer(rest, lr=config.lr,
                                         weight_decay=config.weight_decay,
                                         betas=(config.beta1, config.beta2))
        for group in self.param_groups:
            group["peak_lr"] = group["lr"]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


Optimizer = torch.optim.AdamW | MuonAdamW


def build_optimizer(model: GPT, config: TrainConfig) -> Optimizer:
    """The run's optimiser: `configure_optimizer`'s AdamW, or `MuonAdamW`."""
    if config.optimizer == "muon":
        return MuonAdamW(model, config)
    return configure_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                               betas=(config.beta1, config.beta2))


def set_lr(optimizer: Optimizer, lr: float, config: TrainConfig) -> None:
    """Give every group the schedule's rate: ``lr`` itself for AdamW alone, else each
    group's peak rate scaled by lr / config.lr."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * lr / config.lr if "peak_lr" in group else lr


# ---------------------------------------------------------------------------- the loop


def _autocast(device: torch.device, bf16: bool) -> Any:
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
        mask: (B, T) bool, True where a target counts; at least one must for the mean.
    """
    if targets.shape != logits.shape[:-1] or mask.shape != targets.shape:
        raise ValueError(f"need logits (B, T, V) with targets and mask (B, T), got "
                         f"{tuple(logits.shape)}, {tuple(targets.shape)}, {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True: the target counts), got {mask.dtype}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    total = losses.masked_select(mask.flatten()).sum()
    if reduction == "sum":
        return total
    count = mask.sum()
    if count == 0:
        raise ValueError("the mask selects no target: a mean over none is undefined")
    return total / count


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
    targets, however the ranks share them. ``loss_fn`` replaces `lm_loss` (as in
    `train_step`).
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
                with _autocast(device, bf16):
                    if loss_fn is None and len(batch) == 3:
                        summed = lm_loss(model, *batch, reduction="sum").float()
                        counted.append(torch.stack([summed, batch[2].sum().float()]))
                    else:
                        loss = lm_loss(model, *batch) if loss_fn is None else loss_fn(model,
                                                                                      batch)
                        total += loss.float()
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
    total = torch.zeros((), dtype=torch.float64)
    with eval_mode(model):
        for k in range(0, n_windows, batch_size):
            x, y = x_all[k:k + batch_size].to(device), y_all[k:k + batch_size].to(device)
            with _autocast(device, bf16):
                logits = model(x)
            total += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1),
                                     reduction="sum").double().cpu()
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


@dataclass
class History:
    """What a run measured. ``step[i]`` has ``loss[i]`` (its batch's loss, averaged over
    the ranks), ``lr[i]``, ``grad_norm[i]`` (the global gradient norm before clipping) and
    ``step_ms[i]`` (wall time of the step: batches, forward, backward, update; not
    evaluations); evaluations at ``eval_step[j]`` gave ``train_loss[j]`` and
    ``val_loss[j]`` (``eval_step`` counts steps done, so 0 is the untrained model)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)


@dataclass
class TrainResult:
    model: GPT
    history: History
    metrics: dict[str, Any]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean loss of the step's micro-batches (on this rank)
    grad_norm: float  # global L2 norm of the gradient, before clipping


def train_step(
    model: nn.Module, optimizer: Optimizer,
    micro_batches: Sequence[tuple[Tensor, ...]], *, grad_clip: float,
    bf16: bool = False, counted: Tensor | None = None, loss_fn: LossFn | None = None,
) -> StepResult:
    """One optimiser step on k micro-batches of (x, y), each (B, T), or of (x, y, mask).

    Each micro-batch's mean loss is scaled by 1/k before its backward pass,
    so the summed gradient is that of the mean loss over all k * B
    sequences. Masked micro-batches count different numbers of targets n_i (answers of
    different lengths), so their means are no equal shares: each one's *summed* loss is
    divided by N = n_1 + ... + n_k instead, and the gradient is that of the mean over all
    N counted targets. Under DDP the gradients are averaged over the ranks once, during
    the last micro-batch's backward pass; ``counted`` is then N averaged over the ranks,
    so that their average is the mean over every rank's counted targets. The gradient
    is clipped to norm ``grad_clip`` (0: not clipped) before the update. A ``loss_fn``
    replaces `lm_loss`: its mean loss of each micro-batch counts 1/k.
    """
    k = len(micro_batches)
    masked = loss_fn is None and len(micro_batches[0]) == 3
    if masked and counted is None:
        counted = sum((b[2].sum() for b in micro_batches), torch.zeros((), dtype=torch.long))
    loss_sum = torch.zeros((), device=micro_batches[0][0].device)
    for i, batch in enumerate(micro_batches):
        with _sync_gradients(model, i == k - 1):
            with _autocast(batch[0].device, bf16):
                if counted is None:
                    loss = lm_loss(model, *batch) if loss_fn is None else loss_fn(model, batch)
                    share = loss / k
                else:
                    share = loss = lm_loss(model, *batch, reduction="sum") / counted
            share.backward()  # type: ignore[no-untyped-call]
        loss_sum += loss.detach().float()
    norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # .item() waits for the step to finish
    return StepResult(loss_sum.item() / (1 if masked else k), float(norm))


def _sync_gradients(model: nn.Module, sync: bool) -> Any:
    # DDP all-reduces in every backward pass unless told not to; one all-reduce per
    # optimiser step is enough, as the micro-batches' gradients add up locally first.
    # Looked up by name: torch.compile's wrapper of a DDP model is no DDP instance, but it
    # hands attribute look-ups on to the model it wraps.
    no_sync = getattr(model, "no_sync", None)
    return nullcontext() if sync or no_sync is None else no_sync()


def _rng_state(batch_gen: torch.Generator, ctx: DistContext) -> dict[str, Any]:
    """The random state of the run: the batch stream (shared by the ranks) and each rank's
    torch generator (dropout). Collective: every rank must call it."""
    mine = {"torch": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(ctx.device)
    ranks = gather(mine, ctx)
    return {"batches": batch_gen.get_state(), "torch": ranks[0]["torch"], "ranks": ranks}


def save_run(path: Path, model: GPT, optimizer: Optimizer, config: TrainConfig,
             *, step: int, history: History, batch_gen: torch.Generator,
             tokenizer: Tokenizer | None, ctx: DistContext = SINGLE) -> None:
    """Checkpoint the run at ``step`` (rank 0 writes; every rank must call it)."""
    rng = _rng_state(batch_gen, ctx)
    if ctx.is_main:
        save_checkpoint(path, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "model_config": model.config.model_dump(), "train_config": config.model_dump(),
            "tokenizer": None if tokenizer is None else tokenizer.to_dict(),
            "step": step, "rng": rng, "history": asdict(history),
            "world_size": ctx.world_size})
    barrier(ctx)


def resume_run(
    ckpt: dict[str, Any], model: GPT, optimizer: Optimizer,
    config: TrainConfig, batch_gen: torch.Generator,
    ctx: DistContext = SINGLE,
) -> tuple[int, History]:
    """Restore a saved run into ``model``, ``optimizer`` and the random
    generators; return the step it reached and its history.

    A checkpoint of another model, of other settings (only max_steps and the
    device may change) or of another number of processes is refused.
    """
    _check_resumable(ckpt, model, config, ctx)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt["rng"]  # generators take their states as CPU byte tensors
    batch_gen.set_state(rng["batches"].cpu())  # the batches: one stream, all ranks
    mine = rng["ranks"][ctx.rank] if "ranks" in rng else rng  # dropout's
    torch.set_rng_state(mine["torch"].cpu())
    if "cuda" in mine and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"].cpu(), ctx.device)
    history = History(**({"grad_norm": []} | ckpt["history"]))
    return int(ckpt["step"]), history


def _check_resumable(ckpt: dict[str, Any], model: GPT, config: TrainConfig,
                     ctx: DistContext) -> None:
    if ckpt["model_config"] != model.config.model_dump():
        raise ValueError("the model's configuration differs from the checkpoint's; "
                         "resume with the checkpoint's GPTConfig")
    saved = ckpt["train_config"] | {"max_steps": config.max_steps, "device": config.device}
    if saved != config.model_dump():
        raise ValueError("resume=True continues the saved run: only max_steps (and the "
                         "device) may differ from the checkpoint's TrainConfig")
    if ckpt["world_size"] != ctx.world_size:
        raise ValueError(f"the checkpoint was written by a run of {ckpt['world_size']} "
                         f"process(es) and this run has {ctx.world_size}; resume with the "
                         "same number (--nproc-per-node), since the batches each step reads "
                         "depend on it")


def train(model: GPT | GPTConfig, config: TrainConfig, train_data: np.ndarray | ExampleSet,
          val_data: np.ndarray | ExampleSet, *, tokenizer: Tokenizer | None = None,
          out_dir: Path | str | None = None, resume: bool = False, stop_at: int | None = None,
          progress: bool = True, log: Callable[[str], None] | None = None,
          ctx: DistContext | None = None, compile: bool = False,
          loss_fn: LossFn | None = None) -> TrainResult:
    """Train a GPT on token ids; return it with its `History` and metrics (`_metrics`).

    Args:
        model: a `GPT` to train further, or a `GPTConfig` to build one from (its initial
            weights are then seeded by ``config.seed``).
        config: the run's `TrainConfig`.
        train_data, val_data: (N,) token ids, e.g. `minigpt.data.load_ids` memmaps, or
            `ExampleSet`s, whose masked targets alone count (supervised fine-tuning).
        tokenizer: stored in checkpoints so that sampling can decode.
        out_dir: where ``checkpoint.pt`` goes, after every evaluation and at the end.
        resume: continue the run saved in ``out_dir`` (`resume_run`), with its schedule.
        stop_at: stop after this many steps (and checkpoint), as if interrupted.
        progress: show a tqdm progress bar; log: called with each evaluation's line.
        ctx: this process's place in a multi-process run (`minigpt.parallel`); None for
            one process on ``config.device``. Rank 0 logs and checkpoints.
        compile: run the training steps through `torch.compile` (the first step then
            takes seconds to compile; evaluation and checkpoints use the plain model).
        loss_fn: replaces next-token cross-entropy in training and evaluation (`LossFn`).

    Torch's global generator (dropout) is seeded with ``config.seed`` plus the rank.
    """
    ctx = _check_train_args(config, out_dir, resume, stop_at, ctx)
    model, optimizer, batch_gen = _set_up(model, config, train_data, val_data, ctx)
    history, start = History(), 0
    if resume:
        start, history, tokenizer = restore(Path(str(out_dir)), model, optimizer, config,
                                            batch_gen, ctx, tokenizer)
    end = config.max_steps if stop_at is None else min(stop_at, config.max_steps)
    if start > end:
        raise ValueError(f"the checkpoint is at step {start}, past the requested end {end}")
    save = None if out_dir is None else partial(
        save_run, Path(out_dir) / CHECKPOINT_NAME, model, optimizer, config, history=history,
        batch_gen=batch_gen, tokenizer=tokenizer, ctx=ctx)
    saved_at, trainee = start if resume else -1, trainee_of(model, ctx, compile=compile).train()
    wall0, bar = time.perf_counter(), _bar(start, end, progress and ctx.is_main)
    for step in range(start, end + 1):
        # At multiples of eval_interval and at the end (a resumed run's first is done).
        if (step % config.eval_interval == 0 or step == config.max_steps) and not (
                resume and step == start):
            _evaluate(model, config, train_data, val_data, history, step, bar,
                      log if ctx.is_main else None, ctx, loss_fn)
            if save is not None and step > start:
                save(step=step)
                saved_at = step
        if step < end:
            loss = _optimizer_step(step, trainee, optimizer, config, train_data, batch_gen,
                                   history, ctx, model.config.context_length, loss_fn)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            bar.update(1)
    bar.close()
    if save is not None and end != saved_at:
        save(step=end)
    return TrainResult(model, history, _metrics(history, config, model,
                                                 time.perf_counter() - wall0, ctx))


def _bar(start: int, end: int, show: bool) -> Any:
    return tqdm(total=end, initial=start, unit="step", disable=not show, dynamic_ncols=True)


def _evaluate(model: GPT, config: TrainConfig, train_data: np.ndarray | ExampleSet,
              val_data: np.ndarray | ExampleSet,
              history: History, step: int, bar: Any, log: Callable[[str], None] | None,
              ctx: DistContext, loss_fn: LossFn | None = None) -> None:
    # Each rank scores its share of global batches: the numbers do not depend on the number
    # of processes, and no GPU holds more than its training batch.
    losses = estimate_loss(model, {"train": train_data, "val": val_data},
                           batch_size=config.batch_size, seed=config.seed + 1,
                           context_length=model.config.context_length,
                           eval_steps=config.eval_steps, bf16=config.bf16, ctx=ctx,
                           loss_fn=loss_fn)
    if config.eval_full and not isinstance(val_data, ExampleSet):  # the same on every rank
        losses["val"] = full_loss(model, val_data, bf16=config.bf16)
    history.eval_step.append(step)
    history.train_loss.append(losses["train"])
    history.val_loss.append(losses["val"])
    bar.set_postfix(val=f"{losses['val']:.4f}")
    if log is not None:
        log(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")


def restore(out_dir: Path, model: GPT, optimizer: Optimizer, config: TrainConfig,
            batch_gen: torch.Generator, ctx: DistContext, tokenizer: Tokenizer | None,
            ) -> tuple[int, History, Tokenizer | None]:
    """Continue the run saved in ``out_dir`` (`resume_run`); returns its step, its history
    and its tokenizer (``tokenizer`` if given)."""
    # Onto the CPU, whatever the run's device: load_state_dict moves weights and moments to
    # the parameters' device, and generators take only CPU states.
    ckpt = load_checkpoint(out_dir)
    start, history = resume_run(ckpt, model, optimizer, config, batch_gen, ctx)
    if tokenizer is None and ckpt["tokenizer"] is not None:
        tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    return start, history, tokenizer


def _optimizer_step(step: int, trainee: nn.Module, optimizer: Optimizer,
                    config: TrainConfig, data: np.ndarray | ExampleSet,
                    batch_gen: torch.Generator,
                    history: History, ctx: DistContext, T: int,
                    loss_fn: LossFn | None = None) -> float:
    """Step ``step`` of the run: its learning rate, its batches, `train_step`, the history."""
    lr = schedule_lr(step, config)
    set_lr(optimizer, lr, config)
    t0 = time.perf_counter()
    batches = [rank_batch(data, config.batch_size, T, ctx, generator=batch_gen)
               for _ in range(config.grad_accum)]
    counted = None
    if ctx.distributed and len(batches[0]) == 3:  # masked: the ranks' mean answer count
        counted = mean_over_ranks(torch.stack([b[2].sum() for b in batches]).sum().double(),
                                  ctx)
    result = train_step(trainee, optimizer, batches, grad_clip=config.grad_clip,
                        bf16=config.bf16, counted=counted, loss_fn=loss_fn)
    loss = result.loss
    if ctx.distributed:  # the loss of the whole global batch, as one process sees it
        loss = mean_over_ranks(torch.tensor(loss, dtype=torch.float64), ctx).item()
    history.step.append(step)
    history.loss.append(loss)
    history.lr.append(lr)
    history.grad_norm.append(result.grad_norm)
    history.step_ms.append((time.perf_counter() - t0) * 1000.0)
    return loss


def trainee_of(model: GPT, ctx: DistContext, *, compile: bool = False) -> nn.Module:
    """The module the training steps call: the model, wrapped in DDP for several processes,
    then compiled if asked (`_sync_gradients` finds DDP's ``no_sync`` through the wrapper)."""
    trainee = wrap_model(model, ctx)
    return cast(nn.Module, torch.compile(trainee)) if compile else trainee


def _check_train_args(config: TrainConfig, out_dir: Path | str | None, resume: bool,
                      stop_at: int | None, ctx: DistContext | None) -> DistContext:
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir, the directory holding checkpoint.pt")
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int)
                                or stop_at < 0):
        raise ValueError(f"stop_at must be a non-negative int or None, got {stop_at!r}")
    if ctx is None:
        return DistContext(device=torch.device(config.device))
    if not isinstance(ctx, DistContext):
        raise TypeError(f"ctx must be a DistContext, got {type(ctx).__name__}")
    return ctx


def _set_up(model: GPT | GPTConfig, config: TrainConfig, train_data: np.ndarray | ExampleSet,
            val_data: np.ndarray | ExampleSet, ctx: DistContext,
            ) -> tuple[GPT, Optimizer, torch.Generator]:
    """The model on its device, its optimiser, the batch generator; dropout's seed."""
    model = _build_model(model, config, train_data, val_data).to(ctx.device)
    optimizer = build_optimizer(model, config)
    torch.manual_seed(config.seed + ctx.rank)  # dropout: each rank its own masks
    return model, optimizer, torch.Generator().manual_seed(config.seed)


def _build_model(model: GPT | GPTConfig, config: TrainConfig,
                 train_data: np.ndarray | ExampleSet, val_data: np.ndarray | ExampleSet) -> GPT:
    if isinstance(model, GPTConfig):
        torch.manual_seed(config.seed)  # the initial weights
        model = GPT(model)
    elif not isinstance(model, GPT):
        raise TypeError(f"model must be a GPT or a GPTConfig, got {type(model).__name__}")
    T = model.config.context_length
    for name, data in (("train_data", train_data), ("val_data", val_data)):
        if isinstance(data, ExampleSet):
            data.check_context_length(T)
            if config.eval_full:
                raise ValueError(f"eval_full scores a stream of ids; {name} is an ExampleSet, "
                                 "whose loss eval_steps batches estimate")
        elif len(data) <= T:
            raise ValueError(f"{name} has {len(data)} tokens; it needs more than "
                             f"context_length={T}")
        _check_data_ids(name, data, model.config.vocab_size)
    return model


def _check_data_ids(name: str, data: np.ndarray | ExampleSet, vocab_size: int) -> None:
    """Every id of the data lies in [0, vocab_size): checked once here, where the data enter,
    since the forward pass checks ids only on the CPU (`minigpt.model._check_id_range`)."""
    if isinstance(data, ExampleSet):
        low = min(int(s.min()) for s in data.sequences)
        high = max(int(s.max()) for s in data.sequences)
    else:
        low, high = int(np.min(data)), int(np.max(data))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}; the model's ids lie in "
                         f"[0, {vocab_size}) (its vocab_size)")


def _metrics(history: History, config: TrainConfig, model: GPT, total_seconds: float,
             ctx: DistContext) -> dict[str, Any]:
    """final_train_loss, final_val_loss, median_step_ms, tokens_per_second (all ranks),
    steps, train_seconds (sum of step times), total_seconds (wall time, incl. evaluation),
    world_size and effective_batch_size (sequences per optimiser step, all ranks)."""
    effective = config.batch_size * config.grad_accum * ctx.world_size
    tokens_per_step = effective * model.config.context_length
    train_seconds = sum(history.step_ms) / 1000.0
    return {
        "final_train_loss": history.train_loss[-1] if history.train_loss else None,
        "final_val_loss": history.val_loss[-1] if history.val_loss else None,
        "final_eval_step": history.eval_step[-1] if history.eval_step else None,
        "median_step_ms": statistics.median(history.step_ms) if history.step_ms else None,
        "tokens_per_second": (len(history.step_ms) * tokens_per_step / train_seconds
                              if train_seconds > 0 else None),
        "steps": history.step[-1] + 1 if history.step else 0,
        "train_seconds": train_seconds,
        "total_seconds": total_seconds,
        "num_parameters": model.num_parameters(),
        "torch_threads": torch.get_num_threads(),
        "world_size": ctx.world_size,
        "effective_batch_size": effective,
    }


def with_global_batch(config: TrainConfig, global_batch_size: int | None,
                      world_size: int) -> TrainConfig:
    """``config`` with grad_accum set so that a step sees ``global_batch_size`` sequences
    over ``world_size`` processes (None: ``config`` as it is)."""
    if global_batch_size is None:
        return config
    if global_batch_size % (per := config.batch_size * world_size):
        raise ValueError(f"--global-batch-size {global_batch_size} does not split into "
                         f"micro-batches of --batch-size {config.batch_size} x {world_size} "
                         f"processes: it must be a positive multiple of {per}")
    return config.model_copy(update={"grad_accum": global_batch_size // per})


def write_metrics(out_dir: Path, result: TrainResult, config: TrainConfig,
                  val_data: np.ndarray, **more: Any) -> dict[str, Any]:
    """Write ``metrics.json`` (the run's metrics, its configurations, the loss on the whole
    validation split and ``more``) and ``history.json`` into ``out_dir``; return the first."""
    model = result.model
    metrics = result.metrics | {
        "final_val_loss_full": full_loss(model, val_data, bf16=config.bf16),
        "model_config": model.config.model_dump(), "train_config": config.model_dump(),
        "vocab_size": model.config.vocab_size, "val_tokens": len(val_data)} | more
    for name, content in ((METRICS_NAME, metrics), ("history.json", asdict(result.history))):
        atomic_write(Path(out_dir) / name, (json.dumps(content, indent=2) + "\n").encode())
    return metrics


def saved_settings(out_dir: Path, **changes: Any,
                   ) -> tuple[GPTConfig, TrainConfig, Tokenizer | None]:
    """The configurations and tokenizer of the run saved in ``out_dir``, with ``changes``
    (max_steps, device: what a resumed run may change) applied."""
    ckpt = load_checkpoint(out_dir)
    saved = ckpt["train_config"] | changes
    if "device" not in changes and saved["device"] != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"the run in {out_dir} was trained on {saved['device']!r}, which this "
                         "machine lacks; continue it here with device cpu (--device cpu)")
    tokenizer = tokenizer_from_dict(ckpt["tokenizer"]) if ckpt["tokenizer"] else None
    return GPTConfig(**ckpt["model_config"]), TrainConfig(**saved), tokenizer
