"""Kept runs (`minigpt.recipes.runs`): what `RunPool.train` returns, trained once, then loaded
from the cache or fetched from the book's published runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_published import serving

from minigpt import products
from minigpt.config import GPTConfig, TrainConfig
from minigpt.files import WEIGHTS_NAME
from minigpt.recipes import pretrained, published, runs
from minigpt.sweep import RunPool
from minigpt.train import TrainResult

GENERATOR = np.random.default_rng(0)
TRAIN = GENERATOR.integers(0, 8, 2_000).astype(np.uint16)
VAL = GENERATOR.integers(0, 8, 400).astype(np.uint16)
POOL = RunPool(TRAIN, VAL, workers=1)  # trains in this process
SHAPE = GPTConfig(vocab_size=8, context_length=8, d_model=16, n_heads=2, n_layers=1)


def _run(seed: int, **training: Any) -> tuple[GPTConfig, TrainConfig]:
    return SHAPE, TrainConfig(**({"batch_size": 4, "max_steps": 6, "warmup_steps": 2,
                                  "eval_interval": 3, "eval_steps": 2, "seed": seed}
                                 | training))


PLAN = [_run(0), _run(1, lr=3e-3)]
#: What a rerun measures differently: its times.
TIMES = ("median_step_ms", "tokens_per_second", "train_seconds", "total_seconds")


def _same(a: TrainResult, b: TrainResult) -> None:
    assert a.model.training == b.model.training
    states = a.model.state_dict().items(), b.model.state_dict().items()
    for (name, x), (_, y) in zip(*states, strict=True):
        assert torch.equal(x, y), name
    assert {k: v for k, v in vars(a.history).items() if k != "step_ms"} == {
        k: v for k, v in vars(b.history).items() if k != "step_ms"}
    assert {k: v for k, v in a.metrics.items() if k not in TIMES} == {
        k: v for k, v in b.metrics.items() if k not in TIMES}


def test_a_kept_run_is_what_the_pool_trains_and_is_then_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINIGPT_CENSUS", raising=False)
    expected = POOL.train(PLAN)
    first = runs.trained_runs(PLAN, POOL, cache=tmp_path)
    for a, b in zip(first, expected, strict=True):
        _same(a, b)
    assert len(list((tmp_path / "runs").glob(f"*/{WEIGHTS_NAME}"))) == 2
    with monkeypatch.context() as m:
        m.setattr(RunPool, "train_recorded", lambda *a: pytest.fail("trained again"))
        again = runs.trained_runs(PLAN, POOL, cache=tmp_path)
    for a, b in zip(again, expected, strict=True):
        _same(a, b)
        assert a.metrics == next(r for r in first if r.history.loss == a.history.loss).metrics


def test_only_the_missing_runs_are_trained(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    runs.trained_runs(PLAN[:1], POOL, cache=tmp_path)
    trained: list[int] = []
    record = RunPool.train_recorded

    def counted(self: RunPool, plan: Any) -> Any:
        trained.append(len(plan))
        return record(self, plan)

    monkeypatch.setattr(RunPool, "train_recorded", counted)
    runs.trained_runs(PLAN, POOL, cache=tmp_path)
    assert trained == [1]


def test_the_key_is_over_the_run_and_its_data() -> None:
    hashes = runs.ids_sha256(TRAIN), runs.ids_sha256(VAL)
    key = runs.cache_key(runs.run_material(PLAN[0], *hashes))
    assert key == runs.cache_key(runs.run_material(_run(0), *hashes))
    assert key != runs.cache_key(runs.run_material(PLAN[1], *hashes))
    assert key != runs.cache_key(runs.run_material(_run(0, max_steps=7), *hashes))
    assert key != runs.cache_key(runs.run_material(PLAN[0], runs.ids_sha256(VAL), hashes[1]))
    # the same ids in another dtype or shape are other data
    assert runs.ids_sha256(TRAIN) != runs.ids_sha256(TRAIN.astype(np.int64))
    assert runs.ids_sha256(TRAIN) != runs.ids_sha256(TRAIN.reshape(40, 50))
    material = runs.run_material(PLAN[0], *hashes)
    assert material["source_sha256"] == pretrained.source_sha256(runs.RUN_MODULES)
    assert material["threads"] == 1


def test_a_damaged_kept_run_is_trained_again(tmp_path: Path) -> None:
    first = runs.trained_runs(PLAN[:1], POOL, cache=tmp_path)[0]
    weights = next((tmp_path / "runs").glob(f"*/{WEIGHTS_NAME}"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.warns(RuntimeWarning, match="is corrupted"):
        again = runs.trained_runs(PLAN[:1], POOL, cache=tmp_path)[0]
    _same(again, first)


def test_the_build_records_each_run_and_its_products(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "census"
    monkeypatch.setenv("MINIGPT_CENSUS", str(record))
    runs.trained_runs(PLAN, POOL, cache=tmp_path / "cache")
    trained = sorted(p.read_text() for p in record.glob("run-*.jsonl"))
    keys = (record / runs.RUNS_JOURNAL).read_text().splitlines()
    assert len(keys) == 2 and len(trained) == 2
    # loaded from the cache, the runs are recorded the same
    for path in record.iterdir():
        path.unlink()
    runs.trained_runs(PLAN, POOL, cache=tmp_path / "cache")
    assert (record / runs.RUNS_JOURNAL).read_text().splitlines() == keys
    assert sorted(p.read_text() for p in record.glob("run-*.jsonl")) == trained
    if products.mode() != "native":
        assert all(trained), "a run's training computed matrix products"


def test_a_published_run_is_fetched_not_trained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The publisher's cache: the run trained and kept, then published as tools/publish.py does.
    publisher = tmp_path / "publisher"
    runs.trained_runs(PLAN[:1], POOL, cache=publisher)
    folder = next(p for p in (publisher / "runs").iterdir() if p.is_dir())
    key = json.loads((folder / "manifest.json").read_text())["key"]
    site = tmp_path / "site"
    stored = {key: {"chapter": "experiments", **published.publish(folder, site)}}
    # A reader: an empty cache, the index that the repository holds, the site served.
    monkeypatch.setattr(published, "runs_index", lambda: stored)
    monkeypatch.setattr(published, "index", dict)
    monkeypatch.setattr(RunPool, "train_recorded", lambda *a: pytest.fail("trained"))
    with serving(site) as (url, requests):
        monkeypatch.setenv(published.URL_VARIABLE, url)
        fetched = runs.trained_runs(PLAN[:1], POOL, cache=tmp_path / "r")
    assert len(requests) == 2  # its weights and its record
    kept = runs.trained_runs(PLAN[:1], POOL, cache=publisher)
    _same(fetched[0], kept[0])
    assert fetched[0].metrics == kept[0].metrics  # the publisher's times too


def test_a_run_must_be_a_pair_of_configurations(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="run 1 is .*: each run must be a"):
        runs.trained_runs([PLAN[0], (SHAPE, {})], POOL, cache=tmp_path)  # type: ignore[list-item]


def test_runs_on_other_data_are_other_runs(tmp_path: Path) -> None:
    runs.trained_runs(PLAN[:1], POOL, cache=tmp_path)
    runs.trained_runs(PLAN[:1], RunPool(TRAIN[::-1].copy(), VAL, workers=1), cache=tmp_path)
    assert len(list((tmp_path / "runs").glob(f"*/{WEIGHTS_NAME}"))) == 2


def test_a_pool_whose_runs_are_all_kept_starts_no_process(tmp_path: Path) -> None:
    runs.trained_runs(PLAN, POOL, cache=tmp_path)
    with RunPool(TRAIN, VAL, workers=2) as pool:
        runs.trained_runs(PLAN, pool, cache=tmp_path)
        assert pool._pool is not None and not pool._pool._processes
