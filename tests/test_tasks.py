"""minigpt.posttrain.tasks: verifiable tasks from the corpus, a held-out split, exact match."""

from __future__ import annotations

import pytest
import torch

from minigpt import GPT, GPTConfig
from minigpt.data import shakespeare_text
from minigpt.posttrain.chat import add_chat_tokens
from minigpt.posttrain.tasks import (
    FAMILIES,
    NUMBERS,
    Task,
    TaskSplit,
    check_split,
    exact_match,
    few_shot_prompt,
    line_words,
    make_tasks,
    source_lines,
)
from minigpt.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text(["macbeth", "hamlet"])


@pytest.fixture(scope="module")
def split(text: str) -> TaskSplit:
    return make_tasks(text, 60, 20, seed=3)


def test_every_answer_is_right(split: TaskSplit) -> None:
    for task in split.train + split.test:
        words = line_words(task.source)
        assert words is not None and task.question.endswith(task.word or task.source)
        expected = {"first_word": words[0], "last_word": words[-1],
                    "reverse": task.word[::-1], "upper": task.word.upper(),
                    "length": NUMBERS[len(task.word)]}[task.family]
        assert task.answer == expected, task
        if task.word:
            assert task.word in {w.lower() for w in words}


def test_the_held_out_split_shares_no_line_and_no_word(split: TaskSplit) -> None:
    assert {t.source for t in split.train}.isdisjoint(t.source for t in split.test)
    assert {t.word for t in split.train if t.word}.isdisjoint(
        t.word for t in split.test if t.word)
    counts = {f: sum(t.family == f for t in split.test) for f in FAMILIES}
    assert counts == dict.fromkeys(FAMILIES, 20) and len(split.train) == 60 * len(FAMILIES)


def test_check_split_refuses_a_shared_line_or_word() -> None:
    a = Task("first_word", "first word: To be or not", "To", "To be or not")
    b = Task("reverse", "reverse: not", "ton", "Or not to be", "not")
    c = Task("reverse", "reverse: not", "ton", "Not this line", "not")
    with pytest.raises(ValueError, match="1 source lines are in both splits, e.g. 'To be or"):
        check_split([a], [a])
    with pytest.raises(ValueError, match="1 asked-about words are in both splits, e.g. 'not'"):
        check_split([b], [c])
    check_split([a], [c])


def test_tasks_are_deterministic_given_the_seed(text: str, split: TaskSplit) -> None:
    assert make_tasks(text, 60, 20, seed=3) == split
    assert make_tasks(text, 60, 20, seed=4) != split


def test_tasks_fit_the_book_models_context(text: str) -> None:
    tasks = make_tasks(text, 200, 50, seed=0)
    # <|user|> question <|end|> <|assistant|> answer <|end|>: T + 1 = 65 ids at most
    assert max(len(t.question) + len(t.answer) + 4 for t in tasks.train + tasks.test) <= 65


def test_source_lines_and_words() -> None:
    text = "A:\nTo be, or not to be!\nO'er the hill\nAy\n\nB:\nTo be, or not to be!\n"
    assert source_lines(text) == ["To be, or not to be!"]
    assert line_words("To be, or not to be!") == ["To", "be", "or", "not", "to", "be"]
    assert line_words("O'er the hill") is None and line_words("--Nay") is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(families=["speaker"]), r"unknown task families \['speaker'\]; choose from"),
    (dict(n_train=0), "n_train must be an int >= 1, got 0"),
    (dict(test_fraction=1.0), "test_fraction must lie strictly between 0 and 1"),
    (dict(n_train=10**6), r"only \d+ first_word tasks can be made from \d+ lines; asked for"),
])
def test_make_tasks_errors(text: str, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = dict(n_train=5, n_test=5) | kwargs
    with pytest.raises(ValueError, match=message):
        make_tasks(text, **args)  # type: ignore[arg-type]


def test_few_shot_prompts_take_the_shots_that_fit() -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :\n")
    shots = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in ("abc", "dogs", "hello")]
    task = Task("reverse", "reverse: cat", "tac", "cat")
    assert tok.decode(few_shot_prompt(task, shots, tok, 73)) == (
        "reverse: hello\nolleh\n\nreverse: dogs\nsgod\n\nreverse: abc\ncba\n\nreverse: cat\n")
    assert tok.decode(few_shot_prompt(task, shots, tok, 72)) == (
        "reverse: dogs\nsgod\n\nreverse: abc\ncba\n\nreverse: cat\n")
    assert tok.decode(few_shot_prompt(task, shots, tok, 13)) == "reverse: cat\n"


def test_exact_match_scores_each_family() -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyzABC :\n")
    torch.manual_seed(0)
    model, chat = add_chat_tokens(GPT(GPTConfig.debug(vocab_size=tok.vocab_size,
                                                      context_length=32)), tok)
    tasks = [Task("reverse", "reverse: ab", "ba", "ab"), Task("upper", "upper: ab", "AB", "ab")]
    scores = exact_match(model, chat, tasks)
    assert set(scores) == {"reverse", "upper"} and all(0 <= s <= 1 for s in scores.values())
    few = exact_match(model, tok, tasks, shots=tasks)
    assert set(few) == {"reverse", "upper"}


def test_exact_match_counts_only_exact_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyzABC :\n")
    model, chat = add_chat_tokens(GPT(GPTConfig.debug(vocab_size=tok.vocab_size,
                                                      context_length=32)), tok)
    tasks = [Task("reverse", "reverse: ab", "ba", "ab"), Task("reverse", "reverse: cd", "dc",
                                                             "cd"),
             Task("upper", "upper: ab", "AB", "ab")]
    monkeypatch.setattr("minigpt.posttrain.tasks.greedy_replies",
                        lambda *args, **kwargs: ["ba", "dc ", "AB"])
    assert exact_match(model, chat, tasks) == {"reverse": 0.5, "upper": 1.0}


def test_few_shot_scoring_uses_distinct_shots(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyzABC :\n")
    model = GPT(GPTConfig.debug(vocab_size=tok.vocab_size, context_length=64))
    seen: list[str] = []
    monkeypatch.setattr("minigpt.posttrain.tasks.greedy_replies", lambda m, t, prompts, **kw: [
        seen.append(t.decode(p)) or "ba" for p in prompts])
    shots = [Task("reverse", "reverse: ab", "ba", "ab")] * 3 + [
        Task("reverse", "reverse: cd", "dc", "cd")]
    task = Task("reverse", "reverse: xy", "yx", "xy")
    assert exact_match(model, tok, [task], shots=shots) == {"reverse": 0.0}
    assert seen == ["reverse: cd\ndc\n\nreverse: ab\nba\n\nreverse: xy\n"]
