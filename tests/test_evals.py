"""The benchmarks: multiple-choice items from held-out text (deterministic, true ending
among length-matched distractors), scorers (a GPT's, the count models'), accuracy by
summed and per-character likelihood, exact match by turn of a conversation, and the
table."""

from __future__ import annotations

import math
from dataclasses import replace

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given

import minigpt.posttrain.chat
from minigpt import GPT, GPTConfig
from minigpt.posttrain.chat import Turn, add_chat_tokens, fit_context, prompt_ids, reply
from minigpt.posttrain.evals import (
    CHANCE,
    Choice,
    CountModel,
    benchmark_table,
    edit_distance,
    exact_match_by_turn,
    format_table,
    longest_repeat,
    make_choices,
    model_scorer,
    multiple_choice,
    speech_lines,
)
from minigpt.posttrain.tasks import Task, make_tasks
from minigpt.tokenizer import CharTokenizer, Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
WORDS = ["fair", "moon", "night", "love", "sweet", "lord", "good", "king", "heart", "death"]


def play(n_speeches: int = 120, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    speeches = []
    for k in range(n_speeches):
        lines = [" ".join(rng.choice(WORDS, int(rng.integers(3, 6)))).capitalize()
                 + rng.choice([",", ".", ";"]) for _ in range(int(rng.integers(2, 5)))]
        speeches.append(f"SPEAKER{k % 3}:\n" + "\n".join(lines))
    return "\n\n".join(speeches) + "\n"


def test_speech_lines_skip_the_speaker() -> None:
    assert speech_lines("A:\nx y\nz\n\nB:\nonly one\n\nC:\np\nq") == [["x y", "z"], ["p", "q"]]


def test_items_are_deterministic_and_hold_the_true_next_line() -> None:
    text = play()
    items = make_choices(text, 60, seed=3)
    assert items == make_choices(text, 60, seed=3) and items != make_choices(text, 60, seed=4)
    speeches = speech_lines(text)
    nexts = {(a, b) for s in speeches for a, b in zip(s, s[1:], strict=False)}
    labels = set()
    for item in items:
        assert len(item.endings) == 4 and len(set(item.endings)) == 4
        true = item.endings[item.label]
        before, head = item.context.split("\n")
        assert (before, head + true[:-1]) in nexts
        assert len(head) == len(head + true[:-1]) // 2  # cut at the middle
        for e in item.endings:
            assert e.endswith("\n") and abs(len(e) - len(true)) <= 3
        labels.add(item.label)
    assert labels == {0, 1, 2, 3}


@pytest.mark.parametrize("n, message", [(0, r"n must lie in \[1, \d+\] .*got 0"),
                                        (10**6, r"n must lie in \[1, \d+\] .*got 1000000")])
def test_bad_item_counts(n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_choices(play(), n)


def test_count_models_are_distributions() -> None:
    text = play()
    for order in (1, 2):
        m = CountModel(text, order)
        chars = sorted(set(text))
        total = sum(math.exp(m.logprob("a", c)) for c in chars)
        unseen = 1 / (m.context_counts["a" if order == 2 else ""] + m.vocab)
        assert total + unseen == pytest.approx(1.0)
    with pytest.raises(ValueError, match="order must be 1"):
        CountModel(text, 3)


@given(st.text(alphabet="ab\n", min_size=2, max_size=40))
def test_bigram_scores_add_up(text: str) -> None:
    m = CountModel("abba\nab\n", 2)
    whole = m.score([(text[:1], text[1:])])[0]
    assert whole == pytest.approx(sum(m.logprob(text[i - 1], text[i])
                                      for i in range(1, len(text))))


def test_accuracy_by_sum_and_per_character() -> None:
    items = [Choice("c\n", ("a\n", "bbbbbbb\n", "c\n", "d\n"), 1)]
    # scores: the long ending has the lowest sum but the highest mean per character
    scores = {"a\n": -3.0, "bbbbbbb\n": -4.0, "c\n": -2.5, "d\n": -9.0}
    result = multiple_choice(lambda xs: [scores[e] for _, e in xs], items)
    assert result == {"summed": 0.0, "per_char": 1.0}


def model(context_length: int = 64) -> tuple[GPT, CharTokenizer]:
    tok = CharTokenizer.from_text(play() + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:")
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=16,
                         n_heads=2, n_layers=1)).eval(), tok


def test_model_scorer_is_the_sum_of_the_endings_log_probabilities() -> None:
    gpt, tok = model()
    context, ending = "Fair moon,\n", "Good king.\n"
    ids = tok.encode_ordinary(context + ending)
    logp = torch.log_softmax(gpt(torch.tensor([ids[:-1]])), -1)[0]
    n = len(ending)
    expected = sum(logp[i - 1, ids[i]].item() for i in range(len(ids) - n, len(ids)))
    scores = model_scorer(gpt, tok, batch_size=1)([(context, ending), ("o" * 80, ending)])
    assert scores[0] == pytest.approx(expected, abs=1e-4)
    assert math.isfinite(scores[1])  # a long context is cut from the left
    with pytest.raises(ValueError, match="an ending of 70 tokens leaves no room"):
        model_scorer(gpt, tok)([(context, "o" * 70)])


def test_table_rows() -> None:
    text = play(400)
    gpt, tok = model()
    chat_gpt, chat = add_chat_tokens(gpt, tok)
    tasks = make_tasks(text, 3, 3, seed=0, families=["first_word", "upper"])
    rows = benchmark_table({"random": (gpt, tok), "chat": (chat_gpt, chat)}, text,
                           n_items=20, bpc_chars=500, tasks=tasks.test, shots=tasks.train)
    assert [r["model"] for r in rows] == ["chance", "unigram", "bigram", "random", "chat"]
    assert rows[0]["mc_summed"] == CHANCE and rows[0]["bpc"] is None
    assert rows[2]["bpc"] < rows[1]["bpc"] < math.log2(len(set(text)) + 1) + 1e-9
    assert rows[3]["bpc"] == pytest.approx(math.log2(tok.vocab_size), rel=0.05)
    for r in rows:
        assert set(r) == {"model", "mc_summed", "mc_per_char", "bpc", "em_first_word",
                          "em_upper"}
    assert rows[1]["em_upper"] is None and rows[4]["em_upper"] is not None
    table = format_table(rows)
    assert table.splitlines()[0].split() == list(rows[0])
    assert len(table.splitlines()) == 6 and "0.250" in table


# ----- exact match turn by turn ---------------------------------------------------------

def chat_model(context_length: int = 64) -> tuple[GPT, Tokenizer]:
    return add_chat_tokens(*model(context_length))


def held_out(n: int = 6) -> list[Task]:
    return make_tasks(play(400), 3, n, seed=0, families=["first_word", "upper", "reverse"]).test


def test_by_turn_shapes_and_determinism() -> None:
    gpt, tok = chat_model()
    tasks = held_out()  # 18 tasks: 4 conversations of 4, 2 left over
    result = exact_match_by_turn(gpt, tok, tasks, max_new_tokens=4)
    assert len(result.by_turn) == len(result.single_turn) == len(result.dropped) == 4
    assert len(result.conversations) == 4
    assert all(0.0 <= v <= 1.0 for v in (*result.by_turn, *result.single_turn))
    for conversation in result.conversations:
        assert [t.role for t in conversation] == ["user", "assistant"] * 4
        assert {t.text for t in conversation[::2]} <= {t.question for t in tasks}
    assert exact_match_by_turn(gpt, tok, tasks, max_new_tokens=4) == result
    other = exact_match_by_turn(gpt, tok, tasks, max_new_tokens=4, seed=1)
    assert other.conversations != result.conversations
    assert len(exact_match_by_turn(gpt, tok, tasks, n_turns=1, max_new_tokens=2).by_turn) == 1


def test_turn_one_is_the_single_turn_score_and_later_turns_read_the_earlier_ones() -> None:
    gpt, tok = chat_model()
    # Tasks whose right answer is what the model says to the question alone: single-turn
    # exact match is 1 on each, and so is turn 1; a later turn is asked after earlier ones.
    tasks = [replace(t, answer=reply(gpt, tok, [Turn("user", t.question)], max_new_tokens=4))
             for t in held_out()]
    result = exact_match_by_turn(gpt, tok, tasks, n_turns=3, max_new_tokens=4)
    assert result.single_turn == (1.0, 1.0, 1.0)
    assert result.by_turn[0] == 1.0
    assert min(result.by_turn[1:]) < 1.0  # the earlier turns change this model's answers


def test_the_conversation_carries_the_earlier_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    gpt, tok = chat_model(context_length=256)
    fed: list[list[int]] = []
    greedy = minigpt.posttrain.chat.greedy_replies

    def recording(model: GPT, tokenizer: Tokenizer, prompts: list[list[int]],
                  **kwargs: int) -> list[str]:
        fed.extend(map(list, prompts))
        return greedy(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(minigpt.posttrain.chat, "greedy_replies", recording)
    result = exact_match_by_turn(gpt, tok, held_out()[:8], n_turns=4, max_new_tokens=4)
    assert result.dropped == (0.0, 0.0, 0.0, 0.0)
    whole = [t for conversation in result.conversations for t in conversation]
    expected = [prompt_ids(conversation[:2 * k + 1], tok) for conversation in
                result.conversations for k in range(4)]
    assert fed == expected  # the k-th question after the k - 1 questions and answers before
    assert len(fed[3]) > len(fed[2]) > len(fed[1]) > len(fed[0]) and len(whole) == 16


def test_turns_are_dropped_when_the_context_is_short() -> None:
    gpt, tok = chat_model(context_length=48)
    tasks = held_out()
    result = exact_match_by_turn(gpt, tok, tasks, n_turns=3, max_new_tokens=8)
    assert result.dropped[0] == 0.0 and min(result.dropped[1:]) > 0.0
    # the turns missing from each prompt: what fit_context drops from the whole conversation
    missing = np.array([[2 * k + 1 - len(fit_context(c[:2 * k + 1], tok, 48, room=8))
                         for k in range(3)] for c in result.conversations])
    assert result.dropped == tuple(missing.mean(0).tolist())


@pytest.mark.parametrize("n_turns, n_tasks, message", [
    (0, 6, "n_turns must be an int >= 1, got 0"),
    (2.0, 6, "n_turns must be an int >= 1, got 2.0"),
    (4, 3, "a conversation of 4 turns needs at least 4 tasks, got 3")])
def test_by_turn_bad_arguments(n_turns: int, n_tasks: int, message: str) -> None:
    gpt, tok = chat_model()
    with pytest.raises(ValueError, match=message):
        exact_match_by_turn(gpt, tok, held_out()[:n_tasks], n_turns=n_turns)


def test_edit_distance_counts_the_fewest_letters_changed() -> None:
    assert edit_distance("kitten", "sitting") == 3  # k -> s, e -> i, + g
    assert edit_distance("thee", "the") == edit_distance("the", "thee") == 1
    assert edit_distance("night", "nihgt") == 2  # a swap is two replacements
    assert edit_distance("", "rose") == 4 and edit_distance("rose", "rose") == 0


@given(st.text("abc", max_size=8), st.text("abc", max_size=8), st.text("abc", max_size=8))
def test_edit_distance_is_a_distance(a: str, b: str, c: str) -> None:
    d = edit_distance(a, b)
    assert d == edit_distance(b, a) and (d == 0) == (a == b)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert edit_distance(a, c) <= d + edit_distance(b, c)


def test_the_longest_repeat_is_the_longest_stretch_that_occurs_twice() -> None:
    assert longest_repeat("") == longest_repeat("abc") == 0
    assert longest_repeat("abcab") == 2
    assert longest_repeat("aaaa") == 3  # the two may overlap
    assert longest_repeat("to be or not to be") == 5  # "to be"
