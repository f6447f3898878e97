"""Supervised fine-tuning: a base model taught to answer in the chat format.

The data are conversations (`minigpt.posttrain.tasks`' questions and answers, one or several to a
conversation), encoded with the chat tokens into an `ExampleSet` whose mask marks what the
assistant says; the training run is `minigpt.train.train`'s, whose loss counts the masked
targets only (`masked_lm_loss`) and whose accumulated micro-batches are weighted by their
share of answer tokens (`train_step`).

The command line's `python -m minigpt sft` fine-tunes with it (`minigpt.cli`),
and so does set-up's `minigpt.recipes.assistant.sft_model`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from minigpt.config import TrainConfig
from minigpt.data import ExampleSet
from minigpt.model import GPT
from minigpt.posttrain.chat import Turn, add_chat_tokens, encode_conversation, extend_context
from minigpt.posttrain.tasks import Task, conversations
from minigpt.tokenizer import END_OF_TURN, BPETokenizer, CharTokenizer, Tokenizer
from minigpt.train import TrainResult, train

#: The fine-tuning recipe of the book's assistants (set-up's and the command line's): 1,000
#: steps of 8 conversations with AdamW at a peak rate of 6e-3, a short warm-up and no
#: weight decay.
SFT_TRAINING: dict[str, Any] = dict(
    batch_size=8, max_steps=1000, lr=6e-3, min_lr=6e-4, warmup_steps=50, weight_decay=0.0,
    eval_interval=250, eval_steps=10, seed=1337)


def encode_conversations(conversations: Sequence[Sequence[Turn]], tokenizer: Tokenizer,
                         context_length: int | None = None) -> ExampleSet:
    """The conversations as token ids (`encode_conversation`), masked to what the assistant
    says. A conversation longer than a model of ``context_length`` reads in one pass loses
    its oldest exchanges (a question and its answer) until it fits, as the chat command
    drops them (`minigpt.posttrain.chat.fit_context`); None keeps every conversation whole."""
    if not conversations:
        raise ValueError("encode_conversations needs at least one conversation")
    sequences, masks = [], []
    for k, turns in enumerate(conversations):
        ids, mask = encode_conversation(turns, tokenizer)
        if context_length is not None:
            while len(ids) > context_length + 1 and len(turns) > 2:
                turns = turns[2:]
                ids, mask = encode_conversation(turns, tokenizer)
            if len(ids) > context_length + 1:
                raise ValueError(f"conversation {k}'s last exchange alone is {len(ids)} "
                                 f"tokens; a model of context {context_length} reads "
                                 f"{context_length + 1}")
        sequences.append(ids)
        masks.append(mask)
    return ExampleSet(sequences, masks, pad_id=tokenizer.special_tokens[END_OF_TURN])


def encode_tasks(tasks: Sequence[Task], tokenizer: Tokenizer) -> ExampleSet:
    """The tasks as conversations of one exchange each, masked to the answers."""
    if not tasks:
        raise ValueError("encode_tasks needs at least one task")
    return encode_conversations([t.conversation() for t in tasks], tokenizer)


def finetune(model: GPT, tokenizer: CharTokenizer | BPETokenizer, train_tasks: Sequence[Task],
             val_tasks: Sequence[Task], config: TrainConfig, *, replay: Sequence[str] = (),
             max_turns: int = 1, context_length: int | None = None, length_buckets: int = 1,
             **train_args: Any) -> tuple[TrainResult, CharTokenizer | BPETokenizer]:
    """Give a base model the chat tokens (`add_chat_tokens`) and train it on the tasks'
    answers with `minigpt.train.train` (``train_args`` go to it); the base model is not
    changed. Returns the run's result (``.model`` is the fine-tuned model) and the chat
    tokenizer.

    ``max_turns``: the tasks are asked in conversations of 1 to ``max_turns`` questions
    (`minigpt.posttrain.tasks.conversations`, grouped with the run's seed), so that the model learns
    to answer the last question whatever turns precede it. ``context_length``: the
    fine-tuned model reads this many tokens (`extend_context`; default: the base model's).
    ``replay``: plain texts (e.g. `text_windows` of the pre-training text) mixed into the
    training examples, every target of each counted: without them the model, trained on
    answers alone, forgets how to continue text. ``length_buckets``: each batch is drawn
    from one of this many buckets of training examples of similar length
    (`ExampleSet.get_batch`), so that it carries little padding.
    """
    chat_model, chat = add_chat_tokens(model, tokenizer)
    if context_length is not None:
        chat_model = extend_context(chat_model, context_length)
    T = chat_model.config.context_length
    data = encode_conversations(conversations(train_tasks, max_turns, seed=config.seed),
                                chat, T)
    plain = [chat.encode_ordinary(t) for t in replay]
    data = ExampleSet([s.tolist() for s in data.sequences] + plain,
                      [m.tolist() for m in data.masks] + [[True] * len(p) for p in plain],
                      pad_id=data.pad_id, length_buckets=length_buckets)
    val = encode_conversations(conversations(val_tasks, max_turns, seed=0), chat, T)
    result = train(chat_model, config, data, val, tokenizer=chat, **train_args)
    return result, chat


def text_windows(text: str, n: int, length: int, *, seed: int = 0) -> list[str]:
    """``n`` pieces of ``text`` of ``length`` characters at random places (``seed``)."""
    if n < 1 or not 1 < length < len(text):
        raise ValueError(f"need n >= 1 windows of 1 < length < {len(text)} characters, got "
                         f"n={n}, length={length}")
    rng = random.Random(seed)
    return [text[i:i + length] for i in (rng.randrange(len(text) - length) for _ in range(n))]
