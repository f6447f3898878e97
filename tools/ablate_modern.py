"""The modern recipe at the book model's size, with one of its changes taken out at a time.

    .venv/bin/python tools/ablate_modern.py [--steps 130] [--seeds 0,1,2,3] [--workers 2]
        [--out book/data/modern_ablation.json]

The modern-GPT chapter measures each change on a two-layer model for 100 steps, where
ReLU², dropping the biases and gains, the untied zero-initialised head and QK-norm do not
pay; `GPTConfig.modern` keeps them. This tool checks them where the recipe is used: the
book model's shape (`GPTConfig.modern`), `TrainConfig.modern` for --steps steps (130 is the
length that reaches nanoGPT's final loss in the benchmark), each row on every seed, each
run's loss on the first 131,072 characters of the book's validation text (2,048 windows
of 64, the same for every run). A row's change is the mean of its paired differences from
the full recipe on the same seeds, with its standard error, t and one-sided p-value
(`minigpt.sweep.paired_difference`): a change of the recipe is supported when undoing it
raises the loss with p < 0.05, and a simplification (no biases and gains) stays unless
undoing it lowers the loss by the same test. The runs train side by side
(`minigpt.sweep.RunPool`, one thread each): about 35 s of CPU per run, the 24 runs of the
defaults about 7 minutes on a 2-core AMD EPYC.

With --out, the losses and everything that made them (each run's model and training
configuration, the PyTorch version, the CPU kernels) are written as JSON; the chapter prints
its table from the copy in book/data/, and tests/test_ablate.py checks that the copy's
configurations are still the ones this tool would train. Seeded runs give the same bits on
every x86-64 CPU (`minigpt.PINNED_CPU_KERNELS`), so a rerun reproduces every loss exactly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt import GPTConfig
from minigpt.config import TrainConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.losses import full_loss
from minigpt.recipes.pretrained import environment
from minigpt.sweep import RunPool, paired_difference
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


def plan(vocab_size: int, rows: list[str], seeds: list[int],
         steps: int) -> list[tuple[GPTConfig, TrainConfig]]:
    """The runs, row by row and, within a row, seed by seed."""
    return [(GPTConfig.modern(vocab_size, **ROWS[row]),
             TrainConfig.modern(max_steps=steps, eval_interval=steps, eval_steps=1, seed=s))
            for row in rows for s in seeds]


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
    text = shakespeare_text()
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text)
    train_ids = np.asarray(tokenizer.encode_ordinary(train_text), dtype=np.uint16)
    val_ids = np.asarray(tokenizer.encode_ordinary(val_text), dtype=np.uint16)
    held_out = val_ids[:HELD_OUT_WINDOWS * 64 + 1]
    runs = plan(tokenizer.vocab_size, rows, seeds, args.steps)
    with RunPool(train_ids, val_ids, workers=args.workers) as pool:
        results = pool.train(runs)
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
        record = {
            "tool": "tools/ablate_modern.py", "steps": args.steps, "seeds": seeds,
            "held_out_windows": HELD_OUT_WINDOWS,
            **environment(),
            "rows": [{"name": row, "undo": ROWS[row], "simplification": row in SIMPLIFICATIONS,
                      "params": results[i * len(seeds)].metrics["num_parameters"],
                      "losses": [float(v) for v in losses[i]],
                      "runs": [{"model": model.model_dump(), "training": training.model_dump()}
                               for model, training in runs[i * len(seeds):(i + 1) * len(seeds)]]}
                     for i, row in enumerate(rows)]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
