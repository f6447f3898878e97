"""`python -m minigpt COMMAND`, driven through `minigpt.cli.main`: `train` and `sample` on a
tiny text, `sft`, `dpo`, `chat` and `eval` on tiny models trained for a few steps (help, a
piped conversation, the context's limit), `rl` on a tiny chat model, each flag's check
where it enters (one line naming the flag, what it was given and what it takes), and the
clear errors of each command (a base model where a chat model is needed, an empty data
set, a device this machine lacks, a backend the resumed run's device cannot use)."""

from __future__ import annotations

import inspect
import io
import json
import re
import runpy
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_assistant import play

from minigpt import GPT, GPTConfig
from minigpt.checkpoint import load_checkpoint, save_checkpoint
from minigpt.cli import main
from minigpt.config import TrainConfig
from minigpt.decoding import beam_search
from minigpt.sample import load_model
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train

TEXT = "".join(
    f"{who}:\nWhat say you, {whom}? The night is {mood} and the hour grows late.\n\n"
    for who, whom, mood in [("ROMEO", "Juliet", "dark"), ("JULIET", "Romeo", "young"),
                            ("NURSE", "madam", "cold"), ("TYBALT", "villain", "long")] * 12
)
TINY = ["--n-layers", "1", "--n-heads", "2", "--d-model", "16", "--context-length", "8",
        "--batch-size", "4", "--max-steps", "6", "--warmup-steps", "2", "--eval-interval", "3",
        "--eval-steps", "2", "--no-progress"]


# Tiny models gain nothing from intra-op threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main(["train", "--text", str(text_file), "--tokenizer", "char", "--out", str(out),
                 *TINY]) == 0
    return out


def test_train_writes_metrics_and_checkpoint(trained: Path) -> None:
    metrics = json.loads((trained / "metrics.json").read_text())
    for key in ("final_train_loss", "final_val_loss", "median_step_ms", "tokens_per_second",
                "final_val_loss_full"):
        assert isinstance(metrics[key], float) and metrics[key] > 0, key
    assert metrics["steps"] == 6 and metrics["final_eval_step"] == 6
    assert metrics["model_config"]["d_model"] == 16
    assert metrics["model_config"]["vocab_size"] == len(set(TEXT))
    assert metrics["train_config"]["max_steps"] == 6
    history = json.loads((trained / "history.json").read_text())
    assert history["eval_step"] == [0, 3, 6]
    assert load_checkpoint(trained)["step"] == 6
    assert {p.name for p in trained.iterdir()} == {"checkpoint.pt", "metrics.json",
                                                  "history.json", "train.bin", "val.bin"}


def _handed_to_train(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `train` is handed by ``python -m minigpt train *argv``, on a machine pretending
    to have two GPUs: the model's and the run's settings, the run's flags, the device joined
    (the run stops where training would start)."""
    import minigpt.cli
    from minigpt.parallel import DistContext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    handed: dict[str, Any] = {}

    def join(device: str, backend: str | None = None) -> DistContext:
        handed["joined"] = device
        return DistContext()

    def trainer(shape: GPTConfig, config: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        handed.update(shape=shape.model_dump(), config=config.model_dump(), **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(minigpt.parallel, "init_distributed", join)
    monkeypatch.setattr(minigpt.cli, "train", trainer)
    assert main(["train", *argv]) == 130
    return handed


def test_every_flag_reaches_its_setting(tmp_path: Path, text_file: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each field of GPTConfig (but V, which the text sets) and of TrainConfig has its flag,
    and a value given, other than the recipe's default, is the field's value."""
    model = {"context_length": 8, "d_model": 24, "n_heads": 2, "n_layers": 1, "d_ff": 40,
             "dropout": 0.1, "bias": False, "tie_weights": False, "positional": "rope",
             "layer_norm_eps": 1e-6, "activation": "swiglu", "norm": "rmsnorm",
             "norm_weight": False, "qk_norm": True, "n_kv_heads": 1, "rope_base": 500.0,
             "zero_init": True}
    run = {"batch_size": 2, "grad_accum": 3, "max_steps": 7, "lr": 2e-3, "min_lr": 1e-5,
           "warmup_steps": 1, "decay_steps": 6, "weight_decay": 0.05, "beta1": 0.8,
           "beta2": 0.9, "grad_clip": 0.5, "eval_interval": 2, "eval_steps": 1,
           "eval_full": True, "seed": 3, "bf16": True, "device": "cuda:1",
           "optimizer": "muon", "muon_lr": 0.01, "muon_momentum": 0.9,
           "schedule": "trapezoid", "cooldown_fraction": 0.5}
    assert set(model) == set(GPTConfig.model_fields) - {"vocab_size"}
    assert set(run) == set(TrainConfig.model_fields)
    defaults = GPTConfig.shakespeare_cpu(65).model_dump() | TrainConfig().model_dump()
    assert all(v != defaults[k] for k, v in (model | run).items())  # else no flag could fail
    argv = []
    for name, v in (model | run).items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if v is True else [f"--no-{flag[2:]}"] if v is False else [flag, str(v)]
    handed = _handed_to_train(["--text", str(text_file), "--out", str(tmp_path), *argv,
                               "--compile", "--stop-at", "5", "--no-progress"], monkeypatch)
    assert handed["shape"] == GPTConfig(vocab_size=len(set(TEXT)), **model).model_dump()
    assert handed["config"] == TrainConfig(**run).model_dump()
    assert (handed["joined"], handed["compile"], handed["stop_at"], handed["progress"]) == (
        "cuda:1", True, 5, False)
    # Not given, every field keeps the recipe's own value.
    for recipe, shape, config in (("gpt2", GPTConfig.shakespeare_cpu, TrainConfig),
                                  ("modern", GPTConfig.modern, TrainConfig.modern)):
        handed = _handed_to_train(["--text", str(text_file), "--out", str(tmp_path),
                                   "--recipe", recipe], monkeypatch)
        assert handed["shape"] == shape(len(set(TEXT))).model_dump()
        assert handed["config"] == config().model_dump()
        assert (handed["joined"], handed["compile"], handed["stop_at"], handed["progress"]) == (
            "cpu", False, None, True)


def test_same_seed_same_run(tmp_path: Path, text_file: Path, trained: Path) -> None:
    assert main(["train", "--text", str(text_file), "--out", str(tmp_path), *TINY]) == 0
    again = json.loads((tmp_path / "history.json").read_text())
    first = json.loads((trained / "history.json").read_text())
    assert again["loss"] == first["loss"] and again["val_loss"] == first["val_loss"]


def test_stop_and_resume_equals_a_straight_run(tmp_path: Path, text_file: Path,
                                               trained: Path) -> None:
    base = ["train", "--out", str(tmp_path)]
    assert main([*base, "--text", str(text_file), *TINY, "--stop-at", "3"]) == 0
    assert load_checkpoint(tmp_path)["step"] == 3
    assert main([*base, "--resume", "--no-progress"]) == 0
    resumed = json.loads((tmp_path / "history.json").read_text())
    straight = json.loads((trained / "history.json").read_text())
    assert resumed["loss"] == straight["loss"] and resumed["val_loss"] == straight["val_loss"]


def test_default_corpus_is_the_package_shakespeare(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import minigpt.data

    calls: list[int] = []

    def fake() -> str:
        calls.append(1)
        return TEXT

    monkeypatch.setattr(minigpt.data, "shakespeare_text", fake)
    assert main(["train", "--out", str(tmp_path), *TINY, "--max-steps", "2"]) == 0
    assert calls == [1]
    assert json.loads((tmp_path / "metrics.json").read_text())["text"].startswith(
        "minigpt.data.shakespeare_text")


def test_bpe_tokenizer_run_and_sample(tmp_path: Path, text_file: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--text", str(text_file), "--tokenizer", "bpe", "--bpe-vocab-size",
                 "270", "--out", str(tmp_path), *TINY, "--max-steps", "2"]) == 0
    loaded = load_model(tmp_path)
    assert loaded.tokenizer.name != "char" and loaded.model.config.vocab_size == 270
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ROMEO:",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")


# ----- sample --------------------------------------------------------------------------


def test_sample_prints_a_continuation(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sample", "--checkpoint", str(trained), "--prompt", "JULIET:", "--max-new-tokens",
            "20", "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "4"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("JULIET:") and len(first) == len("JULIET:") + 20 + 1
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # seeded
    assert main([*argv[:-1], "5"]) == 0
    assert capsys.readouterr().out != first


def test_sample_greedy_and_several_samples(trained: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "--checkpoint", str(trained), "--prompt", "The", "--greedy",
                 "--max-new-tokens", "10", "--num-samples", "2"]) == 0
    one, two = capsys.readouterr().out.rstrip("\n").split("\n" + "-" * 40 + "\n")
    assert one == two and one.startswith("The")


def test_sample_beams_and_no_cache(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["sample", "--checkpoint", str(trained), "--prompt", "ROMEO", "--max-new-tokens", "12"]
    model, tokenizer, _ = load_model(trained)
    best = beam_search(model, tokenizer.encode("ROMEO"), 12, num_beams=3).sequences[0]
    assert main([*base, "--beams", "3"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(best.tolist()) + "\n"
    assert main([*base, "--beams", "3", "--no-cache"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(best.tolist()) + "\n"
    assert main([*base, "--seed", "2"]) == 0
    cached = capsys.readouterr().out
    assert main([*base, "--seed", "2", "--no-cache"]) == 0
    assert capsys.readouterr().out == cached  # the cache changes the speed, not the text


def test_load_model(trained: Path) -> None:
    model, tokenizer, step = load_model(trained)
    assert step == 6 and not model.training and tokenizer.decode(tokenizer.encode("ROMEO")) == (
        "ROMEO")
    assert model.config.context_length == 8


def test_a_device_that_fails_is_not_blamed_on_the_checkpoint(
        trained: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The file is read onto the CPU; only the move to the device fails (a GPU that is
    # missing or out of memory), and the error says so rather than "damaged".
    loads: list[object] = []
    real_load = torch.load

    def load(*args: object, **kwargs: object) -> object:
        loads.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    def to(self: GPT, *args: object, **kwargs: object) -> GPT:
        raise RuntimeError("CUDA error: invalid device ordinal\nmore detail")

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # cuda:3 passes the flag's check
    monkeypatch.setattr(GPT, "to", to)
    with pytest.raises(ValueError, match="cannot put the model on cuda:3: CUDA error: invalid "
                                         "device ordinal$") as caught:
        load_model(trained, device="cuda:3")
    assert isinstance(caught.value.__cause__, RuntimeError) and loads == ["cpu"]
    _fails(["sample", "--checkpoint", str(trained), "--device", "cuda:3"], capsys, 1,
           "cannot put the model on cuda:3: CUDA error: invalid device ordinal")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda: CUDA is not available on this machine"):
        load_model(trained, device="cuda")


# ----- errors: clear message, no traceback, non-zero exit ------------------------------


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], code: int, *needles: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    ("extra", "code", "needles"),
    [
        (["--text", "/no/such/file.txt"], 2, ["argument --text: /no/such/file.txt: no such "
                                               "file"]),
        (["--text", "/dev/null"], 2, ["argument --text: /dev/null is not a regular file"]),
        (["--lr", "-1"], 2, ["argument --lr: Input should be greater than 0, got '-1'"]),
        (["--lr", "fast"], 2, ["argument --lr: Input should be a valid number, unable to parse "
                                 "string as a number, got 'fast'"]),
        (["--lr", "inf"], 2, ["argument --lr: Input should be a finite number, got 'inf'"]),
        (["--rope-base", "1"], 2, ["argument --rope-base: Input should be greater than 1"]),
        (["--batch-size", "1.5"], 2, ["argument --batch-size: Input should be a valid integer"]),
        (["--max-step", "3"], 2, ["unrecognized arguments: --max-step"]),
        (["--n-heads", "3"], 2, ["--d-model (=16) must be divisible by --n-heads (=3)"]),
        (["--dropout", "1.5"], 2, ["--dropout", "less than 1"]),
        (["--tokenizer", "words"], 2, ["invalid choice: 'words'"]),
        (["--bpe-vocab-size", "300"], 2, ["--bpe-vocab-size applies only with --tokenizer bpe"]),
        (["--max-steps", "1"], 2, ["--warmup-steps (=2) must not exceed --decay-steps (=1",
                                    "raise --max-steps"]),
        (["--min-lr", "1"], 2, ["--min-lr (=1.0) must not exceed --lr (=0.001)"]),
        (["--device", "tpu9"], 2, ["argument --device: 'tpu9' is not a torch device"]),
        (["--device", "meta"], 2, ["--device: 'meta': models run on cpu, cuda or cuda:N"]),
        (["--context-length", "5000"], 1, ["needs more than context_length=5000"]),
        (["--threads", "0"], 2, ["argument --threads: Input should be greater than or equal to "
                                  "1, got '0'"]),
        (["--threads", "two"], 2, ["argument --threads: Input should be a valid integer, unable "
                                    "to parse string as an integer, got 'two'"]),
        (["--stop-at", "-1"], 2, ["argument --stop-at: Input should be greater than or equal to "
                                   "0, got '-1'"]),
        (["--nproc-per-node", "0"], 2, ["argument --nproc-per-node: Input should be greater "]),
        (["--global-batch-size", "0"], 2, ["argument --global-batch-size: Input should be "]),
        (["--tokenizer", "bpe", "--bpe-vocab-size", "1"], 2,
         ["argument --bpe-vocab-size: Input should be greater than or equal to 2, got '1'"]),
        (["--master-port", "70000"], 2, ["argument --master-port: Input should be less than or "
                                         "equal to 65535, got '70000'"]),
        (["--master-port", "x"], 2, ["argument --master-port: Input should be a valid integer"]),
    ],
)
def test_train_errors(tmp_path: Path, text_file: Path, capsys: pytest.CaptureFixture[str],
                      extra: list[str], code: int, needles: list[str]) -> None:
    argv = ["train", "--text", str(text_file), "--out", str(tmp_path / "out"), *TINY, *extra]
    _fails(argv, capsys, code, *needles)


def test_train_error_paths_on_files(tmp_path: Path, text_file: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["train", "--text", str(text_file)], capsys, 2, "required: --out")
    (tmp_path / "file").write_text("x")
    _fails(["train", "--text", str(text_file), "--out", str(tmp_path / "file"), *TINY], capsys,
           2, "argument --out: ", "file exists and is not a directory")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    _fails(["train", "--text", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o"),
            *TINY], capsys, 1, "is not UTF-8 text")
    (tmp_path / "empty.txt").write_text("")
    _fails(["train", "--text", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o"),
            *TINY], capsys, 1, "empty.txt is empty")
    _fails(["train", "--out", str(tmp_path / "none"), "--resume"], capsys, 2,
           "--resume continues the run saved in --out: no checkpoint at")


def test_resume_refuses_new_settings(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["train", "--out", str(trained), "--resume", "--lr", "0.1", "--no-bias"], capsys, 2,
           "drop --no-bias, --lr (only --max-steps and --device may change)")
    _fails(["train", "--out", str(trained), "--resume", "--tokenizer", "char"], capsys, 2,
           "drop --tokenizer")  # a new run's flag, even at its default
    # What it may change is checked by the run's TrainConfig, under its flag.
    _fails(["train", "--out", str(trained), "--resume", "--max-steps", "-1"], capsys, 2,
           "minigpt train: error: argument --max-steps: Input should be greater than or equal "
           "to 0, got '-1'")


@pytest.mark.parametrize(("cuda", "flags", "needle"), [
    (True, ["--backend", "nccl"], None),  # the checkpoint's device is cuda: nccl fits it
    (True, [], None),  # and is the default there
    (True, ["--backend", "gloo"], None),
    (True, ["--device", "cpu", "--backend", "nccl"],  # flags that do not go together
     "minigpt train: error: the nccl backend needs CUDA GPUs, and this run is on the cpu"),
    (True, ["--device", "cpu"], None),  # gloo, the CPU's default
    (False, ["--backend", "nccl"], "was trained on 'cuda', which this machine lacks; continue "
                                   "it here with device cpu (--device cpu)"),
    (False, ["--device", "cpu", "--backend", "gloo"], None),
])
def test_resume_checks_the_backend_against_the_checkpoints_device(
        cuda: bool, flags: list[str], needle: str | None, trained: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run of 2 processes saved on cuda, resumed with --nproc-per-node 2: the backend is
    checked against the device the resumed run will use (the checkpoint's unless --device
    is given), before torchrun starts anything. The GPUs (and NCCL) are pretended: the
    launcher stops where torchrun would start the processes."""
    import torch.distributed.run

    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    ckpt = load_checkpoint(tmp_path)
    ckpt["train_config"]["device"], ckpt["world_size"] = "cuda", 2
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: cuda)
    started: list[list[str]] = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: started.append(
        args.training_script_args))
    argv = ["train", "--out", str(tmp_path), "--resume", "--nproc-per-node", "2", *flags]
    if needle is None:
        assert main(argv) == 0
        assert started == [["train", "--out", str(tmp_path), "--resume", *flags]]
    else:
        _fails(argv, capsys, 2 if "--device" in flags else 1, needle)
        assert started == []


@pytest.mark.parametrize(
    ("extra", "code", "needles"),
    [
        (["--prompt", "é"], 1, ["cannot be encoded by the char tokenizer", "'é'"]),
        (["--prompt", ""], 2, ["--prompt: String should have at least 1 character"]),
        (["--temperature", "-1"], 2, ["--temperature: Input should be greater than or equal"]),
        (["--temperature", "inf"], 2, ["--temperature: Input should be a finite number"]),
        (["--top-k", "0"], 2, ["--top-k: Input should be greater than or equal to 1"]),
        (["--top-k", "1000"], 1, ["top_k must lie in [1, V]"]),
        (["--top-p", "0"], 2, ["--top-p: Input should be greater than 0"]),
        (["--max-new-tokens", "-3"], 2, ["--max-new-tokens: Input should be greater than or"]),
        (["--num-samples", "0"], 2, ["--num-samples: Input should be greater than or equal"]),
        (["--device", "abc"], 2, ["--device: 'abc' is not a torch device; use cpu, cuda"]),
        (["--beams", "0"], 2, ["--beams: Input should be greater than or equal to 1"]),
        (["--beams", "2", "--top-k", "3", "--temperature", "1"], 2,
         ["--beams searches", "does not sample; drop --temperature, --top-k"]),
        (["--beams", "2", "--num-samples", "2"], 2, ["drop --num-samples"]),
        (["--speculate", "3"], 2, ["--speculate needs --draft"]),
        (["--draft", "{trained}", "--beams", "2"], 2, ["argument --beams: not allowed with "
                                                       "argument --draft"]),
        (["--draft", "{trained}", "--no-cache"], 2, ["drop --no-cache"]),
        (["--draft", "x"], 2, ["argument --draft: no checkpoint at x"]),
        (["--seed", "x"], 2, ["argument --seed: Input should be a valid integer, unable to "
                               "parse string as an integer, got 'x'"]),
    ],
)
def test_sample_errors(trained: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                       code: int, needles: list[str]) -> None:
    _fails(["sample", "--checkpoint", str(trained), "--prompt", "a",
            *(a.format(trained=trained) for a in extra)], capsys, code, *needles)


def test_sample_with_a_draft(trained: Path, tmp_path: Path, text_file: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    draft = tmp_path / "draft"
    assert main(["train", "--text", str(text_file), "--out", str(draft), *TINY,
                 "--d-model", "8", "--seed", "3"]) == 0
    capsys.readouterr()
    base = ["sample", "--checkpoint", str(trained), "--prompt", "ROMEO:", "--max-new-tokens",
            "12"]
    assert main([*base, "--greedy"]) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--greedy", "--draft", str(draft), "--speculate", "3"]) == 0
    fast = capsys.readouterr()
    assert fast.out == plain  # greedy: exactly the target's own text
    assert "proposals accepted" in fast.err and "tokens per pass of the target" in fast.err
    assert main([*base, "--draft", str(draft), "--num-samples", "2", "--top-k", "5"]) == 0
    assert capsys.readouterr().out.count("ROMEO:") == 2
    _fails([*base, "--draft", str(draft), "--speculate", "0"], capsys, 2,
           "--speculate: Input should be greater than or equal to 1")
    other = tmp_path / "other"
    (tmp_path / "other.txt").write_text(TEXT + "xyzq!", encoding="utf-8")
    assert main(["train", "--text", str(tmp_path / "other.txt"), "--out", str(other),
                 *TINY]) == 0
    _fails([*base, "--draft", str(other)], capsys, 1, "trained with another tokenizer",
           "the draft must share the target's tokenizer")
    _fails([*base, "--draft", str(tmp_path / "none")], capsys, 2,
           "argument --draft: no checkpoint at")


def test_sample_checkpoint_errors(tmp_path: Path, trained: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["sample", "--checkpoint", str(tmp_path / "missing"), "--prompt", "a"], capsys, 2,
           "argument --checkpoint: no checkpoint at")
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage, not a checkpoint")
    _fails(["sample", "--checkpoint", str(tmp_path), "--prompt", "a"], capsys, 1,
           "is not a readable checkpoint")
    data = (trained / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    _fails(["sample", "--checkpoint", str(tmp_path), "--prompt", "a"], capsys, 1,
           "is not a readable checkpoint")
    _fails(["sample", "--prompt", "a"], capsys, 2, "required: --checkpoint")


def test_a_checkpoint_with_a_bad_split_pattern_is_named(
        trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = load_checkpoint(trained)
    ckpt["tokenizer"] = {"kind": "bpe", "name": "b", "merges": [], "special_tokens": [],
                         "pat_str": "(ab"}
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    for name in ("train.bin", "val.bin"):
        (tmp_path / name).write_bytes((trained / name).read_bytes())
    needle = "pat_str '(ab' is not a valid regular expression: missing ) at position 3"
    _fails(["sample", "--checkpoint", str(tmp_path), "--prompt", "a"], capsys, 1,
           f"the checkpoint in {tmp_path} is inconsistent", needle)
    _fails(["train", "--out", str(tmp_path), "--resume", "--no-progress"], capsys, 1, needle)


def test_a_default_that_follows_from_other_flags_is_not_shown_as_a_number(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    d_ff = text[text.rindex("--d-ff D_FF"):text.rindex("--dropout DROPOUT")]  # its help
    assert "default:" not in d_ff and "4 D" in d_ff  # 4 D of the D given, not 512
    assert "--d-model D_MODEL" in text and "(default: 128)" in text  # others keep theirs


def test_a_bad_world_size_is_a_one_line_error(tmp_path: Path, text_file: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    _fails(["train", "--text", str(text_file), "--out", str(tmp_path), *TINY], capsys, 1,
           "minigpt train: error: environment variable WORLD_SIZE='two' is not an integer")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    _fails(["train", "--text", str(text_file), "--out", str(tmp_path), *TINY, "--lr", "-1"],
           capsys, 2, "minigpt train: error (rank 1):")


def test_usage_errors_of_the_command_itself(capsys: pytest.CaptureFixture[str]) -> None:
    _fails([], capsys, 2, "the following arguments are required: COMMAND")
    _fails(["tran"], capsys, 2, "invalid choice: 'tran'", "'train'")
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "sample", "sft", "dpo", "chat", "eval",
                                        "assets", "pretrained"))


def test_python_dash_m_runs_the_command_line(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m minigpt ...` runs the package's __main__ module as runpy does here, and
    # exits with main's status.
    for argv, code in ((["sample", "--help"], 0), (["sample", "--top-k", "x"], 2)):
        monkeypatch.setattr(sys, "argv", ["minigpt", *argv])
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("minigpt", run_name="__main__", alter_sys=True)
        assert exit_.value.code == code
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m minigpt sample")
    assert err == ("minigpt sample: error: argument --top-k: Input should be a valid integer, "
                   "unable to parse string as an integer, got 'x'\n")


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--text", "--tokenizer", "--n-layers", "--n-heads", "--d-model",
                 "--context-length", "--batch-size", "--max-steps", "--lr", "--min-lr",
                 "--warmup-steps", "--weight-decay", "--beta2", "--grad-clip", "--dropout",
                 "--eval-interval", "--eval-steps", "--seed", "--out", "--resume"):
        assert flag in out, flag
    for command, flags in (("sample", ("--checkpoint", "--beams", "--draft")),
                           ("assets", ("--check", "--cache")),
                           ("pretrained", ("--only", "--quiet"))):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: python -m minigpt {command}"), out
        assert all(flag in out for flag in flags), (command, out)


def test_a_short_run_needs_no_warmup_flag(tmp_path: Path, text_file: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The default warm-up (100 steps) is cut to the run's decay steps, not refused.
    config = _handed_to_train(["--text", str(text_file), "--out", str(tmp_path),
                               "--max-steps", "2"], monkeypatch)["config"]
    assert (config["max_steps"], config["warmup_steps"], config["decay_steps"]) == (2, 2, 2)
    assert TrainConfig.model_fields["warmup_steps"].default > 2  # the default was cut


def _usage_and_help(command: str, capsys: pytest.CaptureFixture[str],
                    ) -> tuple[str, dict[str, str]]:
    """``command``'s usage (on one line), and each option's help (on one line)."""
    assert main([command, "--help"]) == 0
    usage, _, body = capsys.readouterr().out.partition("\n\n")
    helps: dict[str, str] = {}
    for line in body.splitlines():
        if line.startswith("  -"):
            names, _, rest = line.strip().partition("  ")
            current = [n.split()[0].rstrip(",") for n in names.split(", ")]
            helps |= dict.fromkeys(current, rest.strip())
        elif line.startswith("   ") and helps:
            helps |= {n: f"{helps[n]} {line.strip()}".strip() for n in current}
    return " ".join(usage.split()), helps


@pytest.mark.parametrize("command", ["train", "sample"])
def test_the_help_shows_the_package_models_defaults(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every default that train's and sample's flags show is the field's in the package's
    model (the CPU preset's for the model's shape), written once, there. A required flag has
    none; one whose default is None (or False, for a flag that can only turn a setting on)
    says what happens in words."""
    from minigpt.sample import SampleSettings

    _, helps = _usage_and_help(command, capsys)
    if command == "train":
        defaults = GPTConfig.shakespeare_cpu(65).model_dump() | TrainConfig().model_dump()
        for derived in ("vocab_size", "d_ff", "decay_steps"):  # from the text, D, max_steps
            defaults.pop(derived)
        defaults["warmup_steps"] = TrainConfig.model_fields["warmup_steps"].default
    else:
        defaults = {name: field.default for name, field in SampleSettings.model_fields.items()
                    if not field.is_required()}
    for name, value in defaults.items():
        option = "--" + name.replace("_", "-")
        if value is None or (value is False and "--no-" + option[2:] not in helps):
            continue
        shown = repr(value) if name == "prompt" else str(value)
        assert re.search(re.escape(f"(default: {shown}") + "[),;]", helps[option]), (
            option, helps[option])


@pytest.mark.parametrize("command", ["train", "sample"])
def test_each_settings_field_has_one_flag_whose_help_is_its_docstring(
        command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every field of the settings a command makes (but V, which the text sets) has one flag,
    named for it, whose help is the field's whole text in its class's docstring (its
    Attributes section), then the default the help shows, if any."""
    from minigpt.sample import SampleSettings

    monkeypatch.setenv("COLUMNS", "1000")  # no word broken at a hyphen (multi-|query)
    usage, helps = _usage_and_help(command, capsys)
    models = (GPTConfig, TrainConfig) if command == "train" else (SampleSettings,)
    for model in models:
        doc = " ".join(inspect.cleandoc(model.__doc__ or "").replace("`", "").split())
        entry = "|".join(model.model_fields)  # an entry starts a sentence: ". name: "
        for name in set(model.model_fields) - {"vocab_size"}:
            flag = "--" + name.replace("_", "-")
            assert len(re.findall(rf"(?<![\w-]){flag}(?![\w-])", usage)) == 1, flag
            text = re.sub(r" \(default: [^)]*\)$", "", helps[flag])
            assert re.search(rf"(Attributes:|\.) (\w+, )*{name}(, \w+)*: {re.escape(text)}"
                             rf"( ({entry})[:,]|$)", doc), (flag, text)  # its whole entry


def test_a_refusal_from_a_checkpoint_is_not_a_usage_error(
        trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Settings a file holds, refused: exit status 1, the field named as the file names it.
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    ckpt = load_checkpoint(tmp_path)
    ckpt["train_config"]["lr"] = -1.0
    save_checkpoint(tmp_path / "checkpoint.pt", ckpt)
    _fails(["train", "--out", str(tmp_path), "--resume", "--no-progress"], capsys, 1,
           "minigpt train: error: lr: Input should be greater than 0, got -1.0")


@pytest.mark.parametrize(("argv", "message"), [
    (["rl", "--json", "{tmp}"], "argument --json: {tmp} is a directory"),
    (["rl", "--json", "{tmp}/no/rows.jsonl"], "argument --json: {tmp}/no: no such directory"),
    (["rl", "--out", "{file}"], "argument --out: {file} exists and is not a directory"),
    (["sft", "--out", "{file}"], "argument --out: {file} exists and is not a directory"),
    (["eval", "--text", "{tmp}"], "argument --text: {tmp} is not a regular file"),
    (["assets", "--cache", "{file}", "--check"], "argument --cache: {file} exists and is not "
                                                 "a directory"),
])
def test_a_path_that_cannot_serve_is_a_usage_error(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused as argparse reads it, before anything loads or runs (a run's numbers would
    otherwise be lost at its end)."""
    (tmp_path / "file").write_text("x")
    names = {"tmp": tmp_path, "file": tmp_path / "file"}
    start = ["--checkpoint", str(tmp_path / "none")] * (argv[0] != "assets")  # read after
    _fails([*(a.format(**names) for a in argv), *start], capsys, 2, message.format(**names))


def test_a_usage_error_is_one_line(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse's own errors too: no usage block before the line that says what is wrong.
    assert main(["train", "--out", "x", "--lr", "fast"]) == 2
    assert capsys.readouterr().err == (
        "minigpt train: error: argument --lr: Input should be a valid number, unable to parse "
        "string as a number, got 'fast'\n")
    assert main(["sample", "--checkpoint", str(trained), "--top-p", "0"]) == 2
    assert capsys.readouterr().err == ("minigpt sample: error: argument --top-p: Input should "
                                       "be greater than 0, got '0'\n")
    # What the settings refuse of flags valid one by one: their words, under the flags' names.
    assert main(["train", "--out", "x", "--min-lr", "0.1", "--lr", "0.01"]) == 2
    assert capsys.readouterr().err == (
        "minigpt train: error: --min-lr (=0.1) must not exceed --lr (=0.01)\n")


def test_the_cached_models_are_named_in_one_help(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # `pretrained --help` names them; every other screen that takes --model points there.
    monkeypatch.setenv("COLUMNS", "1000")  # no line broken inside a name (copy-|mix-50)
    screens = {}
    for command in ([], ["train"], ["sample"], ["sft"], ["dpo"], ["rl"], ["chat"], ["eval"],
                    ["assets"], ["pretrained"]):
        assert main([*command, "--help"]) == 0
        screens[" ".join(command)] = " ".join(capsys.readouterr().out.split())
    naming = [name for name, text in screens.items() if "copy-mix-50" in text]
    assert naming == ["pretrained"] and "rl-METHOD-SEED" in screens["pretrained"]
    for command in ("sft", "dpo", "rl", "chat", "eval"):
        assert "`python -m minigpt pretrained --help` names them" in screens[command]


def test_train_keeps_the_thread_count_unless_told(
        tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As sft and dpo: without --threads the process's torch threads (3 here); with it, that
    many for the run, and the count before after it (the run stops where training starts)."""
    import minigpt.cli

    seen: list[int] = []

    def trainer(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        raise KeyboardInterrupt

    monkeypatch.setattr(minigpt.cli, "train", trainer)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for threads in ([], ["--threads", "2"]):
            assert main(["train", "--text", str(text_file), "--out", str(tmp_path), *TINY,
                         *threads]) == 130
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [3, 3, 2, 3]


def test_the_modern_recipe_under_the_flags_given(tmp_path: Path, text_file: Path) -> None:
    from minigpt.config import MODERN_LAYOUT, MODERN_TRAINING

    assert main(["train", "--text", str(text_file), "--out", str(tmp_path), "--recipe",
                 "modern", "--n-layers", "1", "--context-length", "8", "--batch-size", "2",
                 "--max-steps", "3", "--n-kv-heads", "2", "--no-progress"]) == 0
    ckpt = load_checkpoint(tmp_path)
    model, train = ckpt["model_config"], ckpt["train_config"]
    assert all(model[k] == v for k, v in MODERN_LAYOUT.items())  # the recipe's layout
    assert model["n_layers"] == 1 and model["n_kv_heads"] == 2  # and the flags given
    assert train["optimizer"] == "muon" and train["schedule"] == "trapezoid"
    assert train["muon_lr"] == MODERN_TRAINING["muon_lr"] and train["batch_size"] == 2
    assert train["warmup_steps"] == 3  # the recipe's warm-up, cut to the 3-step run
    assert set(ckpt["optimizer"]) == {"muon", "adamw"}


# ----- the assistant's commands: sft, dpo, chat, eval -----------------------------------

TUNE = ["--steps", "2", "--n-train", "6", "--n-test", "2", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A text file, a base checkpoint, and sft and dpo runs made by the commands."""
    root = tmp_path_factory.mktemp("runs")
    text = root / "plays.txt"
    text.write_text(play(), encoding="utf-8")
    tok = CharTokenizer.from_text(play())
    ids = np.asarray(tok.encode_ordinary(play()), dtype=np.uint16)
    torch.manual_seed(0)
    train(GPTConfig(vocab_size=tok.vocab_size, context_length=64, d_model=16, n_heads=2,
                    n_layers=1), TrainConfig(max_steps=2, warmup_steps=1, batch_size=2),
          ids, ids, tokenizer=tok, out_dir=root / "base", progress=False)
    assert main(["sft", "--checkpoint", str(root / "base"), "--text", str(text),
                 "--out", str(root / "sft"), "--context-length", "64", "--max-turns", "2",
                 *TUNE]) == 0
    assert main(["dpo", "--checkpoint", str(root / "sft"), "--text", str(text),
                 "--out", str(root / "dpo"), *TUNE]) == 0
    return {"text": text, "base": root / "base", "sft": root / "sft", "dpo": root / "dpo"}


@pytest.mark.parametrize("command", ["chat", "sft", "dpo", "eval"])
def test_assistant_commands_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: python -m minigpt {command}" in out
    assert all(f in out for f in ("--checkpoint", "--model", "--device"))


def test_sft_and_dpo_write_runs(runs: dict[str, Path]) -> None:
    for name in ("sft", "dpo"):
        assert (runs[name] / "checkpoint.pt").is_file()
        assert json.loads((runs[name] / "metrics.json").read_text())["exact_match"]
        assert load_checkpoint(runs[name])["train_config"]["device"] == "cpu"
    model, tok, _ = load_model(runs["dpo"])
    assert "<|user|>" in tok.special_tokens


def test_chat_with_piped_input(runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("upper: moon\n\nreverse: king\n"))
    assert main(["chat", "--checkpoint", str(runs["sft"]), "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"chatting with {runs['sft']} (context 64 tokens; the oldest turns "
                          "are dropped when the conversation outgrows it); end with Ctrl-D")
    assert out.count("you> ") == 4 and out.rstrip().endswith("bye")


def test_eval_prints_the_table(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--checkpoint", str(runs["dpo"]), "--text", str(runs["text"]),
                 "--items", "10", "--n-train", "4", "--n-test", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["model", "mc_summed", "mc_per_char", "bpc"]
    assert [line.split()[0] for line in lines[1:]] == ["chance", "unigram", "bigram", "dpo"]


def test_eval_scores_the_tasks_the_assistants_hold_out(
        runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """On the corpus set-up uses and with its task settings, `eval` scores exactly
    `assistant_tasks().test` (with `.train` as the shots): tasks made from the base model's
    training split, none of them a question the assistants trained on. Made from the whole
    text instead, a third of the held-out questions of the book's corpus were trained on."""
    import minigpt.cli
    from minigpt import data
    from minigpt.recipes import assistant, pretrained

    monkeypatch.setattr(pretrained, "corpus", play)  # a tiny corpus for both
    monkeypatch.setattr(data, "shakespeare_text", play)
    given: dict[str, Any] = {}
    monkeypatch.setattr(minigpt.cli, "benchmark_table",
                        lambda models, text, **kwargs: given.update(kwargs) or [])
    monkeypatch.setattr(minigpt.cli, "format_table", lambda rows: "")
    recipe = assistant.ASSISTANT_RECIPE.model_copy(update={"n_train": 20, "n_test": 5})
    assert main(["eval", "--checkpoint", str(runs["sft"]), "--n-train", "20",
                 "--n-test", "5"]) == 0
    expected = assistant.assistant_tasks(recipe)
    assert given["tasks"] == expected.test and given["shots"] == expected.train
    defaults, book = minigpt.cli.build_parser().parse_args(["eval"]), assistant.ASSISTANT_RECIPE
    assert (defaults.n_train, defaults.n_test, defaults.task_seed) == (
        book.n_train, book.n_test, book.task_seed)  # the command's defaults are set-up's


@pytest.mark.parametrize("argv, code, message", [
    (["chat", "--checkpoint", "{base}"], 1, "base has no chat tokens (<|user|>, "
                                            "<|assistant|>, <|end|> missing): it is a base model"),
    (["dpo", "--checkpoint", "{base}", "--out", "{tmp}"], 1, "base has no chat tokens"),
    (["sft", "--checkpoint", "{sft}", "--out", "{tmp}"], 1, "sft already has the chat tokens"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}"], 1, "base has learned positions, "
     "weights for exactly 64 of them: pass --context-length 64, or start from a model with "
     "rotary positions"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--text", "{empty}",
      "--context-length", "64"], 1,
     "only 0 first_word tasks can be made from 0 lines"),
    (["eval", "--checkpoint", "{tmp}"], 2, "argument --checkpoint: no checkpoint at"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--n-train", "0"], 2,
     "argument --n-train: Input should be greater than or equal to 1, got '0'"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--steps", "0"], 2,
     "argument --steps: Input should be greater than or equal to 1, got '0'"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--lr", "-0.001"], 2,
     "argument --lr: Input should be greater than 0, got '-0.001'"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--context-length", "1"], 2,
     "argument --context-length: Input should be greater than or equal to 2, got '1'"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--task-seed", "-2"], 2,
     "argument --task-seed: Input should be greater than or equal to 0, got '-2'"),
    (["eval", "--checkpoint", "{sft}", "--items", "0"], 2,
     "argument --items: Input should be greater than or equal to 1, got '0'"),
    (["dpo", "--checkpoint", "{sft}", "--out", "{tmp}", "--beta", "0"], 2,
     "argument --beta: Input should be greater than 0, got '0'"),
    (["dpo", "--checkpoint", "{sft}", "--out", "{tmp}", "--beta", "inf"], 2,
     "argument --beta: Input should be a finite number, got 'inf'"),
    (["chat", "--checkpoint", "{sft}", "--max-new-tokens", "0"], 2,
     "argument --max-new-tokens: Input should be greater than or equal to 1, got '0'"),
    (["chat", "--checkpoint", "{sft}", "--model", "sft-0"], 2,
     "argument --model: not allowed with argument --checkpoint"),
    (["chat", "--model", "gpt5"], 2, "--model: invalid choice: 'gpt5' (choose from book, "),
    (["dpo", "--checkpoint", "{sft}"], 2, "the following arguments are required: --out"),
])
def test_clear_errors(argv: list[str], code: int, message: str, runs: dict[str, Path],
                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("A:\nno\n", encoding="utf-8")
    names = {"base": runs["base"], "sft": runs["sft"], "tmp": tmp_path / "out", "empty": empty}
    assert main([a.format(**names) for a in argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert code == 2 or f"minigpt {argv[0]}: error:" in err


@pytest.fixture(scope="module")
def chat_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model of the corpus's characters (the rhymes and the older families'
    questions are made from the corpus), saved as a run."""
    from minigpt.data import shakespeare_text
    from minigpt.tokenizer import CHAT_TOKENS, with_special_tokens

    chat = with_special_tokens(CharTokenizer.from_text(shakespeare_text()), CHAT_TOKENS)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=chat.vocab_size, context_length=64, d_model=16,
                          n_heads=2, n_layers=1))
    start = tmp_path_factory.mktemp("start")
    save_checkpoint(start / "checkpoint.pt", {
        "model": model.state_dict(), "optimizer": {}, "model_config": model.config.model_dump(),
        "train_config": TrainConfig().model_dump(), "tokenizer": chat.to_dict(), "step": 0,
        "rng": {}, "history": {}, "world_size": 1})
    return start


@pytest.fixture(scope="module")
def short_rewards() -> Iterator[None]:
    """What `rl` reads, the rewards recipe and its tasks, with a shorter evaluation (six
    held-out words, four questions of each older family, 500 characters of text), the tasks
    made once for the module."""
    from minigpt.recipes import rewards

    recipe = rewards.REWARDS_RECIPE.model_copy(update={
        "eval_words": 6, "eval_samples": 8, "eval_old": 4, "bpc_chars": 500})
    made = rewards.rewards_data(recipe)

    def tasks(given: rewards.RewardsRecipe) -> rewards.RewardsData:
        assert given is recipe
        return made

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rewards, "REWARDS_RECIPE", recipe)
        patch.setattr(rewards, "rewards_data", tasks)
        yield


@pytest.mark.usefixtures("short_rewards")
def test_rl_continues_a_chat_model_and_writes_a_run_chat_can_load(
        chat_start: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Two steps, and the run's evaluation.
    out, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    assert main(["rl", "--checkpoint", str(chat_start), "--method", "sft-random",
                 "--steps", "2", "--lr", "1e-3", "--out", str(out), "--json", str(rows)]) == 0
    printed = capsys.readouterr().out
    assert f"continuing {chat_start.name} with sft-random (2 steps)" in printed
    assert "held-out rhymes: pass@1" in printed and "; sampled [" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"] == "sft-random" and len(metrics["history"]["loss"]) == 2
    assert 0 <= metrics["pass@1"] <= metrics["pass@8"] <= 1 and metrics["kl_to_start"] > 0
    row = json.loads(rows.read_text())  # the same numbers, without the history
    assert row == {k: v for k, v in metrics.items() if k != "history"}
    assert (row["steps"], row["lr"], row["validation"], row["cold_start_key"],
            row["cold_start_weights_sha256"]) == (
        2, 1e-3, False, None, None)  # a run's checkpoint has no cache key
    assert row["loss_last10"] == sum(metrics["history"]["loss"]) / 2
    ckpt = load_checkpoint(out)
    assert (ckpt["step"], ckpt["train_config"]["lr"]) == (2, 1e-3)
    trained, tok, step = load_model(out)
    assert step == 2 and "<|user|>" in tok.special_tokens
    before = load_model(chat_start).model
    assert any(not torch.equal(a, b) for a, b in zip(
        trained.state_dict().values(), before.state_dict().values(), strict=True))


@pytest.mark.usefixtures("short_rewards")
def test_rl_cold_evaluates_the_start_and_validation_other_words(
        chat_start: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--method cold evaluates the start without a step (the rate sweep's baseline row);
    --validation evaluates as many held-out words, none of those the chapter evaluates."""
    from minigpt.recipes import rewards

    evaluated: list[list[Any]] = []
    real = rewards.evaluate_run

    def evaluate(model: GPT, start: GPT, tokenizer: Any, data: Any, *args: Any,
                 **kwargs: Any) -> Any:
        evaluated.append(data.eval_rhymes)
        return real(model, start, tokenizer, data, *args, **kwargs)

    monkeypatch.setattr(rewards, "evaluate_run", evaluate)
    rows = tmp_path / "rows.jsonl"
    for extra in ([], ["--validation"]):
        assert main(["rl", "--checkpoint", str(chat_start), "--method", "cold", "--json",
                     str(rows), *extra]) == 0
    assert "continuing" not in capsys.readouterr().out
    chapter, validation = (json.loads(line) for line in rows.read_text().splitlines())
    assert (chapter["method"], chapter["steps"], chapter["lr"]) == ("cold", 0, None)
    assert chapter["kl_to_start"] == 0 and "loss_last10" not in chapter
    assert (chapter["validation"], validation["validation"]) == (False, True)
    words, other = evaluated
    assert len(words) == len(other) and not set(words) & set(other)
    assert list(tmp_path.iterdir()) == [rows]  # no --out: no checkpoint


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["rl", "--out", "{tmp}", "--method", "ppo"], 2, "argument --method: invalid choice: 'ppo'"),
    (["rl", "--out", "{tmp}", "--steps", "0"], 2,
     "argument --steps: Input should be greater than or equal to 1, got '0'"),
    (["rl", "--out", "{tmp}", "--lr", "nan"], 2,
     "argument --lr: Input should be a finite number, got 'nan'"),
    (["rl", "--out", "{tmp}", "--lr", "0"], 2,
     "argument --lr: Input should be greater than 0, got '0'"),
    (["rl", "--out", "{tmp}", "--seed", "-1"], 2,
     "argument --seed: Input should be greater than or equal to 0, got '-1'"),
    (["rl", "--out", "{tmp}", "--threads", "0"], 2,
     "argument --threads: Input should be greater than or equal to 1, got '0'"),
    (["rl", "--out", "{tmp}", "--method", "cold", "--steps", "5"], 2,
     "--method cold evaluates the start as it is: --steps and --lr continue it"),
    (["rl", "--out", "{tmp}", "--method", "cold", "--lr", "1e-3"], 2,
     "--method cold evaluates the start as it is"),
    (["rl", "--out", "{tmp}", "--model", "rl-ppo-0"], 2,
     "--model: invalid choice: 'rl-ppo-0' (choose from book, "),
    (["rl", "--checkpoint", "{base}", "--out", "{tmp}"], 1, "it is a base model"),
    (["rl", "--model", "rl-cold"], 2, "give --out, --json or both: where the run's numbers go"),
])
def test_rl_errors(argv: list[str], code: int, message: str, runs: dict[str, Path],
                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = {"base": runs["base"], "tmp": tmp_path / "out"}
    assert main([a.format(**names) for a in argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["chat", "sft", "dpo", "eval", "sample"])
@pytest.mark.parametrize(("device", "message"), [
    ("tpu9", "'tpu9' is not a torch device; use cpu, cuda or cuda:N"),
    ("cuda", "'cuda': CUDA is not available on this machine; use cpu"),
    ("cuda:2", "'cuda:2': CUDA is not available on this machine; use cpu"),
    ("meta", "'meta': models run on cpu, cuda or cuda:N (or mps)"),
])
def test_every_model_command_checks_its_device(
        command: str, device: str, message: str, runs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = ["--out", str(tmp_path)] * (command in ("sft", "dpo"))
    _fails([command, "--checkpoint", str(runs["sft"]), *out, "--device", device], capsys, 2,
           f"minigpt {command}: error: argument --device: {message}")
    assert not (tmp_path / "checkpoint.pt").exists()


def test_a_gpu_index_the_machine_lacks_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _fails(["chat", "--model", "sft-0", "--device", "cuda:2"], capsys, 2,
           "--device: 'cuda:2': this machine has 2 GPU(s), cuda:0 to cuda:1")


@pytest.mark.parametrize("command", ["chat", "sft", "dpo", "eval"])
def test_the_device_reaches_the_model_and_the_training(
        command: str, runs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--device cuda:1 on a machine pretending to have two GPUs: the model is loaded there,
    and sft and dpo train there (their run stops where training would start)."""
    import minigpt.cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)
    seen: list[object] = []
    real_load = minigpt.cli.load_model

    def load(path: Path, *, device: str | torch.device) -> Any:
        seen.append(str(device))
        return real_load(path, device="cpu")

    def trainer(*args: Any, **kwargs: Any) -> Any:
        seen.extend([args[4].device, str(kwargs["ctx"].device)])
        raise KeyboardInterrupt

    monkeypatch.setattr(minigpt.cli, "load_model", load)
    monkeypatch.setattr(minigpt.cli, "finetune", trainer)
    monkeypatch.setattr(minigpt.cli, "train_dpo", trainer)
    monkeypatch.setattr(minigpt.cli, "format_table", lambda rows: seen.append("table") or "")
    monkeypatch.setattr(minigpt.cli, "benchmark_table", lambda *args, **kwargs: [])
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    start = runs["base"] if command == "sft" else runs["sft"]
    extra = {"sft": ["--out", str(tmp_path), "--context-length", "64", *TUNE],
             "dpo": ["--out", str(tmp_path), *TUNE],
             "eval": ["--text", str(runs["text"]), "--n-train", "4", "--n-test", "2"],
             "chat": []}[command]
    main([command, "--checkpoint", str(start), "--device", "cuda:1", *extra])
    assert seen == {"sft": ["cuda:1"] * 3, "dpo": ["cuda:1"] * 3,
                    "eval": ["cuda:1", "table"], "chat": ["cuda:1"]}[command]


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_rank_joins_its_group_before_loading_the_model_onto_its_gpu(
        command: str, runs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 under torchrun with --device cuda: joining the process group gives it
    GPU cuda:1, and only then is the model loaded, there. Loaded before, every rank's model
    (and DPO's frozen reference, a copy of it) would sit on GPU 0."""
    import minigpt.cli
    from minigpt.parallel import DistContext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    events: list[tuple[str, str]] = []
    real_load = minigpt.cli.load_model

    def join(device: str, backend: str | None = None) -> DistContext:
        events.append(("join", device))
        return DistContext(rank=1, local_rank=1, world_size=2, backend="nccl",
                           device=torch.device("cuda", 1))

    def load(path: Path, *, device: str | torch.device) -> Any:
        events.append(("load", str(device)))
        return real_load(path, device="cpu")

    def trainer(*args: Any, **kwargs: Any) -> Any:
        events.append(("train", str(kwargs["ctx"].device)))
        raise KeyboardInterrupt

    monkeypatch.setattr(minigpt.parallel, "init_distributed", join)
    monkeypatch.setattr(minigpt.parallel, "shutdown", lambda ctx: events.append(("leave", "")))
    monkeypatch.setattr(minigpt.cli, "load_model", load)
    monkeypatch.setattr(minigpt.cli, "finetune", trainer)
    monkeypatch.setattr(minigpt.cli, "train_dpo", trainer)
    start = runs["base"] if command == "sft" else runs["sft"]
    extra = ["--context-length", "64"] if command == "sft" else []
    assert main([command, "--checkpoint", str(start), "--device", "cuda", "--text",
                 str(runs["text"]), "--out", str(tmp_path), *TUNE, *extra]) == 130
    assert events == [("join", "cuda"), ("load", "cuda:1"), ("train", "cuda:1"), ("leave", "")]


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_sft_and_dpo_keep_the_thread_count_unless_told(
        command: str, runs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --threads a run keeps the process's torch threads (3 here); with it, the
    run has that many and the count before comes back after (the run stops where training
    would start)."""
    import minigpt.cli

    seen: list[int] = []

    def trainer(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        raise KeyboardInterrupt

    monkeypatch.setattr(minigpt.cli, "finetune", trainer)
    monkeypatch.setattr(minigpt.cli, "train_dpo", trainer)
    start = runs["base"] if command == "sft" else runs["sft"]
    extra = ["--context-length", "64"] if command == "sft" else []
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for threads in ([], ["--threads", "2"]):
            assert main([command, "--checkpoint", str(start), "--text", str(runs["text"]),
                         "--out", str(tmp_path), *TUNE, *extra, *threads]) == 130
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [3, 3, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_under_torchrun_two_processes_train_and_rank_zero_writes(
        command: str, runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    # torchrun's launcher runs here, as `train --nproc-per-node` runs it; the two ranks are
    # processes of their own.
    from torch.distributed.run import parse_args, run

    start = runs["base"] if command == "sft" else runs["sft"]
    out = tmp_path / command
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run(parse_args([  # type: ignore[no-untyped-call]
        "--standalone", "--nproc-per-node=2", "-m", "minigpt", command, "--checkpoint",
        str(start), "--text", str(runs["text"]), "--out", str(out), *TUNE,
        *(["--context-length", "64"] if command == "sft" else [])]))
    assert capfd.readouterr().out.count("wrote ") == 1  # rank 0 alone
    assert load_checkpoint(out)["world_size"] == 2
    assert json.loads((out / "metrics.json").read_text())["exact_match"]
