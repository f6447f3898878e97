"""Sampling from a trained checkpoint: `load_model` for Python, `main` for the CLI.

    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --max-new-tokens 200
    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --beams 4
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from pydantic import ValidationError

from minigpt.checkpoint import load_checkpoint
from minigpt.config import GPTConfig
from minigpt.generate import beam_search, generate
from minigpt.model import GPT
from minigpt.speculative import speculative_generate
from minigpt.tokenizer import Tokenizer, tokenizer_from_dict


class LoadedModel(NamedTuple):
    """A trained model (in eval mode), the tokenizer it was trained with, and its step."""

    model: GPT
    tokenizer: Tokenizer
    step: int


def load_model(checkpoint: Path | str, *, device: str | torch.device = "cpu") -> LoadedModel:
    """Rebuild the model and tokenizer saved by `minigpt.train` in ``checkpoint``
    (a directory holding ``checkpoint.pt``, or the file itself).

    Raises FileNotFoundError when there is no checkpoint and ValueError when the file is
    not a readable minigpt checkpoint or was saved without a tokenizer.
    """
    ckpt = load_checkpoint(checkpoint, map_location=device)
    if ckpt["tokenizer"] is None:
        raise ValueError(f"the checkpoint in {checkpoint} has no tokenizer; it was trained "
                         "without one (train(..., tokenizer=...)), so its ids cannot be decoded")
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    except (ValidationError, RuntimeError, KeyError, TypeError) as err:
        raise ValueError(f"the checkpoint in {checkpoint} is inconsistent: {err}") from None
    return LoadedModel(model.to(device).eval(), tokenizer, int(ckpt["step"]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minigpt sample",
                                description="Continue a prompt with a trained checkpoint.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="the --out directory of `python -m minigpt train`")
    p.add_argument("--prompt", default="\n",
                   help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=500, metavar="N")
    p.add_argument("--temperature", type=float, default=None,
                   help="> 0 rescales the logits; 0 is greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens with mass >= P")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=int, default=1337, help="seed of the sampler (default 1337)")
    p.add_argument("--num-samples", type=int, default=1, metavar="S",
                   help="independent continuations to print (default 1)")
    p.add_argument("--beams", type=int, default=None, metavar="K",
                   help="beam search with K beams instead of sampling: print the most likely "
                        "continuation found (no --temperature, --top-k, --top-p, --greedy)")
    p.add_argument("--no-cache", action="store_true",
                   help="re-read the whole context at every step instead of keeping a "
                        "key-value cache (slower, same tokens)")
    p.add_argument("--draft", metavar="DIR",
                   help="speculative sampling: a smaller model's checkpoint (same tokenizer) "
                        "proposes tokens that this one checks; the text's distribution is "
                        "unchanged")
    p.add_argument("--speculate", type=int, default=None, metavar="K",
                   help="tokens the draft proposes per round (default 4; needs --draft)")
    p.add_argument("--device", default="cpu")
    return p


def _speculate(args: argparse.Namespace, model: GPT, tokenizer: Tokenizer,
               ids: list[int]) -> torch.Tensor:
    """--draft: every sample by speculative sampling; the acceptance rate goes to stderr."""
    k = 4 if args.speculate is None else args.speculate
    if k < 1:
        raise ValueError(f"--speculate must be >= 1, got {k}")
    draft, draft_tokenizer, _ = load_model(args.draft, device=args.device)
    if draft_tokenizer.to_dict() != tokenizer.to_dict():
        raise ValueError(f"--draft {args.draft} was trained with another tokenizer "
                         f"({draft_tokenizer.name}, V={draft.config.vocab_size}) than "
                         f"--checkpoint ({tokenizer.name}, V={model.config.vocab_size}); "
                         "the draft must share the target's tokenizer")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    temperature = 1.0 if args.temperature is None else args.temperature
    rows, accepted, checked, passes, new = [], 0, 0, 0, 0
    for _ in range(args.num_samples):
        res = speculative_generate(model, draft, ids, args.max_new_tokens, k=k,
                                   temperature=temperature, top_k=args.top_k,
                                   top_p=args.top_p, greedy=args.greedy, generator=gen)
        rows.append(res.ids)
        accepted, checked = accepted + res.accepted, checked + res.accepted + res.rejected
        passes, new = passes + res.target_passes, new + args.max_new_tokens
    if checked:
        print(f"speculative sampling: {accepted}/{checked} proposals accepted "
              f"({accepted / checked:.0%}), {new / max(passes, 1):.2f} tokens per pass of "
              "the target", file=sys.stderr)
    return torch.stack(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m minigpt sample ...`: returns the exit status (0 ok, 1 error, 2 usage)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code) if isinstance(exit_.code, int) else 2
    try:
        if args.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
        if args.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        try:
            torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device!r} is not a torch device "
                             "(e.g. cpu, cuda, cuda:1)") from None
        if args.beams is not None:
            if args.beams < 1:
                raise ValueError(f"--beams must be >= 1, got {args.beams}")
            sampling = [flag for flag, value in (
                ("--temperature", args.temperature), ("--top-k", args.top_k),
                ("--top-p", args.top_p), ("--greedy", args.greedy or None),
                ("--num-samples", None if args.num_samples == 1 else args.num_samples),
            ) if value is not None]
            if sampling:
                raise ValueError(f"--beams searches for the most likely continuation and does "
                                 f"not sample; drop {', '.join(sampling)}")
        if args.speculate is not None and args.draft is None:
            raise ValueError("--speculate needs --draft, the checkpoint of the draft model")
        if args.draft is not None and args.beams is not None:
            raise ValueError("--draft speeds up sampling; it does not combine with --beams")
        if args.draft is not None and args.no_cache:
            raise ValueError("--draft keeps key-value caches; drop --no-cache")
        if not args.prompt:
            raise ValueError("--prompt is empty: give at least one character to continue")
        model, tokenizer, _ = load_model(args.checkpoint, device=args.device)
        try:
            ids = tokenizer.encode(args.prompt)
        except ValueError as err:
            raise ValueError(f"--prompt cannot be encoded by the {tokenizer.name} tokenizer "
                             f"of this checkpoint: {err}") from None
        if args.draft is not None:
            out = _speculate(args, model, tokenizer, ids)
        elif args.beams is not None:
            found = beam_search(model, ids, args.max_new_tokens, num_beams=args.beams,
                                use_cache=not args.no_cache)
            out = found.sequences[:1]  # the best hypothesis
        else:
            gen = torch.Generator(device=args.device).manual_seed(args.seed)
            prompt = torch.tensor([ids] * args.num_samples, dtype=torch.long)
            temperature = 1.0 if args.temperature is None else args.temperature
            out = generate(model, prompt, args.max_new_tokens, temperature=temperature,
                           top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                           generator=gen, use_cache=not args.no_cache)
    except (OSError, ValueError, TypeError) as err:
        print(f"minigpt sample: error: {err}", file=sys.stderr)
        return 1
    for k, row in enumerate(out.tolist()):
        if k:
            print("-" * 40)
        print(tokenizer.decode(row))
    return 0
