"""DPO: the pairs (a verifiable better answer), the loss against its closed form, its
gradients (none for the reference, none when the two answers are the same), training on
train()'s loop, the metrics and the KL estimator."""

from __future__ import annotations

import ast
import math
import random
import textwrap
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from minigpt import GPT, GPTConfig
from minigpt.config import TrainConfig
from minigpt.losses import estimate_loss
from minigpt.posttrain import dpo
from minigpt.posttrain.chat import add_chat_tokens, greedy_replies, prompt_ids
from minigpt.posttrain.dpo import (
    PreferencePair,
    PreferenceSet,
    beta_sweep,
    dpo_loss,
    encode_pairs,
    evaluate_dpo,
    make_pairs,
    model_pairs,
    near_miss,
    pair_logprobs,
    preference_loss,
    preference_metrics,
    sampled_kl,
    sequence_logprobs,
    train_dpo,
)
from minigpt.posttrain.tasks import FAMILIES, Task, line_words
from minigpt.tokenizer import END_OF_TURN, CharTokenizer
from minigpt.train import train_step

pytestmark = pytest.mark.usefixtures("one_thread")
LINES = ["Now fair Hippolyta our hour", "Draws on apace four happy days",
         "This old moon wanes", "now now now"]


def tasks() -> list[Task]:
    out = []
    for line in LINES:
        words = line_words(line) or []
        for family, make in FAMILIES.items():
            word = words[-1].lower() if family in ("reverse", "upper", "length") else ""
            q, a = make(line, words, word)
            out.append(Task(family, q, a, line, word))
    return out


def chat_model() -> tuple[GPT, CharTokenizer]:
    tok = CharTokenizer.from_text("".join(t.question + t.answer for t in tasks())
                                  + "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=64, d_model=16,
                         n_heads=2, n_layers=1))
    model, chat = add_chat_tokens(base, tok)
    return model.eval(), chat  # type: ignore[return-value]


# ----- pairs -----------------------------------------------------------------------------

def test_each_pair_prefers_the_right_answer_to_a_wrong_one() -> None:
    pairs = make_pairs(tasks(), seed=0)
    assert len(pairs) == len(tasks())
    for pair in pairs:
        assert pair.chosen == pair.task.answer and pair.rejected != pair.task.answer
    assert make_pairs(tasks(), seed=0) == pairs  # deterministic


@pytest.mark.parametrize("family, line, word, expected", [
    ("first_word", "Now fair Hippolyta", "", {"fair"}),
    ("last_word", "Now fair Hippolyta", "", {"fair"}),
    ("reverse", "x", "moon", {"moon", "onom"}),
    ("upper", "x", "moon", {"moon", "Moon"}),
    ("length", "x", "moon", {"three", "five"}),
    ("first_word", "now now now", "", {"noww"}),  # 2nd word = answer: doubled
])
def test_near_misses(family: str, line: str, word: str, expected: set[str]) -> None:
    q, a = FAMILIES[family](line, line_words(line) or [], word)
    task = Task(family, q, a, line, word)
    seen = {near_miss(task, random.Random(s)) for s in range(20)}
    assert seen == expected


@given(st.text(alphabet="abcdefgh", min_size=1, max_size=8), st.integers(0, 1000))
def test_a_near_miss_is_never_the_answer(word: str, seed: int) -> None:
    line = f"say {word} now"
    for family, make in FAMILIES.items():
        w = word if family in ("reverse", "upper", "length") else ""
        q, a = make(line, line_words(line) or [], w)
        assert near_miss(Task(family, q, a, line, w), random.Random(seed)) != a


def test_on_policy_pairs_reject_the_models_own_wrong_answers() -> None:
    model, tok = chat_model()
    ts = tasks()
    pairs = model_pairs(model, tok, ts, seed=0, max_new_tokens=4)
    answers = greedy_replies(model, tok, [prompt_ids(t.conversation()[:1], tok) for t in ts],
                             max_new_tokens=4)
    own = 0
    for pair, answer in zip(pairs, answers, strict=True):
        assert pair.chosen == pair.task.answer != pair.rejected
        if answer and answer != pair.task.answer and "<|" not in answer:
            assert pair.rejected == answer
            own += 1
    assert own > 0
    with pytest.raises(ValueError, match="at least one task"):
        model_pairs(model, tok, [])


def test_bad_pairs_are_refused() -> None:
    with pytest.raises(ValueError, match="two different answers, got 'a' twice"):
        PreferencePair(tasks()[0], "a", "a")
    with pytest.raises(ValueError, match="at least one task"):
        make_pairs([])
    model, tok = chat_model()
    with pytest.raises(ValueError, match="at least one preference pair"):
        encode_pairs([], tok, model)
    with pytest.raises(ValueError, match=r"reference log-probabilities \(N, 2\)"):
        PreferenceSet([[1, 2], [1, 3]], [[False, True]] * 2, torch.zeros(2, 2))
    for both_or_neither in ({}, {"reference": torch.zeros(1, 2), "reference_model": model}):
        with pytest.raises(ValueError, match="either the reference's log-probabilities or"):
            PreferenceSet([[1, 2], [1, 3]], [[False, True]] * 2, **both_or_neither)


def test_a_pair_too_long_for_the_context_is_refused() -> None:
    model, tok = chat_model()
    long = Task("upper", "upper: " + "a" * 60, "A" * 60, "x", "a" * 60)
    with pytest.raises(ValueError, match="a model with a context of T=64 reads at most"):
        encode_pairs(make_pairs([long]), tok, model)


def test_batches_hold_whole_pairs_with_the_reference_logprobs() -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    data = encode_pairs(pairs, tok, model)
    x, y, mask, ref = data.get_batch(5, 64, generator=torch.Generator().manual_seed(0))
    assert x.shape[:2] == y.shape[:2] == mask.shape[:2] == (5, 2) and ref.shape == (5, 2)
    x, y, mask, ref = data.pairs([3])
    chosen = tok.decode(y[0, 0][mask[0, 0]].tolist())
    rejected = tok.decode(y[0, 1][mask[0, 1]].tolist())
    assert chosen == pairs[3].chosen + END_OF_TURN
    assert rejected == pairs[3].rejected + END_OF_TURN
    torch.testing.assert_close(ref, pair_logprobs(model, data)[[3]])


def test_the_reference_scores_a_pair_once_and_only_when_it_is_read() -> None:
    model, tok = chat_model()
    data = encode_pairs(make_pairs(tasks()), tok, model)
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    first = data.pairs([4, 1, 4])[3]
    assert calls == [4]  # pairs 4 and 1 (chosen and rejected), scored in one pass
    torch.testing.assert_close(first, data.pairs([1, 4, 4])[3][[1, 0, 2]])
    assert calls == [4]  # kept, not scored again
    everything = data.reference_logprobs()
    assert len(calls) > 1 and everything.shape == (data.num_pairs, 2)
    torch.testing.assert_close(everything, pair_logprobs(model, data), atol=1e-5, rtol=0)
    torch.testing.assert_close(everything[[4, 1]], first[:2])


# ----- the loss --------------------------------------------------------------------------

def test_loss_equals_the_closed_form_on_hand_values() -> None:
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    beta = 0.5
    # pair 0: (-1 + 1.5) - (-2 + 1.5) = 1; pair 1: (-3 + 2) - (-1 + 2) = -2
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2
    assert dpo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(expected, rel=1e-6)
    # equal rewards: log 2, whatever beta
    z = torch.zeros(3)
    assert dpo_loss(z, z, z, z, 7.0).item() == pytest.approx(math.log(2))


@given(st.floats(-20, 20), st.floats(-20, 20), st.floats(0.01, 5))
def test_loss_is_softplus_of_minus_the_scaled_margin(a: float, b: float, beta: float) -> None:
    loss = dpo_loss(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64),
                    torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                    beta)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-beta * (a - b))), rel=1e-9,
                                         abs=1e-12)


def test_gradient_of_the_margin_at_equal_rewards_is_minus_half_beta() -> None:
    margin = torch.zeros(1, requires_grad=True)
    z = torch.zeros(1)
    dpo_loss(margin, z, z, z, beta=0.3).backward()
    assert margin.grad is not None
    assert margin.grad.item() == pytest.approx(-0.15)  # -beta * sigmoid(0): not zero


def test_no_gradient_when_both_answers_are_the_same() -> None:
    # Equal answers: r_w - r_l is 0 for every policy, so the loss is log 2, flat.
    model, tok = chat_model()
    model.train()
    pair = make_pairs(tasks())[0]
    same = PreferenceSet(*_pair_sequences(pair, tok, same=True), torch.zeros(1, 2))
    loss = preference_loss(model, same.pairs([0]), beta=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2))
    # zero up to float rounding: the two rows' gradients cancel in the batched sums
    largest = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    assert largest < 1e-6


def _pair_sequences(pair: PreferencePair, tok: CharTokenizer, same: bool,
                    ) -> tuple[list[list[int]], list[list[bool]]]:
    from minigpt.posttrain.chat import encode_conversation
    chosen, rejected = pair.conversations()
    a = encode_conversation(chosen, tok)
    b = a if same else encode_conversation(rejected, tok)
    return [a[0], b[0]], [a[1], b[1]]


def test_the_reference_gets_no_gradient_and_the_policy_does() -> None:
    model, tok = chat_model()
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())
    data = encode_pairs(make_pairs(tasks()), tok, reference)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [data.pairs(range(4))],
               grad_clip=0.0, loss_fn=lambda m, b: preference_loss(m, b, beta=0.1))
    assert all(p.grad is None for p in reference.parameters())
    # the policy's gradient, before the step cleared it
    model.zero_grad()
    preference_loss(model, data.pairs(range(4)), beta=0.1).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_sequence_logprobs_sum_the_answer_tokens_only() -> None:
    model, tok = chat_model()
    data = encode_pairs(make_pairs(tasks()[:1]), tok, model)
    x, y, mask, _ = data.pairs([0])
    x, y, mask = x[:, 0], y[:, 0], mask[:, 0]
    logp = torch.log_softmax(model(x), -1)[0].gather(-1, y[0, :, None])[:, 0]
    expected = logp[mask[0]].sum()
    torch.testing.assert_close(sequence_logprobs(model, x, y, mask)[0], expected)
    other = y.clone()
    other[~mask] = 0  # targets outside the mask do not count
    torch.testing.assert_close(sequence_logprobs(model, x, other, mask),
                               sequence_logprobs(model, x, y, mask))


def test_at_the_start_the_policy_is_the_reference() -> None:
    model, tok = chat_model()
    data = encode_pairs(make_pairs(tasks()), tok, model)
    metrics = preference_metrics(model, data, beta=0.1)
    assert metrics["margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    losses = estimate_loss(model, {"val": data}, batch_size=4, context_length=64, eval_steps=2,
                           loss_fn=lambda m, b: preference_loss(m, b, beta=0.1))
    assert losses["val"] == pytest.approx(math.log(2), abs=1e-5)


# ----- training and metrics ---------------------------------------------------------------

def config(steps: int = 30) -> TrainConfig:
    return TrainConfig(batch_size=8, max_steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                       weight_decay=0.0, eval_interval=10, eval_steps=2, seed=0)


def test_dpo_training_raises_preference_accuracy_and_leaves_its_input_alone(tmp_path) -> None:
    model, tok = chat_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pairs = make_pairs(tasks())
    result, reference = train_dpo(model, tok, pairs, pairs, config(40), beta=0.5,
                                  progress=False, out_dir=tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())
    assert not any(p.requires_grad for p in reference.parameters())
    h = result.history
    assert h.val_loss[0] == pytest.approx(math.log(2), abs=1e-4)
    assert h.val_loss[-1] < 0.5 * math.log(2)
    data = encode_pairs(pairs, tok, reference)
    metrics = preference_metrics(result.model, data, beta=0.5)
    assert metrics["accuracy"] == 1.0 and metrics["margin"] > 1.0
    assert (tmp_path / "checkpoint.pt").is_file()


def test_the_precision_is_set_before_the_reference_scores() -> None:
    # On a GPU, train() lets float32 products use TF32 (`allow_tf32`); the reference must
    # score under the same setting as the policy, so not before it.
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    events: list[str] = []

    def scored(*args: object, **kwargs: object) -> torch.Tensor:
        events.append("reference scores")
        return real_scores(*args, **kwargs)  # type: ignore[arg-type]

    real_scores = dpo.pair_logprobs
    with mock.patch("minigpt.train.allow_tf32", lambda device: events.append("precision")), \
            mock.patch("minigpt.posttrain.dpo.pair_logprobs", scored):
        train_dpo(model, tok, pairs, pairs, config(2), beta=0.1, progress=False)
    assert events[0] == "precision" and "reference scores" in events


def test_training_is_deterministic() -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    a, _ = train_dpo(model, tok, pairs, pairs, config(5), beta=0.1, progress=False)
    b, _ = train_dpo(model, tok, pairs, pairs, config(5), beta=0.1, progress=False)
    assert a.history.loss == b.history.loss


def test_kl_is_zero_for_the_reference_itself_and_positive_after_training() -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    prompts = [prompt_ids(p.conversations()[0][:1], tok) for p in pairs]
    end = tok.special_tokens[END_OF_TURN]
    assert sampled_kl(model, model, prompts, end, samples=2) == pytest.approx(0.0, abs=1e-5)
    result, reference = train_dpo(model, tok, pairs, pairs, config(20), beta=0.1,
                                  progress=False)
    kl = sampled_kl(result.model, reference, prompts, end, samples=2, seed=1)
    assert kl > 0.01
    assert kl == sampled_kl(result.model, reference, prompts, end, samples=2, seed=1)
    with pytest.raises(ValueError, match="at least one prompt"):
        sampled_kl(model, model, [], end)
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens; a prompt needs 1 to 63"):
        sampled_kl(model, model, [[1] * 64], end)




def test_under_bf16_the_reference_runs_as_the_policy_does() -> None:
    # At step 0 the policy is the reference: with both under the same autocast, every
    # log-ratio is zero and the loss is log 2.
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    bf16 = config(2).model_copy(update={"bf16": True})
    result, _ = train_dpo(model, tok, pairs, pairs, bf16, beta=0.1, progress=False)
    assert result.history.loss[0] == pytest.approx(math.log(2), abs=1e-6)
    data = encode_pairs(pairs, tok, model, bf16=True)
    assert data.bf16 and not encode_pairs(pairs, tok, model).bf16
    torch.testing.assert_close(data.reference_logprobs([0, 1]),
                               pair_logprobs(model, data, [0, 1], bf16=True))


@pytest.mark.cuda
def test_kl_draws_on_the_policys_device() -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    prompts = [prompt_ids(p.conversations()[0][:1], tok) for p in pairs]
    model = model.to("cuda")
    kl = sampled_kl(model, model, prompts, tok.special_tokens[END_OF_TURN], samples=2)
    assert kl == pytest.approx(0.0, abs=1e-5)


def test_beta_sweep_rows() -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    rows = beta_sweep(model, tok, pairs, pairs, [0.1, 1.0], config(10), kl_samples=1)
    assert [(r["beta"], r["steps"]) for r in rows] == [(0.1, 0), (0.1, 10), (1.0, 10)]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert set(rows[1]) >= {"accuracy", "margin", "loss", "kl", "seconds"}
    m = evaluate_dpo(model, model, tok, pairs, 0.1, kl_samples=1)
    assert m["accuracy"] == 0.0 and m["margin"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("beta", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_beta_is_refused(beta: object) -> None:
    model, tok = chat_model()
    pairs = make_pairs(tasks()[:2])
    with pytest.raises(ValueError, match="beta must be a positive number"):
        train_dpo(model, tok, pairs, pairs, config(2), beta=beta)  # type: ignore[arg-type]


# ----- several processes ------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_dpo import DDP_STEPS, chat_model, config, make_pairs, tasks, train_dpo
    from minigpt.parallel import init_distributed, shutdown
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    model, tok = chat_model()
    pairs = make_pairs(tasks())
    run = config(DDP_STEPS).model_copy(update=dict(batch_size=4))
    result, _ = train_dpo(model, tok, pairs, pairs, run, beta=0.5, ctx=ctx, progress=False)
    if ctx.rank == 0:
        torch.save(result.model.state_dict(), sys.argv[1] + "/ddp.pt")
        print(repr(result.history.loss))
    shutdown(ctx)
""")
DDP_STEPS = 3


@pytest.mark.slow
def test_two_ranks_train_dpo_as_one_process_on_their_pairs_together(tmp_path) -> None:
    # 2 ranks x 4 pairs a step: the same run as one process taking 8 pairs a step (the
    # reference's log-probabilities travel with the pairs; the loss is a mean over pairs).
    from test_parallel import run_script_on_ranks

    results = run_script_on_ranks(2, DDP_SCRIPT, tmp_path)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    model, tok = chat_model()
    one, _ = train_dpo(model, tok, make_pairs(tasks()), make_pairs(tasks()),
                       config(DDP_STEPS), beta=0.5, progress=False)
    assert ast.literal_eval(results[0].stdout) == pytest.approx(one.history.loss, rel=1e-5)
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(ddp[name], value, rtol=0, atol=1e-5)
