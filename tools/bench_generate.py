"""Time `minigpt.generate` with and without its key-value cache.

    .venv/bin/python tools/bench_generate.py                 # both models, 5 rounds
    .venv/bin/python tools/bench_generate.py --rounds 9 --models gpt2-small

For each model (randomly initialised: speed does not depend on the weights)
the script generates the same greedy continuation with ``use_cache=True`` and
with ``use_cache=False``, alternating the two within every round so that the
load of a shared machine hits both alike, and prints the median time per
generated token of each and their ratio. It also checks that both produced the
same tokens. Models:

- ``book``: the book's trained-model shape (L4 H4 D128, T_max 64, V 70): a
  prompt of 8 tokens and 56 new ones, so the sequence fills the context;
- ``gpt2-small``: GPT-2 small (124M parameters, T_max 1024, V 50257): a prompt
  of 16 tokens and 112 new ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minigpt import GPT, GPTConfig, generate

MODELS = {
    "book": (dict(vocab_size=70, context_length=64, d_model=128, n_heads=4, n_layers=4), 8, 56),
    "gpt2-small": (GPTConfig.gpt2("small").model_dump(), 16, 112),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds")
    for name in args.models:
        fields, prompt_len, new = MODELS[name]
        torch.manual_seed(0)
        model = GPT(GPTConfig(**fields)).eval()
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                               generator=torch.Generator().manual_seed(1))
        times: dict[bool, list[float]] = {True: [], False: []}
        outputs: dict[bool, torch.Tensor] = {}
        generate(model, prompt, 4, greedy=True)  # warm-up
        for round_ in range(args.rounds):
            for use_cache in ((True, False) if round_ % 2 == 0 else (False, True)):
                start = time.perf_counter()
                outputs[use_cache] = generate(model, prompt, new, greedy=True,
                                              use_cache=use_cache)
                times[use_cache].append((time.perf_counter() - start) / new)
        same = torch.equal(outputs[True], outputs[False])
        with_cache = statistics.median(times[True]) * 1e3
        without = statistics.median(times[False]) * 1e3
        print(f"{name}: prompt {prompt_len} + {new} new tokens | with cache {with_cache:.2f} "
              f"ms/token | without {without:.2f} ms/token | speed-up {without / with_cache:.1f}x "
              f"| same tokens: {same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
