"""Learning a byte-level BPE vocabulary from text: `train_bpe` finds the merges, most
frequent adjacent pair first, and hands them to `minigpt.tokenizer.BPETokenizer`, which
encodes and decodes with them. `get_tokenizer` builds the tokenizer a run asks for by kind
("char", "bpe", trained here, or "gpt2").
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise

import regex

from minigpt.tokenizer import (
    ENDOFTEXT,
    GPT2_PAT_STR,
    KINDS,
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    _check_special_names,
)

DEFAULT_BPE_VOCAB_SIZE = 512


def train_bpe(text: str, vocab_size: int, *,
              special_tokens: Sequence[str] = (ENDOFTEXT,)) -> BPETokenizer:
    """Learn `vocab_size - 256 - len(special_tokens)` merges on `text`.

    The text is split with GPT-2's regex and BPE runs on the distinct chunks weighted by their
    counts (a few tens of thousands of chunks rather than millions of characters). Each step
    merges the most frequent adjacent pair of tokens; ties go to the pair whose (first, second)
    token ids are smallest, i.e. to older tokens, bytes ordered by value, so training is
    deterministic. Only the words containing the chosen pair are updated, and a heap with
    stale entries skipped on pop finds the next best pair.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("train_bpe needs a non-empty text")
    names = _check_special_names(special_tokens)
    if vocab_size < 256 + len(names):
        raise ValueError(f"vocab_size must be at least {256 + len(names)} (256 bytes + "
                         f"{len(names)} special tokens), got {vocab_size}")
    n_merges = vocab_size - 256 - len(names)

    chunk_counts = Counter(regex.findall(GPT2_PAT_STR, text))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    counts = list(chunk_counts.values())
    pair_counts: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for w, word in enumerate(words):
        for pair in pairwise(word):
            pair_counts[pair] += counts[w]
            where.setdefault(pair, set()).add(w)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    vocab = [bytes([b]) for b in range(256)]
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < n_merges:
        while heap and -heap[0][0] != pair_counts.get(heap[0][1], 0):
            heapq.heappop(heap)  # stale: that pair's count has changed since it was pushed
        if not heap:
            raise ValueError(f"the text supports only {len(merges)} merges (every chunk is a "
                             f"single token); vocab_size can be at most "
                             f"{256 + len(merges) + len(names)}")
        _, (a, b) = heapq.heappop(heap)
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        merges.append((vocab[a], vocab[b]))
        delta: Counter[tuple[int, int]] = Counter()
        for w in where.pop((a, b)):
            word, c = words[w], counts[w]
            merged, k = [], 0
            while k < len(word):
                if k + 1 < len(word) and word[k] == a and word[k + 1] == b:
                    merged.append(new)
                    k += 2
                else:
                    merged.append(word[k])
                    k += 1
            for pair in pairwise(word):
                delta[pair] -= c
            for pair in pairwise(merged):
                delta[pair] += c
                where.setdefault(pair, set()).add(w)
            words[w] = merged
        for pair, d in delta.items():
            if d:
                pair_counts[pair] += d
                if pair_counts[pair] > 0:
                    heapq.heappush(heap, (-pair_counts[pair], pair))
                else:
                    del pair_counts[pair]
    return BPETokenizer(merges, names, name=f"minigpt-bpe-{vocab_size}")


def get_tokenizer(kind: str, text: str | None = None, *,
                  vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer of the given kind: "char" (the alphabet of `text`), "bpe" (trained on
    `text`, `vocab_size` tokens, default 512) or "gpt2" (GPT-2's; `text` is not needed)."""
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")
    if vocab_size is not None and kind != "bpe":
        raise ValueError(f"vocab_size applies only to the 'bpe' tokenizer, not to {kind!r}")
    if kind == "gpt2":
        return GPT2Tokenizer()
    if text is None:
        raise ValueError(f"the {kind!r} tokenizer is built from a text; pass text=...")
    if kind == "char":
        return CharTokenizer.from_text(text)
    return train_bpe(text, DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
