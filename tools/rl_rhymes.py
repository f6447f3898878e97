"""One run of the rewards chapter, with other steps or another rate: what chose the rates.

    .venv/bin/python tools/rl_rhymes.py --method METHOD [--steps N] [--lr LR] [--seed 0]
        [--validation] [--json runs.jsonl]

METHOD is ``cold`` (the cold start itself, evaluated) or one of `minigpt.rewards.METHODS`,
continued from the cold start (`minigpt.rewards.cold_model`, cached by set-up) with
`minigpt.rewards.continue_training`; ``--steps`` and ``--lr`` replace the recipe's
(`minigpt.rewards.STEPS`, `LR`). The run is evaluated by `minigpt.rewards.evaluate_run`: on
the chapter's held-out words, or with ``--validation`` on as many other held-out words,
none of the chapter's. The recipe's rates were chosen so: for each method, the rate of
1e-4, 3e-4, 6e-4, 1.2e-3 (SFT) or 1e-3 (GRPO, rejection sampling) with the best validation
pass@1 among those that kept the older families' exact match within 0.03 of the cold
start's. The chapter prints that sweep from book/data/rewards_sweep.jsonl, made so (one
thread a run, about two minutes each; the rows record the cold start's cache key, and the
chapter prints whether it is the one it continues):

    for m in grpo rft; do for lr in 0.0001 0.0003 0.001; do .venv/bin/python
        tools/rl_rhymes.py --validation --json book/data/rewards_sweep.jsonl
        --method $m --lr $lr; done; done
    (the same for sft-random and sft-frequent at 0.0003 0.0006 0.0012, and once
    with --method cold, first)

Prints the seconds of training (wall-clock and CPU), the evaluation and the samples to
three words; ``--json`` appends the run's numbers as one line. One thread; seeded, a run is
reproducible.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import get_args

import torch

from minigpt import rewards
from minigpt.rewards import REWARDS_RECIPE, Method, continue_training, evaluate_run, rewards_data

SHOWN = ("terror", "metaphor", "night")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", required=True, choices=("cold", *get_args(Method)))
    p.add_argument("--steps", type=int, help="optimiser steps (default: the recipe's)")
    p.add_argument("--lr", type=float, help="AdamW's rate (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0, help="questions drawn, answers sampled")
    p.add_argument("--validation", action="store_true",
                   help="evaluate on other held-out words than the chapter's")
    p.add_argument("--json", type=Path, help="append the run's numbers here, one line")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.method == "cold" and (args.steps is not None or args.lr is not None):
        p.error("the cold start is the cached one: --steps and --lr continue it, with a method")

    torch.set_num_threads(1)
    start, tok, cold_info = rewards.cold_model()
    data = rewards_data()
    if args.validation:  # as many held-out words again, none of the chapter's
        chapter = set(data.eval_rhymes)
        rest = [t for t in data.rhymes.test if t not in chapter]
        data = replace(data, eval_rhymes=random.Random(4321).sample(rest, len(data.eval_rhymes)))
    cold = args.method == "cold"
    # the cold start is trained already; a method takes the recipe's steps and rate unless told
    steps = 0 if cold else args.steps or REWARDS_RECIPE.steps[args.method]
    lr = None if cold else args.lr or REWARDS_RECIPE.lr[args.method]
    model = copy.deepcopy(start)
    seconds = cpu = 0.0
    history: dict[str, list[float]] = {}
    if not cold:
        t0, c0 = time.perf_counter(), time.process_time()
        history = continue_training(model, tok, args.method, data, seed=args.seed,
                                    steps=steps, lr=lr)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    ev = evaluate_run(model, start, tok, data, seed=args.seed)
    numbers = {k: v for k, v in ev.items() if k not in ("words", "answers", "greedy_answers")}
    row = {"method": args.method, "seed": args.seed, "validation": args.validation,
           "cold_start_key": cold_info.key,
           "steps": steps, "lr": lr, "seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
           **numbers, **{f"{k}_last10": statistics.fmean(v[-10:]) for k, v in history.items()}}
    print(json.dumps(row, indent=1))
    for word in [w for w in SHOWN if w in ev["words"]] or ev["words"][:3]:
        i = ev["words"].index(word)
        print(f"{word}: greedy {ev['greedy_answers'][i]!r}; sampled {ev['answers'][i][:8]}")
    if args.json is not None:
        with args.json.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
