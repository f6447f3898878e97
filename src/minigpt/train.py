"""Training a GPT: the step, the loop, and checkpoints to continue a run.

The loop is nanoGPT's in substance: AdamW with weight decay on the matrices only (or Muon on
the hidden matrices, `minigpt.optim`), a linear warm-up then a decay to a floor, gradient
clipping, optional gradient accumulation and bf16 autocast, a periodic estimate of the train
and validation loss (`minigpt.losses`), and checkpoints that hold everything needed to
continue the very same run (weights, optimiser moments, the configurations, the tokenizer
and the random-number generators). `train` is the loop, read top to bottom; `train_step`
is one optimiser step.

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
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm  # plain text bar: works in a terminal and a notebook alike

from minigpt.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from minigpt.config import GPTConfig, TrainConfig, stream_seed
from minigpt.data import Batch, ExampleSet
from minigpt.files import atomic_write
from minigpt.losses import (
    SINGLE,
    LossFn,
    MicroBatch,
    autocast,
    estimate_loss,
    full_loss,
    lm_loss,
)
from minigpt.model import GPT
from minigpt.optim import Optimizer, build_optimizer, schedule_lr, set_lr
from minigpt.parallel import (
    DistContext,
    allow_tf32,
    barrier,
    gather,
    mean_over_ranks,
    rank_batch,
    wrap_model,
)
from minigpt.tokenizer import Tokenizer, tokenizer_from_dict

METRICS_NAME = "metrics.json"


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
    """What a step measured, as 0-dim tensors on the model's device: reading them (``float``)
    waits for the device, so the loop reads them only when it logs."""

    loss: Tensor  # the step's mean loss (on this rank: its micro-batches)
    grad_norm: Tensor  # global L2 norm of the gradient, before clipping


def train_step(
    model: nn.Module, optimizer: Optimizer, micro_batches: Sequence[MicroBatch], *,
    grad_clip: float, bf16: bool = False, loss_fn: LossFn | None = None,
    ctx: DistContext = SINGLE,
) -> StepResult:
    """One optimiser step on k micro-batches, each a `Batch` of (B, T) inputs and targets,
    and of a mask for examples whose masked targets alone count.

    The loss is the mean over all N counted targets of the k micro-batches (every target
    of a stream of ids; of examples, the masked ones): each micro-batch's *summed*
    cross-entropy is divided by N = n_1 + ... + n_k, counted before the first backward
    pass, so the summed gradient is that of the mean and every counted target weighs the
    same, in a micro-batch of short answers or of long ones. Under DDP the gradients are
    averaged over the ranks once, during the last micro-batch's backward pass, and N is
    averaged over the ranks (one all-reduce), so that their average is the mean over every
    rank's counted targets. The gradient is clipped to norm ``grad_clip`` (0: not clipped)
    before the update. A ``loss_fn`` replaces `lm_loss`: its mean loss of each
    micro-batch, whatever batch type its data set draws, counts 1/k. The loss and the
    norm stay on the device (`StepResult`): reading them would wait for the step.
    """
    k = len(micro_batches)
    if loss_fn is None:  # every counted target of the step, on every rank, weighs the same
        counted = mean_over_ranks(torch.stack([_counted(b) for b in micro_batches]).sum()
                                  .to(wide_float(ctx.device)), ctx)
    loss_sum = torch.zeros((), device=micro_batches[0].x.device)
    for i, batch in enumerate(micro_batches):
        with _sync_gradients(model, i == k - 1):  # the backward pass is inside: DDP's no_sync
            with autocast(batch.x.device, bf16):
                if loss_fn is not None:
                    loss = loss_fn(model, batch) / k
                else:  # a Batch (`_counted` checked)
                    loss = lm_loss(model, *cast(Batch, batch), reduction="sum") / counted
            loss.backward()  # type: ignore[no-untyped-call]
        loss_sum += loss.detach().float()
    norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, norm)


def _counted(batch: MicroBatch) -> Tensor:
    """How many targets of a `Batch` count: where its mask is True, or all of them."""
    assert isinstance(batch, Batch), "next-token cross-entropy reads Batches; else a loss_fn"
    if batch.mask is None:  # made on the device: no copy from the host every micro-batch
        return torch.full((), batch.y.numel(), dtype=torch.int64, device=batch.y.device)
    return batch.mask.sum()


def wide_float(device: torch.device) -> torch.dtype:
    """The dtype a step's counts and losses are averaged in on ``device``: float64, but on
    Apple's MPS, which has none, float32 (exact for counts below 2^24)."""
    return torch.float32 if device.type == "mps" else torch.float64


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
            one process on ``config.device``. Every rank evaluates its share; rank 0 logs
            and writes the checkpoints.
        compile: run the training steps through `torch.compile` (the first step then
            takes seconds to compile; evaluation and checkpoints use the plain model).
        loss_fn: replaces next-token cross-entropy in training and evaluation (`LossFn`).

    The initial weights, dropout (on each rank its own), the batches (the same on every
    rank) and the evaluation's batches each draw from their own stream of ``config.seed``
    (`minigpt.config.stream_seed`); dropout's is torch's global generator. On a
    CUDA device float32 matrix products use TF32 from here on (`minigpt.parallel.allow_tf32`).
    """
    if resume and out_dir is None:
        raise ValueError("resume=True needs out_dir, the directory holding checkpoint.pt")
    if stop_at is not None and stop_at < 0:
        raise ValueError(f"stop_at must be a number of steps (>= 0) or None, got {stop_at}")
    ctx = DistContext(device=torch.device(config.device)) if ctx is None else ctx
    allow_tf32(ctx.device)  # as the command line does: a run from Python on a GPU too
    model = _model_for(model, config, train_data, val_data).to(ctx.device)
    optimizer = build_optimizer(model, config)
    torch.manual_seed(stream_seed(config.seed, "dropout", ctx.rank))  # each rank its masks
    batch_gen = torch.Generator().manual_seed(stream_seed(config.seed, "batches"))  # all ranks
    history, start = History(), 0
    if resume:
        # Onto the CPU, whatever the run's device: load_state_dict moves weights and moments
        # to the parameters' device, and generators take only CPU states.
        ckpt = load_checkpoint(Path(str(out_dir)))
        start, history = resume_run(ckpt, model, optimizer, config, batch_gen, ctx)
        if tokenizer is None and ckpt["tokenizer"] is not None:
            tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    end = config.max_steps if stop_at is None else min(stop_at, config.max_steps)
    if start > end:
        raise ValueError(f"the checkpoint is at step {start}, past the requested end {end}")

    def save(step: int) -> None:
        if out_dir is not None:
            save_run(Path(out_dir) / CHECKPOINT_NAME, model, optimizer, config, step=step,
                     history=history, batch_gen=batch_gen, tokenizer=tokenizer, ctx=ctx)

    trainee = trainee_of(model, ctx, compile=compile).train()
    T = model.config.context_length
    bar = tqdm(total=end, initial=start, unit="step", disable=not (progress and ctx.is_main),
               dynamic_ncols=True)
    saved_at, wall0 = start if resume else -1, time.perf_counter()
    unread: list[StepResult] = []  # the steps' losses and norms, read at each evaluation
    for step in range(start, end + 1):
        # Evaluate at multiples of eval_interval and at the end (a resumed run's first step
        # was evaluated before it stopped). Each rank scores its share of global batches:
        # the numbers do not depend on the number of processes.
        if (step % config.eval_interval == 0 or step == config.max_steps) and not (
                resume and step == start):
            record_steps(unread, history, ctx)
            losses = estimate_loss(model, {"train": train_data, "val": val_data},
                                   batch_size=config.batch_size, context_length=T,
                                   eval_steps=config.eval_steps,
                                   seed=stream_seed(config.seed, "eval"),
                                   bf16=config.bf16, ctx=ctx, loss_fn=loss_fn)
            if config.eval_full and not isinstance(val_data, ExampleSet):
                losses["val"] = full_loss(model, val_data, bf16=config.bf16)  # on every rank
            history.eval_step.append(step)
            history.train_loss.append(losses["train"])
            history.val_loss.append(losses["val"])
            bar.set_postfix(loss=f"{history.loss[-1]:.4f}" if history.loss else "-",
                            val=f"{losses['val']:.4f}")
            if log is not None and ctx.is_main:
                log(f"step {step}: train loss {losses['train']:.4f}, "
                    f"val loss {losses['val']:.4f}")
            if step > start:
                save(step)
                saved_at = step
        if step == end:
            break
        # One optimiser step: its learning rate, its grad_accum micro-batches, the update.
        lr = schedule_lr(step, config)
        set_lr(optimizer, lr, config)
        t0 = time.perf_counter()
        batches = [rank_batch(train_data, config.batch_size, T, ctx, generator=batch_gen)
                   for _ in range(config.grad_accum)]
        result = train_step(trainee, optimizer, batches, grad_clip=config.grad_clip,
                            bf16=config.bf16, loss_fn=loss_fn, ctx=ctx)
        history.step.append(step)
        history.lr.append(lr)
        history.step_ms.append((time.perf_counter() - t0) * 1000.0)
        unread.append(result)
        bar.update(1)
    bar.close()
    record_steps(unread, history, ctx)
    if end != saved_at:
        save(end)
    return TrainResult(model, history, _metrics(history, config, model,
                                                 time.perf_counter() - wall0, ctx))


def record_steps(results: list[StepResult], history: History, ctx: DistContext) -> None:
    """Move the steps' losses (averaged over the ranks: the loss of each global batch, as one
    process sees it) and gradient norms into ``history``, and forget them. One wait for the
    device and one all-reduce for them all (collective: every rank must call it)."""
    if results:
        losses = mean_over_ranks(torch.stack([r.loss for r in results])
                                 .to(wide_float(ctx.device)), ctx)
        history.loss += losses.tolist()
        history.grad_norm += torch.stack([r.grad_norm for r in results]).tolist()
        results.clear()


def trainee_of(model: GPT, ctx: DistContext, *, compile: bool = False) -> nn.Module:
    """The module the training steps call: the model, wrapped in DDP for several processes,
    then compiled if asked (`_sync_gradients` finds DDP's ``no_sync`` through the wrapper)."""
    trainee = wrap_model(model, ctx)
    return cast(nn.Module, torch.compile(trainee)) if compile else trainee


def _model_for(model: GPT | GPTConfig, config: TrainConfig,
               train_data: np.ndarray | ExampleSet, val_data: np.ndarray | ExampleSet) -> GPT:
    """The model to train (built from a `GPTConfig`, seeded), once its data are checked
    against it: where the data enter the loop."""
    if isinstance(model, GPTConfig):
        torch.manual_seed(stream_seed(config.seed, "init"))
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
    since the forward pass does not check them: PyTorch's embedding refuses an id out of
    range on a CPU, but on a GPU it may read memory it should not."""
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
