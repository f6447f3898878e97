"""`python -m minigpt chat|sft|dpo|eval`: help, a piped conversation, the context's limit,
and clear errors (a base model where a chat model is needed, an empty data set, a message
longer than the context). Tiny models trained for a few steps on a small text."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_assistant import play

from minigpt import GPTConfig
from minigpt.assistant_cli import chat_loop, fit_context
from minigpt.chat import Turn
from minigpt.checkpoint import load_checkpoint
from minigpt.cli import main
from minigpt.config import TrainConfig
from minigpt.sample import load_model
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--steps", "2", "--n-train", "6", "--n-test", "2", "--quiet"]


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
                 "--out", str(root / "sft"), *TINY]) == 0
    assert main(["dpo", "--checkpoint", str(root / "sft"), "--text", str(text),
                 "--out", str(root / "dpo"), *TINY]) == 0
    return {"text": text, "base": root / "base", "sft": root / "sft", "dpo": root / "dpo"}


@pytest.mark.parametrize("command", ["chat", "sft", "dpo", "eval"])
def test_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: python -m minigpt {command}" in out and "--checkpoint" in out


def test_sft_and_dpo_write_runs(runs: dict[str, Path]) -> None:
    for name in ("sft", "dpo"):
        assert (runs[name] / "checkpoint.pt").is_file()
        assert (runs[name] / "metrics.json").is_file()
    model, tok, _ = load_model(runs["dpo"])
    assert "<|user|>" in tok.special_tokens


def test_chat_with_piped_input(runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("upper: moon\n\nreverse: king\n"))
    assert main(["chat", "--checkpoint", str(runs["sft"]), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("chatting with sft (context 64 tokens)")
    assert out.count("you> ") == 4 and out.rstrip().endswith("bye")


def test_chat_turns_stay_in_the_chat_format(runs: dict[str, Path]) -> None:
    model, tok, _ = load_model(runs["sft"])
    out = io.StringIO()
    turns = chat_loop(model, tok, io.StringIO("upper: moon\nfirst word: Good king\n"), out,
                      max_new_tokens=3)
    assert [t.role for t in turns] == ["user", "assistant"] * 2
    assert turns[2].text == "first word: Good king"


def test_a_long_conversation_forgets_its_first_turns(runs: dict[str, Path]) -> None:
    model, tok, _ = load_model(runs["sft"])
    out = io.StringIO()
    turns = [Turn("user", "upper: moon"), Turn("assistant", "MOON"),
             Turn("user", "reverse: king"), Turn("assistant", "gnik")]
    kept = fit_context(turns + [Turn("user", "first word: Good noble king")], tok, 64, out)
    assert kept[0].role == "user" and len(kept) < 5
    assert "outgrew the context of 64 tokens: its first" in out.getvalue()
    with pytest.raises(ValueError, match="this message makes a prompt of 7.* tokens; the "
                                         "model reads 64"):
        fit_context([Turn("user", "moon " * 14)], tok, 64, out)


def test_chat_refuses_messages_it_cannot_take_and_goes_on(runs: dict[str, Path]) -> None:
    model, tok, _ = load_model(runs["sft"])
    out = io.StringIO()
    turns = chat_loop(model, tok, io.StringIO("moon " * 20 + "\n" + "héllo\n" + "upper: moon\n"),
                      out, max_new_tokens=2)
    text = out.getvalue()
    assert "(not sent: this message makes a prompt of" in text
    assert "(not sent: character 'é'" in text
    assert len(turns) == 2 and text.rstrip().endswith("bye")


def test_ctrl_c_ends_the_chat_cleanly(runs: dict[str, Path]) -> None:
    class Interrupted(io.StringIO):
        def readline(self, *args: object) -> str:
            raise KeyboardInterrupt

    model, tok, _ = load_model(runs["sft"])
    out = io.StringIO()
    assert chat_loop(model, tok, Interrupted(), out) == []
    assert out.getvalue().endswith("bye\n")


def test_eval_prints_the_table(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--checkpoint", str(runs["dpo"]), "--text", str(runs["text"]),
                 "--items", "10", "--n-train", "4", "--n-test", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["model", "mc_summed", "mc_per_char", "bpc"]
    assert [line.split()[0] for line in lines[1:]] == ["chance", "unigram", "bigram", "dpo"]


@pytest.mark.parametrize("argv, message", [
    (["chat", "--checkpoint", "{base}"], "base has no chat tokens (<|user|>, <|assistant|>, "
                                         "<|end|> missing): it is a base model"),
    (["dpo", "--checkpoint", "{base}", "--out", "{tmp}"], "base has no chat tokens"),
    (["sft", "--checkpoint", "{sft}", "--out", "{tmp}"], "sft already has the chat tokens"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--text", "{empty}"],
     "only 0 first_word tasks can be made from 0 lines"),
    (["sft", "--checkpoint", "{base}", "--out", "{tmp}", "--n-train", "0"],
     "n_train must be an int >= 1, got 0"),
    (["dpo", "--checkpoint", "{sft}", "--out", "{tmp}", "--beta", "0"],
     "beta must be a positive number"),
    (["chat", "--checkpoint", "{sft}", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["eval", "--checkpoint", "{tmp}"], "checkpoint"),
])
def test_clear_errors(argv: list[str], message: str, runs: dict[str, Path], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("A:\nno\n", encoding="utf-8")
    names = {"base": runs["base"], "sft": runs["sft"], "tmp": tmp_path / "out", "empty": empty}
    assert main([a.format(**names) for a in argv]) == 1
    err = capsys.readouterr().err
    assert f"minigpt {argv[0]}: error:" in err and message in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_under_torchrun_two_processes_train_and_rank_zero_writes(
        runs: dict[str, Path], tmp_path: Path, command: str) -> None:
    start = runs["base"] if command == "sft" else runs["sft"]
    out = tmp_path / command
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "minigpt", command, "--checkpoint", str(start), "--text", str(runs["text"]),
         "--out", str(out), *TINY], capture_output=True, text=True, timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("wrote ") == 1  # rank 0 alone
    assert load_checkpoint(out)["world_size"] == 2
    assert json.loads((out / "metrics.json").read_text())["exact_match"]
