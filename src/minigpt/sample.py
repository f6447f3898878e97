"""Sampling from a trained checkpoint: `load_model` rebuilds the model and its tokenizer.

    model, tokenizer, step = load_model("runs/char")
    generate(model, tokenizer.encode("ROMEO:"), 200)

`sample_texts(SampleSettings(...))` is what the command line runs (`minigpt.cli`):

    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --max-new-tokens 200
    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --beams 4
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, Field, model_validator

from minigpt.checkpoint import load_checkpoint
from minigpt.config import Device, GPTConfig
from minigpt.decoding import beam_search, generate
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
    not a readable minigpt checkpoint, was saved without a tokenizer, or the model cannot
    be put on ``device``.
    """
    # Read onto the CPU, so that only reading errors are blamed on the file: a missing GPU
    # or one out of memory fails in the move below and is reported as what it is.
    ckpt = load_checkpoint(checkpoint)
    if ckpt["tokenizer"] is None:
        raise ValueError(f"the checkpoint in {checkpoint} has no tokenizer; it was trained "
                         "without one (train(..., tokenizer=...)), so its ids cannot be decoded")
    try:
        model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        tokenizer = tokenizer_from_dict(ckpt["tokenizer"])
    except (RuntimeError, KeyError, TypeError, ValueError) as err:  # incl. pydantic's
        raise ValueError(f"the checkpoint in {checkpoint} is inconsistent: {err}") from None
    return LoadedModel(_to_device(model, device).eval(), tokenizer, int(ckpt["step"]))


def _to_device(model: GPT, device: str | torch.device) -> GPT:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"cannot put the model on {device!s}: CUDA is not available on "
                         "this machine")
    try:
        return model.to(device)
    except RuntimeError as err:  # e.g. cuda:3 on a machine with one GPU, or out of memory
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"cannot put the model on {device!s}: {reason}") from err


class SampleSettings(BaseModel):
    """What `sample_texts` continues, and how (`python -m minigpt sample`'s flags, one a
    field).

    Attributes:
        checkpoint: the ``--out`` directory of `python -m minigpt train`.
        prompt: the text to continue. max_new_tokens: the tokens to add.
        temperature: 1 by default; 0 is greedy. top_k: sample among the k most likely
            only. top_p: sample from the smallest set of most likely tokens whose mass
            reaches p. greedy: always take the most likely token.
        seed: seeds the sampler. num_samples: independent continuations to print.
        cache: keep a key-value cache (``--no-cache``: slower, the same tokens).
        device: cpu, cuda, cuda:1, ...
        beams: beam search with this many beams: the most likely continuation found, no
            sampling.
        draft: speculative sampling: the checkpoint of a smaller model with the same
            tokenizer, which proposes while this one checks. speculate: the tokens the
            draft proposes a round (default 4; needs ``draft``).
    """

    checkpoint: Path
    prompt: str = Field("\n", min_length=1)
    max_new_tokens: int = Field(500, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    greedy: bool = False
    seed: int = Field(1337, ge=0)
    num_samples: int = Field(1, ge=1)
    cache: bool = True
    device: Device = "cpu"
    beams: int | None = Field(None, ge=1)
    draft: Path | None = None
    speculate: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _combinable(self) -> SampleSettings:
        sampling = [f"--{k.replace('_', '-')}" for k in ("temperature", "top_k", "top_p")
                    if getattr(self, k) is not None]
        sampling += ["--greedy"] * self.greedy + ["--num-samples"] * (self.num_samples != 1)
        if self.beams is not None and sampling:
            raise ValueError(f"--beams searches for the most likely continuation and does not "
                             f"sample; drop {', '.join(sampling)}")
        if self.speculate is not None and self.draft is None:
            raise ValueError("--speculate needs --draft, the checkpoint of the draft model")
        if self.draft is not None and not self.cache:
            raise ValueError("--draft keeps key-value caches; drop --no-cache")
        return self


def sample_texts(args: SampleSettings) -> list[str]:
    """The continuations of ``args.prompt`` by the checkpoint ``args.checkpoint``: sampled,
    found by beam search (``beams``) or sampled speculatively with a draft (``draft``; the
    acceptance rate goes to stderr)."""
    model, tokenizer, _ = load_model(args.checkpoint, device=args.device)
    try:
        ids = tokenizer.encode(args.prompt)
    except ValueError as err:
        raise ValueError(f"--prompt cannot be encoded by the {tokenizer.name} tokenizer of "
                         f"this checkpoint: {err}") from None
    tau = 1.0 if args.temperature is None else args.temperature
    gen = torch.Generator(args.device).manual_seed(args.seed)
    if args.draft is not None:
        out = _speculate(args, model, tokenizer, ids, tau, gen)
    elif args.beams is not None:
        out = beam_search(model, ids, args.max_new_tokens, num_beams=args.beams,
                          use_cache=args.cache).sequences[:1]  # the best
    else:
        out = generate(model, torch.tensor([ids] * args.num_samples), args.max_new_tokens,
                       temperature=tau, top_k=args.top_k, top_p=args.top_p, greedy=args.greedy,
                       generator=gen, use_cache=args.cache)
    return [tokenizer.decode(row) for row in out.tolist()]


def _speculate(args: SampleSettings, model: Any, tokenizer: Any, ids: list[int], tau: float,
               gen: torch.Generator) -> torch.Tensor:
    """--draft: every sample by speculative sampling; the acceptance rate goes to stderr."""
    draft, draft_tokenizer, _ = load_model(args.draft or "", device=args.device)
    if draft_tokenizer.to_dict() != tokenizer.to_dict():
        raise ValueError(f"--draft {args.draft} was trained with another tokenizer "
                         f"({draft_tokenizer.name}, V={draft.config.vocab_size}) than "
                         f"--checkpoint ({tokenizer.name}, V={model.config.vocab_size}); "
                         "the draft must share the target's tokenizer")
    runs = [speculative_generate(model, draft, ids, args.max_new_tokens, k=args.speculate or 4,
                                 temperature=tau, top_k=args.top_k, top_p=args.top_p,
                                 greedy=args.greedy, generator=gen)
            for _ in range(args.num_samples)]
    accepted, checked = sum(r.accepted for r in runs), sum(r.accepted + r.rejected for r in runs)
    if checked:
        passes = max(1, sum(r.target_passes for r in runs))
        print(f"speculative sampling: {accepted}/{checked} proposals accepted "
              f"({accepted / checked:.0%}), {len(runs) * args.max_new_tokens / passes:.2f} "
              "tokens per pass of the target", file=sys.stderr)
    return torch.stack([r.ids for r in runs])
