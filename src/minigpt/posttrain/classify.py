"""A pretrained GPT put to a labelled task: GPT-1's classification head.

GPT-1 (Radford et al., 2018) fine-tunes the whole pretrained model together with one new
linear layer that reads the final hidden state of the input's last token, and keeps the
language-modelling loss on the task's text as an auxiliary term. `GPTClassifier` is that
recipe for any `minigpt.GPT`; `scrambled_words` makes a small labelled task from a text
(is this a word of the text, or its letters shuffled?), to show what pretraining buys.

Batches enter through `pad_batch`, which makes the lengths, so the forward pass and the
loss read them without checking them again (nor reading them on the host, batch after
batch); a label out of range is refused by the cross-entropy itself.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.model import GPT


class GPTClassifier(nn.Module):
    """A GPT with a linear classification head on the last token's final hidden state.

    ``forward(ids (B, T), lengths (B,))`` returns the class logits (B, C) and the
    next-token logits (B, T, V). Sequences are padded on the right; with the causal mask
    no real position sees the padding, so position ``lengths[b] - 1`` is read.
    """

    def __init__(self, gpt: GPT, num_classes: int) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.gpt = gpt
        self.head = nn.Linear(gpt.config.d_model, num_classes)

    def forward(self, ids: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        assert lengths.shape == ids.shape[:1], "one length per row of ids (B, T)"
        x = self.gpt.hidden_states(ids)  # (B, T, D): what the LM head reads
        last = x[torch.arange(len(ids), device=ids.device), lengths - 1]  # (B, D)
        return self.head(last), self.gpt.lm_head(x)


def classification_loss(model: GPTClassifier, ids: Tensor, lengths: Tensor, labels: Tensor,
                        *, lm_weight: float = 0.0) -> Tensor:
    """Cross-entropy of the labels, plus ``lm_weight`` times the language-modelling loss
    of the inputs' own text (GPT-1's auxiliary objective; 0 turns it off).

    ids (B, T) padded on the right, lengths (B,), labels (B,) in 0..C-1.
    """
    if not lm_weight >= 0:
        raise ValueError(f"lm_weight must be >= 0, got {lm_weight}")
    class_logits, token_logits = model(ids, lengths)
    loss = F.cross_entropy(class_logits, labels)
    if lm_weight > 0:
        # position t predicts token t + 1; the last real position and the padding do not
        targets = ids[:, 1:].masked_fill(
            torch.arange(1, ids.shape[1], device=ids.device) >= lengths[:, None], -100)
        lm = F.cross_entropy(token_logits[:, :-1].flatten(0, 1), targets.flatten(),
                             ignore_index=-100)
        loss = loss + lm_weight * lm
    return loss


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Token-id lists -> ids (B, T_max) padded on the right with ``pad_id``, lengths (B,),
    each in 1..T_max: where a batch enters `GPTClassifier`."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pad_batch needs at least one sequence and no empty one")
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids, lengths


def scrambled_words(text: str, n_train: int, n_test: int, *, seed: int, min_length: int = 5,
                    max_length: int = 9) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A balanced labelled task made from a text: is " word " a word of the text (label 1)
    or one with its letters shuffled (label 0)? Returns (train, test) examples.

    The distinct lower-case words of ``min_length``..``max_length`` letters are put in a
    seeded random order; the first n_train make the training examples and the next n_test
    the test examples, so no word (or scrambled version of it) is in both. Each word becomes
    a positive or, with probability 1/2, a negative: its letters in an order that is not a
    word of the text. Words whose letters are all equal cannot be scrambled and are left out.
    """
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    vocabulary = set(re.findall(r"[a-z]+", text))
    words = sorted(w for w in vocabulary if min_length <= len(w) <= max_length
                   and len(set(w)) > 1)
    if n_train < 1 or n_test < 1 or n_train + n_test > len(words):
        raise ValueError(f"need n_train, n_test >= 1 and n_train + n_test <= {len(words)} "
                         f"(the eligible words), got {n_train} and {n_test}")
    rng = random.Random(seed)
    rng.shuffle(words)
    examples: list[tuple[str, int]] = []
    for word in words:
        if len(examples) == n_train + n_test:
            break
        if rng.random() < 0.5:
            examples.append((f" {word} ", 1))
            continue
        for _ in range(100):  # a different arrangement that is not itself a word
            scrambled = "".join(rng.sample(word, len(word)))
            if scrambled != word and scrambled not in vocabulary:
                examples.append((f" {scrambled} ", 0))
                break
    if len(examples) < n_train + n_test:
        raise ValueError(f"only {len(examples)} examples could be made from the text")
    return examples[:n_train], examples[n_train:]
