"""The cached assistants: fine-tuned and preference-tuned once, then loaded and verified;
one key per seed. A tiny base recipe and tiny runs on a small text, in a temporary cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from minigpt.cli import main
from minigpt.config import TrainConfig
from minigpt.data import split_text
from minigpt.posttrain.chat import Turn, reply
from minigpt.posttrain.tasks import source_lines
from minigpt.recipes import pretrained
from minigpt.recipes.assistant import (
    AssistantRecipe,
    assistant_tasks,
    dpo_model,
    sft_model,
)
from minigpt.recipes.pretrained import MANIFEST_NAME, Recipe

WORDS = ["fair", "moon", "night", "love", "sweet", "lord", "good", "king", "heart", "death",
         "speak", "gentle", "noble", "time", "sir", "come"]


def play() -> str:
    rng = np.random.default_rng(0)
    speeches = []
    for k in range(150):
        lines = [" ".join(rng.choice(WORDS, int(rng.integers(3, 5)))).capitalize() + "."
                 for _ in range(3)]
        speeches.append(f"SPEAKER{k % 3}:\n" + "\n".join(lines))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ:\nabcdefghijklmnopqrstuvwxyz"  # every letter
    return "\n\n".join([alphabet, *speeches]) + "\n"


TINY_BASE = Recipe(n_layers=1, n_heads=2, d_model=16, context_length=64,
                   layout=dict(positional="rope"),
                   training=TrainConfig(batch_size=4, max_steps=10, warmup_steps=2,
                                        eval_interval=5, eval_steps=2, seed=0))
TINY = AssistantRecipe(
    base=TINY_BASE, n_train=20, n_test=5, context_length=128, max_turns=2,
    sft=TrainConfig(batch_size=8, max_steps=6, warmup_steps=2, eval_interval=3, eval_steps=1,
                    weight_decay=0.0, seed=0),
    dpo=TrainConfig(batch_size=4, max_steps=4, warmup_steps=1, lr=1e-4, min_lr=1e-5,
                    eval_interval=2, eval_steps=1, seed=0))


@pytest.fixture(autouse=True)
def tiny_world(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "corpus", play)
    torch.set_num_threads(1)


def test_sft_models_are_cached_one_per_seed() -> None:
    model, chat, info = sft_model(0, recipe=TINY)
    assert info.built and not model.training
    manifest = json.loads((info.path / MANIFEST_NAME).read_text())
    assert set(manifest["metrics"]["exact_match"]) == {"first_word", "last_word", "length",
                                                       "reverse", "upper"}
    assert manifest["key_material"]["kind"] == "sft"
    again, _, info2 = sft_model(0, recipe=TINY)
    assert not info2.built and info2.key == info.key
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values(), strict=True))
    assert model.config.context_length == 128
    # The context, the most questions a conversation holds, the length buckets of a batch.
    assert manifest["key_material"]["conversations"] == [128, 2, TINY.length_buckets]
    other = sft_model(1, recipe=TINY)[2]
    assert other.key != info.key
    assert isinstance(reply(model, chat, [Turn("user", "upper: moon")], max_new_tokens=3), str)
    tasks = assistant_tasks(TINY)
    assert len(tasks.train) == 5 * 20 and len(tasks.test) == 5 * 5


def test_no_task_comes_from_the_held_out_text() -> None:
    # The benchmark and bits per character read the held-out text: no assistant may train
    # (or be scored as if unseen) on a line of it.
    seen, held = split_text(pretrained.corpus(), TINY.base.train_fraction)
    seen_lines, held_lines = set(source_lines(seen)), set(source_lines(held)) - set(
        source_lines(seen))
    tasks = assistant_tasks(TINY)
    sources = {t.source for t in tasks.train + tasks.test}
    assert held_lines and sources <= seen_lines and not sources & held_lines


def test_dpo_model_is_cached_with_its_measurements() -> None:
    model, chat, info = dpo_model(recipe=TINY)
    metrics = info.metrics
    assert {"accuracy", "margin", "kl", "beta", "exact_match"} <= set(metrics)
    assert metrics["kl"] >= 0 and metrics["beta"] == TINY.beta
    assert info.manifest["key_material"]["parent"] == sft_model(0, recipe=TINY)[2].key
    assert not dpo_model(recipe=TINY)[2].built
    assert model.config.vocab_size == chat.vocab_size
    other = dpo_model(beta=2.0, recipe=TINY)[2]
    assert other.metrics["beta"] == 2.0 and other.key != info.key
    with pytest.raises(ValueError, match="beta\n  Input should be greater than 0"):
        dpo_model(beta=0.0, recipe=TINY)


def test_bad_seed() -> None:
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        sft_model(-1, recipe=TINY)


def test_the_command_lists_the_assistants(capsys) -> None:
    assert main(["pretrained", "--help"]) == 0
    out = capsys.readouterr().out
    for name in ("sft-0", "sft-1", "sft-2", "dpo"):
        assert name in out
