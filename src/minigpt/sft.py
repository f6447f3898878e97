"""Supervised fine-tuning: a base model taught to answer in the chat format.

The data are conversations (`minigpt.tasks`' questions and answers), encoded with the chat
tokens into an `ExampleSet` whose mask marks what the assistant says; the training run is
`minigpt.train.train`'s, whose loss counts the masked targets only (`masked_lm_loss`) and
whose accumulated micro-batches are weighted by their share of answer tokens (`train_step`).

    python -m minigpt.sft --steps 1500

fine-tunes the book's model on the task families and prints each family's exact match on
the held-out tasks, the base model's (prompted with solved examples) beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from minigpt.chat import add_chat_tokens, encode_conversation
from minigpt.data import ExampleSet, shakespeare_text
from minigpt.model import GPT
from minigpt.pretrained import book_model
from minigpt.tasks import FAMILIES, Task, exact_match, make_tasks
from minigpt.tokenizer import END_OF_TURN, BPETokenizer, CharTokenizer, Tokenizer
from minigpt.train import TrainConfig, TrainResult, train

#: Fine-tuning settings for the book model: a lower peak rate than pre-training's, a short
#: warm-up, and larger batches (a sequence holds one short answer).
SFT_TRAINING: dict[str, Any] = dict(
    batch_size=32, lr=5e-4, min_lr=5e-5, warmup_steps=50, weight_decay=0.0,
    eval_interval=250, eval_steps=10, seed=1337)


def encode_tasks(tasks: Sequence[Task], tokenizer: Tokenizer) -> ExampleSet:
    """The tasks as conversations (`encode_conversation`), masked to the answers."""
    if not tasks:
        raise ValueError("encode_tasks needs at least one task")
    encoded = [encode_conversation(t.conversation(), tokenizer) for t in tasks]
    return ExampleSet([ids for ids, _ in encoded], [mask for _, mask in encoded],
                      pad_id=tokenizer.special_tokens[END_OF_TURN])


def finetune(model: GPT, tokenizer: CharTokenizer | BPETokenizer, train_tasks: Sequence[Task],
             val_tasks: Sequence[Task], config: TrainConfig, *, replay: Sequence[str] = (),
             **train_args: Any) -> tuple[TrainResult, CharTokenizer | BPETokenizer]:
    """Give a base model the chat tokens (`add_chat_tokens`) and train it on the tasks'
    answers with `minigpt.train.train` (``train_args`` go to it); the base model is not
    changed. Returns the run's result (``.model`` is the fine-tuned model) and the chat
    tokenizer.

    ``replay``: plain texts (e.g. `text_windows` of the pre-training text) mixed into the
    training examples, every target of each counted: without them the model, trained on
    answers alone, forgets how to continue text.
    """
    chat_model, chat = add_chat_tokens(model, tokenizer)
    data = encode_tasks(train_tasks, chat)
    if replay:
        plain = [chat.encode_ordinary(t) for t in replay]
        data = ExampleSet([s.tolist() for s in data.sequences] + plain,
                          [m.tolist() for m in data.masks] + [[True] * len(p) for p in plain],
                          pad_id=data.pad_id)
    result = train(chat_model, config, data, encode_tasks(val_tasks, chat), tokenizer=chat,
                   **train_args)
    return result, chat


def text_windows(text: str, n: int, length: int, *, seed: int = 0) -> list[str]:
    """``n`` pieces of ``text`` of ``length`` characters at random places (``seed``)."""
    if n < 1 or not 1 < length < len(text):
        raise ValueError(f"need n >= 1 windows of 1 < length < {len(text)} characters, got "
                         f"n={n}, length={length}")
    rng = random.Random(seed)
    return [text[i:i + length] for i in (rng.randrange(len(text) - length) for _ in range(n))]


def compare(steps: int, *, n_train: int = 2000, n_test: int = 200, seed: int = 0,
            families: Sequence[str] = tuple(FAMILIES), **training: Any) -> dict[str, Any]:
    """The book model's held-out exact match per task family: the base model prompted with
    solved examples, and after ``steps`` steps of fine-tuning on ``n_train`` tasks a family
    (with `SFT_TRAINING`'s settings, under ``training``)."""
    base, tokenizer, _ = book_model()
    tasks = make_tasks(shakespeare_text(), n_train, n_test, seed=seed, families=families)
    before = exact_match(base, tokenizer, tasks.test, shots=tasks.train)
    config = TrainConfig(**(SFT_TRAINING | dict(max_steps=steps, seed=seed) | training))
    start = time.perf_counter()
    result, chat = finetune(base, tokenizer, tasks.train, tasks.test, config, progress=False)
    seconds = time.perf_counter() - start
    after = exact_match(result.model, chat, tasks.test)
    return {"steps": steps, "seed": seed, "train_seconds": round(seconds, 1),
            "final_val_loss": result.metrics["final_val_loss"],
            "few_shot": before, "fine_tuned": after}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minigpt.sft", description=compare.__doc__)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=SFT_TRAINING["lr"])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = compare(args.steps, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                  families=args.families, lr=args.lr, min_lr=args.lr / 10)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
