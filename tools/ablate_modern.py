"""The modern recipe at the book model's size, with one of its changes taken out at a time.

    .venv/bin/python tools/ablate_modern.py [--steps 130] [--seeds 0,1] [--workers 2]

The modern-GPT chapter measures each change on a two-layer model for 100 steps, where
ReLU², dropping the biases and gains, and the untied zero-initialised head do not pay;
`GPTConfig.modern` keeps them. This tool checks them where the recipe is used: the book
model's shape (`GPTConfig.modern`), `TrainConfig.modern` for --steps steps (130 is the
length that reaches nanoGPT's final loss in the benchmark), each row on every seed, each
run's loss on the first 131,072 characters of the book's validation text (2,048 windows
of 64, the same for every run). A row's change is the mean of its paired differences from
the full recipe on the same seeds, with their standard error. The runs train side by side
(`minigpt.sweep.RunPool`, one thread each): about 45 s of CPU per run on this machine.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
import torch

from minigpt import GPTConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.sweep import RunPool
from minigpt.tokenizer import CharTokenizer
from minigpt.train import TrainConfig, full_loss

#: Each row undoes one change of the modern layout (the first row undoes nothing).
ROWS: dict[str, dict[str, Any]] = {
    "modern recipe": {},
    "GELU (tanh) for ReLU²": dict(activation="gelu_tanh"),
    "biases and norm gains": dict(bias=True, norm_weight=True),
    "tied head + GPT-2 init": dict(tie_weights=True, zero_init=False),
    "no QK-norm": dict(qk_norm=False),
    "learned positions": dict(positional="learned"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--seeds", default="0,1", help="comma-separated (at least two)")
    p.add_argument("--workers", type=int, help="processes (default: one per core)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated row names to run (the first is always run)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2:
        p.error("--seeds needs at least two seeds for a standard error")
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
    held_out = val_ids[:2048 * 64 + 1]
    runs = [(GPTConfig.modern(tokenizer.vocab_size, **ROWS[row]),
             TrainConfig.modern(max_steps=args.steps, eval_interval=args.steps,
                                eval_steps=1, seed=s))
            for row in rows for s in seeds]
    with RunPool(train_ids, val_ids, workers=args.workers) as pool:
        results = pool.train(runs)
    losses = np.array([full_loss(r.model, held_out) for r in results]).reshape(len(rows), -1)
    print(f"the modern recipe at the book model's size, {args.steps} steps, seeds {seeds}; "
          "loss on 2,048 held-out windows")
    print(f"{'row':24}" + "".join(f"{f'seed {s}':>8}" for s in seeds)
          + f"{'mean':>8}{'change':>8}{'se':>7}{'params':>10}")
    for i, row in enumerate(rows):
        diff = losses[i] - losses[0]
        se = diff.std(ddof=1) / math.sqrt(len(seeds))
        params = results[i * len(seeds)].metrics["num_parameters"]
        print(f"{row:24}" + "".join(f"{v:8.4f}" for v in losses[i])
              + f"{losses[i].mean():8.4f}{diff.mean():+8.4f}{se:7.4f}{params:10,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
