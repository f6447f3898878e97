"""minigpt.bpe: learning byte-level BPE merges, and building a tokenizer by kind."""

from __future__ import annotations

from collections import Counter

import pytest
import regex

from minigpt.bpe import get_tokenizer, train_bpe
from minigpt.tokenizer import (
    ENDOFTEXT,
    GPT2_PAT_STR,
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    gpt2_encoding,
)

# ------------------------------------------------------------------------ learning merges

def test_bpe_layout_and_first_merges(bpe: BPETokenizer, macbeth: str) -> None:
    assert bpe.vocab_size == 512 and len(bpe.merges) == 512 - 256 - 1
    assert bpe.special_tokens == {ENDOFTEXT: 511}
    assert bpe.pat_str == GPT2_PAT_STR == gpt2_encoding()._pat_str
    # The first merge is the most frequent adjacent byte pair inside the regex's chunks.
    pairs: Counter[tuple[bytes, bytes]] = Counter()
    for chunk in regex.findall(GPT2_PAT_STR, macbeth):
        data = chunk.encode()
        pairs.update((data[k:k + 1], data[k + 1:k + 2]) for k in range(len(data) - 1))
    top = max(pairs.values())
    assert bpe.merges[0] == min(pair for pair, count in pairs.items() if count == top)
    assert bpe.token_bytes(256) == b"".join(bpe.merges[0])
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in bpe.merges)
    # BPE compresses: fewer tokens than bytes.
    assert len(bpe.encode_ordinary(macbeth)) < 0.6 * len(macbeth.encode())


def test_bpe_training_is_deterministic(macbeth: str, bpe: BPETokenizer) -> None:
    assert train_bpe(macbeth, 512).merges == bpe.merges


def test_bpe_training_errors() -> None:
    with pytest.raises(ValueError, match=r"at least 257 \(256 bytes \+ 1 special tokens\), got"):
        train_bpe("some text", 256)
    with pytest.raises(ValueError, match=r"at least 256 \(256 bytes \+ 0 special"):
        train_bpe("some text", 255, special_tokens=())
    with pytest.raises(ValueError, match="non-empty text"):
        train_bpe("", 300)
    # "abab" is one chunk: b"ab" then b"abab" and nothing is left to merge.
    with pytest.raises(ValueError, match="supports only 2 merges.*at most 258"):
        train_bpe("abab", 300, special_tokens=())
    assert train_bpe("abab", 258, special_tokens=()).merges == [(b"a", b"b"), (b"ab", b"ab")]


def test_bpe_ties_go_to_the_smaller_pair() -> None:
    # Chunks "cd", "\n", "ab": two pairs, each seen once; the smaller byte values win.
    assert train_bpe("cd\nab", 257, special_tokens=()).merges == [(b"a", b"b")]
    assert train_bpe("ab\ncd", 257, special_tokens=()).merges == [(b"a", b"b")]
    assert train_bpe("ab\ncd\ncd", 257, special_tokens=()).merges == [(b"c", b"d")]


# ---------------------------------------------------------------- a tokenizer by kind

def test_get_tokenizer_and_the_protocol(macbeth: str) -> None:
    char = get_tokenizer("char", macbeth)
    bpe = get_tokenizer("bpe", macbeth[:50_000], vocab_size=300)
    gpt2 = get_tokenizer("gpt2")
    assert isinstance(char, CharTokenizer) and isinstance(bpe, BPETokenizer)
    assert isinstance(gpt2, GPT2Tokenizer) and bpe.vocab_size == 300
    for tok in (char, bpe, gpt2):
        assert isinstance(tok, Tokenizer)
    assert get_tokenizer("bpe", macbeth[:50_000]).vocab_size == 512  # the default


def test_get_tokenizer_errors() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind 'word'; choose one of char, bpe"):
        get_tokenizer("word", "text")
    with pytest.raises(ValueError, match="vocab_size applies only to the 'bpe' tokenizer"):
        get_tokenizer("char", "text", vocab_size=10)
    with pytest.raises(ValueError, match="pass text="):
        get_tokenizer("bpe")
