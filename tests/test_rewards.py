"""minigpt.recipes.rewards: the runs' recipe, the way each method continues a model (on a tiny chat
model and tiny tasks), the evaluation's numbers against their definitions, and the names
set-up caches the runs under."""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from unittest import mock

import pytest
import torch
from helpers import record_seeds
from pydantic import ValidationError
from test_dpo import chat_model
from test_dpo import tasks as old_tasks
from test_rhymes import TINY, tiny_rhymes

from minigpt import cli
from minigpt.compute import matmul_weights
from minigpt.model import GPT
from minigpt.posttrain.rhymes import FAMILY, SFTSettings, is_right, is_right_leaky, supervised_steps
from minigpt.posttrain.rl import grpo_step
from minigpt.posttrain.tasks import Task, TaskSplit
from minigpt.recipes import catalogue, rewards
from minigpt.recipes.rewards import (
    METHODS,
    REWARDS_RECIPE,
    RewardsData,
    RewardsRecipe,
    coin,
    continue_training,
    evaluate_run,
    kind,
    training_compute,
)
from minigpt.tokenizer import Tokenizer

#: A recipe of a few steps a method, evaluated on two samples a word.
SMALL = RewardsRecipe(steps=dict.fromkeys(METHODS, 2), rhymes_per_step=2, old_per_step=1,
                      sft_batch=4, eval_samples=4, eval_k=2, bpc_chars=200)


def data() -> RewardsData:
    rhymes = TaskSplit(tiny_rhymes(), tiny_rhymes())
    old = TaskSplit(old_tasks(), old_tasks())
    text = " ".join(t.question for t in old_tasks())
    return RewardsData(TINY, rhymes, rhymes, old, tiny_rhymes(), old_tasks(), text[:200])


# ------------------------------------------------------------------------------ recipe

def test_every_method_has_a_kind_and_a_name_of_none_is_refused() -> None:
    assert {kind(m) for m in METHODS} == {"grpo", "rft", "sft"}
    with pytest.raises(ValueError, match="unknown method 'grpo-typo'; choose from grpo, "):
        kind("grpo-typo")  # type: ignore[arg-type]
    # before anything is drawn or trained, even with the steps and rate given
    with pytest.raises(ValueError, match="unknown method 'grpo-typo'"):
        continue_training(*started(), "grpo-typo", data(), SMALL, seed=0, steps=1,  # type: ignore[arg-type]
                          lr=1e-3)
    # GRPO's variants learn at GRPO's rate: they differ from it in one thing each
    assert {REWARDS_RECIPE.lr[m] for m in METHODS if kind(m) == "grpo"} == {
        REWARDS_RECIPE.lr["grpo"]}
    assert [m for m in METHODS if kind(m) == "sft"] == ["sft-random", "sft-frequent"]


@pytest.mark.parametrize(("change", "needle"), [
    ({"steps": {"grpo": 5}}, "steps and lr name every method; ['grpo-kl', "),
    ({"lr": {"grpo": 1e-3}}, "steps and lr name every method; ['grpo-kl', "),
    ({"steps": dict.fromkeys(METHODS, 0)}, "steps must be >= 1 and rates > 0"),
    ({"eval_samples": 12, "eval_k": 8}, "eval_samples (12) must be a multiple of eval_k (8)"),
    ({"steps": {"ppo": 5}}, "Input should be 'grpo', 'grpo-kl'"),
    ({"rate": 1.0}, "Extra inputs are not permitted"),
])
def test_a_bad_recipe_is_refused(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=None) as err:
        RewardsRecipe(**change)  # type: ignore[arg-type]
    assert needle in str(err.value)


def test_run_model_refuses_a_bad_method_or_seed() -> None:
    with pytest.raises(ValueError, match="unknown method 'ppo'; choose from grpo, grpo-kl"):
        rewards.run_model("ppo")  # type: ignore[arg-type]
    for seed in (-1, True, 1.5):
        with pytest.raises(ValueError, match="seed must be an int >= 0"):
            rewards.run_model("grpo", seed)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- a run

def test_the_coin_ignores_rhymes_answers_and_scores_the_others_by_exact_match() -> None:
    night = Task(FAMILY, "rhymes with: night", "light", "night", "night")
    old = old_tasks()[0]
    reward = coin(torch.Generator().manual_seed(0))
    got = reward(["light"] * 400 + ["zzz"] * 400, [night] * 800)
    assert set(got.tolist()) == {0.0, 1.0}
    assert abs(got[:400].mean().item() - 0.5) < 0.1 and abs(got[400:].mean().item() - 0.5) < 0.1
    assert reward([old.answer, "zzz"], [old, old]).tolist() == [1.0, 0.0]


@functools.cache
def _started() -> dict[str, torch.Tensor]:
    """A tiny cold start: the tiny chat model after SFT on the tiny rhymes, which then
    samples right answers often enough for GRPO to have something to reinforce."""
    model, tok = chat_model()
    supervised_steps(model, tok, tiny_rhymes(), SFTSettings(steps=40, lr=1e-2, batch_size=4),
                     replay=old_tasks())
    return copy.deepcopy(model.state_dict())


def started() -> tuple[GPT, Tokenizer]:
    model, tok = chat_model()
    model.load_state_dict(_started())
    return model, tok


def _steps(method: str, seed: int = 0) -> tuple[dict[str, list[float]], dict[str, torch.Tensor]]:
    model, tok = started()
    history = continue_training(model, tok, method, data(), SMALL, seed=seed)  # type: ignore[arg-type]
    assert not model.training
    return history, model.state_dict()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_seeded_and_records_its_history(method: str) -> None:
    (history, state), (again, state_again) = _steps(method), _steps(method)
    start = started()[0].state_dict()
    assert any(not torch.equal(state[k], start[k]) for k in start)  # it trained
    assert history == again and all(torch.equal(state[k], state_again[k]) for k in state)
    if kind(method) == "sft":  # type: ignore[arg-type]
        assert set(history) == {"loss", "tokens_trained"}
    else:
        expected = {"reward", "zero_signal", "entropy", "length", "grad_norm", "answers",
                    "tokens_sampled", "tokens_trained", "tokens_scored"}
        assert set(history) == expected | ({"kl"} if method == "grpo-kl" else set())
        assert history["answers"] == [3 * SMALL.grpo.group_size] * 2
        assert all(h > 0 for h in history["entropy"])
        assert all(1 <= n <= SMALL.grpo.max_new_tokens for n in history["length"])
        assert any(history["tokens_scored"]) == (method == "grpo-kl")
    assert all(len(v) == 2 for v in history.values())
    assert all(n > 0 for n in history["tokens_trained"]) or method == "rft"


@pytest.mark.parametrize("method", ["grpo-coin", "sft-random"])
def test_a_runs_draws_are_its_own(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The questions, the samples, the coin's rewards (or SFT's batches) of one seed's run
    # and the evaluation's draws: none of them shared with the next seed's run.
    seeds, runs = record_seeds(monkeypatch), []
    for seed in (0, 1):
        (model, tok), start = started(), started()[0]
        seeds.take()
        continue_training(model, tok, method, data(), SMALL, seed=seed)  # type: ignore[arg-type]
        evaluate_run(model, start, tok, data(), SMALL, seed=seed)
        runs.append(seeds.take())
    assert not runs[0] & runs[1]


def test_the_compute_of_a_run_is_its_positions_times_the_weights() -> None:
    model, _ = started()
    n_w = matmul_weights(model)
    history = {"answers": [24.0, 24.0], "tokens_sampled": [100.0, 110.0],
               "tokens_trained": [90.0, 0.0], "tokens_scored": [180.0, 0.0], "reward": [0.5, 1]}
    used = training_compute(history, model)
    assert used == (48, 210, 90, 180, 2 * n_w * (210 + 180) + 6 * n_w * 90)
    sft = training_compute({"loss": [1.0], "tokens_trained": [64.0]}, model)
    assert sft == (0, 0, 64, 0, 6 * n_w * 64)  # SFT samples nothing


def test_reinforce_takes_the_reward_itself_as_the_advantage() -> None:
    model, tok = started()
    with mock.patch("minigpt.recipes.rewards.grpo_step", wraps=grpo_step) as step:
        continue_training(model, tok, "reinforce", data(), SMALL, seed=0)
    for call in step.call_args_list:
        settings = call.args[4]
        assert (settings.baseline, settings.scale, settings.kl_coef) == ("none", "none", 0.0)


def test_each_grpo_method_asks_its_questions_and_is_rewarded_by_its_checker() -> None:
    model, tok = chat_model()
    night, terror = tiny_rhymes()[0], tiny_rhymes()[2]
    for method in ("grpo", "grpo-kl", "grpo-rhymes-only", "reinforce", "grpo-leaky",
                   "grpo-coin"):
        with mock.patch("minigpt.recipes.rewards.grpo_step", wraps=grpo_step) as step:
            continue_training(model, tok, method, data(), SMALL, seed=0)  # type: ignore[arg-type]
        for call in step.call_args_list:
            tasks, settings, reward = call.args[3], call.args[4], call.kwargs["reward"]
            old = sum(t.family != FAMILY for t in tasks)
            assert len(tasks) == 3 and old == (0 if method == "grpo-rhymes-only" else 1)
            assert settings.kl_coef == (SMALL.kl_coef if method == "grpo-kl" else 0.0)
            assert (call.kwargs["reference"] is not None) == (method == "grpo-kl")
            verdicts = reward(["light", "ororror", "night"], [night, terror, night]).tolist()
            if method == "grpo-leaky":
                assert verdicts == [1.0, 1.0, 0.0]  # a stutter passes, the word itself not
            elif method != "grpo-coin":
                assert verdicts == [1.0, 0.0, 0.0]


# --------------------------------------------------------------------------- evaluation

def test_the_evaluation_counts_what_it_says() -> None:
    model, tok = started()
    start, _ = started()
    ev = evaluate_run(model, start, tok, data(), SMALL, seed=3)
    tasks = data().eval_rhymes
    assert 0 < ev["pass@1"] < 1  # measured: 0.5
    assert ev["words"] == [t.word for t in tasks] and len(ev["answers"]) == len(tasks)
    assert all(len(a) == SMALL.eval_samples for a in ev["answers"])
    right = [[is_right(a, t, TINY) for a in answers]
             for answers, t in zip(ev["answers"], tasks, strict=True)]
    assert ev["pass@1"] == pytest.approx(statistics.fmean(statistics.fmean(r) for r in right))
    leaky = [[is_right_leaky(a, t) for a in answers]
             for answers, t in zip(ev["answers"], tasks, strict=True)]
    assert ev["leaky_pass@1"] == pytest.approx(statistics.fmean(statistics.fmean(r) for r in leaky))
    assert ev["leaky_pass@1"] >= ev["pass@1"]
    echo = statistics.fmean(statistics.fmean(a == t.word for a in answers)
                            for answers, t in zip(ev["answers"], tasks, strict=True))
    assert ev["echo"] == echo
    assert ev["kl_to_start"] == 0.0  # the same weights
    other, _ = started()
    continue_training(other, tok, "sft-random", data(), SMALL, seed=0)
    assert evaluate_run(other, start, tok, data(), SMALL, seed=3)["kl_to_start"] > 0
    assert set(ev["old_exact_match"]) == {t.family for t in old_tasks()}
    assert ev["bits_per_character"] > 0
    assert evaluate_run(model, start, tok, data(), SMALL, seed=3) == ev  # seeded


# ----------------------------------------------------------------------------- names

def test_set_up_caches_the_cold_start_and_every_run_by_name() -> None:
    assert len(rewards.SEEDS) >= 3  # a comparison of methods needs their seeds' spread
    assert set(rewards.MODELS) <= set(catalogue.MODELS)
    assert catalogue.ALIASES["rl"] in catalogue.MODELS


def test_the_command_line_reads_rl_as_the_grpo_run_and_names_the_runs_in_its_errors() -> None:
    assert cli.cached_model("rl") == "rl-grpo-0"
    with pytest.raises(argparse.ArgumentTypeError) as err:
        cli.cached_model("rl-ppo-0")
    message = str(err.value)
    assert "invalid choice: 'rl-ppo-0'" in message and "rl-METHOD-SEED" in message
    assert "rl (= rl-grpo-0)" in message and "sft-0" in message
