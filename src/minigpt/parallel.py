"""Data-parallel training over several processes with `torch.distributed` and DDP.

Each process (a *rank*) holds a full copy of the model, reads its own slice of every batch,
and computes gradients on it; `DistributedDataParallel` averages the gradients over the
ranks during the backward pass, so every rank applies the same update and the copies never
drift apart. Launch one process per GPU (or, on a CPU, a few) with PyTorch's launcher:

    torchrun --standalone --nproc-per-node=2 -m minigpt train ...

or, on one machine, with `python -m minigpt train --nproc-per-node 2 ...`, which checks the
settings first and starts the processes itself. Either way each process finds its rank in
the environment variables RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from minigpt.data import Batch, ExampleSet, get_batch

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


class DistributedError(RuntimeError):
    """A distributed setting that cannot work here; the message says what to change."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a run: its rank among ``world_size`` processes, its
    rank on this machine, the communication backend and its device. The defaults describe
    a single process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes files; every rank trains and scores its share of
        each evaluation (`minigpt.losses.estimate_loss` averages the shares)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer"
                               ) from None
    if number < 0:
        raise DistributedError(f"environment variable {name}={number} is negative")
    return number


def choose_backend(device: torch.device, backend: str | None) -> str:
    """gloo on CPUs, nccl on CUDA GPUs, unless ``backend`` names one; refuses what cannot
    run here."""
    chosen = backend or ("nccl" if device.type == "cuda" else "gloo")
    if chosen not in ("gloo", "nccl"):
        raise DistributedError(f"backend {chosen!r} is not supported; choose gloo or nccl")
    if chosen == "nccl" and device.type != "cuda":
        raise DistributedError("the nccl backend needs CUDA GPUs, and this run is on the "
                               f"{device.type}; use --backend gloo, or --device cuda on a "
                               "machine with GPUs")
    if chosen == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise DistributedError("the nccl backend needs CUDA GPUs and a PyTorch built with "
                               "NCCL; this machine has neither; use --backend gloo")
    return chosen


def allow_tf32(device: torch.device) -> None:
    """On a CUDA device, let float32 matrix products use TF32
    (``torch.set_float32_matmul_precision("high")``), as GPU training recipes do; on any
    other device nothing changes. The one place that decides it: `init_distributed` calls
    it before a command loads its model, and `minigpt.train.train` for a run started from
    Python."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def init_distributed(device: str = "cpu", backend: str | None = None) -> DistContext:
    """Join the process group described by the environment (set by torchrun), or return a
    single-process context when there is none (or WORLD_SIZE is 1).

    On CUDA, rank r of a machine uses GPU ``LOCAL_RANK``, and float32 matrix products may
    use TF32 (`allow_tf32`). Raises `DistributedError` with the setting to change when the
    backend, the GPUs or the rendezvous cannot work.
    """
    dev = torch.device(device)
    allow_tf32(dev)
    if not all(name in os.environ for name in ENV_VARS) or _env_int("WORLD_SIZE") <= 1:
        return DistContext(device=dev)
    rank, local_rank, world = (_env_int(name) for name in ENV_VARS)
    if rank >= world:
        raise DistributedError(f"RANK={rank} must be smaller than WORLD_SIZE={world}")
    chosen = choose_backend(dev, backend)
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local_rank} but this machine has "
                                   f"{torch.cuda.device_count()} GPU(s); start at most that "
                                   "many processes per machine (--nproc-per-node)")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(chosen, rank=rank, world_size=world,
                                timeout=timedelta(minutes=10))
    except (RuntimeError, ValueError) as err:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "address already in use" in str(err).lower():
            raise DistributedError(f"the rendezvous port {where} is in use; choose a free one "
                                   "(--master-port) or let --standalone pick one") from None
        raise DistributedError(f"could not join the process group at {where} as rank {rank} "
                               f"of {world} ({chosen}): {first}") from None
    return DistContext(rank, local_rank, world, chosen, dev)


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (a no-op for a single process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The model as this process trains it.

    With several ranks it is wrapped in `DistributedDataParallel`, which
    broadcasts rank 0's weights once, then averages the gradients in buckets
    while the backward pass runs; a single process trains the model itself.
    """
    if not ctx.distributed:
        return model
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def rank_batch(
    data: np.ndarray | ExampleSet, batch_size: int, context_length: int, ctx: DistContext,
    *, generator: torch.Generator,
) -> Batch:
    """Rank ``ctx.rank``'s share of one global batch, as a `Batch`: (B, T) inputs and
    targets of a stream of ids, or the (B, L) inputs, targets and mask of an `ExampleSet`'s
    padded sequences (a subclass's own batch type, such as preference pairs, is kept).

    Every rank draws the same B * world_size windows (or sequences) from the same seeded
    generator and keeps rows r B .. (r + 1) B - 1, so the ranks read different rows and
    together exactly the batch that one process with batch size B * world_size would read.
    """
    def draw(rows: int, device: torch.device | str = "cpu") -> Batch:
        if isinstance(data, ExampleSet):
            return data.get_batch(rows, context_length, generator=generator, device=device)
        return Batch(*get_batch(data, rows, context_length, generator=generator, device=device))

    if not ctx.distributed:
        return draw(batch_size, ctx.device)
    batch = draw(batch_size * ctx.world_size)
    mine = slice(ctx.rank * batch_size, (ctx.rank + 1) * batch_size)
    kind: Any = type(batch)  # Batch, or a data set's own batch type of tensors
    return cast(Batch, kind(*(None if t is None else t[mine].to(ctx.device) for t in batch)))


def sum_over_ranks(value: Tensor, ctx: DistContext) -> Tensor:
    """The sum of a tensor over the ranks (itself for a single process), on ``ctx.device``:
    NCCL reduces only tensors on the GPU."""
    if not ctx.distributed:
        return value
    value = value.to(ctx.device, copy=True)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def mean_over_ranks(value: Tensor, ctx: DistContext) -> Tensor:
    """The mean of a tensor over the ranks (itself for a single process), on ``ctx.device``."""
    return sum_over_ranks(value, ctx) / ctx.world_size if ctx.distributed else value


def gather(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order (collective: every rank must call it)."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: DistContext) -> None:
    """Wait until every rank gets here."""
    if ctx.distributed:  # NCCL's barrier runs on this rank's GPU
        dist.barrier(device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the operating system's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Raise `DistributedError` if ``port`` cannot be listened on (in use, or out of range)."""
    if not 1 <= port <= 65535:
        raise DistributedError(f"--master-port {port} is not a TCP port (1..65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise DistributedError(f"--master-port {port}: cannot listen on {host}:{port} "
                                   f"({err.strerror}); choose a free port or leave "
                                   "--master-port out to get one") from None
