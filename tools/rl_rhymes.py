"""Learning from rewards on rhymes: the cold start, then seven ways to continue from it.

    .venv/bin/python tools/rl_rhymes.py --method METHOD [--model-dir DIR] [--cold cold.pt]
        [--steps N] [--lr LR] [--seed 0] [--eval-tasks 200] [--json runs.jsonl]

METHOD is one of:
    zero-shot      the chat model itself (``sft-0``), evaluated, not trained
    cold           the cold start (`minigpt.rhymes.cold_start`, `COLD_START`), evaluated
    grpo, grpo-kl  GRPO (`minigpt.rl.grpo_step`) without and with a KL penalty (beta 0.1)
                   to the cold start, rewarded by the checker (`minigpt.rhymes.checker`)
    rft            rejection-sampling fine-tuning (`minigpt.rl.rft_step`), the same checker
    sft-random     SFT on a random right answer to each word (`supervised_steps`)
    sft-frequent   SFT on the corpus's most frequent right answer
    grpo-leaky     GRPO rewarded by the leaky checker (any text with the right ending)
    grpo-random    GRPO rewarded by a fair coin, whatever the answer

Every method but the first two starts from the cold start, which is trained once and kept
in ``--cold`` (a state dict) for the next runs. Each step of GRPO and RFT asks 16 questions,
8 answers each (`GRPOSettings`' defaults but 12 new tokens at most), 12 of them rhymes and
4 of the older families (`minigpt.assistant.assistant_tasks`, rewarded by exact match);
an SFT step reads 8 conversations, 6 rhymes and 2 older ones. A run is a fixed number of
optimiser steps (``--steps``; the defaults, `STEPS`, take each method about 45-60 s on
one thread of a 2-core AMD EPYC shared with other work), timed without its evaluations.

Each run prints: the training seconds (wall-clock, and the process's CPU seconds, which
another program's load on the machine changes less); on ``--eval-tasks`` held-out rhymes words
(a seeded sample) the greedy right rate, sampled pass@1 and pass@8 and the distinct right
answers among 16 samples (`minigpt.rl.evaluate_sampled`, the true checker), the fraction of
groups of 8 all-equal beside its prediction p^8 + (1 - p)^8; the older families' exact
match on as many of their held-out tasks (`minigpt.tasks.exact_match`); the mean training
reward; then the share of samples that echo the asked word or that only the leaky checker
accepts, and the samples to three words. ``--json`` appends the run's numbers as one line.

The chat model is `minigpt.assistant.MODELS`' ``sft-0`` (trained at set-up, or loaded from
its cache); ``--model-dir`` reads its weights from a cache folder instead (``model.pt`` and
``manifest.json``), without the cache key's check. One thread; seeded, a run is
reproducible on one machine.
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

from minigpt import pretrained
from minigpt.assistant import MODELS, assistant_tasks
from minigpt.config import GPTConfig
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.rhymes import (
    COLD_START,
    FAMILY,
    SFTSettings,
    checker,
    cold_start,
    make_rhymes,
    scorer,
    supervised_steps,
)
from minigpt.rl import GRPOSettings, Reward, SampledEval, evaluate_sampled, grpo_step, rft_step
from minigpt.tasks import Task, exact_match
from minigpt.tokenizer import CHAT_TOKENS, CharTokenizer, Tokenizer, with_special_tokens

GRPO_METHODS = ("grpo", "grpo-kl", "grpo-leaky", "grpo-random")
SFT_METHODS = ("sft-random", "sft-frequent")
METHODS = ("zero-shot", "cold", *GRPO_METHODS, "rft", *SFT_METHODS)
#: Optimiser steps of each method: about 45-60 s of training on one thread here (a GRPO
#: step with its rollouts takes about 1 s, 1.5 s with the KL's two extra forward passes;
#: an RFT step 0.6 s, an SFT step 40 ms).
STEPS = {"grpo": 50, "grpo-kl": 35, "grpo-leaky": 50, "grpo-random": 50, "rft": 80,
         "sft-random": 1300, "sft-frequent": 1300}
#: AdamW's constant rate of each kind of method.
LR = {"grpo": 3e-4, "rft": 3e-4, "sft": 6e-4}
SETTINGS = GRPOSettings(group_size=8, max_new_tokens=12)
RHYMES_PER_STEP, OLD_PER_STEP = 12, 4  # 25 % older families
SFT_BATCH, SFT_REPLAY = 8, 0.25
SHOWN = ("terror", "metaphor", "night")


def kind(method: str) -> str:
    return "grpo" if method in GRPO_METHODS else "sft" if method in SFT_METHODS else method


def load_chat_model(model_dir: Path | None) -> tuple[GPT, Tokenizer]:
    """sft-0 and its chat tokenizer: from the package's cache, or from ``model_dir``."""
    if model_dir is None:
        model, tok, _ = MODELS["sft-0"]()
        return model.eval(), tok
    manifest = json.loads((model_dir / "manifest.json").read_text(encoding="utf-8"))
    model = GPT(GPTConfig(**manifest["key_material"]["model_config"]))
    model.load_state_dict(torch.load(model_dir / "model.pt", map_location="cpu",
                                     weights_only=True))
    chat = with_special_tokens(CharTokenizer.from_text(pretrained.corpus()), CHAT_TOKENS)
    assert chat.vocab_size == model.config.vocab_size, "the model reads this tokenizer"
    return model.eval(), chat


def coin_reward(generator: torch.Generator) -> Reward:
    """A fair coin for each rhymes answer, whatever it says; exact match for the others."""

    def reward(answers: Sequence[str], tasks: Sequence[Task]) -> torch.Tensor:
        coins = torch.randint(0, 2, (len(answers),), generator=generator).float()
        exact = torch.tensor([float(a == t.answer) for a, t in zip(answers, tasks, strict=True)])
        rhymes = torch.tensor([t.family == FAMILY for t in tasks])
        return torch.where(rhymes, coins, exact)

    return reward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--model-dir", type=Path, help="a cached sft-0 folder (model.pt, manifest)")
    p.add_argument("--cold", type=Path, default=Path("rhymes-cold-start.pt"),
                   help="where the cold start's weights are kept")
    p.add_argument("--steps", type=int, help=f"optimiser steps (default: {STEPS})")
    p.add_argument("--lr", type=float, help=f"AdamW's rate (default: {LR})")
    p.add_argument("--seed", type=int, default=0, help="questions drawn, answers sampled")
    p.add_argument("--eval-tasks", type=int, default=200, help="held-out tasks evaluated")
    p.add_argument("--json", type=Path, help="append the run's numbers here, one line")
    args = p.parse_args(argv)
    for name in ("steps", "eval_tasks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.lr is not None and not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.model_dir is not None and not (args.model_dir / "model.pt").is_file():
        p.error(f"--model-dir {args.model_dir} holds no model.pt")
    method, k = args.method, kind(args.method)
    steps = args.steps if args.steps is not None else STEPS.get(method, COLD_START.steps)
    lr = args.lr if args.lr is not None else LR.get(k, COLD_START.lr)

    torch.set_num_threads(1)
    model, tok = load_chat_model(args.model_dir)
    text = pretrained.corpus()
    vocab, rhymes = make_rhymes(text, seed=0)
    _, frequent = make_rhymes(text, seed=0, teacher="frequent")
    old = assistant_tasks()
    pick = random.Random(1234)
    eval_rhymes = pick.sample(rhymes.test, min(args.eval_tasks, len(rhymes.test)))
    eval_old = pick.sample(old.test, min(args.eval_tasks, len(old.test)))
    right, leaky = scorer(checker(vocab)), scorer(checker(None))

    seconds = cpu = 0.0  # wall-clock and this process's CPU seconds of training
    rewards: list[tuple[float, float]] = []
    extra: dict[str, Any] = {}
    if method == "cold" or (method != "zero-shot" and not args.cold.is_file()):
        settings = SFTSettings(**(COLD_START.model_dump() | dict(
            steps=steps, lr=lr, seed=args.seed))) if method == "cold" else COLD_START
        t0, c0 = time.perf_counter(), time.process_time()
        model, losses = cold_start(model, tok, rhymes.train, old.train, settings)
        cold_seconds, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
        torch.save(model.state_dict(), args.cold)
        print(f"cold start: {settings}, {cold_seconds:.1f} s, loss {losses[0]:.3f} -> "
              f"{statistics.fmean(losses[-50:]):.3f} (mean of the last 50); kept in {args.cold}")
        if method == "cold":
            seconds, cpu = cold_seconds, cold_cpu
    elif method != "zero-shot":
        model.load_state_dict(torch.load(args.cold, map_location="cpu", weights_only=True))

    if method not in ("zero-shot", "cold"):
        reference = copy.deepcopy(model).requires_grad_(False)
        rng, generator = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
        if k == "sft":
            tasks = rhymes.train if method == "sft-random" else frequent.train
            settings_sft = SFTSettings(steps=steps, lr=lr, batch_size=SFT_BATCH,
                                       replay_fraction=SFT_REPLAY, seed=args.seed)
            t0, c0 = time.perf_counter(), time.process_time()
            losses = supervised_steps(model, tok, tasks, settings_sft, replay=old.train)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            extra["loss"] = [losses[0], statistics.fmean(losses[-50:])]
        else:
            reward: Reward = {"grpo-leaky": leaky, "grpo-random": coin_reward(
                torch.Generator().manual_seed(args.seed + 1))}.get(method, right)
            settings = SETTINGS.model_copy(update={"kl_coef": 0.1 if method == "grpo-kl" else 0.0})
            optimizer = configure_optimizer(model, lr=lr, weight_decay=0.0)
            kls: list[float] = []
            for _ in range(steps):
                ts = rng.sample(rhymes.train, RHYMES_PER_STEP) + rng.sample(old.train, OLD_PER_STEP)
                t0, c0 = time.perf_counter(), time.process_time()
                if k == "rft":
                    stats: Any = rft_step(model, optimizer, tok, ts, settings,
                                          generator=generator, reward=reward)
                else:
                    stats = grpo_step(model, optimizer, tok, ts, settings, generator=generator,
                                      reward=reward,
                                      reference=reference if settings.kl_coef > 0 else None)
                    kls.append(stats.kl if stats.kl is not None else float("nan"))
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - c0
                rewards.append((stats.reward, stats.zero_signal))
            extra["zero_signal_first10"] = statistics.fmean(z for _, z in rewards[:10])
            extra["zero_signal_last10"] = statistics.fmean(z for _, z in rewards[-10:])
            if settings.kl_coef > 0:
                extra["kl_last10"] = statistics.fmean(kls[-10:])
        model.eval()

    extra["cpu_seconds"] = round(cpu, 1)
    report(method, steps if method != "zero-shot" else 0, lr, seconds, rewards, extra, model, tok,
           eval_rhymes, eval_old, right, leaky, args)
    return 0


def report(method: str, steps: int, lr: float, seconds: float,
           rewards: list[tuple[float, float]], extra: dict[str, Any], model: GPT, tok: Tokenizer,
           eval_rhymes: list[Task], eval_old: list[Task], right: Reward, leaky: Reward,
           args: argparse.Namespace) -> None:
    seed = 10_000 + args.seed
    t0 = time.perf_counter()
    ev: SampledEval = evaluate_sampled(model, tok, eval_rhymes, reward=right,
                                       generator=torch.Generator().manual_seed(seed))
    # the same draws (the same seed), judged by the leaky checker
    ev_leaky = evaluate_sampled(model, tok, eval_rhymes, reward=leaky,
                                generator=torch.Generator().manual_seed(seed))
    em = exact_match(model, tok, eval_old)
    eval_seconds = time.perf_counter() - t0
    samples = [a for answers in ev.answers for a in answers]
    asked = [t.word for t in eval_rhymes for _ in range(ev.n)]
    echo = statistics.fmean(a == w for a, w in zip(samples, asked, strict=True))
    train_reward = statistics.fmean(r for r, _ in rewards) if rewards else None
    last_reward = statistics.fmean(r for r, _ in rewards[-10:]) if rewards else None
    row = {"method": method, "steps": steps, "lr": lr, "seconds": round(seconds, 1),
           "pass@1": ev.pass_at_1, "pass@8": ev.pass_at_k, "greedy": ev.greedy,
           "distinct_right": ev.distinct_right, "all_equal": ev.all_equal,
           "all_equal_predicted": ev.all_equal_predicted, "leaky_pass@1": ev_leaky.pass_at_1,
           "old_exact_match": statistics.fmean(em.values()), "old_by_family": em,
           "train_reward": train_reward, "train_reward_last10": last_reward,
           "echo": echo, "eval_seconds": round(eval_seconds, 1), **extra}
    shown = "-" if train_reward is None else f"{train_reward:.3f} (last 10 steps {last_reward:.3f})"
    print(f"{method}: {steps} steps at lr {lr:g}, {seconds:.1f} s of training\n"
          f"  held-out rhymes ({ev.tasks} words): pass@1 {ev.pass_at_1:.3f}  pass@8 "
          f"{ev.pass_at_k:.3f}  greedy {ev.greedy:.3f}  distinct right of 16 "
          f"{ev.distinct_right:.2f}  groups of 8 all-equal {ev.all_equal:.3f} (predicted "
          f"{ev.all_equal_predicted:.3f})\n"
          f"  leaky checker's pass@1 {ev_leaky.pass_at_1:.3f}  echoes of the word {echo:.3f}\n"
          f"  older families' exact match {row['old_exact_match']:.3f} "
          f"{ {f: round(v, 3) for f, v in em.items()} }\n"
          f"  training reward {shown}  {extra}\n  (evaluation {eval_seconds:.1f} s)")
    by_word = {t.word: i for i, t in enumerate(eval_rhymes)}
    for word in [w for w in SHOWN if w in by_word] or [t.word for t in eval_rhymes[:3]]:
        i = by_word[word]
        print(f"  {word}: greedy {ev.greedy_answers[i]!r}; sampled {list(ev.answers[i][:8])}")
    if args.json is not None:
        with args.json.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    raise SystemExit(main())
