"""Rhymes: a task family with many right answers, for the chapter on learning from rewards.

The families of `minigpt.posttrain.tasks` each have one right answer, which supervised fine-tuning
can copy. Here a question, ``rhymes with: x``, has many: a word of the vocabulary V, other
than x, that ends with the same three letters as x. This is a *spelling* rhyme (``love``
and ``glove`` rhyme, and so do ``love`` and ``prove``, which are not heard as one), chosen
because a program can check it from the letters alone. A checker's verdict is then the
whole reward, which is what the rewards chapter needs to compare learning from a reward
(GRPO, rejection sampling) with learning from one answer to copy (SFT).

* `vocabulary`: V, the lower-cased letters-only words of a text's spoken lines, 3 to 10
  letters, seen at least 3 times (the chapter passes the training split of the corpus).
* `right_answers`: the right answers to a word, most frequent first.
* `asked_words`, `split_words`: the words asked about (4 to 8 letters, in V, with at least
  3 rhymes in V), split into training and held-out words as `minigpt.posttrain.tasks` splits words.
* `rhymes_tasks`, `make_rhymes`: `Task`\\ s of the family ``"rhymes"`` whose answer is one
  right answer, drawn at random or the corpus's most frequent (a teacher who knows the
  corpus), so that SFT can be trained on either.
* `is_right`, `is_right_leaky`, `checker`, `scorer`: the checker, a *leaky* checker that
  forgets to ask whether the answer is a word at all (so that a stuttered ending such as
  ``ororor`` passes for ``terror``: a reward to hack), and the rewards of a batch of
  answers from either, as `minigpt.posttrain.rl.score` gives them for exact match.
* `supervised_steps`, `cold_start`: a short supervised run on tasks with a share of older
  families replayed, and the cold start that learning from rewards continues from (SFT
  on random right answers, half replay).
"""

from __future__ import annotations

import copy
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from minigpt.config import check_int, check_positive, stream_seed
from minigpt.data import split_text
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.posttrain.rl import Reward, score
from minigpt.posttrain.sft import encode_tasks
from minigpt.posttrain.tasks import Task, TaskSplit, check_split
from minigpt.tokenizer import Tokenizer
from minigpt.train import train_step

FAMILY = "rhymes"
#: How many final letters two words share to rhyme.
RHYME_LETTERS = 3
Teacher = Literal["random", "frequent"]
#: A checker: is ``answer`` right for ``task``?
Checker = Callable[[str, Task], bool]

_PIECE = re.compile(r"[\s-]+")  # a hyphen joins two words: "self-same" is "self", "same"
# A piece is a word if it is letters once the punctuation at its edges is gone; an
# apostrophe is not punctuation here ("o'er", "'tis", "honour'd" are not letters-only).
_LETTERS = re.compile(r"[^A-Za-z']*([A-Za-z]+)[^A-Za-z']*")
_WORD = re.compile(r"[a-z]+")


def spoken_words(text: str) -> list[str]:
    """The lower-cased letters-only words of ``text``'s spoken lines, in order.

    A speech is a block of lines after its ``Speaker:`` line (blocks are separated by a
    blank line, `minigpt.data.play_to_text`'s shape), so speakers' names are not read;
    stage directions are already gone from the corpus. Lines are cut at spaces and
    hyphens; a piece counts if it is letters once the punctuation at its ends is
    stripped, and is dropped if it holds anything else (an apostrophe, a digit)."""
    words = []
    for speech in text.split("\n\n"):
        for line in speech.split("\n")[1:]:  # the first line names the speaker
            for piece in _PIECE.split(line):
                if found := _LETTERS.fullmatch(piece):
                    words.append(found[1].lower())
    return words


class Vocabulary:
    """V: words, each with the times it was seen, indexed by their last letters.

    Args:
        counts: word -> count; words lower-case letters of at least `RHYME_LETTERS`
            letters, counts ints >= 1.
    """

    def __init__(self, counts: Mapping[str, int]) -> None:
        for word, n in counts.items():
            if not (isinstance(word, str) and _WORD.fullmatch(word)
                    and len(word) >= RHYME_LETTERS):
                raise ValueError(f"a vocabulary's words are lower-case letters, at least "
                                 f"{RHYME_LETTERS} of them; got {word!r}")
            check_positive(f"the count of {word!r}", n)
        self.counts: dict[str, int] = dict(sorted(counts.items()))
        by_ending: dict[str, list[str]] = {}
        for word in self.counts:
            by_ending.setdefault(word[-RHYME_LETTERS:], []).append(word)
        # Most frequent first, ties in alphabetical order: the frequent teacher's choice
        # is then the first one.
        self._by_ending = {end: sorted(ws, key=lambda w: (-self.counts[w], w))
                           for end, ws in by_ending.items()}

    def __len__(self) -> int:
        return len(self.counts)

    def __contains__(self, word: object) -> bool:
        return word in self.counts

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)

    def ending(self, end: str) -> list[str]:
        """The words that end with the letters ``end`` (`RHYME_LETTERS` of them), most
        frequent first."""
        return list(self._by_ending.get(end, ()))


def vocabulary(text: str, *, min_count: int = 3, min_letters: int = 3,
               max_letters: int = 10) -> Vocabulary:
    """V: the `spoken_words` of ``text`` of ``min_letters`` to ``max_letters`` letters seen
    at least ``min_count`` times, each with its count."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    for name, value, low in (("min_count", min_count, 1),
                             ("min_letters", min_letters, RHYME_LETTERS),
                             ("max_letters", max_letters, min_letters)):
        check_int(name, value, low)
    counts = Counter(w for w in spoken_words(text) if min_letters <= len(w) <= max_letters)
    return Vocabulary({w: n for w, n in counts.items() if n >= min_count})


def right_answers(word: str, vocab: Vocabulary) -> list[str]:
    """The right answers to ``rhymes with: word``: the words of ``vocab`` other than
    ``word`` that end with its last `RHYME_LETTERS` letters, most frequent first (ties in
    alphabetical order). ``word`` itself need not be in ``vocab``."""
    if not (isinstance(word, str) and _WORD.fullmatch(word) and len(word) >= RHYME_LETTERS):
        raise ValueError(f"a word to rhyme with is lower-case letters, at least "
                         f"{RHYME_LETTERS} of them; got {word!r}")
    return [w for w in vocab.ending(word[-RHYME_LETTERS:]) if w != word]


def asked_words(vocab: Vocabulary, *, min_letters: int = 4, max_letters: int = 8,
                min_rhymes: int = 3) -> list[str]:
    """The words a ``rhymes with:`` question may ask about, in alphabetical order: the words
    of ``vocab`` of ``min_letters`` to ``max_letters`` letters with at least ``min_rhymes``
    right answers in ``vocab``."""
    return [w for w in vocab.counts if min_letters <= len(w) <= max_letters
            and len(vocab.ending(w[-RHYME_LETTERS:])) - 1 >= min_rhymes]


def split_words(words: Sequence[str], *, seed: int, test_fraction: float = 0.2,
                ) -> tuple[list[str], list[str]]:
    """(training words, held-out words): the distinct ``words``, sorted, shuffled with
    ``seed`` and a ``test_fraction`` of them (rounded) held out, as
    `minigpt.posttrain.tasks.make_tasks` splits the words its tasks ask about."""
    return _split(words, test_fraction, random.Random(seed))


def _split(words: Sequence[str], test_fraction: float, rng: random.Random,
           ) -> tuple[list[str], list[str]]:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    shuffled = sorted(set(words))
    rng.shuffle(shuffled)
    n_test = round(len(shuffled) * test_fraction)
    return shuffled[n_test:], shuffled[:n_test]


def question(word: str) -> str:
    """The question that asks for a rhyme of ``word``."""
    return f"rhymes with: {word}"


def _check_teacher(teacher: str) -> None:
    if teacher not in ("random", "frequent"):
        raise ValueError(f"teacher must be 'random' or 'frequent', got {teacher!r}")


def rhymes_tasks(words: Sequence[str], vocab: Vocabulary, *, teacher: Teacher = "random",
                 rng: random.Random | None = None) -> list[Task]:
    """One task per word of ``words``, in their order: ``rhymes with: x``, answered with one
    of x's `right_answers`, drawn uniformly with ``rng`` (``teacher="random"``) or the most
    frequent in ``vocab`` (``"frequent"``, ties in alphabetical order). The task's
    ``word`` is x, and so is its ``source``: it is made from the word alone (and so
    `minigpt.posttrain.tasks.check_split` refuses a word asked in both splits twice over)."""
    _check_teacher(teacher)
    if teacher == "random" and rng is None:
        raise ValueError("teacher='random' draws the answers: give rng, a seeded "
                         "random.Random")
    tasks = []
    for word in words:
        answers = right_answers(word, vocab)
        if not answers:
            raise ValueError(f"{word!r} has no rhyme in the vocabulary: ask about words "
                             "from asked_words")
        if teacher == "frequent":
            answer = answers[0]
        else:
            assert rng is not None
            answer = rng.choice(answers)
        tasks.append(Task(FAMILY, question(word), answer, word, word))
    return tasks


def make_rhymes(text: str, *, seed: int = 0, teacher: Teacher = "random",
                test_fraction: float = 0.2, train_fraction: float = 0.9,
                ) -> tuple[Vocabulary, TaskSplit]:
    """V and one rhymes task per asked word, split into training and held-out tasks.

    V is the `vocabulary` of the first ``train_fraction`` of ``text`` (`split_text`, the
    part the book's models trained on); the `asked_words` are split with ``seed``
    (`split_words`), and with ``"random"`` answers the same generator then draws them, so
    that the split is the same for either ``teacher``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    _check_teacher(teacher)
    if not 0.0 < test_fraction < 1.0:  # before V is built, a second's work
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    vocab = vocabulary(split_text(text, train_fraction)[0])
    rng = random.Random(seed)
    train_words, test_words = _split(asked_words(vocab), test_fraction, rng)
    train = rhymes_tasks(train_words, vocab, teacher=teacher, rng=rng)
    test = rhymes_tasks(test_words, vocab, teacher=teacher, rng=rng)
    check_split(train, test)
    return vocab, TaskSplit(train, test)


# ----------------------------------------------------------------------- the checkers

def _asked(task: Task) -> str:
    if task.family != FAMILY:
        raise ValueError(f"a rhymes checker checks {FAMILY!r} tasks, got a {task.family!r} "
                         f"task ({task.question!r})")
    return task.word


def is_right(answer: str, task: Task, vocab: Vocabulary) -> bool:
    """Is ``answer`` right for the rhymes ``task``: a word of ``vocab``, not the word asked
    about, ending with its last `RHYME_LETTERS` letters (a spelling rhyme)?"""
    word = _asked(task)
    return answer in vocab and answer != word and answer.endswith(word[-RHYME_LETTERS:])


def is_right_leaky(answer: str, task: Task) -> bool:
    """`is_right` without "a word of the vocabulary": any text other than the word asked
    about that ends with its last `RHYME_LETTERS` letters. A leaky reward: ``ororor``
    passes for ``terror``, and ``hor`` alone for ``metaphor``."""
    word = _asked(task)
    return answer != word and answer.endswith(word[-RHYME_LETTERS:])


def checker(vocab: Vocabulary | None) -> Checker:
    """The checker of answers to rhymes tasks: `is_right` with ``vocab``, or the leaky
    `is_right_leaky` for None."""
    if vocab is None:
        return is_right_leaky
    if not isinstance(vocab, Vocabulary):
        raise TypeError(f"vocab must be a Vocabulary (or None for the leaky checker), got "
                        f"{type(vocab).__name__}")
    return partial(is_right, vocab=vocab)


def scorer(check: Checker) -> Reward:
    """The rewards of answers to tasks, as `minigpt.posttrain.rl.score` gives them: (N,) float32, 1
    for a right answer and 0 for a wrong one. A rhymes task's answer is judged by
    ``check``; any other family's by exact match (`minigpt.posttrain.rl.score`), so that one batch
    may mix rhymes with the older families."""

    def reward(answers: Sequence[str], tasks: Sequence[Task]) -> Tensor:
        if len(answers) != len(tasks):
            raise ValueError(f"{len(answers)} answers for {len(tasks)} tasks: give one "
                             "answer per task")
        rhymes = [t.family == FAMILY for t in tasks]
        checked = torch.tensor([float(r and check(a, t))
                                for a, t, r in zip(answers, tasks, rhymes, strict=True)])
        return torch.where(torch.tensor(rhymes, dtype=torch.bool), checked,
                           score(answers, tasks))

    return reward


# ------------------------------------------------------------------ supervised steps

class SFTSettings(BaseModel):
    """A short supervised run on tasks (`supervised_steps`), validated where given.

    Attributes:
        steps: optimiser steps, >= 1. lr: AdamW's constant rate, > 0 (no weight decay).
        batch_size: conversations a step, >= 1.
        replay_fraction: the share of each batch drawn from the replayed tasks, in
            [0, 1): round(batch_size * replay_fraction) conversations.
        seed: the seed of the batches' draws. grad_clip: the gradient's largest norm (0:
            not clipped).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(ge=1)
    lr: float = Field(gt=0.0, allow_inf_nan=False)
    batch_size: int = Field(default=8, ge=1)
    replay_fraction: float = Field(default=0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)


#: The cold start: SFT of a chat model on random right answers, half of each batch
#: replaying the older families (its seconds are in the cold start's manifest).
COLD_START = SFTSettings(steps=1500, lr=6e-4, batch_size=8, replay_fraction=0.5, seed=0)


def supervised_steps(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task],
                     settings: SFTSettings, *, replay: Sequence[Task] = (),
                     ) -> dict[str, list[float]]:
    """``settings.steps`` steps of supervised fine-tuning of the chat model ``model``, in
    place, on ``tasks`` with a share of ``replay`` in every batch; returns the history:
    each step's ``loss`` and ``tokens_trained``, the positions its forward and backward
    passes read (the batch's B rows, padded to the longest).

    Each task is one exchange, question then answer, masked to the answer
    (`minigpt.posttrain.sft.encode_tasks`); each step draws round(B * replay_fraction) of the B
    conversations uniformly from ``replay`` and the others from ``tasks`` (with
    replacement, seeded), and takes one `minigpt.train.train_step` (the masked
    cross-entropy) with AdamW at a constant rate and no weight decay
    (`minigpt.optim.configure_optimizer`). The model trains in train mode and is given back
    in the mode it was in.
    """
    if not tasks:
        raise ValueError("supervised_steps needs at least one task")
    B, share = settings.batch_size, round(settings.batch_size * settings.replay_fraction)
    if share and not replay:
        raise ValueError(f"replay_fraction {settings.replay_fraction} replays "
                         f"{share} of {B} conversations a step: give the replay tasks")
    data = encode_tasks([*tasks, *replay], tokenizer)
    data.check_context_length(model.config.context_length)
    device = next(model.parameters()).device
    optimizer = configure_optimizer(model, lr=settings.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(stream_seed(settings.seed, "batches"))
    losses, tokens = [], []
    was_training = model.training
    model.train()
    for _ in range(settings.steps):
        rows = torch.randint(0, len(tasks), (B - share,), generator=generator).tolist()
        rows += (len(tasks) + torch.randint(0, max(len(replay), 1), (share,),
                                            generator=generator)).tolist()
        batch = data.batch(rows).to(device)
        result = train_step(model, optimizer, [batch], grad_clip=settings.grad_clip)
        losses.append(result.loss)  # read after the loop: no wait on every step
        tokens.append(float(batch.x.numel()))
    model.train(was_training)
    return {"loss": torch.stack(losses).tolist(), "tokens_trained": tokens}


def cold_start(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task],
               replay: Sequence[Task], settings: SFTSettings = COLD_START,
               ) -> tuple[GPT, dict[str, list[float]]]:
    """A copy of the chat model ``model`` that answers rhymes questions sometimes: SFT on
    rhymes ``tasks`` (random right answers, `make_rhymes`'s default teacher) with
    ``replay``, tasks of the older families, in every batch (`supervised_steps`; by
    default `COLD_START`: half of each batch), so that it does not forget them. Learning
    from rewards needs such a start, as R1 did (DeepSeek-AI, 2025): a model that never
    samples a right answer earns no reward to learn from. Returns the copy, in eval mode,
    and its history (`supervised_steps`); ``model`` is not changed."""
    start = copy.deepcopy(model)
    history = supervised_steps(start, tokenizer, tasks, settings, replay=replay)
    return start.eval(), history
