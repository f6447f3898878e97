"""The chapters' sweeps and ablations, kept: each run trained once, then cached and published
like the book's models.

The experiments and modern-GPT chapters train dozens of small models side by side
(`minigpt.sweep.RunPool`): most of their execution time. `trained_runs` returns exactly what
the pool's `RunPool.train` returns for each run, but keeps each run in the cache, under a key over
everything that decides its result: its `GPTConfig` and `TrainConfig`, the sha256 of its
training and held-out token ids, one thread, the code of the package's modules that train it
(`RUN_MODULES`, by their code alone) and the environment (`minigpt.recipes.pretrained.
model_material`, as every cached model's key). A run is then, in `<cache>/runs/<key>/`:

    model.safetensors  its weights
    manifest.json      the key and what it was made from, the weights' sha256, the run's
                       metrics and history (as `train` measured them, times included) and
                       the census of the matrix products its training computed

A run the cache lacks is fetched if the book publishes it (`tests/notebooks/runs.json` holds
the hashes it must have; `minigpt.recipes.published`), and trained otherwise; the runs still
missing are trained together, side by side, by the pool (which starts its processes only
then). A run is bit for bit the same
whichever path gave it, so a chapter prints the same numbers; only the times it reports
(`median_step_ms`, `train_seconds`) are those of the machine that trained the run.

When the build records a chapter's execution (``MINIGPT_CENSUS``, a folder), each run the
chapter used is listed there in ``runs.txt`` and its census goes to the folder's journal,
whether it was trained, loaded or fetched: the build's record is the same either way
(`tools/baseline.py` writes `runs.json` from it, `tools/census.py` the products).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from minigpt.files import cache_dir
from minigpt.model import GPT
from minigpt.recipes.pretrained import (
    TRAINING_MODULES,
    cache_key,
    folder_lock,
    kept_model,
    model_material,
    store_model,
)
from minigpt.sweep import Run, RunPool, check_runs
from minigpt.train import History, TrainResult

log = logging.getLogger(__name__)

#: The package's modules that importing this one loads: the code that trains a kept run
#: (tests/test_pretrained.py checks the list).
RUN_MODULES = (*TRAINING_MODULES, "recipes.runs", "sweep")
#: The file, in a chapter's census folder, that lists the runs the chapter used.
RUNS_JOURNAL = "runs.txt"


def ids_sha256(ids: np.ndarray) -> str:
    """sha256 of token ids: their dtype, their shape and their bytes."""
    ids = np.ascontiguousarray(ids)
    digest = hashlib.sha256(f"{ids.dtype.str}{ids.shape}".encode())
    digest.update(ids.tobytes())
    return digest.hexdigest()


def run_material(run: Run, train_sha256: str, val_sha256: str) -> dict[str, Any]:
    """What a kept run's key is hashed from (`minigpt.recipes.pretrained.cache_key`)."""
    config, training = run
    return model_material(RUN_MODULES, config, train_config=training.model_dump(), threads=1,
                          train_sha256=train_sha256, val_sha256=val_sha256)


def run_folder(key: str, cache: Path | None = None) -> Path:
    """Where the run of cache key ``key`` is kept."""
    return (cache_dir() if cache is None else cache) / "runs" / key[:20]


def trained_runs(runs: Sequence[Run], pool: RunPool, *,
                 cache: Path | None = None) -> list[TrainResult]:
    """Each (model config, training config) pair trained from scratch on ``pool``'s data:
    exactly what ``pool.train(runs)`` returns, taken from the cache (or the book's published
    runs) where it is kept; the runs missing are trained by ``pool``, side by side, and
    kept."""
    runs = check_runs(runs)
    hashes = ids_sha256(pool.data[0]), ids_sha256(pool.data[1])
    materials = [run_material(run, *hashes) for run in runs]
    keys = [cache_key(material) for material in materials]
    found: dict[int, tuple[GPT, dict[str, Any]]] = {}
    for i, (key, material) in enumerate(zip(keys, materials, strict=True)):
        folder = run_folder(key, cache)
        with folder_lock(folder):
            if (kept := kept_model(folder, key, material)) is not None:
                found[i] = kept.model, kept.manifest
                keys[i] = kept.key  # the book's own run, where this machine's bits differ
    missing = [i for i in range(len(runs)) if i not in found]
    if missing:
        log.info("training %d of %d runs (%d kept)", len(missing), len(runs), len(found))
        made = pool.train_recorded([runs[i] for i in missing])
        for i, (result, census) in zip(missing, made, strict=True):
            folder = run_folder(keys[i], cache)
            with folder_lock(folder):
                found[i] = store_model(folder, keys[i], materials[i], (
                    result.model, result.metrics, asdict(result.history)), census)
    _journal(keys, [found[i][1] for i in range(len(runs))])
    results = []
    for i in range(len(runs)):
        model, manifest = found[i]
        # `train` hands its model back in training mode; so does a kept run.
        results.append(TrainResult(model.train(), History(**manifest["history"]),
                                   manifest["metrics"]))
    return results


def _journal(keys: list[str], manifests: list[dict[str, Any]]) -> None:
    """With ``MINIGPT_CENSUS``, list the runs in its `RUNS_JOURNAL` and journal their census."""
    folder = os.environ.get("MINIGPT_CENSUS")
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    with (path / RUNS_JOURNAL).open("a", encoding="utf-8") as runs:
        runs.writelines(f"{key}\n" for key in keys)
    for key, manifest in zip(keys, manifests, strict=True):
        (path / f"run-{key[:20]}.jsonl").write_text("".join(
            json.dumps(entry, separators=(",", ":")) + "\n"
            for entry in manifest["products"]), encoding="utf-8")
