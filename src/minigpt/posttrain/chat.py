"""The chat format: a conversation as one sequence of tokens, and back.

A conversation is a list of turns, each a role (``"user"`` or ``"assistant"``) and a text.
It is written as the role's special token, the text, and the end-of-turn token, turn after
turn::

    <|user|>first word: Now, fair Hippolyta<|end|><|assistant|>Now<|end|>

`render` and `parse` convert between turns and that text; `encode_conversation` and
`decode_conversation` between turns and token ids, with a mask of the tokens an assistant
says (its texts and their end tokens: what supervised fine-tuning trains on). Anything that
is not a conversation is refused with a `ChatFormatError` saying where and why.
`add_chat_tokens` gives a pretrained model and its tokenizer the three new tokens, keeping
every old weight, `extend_context` lets a model without positional weights read a longer
context, and `reply` lets the model answer. `chat_loop` holds a conversation with
it over a terminal's input and output (`python -m minigpt chat`): the model answers each
message (`answer_turn`), and a conversation longer than the context keeps its latest turns
(`fit_context`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

import regex
import torch
from torch import Tensor

from minigpt.config import GPTConfig
from minigpt.decoding import generate_by_length
from minigpt.model import GPT
from minigpt.tokenizer import (
    ASSISTANT,
    CHAT_TOKENS,
    END_OF_TURN,
    USER,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    with_special_tokens,
)

Role = Literal["user", "assistant"]
ROLE_TOKENS: dict[str, str] = {"user": USER, "assistant": ASSISTANT}
_ROLE_OF = {token: role for role, token in ROLE_TOKENS.items()}
_SPECIAL = regex.compile("(" + "|".join(regex.escape(t) for t in CHAT_TOKENS) + ")")


class ChatFormatError(ValueError):
    """A text, a list of ids or a list of turns that is not a conversation."""


@dataclass(frozen=True)
class Turn:
    """One turn of a conversation: who speaks (``"user"`` or ``"assistant"``) and what."""

    role: Role
    text: str

    def __post_init__(self) -> None:
        if self.role not in ROLE_TOKENS:
            raise ChatFormatError(f"a turn's role must be one of {sorted(ROLE_TOKENS)}, "
                                  f"got {self.role!r}")
        if not isinstance(self.text, str):
            raise ChatFormatError(f"a turn's text must be a str, got {type(self.text).__name__}")
        found = _SPECIAL.search(self.text)
        if found:
            raise ChatFormatError(f"the {self.role}'s text {_snippet(self.text)} contains the "
                                  f"special token {found.group()!r} at position "
                                  f"{found.start()}; a turn's text may not hold "
                                  f"{', '.join(CHAT_TOKENS)}")


def _snippet(text: str, width: int = 30) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


def render(turns: Sequence[Turn]) -> str:
    """The conversation as text: ``<|role|>text<|end|>`` for each turn."""
    return "".join(ROLE_TOKENS[t.role] + t.text + END_OF_TURN for t in turns)


# A conversation read token by token: special tokens (by their string) and plain texts, with
# the position (character or token index) each starts at.
Piece = tuple[str, str, int]  # ("special" | "text", the token or the text, position)


def _assemble(pieces: Iterable[Piece], unit: str) -> list[Turn]:
    """Turns from pieces that must follow ``(<|role|> text? <|end|>)+``."""
    turns: list[Turn] = []
    role: str | None = None  # the open turn's role
    text = ""
    for kind, value, pos in pieces:
        if kind == "text":
            if role is None:
                raise ChatFormatError(f"the text {_snippet(value)} at {unit} {pos} lies outside "
                                      f"any turn; a turn opens with {USER} or {ASSISTANT}")
            text = value
        elif value in _ROLE_OF:
            if role is not None:
                raise ChatFormatError(f"{value} at {unit} {pos} opens a turn inside the "
                                      f"unfinished {role} turn; close that with {END_OF_TURN}")
            role, text = _ROLE_OF[value], ""
        elif value == END_OF_TURN:
            if role is None:
                raise ChatFormatError(f"{END_OF_TURN} at {unit} {pos} closes no turn; a turn "
                                      f"opens with {USER} or {ASSISTANT}")
            turns.append(Turn(role, text))  # type: ignore[arg-type]
            role = None
        else:
            raise ChatFormatError(f"the special token {value!r} at {unit} {pos} has no place in "
                                  f"a conversation; its tokens are {', '.join(CHAT_TOKENS)}")
    if role is not None:
        raise ChatFormatError(f"the last turn ({role}) is unfinished: it must end with "
                              f"{END_OF_TURN}")
    if not turns:
        raise ChatFormatError("no turn found: a conversation needs at least one")
    return turns


def parse(text: str) -> list[Turn]:
    """The turns of a rendered conversation; `ChatFormatError` if ``text`` is not one."""
    pieces: list[Piece] = []
    pos = 0
    for k, part in enumerate(_SPECIAL.split(text)):
        if part:
            pieces.append(("special" if k % 2 else "text", part, pos))
        pos += len(part)
    return _assemble(pieces, "character")


def _chat_ids(tokenizer: Tokenizer) -> dict[str, int]:
    special = tokenizer.special_tokens
    missing = [t for t in CHAT_TOKENS if t not in special]
    if missing:
        raise ValueError(f"the tokenizer {tokenizer.name} lacks the chat tokens {missing}; "
                         "add them with minigpt.tokenizer.with_special_tokens")
    return special


def encode_conversation(turns: Sequence[Turn],
                        tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation, and a mask that is True on the tokens an
    assistant says: its texts and their end tokens (not its role token, which the user's
    side writes to ask for an answer). Texts are encoded with ``encode_ordinary``."""
    special = _chat_ids(tokenizer)
    ids: list[int] = []
    mask: list[bool] = []
    for turn in turns:
        body = tokenizer.encode_ordinary(turn.text) + [special[END_OF_TURN]]
        said = turn.role == "assistant"
        ids += [special[ROLE_TOKENS[turn.role]]] + body
        mask += [False] + [said] * len(body)
    return ids, mask


def decode_conversation(ids: Sequence[int], tokenizer: Tokenizer) -> list[Turn]:
    """The turns of a sequence of token ids; `ChatFormatError` if it is not a conversation."""
    special = _chat_ids(tokenizer)
    name_of = {i: s for s, i in special.items()}
    ids = list(ids)
    pieces: list[Piece] = []
    start = 0
    for k, i in enumerate([*ids, None]):
        if i is None or i in name_of:
            if k > start:  # the plain tokens since the last special one
                pieces.append(("text", tokenizer.decode(ids[start:k]), start))
            if i is not None:
                pieces.append(("special", name_of[i], k))
            start = k + 1
    return _assemble(pieces, "token")


def prompt_ids(turns: Sequence[Turn], tokenizer: Tokenizer) -> list[int]:
    """The ids that ask for the assistant's next turn: the conversation, then
    ``<|assistant|>``. The conversation must end with a user's turn."""
    if not turns or turns[-1].role != "user":
        raise ChatFormatError("a prompt asks for an answer: its last turn must be the user's")
    ids, _ = encode_conversation(turns, tokenizer)
    return ids + [_chat_ids(tokenizer)[ASSISTANT]]


# ------------------------------------------------------------------------------ the model

@torch.no_grad()
def extend_vocabulary(model: GPT, vocab_size: int) -> GPT:
    """A copy of ``model`` that reads and predicts ``vocab_size`` tokens, the old V first.

    Every old weight is kept exactly: the rows 0..V-1 of the token embedding (and of the
    head, if it is not tied to it) and every other parameter, so the old tokens' logits are
    the old model's. A new token's row starts as the mean of the old rows: it is read like
    an average token and, through the head, scored like one, so it takes a small share of
    the probability rather than a random, possibly large one.
    """
    old = model.config.vocab_size
    if vocab_size < old:
        raise ValueError(f"vocab_size must be an int >= the model's {old} (a vocabulary only "
                         f"grows), got {vocab_size!r}")
    state = model.state_dict()
    for name in ("wte.weight", "lm_head.weight"):
        rows = state[name]
        state[name] = torch.cat([rows, rows.mean(0, keepdim=True).expand(vocab_size - old, -1)])
    return _remade(model, state, vocab_size=vocab_size)


@torch.no_grad()
def extend_context(model: GPT, context_length: int) -> GPT:
    """A copy of ``model`` that reads up to ``context_length`` tokens, every weight kept.

    Only a model whose positions have no weights can: rotary positions and the sinusoidal
    encoding are functions of the position, computed for any length, while GPT-2's learned
    positions have a row of weights per position and none beyond the context it was
    trained with. The copy computes the old model's logits on any input the old one reads;
    how well it uses the positions it never trained on is for fine-tuning to teach.
    """
    old = model.config.context_length
    if context_length < old:
        raise ValueError(f"context_length must be an int >= the model's {old} (a context "
                         f"only grows), got {context_length!r}")
    if model.config.positional == "learned" and context_length > old:
        raise ValueError(f"a model with learned positions has weights for its {old} "
                         f"positions only and cannot read {context_length}; rotary "
                         "('rope') or sinusoidal positions can")
    return _remade(model, model.state_dict(), context_length=context_length)


def _remade(model: GPT, state: dict[str, Tensor], **changes: int) -> GPT:
    """A GPT of ``model``'s config with ``changes``, holding ``state``, on ``model``'s device
    and dtype and in its mode (training or eval)."""
    param = next(model.parameters())
    with torch.random.fork_rng(devices=[]):  # the new model's random start is overwritten
        new = GPT(GPTConfig(**(model.config.model_dump() | changes)))  # validated
    new.to(device=param.device, dtype=param.dtype)
    new.load_state_dict(state)
    return new.train(model.training)


def add_chat_tokens(model: GPT, tokenizer: CharTokenizer | BPETokenizer,
                    ) -> tuple[GPT, CharTokenizer | BPETokenizer]:
    """``tokenizer`` with the chat tokens (`with_special_tokens`) and ``model`` extended to
    read and predict them (`extend_vocabulary`)."""
    if tokenizer.vocab_size != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens and the model "
                         f"{model.config.vocab_size}: they must be a model and its tokenizer")
    chat = with_special_tokens(tokenizer, CHAT_TOKENS)
    return extend_vocabulary(model, chat.vocab_size), chat


def reply(model: GPT, tokenizer: Tokenizer, turns: Sequence[Turn], *,
          max_new_tokens: int = 32) -> str:
    """The assistant's greedy answer to ``turns``: the most likely token each step, until
    it ends its turn, the context is full or ``max_new_tokens`` tokens have come."""
    ids = prompt_ids(turns, tokenizer)
    return greedy_replies(model, tokenizer, [ids], max_new_tokens=max_new_tokens)[0]


def greedy_replies(model: GPT, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], *,
                   max_new_tokens: int = 32, stop: int | None = None) -> list[str]:
    """Greedy continuations of several prompts (lists of ids), each cut before its first
    ``stop`` token (default: the end of turn) and decoded. Prompts of equal length are
    decoded together (`minigpt.decoding.generate_by_length`); a continuation stops where
    the context is full."""
    stop = _chat_ids(tokenizer)[END_OF_TURN] if stop is None else stop
    out: list[str] = [""] * len(prompts)
    for rows, seqs in generate_by_length(model, prompts, max_new_tokens, greedy=True,
                                         stop_id=stop):
        for k, seq in zip(rows, seqs[:, len(prompts[rows[0]]):].tolist(), strict=True):
            cut = seq.index(stop) if stop in seq else len(seq)
            out[k] = tokenizer.decode(seq[:cut])
    return out


# ----------------------------------------------------------------------- a conversation

def fit_context(turns: Sequence[Turn], tokenizer: Tokenizer, context_length: int, *,
                room: int = 2) -> list[Turn]:
    """``turns`` without their oldest turns, as few as needed for the prompt
    (`prompt_ids`) to leave ``room`` tokens for the answer in the context, and starting with
    a user's turn. The last message is kept alone even when it leaves less room, if it
    leaves two tokens (a character and the end of the turn); ValueError if not."""
    for start in range(len(turns)):
        kept = turns[start:]
        if kept[0].role == "user" and len(prompt_ids(kept, tokenizer)) + room <= context_length:
            return list(kept)
    n = len(prompt_ids(turns[-1:], tokenizer))
    if n < context_length - 1:
        return list(turns[-1:])
    raise ValueError(f"this message makes a prompt of {n} tokens; the model reads "
                     f"{context_length}, and an answer needs room: write a shorter one")


def answer_turn(model: GPT, tokenizer: Tokenizer, turns: Sequence[Turn], *,
                max_new_tokens: int = 32) -> Turn:
    """The assistant's next turn after ``turns``: `reply`'s answer, cut before any chat
    token the model produced (a turn's text may not hold one)."""
    answer = reply(model, tokenizer, turns, max_new_tokens=max_new_tokens)
    cut = min((answer.index(t) for t in CHAT_TOKENS if t in answer), default=len(answer))
    return Turn("assistant", answer[:cut])


def chat_loop(model: GPT, tokenizer: Tokenizer, stdin: TextIO, stdout: TextIO, *,
              max_new_tokens: int = 32) -> list[Turn]:
    """Read the user's lines from ``stdin`` and write the model's answers to ``stdout``
    until end of input or Ctrl-C; returns the turns. When the conversation outgrows the
    context its oldest turns are dropped (`fit_context`) and the user told; a
    message that cannot be sent (too long by itself, a character or token the model cannot
    read) is refused with the reason."""
    turns: list[Turn] = []
    T = model.config.context_length
    while True:
        stdout.write("you> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:
            stdout.write("\nbye\n")
            return turns
        if not line.strip():
            continue
        try:
            kept = fit_context([*turns, Turn("user", line.rstrip("\n"))], tokenizer, T,
                               room=max_new_tokens)
        except ValueError as err:  # incl. ChatFormatError
            stdout.write(f"(not sent: {err})\n")
            continue
        if forgotten := len(turns) + 1 - len(kept):
            stdout.write(f"(the conversation outgrew the context of {T} tokens: its first "
                         f"{forgotten} turn(s) are forgotten)\n")
        try:
            answer = answer_turn(model, tokenizer, kept, max_new_tokens=max_new_tokens)
        except KeyboardInterrupt:
            stdout.write("\nbye\n")
            return kept
        turns = [*kept, answer]
        stdout.write(f"{answer.text}\n")
