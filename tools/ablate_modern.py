"""The modern recipe at the book model's size, with one of its changes taken out at a time.

    .venv/bin/python tools/ablate_modern.py [--steps 130] [--seeds 0,1,2,3] [--workers 2]
        [--out book/data/modern_ablation.json]

The modern-GPT chapter measures each change on a two-layer model for 100 steps, where its
test does not keep the untied, zero-initialised layout without biases and gains, nor, in
the book's draw of the seeds, ReLU² or QK-norm alone; `GPTConfig.modern` keeps them all.
This tool checks them where the recipe is used: the book model's shape
(`GPTConfig.modern`), `TrainConfig.modern` for --steps steps (130 is the length that
reaches nanoGPT's final loss in the benchmark), each row on every seed, each run's loss on
the first 131,072 characters of the book's validation text (2,048 windows of 64, the same
for every run). A row's change is the mean of its paired differences from the full recipe
on the same seeds, with its standard error, t and one-sided p-value
(`minigpt.sweep.paired_difference`): a change of the recipe is supported when undoing it
raises the loss with p < 0.05, and a simplification (no biases and gains) stays unless
undoing it lowers the loss by the same test. The runs train side by side
(`minigpt.sweep.RunPool`, one thread each): about 35 s of CPU per run, the 24 runs of the
defaults about 14 CPU-minutes.

The runs are kept like the chapters' sweeps (`minigpt.recipes.runs.trained_runs`): each is
cached under a key over everything that decides its bits, so a second call with the same
code trains nothing. A run's bits are decided by its model and training configurations, the
token ids it trains and is evaluated on, the code of the package's modules that train it
(`minigpt.recipes.runs.RUN_MODULES`) and the environment (`minigpt.recipes.pretrained.
environment`: the PyTorch version, its CPU kernels and MKL's mode, how matrix products are
summed, and the redraw of the random streams). Two settings of that environment draw other
bits on purpose: ``MINIGPT_PRODUCTS=native`` (PyTorch's own matrix products) and
``MINIGPT_SEED_SHIFT`` (another draw of every random stream); a record made under either is
another draw of the table, not the book's.

With --out, the record is written as JSON: the losses, and what made them and what they
made: the sha256 of the training code, the environment, the sha256 of the token ids, and
for each run its configurations, its cache key and the sha256 of its final weights (as a
kept run's manifest holds them). The chapter prints its table from the copy in book/data/;
tests/test_ablate.py checks that the copy's configurations are still the ones this tool
would train, and that its code, environment and keys are today's (a record left from older
code fails it; `REGENERATE` says what to run). Seeded runs give the same bits on every
x86-64 CPU (`minigpt.PINNED_CPU_KERNELS`), so a rerun reproduces every loss exactly.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt import GPTConfig
from minigpt.config import TrainConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.losses import full_loss
from minigpt.recipes.pretrained import cache_key, environment, source_sha256, weights_bytes
from minigpt.recipes.runs import RUN_MODULES, ids_sha256, run_material, trained_runs
from minigpt.sweep import Run, RunPool, paired_difference
from minigpt.tokenizer import CharTokenizer

#: Each row undoes one change of the modern layout (the first row undoes nothing).
ROWS: dict[str, dict[str, Any]] = {
    "modern recipe": {},
    "GELU (tanh) for ReLU²": dict(activation="gelu_tanh"),
    "biases and norm gains": dict(bias=True, norm_weight=True),
    "tied head + GPT-2 init": dict(tie_weights=True, zero_init=False),
    "no QK-norm": dict(qk_norm=False),
    "learned positions": dict(positional="learned"),
}
#: Rows that undo a simplification: the recipe keeps it unless undoing it lowers the loss.
SIMPLIFICATIONS = ("biases and norm gains",)
HELD_OUT_WINDOWS = 2048  # of 64 characters
#: Where the chapter reads the record, and how to make it again.
RECORD = Path(__file__).resolve().parents[1] / "book" / "data" / "modern_ablation.json"
REGENERATE = (".venv/bin/python tools/ablate_modern.py --out book/data/modern_ablation.json "
              "(about 14 CPU-minutes), then read the modern-GPT chapter's prose against the "
              "new table")
#: What the record says of its bits.
BITS = ("Each run's weights, and so its loss, are decided by its two configurations, the "
        "sha256 of its training and held-out token ids, the code of the modules "
        "`source_sha256` covers and `environment`; `key` hashes them all "
        "(minigpt.recipes.runs.run_material). MINIGPT_PRODUCTS=native and MINIGPT_SEED_SHIFT "
        "draw other bits: `environment` records both ('products', 'seed_shift').")


def book_ids() -> tuple[int, np.ndarray, np.ndarray]:
    """The character vocabulary's size and the book's training and validation token ids."""
    text = shakespeare_text()
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text)
    train_ids = np.asarray(tokenizer.encode_ordinary(train_text), dtype=np.uint16)
    val_ids = np.asarray(tokenizer.encode_ordinary(val_text), dtype=np.uint16)
    return tokenizer.vocab_size, train_ids, val_ids


def plan(vocab_size: int, rows: list[str], seeds: list[int], steps: int) -> list[Run]:
    """The runs, row by row and, within a row, seed by seed."""
    return [(GPTConfig.modern(vocab_size, **ROWS[row]),
             TrainConfig.modern(max_steps=steps, eval_interval=steps, eval_steps=1, seed=s))
            for row in rows for s in seeds]


def run_keys(runs: list[Run], train_ids: np.ndarray, val_ids: np.ndarray) -> list[str]:
    """Each run's cache key under today's code and environment (`trained_runs` keeps it so)."""
    hashes = ids_sha256(train_ids), ids_sha256(val_ids)
    return [cache_key(run_material(run, *hashes)) for run in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--seeds", default="0,1,2,3", help="comma-separated (at least two)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated row names to run (the first is always run)")
    p.add_argument("--out", type=Path, help="write the runs and their losses as JSON here")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        p.error("--seeds needs at least two distinct seeds for a standard error")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    rows = ["modern recipe", *(r for r in args.rows.split(",") if r != "modern recipe")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; the rows are {list(ROWS)}")
    torch.set_num_threads(1)
    vocab_size, train_ids, val_ids = book_ids()
    held_out = val_ids[:HELD_OUT_WINDOWS * 64 + 1]
    runs = plan(vocab_size, rows, seeds, args.steps)
    with RunPool(train_ids, val_ids, workers=args.workers) as pool:
        # row by row: a row's runs are kept as soon as they are trained, so an
        # interrupted call resumes at the row it stopped in
        n = len(seeds)
        results = []
        for i, row in enumerate(rows):
            results += trained_runs(runs[i * n:(i + 1) * n], pool)
            print(f"{row}: {n} runs trained or kept", flush=True)
    losses = np.array([full_loss(r.model, held_out) for r in results]).reshape(len(rows), -1)
    print(f"the modern recipe at the book model's size, {args.steps} steps, seeds {seeds}; "
          f"loss on {HELD_OUT_WINDOWS:,} held-out windows")
    print(f"{'row':24}" + "".join(f"{f'seed {s}':>8}" for s in seeds)
          + f"{'mean':>8}{'change':>8}{'se':>7}{'t':>6}{'p':>7}")
    for i, row in enumerate(rows):
        line = f"{row:24}" + "".join(f"{v:8.4f}" for v in losses[i]) + f"{losses[i].mean():8.4f}"
        if i:
            change = paired_difference(losses[i], losses[0])
            line += (f"{change.mean:+8.4f}{change.se:7.4f}{change.t:6.1f}"
                     f"{1 - change.p_lower:7.3f}")  # p of "undoing it raises the loss"
        print(line)
    if args.out:
        keys = run_keys(runs, train_ids, val_ids)
        record = {
            "tool": "tools/ablate_modern.py", "steps": args.steps, "seeds": seeds,
            "held_out_windows": HELD_OUT_WINDOWS,
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "bits": BITS,
            "modules": list(RUN_MODULES), "source_sha256": source_sha256(RUN_MODULES),
            "environment": environment(),
            "train_sha256": ids_sha256(train_ids), "val_sha256": ids_sha256(val_ids),
            "rows": [{"name": row, "undo": ROWS[row], "simplification": row in SIMPLIFICATIONS,
                      "params": results[i * n].metrics["num_parameters"],
                      "losses": [float(v) for v in losses[i]],
                      "runs": [{"model": model.model_dump(), "training": training.model_dump(),
                                "key": key, "weights_sha256": hashlib.sha256(
                                    weights_bytes(result.model)).hexdigest()}
                               for (model, training), key, result in zip(
                                   runs[i * n:(i + 1) * n], keys[i * n:(i + 1) * n],
                                   results[i * n:(i + 1) * n], strict=True)]}
                     for i, row in enumerate(rows)]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
