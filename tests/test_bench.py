"""tools/bench_nanogpt.py's time-to-loss arithmetic, on made-up curves of (step, training
seconds, whole-split validation loss)."""

from __future__ import annotations

from helpers import load_tool

bench = load_tool("bench_nanogpt")

CURVE = [(0, 0.0, 4.2), (100, 10.0, 2.1), (200, 20.0, 1.9), (300, 30.0, 1.7)]


def test_time_to_a_loss_is_the_first_evaluation_at_or_below_it() -> None:
    assert bench.time_to(CURVE, 1.9) == 20.0
    assert bench.time_to(CURVE, 1.95) == 20.0  # not interpolated: the evaluation that shows it
    assert bench.time_to(CURVE, 1.6) is None


def test_loss_at_a_time_needs_a_run_that_long() -> None:
    assert bench.loss_at(CURVE, 25.0) == 1.9  # the last evaluation made by then
    assert bench.loss_at(CURVE, 30.0) == 1.7
    assert bench.loss_at(CURVE, 30.5) == 1.7  # within 2 %: the same length of run
    assert bench.loss_at(CURVE, 40.0) is None  # the run stopped well before 40 s
