"""tools/rl_rhymes.py: its refusals of bad arguments (before any model is loaded). The
functions it runs are the package's, tested in tests/test_rewards.py."""

from __future__ import annotations

import pytest
from helpers import load_tool

tool = load_tool("rl_rhymes")


@pytest.mark.parametrize("argv, needle", [
    (["--method", "ppo"], "invalid choice: 'ppo'"),
    (["--method", "grpo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--method", "grpo", "--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--method", "grpo", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--method", "cold", "--steps", "5"], "the cold start is the cached one"),
])
def test_bad_arguments_are_refused(argv: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tool.main(argv)
    assert needle in capsys.readouterr().err
