"""A few steps of every kind of training set-up runs, as sha256s: run it on two CPUs and compare.

Set-up trains the book's models with seven kinds of run: the book recipe (AdamW), the modern
recipe (Muon), supervised fine-tuning of the modern model into an assistant, DPO from that
assistant, GRPO and rejection sampling from it (the rewards chapter's; its SFT runs are
supervised steps like the assistant's), and the inside-the-model chapter's copiers (their
own batch of repeated rows). Each kind here takes a few optimiser steps of its
recipe (its model, context, optimiser and schedule, but a small batch, on four plays, one
thread), the next one continuing from the last as set-up's chain does, and prints the sha256
of the weights after it. A chapter-like check follows: with a trained model (``--model``:
its weights, config and tokenizer, which `tests/test_same_bits.py` writes from the cached
book model), a greedy sample, the sha256 of one forward pass's attention weights, and one
weight as a chapter prints it.

Two CPUs that give the same lines train the same bits. `tests/test_same_bits.py` runs this
natively and under `qemu-x86_64` as an Intel CPU (Haswell) and an AMD one (EPYC):

    .venv/bin/python tools/same_bits.py
    qemu-x86_64 -cpu Haswell .venv/bin/python tools/same_bits.py

Output: one JSON object, name -> sha256 (or printed text), on stdout.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Importing minigpt pins the CPU kernels (minigpt.PINNED_CPU_KERNELS), before torch runs
# an operation.
from minigpt import pretrained
from minigpt.assistant import ASSISTANT_RECIPE
from minigpt.config import GPTConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.decoding import generate
from minigpt.dpo import make_pairs, train_dpo
from minigpt.interp import RECIPES, train_copier
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.rewards import REWARDS_RECIPE, coin
from minigpt.rhymes import SFTSettings, Vocabulary, rhymes_tasks, supervised_steps
from minigpt.rl import grpo_step, rft_step
from minigpt.sft import finetune, text_windows
from minigpt.tasks import Task, make_tasks
from minigpt.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_dict
from minigpt.train import train

#: The plays the runs read (about 550,000 characters): enough for every task family, and
#: little for an emulated CPU to read.
PLAYS = ("hamlet", "king-lear", "macbeth", "othello")
#: Tokens of the greedy sample.
SAMPLE_TOKENS = 60


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 of the model's weights, as `torch.save` writes its state dict."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def training_runs(steps: int, batch_size: int) -> dict[str, str]:
    """``steps`` optimiser steps of ``batch_size`` sequences (or pairs) of each kind of run
    set-up makes, chained as set-up chains them; the sha256 of the weights after each."""
    text = shakespeare_text(PLAYS)
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text, pretrained.BOOK_RECIPE.train_fraction)
    train_ids = np.asarray(tokenizer.encode_ordinary(train_text), dtype=np.uint16)
    val_ids = np.asarray(tokenizer.encode_ordinary(val_text), dtype=np.uint16)
    short = dict(max_steps=steps, warmup_steps=1, eval_interval=steps, eval_steps=1,
                 batch_size=batch_size)
    hashes: dict[str, str] = {}
    models: dict[str, GPT] = {}
    recipes = {"book": pretrained.BOOK_RECIPE, "draft": pretrained.DRAFT_RECIPE,
               "modern": pretrained.MODERN_RECIPE}
    for name, recipe in recipes.items():
        config = recipe.training.model_copy(update=short)
        result = train(recipe.gpt_config(tokenizer.vocab_size), config, train_ids, val_ids,
                       progress=False)
        models[name] = result.model
        hashes[name] = weights_sha256(result.model)
    recipe = ASSISTANT_RECIPE
    tasks = make_tasks(train_text, 2, 1, seed=recipe.task_seed)
    sft_config = recipe.sft.model_copy(update=short)
    sft, chat = finetune(models["modern"], tokenizer, tasks.train, tasks.test, sft_config,
                         replay=text_windows(train_text, 8, recipe.replay_chars),
                         max_turns=recipe.max_turns, context_length=recipe.context_length,
                         progress=False)
    hashes["sft"] = weights_sha256(sft.model)
    dpo_config = recipe.dpo.model_copy(update=short)
    dpo, _ = train_dpo(sft.model, chat, make_pairs(tasks.train), make_pairs(tasks.test, seed=1),
                       dpo_config, beta=recipe.beta, progress=False)
    hashes["dpo"] = weights_sha256(dpo.model)
    hashes |= reward_runs(sft.model, chat, tasks.train[:1], steps)
    copier = RECIPES["copy-0"].model_copy(update=dict(steps=steps, snapshot_every=steps,
                                                      probe_rows=2))
    hashes["copier"] = weights_sha256(train_copier(copier, text)[0])
    return hashes


def reward_runs(model: GPT, chat: Tokenizer, old: list[Task], steps: int) -> dict[str, str]:
    """``steps`` supervised steps on rhymes, GRPO steps and rejection-sampling steps from
    ``model``, as the rewards chapter's runs take them (their settings, but GRPO's and
    rejection sampling's four answers of at most four tokens to three questions, rewarded by
    a seeded coin, `minigpt.rewards.coin`: a gradient whatever the tiny run samples, with
    this seed groups whose coins differ)."""
    rhymes = rhymes_tasks(["night", "light"], Vocabulary({"night": 3, "light": 3, "might": 3}),
                          teacher="frequent")
    settings = REWARDS_RECIPE.grpo.model_copy(update={"group_size": 4, "max_new_tokens": 4})
    hashes = {}
    policy = copy.deepcopy(model)  # the cold start's and the SFT runs' steps: 8 short answers
    supervised_steps(policy, chat, rhymes * 4, SFTSettings(
        steps=steps, lr=REWARDS_RECIPE.lr["sft-random"], batch_size=8, replay_fraction=0.25),
        replay=old)
    hashes["rhymes sft"] = weights_sha256(policy)
    for kind, step in (("grpo", grpo_step), ("rft", rft_step)):
        policy = copy.deepcopy(model)
        optimizer = configure_optimizer(policy, lr=REWARDS_RECIPE.lr[kind], weight_decay=0.0)
        generator = torch.Generator().manual_seed(0)
        reward = coin(torch.Generator().manual_seed(1))
        for _ in range(steps):
            step(policy, optimizer, chat, rhymes + old, settings, generator=generator,
                 reward=reward)
        hashes[kind] = weights_sha256(policy)
    return hashes


def raw_mkl() -> dict[str, str]:
    """MKL's own products of inner dimension 64, 192 and 256, one of each: the two makers'
    CPUs sum the last in different orders (the README's "What reproduces where"), so two
    emulated CPUs that agree on it are not the two makers' paths."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for k in (64, 192, 256):
        a, b = torch.randn(96, k, generator=generator), torch.randn(k, 80, generator=generator)
        out[str(k)] = tensor_sha256(a @ b)
    return {"raw mkl": json.dumps(out, sort_keys=True)}


def chapter_checks(model_file: Path) -> dict[str, str]:
    """What a chapter prints of a trained model: a greedy sample and attention weights."""
    saved: dict[str, Any] = torch.load(model_file, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["config"]))
    model.load_state_dict(saved["state"])
    model.eval()
    tokenizer = tokenizer_from_dict(saved["tokenizer"])
    prompt = tokenizer.encode_ordinary("ROMEO:\nBut soft, what light")
    with torch.no_grad():
        sample = generate(model, prompt, SAMPLE_TOKENS, greedy=True).tolist()
        _, attention = model.forward_with_attention(torch.tensor([prompt]))
    return {"greedy sample": tokenizer.decode(sample[len(prompt):]),
            "attention sha256": tensor_sha256(torch.stack(attention)),
            "attention[layer 1, head 0, last row, first column]":
                f"{attention[1][0, 0, -1, 0].item():.4f}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1,
                        help="optimiser steps of each kind of run (default 1)")
    parser.add_argument("--batch-size", type=int, default=2,
                        help="sequences (DPO: pairs) a step, in place of each recipe's "
                             "(default 2)")
    parser.add_argument("--only", choices=("training", "chapter"),
                        help="the training runs only, or the chapter's checks only (default: "
                             "MKL's own products, the training runs, and the chapter's "
                             "checks if --model)")
    parser.add_argument("--model", type=Path,
                        help="a trained model: torch.save({'config': ..., 'state': ..., "
                             "'tokenizer': tokenizer.to_dict()})")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps and --batch-size must be at least 1, got {args.steps} and "
                     f"{args.batch_size}")
    if args.only == "chapter" and args.model is None:
        parser.error("--only chapter needs --model")
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    torch.set_num_threads(1)  # as set-up trains: one thread, the same reductions every run
    out: dict[str, str] = {"cpu kernels": torch.backends.cpu.get_cpu_capability()}
    if args.only is None:
        out |= raw_mkl()
    if args.only in (None, "training"):
        out |= training_runs(args.steps, args.batch_size)
    if (args.only is None and args.model is not None) or args.only == "chapter":
        out |= chapter_checks(args.model)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
