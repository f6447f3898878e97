"""Benchmarks beyond the loss: a multiple-choice test made from held-out text, count
baselines, exact match per task family and by turn of a conversation, bits per character,
and one table of them all.

The multiple-choice test is HellaSwag's idea at the book's scale: a line of a held-out
speech and the first half of the next line are the context, and the second half must be
told from three distractors, second halves of about the same length from elsewhere in the
held-out text (`make_choices`, deterministic given a seed). A model answers with the
ending it finds most likely: by the summed log-likelihood of the ending's characters, or
by that sum divided by the ending's number of characters (which removes the preference
for short endings). Chance is 25 %. A unigram
and a bigram count model of the training text (`CountModel`) are scored the same way: a
model that does not beat them has learnt little beyond letter frequencies.

`exact_match_by_turn` asks the held-out tasks' questions several to a conversation, one
after another as `python -m minigpt chat` does, and scores each answer by its turn, beside
the same questions asked alone: a conversation's later turns are read in a context that
holds the earlier ones, or what is left of them, which `exact_match` never shows a model.

`benchmark_table` runs everything on a list of named models; `edit_distance` says how near
a wrong answer is, and `longest_repeat` how far a text repeats itself.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minigpt.config import check_positive
from minigpt.data import split_text
from minigpt.losses import bits_per_character
from minigpt.model import GPT, eval_mode
from minigpt.posttrain.chat import Turn, answer_turn, fit_context, greedy_replies, prompt_ids
from minigpt.posttrain.dpo import sequence_logprobs
from minigpt.posttrain.tasks import Task, exact_match
from minigpt.tokenizer import CHAT_TOKENS, Tokenizer

CHANCE = 0.25


@dataclass(frozen=True)
class Choice:
    """A context and four endings, of which ``endings[label]`` is the true next line."""

    context: str
    endings: tuple[str, ...]
    label: int


def speech_lines(text: str) -> list[list[str]]:
    """The spoken lines of each speech of ``text`` (a speech is a block after a
    ``Speaker:`` line; blocks are separated by a blank line), without empty lines."""
    speeches = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n")[1:] if line.strip()]
        if len(lines) >= 2:
            speeches.append(lines)
    return speeches


def make_choices(text: str, n: int, *, seed: int = 0, max_chars: int = 40,
                 length_slack: int = 3) -> list[Choice]:
    """``n`` multiple-choice items from ``text`` (held-out text).

    Each item is a line of a speech cut in two at its middle character (`_cut`): the
    context is the speech's previous line and the line's first half, the true ending its
    second half and newline; the three distractors are
    second halves of other lines of ``text`` whose length differs from the true ending's
    by at most ``length_slack`` characters (so length alone does not give the answer
    away). The ending has at most ``max_chars`` characters, so that it and the end of its
    context fit the book model's window of 64; the true ending's place is drawn with
    ``seed``, as are the items.
    """
    halves = [(before + "\n" + head, tail) for lines in speech_lines(text)
              for before, line in zip(lines, lines[1:], strict=False)
              for head, tail in [_cut(line)] if 0 < len(tail) <= max_chars]
    if not 1 <= n <= len(halves):
        raise ValueError(f"n must lie in [1, {len(halves)}] (the lines of the text that cut "
                         f"into a context and an ending of at most {max_chars} characters), "
                         f"got {n}")
    by_length: dict[int, list[str]] = {}
    for tail in sorted({tail for _, tail in halves}):
        by_length.setdefault(len(tail), []).append(tail)
    rng = random.Random(seed)
    items = []
    for context, true in rng.sample(halves, n):
        pool = [t for k in range(len(true) - length_slack, len(true) + length_slack + 1)
                for t in by_length.get(k, []) if t != true]
        if len(pool) < 3:
            raise ValueError(f"fewer than 3 distractors of about {len(true)} characters")
        endings = rng.sample(pool, 3)
        label = rng.randrange(4)
        endings.insert(label, true)
        items.append(Choice(context, tuple(endings), label))
    return items


def _cut(line: str) -> tuple[str, str]:
    """A line cut at its middle character: (head, tail + newline). The cut falls inside a
    word as often as not, so the true ending must also finish the word it starts in."""
    k = len(line) // 2
    return line[:k], line[k:] + "\n"


# A scorer gives the log-likelihood (nats) of each ending after its context.
Scorer = Callable[[Sequence[tuple[str, str]]], list[float]]


def model_scorer(model: GPT, tokenizer: Tokenizer, *, batch_size: int = 64) -> Scorer:
    """A GPT's scorer: log p(ending | context), the sum over the ending's tokens (a context
    longer than fits is cut from the left)."""
    T = model.config.context_length

    @torch.no_grad()
    def score(items: Sequence[tuple[str, str]]) -> list[float]:
        rows = []
        for context, ending in items:
            end = tokenizer.encode_ordinary(ending)
            if len(end) >= T:
                raise ValueError(f"an ending of {len(end)} tokens leaves no room for its "
                                 f"context in the model's {T}")
            ids = (tokenizer.encode_ordinary(context) + end)[-(T + 1):]
            rows.append((ids, len(end)))
        out: list[float] = []
        with eval_mode(model):
            for k in range(0, len(rows), batch_size):
                out += _score_rows(model, rows[k:k + batch_size])
        return out

    return score


def _score_rows(model: GPT, rows: Sequence[tuple[list[int], int]]) -> list[float]:
    length = max(len(ids) for ids, _ in rows)
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for r, (seq, n_end) in enumerate(rows):
        ids[r, :len(seq)] = torch.tensor(seq)
        mask[r, len(seq) - n_end:len(seq)] = True
    device = next(model.parameters()).device
    x, y, m = ids[:, :-1].to(device), ids[:, 1:].to(device), mask[:, 1:].to(device)
    return [float(v) for v in sequence_logprobs(model, x, y, m).tolist()]


class CountModel:
    """A character n-gram model (n = 1 unigram, n = 2 bigram) of a text, with add-one
    smoothing over the text's characters (an unseen character gets one count too)."""

    def __init__(self, text: str, order: int) -> None:
        if order not in (1, 2):
            raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {order!r}")
        self.order = order
        self.vocab = len(set(text)) + 1  # + 1: every unseen character, as one
        self.counts = Counter(text[max(0, i - order + 1):i + 1] for i in range(len(text)))
        self.context_counts = Counter(text[max(0, i - order + 1):i] for i in range(len(text)))

    def logprob(self, previous: str, char: str) -> float:
        """log p(char | the last order - 1 characters of previous)."""
        key = previous[len(previous) - self.order + 1:] if self.order > 1 else ""
        return math.log((self.counts[key + char] + 1) / (self.context_counts[key] + self.vocab))

    def score(self, items: Sequence[tuple[str, str]]) -> list[float]:
        """log p(ending | context) for each item: the sum over the ending's characters."""
        return [sum(self.logprob(context + ending[:i], c) for i, c in enumerate(ending))
                for context, ending in items]

    def bits_per_character(self, text: str) -> float:
        """The mean of -log2 p over ``text``'s characters after the first."""
        nats = -sum(self.logprob(text[i - 1], text[i]) for i in range(1, len(text)))
        return nats / (len(text) - 1) / math.log(2)


def multiple_choice(score: Scorer, items: Sequence[Choice]) -> dict[str, float]:
    """Accuracy when the highest summed log-likelihood picks the ending (``"summed"``) and
    when the highest log-likelihood per character does (``"per_char"``)."""
    flat = score([(c.context, e) for c in items for e in c.endings])
    right = {"summed": 0, "per_char": 0}
    for k, choice in enumerate(items):
        ll = flat[4 * k:4 * k + 4]
        per_char = [v / len(e) for v, e in zip(ll, choice.endings, strict=True)]
        right["summed"] += int(np.argmax(ll)) == choice.label
        right["per_char"] += int(np.argmax(per_char)) == choice.label
    return {name: n / len(items) for name, n in right.items()}


# ------------------------------------------------------------ exact match turn by turn

@dataclass(frozen=True)
class TurnMatch:
    """Exact match by turn (`exact_match_by_turn`); entry k of each tuple is about the
    conversations' (k + 1)-th question.

    Attributes:
        by_turn: the fraction answered exactly right, asked in the conversation.
        single_turn: the fraction of the same questions answered exactly right, each asked
            alone (`minigpt.posttrain.tasks.exact_match`).
        dropped: the mean number of earlier turns (questions and answers) that no longer
            fit the context when the question was asked (`minigpt.posttrain.chat.fit_context`).
        conversations: every conversation whole, question, answer, question, ...
    """

    by_turn: tuple[float, ...]
    single_turn: tuple[float, ...]
    dropped: tuple[float, ...]
    conversations: tuple[tuple[Turn, ...], ...]


def edit_distance(a: str, b: str) -> int:
    """Letters inserted, deleted or replaced to turn ``a`` into ``b`` (Levenshtein's
    distance): how near a wrong answer is to the right one. One row of the table at a time:
    ``row[j]`` is the distance from the first letters of ``a`` read so far to ``b[:j]``."""
    row = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1,
                                           diagonal + (char != other))
    return row[-1]


def longest_repeat(text: str) -> int:
    """The length of the longest stretch of characters that occurs twice in ``text`` (the two
    may overlap): how far a decoder that settles on a phrase repeats it."""
    return max((n for n in range(1, len(text)) for i in range(len(text) - n)
                if text.find(text[i:i + n], i + 1) != -1), default=0)


def exact_match_by_turn(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task], *,
                        n_turns: int = 4, seed: int = 0, max_new_tokens: int = 32,
                        ) -> TurnMatch:
    """Exact match at turn 1, 2, ..., ``n_turns`` of conversations made of ``tasks``.

    The tasks are shuffled with ``seed`` and cut into ``len(tasks) // n_turns`` conversations
    of ``n_turns`` questions (the few left over are not asked). Each question is asked as the
    chat command asks it (`minigpt.posttrain.chat.chat_loop`): after the conversation so far,
    less its oldest turns if it has outgrown the context (`fit_context`), answered greedily in
    at most ``max_new_tokens`` tokens (`answer_turn`). Turn 1 is a question asked alone; its
    score is the single-turn one, but for an answer holding a chat token before its end, which
    the chat command cuts off.
    """
    check_positive("n_turns", n_turns)
    if len(tasks) < n_turns:
        raise ValueError(f"a conversation of {n_turns} turns needs at least {n_turns} tasks, "
                         f"got {len(tasks)}")
    shuffled = random.Random(seed).sample(list(tasks), len(tasks))
    groups = [shuffled[k:k + n_turns] for k in range(0, len(shuffled) - n_turns + 1, n_turns)]
    T = model.config.context_length
    right = np.zeros((len(groups), n_turns))
    alone = np.zeros((len(groups), n_turns))
    dropped = np.zeros((len(groups), n_turns))
    conversations = []
    # Asked alone: all at once, as `exact_match` asks them (prompts of a length together).
    singles = greedy_replies(model, tokenizer, [prompt_ids([Turn("user", t.question)],
                                                           tokenizer) for t in shuffled],
                             max_new_tokens=max_new_tokens)
    for c, group in enumerate(groups):
        turns: list[Turn] = []  # what the chat keeps: the conversation, less what was dropped
        whole: list[Turn] = []
        for k, task in enumerate(group):
            question = Turn("user", task.question)
            kept = fit_context([*turns, question], tokenizer, T, room=max_new_tokens)
            answer = answer_turn(model, tokenizer, kept, max_new_tokens=max_new_tokens)
            turns = [*kept, answer]
            whole += [question, answer]
            dropped[c, k] = 2 * k + 1 - len(kept)
            right[c, k] = answer.text == task.answer
            alone[c, k] = singles[c * n_turns + k] == task.answer
        conversations.append(tuple(whole))
    return TurnMatch(tuple(right.mean(0).tolist()), tuple(alone.mean(0).tolist()),
                     tuple(dropped.mean(0).tolist()), tuple(conversations))


# --------------------------------------------------------------------------- the table

def benchmark_table(models: Mapping[str, tuple[GPT, Tokenizer]], text: str, *,
                    n_items: int = 1000, seed: int = 0, train_fraction: float = 0.9,
                    bpc_chars: int = 20_000, tasks: Sequence[Task] = (),
                    shots: Sequence[Task] = ()) -> list[dict[str, Any]]:
    """One row per model, after rows for chance and the unigram and bigram baselines.

    ``text`` is split as the book model's data is (`split_text`): the baselines count the
    first part; the multiple-choice items (``n_items``, `make_choices` with ``seed``) and
    bits per character (on the held-out part's first ``bpc_chars`` characters, with
    `minigpt.losses.bits_per_character`) come from the held-out part. With ``tasks``, each
    model's exact match per family (`minigpt.posttrain.tasks.exact_match`): in the chat format for a
    model whose tokenizer has the chat tokens, else few-shot from ``shots``.
    Columns: model, mc_summed, mc_per_char, bpc, and em_<family> (None where not defined).
    """
    seen, held_out = split_text(text, train_fraction)
    items = make_choices(held_out, n_items, seed=seed)
    sample = held_out[:bpc_chars]
    families = sorted({t.family for t in tasks})
    blank = {f"em_{f}": None for f in families}
    rows: list[dict[str, Any]] = [{"model": "chance", "mc_summed": CHANCE,
                                   "mc_per_char": CHANCE, "bpc": None} | blank]
    for name, order in (("unigram", 1), ("bigram", 2)):
        counts = CountModel(seen, order)
        mc = multiple_choice(counts.score, items)
        rows.append({"model": name, "mc_summed": mc["summed"], "mc_per_char": mc["per_char"],
                     "bpc": counts.bits_per_character(sample)} | blank)
    for name, (model, tokenizer) in models.items():
        mc = multiple_choice(model_scorer(model, tokenizer), items)
        ids = np.asarray(tokenizer.encode_ordinary(sample), dtype=np.int64)
        row = {"model": name, "mc_summed": mc["summed"], "mc_per_char": mc["per_char"],
               "bpc": bits_per_character(model, ids, tokenizer)}
        if tasks:
            chat = all(t in tokenizer.special_tokens for t in CHAT_TOKENS)
            em = exact_match(model, tokenizer, tasks, shots=None if chat else shots)
            row |= {f"em_{f}": em.get(f) for f in families}
        rows.append(row | ({} if tasks else blank))
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a plain-text table: fractions and bits to three decimals, "-" for
    None."""
    columns = list(rows[0])
    cells = [[c for c in columns]] + [
        [("-" if r[c] is None else f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
         for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
                     for row in cells)
