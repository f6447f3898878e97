"""The copiers: small models trained on text in which stretches repeat, where copying
pays, with snapshots of their heads' scores as they train, cached like the book's other
models (the inside-the-model chapter)."""

from __future__ import annotations

import copy
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from minigpt.config import GPTConfig, stream_seed
from minigpt.data import Batch, get_batch, split_text
from minigpt.interp.heads import (
    Head,
    Scores,
    copy_losses,
    head_scores,
    repeated,
)
from minigpt.losses import lm_loss
from minigpt.model import GPT
from minigpt.optim import configure_optimizer
from minigpt.recipes import pretrained
from minigpt.recipes.pretrained import Built, ModelInfo
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train_step

#: The package's modules that train a copier: its cache key covers their source.
COPIER_MODULES = (*pretrained.TRAINING_MODULES, "interp", "interp.heads",
                  "recipes.copiers")


#: The held-out probes: repeated rows for the scores and losses (`repeated`, seed 1) and
#: the short one whose attention the snapshots keep (12 ids twice).
PROBE_SEED, SHOWN_HALF = 1, 12


class CopyRecipe(BaseModel):
    """A small model trained on the training text with repeated stretches, where copying
    what came before pays: its shape, its rows, its run and its snapshots.

    Each training row is a window of ``context_length`` + 1 ids of the text; in a share
    ``repeat_fraction`` of the rows, a stretch of ``shortest`` to ``longest`` ids at a
    random place is written again right after itself (over the text that followed it).
    ``fixed_offset`` instead repeats the row's first half in its second half, always 32
    positions back at context 64: a task a head can solve by position alone. AdamW at a
    constant rate, no weight decay; every ``snapshot_every`` steps the scores and losses on
    repeated held-out rows are recorded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    d_model: int = Field(default=64, gt=0)
    #: The MLP's width: 3 D, where the chapter measured its copiers (with GPT-2's 4 D the
    #: copying was shared among more heads of layer 1).
    d_ff: int = Field(default=192, gt=0)
    context_length: int = Field(default=64, gt=1)
    batch_size: int = Field(default=16, gt=0)
    steps: int = Field(default=2400, gt=0)
    lr: float = Field(default=3e-3, gt=0.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    seed: int = Field(default=0, ge=0)
    repeat_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    shortest: int = Field(default=16, gt=0)
    longest: int = Field(default=32, gt=0)
    fixed_offset: bool = False
    snapshot_every: int = Field(default=50, gt=0)
    probe_rows: int = Field(default=32, gt=0)
    train_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    threads: int = Field(default=1, ge=1, strict=True)

    @model_validator(mode="after")
    def _stretches_fit(self) -> CopyRecipe:
        if not self.shortest <= self.longest <= (self.context_length + 1) // 2:
            raise ValueError(f"stretches of {self.shortest} to {self.longest} ids must satisfy "
                             f"shortest <= longest <= {(self.context_length + 1) // 2}, so that "
                             f"one fits twice in a row of {self.context_length + 1}")
        if self.context_length % 2 or self.context_length < 2 * SHOWN_HALF:
            raise ValueError(f"context_length must be even (two halves) and at least "
                             f"{2 * SHOWN_HALF} (the row the snapshots show), got "
                             f"{self.context_length}")
        self.gpt_config(vocab_size=2)  # GPTConfig's own checks: the heads divide D
        return self

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model's GPT-2-layout `GPTConfig` for a vocabulary of `vocab_size` tokens."""
        return GPTConfig.shakespeare_cpu(
            vocab_size, n_layers=self.n_layers, n_heads=self.n_heads, d_model=self.d_model,
            d_ff=self.d_ff, context_length=self.context_length, activation="gelu_tanh")


def training_rows(ids: Tensor, recipe: CopyRecipe, generator: torch.Generator) -> Tensor:
    """A batch of `CopyRecipe`'s training rows (B, T + 1) from the stream ``ids``."""
    B, T = recipe.batch_size, recipe.context_length
    starts = torch.randint(0, len(ids) - T - 1, (B,), generator=generator)
    rows = ids[starts[:, None] + torch.arange(T + 1)]
    if recipe.fixed_offset:
        length, place = torch.full((B,), T // 2), torch.zeros(B, dtype=torch.long)
    else:
        length = torch.randint(recipe.shortest, recipe.longest + 1, (B,), generator=generator)
        place = (torch.rand(B, generator=generator) * (T + 2 - 2 * length)).long()
    chosen = torch.rand(B, generator=generator) < recipe.repeat_fraction
    j = torch.arange(T + 1)[None, :]
    again = chosen[:, None] & (j >= (place + length)[:, None]) & (
        j < (place + 2 * length)[:, None])
    return rows.gather(1, torch.where(again, j - length[:, None], j))


def _split_ids(text: str, recipe: CopyRecipe) -> tuple[CharTokenizer, Tensor, Tensor]:
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text, recipe.train_fraction)
    return (tokenizer, torch.tensor(tokenizer.encode_ordinary(train_text)),
            torch.tensor(tokenizer.encode_ordinary(val_text)))


def probe_rows(model: GPT, val: Tensor, count: int) -> Tensor:
    """``count`` repeated rows of held-out ids, half a context each: the same on every call."""
    half = model.config.context_length // 2
    return repeated(val, count, half, torch.Generator().manual_seed(PROBE_SEED))


def _train_copier(recipe: CopyRecipe, text: str, say: Any, folder: Path) -> Built:
    say(f"training a copier once ({pretrained.plural(recipe.n_layers, 'layer')}, "
        f"{recipe.steps} steps, repeats in {recipe.repeat_fraction:.0%} of rows); it is "
        f"cached in {folder}")
    return train_copier(recipe, text)


def train_copier(recipe: CopyRecipe, text: str) -> Built:
    """Train the copier of ``recipe`` on the first part of ``text`` (its character
    tokenizer's ids; the rest is held out): the model in eval mode, its metrics and its
    history with the snapshots (what `copier` caches)."""
    tokenizer, train_ids, val_ids = _split_ids(text, recipe)
    config = recipe.gpt_config(tokenizer.vocab_size)
    start = time.perf_counter()
    with pretrained.threads(recipe.threads):
        torch.manual_seed(stream_seed(recipe.seed, "init"))
        model = GPT(config)
        optimizer = configure_optimizer(model, lr=recipe.lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(stream_seed(recipe.seed, "batches"))
        probes = probe_rows(model, val_ids, recipe.probe_rows)
        history: dict[str, list[Any]] = {k: [] for k in (
            "step", "first", "second", "induction", "previous")}
        snapshots, losses = [], []
        for step in range(recipe.steps + 1):
            if step % recipe.snapshot_every == 0 or step == recipe.steps:
                model.eval()
                copies, scores = copy_losses(model, probes), head_scores(model, probes)
                model.train()
                history["step"].append(step)
                history["first"].append(round(copies.first, 4))
                history["second"].append(round(copies.second, 4))
                history["induction"].append(np.round(scores.induction.numpy(), 4).tolist())
                history["previous"].append(np.round(scores.previous.numpy(), 4).tolist())
                snapshots.append(copy.deepcopy(model.state_dict()))
            if step == recipe.steps:
                break
            rows = training_rows(train_ids, recipe, generator)
            batch = Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
            losses.append(train_step(model, optimizer, [batch],
                                     grad_clip=recipe.grad_clip).loss)
        seconds = time.perf_counter() - start
        model.eval()
        history["loss"] = [round(v, 4) for v in torch.stack(losses).tolist()]
        final = Scores(torch.tensor(history["induction"][-1]),
                       torch.tensor(history["previous"][-1]))
        history |= _patterns(model, snapshots, final.top(), val_ids, tokenizer)
        plain_x, plain_y = get_batch(val_ids.numpy(), 64, config.context_length,
                                     generator=torch.Generator().manual_seed(PROBE_SEED))
        with torch.no_grad():  # plain held-out text, nothing repeated on purpose
            plain = float(lm_loss(model, plain_x, plain_y))
    crossed = [s for s, grid in zip(history["step"], history["induction"], strict=True)
               if max(map(max, grid)) >= 0.5]
    metrics = {"first": history["first"][-1], "second": history["second"][-1],
               "induction": round(float(final.induction.max()), 4),
               "previous": round(float(final.previous.max()), 4),
               "top_induction": list(final.top()), "top_previous": list(final.top("previous")),
               "crossed_at": crossed[0] if crossed else None, "plain_loss": round(plain, 4),
               "train_seconds": seconds}
    return model, metrics, history


def _patterns(model: GPT, snapshots: list[dict[str, Tensor]], head: Head, val: Tensor,
              tokenizer: CharTokenizer) -> dict[str, Any]:
    """The attention of ``head`` at every snapshot on one short repeated held-out row."""
    row = repeated(val, 1, SHOWN_HALF, torch.Generator().manual_seed(PROBE_SEED))
    final = copy.deepcopy(model.state_dict())
    patterns = []
    for state in snapshots:
        model.load_state_dict(state)
        with torch.no_grad():
            _, maps = model.forward_with_attention(row[:, :-1])
        patterns.append(np.round(maps[head[0]][0, head[1]].numpy(), 3).tolist())
    model.load_state_dict(final)
    return {"pattern": patterns, "pattern_head": list(head),
            "pattern_text": tokenizer.decode(row[0, :-1].tolist())}


def copier(recipe: CopyRecipe, *, progress: bool = False, cache: Path | None = None,
           ) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The copier ``recipe`` trains on the corpus, its tokenizer and a `ModelInfo` whose
    metrics hold its final scores and losses and whose history holds its snapshots; trained
    once and cached (the key covers the recipe, the corpus, PyTorch and `COPIER_MODULES`)."""
    text = pretrained.corpus()
    tokenizer = CharTokenizer.from_text(text)
    material = pretrained.model_material(COPIER_MODULES, recipe.gpt_config(tokenizer.vocab_size),
                                         recipe=recipe.model_dump(),
                                         corpus_sha256=pretrained.corpus_sha256(text))
    model, info = pretrained.cached_model(material, partial(_train_copier, recipe, text),
                                          progress=progress, cache=cache)
    return model, tokenizer, info


#: The copiers set-up trains: three seeds of the two-layer model where every row repeats a
#: stretch; one layer; repeats at a fixed offset; and shares of repeated rows.
RECIPES: dict[str, CopyRecipe] = {
    **{f"copy-{seed}": CopyRecipe(seed=seed) for seed in (0, 1, 2)},
    "copy-1layer": CopyRecipe(n_layers=1),
    "copy-fixed": CopyRecipe(n_layers=1, fixed_offset=True, steps=800),
    "copy-plain": CopyRecipe(repeat_fraction=0.0),
    "copy-mix-25": CopyRecipe(repeat_fraction=0.25),
    "copy-mix-50": CopyRecipe(repeat_fraction=0.5),
}


MODELS: dict[str, pretrained.Loader] = {
    name: partial(copier, recipe) for name, recipe in RECIPES.items()}


def copy_opportunity(text: str, context: int, match: int, positions: int,
                     generator: torch.Generator) -> tuple[float, float]:
    """How often copying could help in ``text`` with a window of ``context`` characters: at
    ``positions`` random places, whether the ``match`` characters ending there occurred
    earlier in the window, and whether the character after that earlier occurrence (the
    latest one) is the next one. Returns the two shares: matched, and matched and right."""
    if not 0 < match < context < len(text) - 1:
        raise ValueError(f"a match fits in a window of the text: 0 < match < context < "
                         f"len(text) - 1, got {match}, {context}, {len(text) - 1}")
    ends = torch.randint(context - 1, len(text) - 1, (positions,), generator=generator)
    matched = right = 0
    for end in ends.tolist():
        gram = text[end - match + 1:end + 1]
        earlier = text.rfind(gram, end - context + 1, end)  # ends before position `end`
        if earlier >= 0:
            matched += 1
            right += text[earlier + match] == text[end + 1]
    return matched / positions, right / positions
