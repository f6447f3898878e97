"""Supervised fine-tuning: a base model taught to answer in the chat format.

The data are conversations (`minigpt.tasks`' questions and answers), encoded with the chat
tokens into an `ExampleSet` whose mask marks what the assistant says; the training run is
`minigpt.train.train`'s, whose loss counts the masked targets only (`masked_lm_loss`) and
whose accumulated micro-batches are weighted by their share of answer tokens (`train_step`).

The command line's `python -m minigpt sft` fine-tunes with it (`minigpt.cli`),
and so does set-up's `minigpt.assistant.sft_model`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from minigpt.chat import add_chat_tokens, encode_conversation
from minigpt.config import TrainConfig
from minigpt.data import ExampleSet
from minigpt.model import GPT
from minigpt.tasks import Task
from minigpt.tokenizer import END_OF_TURN, BPETokenizer, CharTokenizer, Tokenizer
from minigpt.train import TrainResult, train

#: The fine-tuning recipe of the book's assistants (set-up's and the command line's): 600
#: steps at pre-training's peak rate with a short warm-up, larger batches (a sequence holds
#: one short answer) and no weight decay.
SFT_TRAINING: dict[str, Any] = dict(
    batch_size=32, max_steps=600, lr=1e-3, min_lr=1e-4, warmup_steps=50, weight_decay=0.0,
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
