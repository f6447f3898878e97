"""The book's assistants: the modern recipe's model fine-tuned to answer (SFT) and then
preference-tuned (DPO), each trained once at set-up and cached like the book model
(`minigpt.recipes.pretrained`).

The base is the modern model (`minigpt.recipes.pretrained.MODERN_RECIPE`) because its positions
are rotary: it has no weights per position, so its fine-tuned copy reads a context of 256
tokens (`minigpt.posttrain.chat.extend_context`), four times what it was pre-trained on, which
holds a conversation of several exchanges. GPT-2's learned positions stop at the 64 it trained
on.

    model, tokenizer, info = sft_model(seed=1)   # one of SFT_SEEDS
    model, tokenizer, info = dpo_model()         # DPO from sft_model(seed=0)

The fine-tuned models differ only in the training seed (the order of their batches and
how the tasks are grouped into conversations), so
that a chapter can report exact match over several seeds with its spread; they all learn
from the same tasks (`assistant_tasks`) and are scored on the same held-out ones. A model's
manifest keeps what set-up measured: the run's metrics and, under ``"exact_match"``, its
held-out exact match per task family (for DPO also the preference metrics and the KL to
its reference, `minigpt.posttrain.dpo.evaluate_dpo`). The cache key covers the base model's key, the
task and training settings, the thread count and the PyTorch version.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from minigpt.config import GPTConfig, TrainConfig, check_int
from minigpt.data import split_text
from minigpt.model import GPT
from minigpt.posttrain.dpo import DPO_TRAINING, evaluate_dpo, make_pairs, train_dpo
from minigpt.posttrain.sft import SFT_TRAINING, finetune, text_windows
from minigpt.posttrain.tasks import TaskSplit, exact_match, make_tasks
from minigpt.recipes import pretrained
from minigpt.recipes.pretrained import Built, ModelInfo, cached_model
from minigpt.tokenizer import CHAT_TOKENS, CharTokenizer, with_special_tokens

#: The package's modules that importing this one loads; their source is part of every
#: assistant's cache key, as `pretrained.TRAINING_MODULES`' is of the base model's.
ASSISTANT_MODULES = tuple(sorted({*pretrained.TRAINING_MODULES, "decoding", "posttrain",
                                  "posttrain.chat", "posttrain.dpo", "posttrain.sft",
                                  "posttrain.tasks", "recipes.assistant"}))
#: The training seeds of the cached fine-tuned models.
SFT_SEEDS = (0, 1, 2)


class AssistantRecipe(BaseModel):
    """How the assistants are made from the book model.

    Attributes:
        base: the recipe of the model they start from (the modern model's).
        context_length: the context the fine-tuned models read (`extend_context`).
        max_turns: fine-tuning's conversations hold 1 to this many questions
            (`minigpt.posttrain.tasks.conversations`).
        n_train, n_test: tasks of each family for training and held out (`make_tasks`).
        task_seed: the seed of the tasks and their split.
        sft: fine-tuning's settings (its seed is replaced by each model's).
        replay, replay_chars: windows of the base model's training text, and their length,
            mixed into fine-tuning (`minigpt.posttrain.sft.finetune`'s ``replay``): without them the
            fine-tuned model forgets how to continue text (the assistant chapter's
            exercise 5 measures it after 100 steps: 3.6 bits per character on held-out
            text without them, 2.7 with them, against the base model's 2.3).
        dpo: DPO's settings; beta its KL weight; pair_seed the seed of the near misses.
        length_buckets: fine-tuning draws each batch from one of this many buckets of
            conversations of similar length (`minigpt.data.ExampleSet.get_batch`): a step
            then reads 45 % fewer tokens, nearly all of them real, where one bucket padded
            every conversation to the batch's longest.
        threads: torch threads while training (one: the same weights on every run).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: pretrained.Recipe = pretrained.MODERN_RECIPE
    context_length: int = Field(default=256, ge=2)
    max_turns: int = Field(default=6, ge=1)
    n_train: int = Field(default=2000, ge=1)
    n_test: int = Field(default=200, ge=1)
    task_seed: int = Field(default=0, ge=0)
    sft: TrainConfig = Field(default_factory=lambda: TrainConfig(**SFT_TRAINING))
    replay: int = Field(default=500, ge=0)
    replay_chars: int = Field(default=40, ge=1)
    dpo: TrainConfig = Field(default_factory=lambda: TrainConfig(**DPO_TRAINING))
    beta: float = Field(default=0.5, gt=0.0, allow_inf_nan=False, strict=True)
    pair_seed: int = Field(default=0, ge=0)
    length_buckets: int = Field(default=16, ge=1)
    threads: int = Field(default=1, ge=1, strict=True)


ASSISTANT_RECIPE = AssistantRecipe()


def assistant_tasks(recipe: AssistantRecipe = ASSISTANT_RECIPE) -> TaskSplit:
    """The tasks the assistants learn from (``.train``) and are scored on (``.test``), both
    made from the base model's training text: the held-out text, which the benchmark and
    bits per character read, stays unseen by every assistant."""
    return seen_tasks(pretrained.corpus(), recipe.n_train, recipe.n_test,
                      seed=recipe.task_seed, train_fraction=recipe.base.train_fraction)


def seen_tasks(text: str, n_train: int, n_test: int, *, seed: int,
               train_fraction: float = ASSISTANT_RECIPE.base.train_fraction) -> TaskSplit:
    """`make_tasks` of the first ``train_fraction`` of ``text`` (`split_text`), the part a
    base model trained on. The assistants' tasks and the command line's (`minigpt.cli`'s
    sft, dpo and eval) are made here alone, so that with the same text and settings the
    command scores the very held-out tasks set-up scored, none of them trained on."""
    seen = split_text(text, train_fraction)[0]
    return make_tasks(seen, n_train, n_test, seed=seed)


def _material(kind: str, parent: ModelInfo, model_config: GPTConfig, config: TrainConfig,
              recipe: AssistantRecipe, **more: Any) -> dict[str, Any]:
    return pretrained.model_material(
        ASSISTANT_MODULES, model_config, kind=kind, parent=parent.key,
        train_config=config.model_dump(), tasks=[recipe.n_train, recipe.n_test, recipe.task_seed],
        replay=[recipe.replay, recipe.replay_chars],
        conversations=[recipe.context_length, recipe.max_turns, recipe.length_buckets],
        threads=recipe.threads, **more)


def _say_training(progress: bool) -> dict[str, Any]:
    # As for the book model: a bar only on a terminal, the evaluation lines either way.
    return {"progress": progress and sys.stderr.isatty()}


def sft_model(seed: int = 0, *, progress: bool = False, recipe: AssistantRecipe =
              ASSISTANT_RECIPE) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The modern model fine-tuned on `assistant_tasks` with training seed ``seed``
    (`minigpt.posttrain.sft.finetune`), its chat tokenizer, and a `ModelInfo`; cached."""
    check_int("seed", seed, 0)
    base, tokenizer, base_info = pretrained.book_model(progress=progress, recipe=recipe.base)
    chat = with_special_tokens(tokenizer, CHAT_TOKENS)
    config = recipe.sft.model_copy(update={"seed": seed})
    shape = base.config.model_copy(update={"vocab_size": chat.vocab_size,
                                           "context_length": recipe.context_length})

    def build(say: Any, folder: Path) -> Built:
        tasks = assistant_tasks(recipe)
        say(f"fine-tuning the modern model once (seed {seed}, {config.max_steps} steps); it "
            f"is cached in {folder}")
        seen = split_text(pretrained.corpus(), recipe.base.train_fraction)[0]
        replay = text_windows(seen, recipe.replay, recipe.replay_chars, seed=seed) if (
            recipe.replay) else []
        with pretrained.threads(recipe.threads):
            result, chat = finetune(base, tokenizer, tasks.train, tasks.test, config,
                                    replay=replay, max_turns=recipe.max_turns,
                                    context_length=recipe.context_length,
                                    length_buckets=recipe.length_buckets,
                                    log=say if progress else None,
                                    **_say_training(progress))
            em = exact_match(result.model, chat, tasks.test)
        return result.model, result.metrics | {"exact_match": em}, asdict(result.history)

    model, info = cached_model(_material("sft", base_info, shape, config, recipe), build,
                               progress=progress)
    return model, chat, info  # type: ignore[return-value]


def dpo_model(*, beta: float | None = None, progress: bool = False,
              recipe: AssistantRecipe = ASSISTANT_RECIPE,
              ) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """`sft_model` (seed 0) preference-tuned with DPO (`minigpt.posttrain.dpo.train_dpo`) on pairs
    of `assistant_tasks`' training tasks, its reference being that model, with KL weight
    ``beta`` (default: the recipe's); cached, one model per beta."""
    if beta is not None:  # a validated copy: the beta is checked as the recipe's is
        recipe = AssistantRecipe.model_validate(dict(recipe) | {"beta": beta})
    policy, chat, sft_info = sft_model(0, progress=progress, recipe=recipe)
    config = recipe.dpo

    def build(say: Any, folder: Path) -> Built:
        tasks = assistant_tasks(recipe)
        train_pairs = make_pairs(tasks.train, seed=recipe.pair_seed)
        val_pairs = make_pairs(tasks.test, seed=recipe.pair_seed + 1)
        say(f"preference-tuning the fine-tuned model once (beta {recipe.beta}, "
            f"{config.max_steps} steps); it is cached in {folder}")
        with pretrained.threads(recipe.threads):
            result, reference = train_dpo(policy, chat, train_pairs, val_pairs, config,
                                          beta=recipe.beta, log=say if progress else None,
                                          **_say_training(progress))
            measured = evaluate_dpo(result.model, reference, chat, val_pairs, recipe.beta)
            em = exact_match(result.model, chat, tasks.test)
        metrics = result.metrics | {"beta": recipe.beta, "exact_match": em} | measured
        return result.model, metrics, asdict(result.history)

    material = _material("dpo", sft_info, policy.config, config, recipe,
                         beta=recipe.beta, pair_seed=recipe.pair_seed)
    model, info = cached_model(material, build, progress=progress)
    return model, chat, info


#: Every model set-up caches, by name (`python -m minigpt pretrained --only NAME`): the
#: pre-trained ones (`minigpt.recipes.pretrained.MODELS`) and the assistants, the modern model
#: fine-tuned with three seeds and preference-tuned with the recipe's beta and, for the
#: assistant chapter's sweep, two others.
MODELS: dict[str, pretrained.Loader] = {
    **pretrained.MODELS,
    **{f"sft-{seed}": partial(sft_model, seed) for seed in SFT_SEEDS},
    "dpo": dpo_model, "dpo-beta0.1": partial(dpo_model, beta=0.1),
    "dpo-beta2": partial(dpo_model, beta=2.0)}
