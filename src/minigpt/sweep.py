"""Many small training runs at once, one per core: ablations and sweeps.

A model small enough to train many times uses one core well and a second one badly (its
matrices are too small to split), so a sweep runs whole runs side by side instead: each in
its own process with one thread. Every run is seeded by its own `TrainConfig`, so a run's
result does not depend on which process ran it or what ran beside it: `train_many` returns
exactly what calling `train` on each run in turn (with one thread) returns.

`paired_difference` reads an ablation: a change against a reference, seed by seed, with a
paired t-test; `welch_difference` compares two groups of runs that are not paired (Welch's
t-test).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minigpt import products
from minigpt.config import GPTConfig, TrainConfig
from minigpt.train import TrainResult, train

#: A run: the model to build and how to train it.
Run = tuple[GPTConfig, TrainConfig]

_DATA: dict[str, np.ndarray] = {}  # each worker's copy of the token ids, sent once


def _start_worker(train_data: np.ndarray, val_data: np.ndarray) -> None:
    torch.set_num_threads(1)
    _DATA["train"], _DATA["val"] = train_data, val_data


def _run(run: Run) -> TrainResult:
    return train(*run, _DATA["train"], _DATA["val"], progress=False)


def _run_recorded(run: Run) -> tuple[TrainResult, list[Any]]:
    with products.census() as calls:
        result = train(*run, _DATA["train"], _DATA["val"], progress=False)
    return result, calls


def check_runs(runs: Sequence[Run]) -> list[Run]:
    """``runs`` as a list, each checked to be a (GPTConfig, TrainConfig) pair."""
    runs = list(runs)
    for i, run in enumerate(runs):
        if (not isinstance(run, tuple) or len(run) != 2 or not isinstance(run[0], GPTConfig)
                or not isinstance(run[1], TrainConfig)):
            raise TypeError(f"run {i} is {run!r}: each run must be a (GPTConfig, "
                            "TrainConfig) pair")
    return runs


class RunPool:
    """Processes that train runs side by side; use it as a context manager.

    ``workers`` processes (default: one per core) each train one run at a time with one
    thread, on the token ids given here (sent to each process once); ``workers=1`` trains
    in this process, one run after the other. New processes are started (not forked), so
    this works the same on every system and inside Jupyter; each pays for importing torch
    once (a second or two), which is why a pool is kept for a whole sweep. The processes
    start when the pool first trains.
    """

    def __init__(self, train_data: np.ndarray, val_data: np.ndarray, *,
                 workers: int | None = None) -> None:
        workers = os.cpu_count() or 1 if workers is None else workers
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._data = (np.asarray(train_data), np.asarray(val_data))
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        if workers > 1:
            self._pool = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=self._data)

    @property
    def data(self) -> tuple[np.ndarray, np.ndarray]:
        """The training and held-out token ids the runs train on."""
        return self._data

    def train(self, runs: Sequence[Run]) -> list[TrainResult]:
        """Train each (model config, training config) pair from scratch; results in order,
        each exactly what `train` on that pair with one thread returns."""
        return self._map(_run, runs)

    def train_recorded(self, runs: Sequence[Run]) -> list[tuple[TrainResult, list[Any]]]:
        """`train`, each result with the census of the matrix products its training computed
        (`minigpt.products.census`): what a kept run records (`minigpt.recipes.runs`)."""
        return self._map(_run_recorded, runs)

    def _map(self, function: Callable[[Run], Any], runs: Sequence[Run]) -> list[Any]:
        if self._closed:
            raise RuntimeError("this RunPool is closed: make a new one to train more runs")
        runs = check_runs(runs)
        if self._pool is None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            _DATA["train"], _DATA["val"] = self._data
            try:
                return [function(run) for run in runs]
            finally:
                torch.set_num_threads(threads)
                _DATA.clear()
        return list(self._pool.map(function, runs))

    def close(self) -> None:
        """Stop the processes (a pool that is closed cannot train again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._data = (np.empty(0), np.empty(0))
        self._closed = True

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def train_many(runs: Sequence[Run], train_data: np.ndarray,
               val_data: np.ndarray, *, workers: int | None = None) -> list[TrainResult]:
    """`RunPool.train` on a pool made for these runs alone (at most one process per run)."""
    runs = list(runs)
    workers = min(len(runs), os.cpu_count() or 1) if workers is None else workers
    with RunPool(train_data, val_data, workers=workers) as pool:
        return pool.train(runs)


# ------------------------------------------------------------------ reading an ablation

@dataclass(frozen=True)
class Paired:
    """A change measured seed by seed against a reference (`paired_difference`).

    Attributes:
        mean: the mean of the paired differences (change minus reference).
        se: its standard error, the differences' standard deviation over sqrt(n).
        t: mean / se (-inf or +inf when every difference is the same nonzero number,
            nan when they are all zero).
        p_lower: P(T <= t) for T Student's t with n - 1 degrees of freedom: the chance of a
            t this low if the change did nothing (the differences centred on zero, normal),
            the one-sided p-value of "the change lowers the loss".
    """

    mean: float
    se: float
    t: float
    p_lower: float


def paired_difference(values: Sequence[float] | np.ndarray,
                      reference: Sequence[float] | np.ndarray) -> Paired:
    """Compare ``values`` with ``reference`` pair by pair (one pair per seed, n >= 2)."""
    a = np.asarray(values, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) < 2:
        raise ValueError(f"need two 1-d sequences of the same length >= 2 (one value per "
                         f"seed), got shapes {a.shape} and {b.shape}")
    diff = a - b
    mean, se = float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff)))
    if se > 0:
        t = mean / se
    else:
        t = math.nan if mean == 0 else math.copysign(math.inf, mean)
    p = math.nan if math.isnan(t) else student_t_cdf(t, len(diff) - 1)
    return Paired(mean, se, t, p)


@dataclass(frozen=True)
class Welch:
    """Two groups of runs compared without pairing them (`welch_difference`).

    Attributes:
        mean: mean(values) - mean(reference). se: its standard error,
            sqrt(var_a / n_a + var_b / n_b) with each sample variance (n - 1).
        t: mean / se. dof: the Welch-Satterthwaite degrees of freedom (not an integer).
        p_two_sided: P(|T| >= |t|) for T Student's t with ``dof`` degrees of freedom.
    """

    mean: float
    se: float
    t: float
    dof: float
    p_two_sided: float


def welch_difference(values: Sequence[float], reference: Sequence[float]) -> Welch:
    """Welch's t-test of mean(values) - mean(reference), two groups of at least two runs
    each whose spreads may differ; at least one group must vary."""
    a = np.asarray(values, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.ndim != 1 or b.ndim != 1 or len(a) < 2 or len(b) < 2:
        raise ValueError(f"need two 1-d sequences of at least two values each, got shapes "
                         f"{a.shape} and {b.shape}")
    va, vb = float(a.var(ddof=1)) / len(a), float(b.var(ddof=1)) / len(b)
    if va + vb == 0:
        raise ValueError("both groups are constant: Welch's test needs some spread")
    mean = float(a.mean() - b.mean())
    se = math.sqrt(va + vb)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    t = mean / se
    return Welch(mean, se, t, dof, 2 * student_t_cdf(-abs(t), dof))


def student_t_cdf(x: float, dof: float) -> float:
    """P(T <= x) for Student's t distribution with ``dof`` degrees of freedom (any real
    dof >= 1: Welch's test gives fractional ones).

    With u = sqrt(dof) tan(theta) the density's integral from 0 to x becomes
    Gamma((dof+1)/2) / (sqrt(pi) Gamma(dof/2)) times the integral of cos(theta)^(dof-1)
    from 0 to arctan(x / sqrt(dof)): a smooth integrand on a bounded interval, which
    Simpson's rule on 2,001 points integrates to about 1e-12.
    """
    if not dof >= 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if math.isnan(x):
        raise ValueError("x must be a number, got nan")
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    end = math.atan(abs(x) / math.sqrt(dof))
    theta = np.linspace(0.0, end, 2001)
    weights = np.ones(2001)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    integral = float(weights @ np.cos(theta) ** (dof - 1)) * end / 6000
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(math.pi)
    half = min(0.5, scale * integral)  # (rounding can take it a hair past 1/2)
    return 0.5 + half if x >= 0 else 0.5 - half
