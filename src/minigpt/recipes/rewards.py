"""The rewards chapter's runs: a cold start on rhymes, then nine ways to continue from it
for about a minute of CPU time each, each trained once at set-up and cached like the
assistants.

The chat model ``sft-0`` (`minigpt.recipes.assistant.sft_model`) answers ``rhymes with: x``
(`minigpt.posttrain.rhymes`) in the older families' formats and almost never rightly, so
learning from rewards has nothing to reinforce. `cold_model` gives it a start: a minute of SFT
on random right answers, half of each batch replaying the older families
(`minigpt.posttrain.rhymes.cold_start`). `run_model` continues from that start with one
`Method`, a seed and the recipe's number of optimiser steps (`STEPS`, about a minute of CPU
time each; `training_compute` counts what a run spent from its per-step history):

* ``grpo``: GRPO (`minigpt.posttrain.rl.grpo_step`), rewarded by the checker
  (`minigpt.posttrain.rhymes.is_right`); ``grpo-kl`` with a KL penalty to the start;
  ``grpo-rhymes-only`` with no older family's question in its batches (the others ask a quarter
  of them); ``reinforce``, GRPO's step without a baseline (the reward itself is the advantage);
* ``rft``: rejection-sampling fine-tuning (`minigpt.posttrain.rl.rft_step`) with the same checker;
* ``sft-random``, ``sft-frequent``: SFT on a random right answer to each word, or on its most
  frequent one in the corpus (a teacher who knows the corpus);
* ``grpo-leaky``: GRPO rewarded by the leaky checker (`minigpt.posttrain.rhymes.is_right_leaky`);
  ``grpo-coin``: GRPO rewarded by a fair coin, whatever the answer.

`evaluate_run` measures a model the same way for every run, and its numbers go into the
manifest (``metrics["evaluation"]``), so the chapter reads them from the cache: on
`RewardsRecipe.eval_words` held-out words, the sampled pass@1 and pass@8 and the greedy
right rate (`minigpt.posttrain.rl.evaluate_sampled`), the distinct right answers among 16 samples,
the leaky checker's pass@1 on the same samples, how often a sample echoes the word, the KL
to the start (`minigpt.posttrain.dpo.sampled_kl`, as the assistant chapter measures DPO's), the
older families' exact match and the bits per character of the held-out text. The cache key
covers ``sft-0``'s key, the recipe, the method, the seed, the thread count, PyTorch and the
source of every module that trains the runs.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minigpt.compute import matmul_weights
from minigpt.config import check_int, stream_seed
from minigpt.data import split_text
from minigpt.losses import bits_per_character
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.posttrain.chat import prompt_ids
from minigpt.posttrain.dpo import sampled_kl
from minigpt.posttrain.rhymes import (
    COLD_START,
    FAMILY,
    SFTSettings,
    Vocabulary,
    cold_start,
    is_right_leaky,
    make_rhymes,
    scorer,
    supervised_steps,
)
from minigpt.posttrain.rhymes import checker as rhymes_checker
from minigpt.posttrain.rl import GRPOSettings, Reward, evaluate_sampled, grpo_step, rft_step, score
from minigpt.posttrain.tasks import Task, TaskSplit, exact_match
from minigpt.recipes import pretrained
from minigpt.recipes.assistant import (
    ASSISTANT_MODULES,
    ASSISTANT_RECIPE,
    AssistantRecipe,
    assistant_tasks,
    sft_model,
)
from minigpt.recipes.pretrained import Built, ModelInfo, cached_model
from minigpt.tokenizer import END_OF_TURN, CharTokenizer, Tokenizer

#: The package's modules that importing this one loads; their source is part of every run's
#: cache key.
REWARDS_MODULES = tuple(sorted({*ASSISTANT_MODULES, "compute", "posttrain.rhymes",
                                "posttrain.rl", "recipes.rewards"}))

Method = Literal["grpo", "grpo-kl", "grpo-rhymes-only", "reinforce", "rft", "sft-random",
                 "sft-frequent", "grpo-leaky", "grpo-coin"]
METHODS: tuple[Method, ...] = get_args(Method)
#: What a method's steps are: GRPO's (with rollouts), rejection sampling's, or SFT's.
Kind = Literal["grpo", "rft", "sft"]


def kind(method: Method) -> Kind:
    """The kind of step ``method`` takes; ValueError for a name that is no method's."""
    if method not in METHODS:  # else any other name would train as GRPO with the checker
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return "sft" if method.startswith("sft") else "rft" if method == "rft" else "grpo"


#: Optimiser steps of each method: about the same CPU time for every method (a GRPO step
#: with its rollouts costs more than a rejection-sampling step, and either far more than an
#: SFT step), GRPO's variants GRPO's own steps, so that each differs from it in one thing;
#: the manifest records each run's seconds, `training_compute` its work.
STEPS: dict[Method, int] = {"grpo": 50, "grpo-kl": 50, "grpo-rhymes-only": 50, "reinforce": 50,
                            "rft": 80, "sft-random": 1300, "sft-frequent": 1300,
                            "grpo-leaky": 50, "grpo-coin": 50}
#: AdamW's constant rate of each method, 3e-4 for all. A sweep (1e-4, 3e-4 and 1e-3 for GRPO
#: and rejection sampling; 3e-4, 6e-4 and 1.2e-3 for SFT; on 100 held-out words that the
#: chapter's evaluation does not read) set it on an earlier draw of the models, by a rule: the
#: best pass@1 among the rates that kept the older families' mean exact match within 0.03 of
#: the cold start's. It is kept when the models are drawn again: the rule's margins are within
#: one run's standard error (about 0.015 on 500 tasks), and one rate compares the methods at
#: one step size. GRPO's variants, REINFORCE without a baseline among them, take GRPO's. The
#: chapter prints the sweep, and the rule's choice on the models of the day, from
#: book/data/rewards_sweep.jsonl, one row a run of seed 0 (about two minutes each), the
#: cold start's first: ``python -m minigpt rl --threads 1 --validation --json
#: book/data/rewards_sweep.jsonl --method METHOD [--lr RATE]``.
LR: dict[Method, float] = {"grpo": 3e-4, "grpo-kl": 3e-4, "grpo-rhymes-only": 3e-4,
                           "reinforce": 3e-4, "rft": 3e-4, "sft-random": 3e-4,
                           "sft-frequent": 3e-4, "grpo-leaky": 3e-4, "grpo-coin": 3e-4}


class RewardsRecipe(BaseModel):
    """How the runs are made from ``sft-0``.

    Attributes:
        assistant: the recipe of the chat model they start from (``sft-0``'s) and of the
            older families' tasks. rhymes_seed: the seed of the rhymes words' split.
        cold: the cold start's SFT (`minigpt.posttrain.rhymes.COLD_START`).
        grpo: the settings of GRPO's and rejection sampling's steps (groups of 8, answers of
            at most 12 tokens); kl_coef: beta of ``grpo-kl``.
        rhymes_per_step, old_per_step: questions of a GRPO or rejection-sampling step, of
            rhymes and of the older families (``grpo-rhymes-only`` asks rhymes only).
        sft_batch, sft_replay: conversations of an SFT step, and the share of them from the
            older families.
        steps: optimiser steps of each method; lr: AdamW's rate of each method.
        eval_words: held-out words evaluated (a seeded sample, `eval_seed`);
            eval_samples: answers sampled to each; eval_k: the k of pass@k.
        eval_old: held-out tasks of each older family whose exact match is measured (the
            first of each family).
        bpc_chars: characters of held-out text whose bits per character are measured.
        threads: torch threads while training (one: the same weights on every run).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    assistant: AssistantRecipe = ASSISTANT_RECIPE
    rhymes_seed: int = Field(default=0, ge=0)
    cold: SFTSettings = COLD_START
    grpo: GRPOSettings = GRPOSettings(group_size=8, max_new_tokens=12)
    kl_coef: float = Field(default=0.1, gt=0.0, allow_inf_nan=False)
    rhymes_per_step: int = Field(default=12, ge=1)
    old_per_step: int = Field(default=4, ge=0)
    sft_batch: int = Field(default=8, ge=1)
    sft_replay: float = Field(default=0.25, ge=0.0, lt=1.0, allow_inf_nan=False)
    steps: dict[Method, int] = Field(default_factory=lambda: dict(STEPS))
    lr: dict[Method, float] = Field(default_factory=lambda: dict(LR))
    eval_words: int = Field(default=100, ge=1)
    eval_samples: int = Field(default=16, ge=1)
    eval_k: int = Field(default=8, ge=1)
    eval_seed: int = Field(default=1234, ge=0)
    eval_old: int = Field(default=100, ge=1)
    bpc_chars: int = Field(default=20_000, ge=2)
    threads: int = Field(default=1, ge=1, strict=True)

    @model_validator(mode="after")
    def _every_method_has_steps_and_a_rate(self) -> RewardsRecipe:
        missing = [m for m in METHODS if m not in self.steps or m not in self.lr]
        if missing:
            raise ValueError(f"steps and lr name every method; {missing} lack one")
        if any(n < 1 for n in self.steps.values()) or any(not r > 0 for r in self.lr.values()):
            raise ValueError(f"steps must be >= 1 and rates > 0, got {self.steps}, {self.lr}")
        if self.eval_samples % self.eval_k:
            raise ValueError(f"eval_samples ({self.eval_samples}) must be a multiple of eval_k "
                             f"({self.eval_k})")
        return self


REWARDS_RECIPE = RewardsRecipe()


# ------------------------------------------------------------------------------- the data

@dataclass(frozen=True)
class RewardsData:
    """The tasks of every run: V, the rhymes split with random and with most frequent
    answers, the older families' tasks, and the held-out words evaluated."""

    vocab: Vocabulary
    rhymes: TaskSplit
    frequent: TaskSplit
    old: TaskSplit
    eval_rhymes: list[Task]
    eval_old: list[Task]
    held_out_text: str


def rewards_data(recipe: RewardsRecipe = REWARDS_RECIPE) -> RewardsData:
    """`RewardsData` made from the corpus: rhymes of the base model's training text
    (`minigpt.posttrain.rhymes.make_rhymes`), the assistants' tasks (`assistant_tasks`), a seeded
    sample of `RewardsRecipe.eval_words` held-out rhymes tasks, the first
    `RewardsRecipe.eval_old` held-out tasks of each older family, and the held-out text."""
    text = pretrained.corpus()
    fraction = recipe.assistant.base.train_fraction
    vocab, rhymes = make_rhymes(text, seed=recipe.rhymes_seed, train_fraction=fraction)
    _, frequent = make_rhymes(text, seed=recipe.rhymes_seed, teacher="frequent",
                              train_fraction=fraction)
    test = rhymes.test
    eval_rhymes = random.Random(recipe.eval_seed).sample(test, min(recipe.eval_words, len(test)))
    old = assistant_tasks(recipe.assistant)
    by_family: dict[str, list[Task]] = {}
    for task in old.test:
        by_family.setdefault(task.family, []).append(task)
    eval_old = [t for tasks in by_family.values() for t in tasks[:recipe.eval_old]]
    return RewardsData(vocab, rhymes, frequent, old, eval_rhymes, eval_old,
                       split_text(text, fraction)[1][:recipe.bpc_chars])


def coin(generator: torch.Generator) -> Reward:
    """A reward that ignores what a rhymes answer says: a fair coin, drawn with
    ``generator``; the older families' answers are scored by exact match
    (`minigpt.posttrain.rl.score`)."""

    def reward(answers: Sequence[str], tasks: Sequence[Task]) -> torch.Tensor:
        coins = torch.randint(0, 2, (len(answers),), generator=generator).float()
        rhymes = torch.tensor([t.family == FAMILY for t in tasks])
        return torch.where(rhymes, coins, score(answers, tasks))

    return reward


# ---------------------------------------------------------------------------- a run

def continue_training(model: GPT, tokenizer: Tokenizer, method: Method, data: RewardsData,
                      recipe: RewardsRecipe = REWARDS_RECIPE, *, seed: int,
                      steps: int | None = None, lr: float | None = None,
                      ) -> dict[str, list[float]]:
    """Train the chat model ``model`` in place with ``method`` from where it is (the cold
    start), for ``steps`` optimiser steps at AdamW's constant rate ``lr`` (default: the
    recipe's); returns the per-step history. GRPO and rejection sampling record what
    practitioners log: ``reward``, ``zero_signal`` (the share of groups whose answers all
    scored the same), ``entropy`` (`minigpt.posttrain.rl.answer_entropy`, nats a token), ``length``
    (tokens an answer), ``grad_norm``, and ``kl`` (to the start, nats an answer) for
    ``grpo-kl``; SFT records its ``loss``. Every method records the work of each step:
    ``answers`` sampled, ``tokens_sampled``, ``tokens_trained`` and ``tokens_scored``
    (`minigpt.posttrain.rl.GRPOStats`; SFT only trains), from which `training_compute` counts FLOPs.

    GRPO and rejection sampling ask `RewardsRecipe.rhymes_per_step` rhymes questions and
    `RewardsRecipe.old_per_step` of the older families (rewarded by exact match) a step,
    drawn from ``seed``'s stream ``"tasks"``, the answers sampled from its ``"sampling"``
    and the coin's rewards from its ``"coin"`` (`minigpt.config.stream_seed`); SFT reads
    `RewardsRecipe.sft_batch` conversations a step, a `RewardsRecipe.sft_replay` share of
    them of the older families, drawn from ``seed``'s ``"batches"``.
    """
    k = kind(method)
    steps = recipe.steps[method] if steps is None else steps
    lr = recipe.lr[method] if lr is None else lr
    if k == "sft":
        tasks = data.rhymes.train if method == "sft-random" else data.frequent.train
        sft = SFTSettings(steps=steps, lr=lr, batch_size=recipe.sft_batch,
                          replay_fraction=recipe.sft_replay, seed=seed)
        return supervised_steps(model, tokenizer, tasks, sft, replay=data.old.train)
    rewards: dict[str, Reward] = {"grpo-leaky": scorer(is_right_leaky),
                                  "grpo-coin": coin(_generator(seed, "coin"))}
    reward = rewards.get(method, scorer(rhymes_checker(data.vocab)))
    beta = recipe.kl_coef if method == "grpo-kl" else 0.0
    settings = recipe.grpo.model_copy(update={"kl_coef": beta})
    if method == "reinforce":  # the reward itself is the advantage
        settings = settings.model_copy(update={"baseline": "none", "scale": "none"})
    reference = copy.deepcopy(model).requires_grad_(False) if beta else None
    n_old = 0 if method == "grpo-rhymes-only" else recipe.old_per_step
    n_rhymes = recipe.rhymes_per_step + recipe.old_per_step - n_old
    optimizer = configure_optimizer(model, lr=lr, weight_decay=0.0)
    rng, generator = random.Random(stream_seed(seed, "tasks")), _generator(seed, "sampling")
    logged = ("reward", "zero_signal", "entropy", "length", "grad_norm", "answers",
              "tokens_sampled", "tokens_trained", "tokens_scored")
    history: dict[str, list[float]] = {name: [] for name in logged}
    for _ in range(steps):
        tasks = rng.sample(data.rhymes.train, n_rhymes) + rng.sample(data.old.train, n_old)
        if k == "rft":
            stats: Any = rft_step(model, optimizer, tokenizer, tasks, settings,
                                  generator=generator, reward=reward)
        else:
            stats = grpo_step(model, optimizer, tokenizer, tasks, settings, generator=generator,
                              reward=reward, reference=reference)
            if stats.kl is not None:
                history.setdefault("kl", []).append(stats.kl)
        for name in logged:
            history[name].append(float(getattr(stats, name)))
    model.eval()
    return history


def _generator(seed: int, name: str, *index: int) -> torch.Generator:
    """A CPU generator drawing stream ``name`` of ``seed`` (`minigpt.config.stream_seed`)."""
    return torch.Generator().manual_seed(stream_seed(seed, name, *index))


class Compute(NamedTuple):
    """What a run's training did, summed over its steps (`training_compute`)."""

    answers: int
    tokens_sampled: int
    tokens_trained: int
    tokens_scored: int
    flops: int


def training_compute(history: dict[str, list[float]], model: GPT) -> Compute:
    """The work of a run from its history (`continue_training`'s): the answers it sampled,
    the positions its sampler read, those its training steps read forward and backward,
    those read forward only to score (the KL's log-probabilities), and the FLOPs of its
    matrix products: 2 N_W a position forward, 6 N_W forward and backward
    (`minigpt.compute.matmul_weights`; attention over these short rows is left out)."""
    total = {name: int(sum(history.get(name, ()))) for name in Compute._fields[:-1]}
    n_w = matmul_weights(model)
    flops = (2 * n_w * (total["tokens_sampled"] + total["tokens_scored"])
             + 6 * n_w * total["tokens_trained"])
    return Compute(**total, flops=flops)


# --------------------------------------------------------------------------- evaluation

def evaluate_run(model: GPT, start: GPT, tokenizer: Tokenizer, data: RewardsData,
                 recipe: RewardsRecipe = REWARDS_RECIPE, *, seed: int = 0) -> dict[str, Any]:
    """What the chapter compares of a run, as JSON-able data (see the module's docstring);
    with its sampled and greedy answers to each evaluated word (``answers``, ``greedy``),
    from which the chapter shows its failure modes. The answers are drawn from ``seed``'s
    stream ``"evaluation"``, the KL's from its ``"kl"`` (`minigpt.config.stream_seed`)."""
    right = scorer(rhymes_checker(data.vocab))
    tasks = data.eval_rhymes
    ev = evaluate_sampled(model, tokenizer, tasks, reward=right, samples=recipe.eval_samples,
                          k=recipe.eval_k, max_new_tokens=recipe.grpo.max_new_tokens,
                          generator=_generator(seed, "evaluation"))
    leaky = statistics.fmean(statistics.fmean(is_right_leaky(a, t) for a in answers)
                             for answers, t in zip(ev.answers, tasks, strict=True))
    echo = statistics.fmean(statistics.fmean(a == t.word for a in answers)
                            for answers, t in zip(ev.answers, tasks, strict=True))
    prompts = [prompt_ids(t.conversation()[:1], tokenizer) for t in tasks]
    kl = sampled_kl(model, start, prompts, tokenizer.special_tokens[END_OF_TURN],
                    samples=recipe.eval_k, max_new_tokens=recipe.grpo.max_new_tokens,
                    seed=stream_seed(seed, "kl"))
    ids = np.asarray(tokenizer.encode_ordinary(data.held_out_text), dtype=np.int64)
    return {"pass@1": ev.pass_at_1, f"pass@{ev.k}": ev.pass_at_k, "greedy": ev.greedy,
            "distinct_right": ev.distinct_right, "all_equal": ev.all_equal,
            "all_equal_predicted": ev.all_equal_predicted, "leaky_pass@1": leaky,
            "echo": echo, "kl_to_start": kl,
            "old_exact_match": exact_match(model, tokenizer, data.eval_old),
            "bits_per_character": bits_per_character(model, ids, tokenizer),
            "words": [t.word for t in tasks], "answers": [list(a) for a in ev.answers],
            "greedy_answers": list(ev.greedy_answers)}


# ------------------------------------------------------------------------- the cache

def _material(kind_: str, parent: ModelInfo, model: GPT, recipe: RewardsRecipe,
              **more: Any) -> dict[str, Any]:
    return pretrained.model_material(REWARDS_MODULES, model.config, kind=kind_,
                                     parent=parent.key, recipe=recipe.model_dump(mode="json"),
                                     **more)


#: The older families with the least room (``sft-0``'s lowest exact match), and how their
#: room is measured: held-out tasks of each, answers sampled to each, the k of pass@k.
ROOM_FAMILIES = ("first_word", "last_word", "reverse")
ROOM_TASKS, ROOM_SAMPLES, ROOM_K = 100, 32, 8


def room(model: GPT, tokenizer: Tokenizer, old: TaskSplit) -> dict[str, dict[str, float]]:
    """How much a chat model leaves to learn on the older families of `ROOM_FAMILIES`: on
    the first `ROOM_TASKS` held-out tasks of each, the greedy exact match, the sampled
    pass@1 and pass@8 (`ROOM_SAMPLES` answers a task, exact match), and the fraction of
    groups of 8 answers all right or all wrong beside its prediction p^8 + (1 - p)^8
    (`minigpt.posttrain.rl.evaluate_sampled`)."""
    measured = {}
    for i, family in enumerate(ROOM_FAMILIES):
        tasks = [t for t in old.test if t.family == family][:ROOM_TASKS]
        ev = evaluate_sampled(model, tokenizer, tasks, reward=score, samples=ROOM_SAMPLES,
                              k=ROOM_K, generator=_generator(0, "room", i))
        measured[family] = {"greedy": ev.greedy, "pass@1": ev.pass_at_1,
                            f"pass@{ROOM_K}": ev.pass_at_k, "all_equal": ev.all_equal,
                            "all_equal_predicted": ev.all_equal_predicted}
    return measured


def cold_model(*, progress: bool = False, recipe: RewardsRecipe = REWARDS_RECIPE,
               ) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """``sft-0`` given a cold start on rhymes (`minigpt.posttrain.rhymes.cold_start` with
    `RewardsRecipe.cold`), its chat tokenizer and a `ModelInfo`; cached. Its manifest also
    holds ``sft-0``'s own evaluation (``metrics["zero_shot"]``) and the room it leaves on
    the older families (`room`, ``metrics["room"]``)."""
    chat_model, chat, parent = sft_model(0, progress=progress, recipe=recipe.assistant)

    def build(say: Any, folder: Path) -> Built:
        data = rewards_data(recipe)
        say(f"a cold start on rhymes, once ({recipe.cold.steps} SFT steps); it is cached in "
            f"{folder}")
        with pretrained.threads(recipe.threads):
            zero_shot = evaluate_run(chat_model, chat_model, chat, data, recipe)
            old_room = room(chat_model, chat, data.old)
            t0, c0 = time.perf_counter(), time.process_time()
            model, history = cold_start(chat_model, chat, data.rhymes.train, data.old.train,
                                        recipe.cold)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            evaluation = evaluate_run(model, model, chat, data, recipe)
        return model, {"evaluation": evaluation, "zero_shot": zero_shot, "room": old_room,
                       "train_seconds": seconds, "train_cpu_seconds": cpu}, history

    model, info = cached_model(_material("rhymes-cold", parent, chat_model, recipe), build,
                               progress=progress)
    return model, chat, info


def run_model(method: Method, seed: int = 0, *, progress: bool = False,
              recipe: RewardsRecipe = REWARDS_RECIPE) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The cold start (`cold_model`) continued with ``method`` and training seed ``seed``
    (`continue_training`), its chat tokenizer and a `ModelInfo`; cached, with its
    `evaluate_run` in ``metrics["evaluation"]`` and its seconds of training."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    check_int("seed", seed, 0)
    start, chat, parent = cold_model(progress=progress, recipe=recipe)

    def build(say: Any, folder: Path) -> Built:
        data = rewards_data(recipe)
        say(f"continuing the cold start with {method} once (seed {seed}, "
            f"{recipe.steps[method]} steps); it is cached in {folder}")
        model = copy.deepcopy(start)
        with pretrained.threads(recipe.threads):
            t0, c0 = time.perf_counter(), time.process_time()
            history = continue_training(model, chat, method, data, recipe, seed=seed)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            evaluation = evaluate_run(model, start, chat, data, recipe, seed=seed)
        return model, {"evaluation": evaluation, "train_seconds": seconds,
                       "train_cpu_seconds": cpu}, history

    model, info = cached_model(_material("rhymes-run", parent, start, recipe, method=method,
                                         seed=seed), build, progress=progress)
    return model, chat, info


#: The seeds of every method's runs: the chapter compares methods against their seeds' spread.
SEEDS = (0, 1, 2)

#: The runs set-up caches, by name: the cold start, and ``rl-METHOD-SEED``.
MODELS: dict[str, pretrained.Loader] = {
    "rl-cold": cold_model,
    **{f"rl-{m}-{s}": partial(run_model, m, s) for m in METHODS for s in SEEDS}}
