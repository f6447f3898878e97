"""tools/bench_nanogpt.py's time-to-loss arithmetic, on made-up curves of (step, training
seconds, whole-split validation loss)."""

from __future__ import annotations

import pytest
from helpers import load_tool

bench = load_tool("bench_nanogpt")

CURVE = [(0, 0.0, 4.2), (100, 10.0, 2.1), (200, 20.0, 1.9), (300, 30.0, 1.7)]


def test_time_to_a_loss_is_the_first_evaluation_at_or_below_it() -> None:
    assert bench.time_to(CURVE, 1.9) == 20.0
    assert bench.time_to(CURVE, 1.95) == 20.0  # not interpolated: the evaluation that shows it
    assert bench.time_to(CURVE, 1.6) is None


def test_loss_at_a_time_is_the_last_evaluation_made_by_then() -> None:
    assert bench.loss_at(CURVE, 25.0) == 1.9
    assert bench.loss_at(CURVE, 30.0) == 1.7
    assert bench.loss_at(CURVE, 40.0) == 1.7  # a run that stopped earlier keeps its loss
    assert bench.loss_at(CURVE[1:], 5.0) is None  # no evaluation made that early


def test_a_fit_run_ends_within_the_time_at_the_first_run_s_pace() -> None:
    # 0.1 s per step: 95 % of 100 s is 950 steps; rounded down to multiples of 100
    assert bench.fit_steps(CURVE, 100.0) == 950
    assert bench.fit_steps(CURVE, 100.0, every=100) == 900
    assert bench.fit_steps(CURVE, 100.0, margin=1.0) == 1000
    with pytest.raises(ValueError, match="fewer than 100 steps at 100 ms per step"):
        bench.fit_steps(CURVE, 5.0, every=100)
    with pytest.raises(ValueError, match="cannot read a pace"):
        bench.fit_steps([(0, 0.0, 4.2)], 100.0)
