"""minigpt.sweep: runs trained side by side equal the same runs trained one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minigpt import GPTConfig
from minigpt.sweep import RunPool, train_many
from minigpt.train import TrainConfig, train

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
