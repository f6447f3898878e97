"""tools/rl_rhymes.py: its coin reward, and its refusals of bad arguments (before any model
is loaded). The functions it runs are the package's, tested in tests/test_rl.py and
tests/test_rhymes.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import load_tool

from minigpt.rhymes import FAMILY, question
from minigpt.tasks import Task

tool = load_tool("rl_rhymes")


def test_the_coin_rewards_rhymes_at_random_and_the_older_families_by_exact_match() -> None:
    rhyme = Task(FAMILY, question("night"), "light", "night", "night")
    reverse = Task("reverse", "reverse: night", "thgin", "night", "night")
    reward = tool.coin_reward(torch.Generator().manual_seed(0))
    tasks = [rhyme] * 400 + [reverse, reverse]
    got = reward(["light"] * 400 + ["thgin", "night"], tasks)
    assert got[-2:].tolist() == [1.0, 0.0]
    coins = got[:400]
    assert set(coins.tolist()) == {0.0, 1.0} and 0.4 < coins.mean().item() < 0.6
    again = tool.coin_reward(torch.Generator().manual_seed(0))(["light"] * 400, [rhyme] * 400)
    assert torch.equal(again, coins)  # seeded


def test_each_method_has_its_kind_of_step() -> None:
    assert [tool.kind(m) for m in tool.METHODS] == [
        "zero-shot", "cold", "grpo", "grpo", "grpo", "grpo", "rft", "sft", "sft"]
    assert set(tool.STEPS) == set(tool.METHODS) - {"zero-shot", "cold"}
    assert set(tool.LR) == {"grpo", "rft", "sft"}


@pytest.mark.parametrize("argv, needle", [
    (["--method", "ppo"], "invalid choice: 'ppo'"),
    (["--method", "grpo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--method", "grpo", "--eval-tasks", "0"], "--eval-tasks must be >= 1, got 0"),
    (["--method", "grpo", "--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--method", "grpo", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--method", "grpo", "--model-dir", "/nonexistent"], "holds no model.pt"),
])
def test_bad_arguments_are_refused(argv: list[str], needle: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tool.main(argv)
    assert needle in capsys.readouterr().err
