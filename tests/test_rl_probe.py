"""tools/rl_probe.py: its pass@k and rejection-sampling step on a small random chat model,
and its refusals of bad arguments (before any model is loaded)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tool
from test_rl import SETTINGS, peaked_model, reachable

from minigpt.optim import configure_optimizer

probe = load_tool("rl_probe")


def test_pass_at_8_is_at_least_pass_at_1_on_reachable_tasks() -> None:
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    measured = probe.sampled_pass(model, tok, ts, SETTINGS, seed=0)
    assert set(measured) == {"pass@1", "pass@8"}
    assert 0 < measured["pass@1"] <= measured["pass@8"] <= 1
    assert measured == probe.sampled_pass(model, tok, ts, SETTINGS, seed=0)  # seeded


def test_rejection_sampling_steps_on_right_answers_only() -> None:
    model, tok = peaked_model()
    ts = reachable(model, tok, 8, SETTINGS.max_new_tokens)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = configure_optimizer(model, lr=1e-3, weight_decay=0.0)
    out = probe.rft_step(model, opt, tok, ts, SETTINGS, torch.Generator().manual_seed(0),
                         grad_clip=1.0)
    assert 0 < out["kept"] < 8 * SETTINGS.group_size and out["reward"] > 0
    assert not model.training
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    wrong = [t.__class__(t.family, t.question, "no such answer", t.source) for t in ts]
    model.load_state_dict(before)
    out = probe.rft_step(model, opt, tok, wrong, SETTINGS, torch.Generator().manual_seed(0),
                         grad_clip=1.0)
    assert out == {"reward": 0.0, "kept": 0}  # nothing right: no step
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


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
