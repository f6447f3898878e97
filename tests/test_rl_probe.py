"""tools/rl_probe.py: its pass@k on a small random chat model, and its refusals of bad
arguments (before any model is loaded). Its rejection-sampling step is the package's
(`minigpt.rl.rft_step`, tested in tests/test_rl.py)."""

from __future__ import annotations

import pytest
from helpers import load_tool
from test_rl import SETTINGS, peaked_model, reachable

probe = load_tool("rl_probe")


def test_pass_at_8_is_at_least_pass_at_1_on_reachable_tasks() -> None:
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    measured = probe.sampled_pass(model, tok, ts, SETTINGS, seed=0)
    assert set(measured) == {"pass@1", "pass@8"}
    assert 0 < measured["pass@1"] <= measured["pass@8"] <= 1
    assert measured == probe.sampled_pass(model, tok, ts, SETTINGS, seed=0)  # seeded


@pytest.mark.parametrize("argv, needle", [
    (["--families", "first_word,rhyme"], "--families must be"),
    (["--every", "0"], "--every must be >= 1"),
    (["--group-size", "1"], "group_size\n  Input should be greater than or equal to 2"),
    (["--baseline", "ppo"], "invalid choice"),
])
def test_bad_arguments_are_refused(argv: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        probe.main(argv)
    assert needle in capsys.readouterr().err
