"""Training: optimiser groups, schedule, the loop's determinism, accumulation, checkpoints."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import record_seeds
from torch.utils._python_dispatch import TorchDispatchMode

from minigpt import GPT, GPTConfig
from minigpt.bpe import train_bpe
from minigpt.checkpoint import load_checkpoint
from minigpt.config import TrainConfig
from minigpt.data import Batch, ExampleSet
from minigpt.losses import bits_per_character, estimate_loss, full_loss, lm_loss
from minigpt.optim import configure_optimizer, lr_at
from minigpt.parallel import DistContext
from minigpt.tokenizer import CharTokenizer
from minigpt.train import (
    History,
    StepResult,
    record_steps,
    resume_run,
    save_run,
    train,
    train_step,
)

V = 12


# Tiny models gain nothing from intra-op threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides: object) -> GPTConfig:
    values: dict[str, object] = dict(vocab_size=V, context_length=8, d_model=16, n_heads=2,
                                     n_layers=2, dropout=0.0)
    return GPTConfig(**(values | overrides))


def run_config(**overrides: object) -> TrainConfig:
    values: dict[str, object] = dict(batch_size=4, max_steps=20, lr=3e-3, min_lr=3e-4,
                                     warmup_steps=4, eval_interval=10, eval_steps=2, seed=7)
    return TrainConfig(**(values | overrides))


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    # A learnable sequence (a noisy cycle) so that the loss visibly falls.
    rng = np.random.default_rng(0)
    ids = (np.arange(3000) % V + (rng.random(3000) < 0.1)) % V
    return ids[:2700].astype(np.uint16), ids[2700:].astype(np.uint16)


# ----- schedule and optimiser ----------------------------------------------------------


def test_lr_schedule_boundaries() -> None:
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)  # the first step already moves
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == 1.0  # last warm-up step: the full rate
    assert lr_at(10, **kw) == 1.0  # cosine starts at the peak
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half-way: the mean of peak and floor
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(5000, **kw) == 0.1
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_at(0, lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100) == 1.0
    assert lr_at(5, lr=1.0, min_lr=0.2, warmup_steps=5, decay_steps=5) == 0.2


def test_weight_decay_only_on_matrices() -> None:
    model = GPT(tiny_config(bias=True))
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["params"]
    counted = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert counted == model.num_parameters()  # the tied matrix once
    assert opt.defaults["betas"] == (0.9, 0.95)


# ----- TrainConfig ---------------------------------------------------------------------


def test_train_config_defaults_are_the_cpu_recipe() -> None:
    c = TrainConfig()
    assert (c.batch_size, c.max_steps, c.lr, c.min_lr, c.warmup_steps, c.decay_steps) == (
        12, 2000, 1e-3, 1e-4, 100, 2000)
    assert (c.beta1, c.beta2, c.weight_decay, c.grad_clip, c.eval_steps) == (0.9, 0.99, 0.1, 1.0,
                                                                             20)
    assert TrainConfig(max_steps=300, warmup_steps=10).decay_steps == 300
    # A run shorter than the default warm-up warms up over its whole schedule.
    assert TrainConfig(max_steps=50).warmup_steps == 50
    assert TrainConfig(max_steps=500, decay_steps=40).warmup_steps == 40


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 1e-4, "min_lr": 1e-3}, r"min_lr \(=0.001\) must not exceed lr"),
        ({"max_steps": 50, "warmup_steps": 100},
         r"warmup_steps \(=100\) must not exceed decay_steps \(=50, by default max_steps\)"),
        ({"lr": 0.0}, "lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"beta2": 1.0}, "beta2"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"eval_steps": 0}, "eval_steps"),
        ({"device": "gpu0"}, "is not a torch device"),
        ({"learning_rate": 1e-3}, "learning_rate"),
    ],
)
def test_train_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


# ----- the loop ------------------------------------------------------------------------


def test_training_lowers_the_loss_and_reports(data: tuple[np.ndarray, np.ndarray]) -> None:
    result = train(tiny_config(), run_config(max_steps=30), *data, progress=False)
    h, m = result.history, result.metrics
    assert h.step == list(range(30)) and len(h.loss) == len(h.lr) == len(h.step_ms) == 30
    assert h.eval_step == [0, 10, 20, 30]
    assert h.val_loss[-1] < h.val_loss[0] - 0.3
    assert h.val_loss[0] == pytest.approx(math.log(V), abs=0.2)  # untrained: about log V
    assert m["final_val_loss"] == h.val_loss[-1] and m["final_train_loss"] == h.train_loss[-1]
    assert m["median_step_ms"] > 0 and m["tokens_per_second"] > 0 and m["steps"] == 30
    assert h.lr[0] == pytest.approx(3e-3 / 4) and h.lr[-1] > 3e-4


def test_two_seeded_runs_are_identical(data: tuple[np.ndarray, np.ndarray]) -> None:
    cfg = tiny_config(dropout=0.1)
    a = train(cfg, run_config(), *data, progress=False).history
    b = train(cfg, run_config(), *data, progress=False).history
    c = train(cfg, run_config(seed=8), *data, progress=False).history
    assert a.loss == b.loss and a.val_loss == b.val_loss and a.train_loss == b.train_loss
    assert a.loss != c.loss


def test_each_stream_of_a_run_has_a_seed_of_its_own(data: tuple[np.ndarray, np.ndarray],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The initial weights, dropout, the batches and the evaluation's batches: four streams
    # of a run, seeded apart, and none of them a stream of the next seed's run (seeding each
    # with the seed, or one with seed + 1, gives runs that share their draws).
    seeds = record_seeds(monkeypatch)
    runs = []
    for seed in (5, 6):
        train(tiny_config(dropout=0.1), run_config(seed=seed, max_steps=2, warmup_steps=1), *data,
              progress=False)
        runs.append(seeds.take())
    assert [len(run) for run in runs] == [4, 4]
    assert not runs[0] & runs[1]


def test_resume_continues_the_same_run(tmp_path: Path,
                                       data: tuple[np.ndarray, np.ndarray]) -> None:
    # Dropout, accumulation and clipping all on: every random draw and every moment
    # must come back from the checkpoint for the losses to match bit for bit.
    cfg = tiny_config(dropout=0.2)
    tc = run_config(max_steps=16, eval_interval=4, grad_accum=2, grad_clip=0.5)
    tok = CharTokenizer("abcdefghijkl")
    straight = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "a", tokenizer=tok)
    first = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", stop_at=8,
                  tokenizer=tok)
    assert first.history.step == list(range(8))
    assert load_checkpoint(tmp_path / "b")["step"] == 8
    resumed = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", resume=True)
    h1, h2 = straight.history, resumed.history
    assert h1.loss == h2.loss and h1.lr == h2.lr and h1.step == h2.step
    assert h1.eval_step == h2.eval_step == [0, 4, 8, 12, 16]
    assert h1.val_loss == h2.val_loss and h1.train_loss == h2.train_loss
    for (name, p1), p2 in zip(straight.model.state_dict().items(),
                              resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p1, p2), name
    saved = load_checkpoint(tmp_path / "b")
    assert saved["step"] == 16 and saved["tokenizer"] == tok.to_dict()


def test_resume_may_extend_but_not_change_the_run(tmp_path: Path,
                                                  data: tuple[np.ndarray, np.ndarray]) -> None:
    tc = run_config(max_steps=6, eval_interval=3)
    train(tiny_config(), tc, *data, progress=False, out_dir=tmp_path)
    longer = run_config(max_steps=9, eval_interval=3, decay_steps=6)
    result = train(tiny_config(), longer, *data, progress=False, out_dir=tmp_path, resume=True)
    assert result.history.step == list(range(9)) and result.history.lr[-1] == 3e-4
    with pytest.raises(ValueError, match=r"only max_steps \(and the device\) may differ"):
        train(tiny_config(), run_config(max_steps=12, lr=1e-2, decay_steps=6), *data,
              progress=False, out_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match="configuration differs from the checkpoint"):
        train(tiny_config(n_layers=1), longer, *data, progress=False, out_dir=tmp_path,
              resume=True)
    with pytest.raises(ValueError, match="past the requested end"):
        train(tiny_config(), run_config(max_steps=3, eval_interval=3, decay_steps=6), *data,
              progress=False, out_dir=tmp_path, resume=True)


def test_gradient_accumulation_averages_micro_batches(
        data: tuple[np.ndarray, np.ndarray]) -> None:
    # One step over 2 micro-batches of 2 must equal one step over a batch of 4 made of the
    # same sequences (the generator draws the same 4 start indices either way).
    common = dict(max_steps=1, warmup_steps=0, lr=0.05, min_lr=0.0, grad_clip=0.0,
                  eval_interval=100)
    whole = train(tiny_config(), run_config(batch_size=4, **common), *data, progress=False)
    split = train(tiny_config(), run_config(batch_size=2, grad_accum=2, **common), *data,
                  progress=False)
    assert whole.history.loss[0] == pytest.approx(split.history.loss[0], rel=1e-6)
    for p1, p2 in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_a_step_leaves_its_numbers_on_the_device_and_the_loop_reads_them(
        data: tuple[np.ndarray, np.ndarray]) -> None:
    # The step returns tensors (reading them would wait for the device); the loop moves them
    # into the history at each evaluation and at the end, every step's in order.
    torch.manual_seed(0)
    model = GPT(tiny_config())
    ids = torch.from_numpy(data[0][:2 * 8 + 1].astype(np.int64))
    x, y = ids[:-1].view(2, 8), ids[1:].view(2, 8)
    with torch.no_grad():
        expected = lm_loss(model, x, y).item()
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                        [Batch(x[:1], y[:1]), Batch(x[1:], y[1:])], grad_clip=0.0)
    assert isinstance(result, StepResult)
    assert isinstance(result.loss, torch.Tensor) and result.loss.dim() == 0
    assert isinstance(result.grad_norm, torch.Tensor) and result.grad_norm.dim() == 0
    assert result.loss.item() == pytest.approx(expected, rel=1e-6)  # the mean of both
    h = train(tiny_config(), run_config(max_steps=7, eval_interval=3), *data,
              progress=False).history
    assert h.eval_step == [0, 3, 6, 7]
    assert len(h.loss) == len(h.grad_norm) == len(h.step) == 7
    assert all(isinstance(v, float) and v > 0 for v in h.loss + h.grad_norm)
    again = train(tiny_config(), run_config(max_steps=7, eval_interval=100), *data,
                  progress=False).history  # read once, at the end: the same numbers
    assert again.loss == h.loss and again.grad_norm == h.grad_norm


class _Ops(TorchDispatchMode):
    """Records each operation torch runs and the dtypes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), {t.dtype for t in leaves if isinstance(t, torch.Tensor)}))
        return out


def _recorded_step(data: tuple[np.ndarray, np.ndarray], device: str) -> _Ops:
    """The operations of one step of two micro-batches, one masked, on the CPU, as a step
    of a run on ``device`` makes them."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    ids = torch.from_numpy(data[0][:2 * 8 + 1].astype(np.int64))
    x, y = ids[:-1].view(2, 8), ids[1:].view(2, 8)
    batches = [Batch(x[:1], y[:1]), Batch(x[1:], y[1:], torch.arange(8)[None] > 2)]
    ctx = DistContext(device=torch.device(device))
    with _Ops() as ops:
        result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batches,
                            grad_clip=0.0, ctx=ctx)
        record_steps([result], History(), ctx)
    return ops


def test_a_step_makes_no_tensor_from_host_numbers(data: tuple[np.ndarray, np.ndarray]) -> None:
    # On a GPU a tensor made from a Python number is a blocking copy from the host: the
    # step's count of targets is made on the device, where the batch is.
    names = [name for name, _ in _recorded_step(data, "cpu").ops]
    assert "aten.full.default" in names  # the unmasked micro-batch's count
    assert not [n for n in names if n.startswith("aten.lift_fresh")]


def test_a_step_averages_in_float64_except_on_mps(data: tuple[np.ndarray, np.ndarray]) -> None:
    # MPS has no float64: there the counts and losses are averaged in float32.
    def dtypes(device: str) -> set[torch.dtype]:
        return set().union(*(d for _, d in _recorded_step(data, device).ops))

    assert torch.float64 in dtypes("cpu")
    assert torch.float64 not in dtypes("mps")  # the ops ran on the CPU, as MPS would run them


def test_bf16_autocast_trains(data: tuple[np.ndarray, np.ndarray]) -> None:
    fp32 = train(tiny_config(), run_config(), *data, progress=False).history
    bf16 = train(tiny_config(), run_config(bf16=True), *data, progress=False).history
    assert all(math.isfinite(x) for x in bf16.loss)
    assert bf16.val_loss[-1] == pytest.approx(fp32.val_loss[-1], abs=0.1)
    assert bf16.loss != fp32.loss  # the autocast really ran


def test_estimate_loss_is_repeatable_and_leaves_state_alone(
        data: tuple[np.ndarray, np.ndarray]) -> None:
    model = GPT(tiny_config(dropout=0.5)).train()
    splits = {"train": data[0], "val": data[1]}
    rng = torch.get_rng_state()
    kw = dict(batch_size=4, context_length=8, eval_steps=3, seed=1)
    first = estimate_loss(model, splits, **kw)  # type: ignore[arg-type]
    assert first == estimate_loss(model, splits, **kw)  # type: ignore[arg-type]
    assert set(first) == {"train", "val"} and model.training
    assert torch.equal(rng, torch.get_rng_state())


def test_full_loss_scores_every_window_once(data: tuple[np.ndarray, np.ndarray]) -> None:
    model = GPT(tiny_config()).train()
    val = data[1][:83]  # 10 windows of T = 8, plus 2 tokens of which only 1 is a target
    by_hand = []
    with torch.no_grad():
        model.eval()
        for i in range(0, 80, 8):
            x = torch.tensor(val[i:i + 8], dtype=torch.long)[None]
            y = torch.tensor(val[i + 1:i + 9], dtype=torch.long)
            by_hand.append(torch.nn.functional.cross_entropy(model(x)[0], y).item())
        model.train()
    assert full_loss(model, val, batch_size=3) == pytest.approx(sum(by_hand) / 10, rel=1e-6)
    assert full_loss(model, val, batch_size=64) == pytest.approx(sum(by_hand) / 10, rel=1e-6)
    assert model.training
    with pytest.raises(ValueError, match="full_loss needs more than T=8"):
        full_loss(model, val[:8])


def test_bits_per_character_of_characters_is_the_loss_in_bits(
        data: tuple[np.ndarray, np.ndarray]) -> None:
    tokenizer = CharTokenizer("abcdefghijkl")  # V = 12: one character a token
    model = GPT(tiny_config())
    val = data[1][:83]
    assert bits_per_character(model, val, tokenizer) == pytest.approx(
        full_loss(model, val) / math.log(2), rel=1e-9)


def test_bits_per_character_counts_the_characters_of_the_predicted_tokens() -> None:
    text = "the cat sat on the mat; the rat sat on the hat. " * 20
    bpe = train_bpe(text, 256 + 12)
    ids = np.asarray(bpe.encode_ordinary(text[:300]), dtype=np.uint16)
    model = GPT(tiny_config(vocab_size=bpe.vocab_size))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # tied head: every logit 0, uniform over V
    n = (len(ids) - 1) // 8 * 8
    chars = sum(len(bpe.token_bytes(int(i))) for i in ids[1:n + 1])  # ASCII: byte = char
    assert chars > n  # tokens of several characters: bits per token would be misleading
    expected = n * math.log2(bpe.vocab_size) / chars
    assert bits_per_character(model, ids, bpe) == pytest.approx(expected, rel=1e-6)


def test_train_accepts_a_model(data: tuple[np.ndarray, np.ndarray]) -> None:
    model = GPT(tiny_config())
    result = train(model, run_config(max_steps=2, warmup_steps=1), *data, progress=False)
    assert result.model is model


def test_a_gpu_run_uses_tf32_from_python_as_from_the_command_line(
        data: tuple[np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 products on a CUDA GPU may use TF32, whether the run is the command line's
    (`init_distributed`) or `train` called from Python, decided before the model reaches
    the GPU; a CPU run leaves the precision at "highest". No GPU here: the run on "cuda"
    stops where the model would move."""
    from minigpt.parallel import init_distributed

    class Moved(Exception):
        pass

    def move(self: GPT, *args: object, **kwargs: object) -> GPT:
        raise Moved

    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    train(tiny_config(), run_config(max_steps=1, warmup_steps=1), *data, progress=False)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(GPT, "to", move)
    with pytest.raises(Moved):
        train(tiny_config(), run_config(device="cuda"), *data, progress=False)
    assert calls == ["high"]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    init_distributed("cuda")
    assert calls == ["high", "high"]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda d: train(tiny_config(), run_config(), d[0][:8], d[1], progress=False),
         ValueError, r"train_data has 8 tokens; it needs more than context_length=8"),
        (lambda d: train(tiny_config(), run_config(), d[0], np.append(d[1], V),
                         progress=False),
         ValueError, rf"val_data holds token id {V}; the model's ids lie in \[0, {V}\)"),
        (lambda d: train(tiny_config(), run_config(), d[0].astype(np.int64) - 1, d[1],
                         progress=False),
         ValueError, r"train_data holds token id -1"),
        (lambda d: train(tiny_config(), run_config(),
                         ExampleSet([[1, 2, V]], [[False, True, True]]), d[1], progress=False),
         ValueError, rf"train_data holds token id {V}"),
        (lambda d: train(tiny_config(), run_config(), *d, resume=True, progress=False),
         ValueError, "resume=True needs out_dir"),
        (lambda d: train(tiny_config(), run_config(), *d, stop_at=-1, progress=False),
         ValueError, "stop_at must be"),
        (lambda d: train("gpt", run_config(), *d, progress=False),
         TypeError, "model must be a GPT or a GPTConfig"),
    ],
)
def test_train_errors(data: tuple[np.ndarray, np.ndarray], call: object, error: type,
                      message: str) -> None:
    with pytest.raises(error, match=message):
        call(data)  # type: ignore[operator]


# ----- checkpoints ---------------------------------------------------------------------


def test_checkpoint_is_atomic_and_safe_to_load(tmp_path: Path) -> None:
    model = GPT(tiny_config())
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    path = tmp_path / "ck" / "checkpoint.pt"
    save_run(path, model, opt, run_config(), step=3, history=History(),
             batch_gen=torch.Generator().manual_seed(0), tokenizer=None)
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]  # no temp left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's 0600
    # Loadable with torch's safe unpickler: only tensors and plain containers inside.
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 3 and raw["model_config"] == model.config.model_dump()
    assert raw["world_size"] == 1 and len(raw["rng"]["ranks"]) == 1
    assert load_checkpoint(tmp_path / "ck")["step"] == 3  # a directory works too
    # While the new bytes go to disk, a reader of the path still sees the old checkpoint
    # whole; a failure then (the disk gone at fsync) leaves it so, with no temporary file.
    before, seen = path.read_bytes(), []

    def disk_gone(fd: int) -> None:
        seen.append(path.read_bytes() == before)
        raise OSError("disk gone")

    with mock.patch("os.fsync", disk_gone), pytest.raises(OSError, match="disk gone"):
        save_run(path, model, opt, run_config(), step=4, history=History(),
                 batch_gen=torch.Generator(), tokenizer=None)
    assert seen == [True] and path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    save_run(path, model, opt, run_config(), step=4, history=History(),
             batch_gen=torch.Generator(), tokenizer=None)
    assert load_checkpoint(path)["step"] == 4  # a write that completes replaces it


def test_truncated_or_foreign_checkpoints_are_refused(tmp_path: Path,
                                                      data: tuple[np.ndarray, np.ndarray],
                                                      ) -> None:
    out = tmp_path / "run"
    train(tiny_config(), run_config(max_steps=4), *data, out_dir=out, progress=False)
    ckpt = out / "checkpoint.pt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="damaged or truncated"):
        train(tiny_config(), run_config(max_steps=8), *data, out_dir=out, resume=True,
              progress=False)
    ckpt.write_bytes(whole[:100] + bytes(200) + whole[300:])  # corrupted in the middle
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(ckpt)
    ckpt.write_bytes(whole)
    with pytest.raises(ValueError, match="configuration differs"):
        train(tiny_config(d_model=32), run_config(max_steps=8), *data, out_dir=out,
              resume=True, progress=False)
    two = DistContext(rank=0, world_size=2)  # only compared, never joined
    raw = load_checkpoint(ckpt)
    with pytest.raises(ValueError, match="written by a run of 1 process.* this run has 2"):
        model = GPT(tiny_config())
        resume_run(raw, model, configure_optimizer(model, lr=1e-3, weight_decay=0.1),
                   run_config(max_steps=4), torch.Generator(), two)


def test_format_1_checkpoints_still_load(tmp_path: Path) -> None:
    payload = {"format": 1, "model": {}, "optimizer": {}, "model_config": {},
               "train_config": {}, "step": 0, "rng": {}, "history": {}, "tokenizer": None}
    torch.save(payload, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt")["world_size"] == 1
    torch.save(payload | {"format": 9}, tmp_path / "new.pt")
    with pytest.raises(ValueError, match="format 9; this version of minigpt reads formats 1, 2"):
        load_checkpoint(tmp_path / "new.pt")


def test_loading_onto_a_missing_gpu_says_so(tmp_path: Path) -> None:
    model = GPT(tiny_config())
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    save_run(tmp_path / "c.pt", model, opt, run_config(), step=0, history=History(),
             batch_gen=torch.Generator(), tokenizer=None)
    with mock.patch("torch.cuda.is_available", return_value=False), \
            pytest.raises(ValueError, match="CUDA is not available on this machine"):
        load_checkpoint(tmp_path / "c.pt", map_location="cuda")


def test_checkpoint_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a minigpt checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


# ----- torch.compile -------------------------------------------------------------------

@pytest.mark.slow
def test_compiled_training_follows_the_eager_run(data: tuple[np.ndarray, np.ndarray]) -> None:
    """`compile=True` trains the same model as eager mode (to float rounding), in one
    graph: the token-id check compiles to a device assertion instead of a graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tc = run_config(max_steps=12, eval_interval=6, grad_clip=0.5)
    eager = train(tiny_config(), tc, *data, progress=False)
    compiled = train(tiny_config(), tc, *data, progress=False, compile=True)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    np.testing.assert_allclose(compiled.history.loss, eager.history.loss, rtol=1e-4)
    np.testing.assert_allclose(compiled.history.val_loss, eager.history.val_loss, rtol=1e-4)
    for (name, p1), p2 in zip(eager.model.state_dict().items(),
                              compiled.model.state_dict().values(), strict=True):
        torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-5, msg=name)
    # The trained model is the plain module (its checkpoint keys carry no _orig_mod.).
    assert type(compiled.model) is GPT


def test_resume_gives_the_random_states_back_as_cpu_tensors(
        tmp_path: Path, data: tuple[np.ndarray, np.ndarray]) -> None:
    """A run on a GPU resumes with the generators' states on the CPU (the only place
    `torch.set_rng_state` and `Generator.set_state` take them). The meta device stands in
    for the GPU: loading the checkpoint onto the run's device would put the states there."""
    tc = run_config(max_steps=4, eval_interval=2)
    train(tiny_config(dropout=0.1), tc, *data, progress=False, out_dir=tmp_path, stop_at=2)
    saved = load_checkpoint(tmp_path)["rng"]
    model = GPT(tiny_config(dropout=0.1))
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    batch_gen = torch.Generator()
    torch.manual_seed(12345)
    gpu = DistContext(device=torch.device("meta"))
    step, history = resume_run(load_checkpoint(tmp_path), model, optimizer, tc, batch_gen, gpu)
    assert step == 2 and history.step == [0, 1]
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    assert torch.equal(batch_gen.get_state(), saved["batches"])


@pytest.mark.cuda
def test_resume_on_a_gpu_continues_the_same_run(tmp_path: Path,
                                                data: tuple[np.ndarray, np.ndarray]) -> None:
    cfg, tc = tiny_config(dropout=0.2), run_config(max_steps=8, eval_interval=4, device="cuda")
    straight = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "a")
    train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", stop_at=4)
    resumed = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", resume=True)
    assert resumed.history.loss == straight.history.loss
    assert resumed.history.val_loss == straight.history.val_loss
    assert "cuda" in load_checkpoint(tmp_path / "b")["rng"]["ranks"][0]
