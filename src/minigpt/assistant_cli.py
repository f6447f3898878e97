"""The assistant's commands, which `minigpt.cli` registers:

    python -m minigpt sft --out runs/sft                 fine-tune the book model on the tasks
    python -m minigpt dpo --checkpoint runs/sft --out runs/dpo   preference-tune it
    python -m minigpt chat --checkpoint runs/dpo         talk to it in the terminal
    python -m minigpt eval --checkpoint runs/dpo         the benchmark table

Started by torchrun (`torchrun --nproc-per-node 2 -m minigpt sft ...`), sft and dpo train
data-parallel, as `minigpt.train.train` does: each process takes a batch of its own every
step and the gradients are averaged over all their answer tokens (sft) or pairs (dpo); rank
0 evaluates and writes. ``--model NAME`` takes a cached model (`minigpt.assistant.MODELS`:
book, sft-0, dpo, ...) instead of a checkpoint. Bad input raises ValueError with what was
wrong, which the command line prints as one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch

from minigpt import assistant
from minigpt.chat import ChatFormatError, Turn, prompt_ids, reply
from minigpt.config import TrainConfig
from minigpt.data import read_text, shakespeare_text
from minigpt.dpo import DPO_TRAINING, check_beta, make_pairs, train_dpo
from minigpt.evals import benchmark_table, format_table
from minigpt.files import atomic_write
from minigpt.model import GPT
from minigpt.parallel import DistContext, init_distributed, shutdown
from minigpt.sample import load_model
from minigpt.sft import SFT_TRAINING, finetune
from minigpt.tasks import TaskSplit, exact_match, make_tasks
from minigpt.tokenizer import CHAT_TOKENS, Tokenizer

Handler = Callable[[argparse.Namespace, list[str]], int]


def add_commands(commands: Any) -> None:
    """Add chat, sft, dpo and eval to ``commands`` (argparse sub-parsers)."""
    for name, handler, help_ in (
            ("chat", _chat, "talk with a fine-tuned model in the terminal"),
            ("sft", _sft, "fine-tune a base model to answer the verifiable tasks"),
            ("dpo", _dpo, "preference-tune a fine-tuned model with DPO"),
            ("eval", _eval, "print the benchmark table of a model")):
        p = commands.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".",
                                prog=f"python -m minigpt {name}", allow_abbrev=False)
        p.set_defaults(handler=handler)
        source = p.add_mutually_exclusive_group()
        source.add_argument("--checkpoint", type=Path, help="a run's folder (its checkpoint.pt)")
        source.add_argument("--model", choices=sorted(assistant.MODELS),
                            help="a cached model (default: book for sft, sft-0 otherwise)")
        if name == "chat":
            p.add_argument("--max-new-tokens", type=int, default=32, help="longest answer")
        else:
            _task_flags(p, name)


def _task_flags(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--text", type=Path, help="UTF-8 plays to make tasks from (default: "
                   "Shakespeare's)")
    p.add_argument("--n-train", type=int, default=2000, help="training tasks a family")
    p.add_argument("--n-test", type=int, default=200, help="held-out tasks a family")
    p.add_argument("--task-seed", type=int, default=0, help="seed of the tasks")
    if name == "eval":
        p.add_argument("--items", type=int, default=1000, help="multiple-choice items")
        return
    p.add_argument("--out", type=Path, required=True, help="folder for checkpoint.pt and "
                   "metrics.json")
    defaults = SFT_TRAINING if name == "sft" else DPO_TRAINING
    p.add_argument("--steps", type=int, default=defaults["max_steps"])
    p.add_argument("--lr", type=float, default=defaults["lr"])
    p.add_argument("--seed", type=int, default=defaults["seed"], help="training seed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    if name == "dpo":
        p.add_argument("--beta", type=float, default=0.5, help="DPO's KL weight")


def load_any(args: argparse.Namespace, default: str) -> tuple[GPT, Tokenizer, str]:
    """The model of ``--checkpoint`` or ``--model`` (``default`` if neither), its tokenizer
    and a name for it."""
    if args.checkpoint is not None:
        model, tokenizer, _ = load_model(args.checkpoint)
        return model, tokenizer, args.checkpoint.name or str(args.checkpoint)
    name = args.model or default
    model, tokenizer, _ = assistant.MODELS[name]()
    return model, tokenizer, name


def require_chat(tokenizer: Tokenizer, where: str) -> None:
    """Refuse a model whose tokenizer lacks the chat tokens."""
    missing = [t for t in CHAT_TOKENS if t not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"{where} has no chat tokens ({', '.join(missing)} missing): it is a "
                         "base model; fine-tune it first with `python -m minigpt sft`")


def _tasks(args: argparse.Namespace) -> TaskSplit:
    text = shakespeare_text() if args.text is None else read_text(args.text)
    return make_tasks(text, args.n_train, args.n_test, seed=args.task_seed)


def _config(defaults: dict[str, Any], args: argparse.Namespace) -> TrainConfig:
    """The defaults with the command's steps, rate (its tenth the floor) and seed; a run
    shorter than the warm-up warms up over the whole run."""
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    return TrainConfig(**(defaults | dict(
        max_steps=args.steps, lr=args.lr, min_lr=args.lr / 10, seed=args.seed,
        warmup_steps=min(defaults["warmup_steps"], args.steps))))


def _write(out: Path, metrics: dict[str, Any]) -> None:
    atomic_write(out / "metrics.json", (json.dumps(metrics, indent=1) + "\n").encode())
    print(json.dumps(metrics["exact_match"]))
    print(f"wrote {out / 'checkpoint.pt'} and {out / 'metrics.json'}")


@contextmanager
def _processes() -> Iterator[DistContext]:
    """The process group when started by torchrun (`torchrun --nproc-per-node N -m minigpt
    sft ...`: the ranks split each step's batch, rank 0 evaluates and writes), else one
    process."""
    ctx = init_distributed("cpu")
    try:
        yield ctx
    finally:
        shutdown(ctx)


def _sft(args: argparse.Namespace, argv: list[str]) -> int:
    base, tokenizer, name = load_any(args, "book")
    if CHAT_TOKENS[0] in tokenizer.special_tokens:
        raise ValueError(f"{name} already has the chat tokens; sft starts from a base model")
    tasks = _tasks(args)
    torch.set_num_threads(1)
    config = _config(SFT_TRAINING, args)
    with _processes() as ctx:
        result, chat = finetune(base, tokenizer, tasks.train, tasks.test, config,  # type: ignore[arg-type]
                                out_dir=args.out, progress=not args.quiet, ctx=ctx)
        if ctx.is_main:
            _write(args.out, result.metrics | {"exact_match": exact_match(
                result.model, chat, tasks.test)})
    return 0


def _dpo(args: argparse.Namespace, argv: list[str]) -> int:
    policy, tokenizer, name = load_any(args, "sft-0")
    require_chat(tokenizer, name)
    beta = check_beta(args.beta)
    tasks = _tasks(args)
    torch.set_num_threads(1)
    config = _config(DPO_TRAINING, args)
    with _processes() as ctx:
        result, _ = train_dpo(policy, tokenizer, make_pairs(tasks.train, seed=0),
                              make_pairs(tasks.test, seed=1), config, beta=beta,
                              out_dir=args.out, progress=not args.quiet, ctx=ctx)
        if ctx.is_main:
            _write(args.out, result.metrics | {"beta": beta, "exact_match": exact_match(
                result.model, tokenizer, tasks.test)})
    return 0


def _eval(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer, name = load_any(args, "sft-0")
    tasks = _tasks(args)
    text = shakespeare_text() if args.text is None else read_text(args.text)
    rows = benchmark_table({name: (model, tokenizer)}, text, n_items=args.items,
                           tasks=tasks.test, shots=tasks.train)
    print(format_table(rows))
    return 0


def _chat(args: argparse.Namespace, argv: list[str]) -> int:
    model, tokenizer, name = load_any(args, "sft-0")
    require_chat(tokenizer, name)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    print(f"chatting with {name} (context {model.config.context_length} tokens); "
          "end with Ctrl-D or Ctrl-C")
    chat_loop(model, tokenizer, sys.stdin, sys.stdout, max_new_tokens=args.max_new_tokens)
    return 0


def chat_loop(model: GPT, tokenizer: Tokenizer, stdin: TextIO, stdout: TextIO, *,
              max_new_tokens: int = 32) -> list[Turn]:
    """Read the user's lines from ``stdin`` and write the model's answers to ``stdout``,
    the conversation kept in the chat format, until end of input or Ctrl-C; returns the
    turns. When the conversation no longer fits the context, its oldest turns are dropped
    (and the user told); a message too long by itself is refused with the reason."""
    turns: list[Turn] = []
    while True:
        stdout.write("you> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:
            stdout.write("\nbye\n")
            return turns
        if not line.strip():
            continue
        try:
            turns = fit_context(turns + [Turn("user", line.rstrip("\n"))], tokenizer,
                                model.config.context_length, stdout)
        except (ChatFormatError, ValueError) as err:
            stdout.write(f"(not sent: {err})\n")
            continue
        try:
            answer = reply(model, tokenizer, turns, max_new_tokens=max_new_tokens)
        except KeyboardInterrupt:
            stdout.write("\nbye\n")
            return turns
        answer = _cut_special(answer)
        turns.append(Turn("assistant", answer))
        stdout.write(f"{answer}\n")


def fit_context(turns: list[Turn], tokenizer: Tokenizer, context_length: int,
                stdout: TextIO) -> list[Turn]:
    """``turns`` without their oldest turns, as few as needed for the prompt to leave room
    for an answer in the context; ValueError if the last message alone does not fit."""
    for start in range(len(turns)):
        kept = turns[start:]
        if kept[0].role == "user" and len(prompt_ids(kept, tokenizer)) < context_length - 1:
            if start:
                stdout.write(f"(the conversation outgrew the context of {context_length} "
                             f"tokens: its first {start} turn(s) are forgotten)\n")
            return kept
    n = len(prompt_ids(turns[-1:], tokenizer))
    raise ValueError(f"this message makes a prompt of {n} tokens; the model reads "
                     f"{context_length}, and an answer needs room: write a shorter one")


def _cut_special(answer: str) -> str:
    """The answer up to any chat token it produced (a turn's text may not hold one)."""
    cut = min((answer.index(t) for t in CHAT_TOKENS if t in answer), default=len(answer))
    return answer[:cut]

