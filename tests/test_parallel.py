"""Data-parallel training: two real processes (gloo, on the CPU) against one.

Each multi-process test starts its ranks as separate Python processes that meet on a free
port of 127.0.0.1, exactly as `python -m minigpt train --nproc-per-node 2` or torchrun
starts them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt import GPT, GPTConfig
from minigpt.cli import main
from minigpt.data import Batch, ExampleSet
from minigpt.optim import configure_optimizer
from minigpt.parallel import (
    DistContext,
    DistributedError,
    choose_backend,
    free_port,
    init_distributed,
    mean_over_ranks,
    rank_batch,
)
from minigpt.train import train_step

pytestmark = pytest.mark.usefixtures("one_thread")

# One optimiser step on a fixed batch of 8 sequences; rank r of 2 takes rows 4r..4r+3,
# as 2 micro-batches of 2 (so accumulation and the all-reduce are both exercised).
STEP_SCRIPT = textwrap.dedent("""
    import sys, torch
    from minigpt import GPT, GPTConfig
    from minigpt.parallel import init_distributed, shutdown, wrap_model
    from minigpt.optim import configure_optimizer
    from minigpt.data import Batch
    from minigpt.train import train_step
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2,
                          n_layers=2))
    x = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(2))
    mine = slice(4 * ctx.rank, 4 * ctx.rank + 4)
    xs, ys = x[mine], y[mine]
    opt = configure_optimizer(model, lr=1e-2, weight_decay=0.1)
    train_step(wrap_model(model, ctx), opt,
               [Batch(xs[:2], ys[:2]), Batch(xs[2:], ys[2:])], grad_clip=1.0)
    torch.save(model.state_dict(), sys.argv[1] + f"/rank{ctx.rank}.pt")
    shutdown(ctx)
""")


def _ranks(n: int, argv: list[str], tmp: Path) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python argv`` as ranks 0..n-1 of one process group; returns their results."""
    port = str(free_port())
    procs = []
    for rank in range(n):
        env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                            "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, cwd=tmp, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def run_script_on_ranks(n: int, script: str, tmp: Path) -> list[subprocess.CompletedProcess[str]]:
    """Write ``script`` to ``tmp`` and run it as ranks 0..n-1, with the arguments ``tmp`` and
    the tests' folder (from which it may import test modules); every rank must succeed."""
    path = tmp / "ranks_script.py"
    path.write_text(script)
    results = _ranks(n, [str(path), str(tmp), str(Path(__file__).parent)], tmp)
    for r in results:
        assert r.returncode == 0, r.stderr
    return results


@pytest.mark.slow
def test_one_step_on_two_ranks_equals_one_process_on_the_whole_batch(two_ranks: Path) -> None:
    ranks = [torch.load(two_ranks / f"rank{r}.pt", weights_only=True) for r in (0, 1)]

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2, n_layers=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(2))
    opt = configure_optimizer(model, lr=1e-2, weight_decay=0.1)
    train_step(model, opt, [Batch(x, y)], grad_clip=1.0)
    for name, value in model.state_dict().items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # identical updates
        assert torch.allclose(ranks[0][name], value, rtol=0, atol=2e-6), name
    moved = sum(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert moved > 10  # the step did change the weights (the comparison is not vacuous)


def test_rank_batches_partition_the_global_batch() -> None:
    data = np.arange(1000, dtype=np.uint16)
    whole = rank_batch(data, 6, 5, DistContext(), generator=torch.Generator().manual_seed(3))
    parts = [rank_batch(data, 2, 5, DistContext(rank=r, world_size=3),
                        generator=torch.Generator().manual_seed(3)) for r in range(3)]
    assert torch.equal(torch.cat([b.x for b in parts]), whole.x)
    assert torch.equal(torch.cat([b.y for b in parts]), whole.y)
    assert whole.mask is None and all(b.mask is None for b in parts)


TRAIN_FLAGS = ["--n-layers", "2", "--n-heads", "2", "--d-model", "32", "--context-length", "16",
               "--eval-interval", "10", "--eval-steps", "2", "--warmup-steps", "2",
               "--no-progress", "--threads", "1"]

RESUME_FLAGS = ("--no-progress", "--threads", "1")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minigpt.data import shakespeare_text

    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(shakespeare_text()[:60_000], encoding="utf-8")
    return path


def _train(args: list[str], out: Path, text: Path | None = None,
           flags: tuple[str, ...] = tuple(TRAIN_FLAGS)) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "minigpt", "train", *flags, *args, "--out", str(out)]
    if text is not None:
        cmd += ["--text", str(text)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("runs")
    one = _train(["--batch-size", "8", "--max-steps", "20"], root / "one", text_file)
    two = _train(["--batch-size", "4", "--max-steps", "20", "--nproc-per-node", "2"],
                 root / "two", text_file)
    for r in (one, two):
        assert r.returncode == 0, r.stderr
    (root / "two.stdout").write_text(two.stdout)
    yield root


@pytest.mark.slow
def test_two_process_run_equals_the_one_process_run(runs: Path) -> None:
    one, two = (json.loads((runs / d / "history.json").read_text()) for d in ("one", "two"))
    assert len(one["loss"]) == len(two["loss"]) == 20
    assert np.max(np.abs(np.subtract(one["loss"], two["loss"]))) < 1e-4
    assert np.max(np.abs(np.subtract(one["val_loss"], two["val_loss"]))) < 1e-4
    assert one["loss"][-1] < one["loss"][0] - 0.3  # it learned something
    metrics = json.loads((runs / "two" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["effective_batch_size"] == 8
    single = json.loads((runs / "one" / "metrics.json").read_text())
    assert abs(metrics["final_val_loss_full"] - single["final_val_loss_full"]) < 1e-4
    # Only rank 0 reports: one summary line, one set of files.
    assert (runs / "two.stdout").read_text().count("wrote ") == 1


@pytest.mark.slow
def test_two_process_resume_continues_the_same_run(
        runs: Path, tmp_path: Path, text_file: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stopped"
    base = ["--batch-size", "4", "--max-steps", "20", "--nproc-per-node", "2"]
    assert _train([*base, "--stop-at", "10"], out, text_file).returncode == 0
    resumed = _train(["--resume", "--nproc-per-node", "2"], out, flags=RESUME_FLAGS)
    assert resumed.returncode == 0, resumed.stderr
    straight = json.loads((runs / "two" / "history.json").read_text())
    again = json.loads((out / "history.json").read_text())
    assert again["loss"] == straight["loss"] and again["val_loss"] == straight["val_loss"]

    # Another number of processes is refused before any process starts (3), or by the one
    # process of a run without --nproc-per-node: both in this process, as a reader's
    # command line would refuse them.
    for extra, needle in ((["--nproc-per-node", "3"], "resume it with --nproc-per-node 2"),
                          ([], "written by a run of 2 process(es) and this run has 1")):
        assert main(["train", *RESUME_FLAGS, "--resume", *extra, "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--nproc-per-node", "2", "--backend", "nccl"], "the nccl backend needs CUDA GPUs"),
    (["--nproc-per-node", "2", "--batch-size", "4", "--global-batch-size", "12"],
     "--global-batch-size 12 does not split into micro-batches of --batch-size 4 x 2 "
     "processes: it must be a positive multiple of 8"),
    (["--batch-size", "4", "--global-batch-size", "6"],  # one process: refused all the same
     "--global-batch-size 6 does not split into micro-batches of --batch-size 4 x 1 "),
    (["--nproc-per-node", "0"], "argument --nproc-per-node: Input should be greater than or equal "
                                 "to 1, got '0'"),
    (["--global-batch-size", "8", "--grad-accum", "2"], "not both"),
])
def test_bad_settings_are_refused_before_any_process_starts(
        argv: list[str], needle: str, tmp_path: Path, text_file: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Each is the command line's fault (flags that do not go together): a usage error.
    assert main(["train", *TRAIN_FLAGS, *argv, "--text", str(text_file), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


def test_a_port_in_use_is_named(tmp_path: Path, text_file: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = [*TRAIN_FLAGS, "--text", str(text_file), "--out", str(tmp_path / "o")]
        assert main(["train", *argv, "--nproc-per-node", "2", "--master-port",
                     str(port)]) == 1
        assert f"--master-port {port}: cannot listen on 127.0.0.1:{port}" in \
            capsys.readouterr().err
        # A rank started by torchrun (environment variables) on a busy port says so too.
        r = subprocess.run([sys.executable, "-m", "minigpt", "train", *argv], text=True,
                           capture_output=True, timeout=120,
                           env=os.environ | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                             "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port)})
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert f"the rendezvous port 127.0.0.1:{port} is in use" in r.stderr


@pytest.mark.slow
def test_global_batch_size_sets_accumulation(tmp_path: Path, text_file: Path) -> None:
    # In this process (the command line's main), as the bad settings above: no process to
    # start for one process's two steps.
    assert main(["train", *TRAIN_FLAGS, "--batch-size", "4", "--global-batch-size", "12",
                 "--max-steps", "2", "--text", str(text_file), "--out",
                 str(tmp_path / "acc")]) == 0
    metrics = json.loads((tmp_path / "acc" / "metrics.json").read_text())
    assert metrics["train_config"]["grad_accum"] == 3 and metrics["effective_batch_size"] == 12


def test_backend_choice() -> None:
    assert choose_backend(torch.device("cpu"), None) == "gloo"
    with pytest.raises(DistributedError, match="nccl backend needs CUDA GPUs"):
        choose_backend(torch.device("cpu"), "nccl")
    with pytest.raises(DistributedError, match="'mpi' is not supported"):
        choose_backend(torch.device("cpu"), "mpi")


def test_without_torchrun_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed) == (0, 1, True, False)
    # TF32 is a GPU setting: on a CPU, float32 products stay at the highest precision
    assert torch.get_float32_matmul_precision() == "highest"
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DistributedError, match="RANK='x' is not an integer"):
        init_distributed("cpu")


# ----- collectives on the model's device, evaluation per rank, no_sync under compile ------


def test_mean_over_ranks_hands_the_collective_a_tensor_on_the_runs_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL reduces only GPU tensors. The meta device stands in for the GPU, and a wrapped
    all_reduce (one process posing as rank 0 of 2) records what it is handed."""
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, op: object = None) -> None:
        seen.append(tensor.device)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    ctx = DistContext(rank=0, world_size=2, device=torch.device("meta"))
    out = mean_over_ranks(torch.tensor(1.5, dtype=torch.float64), ctx)
    assert seen == [torch.device("meta")] and out.device.type == "meta"


# Two ranks train a few steps (evaluating twice) with every collective they call wrapped: it
# records the device of each tensor handed to it and the rows each evaluation forward reads.
WRAPPED_SCRIPT = textwrap.dedent("""
    import json, sys, numpy as np, torch, torch.distributed as dist
    from minigpt import GPT, GPTConfig
    from minigpt.parallel import init_distributed, shutdown
    from minigpt.config import TrainConfig
    from minigpt.train import train
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    devices = []
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "reduce", "gather", "scatter"):
        def wrapped(tensor, *args, _real=getattr(dist, name), **kwargs):
            first = tensor[0] if isinstance(tensor, list) else tensor
            devices.append(str(first.device))
            return _real(tensor, *args, **kwargs)
        setattr(dist, name, wrapped)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2, n_layers=1))
    eval_rows = []
    model.register_forward_pre_hook(
        lambda m, args: None if m.training else eval_rows.append(args[0].shape[0]))
    data = (np.arange(3000) * 7 % 11).astype(np.uint16)
    result = train(model, TrainConfig(batch_size=int(sys.argv[2]), max_steps=4, eval_interval=2,
                                      eval_steps=3, warmup_steps=1), data, data[:500],
                   progress=False, ctx=ctx)
    with open(sys.argv[1] + f"/wrapped{ctx.rank}.json", "w") as f:
        json.dump({"devices": devices, "eval_rows": sorted(set(eval_rows)),
                   "model_device": str(next(model.parameters()).device),
                   "val_loss": result.history.val_loss, "loss": result.history.loss}, f)
    shutdown(ctx)
""")


@pytest.mark.slow
def test_each_rank_evaluates_its_share_and_collectives_use_the_models_device(
        two_ranks: Path, tmp_path: Path) -> None:
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPED_SCRIPT)
    ranks = [json.loads((two_ranks / f"wrapped{r}.json").read_text()) for r in (0, 1)]
    (tmp_path / "one").mkdir()
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "8"],
                            capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k not in (
                                "RANK", "WORLD_SIZE", "LOCAL_RANK")} | {"OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr
    one = json.loads((tmp_path / "one" / "wrapped0.json").read_text())
    for rank in ranks:
        assert rank["devices"] and set(rank["devices"]) == {rank["model_device"]}
        assert rank["eval_rows"] == [4]  # its own rows of each global batch of 8, no more
        # The same numbers as one process scoring the whole global batches.
        assert np.allclose(rank["val_loss"], one["val_loss"], rtol=0, atol=1e-5)
        assert np.allclose(rank["loss"], one["loss"], rtol=0, atol=1e-5)
    assert one["eval_rows"] == [8] and len(one["val_loss"]) == 3


# Counts DDP's gradient all-reduces (a communication hook sees each bucket) in one optimiser
# step of k micro-batches, eager and through torch.compile.
NO_SYNC_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from minigpt import GPT, GPTConfig
    from minigpt.parallel import init_distributed, shutdown
    from minigpt.optim import configure_optimizer
    from minigpt.data import Batch
    from minigpt.train import train_step, trainee_of
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    counts = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2,
                              n_layers=1))
        trainee = trainee_of(model, ctx, compile=compiled)
        calls = []
        def hook(state, bucket):
            calls.append(1)
            return default_hooks.allreduce_hook(None, bucket)
        trainee.register_comm_hook(None, hook)  # through torch.compile's wrapper, if any
        opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
        x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(ctx.rank))
        for k in (1, 2, 4):
            calls.clear()
            train_step(trainee, opt, [Batch(x, x)] * k, grad_clip=1.0)
            counts[f"{'compiled' if compiled else 'eager'} k={k}"] = len(calls)
    with open(sys.argv[1] + f"/no_sync{ctx.rank}.json", "w") as f:
        json.dump(counts, f)
    # The wrapper holds the Python hook: release it, and torch.compile's cached graphs of
    # it, while the interpreter is whole. Left to the interpreter's exit, a rank sometimes
    # aborted there ("terminate called without an active exception"), its counts written.
    del trainee, hook
    torch._dynamo.reset()
    import gc
    gc.collect()
    shutdown(ctx)
""")



# The three scripts above in one pair of processes: one process group (the first
# init_distributed makes it, the others are handed it; only the last shutdown ends it), the
# scripts run in turn, the wrapping of the collectives, which stays, last.
THREE_SCRIPTS = textwrap.dedent("""
    import runpy, sys
    from minigpt import parallel
    out, groups, real_init, real_shutdown = sys.argv[1], [], parallel.init_distributed, \
        parallel.shutdown
    def init_once(device):
        if not groups:
            groups.append(real_init(device))
        return groups[0]
    parallel.init_distributed, parallel.shutdown = init_once, lambda ctx: None
    for name, argv in (("step", [out]), ("no_sync", [out]), ("wrapped", [out, "4"])):
        if name == "wrapped":
            parallel.shutdown = real_shutdown
        sys.argv = [name + ".py", *argv]
        runpy.run_path(out + "/" + name + ".py", run_name="__main__")
""")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks that run STEP_SCRIPT, NO_SYNC_SCRIPT and WRAPPED_SCRIPT (global batches of
    8 in micro-batches of 4) in one process group; the folder of what they wrote."""
    root = tmp_path_factory.mktemp("two_ranks")
    scripts = [STEP_SCRIPT, NO_SYNC_SCRIPT, WRAPPED_SCRIPT]
    for name, script in zip(("step", "no_sync", "wrapped"), scripts, strict=True):
        (root / f"{name}.py").write_text(script)
    (root / "three.py").write_text(THREE_SCRIPTS)
    for r in _ranks(2, [str(root / "three.py"), str(root)], root):
        assert r.returncode == 0, r.stderr
    return root


@pytest.mark.slow
def test_accumulation_all_reduces_once_per_step_also_under_compile(two_ranks: Path) -> None:
    counts = json.loads((two_ranks / "no_sync0.json").read_text())
    once = counts["eager k=1"]
    assert once >= 1
    assert counts == {f"{mode} k={k}": once for mode in ("eager", "compiled")
                      for k in (1, 2, 4)}, counts


def test_example_batches_partition_over_ranks() -> None:
    data = ExampleSet([[k] * (2 + k % 5) for k in range(10)],
                      [[False] + [True] * (1 + k % 5) for k in range(10)])
    whole = rank_batch(data, 6, 12, DistContext(), generator=torch.Generator().manual_seed(3))
    parts = [rank_batch(data, 2, 12, DistContext(rank=r, world_size=3),
                        generator=torch.Generator().manual_seed(3)) for r in range(3)]
    for k in range(3):
        assert torch.equal(torch.cat([p[k] for p in parts]), whole[k])
