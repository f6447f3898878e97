"""Time training steps or sampling on one thread: what `minigpt.products` costs.

    .venv/bin/python tools/bench_steps.py book [--steps 40]
    MINIGPT_PRODUCTS=native .venv/bin/python tools/bench_steps.py book

``book`` and ``modern`` take their recipes' steps (model, batch, optimiser) on the corpus;
``sft`` takes the modern recipe's steps at the assistants' context and batch (256 tokens, 8
conversations: the shapes of a fine-tuning step); ``sample`` samples 200 tokens from the
cached book model, one sequence, with its key-value cache, ``--steps`` times; ``grpo`` takes
GRPO steps of the rewards chapter's runs from their cold start (the cached ``rl-cold``: 16
questions a step, 8 answers sampled to each, then one optimiser step on them). Prints the
products' mode and the median milliseconds of a step or of a sampled token (the first, which
warms up, not counted). Pair the two modes with a benchmark runner that interleaves them
(docs/reproducibility.md).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import numpy as np
import torch

from minigpt import products
from minigpt.data import shakespeare_text
from minigpt.decoding import generate
from minigpt.recipes import pretrained, rewards
from minigpt.recipes.assistant import ASSISTANT_RECIPE
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=("book", "modern", "sft", "sample", "grpo"))
    parser.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    torch.set_num_threads(1)
    if args.recipe == "sample":
        model, tokenizer, _ = pretrained.book_model()
        prompt = tokenizer.encode_ordinary("ROMEO:\nBut soft, what light")
        per_token = []
        for run in range(args.steps + 1):
            torch.manual_seed(run)
            start = time.perf_counter()
            generate(model, prompt, 200)
            per_token.append((time.perf_counter() - start) / 200 * 1000)
        print(f"sample, products {products.mode()}: median {statistics.median(per_token[1:]):.2f} "
              f"ms a token over {args.steps} runs of 200 tokens")
        return 0
    if args.recipe == "grpo":
        start, chat, _ = rewards.cold_model()
        data = rewards.rewards_data()
        step_ms = []
        for run in range(args.steps + 1):  # one step a run: its own tasks and draws
            begin = time.perf_counter()
            rewards.continue_training(copy.deepcopy(start), chat, "grpo", data, seed=run,
                                      steps=1)
            step_ms.append((time.perf_counter() - begin) * 1000)
        print(f"grpo, products {products.mode()}: median {statistics.median(step_ms[1:]):.1f} "
              f"ms a step over {args.steps} steps")
        return 0
    recipe = pretrained.BOOK_RECIPE if args.recipe == "book" else pretrained.MODERN_RECIPE
    text = shakespeare_text()[:500_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode_ordinary(text), dtype=np.uint16)
    config = recipe.gpt_config(tokenizer.vocab_size)
    training = recipe.training.model_copy(update=dict(
        max_steps=args.steps + 1, warmup_steps=1, eval_interval=10**6, eval_steps=1))
    if args.recipe == "sft":
        config = config.model_copy(update={"context_length": ASSISTANT_RECIPE.context_length})
        training = training.model_copy(update={"batch_size": ASSISTANT_RECIPE.sft.batch_size})
    result = train(config, training, ids, ids[:20_000], progress=False)
    steps = result.history.step_ms[1:]
    print(f"{args.recipe}, products {products.mode()}: median {statistics.median(steps):.1f} "
          f"ms a step over {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
