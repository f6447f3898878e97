"""Sampling from a trained checkpoint: `load_model` rebuilds the model and its tokenizer.

    model, tokenizer, step = load_model("runs/char")
    generate(model, tokenizer.encode("ROMEO:"), 200)

The command line does the same (`minigpt.cli`):

    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --max-new-tokens 200
    python -m minigpt sample --checkpoint runs/char --prompt "ROMEO:" --beams 4
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from minigpt.checkpoint import load_checkpoint
from minigpt.config import GPTConfig
from minigpt.model import GPT
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
    except (RuntimeError, KeyError, TypeError, ValueError) as err:  # incl. pydantic's
        raise ValueError(f"the checkpoint in {checkpoint} is inconsistent: {err}") from None
    return LoadedModel(model.to(device).eval(), tokenizer, int(ckpt["step"]))
