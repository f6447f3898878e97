"""The rewards chapter's rate sweep: one run is `python -m minigpt rl` on one thread.

    .venv/bin/python tools/rl_rhymes.py --method METHOD [--steps N] [--lr LR] [--seed 0]
        [--validation] [--json runs.jsonl]

is ``python -m minigpt rl --threads 1 ...`` (its ``--help`` says what each flag does):
METHOD is ``cold`` (the cold start itself, evaluated) or one of `minigpt.rewards.METHODS`,
continued from the cold start with the recipe's steps and rate unless told. The recipe's
rates (`minigpt.rewards.LR`) were chosen so: for each method, the rate of 1e-4, 3e-4,
6e-4, 1.2e-3 (SFT) or 1e-3 (GRPO, rejection sampling) with the best ``--validation``
pass@1 among those that kept the older families' exact match within 0.03 of the cold
start's. The chapter prints that sweep from book/data/rewards_sweep.jsonl, made so (about
two minutes a run; each row records the cold start's cache key and the sha256 of its
weights, and the chapter prints whether those are the weights it continues: the key moves
with any change to the code that trains the runs, the weights only if the start changed):

    for m in grpo rft; do for lr in 0.0001 0.0003 0.001; do .venv/bin/python
        tools/rl_rhymes.py --validation --json book/data/rewards_sweep.jsonl
        --method $m --lr $lr; done; done
    (the same for sft-random and sft-frequent at 0.0003 0.0006 0.0012, and once
    with --method cold, first)
"""

from __future__ import annotations

import sys

from minigpt import cli


def main(argv: list[str] | None = None) -> int:
    return cli.main(["rl", "--threads", "1", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
