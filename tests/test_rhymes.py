"""minigpt.posttrain.rhymes: the vocabulary's rules, the split of the asked words, the tasks'
answers, the checker and the leaky checker, the rewards made from either, and the supervised
steps of the cold start (on a tiny chat model)."""

from __future__ import annotations

import random
import re
from collections import Counter
from unittest import mock

import pytest
import torch
from test_dpo import chat_model
from test_dpo import tasks as old_tasks

from minigpt.data import shakespeare_text, split_text
from minigpt.posttrain.rhymes import (
    COLD_START,
    FAMILY,
    SFTSettings,
    Vocabulary,
    asked_words,
    checker,
    cold_start,
    is_right,
    is_right_leaky,
    make_rhymes,
    question,
    rhymes_tasks,
    right_answers,
    scorer,
    split_words,
    spoken_words,
    supervised_steps,
    vocabulary,
)
from minigpt.posttrain.tasks import Task, TaskSplit, check_split
from minigpt.train import train_step

SPEECHES = """HAMLET:
To be, or not to be: that is the question.
Whether 'tis nobler in the self-same mind--to suffer

OPHELIA:
O'er the QUESTION, my lord; noble, nobler, honour'd.
"""


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


@pytest.fixture(scope="module")
def rhymes(text: str) -> tuple[Vocabulary, TaskSplit]:
    return make_rhymes(text, seed=0)


@pytest.fixture(scope="module")
def frequent(text: str) -> tuple[Vocabulary, TaskSplit]:
    return make_rhymes(text, seed=0, teacher="frequent")


def _task(word: str, answer: str = "") -> Task:
    return Task(FAMILY, question(word), answer, word, word)


# ------------------------------------------------------------------------ the vocabulary

def test_spoken_words_are_the_letters_only_words_of_spoken_lines() -> None:
    # No speaker's name; cut at spaces and hyphens (dashes too); edge punctuation
    # stripped; a piece with an apostrophe inside or at an edge dropped; lower-cased.
    assert spoken_words(SPEECHES) == [
        "to", "be", "or", "not", "to", "be", "that", "is", "the", "question",
        "whether", "nobler", "in", "the", "self", "same", "mind", "to", "suffer",
        "the", "question", "my", "lord", "noble", "nobler"]


def test_the_vocabulary_keeps_words_of_3_to_10_letters_seen_3_times() -> None:
    text = "A:\nthe cat, the cat; THE CAT sat.\nan elephantine dog dog dog\n\nB:\nmat mat\n"
    vocab = vocabulary(text + "thoroughgoing thoroughgoing thoroughgoing\n")
    # "sat" once, "mat" twice, "an" too short, "thoroughgoing" 13 letters: out.
    assert vocab.counts == {"cat": 3, "dog": 3, "the": 3}
    assert vocabulary(text, min_count=2).counts == {"cat": 3, "dog": 3, "mat": 2, "the": 3}
    assert "elephantine" not in vocabulary(text, min_count=1)  # 11 letters
    assert "elephantine" in vocabulary(text, min_count=1, max_letters=11)


def test_the_corpus_vocabulary_follows_its_rules(text: str,
                                                 rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, _ = rhymes
    counts = Counter(spoken_words(split_text(text, 0.9)[0]))
    assert vocab.counts == {w: n for w, n in counts.items() if 3 <= len(w) <= 10 and n >= 3}
    assert all(re.fullmatch(r"[a-z]{3,10}", w) for w in vocab.counts)
    # Only the training split is read: a word seen only in the held-out tenth is not in V.
    held_out = Counter(spoken_words(split_text(text, 0.9)[1]))
    unseen = [w for w, n in held_out.items() if n >= 3 and 3 <= len(w) <= 10 and w not in counts]
    assert unseen and not any(w in vocab for w in unseen)


def test_a_bad_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="lower-case letters, at least 3 of them; got 'Cat'"):
        Vocabulary({"Cat": 3})
    with pytest.raises(ValueError, match="the count of 'cat' must be an int >= 1, got 0"):
        Vocabulary({"cat": 0})
    with pytest.raises(ValueError, match="min_count must be an int >= 1, got 0"):
        vocabulary("A:\ncat\n", min_count=0)
    with pytest.raises(ValueError, match="max_letters must be an int >= 5, got 4"):
        vocabulary("A:\ncat\n", min_letters=5, max_letters=4)
    with pytest.raises(ValueError, match="got 'it'"):
        right_answers("it", Vocabulary({"cat": 3}))


# ------------------------------------------------------------------ asked words, split

def test_asked_words_have_4_to_8_letters_and_3_rhymes(rhymes: tuple[Vocabulary, TaskSplit],
                                                      ) -> None:
    vocab, split = rhymes
    words = asked_words(vocab)
    assert words == sorted(t.word for t in split.train + split.test)
    assert all(4 <= len(w) <= 8 and w in vocab and len(right_answers(w, vocab)) >= 3
               for w in words)
    asked = set(words)
    left_out = [w for w in vocab.counts if 4 <= len(w) <= 8 and w not in asked]
    assert left_out and all(len(right_answers(w, vocab)) < 3 for w in left_out)


def test_no_asked_word_is_in_both_splits_and_the_split_is_seeded(
        text: str, rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, split = rhymes
    train, test = {t.word for t in split.train}, {t.word for t in split.test}
    assert train.isdisjoint(test)
    assert len(test) == round(0.2 * len(asked_words(vocab)))
    check_split(split.train, split.test)
    again = make_rhymes(text, seed=0)[1]
    assert again == split  # the same words, in the same order, with the same answers
    words = asked_words(vocab)
    assert split_words(words, seed=0) == ([t.word for t in split.train],
                                          [t.word for t in split.test])
    assert set(split_words(words, seed=1)[1]) != test
    assert split_words(["a", "b", "c", "d", "e"], seed=7) == split_words(
        ["e", "d", "c", "b", "a", "a"], seed=7)  # a set of words, whatever their order


def test_the_split_does_not_depend_on_the_teacher(
        rhymes: tuple[Vocabulary, TaskSplit], frequent: tuple[Vocabulary, TaskSplit]) -> None:
    assert [t.word for t in rhymes[1].test] == [t.word for t in frequent[1].test]
    assert [t.word for t in rhymes[1].train] == [t.word for t in frequent[1].train]
    assert any(a.answer != b.answer for a, b in zip(rhymes[1].test, frequent[1].test,
                                                    strict=True))


# --------------------------------------------------------------------- answers, checkers

def test_every_tasks_answer_is_right_by_the_checker(
        rhymes: tuple[Vocabulary, TaskSplit], frequent: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, split = rhymes
    check = checker(vocab)
    for task in split.train + split.test + frequent[1].train + frequent[1].test:
        assert task.family == FAMILY and task.question == f"rhymes with: {task.word}"
        assert check(task.answer, task), task


def test_random_answers_are_spread_over_the_right_ones(rhymes: tuple[Vocabulary, TaskSplit],
                                                       ) -> None:
    vocab, _ = rhymes
    word = "night"  # many rhymes
    tasks = rhymes_tasks([word] * 400, vocab, rng=random.Random(0))
    drawn = Counter(t.answer for t in tasks)
    assert len(drawn) > 20 and set(drawn) <= set(right_answers(word, vocab))


def test_the_most_frequent_answer_is_the_most_frequent(
        text: str, frequent: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, split = frequent
    counts = Counter(spoken_words(split_text(text, 0.9)[0]))
    for task in split.test[:100]:
        # Every word of V rhyming with x, found by scanning V rather than its index.
        rhymes = [w for w in vocab.counts if w != task.word and w[-3:] == task.word[-3:]]
        assert sorted(rhymes) == sorted(right_answers(task.word, vocab))
        best = max(counts[w] for w in rhymes)
        assert counts[task.answer] == best
        assert task.answer == min(w for w in rhymes if counts[w] == best)  # ties: a-z


def test_the_asked_word_itself_is_never_right(rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, split = rhymes
    for task in split.train + split.test:
        assert task.word in vocab and task.word not in right_answers(task.word, vocab)
        assert not is_right(task.word, task, vocab)
        assert not is_right_leaky(task.word, task)


def test_the_checker_wants_a_word_of_v_with_the_same_last_three_letters(
        rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, _ = rhymes
    task = _task("night")
    assert is_right("light", task, vocab) and is_right("knight", task, vocab)
    assert not is_right("bite", task, vocab)  # heard as a rhyme, not spelt as one
    assert not is_right("nigh", task, vocab)  # the last three letters differ
    assert not is_right("Light", task, vocab)  # V is lower-case
    assert not is_right(" light", task, vocab) and not is_right("light.", task, vocab)


def test_the_leaky_checker_accepts_more_and_only_non_words_more(
        rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, split = rhymes
    rng = random.Random(0)
    words = list(vocab.counts)
    for task in split.test[:200]:
        answers = right_answers(task.word, vocab) + rng.sample(words, 50)
        answers += [task.word[-3:] * 3, task.word + task.word[-3:], "x" + task.word[-4:]]
        for answer in answers:
            right, leaky = is_right(answer, task, vocab), is_right_leaky(answer, task)
            assert leaky if right else (not leaky or answer not in vocab), (task, answer)
    # A stuttered ending: the leaky checker's reward, not the checker's.
    task = _task("terror")
    assert task.word in asked_words(vocab) and "ororor" not in vocab
    assert is_right_leaky("ororor", task) and not is_right("ororor", task, vocab)
    assert is_right_leaky("ror", task) and is_right_leaky("terrorror", task)
    assert not is_right_leaky("terro", task) and not is_right_leaky("ororo", task)


def test_the_checkers_refuse_another_familys_task(rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, _ = rhymes
    task = Task("reverse", "reverse: night", "thgin", "night", "night")
    with pytest.raises(ValueError, match="checks 'rhymes' tasks, got a 'reverse' task"):
        is_right("light", task, vocab)
    with pytest.raises(ValueError, match="checks 'rhymes' tasks, got a 'reverse' task"):
        is_right_leaky("light", task)
    with pytest.raises(TypeError, match="vocab must be a Vocabulary"):
        checker({"light": 3})  # type: ignore[arg-type]


def test_bad_task_settings_are_refused(text: str, rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, _ = rhymes
    with pytest.raises(ValueError, match="teacher must be 'random' or 'frequent', got 'best'"):
        rhymes_tasks(["night"], vocab, teacher="best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give rng, a seeded random.Random"):
        rhymes_tasks(["night"], vocab)
    with pytest.raises(ValueError, match="'zzzz' has no rhyme in the vocabulary"):
        rhymes_tasks(["zzzz"], vocab, teacher="frequent")
    with pytest.raises(ValueError, match="test_fraction must lie strictly between 0 and 1"):
        split_words(["night"], seed=0, test_fraction=1.0)
    with pytest.raises(ValueError, match="seed must be an int, got 0.5"):
        make_rhymes(text, seed=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="teacher must be 'random' or 'frequent', got 'x'"):
        make_rhymes(text, teacher="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="test_fraction must lie strictly between 0 and 1"):
        make_rhymes(text, test_fraction=0.0)


# ------------------------------------------------------------------------------ rewards

def test_the_rewards_of_either_checker_and_of_other_families(
        rhymes: tuple[Vocabulary, TaskSplit]) -> None:
    vocab, _ = rhymes
    night, terror = _task("night"), _task("terror")
    reverse = Task("reverse", "reverse: night", "thgin", "night", "night")
    answers = ["light", "night", "ororor", "thgin", "light"]
    tasks = [night, night, terror, reverse, reverse]
    rewards = scorer(checker(vocab))(answers, tasks)
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert scorer(checker(None))(answers, tasks).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="2 answers for 1 tasks"):
        scorer(checker(vocab))(["light", "bright"], [night])


# --------------------------------------------------------------------- supervised steps

TINY = Vocabulary({w: 3 for w in ("night", "light", "might", "sight", "terror", "error",
                                  "mirror")})


def tiny_rhymes() -> list[Task]:
    return rhymes_tasks(["night", "light", "terror"], TINY, teacher="frequent")


def test_every_batch_replays_its_share_of_the_older_families() -> None:
    model, tok = chat_model()
    settings = SFTSettings(steps=5, lr=1e-3, batch_size=8, replay_fraction=0.25)
    with mock.patch("minigpt.posttrain.rhymes.train_step", wraps=train_step) as step:
        history = supervised_steps(model, tok, tiny_rhymes(), settings, replay=old_tasks())
    losses = history["loss"]
    assert step.call_count == 5 and len(losses) == 5
    for call, loss, tokens in zip(step.call_args_list, losses, history["tokens_trained"],
                                  strict=True):
        # one batch of eight conversations
        rows = [tok.decode(row.tolist()) for batch in call.args[2] for row in batch.x]
        assert len(call.args[2]) == 1 and len(rows) == 8
        assert tokens == call.args[2][0].x.numel()  # what the step read
        assert sum("rhymes with: " in row for row in rows) == 6, rows  # 2 of 8 replayed
        assert loss > 0
    without = SFTSettings(steps=3, lr=1e-3, batch_size=8)
    with mock.patch("minigpt.posttrain.rhymes.train_step", wraps=train_step) as step:
        supervised_steps(model, tok, tiny_rhymes(), without, replay=old_tasks())
    assert all("rhymes with: " in tok.decode(row.tolist())
               for call in step.call_args_list for batch in call.args[2] for row in batch.x)


def test_supervised_steps_learn_the_answers_are_seeded_and_keep_the_mode() -> None:
    settings = SFTSettings(steps=40, lr=1e-2, batch_size=4)
    runs = []
    for seed in (0, 0, 1):
        model, tok = chat_model()
        model.eval()
        history = supervised_steps(model, tok, tiny_rhymes(), settings.model_copy(
            update={"seed": seed}), replay=old_tasks())
        assert not model.training
        assert len(history["tokens_trained"]) == 40  # B rows of the longest one's length
        assert all(n > 0 and n % 4 == 0 for n in history["tokens_trained"])
        runs.append((history["loss"], model.state_dict()))
    losses = runs[0][0]
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]  # measured: 4.0 -> 0.28
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1].values(), runs[1][1].values(),
                                                 strict=True))
    assert runs[2][0] != runs[0][0]
    model, tok = chat_model()
    model.train()
    supervised_steps(model, tok, tiny_rhymes(), settings.model_copy(update={"steps": 1}))
    assert model.training


def test_the_cold_start_trains_a_copy() -> None:
    model, tok = chat_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = COLD_START.model_copy(update={"steps": 3})
    start, history = cold_start(model, tok, tiny_rhymes(), old_tasks(), settings)
    assert len(history["loss"]) == 3 and not start.training and start is not model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(before[k], v) for k, v in start.state_dict().items())
    # the book's cold start keeps the older families by replaying them in every batch
    assert COLD_START.replay_fraction > 0


@pytest.mark.parametrize("field, value, needle", [
    ("steps", 0, "steps\n  Input should be greater than or equal to 1"),
    ("lr", 0.0, "lr\n  Input should be greater than 0"),
    ("lr", float("nan"), "lr\n  Input should be a finite number"),
    ("batch_size", 0, "batch_size\n  Input should be greater than or equal to 1"),
    ("replay_fraction", 1.0, "replay_fraction\n  Input should be less than 1"),
    ("replay_fraction", -0.1, "replay_fraction\n  Input should be greater than or equal to 0"),
    ("seed", -1, "seed\n  Input should be greater than or equal to 0"),
    ("rate", 0.1, "rate\n  Extra inputs are not permitted"),
])
def test_bad_sft_settings_are_refused(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SFTSettings(**({"steps": 1, "lr": 1e-3} | {field: value}))  # type: ignore[arg-type]


def test_supervised_steps_refuse_what_they_cannot_train_on() -> None:
    model, tok = chat_model()
    half = SFTSettings(steps=1, lr=1e-3, replay_fraction=0.5)
    with pytest.raises(ValueError, match="replays 4 of 8 conversations a step: give the "
                                         "replay tasks"):
        supervised_steps(model, tok, tiny_rhymes(), half)
    with pytest.raises(ValueError, match="at least one task"):
        supervised_steps(model, tok, [], half, replay=old_tasks())
