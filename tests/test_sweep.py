"""minigpt.sweep: runs trained side by side equal the same runs trained one by one; the
paired t-test that reads an ablation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minigpt import GPTConfig
from minigpt.config import TrainConfig
from minigpt.sweep import RunPool, paired_difference, student_t_cdf, train_many, welch_difference
from minigpt.train import train

DATA = np.random.default_rng(0).integers(0, 11, 4000).astype(np.uint16)
MODEL = GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=2, n_layers=1)


def _runs(seeds: range) -> list[tuple[GPTConfig, TrainConfig]]:
    return [(MODEL, TrainConfig(batch_size=4, max_steps=6, warmup_steps=1, eval_interval=3,
                                eval_steps=1, seed=s)) for s in seeds]


def _alone(run: tuple[GPTConfig, TrainConfig]) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(*run, DATA[:3000], DATA[3000:], progress=False).history.loss
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_two_processes_give_each_run_exactly_what_train_gives() -> None:
    runs = _runs(range(3))
    with RunPool(DATA[:3000], DATA[3000:], workers=2) as pool:
        first = pool.train(runs)
        again = pool.train(runs[::-1])  # the pool is reused; order is kept
    assert [r.history.loss for r in first] == [_alone(run) for run in runs]
    assert [r.history.loss for r in again] == [r.history.loss for r in first[::-1]]
    assert len({r.history.loss[-1] for r in first}) == 3  # the seeds differ


def test_one_worker_trains_here_and_restores_the_thread_count() -> None:
    threads = torch.get_num_threads()
    results = train_many(_runs(range(2)), DATA[:3000], DATA[3000:], workers=1)
    assert torch.get_num_threads() == threads
    assert [r.history.loss for r in results] == [_alone(run) for run in _runs(range(2))]


def test_bad_runs_and_worker_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        RunPool(DATA, DATA, workers=0)
    with RunPool(DATA, DATA, workers=1) as pool, pytest.raises(
            TypeError, match="run 1 is .*: each run must be a \\(GPTConfig, TrainConfig\\)"):
        pool.train([_runs(range(1))[0], (MODEL, {"max_steps": 3})])
    pool = RunPool(DATA, DATA, workers=2)
    pool.close()
    with pytest.raises(RuntimeError, match="this RunPool is closed"):
        pool.train(_runs(range(1)))


# Student's t has closed forms for one, two and three degrees of freedom.
CLOSED_FORMS = {
    1: lambda t: 0.5 + math.atan(t) / math.pi,
    2: lambda t: 0.5 + t / (2 * math.sqrt(2 + t * t)),
    3: lambda t: 0.5 + (t / math.sqrt(3) / (1 + t * t / 3) + math.atan(t / math.sqrt(3)))
    / math.pi,
}


@given(st.floats(-1e6, 1e6), st.sampled_from(sorted(CLOSED_FORMS)))
def test_t_cdf_equals_the_closed_forms(x: float, dof: int) -> None:
    assert student_t_cdf(x, dof) == pytest.approx(CLOSED_FORMS[dof](x), abs=1e-10)


@given(st.floats(-50, 50), st.integers(1, 200))
def test_t_cdf_is_symmetric_and_increasing(x: float, dof: int) -> None:
    assert student_t_cdf(-x, dof) == pytest.approx(1 - student_t_cdf(x, dof), abs=1e-12)
    # increasing, up to the quadrature's error (about 1e-12) where both are within
    # rounding of 1 or 0
    assert student_t_cdf(x + 0.5, dof) >= student_t_cdf(x, dof) - 1e-12
    if abs(x) < 3:  # where the tails are not yet 1 or 0 to double precision
        assert student_t_cdf(x + 0.5, dof) > student_t_cdf(x, dof)


def test_t_cdf_at_tabled_quantiles() -> None:
    # Two-sided 95 % and one-sided 95 % points of the usual t tables.
    for dof, q, p in ((3, 2.353363, 0.95), (3, 3.182446, 0.975), (10, 2.228139, 0.975),
                      (30, 1.697261, 0.95)):
        assert student_t_cdf(q, dof) == pytest.approx(p, abs=1e-6)
    assert student_t_cdf(math.inf, 4) == 1.0 and student_t_cdf(-math.inf, 4) == 0.0
    normal = 0.5 * (1 + math.erf(1.5 / math.sqrt(2)))  # many degrees: the normal
    assert student_t_cdf(1.5, 100_000) == pytest.approx(normal, abs=1e-5)


def test_paired_difference_reads_the_pairs() -> None:
    got = paired_difference([2.0, 2.5, 3.1, 2.2], [2.1, 2.7, 3.2, 2.2])
    diff = np.array([-0.1, -0.2, -0.1, 0.0])
    se = diff.std(ddof=1) / 2
    assert got.mean == pytest.approx(diff.mean()) and got.se == pytest.approx(se)
    assert got.t == pytest.approx(diff.mean() / se)
    assert got.p_lower == pytest.approx(CLOSED_FORMS[3](got.t), abs=1e-10)
    # The pairing matters: the same values against shuffled references are far noisier.
    assert paired_difference([2.0, 2.5, 3.1, 2.2], [2.7, 2.1, 2.2, 3.2]).p_lower > 0.3
    same = paired_difference([1.0, 2.0], [0.5, 1.5])
    assert same.t == math.inf and same.p_lower == 1.0
    assert math.isnan(paired_difference([1.0, 2.0], [1.0, 2.0]).t)


def test_welch_difference_follows_its_definition() -> None:
    a, b = [0.109, 0.107, 0.113], [0.093, 0.086, 0.078]
    got = welch_difference(a, b)
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 3
    assert got.mean == pytest.approx(np.mean(a) - np.mean(b))
    assert got.se == pytest.approx(math.sqrt(va + vb))
    assert got.dof == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2 / 2))
    assert 2 <= got.dof <= 4  # between the smaller group's n - 1 and n_a + n_b - 2
    assert got.p_two_sided == pytest.approx(2 * student_t_cdf(-abs(got.t), got.dof))
    # Equal sizes and spreads: Student's pooled test, n_a + n_b - 2 degrees of freedom.
    even = welch_difference([1.0, 2.0, 3.0], [0.0, 1.0, 2.0])
    assert even.dof == pytest.approx(4.0) and even.t == pytest.approx(math.sqrt(1.5))
    assert welch_difference(b, a).t == pytest.approx(-got.t)


def test_t_cdf_takes_fractional_degrees_between_its_neighbours() -> None:
    # fewer degrees of freedom, heavier tails
    assert student_t_cdf(-2.0, 2) > student_t_cdf(-2.0, 2.5) > student_t_cdf(-2.0, 3)


def test_bad_input_to_the_t_test_is_refused() -> None:
    with pytest.raises(ValueError, match="at least two values each"):
        welch_difference([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="both groups are constant"):
        welch_difference([1.0, 1.0], [2.0, 2.0])
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_difference([1.0], [1.0])
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_difference([1.0, 2.0], [1.0, 2.0, 3.0])
    for dof in (0, -2):
        with pytest.raises(ValueError, match="dof must be >= 1"):
            student_t_cdf(1.0, dof)
    with pytest.raises(ValueError, match="nan"):
        student_t_cdf(math.nan, 3)
