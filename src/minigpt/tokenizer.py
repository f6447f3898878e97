"""Tokenizers: text <-> lists of token ids in [0, V).

Three kinds share one interface (`Tokenizer`):

* `CharTokenizer`: one token per character of a fixed alphabet (Tiny Shakespeare: V = 65).
* `BPETokenizer`: byte-level BPE with GPT-2's pre-tokenisation regex, from merges that
  `minigpt.bpe.train_bpe` learned; they are handed to `tiktoken.Encoding`, the fast encoder,
  and a pure-Python `encode_reference` applies the same merges the slow, readable way.
* `GPT2Tokenizer`: GPT-2's own 50,257-token encoding (`gpt2_encoding()`), built offline from
  the `gpt2.tiktoken` ranks that `python -m minigpt assets` fetched and verified.

Special tokens are explicit: `encode` refuses text that contains a special token's string
unless the caller allows it (`allowed_special`), `encode_ordinary` treats such strings as plain
text, and `decode` rejects ids outside [0, V). `with_special_tokens` appends new ones (the
chat's roles), and `tokenizer_from_dict` rebuilds a tokenizer stored in a checkpoint.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import operator
from collections.abc import Iterable, Sequence, Set
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import regex
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from minigpt.files import GPT2_TIKTOKEN_SHA256, ChecksumError, gpt2_ranks_path

ENDOFTEXT = "<|endoftext|>"
#: The chat format's special tokens (`minigpt.posttrain.chat`): who speaks a turn, and where it
#: ends.
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END_OF_TURN = "<|end|>"
CHAT_TOKENS = (USER, ASSISTANT, END_OF_TURN)
GPT2_PAT_STR: str = r50k_pat_str
"""GPT-2's pre-tokenisation regex (tiktoken's `r50k_base` pattern): splits text into chunks
(contractions, letter runs, digit runs, punctuation runs, whitespace) that BPE never merges
across, each letter/digit/punctuation run taking at most one leading space."""

AllowedSpecial = Set[str] | Literal["all"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, training and sampling need from a tokenizer."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int:
        """V: ids lie in [0, V)."""
        ...

    @property
    def special_tokens(self) -> dict[str, int]: ...

    def encode(self, text: str, *, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        """Ids of `text`; strings of the special tokens in `allowed_special` become those
        tokens, and any other special token's string in the text is an error."""
        ...

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens: their strings are encoded as plain text."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; an id outside [0, V) raises ValueError."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, lists, dicts) that `tokenizer_from_dict` rebuilds it from."""
        ...


# ----------------------------------------------------------------- shared special handling

def _allowed(allowed_special: AllowedSpecial, special_tokens: dict[str, int]) -> set[str]:
    if allowed_special == "all":
        return set(special_tokens)
    if isinstance(allowed_special, str):
        raise TypeError(f"allowed_special must be 'all' or a set of strings, not the string "
                        f"{allowed_special!r}")
    unknown = sorted(set(allowed_special) - set(special_tokens))
    if unknown:
        raise ValueError(f"allowed_special names {unknown}, which are not special tokens of "
                         f"this tokenizer; its special tokens are {sorted(special_tokens)}")
    return set(allowed_special)


def _refuse_disallowed(text: str, special_tokens: dict[str, int], allowed: set[str]) -> None:
    for token in special_tokens:
        if token not in allowed and token in text:
            raise ValueError(
                f"the text contains the special token {token!r}: pass allowed_special="
                f"{{{token!r}}} to encode it as one token, or use encode_ordinary() to encode "
                f"it as plain text")


def _check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    checked = []
    for i in ids:
        try:
            value = operator.index(i)
        except TypeError:
            raise TypeError(f"token ids must be integers, got {i!r}") from None
        if not 0 <= value < vocab_size:
            raise ValueError(f"unknown token id {value}: ids must lie in [0, {vocab_size})")
        checked.append(value)
    return checked


def _check_special_names(special_tokens: Sequence[str]) -> list[str]:
    if isinstance(special_tokens, str):
        raise TypeError(f"special_tokens must be a sequence of strings, not the string "
                        f"{special_tokens!r}")
    names = list(special_tokens)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"special tokens must be non-empty strings, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"special tokens must be distinct, got {names}")
    return names


# Letters, digits, punctuation, whitespace and non-ASCII text: a split pattern must cut
# it into non-empty pieces that, joined, give it back, or BPE loses (or chokes on) text.
_PATTERN_PROBE = "Hello, world! It's 2024:\n\tcafé  中文 🙂?! x\n"
_BYTE_RANKS = {bytes([b]): b for b in range(256)}


def _compile_pattern(pat_str: str) -> regex.Pattern[str]:
    """The pre-tokenisation regex ``pat_str``, compiled, after checking that both regex
    engines (Python's `regex` and tiktoken's) accept it and that it splits text into
    non-empty pieces that cover it."""
    try:
        pattern = regex.compile(pat_str)
    except regex.error as err:
        raise ValueError(f"pat_str {pat_str!r} is not a valid regular expression: "
                         f"{err}") from None
    try:
        tiktoken.Encoding(name="pattern-check", pat_str=pat_str,
                          mergeable_ranks=_BYTE_RANKS, special_tokens={})
    except ValueError as err:
        raise ValueError(f"pat_str {pat_str!r} is a regular expression that tiktoken's "
                         f"engine cannot compile: {err}") from None
    pieces = [m.group() for m in pattern.finditer(_PATTERN_PROBE)]
    if "" in pieces:
        raise ValueError(f"pat_str {pat_str!r} matches the empty string; every piece it "
                         "splits text into must hold at least one character")
    if "".join(pieces) != _PATTERN_PROBE:
        raise ValueError(f"pat_str {pat_str!r} does not cover the text it splits: of "
                         f"{_PATTERN_PROBE!r} it keeps only {''.join(pieces)!r}, and BPE "
                         "would drop the rest")
    return pattern


# ------------------------------------------------------------------------- characters

class CharTokenizer:
    """One id per character: ids 0..C-1 are the characters in sorted order, then the special
    tokens (if any) take ids C, C+1, ..."""

    def __init__(self, chars: str, special_tokens: Sequence[str] = ()) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError("chars must be a non-empty string of distinct characters")
        if len(set(chars)) != len(chars):
            raise ValueError(f"chars must be distinct; {chars!r} repeats some")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self._special = {s: len(chars) + k
                         for k, s in enumerate(_check_special_names(special_tokens))}
        self.itos = list(chars) + list(self._special)

    @classmethod
    def from_text(cls, text: str, special_tokens: Sequence[str] = ()) -> CharTokenizer:
        """The vocabulary of `text`: its distinct characters, sorted by code point."""
        return cls("".join(sorted(set(text))), special_tokens)

    @property
    def name(self) -> str:
        return "char"

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def encode_ordinary(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            pos, c = next((p, c) for p, c in enumerate(text) if c not in self.stoi)
            raise ValueError(f"character {c!r} (U+{ord(c):04X}) at position {pos} is not in the "
                             f"vocabulary of {len(self.chars)} characters") from None

    def encode(self, text: str, *, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        allowed = _allowed(allowed_special, self._special)
        _refuse_disallowed(text, self._special, allowed)
        if not allowed:
            return self.encode_ordinary(text)
        # Longest first, so that a special token that contains another wins.
        splitter = regex.compile(
            "(" + "|".join(regex.escape(s) for s in sorted(allowed, key=len, reverse=True)) + ")")
        ids: list[int] = []
        for k, piece in enumerate(splitter.split(text)):
            ids += [self._special[piece]] if k % 2 else self.encode_ordinary(piece)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.itos[i] for i in _check_ids(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "char", "chars": self.chars, "special_tokens": list(self._special)}


# ----------------------------------------------------------------------- byte-level BPE

class BPETokenizer:
    """Byte-level BPE: ids 0..255 are the bytes, id 256 + k is the k-th merge, and the special
    tokens come last. Encoding runs in tiktoken, built from our merges."""

    def __init__(self, merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] = (ENDOFTEXT,), *,
                 pat_str: str = GPT2_PAT_STR, name: str | None = None) -> None:
        ranks = {bytes([b]): b for b in range(256)}
        pair_ids: dict[tuple[int, int], int] = {}
        for a, b in merges:
            if a not in ranks or b not in ranks:
                raise ValueError(f"merge ({a!r}, {b!r}) uses a token no earlier merge made")
            if a + b in ranks:
                raise ValueError(f"merge ({a!r}, {b!r}) makes {a + b!r}, already a token")
            pair_ids[ranks[a], ranks[b]] = ranks[a + b] = len(ranks)
        names = _check_special_names(special_tokens)
        self._special = {s: len(ranks) + k for k, s in enumerate(names)}
        self._merges = [(bytes(a), bytes(b)) for a, b in merges]
        self._pair_ids = pair_ids
        self._pattern = _compile_pattern(pat_str)
        self.pat_str = pat_str
        self._name = name or f"minigpt-bpe-{len(ranks) + len(names)}"
        self.encoding = tiktoken.Encoding(name=self._name, pat_str=pat_str,
                                          mergeable_ranks=ranks, special_tokens=self._special)

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._merges) + len(self._special)

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    @property
    def merges(self) -> list[tuple[bytes, bytes]]:
        """The merges in the order they were learned: merge k made token 256 + k."""
        return list(self._merges)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one (non-special) token stands for."""
        _check_ids([token_id], 256 + len(self._merges))
        return self.encoding.decode_single_token_bytes(token_id)

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode(self, text: str, *, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        allowed = _allowed(allowed_special, self._special)
        _refuse_disallowed(text, self._special, allowed)
        return self.encoding.encode(text, allowed_special=allowed, disallowed_special=())

    def encode_reference(self, text: str) -> list[int]:
        """The same ids as `encode_ordinary`, computed in plain Python from `merges`: split
        the text with the pre-tokenisation regex, then in each chunk repeatedly merge the
        adjacent pair that was learned first, until no learned pair is left."""
        ids: list[int] = []
        for chunk in self._pattern.findall(text):
            parts = list(chunk.encode("utf-8"))
            while len(parts) > 1:
                candidates = [self._pair_ids.get(pair) for pair in pairwise(parts)]
                best = min((c for c in candidates if c is not None), default=None)
                if best is None:
                    break
                merged, k = [], 0
                while k < len(parts):  # replace every occurrence, left to right
                    if k + 1 < len(parts) and self._pair_ids.get((parts[k], parts[k + 1])) == best:
                        merged.append(best)
                        k += 2
                    else:
                        merged.append(parts[k])
                        k += 1
                parts = merged
            ids += parts
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; byte sequences that are not valid UTF-8 (a sequence cut inside a
        character) decode to U+FFFD, as in tiktoken."""
        return self.encoding.decode(_check_ids(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "bpe", "name": self._name, "pat_str": self.pat_str,
                "merges": [[a.hex(), b.hex()] for a, b in self._merges],
                "special_tokens": list(self._special)}


# ------------------------------------------------------------------------------- GPT-2

def load_ranks(path: Path, sha256: str) -> dict[bytes, int]:
    """Read a `.tiktoken` ranks file (one "base64(token) rank" per line) after checking its hash.

    `tiktoken.load.load_tiktoken_bpe` parses the same format but also keeps a copy of every
    file it reads in a cache folder of its own (by default under the system's temporary
    directory); reading the file here keeps everything in minigpt's cache.
    """
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ChecksumError(f"{path} has sha256 {digest}, expected {sha256}; delete it and run "
                            "`python -m minigpt assets` again")
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:  # binascii.Error is a ValueError
            raise ValueError(f"{path}, line {number}: not 'base64-token rank' ({err})") from None
    return ranks


@functools.cache
def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's encoding (V = 50,257; `<|endoftext|>` = 50256) from the local, verified
    `gpt2.tiktoken`; no network. Raises `MissingAssetError` if set-up has not fetched it."""
    ranks = load_ranks(gpt2_ranks_path(), GPT2_TIKTOKEN_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


class GPT2Tokenizer:
    """The `Tokenizer` interface around `gpt2_encoding()`."""

    def __init__(self) -> None:
        self.encoding = gpt2_encoding()

    @property
    def name(self) -> str:
        return "gpt2"

    @property
    def vocab_size(self) -> int:
        return int(self.encoding.n_vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {token: self.encoding.encode_single_token(token)
                for token in self.encoding.special_tokens_set}

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode(self, text: str, *, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        allowed = _allowed(allowed_special, self.special_tokens)
        _refuse_disallowed(text, self.special_tokens, allowed)
        return self.encoding.encode(text, allowed_special=allowed, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(_check_ids(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "gpt2"}


# ------------------------------------------------------------------- adding special tokens

def with_special_tokens(tokenizer: Tokenizer,
                        names: Sequence[str] = CHAT_TOKENS) -> CharTokenizer | BPETokenizer:
    """A copy of ``tokenizer`` with the special tokens ``names`` appended: they take ids
    V, V + 1, ... (V the old vocabulary size), so every old id keeps its meaning and every
    text encodes to the same ids as before; only the new strings become single tokens.

    The character and BPE tokenizers take new tokens; GPT-2's encoding is fixed.
    """
    if not isinstance(tokenizer, CharTokenizer | BPETokenizer):
        raise TypeError(f"special tokens can be added to a CharTokenizer or a BPETokenizer, "
                        f"not to a {type(tokenizer).__name__}")
    new = _check_special_names(names)
    old = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.__getitem__)
    taken = sorted(set(new) & set(old))
    if taken:
        raise ValueError(f"{taken} are special tokens of {tokenizer.name} already; its special "
                         f"tokens are {old}")
    if isinstance(tokenizer, CharTokenizer):
        return CharTokenizer(tokenizer.chars, old + new)
    return BPETokenizer(tokenizer.merges, old + new, pat_str=tokenizer.pat_str)


# -------------------------------------------------------------- rebuilding a stored one

KINDS = ("char", "bpe", "gpt2")


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Rebuild a tokenizer from its `to_dict()` (e.g. stored in a checkpoint).

    Raises ValueError, with the reason, for anything `to_dict()` cannot have written.
    """
    kind = d.get("kind") if isinstance(d, dict) else None
    try:
        if kind == "char":
            return CharTokenizer(d["chars"], d["special_tokens"])
        if kind == "bpe":
            merges = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in d["merges"]]
            return BPETokenizer(merges, d["special_tokens"], pat_str=d["pat_str"],
                                name=d["name"])
    except KeyError as err:
        raise ValueError(f"the {kind} tokenizer's description lacks the entry {err}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"the {kind} tokenizer's description is invalid: {err}") from None
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"not a tokenizer description: 'kind' must be one of {', '.join(KINDS)}, "
                     f"got {kind!r}")
