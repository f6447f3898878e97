"""What the book computes, as sha256s: run it on two CPUs and compare.

Parts of the output (JSON keys):
- ``census``: every distinct product of a census (``--census tests/notebooks/products.json``:
  what set-up's models and the chapters compute, `tools/census.py`), recomputed through the
  package's kernels on seeded random operands (cut from one pool of random numbers, `POOL`):
  one sha256 per product.
- The training runs: a step of every kind of run set-up makes (the book recipe, its draft and
  the modern recipe, SFT, DPO, the rewards chapter's supervised, GRPO and rejection-sampling
  steps, a copier), chained as set-up chains them, the weights' sha256 after each. The draft
  and SFT take their recipes' own batches; the others ``--batch-size`` sequences. With
  ``--model`` (a trained model's weights, config and tokenizer), a greedy sample and one
  forward pass's attention weights.
- ``random``: the random draws a run makes (normal, uniform, integers, permutations,
  multinomial, Bernoulli and dropout masks), and ``raw mkl``: products MKL computes itself,
  past the package's kernels (what would part between CPU makers without them).

Two CPUs that give the same lines compute the same bits. `tests/test_same_bits.py` runs this
natively and under `qemu-x86_64` as an Intel CPU (Haswell) and an AMD one (EPYC), one process
each:

    .venv/bin/python tools/same_bits.py --census tests/notebooks/products.json
    qemu-x86_64 -cpu Haswell .venv/bin/python tools/same_bits.py --census ...

Output: one JSON object on stdout.
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
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

# Importing minigpt pins the CPU kernels (minigpt.PINNED_CPU_KERNELS), before torch runs
# an operation.
import minigpt.train
from minigpt import products
from minigpt.config import GPTConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.decoding import generate
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.posttrain.dpo import make_pairs, train_dpo
from minigpt.posttrain.rhymes import SFTSettings, Vocabulary, rhymes_tasks, supervised_steps
from minigpt.posttrain.rl import grpo_step, rft_step
from minigpt.posttrain.sft import finetune, text_windows
from minigpt.posttrain.tasks import Task, make_tasks
from minigpt.recipes import pretrained
from minigpt.recipes.assistant import ASSISTANT_RECIPE
from minigpt.recipes.copiers import RECIPES, train_copier
from minigpt.recipes.rewards import REWARDS_RECIPE, coin
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


def _unscored(model: torch.nn.Module, splits: dict[str, Any], **_: Any) -> dict[str, float]:
    """In place of `minigpt.train.estimate_loss` in `training_runs`: every split scores 0.
    An evaluation reads the weights without changing them and draws its batches from a
    generator of its own, so the weights a run trains are the same, and its products are the
    census's to replay; under an emulated CPU evaluations took over a third of the training
    runs' time."""
    return dict.fromkeys(splits, 0.0)


def training_runs(steps: int, batch_size: int) -> dict[str, str]:
    """``steps`` optimiser steps of each kind of run set-up makes, chained as set-up chains
    them, of ``batch_size`` sequences (or pairs), but the draft's and SFT's, which take their
    recipes' own batches (SFT's: 8 conversations of the assistants' context, the kind that
    once parted between makers); the sha256 of the weights after each. The runs are not
    evaluated (`_unscored`)."""
    with mock.patch.object(minigpt.train, "estimate_loss", _unscored):
        return _training_runs(steps, batch_size)


def _training_runs(steps: int, batch_size: int) -> dict[str, str]:
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
        own = {"batch_size": recipe.training.batch_size} if name == "draft" else {}
        config = recipe.training.model_copy(update=short | own)
        result = train(recipe.gpt_config(tokenizer.vocab_size), config, train_ids, val_ids,
                       progress=False)
        models[name] = result.model
        hashes[name] = weights_sha256(result.model)
    recipe = ASSISTANT_RECIPE
    tasks = make_tasks(train_text, 2, 1, seed=recipe.task_seed)
    sft_config = recipe.sft.model_copy(update=short | {"batch_size": recipe.sft.batch_size})
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
    a seeded coin, `minigpt.recipes.rewards.coin`: a gradient whatever the tiny run samples, with
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


#: A call of more rows than this is replayed with fewer (`product_call`).
FULL_ROWS = 72
#: A call of more columns than this is replayed with fewer (`product_call`).
FULL_COLS = 96
#: A batched call of more matrices than this is replayed with this many.
FULL_BATCH = 2


def _rows(m: int) -> int:
    """The rows a call of ``m`` rows is replayed with: all of them up to `FULL_ROWS`, else 48
    plus ``m`` mod 24, so that every residue of the row count that the kernels' row tiles (of
    4, 6 or 12 rows) could meet stays, and the first rows' tiles too."""
    return m if m <= FULL_ROWS else 48 + m % 24


def _cols(n: int) -> int:
    """The columns a call of ``n`` columns is replayed with: all of them up to `FULL_COLS`,
    else 64 plus ``n`` mod 32, so that the last column tile of every path (16 or 32 columns
    wide, a vector's lanes side by side) is as narrow as the call's, after two whole tiles.
    Every chain runs over all ``k`` inner terms: the chain is what the proof is about."""
    return n if n <= FULL_COLS else 64 + n % 32


def product_call(entry: list[Any]) -> tuple[Any, ...]:
    """One census entry as the call `replay` makes: the product through the package's
    kernels, each operand keeping its strides, rows reduced by `_rows` and columns by `_cols`
    (an entry's chain depends on neither its neighbours nor where it falls in a tile), a batch
    of matrices to `FULL_BATCH`."""
    kind, a_shape, a_stride, b_shape, b_stride, _, _, dtype, threads, _, _ = entry
    batch = (min(a_shape[0], FULL_BATCH),) if kind == "bmm" else ()
    m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
    return ((*batch, _rows(m), k), tuple(a_stride), (*batch, k, _cols(n)), tuple(b_stride),
            dtype, threads)


#: Random numbers the replayed operands are cut from (more than the largest operand of the
#: census holds, 4,062,784: 7,936 inner terms over rows 512 apart): drawing each operand
#: afresh would make the draws, not the products, most of an emulated CPU's time.
POOL = 1 << 22
_pools: dict[torch.dtype, torch.Tensor] = {}


def _operand(shape: tuple[int, ...], stride: tuple[int, ...], place: int,
             dtype: torch.dtype) -> torch.Tensor:
    """Random numbers of this shape, laid out with these strides: a view of `POOL` seeded
    random numbers, starting at a place picked by ``place`` (Knuth's multiplicative hash:
    integer arithmetic, the same on every CPU, and no random draw for an emulated CPU to
    spend its time on)."""
    size = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
    assert size <= POOL, f"an operand of {size} numbers: raise POOL"
    if dtype not in _pools:
        _pools[dtype] = torch.randn(POOL, generator=torch.Generator().manual_seed(0),
                                    dtype=dtype)
    start = (place * 2654435761) % (1 << 32) % (POOL - size + 1)
    return _pools[dtype].as_strided(shape, stride, start)


def replay(call: tuple[Any, ...], seed: int) -> str:
    """One of `census_calls` on seeded random operands, through the package's kernels
    (``mm`` / ``bmm``): the sha256 of its result."""
    a_shape, a_stride, b_shape, b_stride, dtype, threads = call
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    kind = getattr(torch, dtype)
    a = _operand(a_shape, a_stride, 2 * seed, kind)
    b = _operand(b_shape, b_stride, 2 * seed + 1, kind)
    return tensor_sha256(torch.bmm(a, b) if len(a_shape) == 3 else torch.mm(a, b))


def census_calls(path: Path) -> list[tuple[Any, ...]]:
    """Every distinct `product_call` of a census file (`tools/census.py`), sorted."""
    census = json.loads(path.read_text(encoding="utf-8"))
    calls = {product_call(entry) for part in census.values() for entry in part}
    return sorted(calls, key=repr)


def census_hashes(path: Path) -> list[str]:
    """`replay` of every one of `census_calls`, seeded by its place in the list."""
    hashes = [replay(call, seed)[:16] for seed, call in enumerate(census_calls(path))]
    torch.set_num_threads(1)
    return hashes


def random_draws() -> dict[str, str]:
    """The sha256 of each kind of random draw a run makes, seeded (dropout's and Bernoulli's
    masks have used MKL's generator in some PyTorch builds)."""
    draws = {}
    for name, draw in {
        "normal": lambda: torch.randn(4099),
        "uniform": lambda: torch.rand(4099),
        "integers": lambda: torch.randint(0, 1000, (4099,)),
        "permutation": lambda: torch.randperm(4099),
        "multinomial": lambda: torch.multinomial(torch.rand(7, 65), 3, replacement=True),
        "bernoulli": lambda: torch.bernoulli(torch.full((4099,), 0.3)),
        "bernoulli_": lambda: torch.empty(4099).bernoulli_(0.1),
        "dropout": lambda: F.dropout(torch.ones(12, 64, 128), p=0.1),
    }.items():
        torch.manual_seed(0)
        draws[name] = tensor_sha256(draw())
    return {"random": json.dumps(draws, sort_keys=True)}


def raw_mkl() -> dict[str, str]:
    """Products that MKL computes itself, past `minigpt.products` (``native_mm``, PyTorch's
    own CPU kernel): of inner dimension 64, 192, 256 and 299 (96 x 80 results), and of 2 rows
    and of 8 columns (inner dimension 128). A CPU maker's own sums show here."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, (m, k, n) in {"64": (96, 64, 80), "192": (96, 192, 80), "256": (96, 256, 80),
                            "299": (96, 299, 80), "2 rows": (2, 128, 80),
                            "8 columns": (96, 128, 8)}.items():
        a, b = torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator)
        out[name] = tensor_sha256(torch.ops.minigpt_products.native_mm(a, b))
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
    parser.add_argument("--census", type=Path,
                        help="a census file (tools/census.py): replay every product in it")
    parser.add_argument("--only", choices=("training", "chapter", "census"),
                        help="the training runs, the chapter's checks or the census only "
                             "(default: the random draws, MKL's own products, the training "
                             "runs, and the census if --census and the chapter's checks if "
                             "--model)")
    parser.add_argument("--model", type=Path,
                        help="a trained model: torch.save({'config': ..., 'state': ..., "
                             "'tokenizer': tokenizer.to_dict()})")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error(f"--steps and --batch-size must be at least 1, got {args.steps} and "
                     f"{args.batch_size}")
    if args.only == "chapter" and args.model is None:
        parser.error("--only chapter needs --model")
    if args.only == "census" and args.census is None:
        parser.error("--only census needs --census")
    if args.model is not None and not args.model.is_file():
        parser.error(f"--model {args.model}: no such file")
    if args.census is not None and not args.census.is_file():
        parser.error(f"--census {args.census}: no such file")
    torch.set_num_threads(1)  # as set-up trains: one thread, the same reductions every run
    out: dict[str, Any] = {"cpu kernels": torch.backends.cpu.get_cpu_capability(),
                           "products": products.mode()}
    if args.census is not None and args.only in (None, "census"):
        out["census"] = census_hashes(args.census)
    if args.only is None:
        out |= random_draws() | raw_mkl()
    if args.only in (None, "training"):
        out |= training_runs(args.steps, args.batch_size)
    if (args.only is None and args.model is not None) or args.only == "chapter":
        out |= chapter_checks(args.model)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
