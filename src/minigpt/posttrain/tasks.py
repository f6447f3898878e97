"""Instruction data with verifiable answers, made offline from the corpus's lines.

Each task is a question about a line of the plays, or about one of its words, whose answer a
program can check: the line's first or last word, a word reversed, in capitals, its number
of letters (spelled out, as the book's alphabet has few digits): skills that the book's
model learns from a few thousand examples in CPU minutes. No task asks for what a model
would have to remember of the plays: knowledge does not come so cheap (asked for the word
that ends a held-out line, a fine-tuned model was right about one time in a hundred).

`make_tasks` draws them, deterministically given a seed, into a training split and a
held-out split that share no source line, and no word that a word task asks about
(`check_split` asserts it); `conversations` groups tasks into conversations of several
unrelated questions, which fine-tuning reads. `exact_match` scores a model on them: greedy
answers, compared with the right ones, per task family.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minigpt.config import check_positive
from minigpt.model import GPT
from minigpt.posttrain.chat import Turn, greedy_replies, prompt_ids
from minigpt.tokenizer import Tokenizer

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
           "ten")
_PUNCTUATION = ".,;:!?"
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Task:
    """One question and its answer; ``source`` is the corpus line it was made from and
    ``word`` the word a word task asks about ("" for the line tasks)."""

    family: str
    question: str
    answer: str
    source: str
    word: str = ""

    def conversation(self) -> list[Turn]:
        """The task as a conversation: the question, then the answer."""
        return [Turn("user", self.question), Turn("assistant", self.answer)]


def conversations(tasks: Sequence[Task], max_turns: int, *, seed: int = 0,
                  ) -> list[list[Turn]]:
    """``tasks`` asked in conversations of 1 to ``max_turns`` questions each: shuffled with
    ``seed`` and cut into consecutive groups whose sizes are drawn uniformly from 1 to
    ``max_turns``; every task is asked once, and a conversation's questions are unrelated,
    so that each answer depends on its own question only, however many turns precede it."""
    check_positive("max_turns", max_turns)
    if not tasks:
        raise ValueError("conversations needs at least one task")
    rng = random.Random(seed)
    shuffled = rng.sample(list(tasks), len(tasks))
    groups: list[list[Turn]] = []
    start = 0
    while start < len(shuffled):
        size = rng.randint(1, max_turns)
        groups.append([turn for task in shuffled[start:start + size]
                       for turn in task.conversation()])
        start += size
    return groups


# A family maps (line, its words, the word chosen for a word task) to (question, answer).
Family = Callable[[str, list[str], str], tuple[str, str]]
LINE_FAMILIES: dict[str, Family] = {
    "first_word": lambda line, words, _: (f"first word: {line}", words[0]),
    "last_word": lambda line, words, _: (f"last word: {line}", words[-1]),
}
WORD_FAMILIES: dict[str, Family] = {
    "reverse": lambda line, words, w: (f"reverse: {w}", w[::-1]),
    "upper": lambda line, words, w: (f"upper: {w}", w.upper()),
    "length": lambda line, words, w: (f"letters in: {w}", NUMBERS[len(w)]),
}
FAMILIES: dict[str, Family] = LINE_FAMILIES | WORD_FAMILIES


def line_words(line: str) -> list[str] | None:
    """The words of a line, if every space-separated piece is letters with at most some
    punctuation after it (so that "first word" has one right answer); else None."""
    words = []
    for piece in line.split(" "):
        word = piece.rstrip(_PUNCTUATION)
        if not _WORD.fullmatch(word):
            return None
        words.append(word)
    return words


def source_lines(text: str, *, min_words: int = 3, max_chars: int = 36,
                 max_word: int = 10) -> list[str]:
    """The distinct spoken lines of ``text`` (not the `Speaker:` lines) of at least
    ``min_words`` words of at most ``max_word`` letters and at most ``max_chars``
    characters, whose words `line_words` accepts, in the order they first appear. (A task
    and its answer then fit in the book model's context of 64 characters.)"""
    seen: dict[str, None] = {}
    for speech in text.split("\n\n"):
        for line in speech.split("\n")[1:]:  # the first line names the speaker
            words = line_words(line)
            if (words and len(words) >= min_words and len(line) <= max_chars
                    and max(map(len, words)) <= max_word):
                seen.setdefault(line, None)
    return list(seen)


@dataclass(frozen=True)
class TaskSplit:
    train: list[Task]
    test: list[Task]


def _split(items: Sequence[str], test_fraction: float, rng: random.Random,
           ) -> tuple[list[str], list[str]]:
    shuffled = list(items)
    rng.shuffle(shuffled)
    n_test = round(len(shuffled) * test_fraction)
    return shuffled[n_test:], shuffled[:n_test]


def _draw(family: str, lines: list[str], words: set[str], n: int,
          rng: random.Random) -> list[Task]:
    """``n`` tasks of one family from ``lines`` (word tasks: about a word of ``words``)."""
    make = FAMILIES[family]
    tasks: list[Task] = []
    for line in rng.sample(lines, len(lines)):
        ws = line_words(line) or []
        word = ""
        if family in WORD_FAMILIES:
            choices = sorted({w.lower() for w in ws} & words)
            if not choices:
                continue
            word = rng.choice(choices)
        question, answer = make(line, ws, word)
        tasks.append(Task(family, question, answer, line, word))
        if len(tasks) == n:
            return tasks
    raise ValueError(f"only {len(tasks)} {family} tasks can be made from {len(lines)} lines; "
                     f"asked for {n}")


def make_tasks(text: str, n_train: int, n_test: int, *, seed: int = 0,
               families: Sequence[str] = tuple(FAMILIES), test_fraction: float = 0.2,
               ) -> TaskSplit:
    """``n_train`` training and ``n_test`` held-out tasks of each family, from ``text``.

    The distinct source lines (`source_lines`) are shuffled with ``seed`` and a
    ``test_fraction`` of them is held out; so is a fraction of the distinct words of 3 to 8
    letters that word tasks ask about (lower-cased). Each split's tasks come from its own
    lines and words only, so a held-out question is about a line, or word, never trained on.
    """
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"unknown task families {unknown}; choose from {sorted(FAMILIES)}")
    for name, n in (("n_train", n_train), ("n_test", n_test)):
        check_positive(name, n)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    rng = random.Random(seed)
    lines = source_lines(text)
    vocabulary = sorted({w.lower() for line in lines for w in line_words(line) or []
                         if 3 <= len(w) <= 8})
    train_lines, test_lines = _split(lines, test_fraction, rng)
    train_words, test_words = _split(vocabulary, test_fraction, rng)
    train = [t for f in families
             for t in _draw(f, train_lines, set(train_words), n_train, rng)]
    test = [t for f in families for t in _draw(f, test_lines, set(test_words), n_test, rng)]
    check_split(train, test)
    return TaskSplit(train, test)


def check_split(train: Sequence[Task], test: Sequence[Task]) -> None:
    """Refuse a held-out split that shares a source line, or an asked-about word, with the
    training split."""
    lines = {t.source for t in train} & {t.source for t in test}
    if lines:
        raise ValueError(f"{len(lines)} source lines are in both splits, e.g. "
                         f"{sorted(lines)[0]!r}; a held-out task must come from an unseen line")
    words = {t.word for t in train if t.word} & {t.word for t in test if t.word}
    if words:
        raise ValueError(f"{len(words)} asked-about words are in both splits, e.g. "
                         f"{sorted(words)[0]!r}; a held-out word task must ask about an "
                         "unseen word")


# ------------------------------------------------------------------------- evaluation

def few_shot_prompt(task: Task, shots: Sequence[Task], tokenizer: Tokenizer,
                    room: int) -> list[int]:
    """A base model's prompt in plain text: solved examples of the task's family, then the
    question, each as ``question\\nanswer\\n\\n``; as many of ``shots`` as leave ``room``
    tokens for the answer in the model's context (``room`` counts the context's size)."""
    query = tokenizer.encode_ordinary(f"{task.question}\n")
    ids = query
    for shot in shots:
        longer = tokenizer.encode_ordinary(f"{shot.question}\n{shot.answer}\n\n") + ids
        if len(longer) > room:
            break
        ids = longer
    return ids


def exact_match(model: GPT, tokenizer: Tokenizer, tasks: Sequence[Task], *,
                shots: Sequence[Task] | None = None, max_new_tokens: int = 12,
                ) -> dict[str, float]:
    """The fraction of ``tasks`` of each family whose greedy answer is exactly right.

    Without ``shots``: in the chat format (the model needs the chat tokens). With
    ``shots``: a base model, prompted in plain text with solved tasks of the same family
    from ``shots``, distinct questions in their order (`few_shot_prompt`), its answer read
    up to the first newline.
    """
    T = model.config.context_length
    if shots is None:
        prompts = [prompt_ids(t.conversation()[:1], tokenizer) for t in tasks]
        answers = greedy_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    else:
        by_family: dict[str, dict[str, Task]] = {}  # distinct questions, first kept
        for shot in shots:
            by_family.setdefault(shot.family, {}).setdefault(shot.question, shot)
        prompts = [few_shot_prompt(t, list(by_family.get(t.family, {}).values()), tokenizer,
                                   T - max_new_tokens) for t in tasks]
        answers = greedy_replies(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                 stop=tokenizer.encode_ordinary("\n")[0])
    scores: dict[str, list[bool]] = {}
    for task, answer in zip(tasks, answers, strict=True):
        scores.setdefault(task.family, []).append(answer == task.answer)
    return {f: sum(s) / len(s) for f, s in sorted(scores.items())}
