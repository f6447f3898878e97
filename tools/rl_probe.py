"""Learning from rewards on a cached assistant: GRPO steps, or a baseline at equal time.

    .venv/bin/python tools/rl_probe.py [--model sft-0] [--families reverse,first_word,last_word]
        [--steps 100] [--seconds S] [--every 10] [--lr 3e-5] [--group-size 8] [--prompts 16]
        [--temperature 1] [--max-new-tokens 12] [--kl-coef 0] [--scale std]
        [--length-norm sequence] [--seed 0] [--baseline sft|rft] [--json out.json]

From a cached chat model (`minigpt.assistant.MODELS`; by default ``sft-0``, the modern model
fine-tuned with seed 0), it trains on the training tasks (`assistant_tasks().train`) of
the chosen families, by default the three the fine-tuned model answers worst. Each step
draws ``--prompts`` questions (seeded) and takes one `minigpt.rl.grpo_step` on them, with
AdamW (`minigpt.optim.configure_optimizer`, no weight decay, a constant rate) and a frozen
copy of the starting model as the KL reference (the KL is measured whatever ``--kl-coef``).
Every ``--every`` steps it prints the steps' mean reward, their fraction of zero-signal
groups and KL, and the held-out greedy exact match per family (`minigpt.tasks.exact_match`
on `assistant_tasks().test`), with the training seconds so far (evaluations excluded); at
the start and the end, pass@1 and pass@8 (`minigpt.rl.pass_at_k`, 8 answers sampled at
temperature 1 per held-out question), and the exact match of every family (does training
three families cost the others?).

The baselines, for a comparison at equal training time (give the same ``--seconds``):
``--baseline sft`` continues supervised fine-tuning on the same families' training tasks
(`minigpt.sft.encode_tasks`, `minigpt.train.train_step` with the assistants' batch size
and gradient clip; the default rate is the one their schedule ends at, `SFT_TRAINING`'s
``min_lr``); ``--baseline rft`` (rejection-sampling fine-tuning, `minigpt.rl.rft_step`)
samples answers exactly as GRPO does and takes a supervised step on the right ones alone.

One thread, as set-up trains; seeded, a run is reproducible on one machine. A GRPO step of
16 questions x 8 answers takes about 1 s on one core of a 2-core AMD EPYC.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minigpt.assistant import MODELS, assistant_tasks
from minigpt.chat import prompt_ids
from minigpt.config import TrainConfig
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.rl import GRPOSettings, grpo_step, pass_at_k, rft_step, rollouts, score
from minigpt.sft import SFT_TRAINING, encode_tasks
from minigpt.tasks import FAMILIES, Task, exact_match
from minigpt.tokenizer import Tokenizer
from minigpt.train import train_step

#: The families the fine-tuned assistants answer worst (held-out exact match, the mean of
#: the three seeds: 0.917, 0.955 and 0.962).
WEAKEST = ("reverse", "first_word", "last_word")
CHAT_MODELS = tuple(name for name in MODELS if name.startswith(("sft", "dpo")))
PASS_SAMPLES = 8


def sampled_pass(model: GPT, tok: Tokenizer, tasks: Sequence[Task], settings: GRPOSettings,
                 seed: int) -> dict[str, float]:
    """pass@1 and pass@8 over ``tasks``, from 8 answers sampled to each at temperature 1."""
    prompts = [prompt_ids(t.conversation()[:1], tok) for t in tasks]
    out = rollouts(model, tok, prompts, group_size=PASS_SAMPLES, temperature=1.0,
                   max_new_tokens=settings.max_new_tokens,
                   generator=torch.Generator().manual_seed(seed))
    right = score(out.texts, [t for t in tasks for _ in range(PASS_SAMPLES)])
    counts = right.view(len(tasks), PASS_SAMPLES).sum(dim=1).long().tolist()
    return {f"pass@{k}": statistics.fmean(pass_at_k(PASS_SAMPLES, c, k) for c in counts)
            for k in (1, PASS_SAMPLES)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="sft-0", choices=CHAT_MODELS)
    p.add_argument("--families", default=",".join(WEAKEST), help="comma-separated")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seconds", type=float, help="stop once training took this long")
    p.add_argument("--every", type=int, default=10, help="evaluate every this many steps")
    p.add_argument("--baseline", choices=("sft", "rft"), help="a baseline instead of GRPO")
    p.add_argument("--lr", type=float, help="default: 3e-5 (GRPO, rft); SFT's min_lr (sft)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="questions per step")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--scale", choices=("std", "none"), default="std")
    p.add_argument("--length-norm", choices=("sequence", "constant"), default="sequence")
    p.add_argument("--seed", type=int, default=0, help="questions drawn and answers sampled")
    p.add_argument("--no-pass", action="store_true", help="skip pass@k (saves ~20 s)")
    p.add_argument("--json", type=Path, help="write the settings and the curve here")
    args = p.parse_args(argv)
    families = args.families.split(",")
    if not families or any(f not in FAMILIES for f in families):
        p.error(f"--families must be comma-separated names from {sorted(FAMILIES)}")
    for name in ("steps", "every", "prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    try:
        settings = GRPOSettings(
            group_size=args.group_size, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, clip=args.clip, kl_coef=args.kl_coef,
            scale=args.scale, length_norm=args.length_norm)
    except ValueError as why:
        p.error(str(why))
    lr = args.lr if args.lr is not None else (
        SFT_TRAINING["min_lr"] if args.baseline == "sft" else 3e-5)

    torch.set_num_threads(1)
    model, tok, _ = MODELS[args.model]()
    model.eval()
    split = assistant_tasks()
    train_tasks = [t for t in split.train if t.family in families]
    test_tasks = [t for t in split.test if t.family in families]
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = configure_optimizer(model, lr=lr, weight_decay=0.0)
    rng, generator = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    sft_data = encode_tasks(train_tasks, tok) if args.baseline == "sft" else None
    sft_clip = TrainConfig(**SFT_TRAINING).grad_clip
    mode = args.baseline or "grpo"
    print(f"{mode} from {args.model} on {', '.join(families)}: lr {lr:g}, {settings}, "
          f"{args.prompts} prompts a step, seed {args.seed}")

    def evaluate() -> dict[str, float]:
        em: dict[str, float] = exact_match(model, tok, test_tasks,
                                           max_new_tokens=args.max_new_tokens)
        return em | {"mean": statistics.fmean(em.values())}

    def ends(label: str) -> dict[str, Any]:
        result: dict[str, Any] = {"exact_match": exact_match(model, tok, split.test)}
        if not args.no_pass:
            result |= sampled_pass(model, tok, test_tasks, settings, seed=10_000 + args.seed)
        shown = {k: round(v, 3) for k, v in result.items() if k != "exact_match"}
        print(f"{label}: every family {result['exact_match']}  {shown}")
        return result

    before = ends("before")
    header = "  ".join(f"{f[:9]:>9}" for f in [*families, "mean"])
    print(f"{'step':>5} {'sec':>6} {'reward':>6} {'zero':>5} {'kl':>6}  {header}")
    curve: list[dict[str, Any]] = []
    window: list[dict[str, float]] = []
    seconds, step = 0.0, 0

    def report() -> None:
        em = evaluate()
        agg = {k: statistics.fmean(w[k] for w in window) if window and k in window[0] else
               float("nan") for k in ("reward", "zero_signal", "kl")}
        curve.append({"step": step, "seconds": seconds, **agg, "exact_match": em})
        cells = "  ".join(f"{em[f]:9.3f}" for f in [*families, "mean"])
        print(f"{step:5d} {seconds:6.1f} {agg['reward']:6.3f} {agg['zero_signal']:5.2f} "
              f"{agg['kl']:6.3f}  {cells}", flush=True)
        window.clear()

    report()
    while step < args.steps and (args.seconds is None or seconds < args.seconds):
        t0 = time.perf_counter()
        if sft_data is not None:
            batch = sft_data.get_batch(SFT_TRAINING["batch_size"], model.config.context_length,
                                       generator=generator)
            train_step(model.train(), optimizer, [batch], grad_clip=sft_clip)
            model.eval()
            window.append({})
        elif args.baseline == "rft":
            rft = rft_step(model, optimizer, tok, rng.sample(train_tasks, args.prompts),
                           settings, generator=generator)
            window.append({"reward": rft.reward, "kept": rft.kept})
        else:
            stats = grpo_step(model, optimizer, tok, rng.sample(train_tasks, args.prompts),
                              settings, generator=generator, reference=reference)
            window.append({"reward": stats.reward, "zero_signal": stats.zero_signal,
                           "kl": stats.kl or 0.0})
        seconds += time.perf_counter() - t0
        step += 1
        if step % args.every == 0:
            report()
    if step % args.every:
        report()
    print(f"{seconds / max(step, 1):.3f} s a step over {step} steps")
    after = ends("after")
    if args.json is not None:
        args.json.write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "lr": lr, "curve": curve,
             "before": before, "after": after, "seconds_per_step": seconds / max(step, 1)},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
