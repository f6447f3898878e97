"""minigpt.posttrain.chat: the chat format (render/parse, ids and mask), the model's new
tokens, and a conversation kept within the context."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minigpt.bpe import train_bpe
from minigpt.config import GPTConfig
from minigpt.model import GPT
from minigpt.posttrain.chat import (
    ChatFormatError,
    Turn,
    add_chat_tokens,
    answer_turn,
    chat_loop,
    decode_conversation,
    encode_conversation,
    extend_context,
    extend_vocabulary,
    fit_context,
    greedy_replies,
    parse,
    prompt_ids,
    render,
    reply,
)
from minigpt.tokenizer import (
    ASSISTANT,
    CHAT_TOKENS,
    END_OF_TURN,
    USER,
    CharTokenizer,
    with_special_tokens,
)

ALPHABET = "\n !',-.:;?<>|ABCMWabcdefghiklmnorstuvwy"
CHAR = with_special_tokens(CharTokenizer.from_text(ALPHABET))

# Texts built from pieces of the special tokens, so that near-misses ("<|end", "|>") are
# common: none of them may be mistaken for a token, and none may hide one.
pieces = st.sampled_from(["<", "|", ">", "<|", "|>", "end", "user", "assistant", "a", " ",
                          "\n", "<|end", "user|>", "<<|", "|>>"])
texts = st.lists(pieces | st.text(ALPHABET, max_size=3), max_size=12).map("".join).filter(
    lambda t: not any(token in t for token in CHAT_TOKENS))
turns = st.builds(Turn, st.sampled_from(["user", "assistant"]), texts)
conversations = st.lists(turns, min_size=1, max_size=5)


def example() -> list[Turn]:
    return [Turn("user", "Who?"), Turn("assistant", "Macbeth."), Turn("user", "And?")]


def test_render_writes_each_turn_between_its_role_and_the_end() -> None:
    assert render(example()) == (f"{USER}Who?{END_OF_TURN}{ASSISTANT}Macbeth.{END_OF_TURN}"
                                 f"{USER}And?{END_OF_TURN}")


@given(conversations)
def test_parse_inverts_render(conversation: list[Turn]) -> None:
    assert parse(render(conversation)) == conversation


@given(conversations)
def test_decode_inverts_encode(conversation: list[Turn]) -> None:
    ids, mask = encode_conversation(conversation, CHAR)
    assert decode_conversation(ids, CHAR) == conversation
    assert CHAR.decode(ids) == render(conversation) and len(mask) == len(ids)


@given(conversations)
def test_decode_inverts_encode_with_bpe(bpe_chat: Any, conversation: list[Turn]) -> None:
    ids, _ = encode_conversation(conversation, bpe_chat)
    assert decode_conversation(ids, bpe_chat) == conversation


@pytest.fixture(scope="module")
def bpe_chat() -> Any:
    return with_special_tokens(train_bpe("the end of the user's turn <| |> " * 20, 270))


def test_the_mask_marks_what_the_assistant_says() -> None:
    ids, mask = encode_conversation(example(), CHAR)
    said = "".join(CHAR.decode([i]) for i, m in zip(ids, mask, strict=True) if m)
    assert said == f"Macbeth.{END_OF_TURN}"
    assert prompt_ids(example(), CHAR) == ids + [CHAR.special_tokens[ASSISTANT]]


@pytest.mark.parametrize("text, message", [
    ("", "no turn found"),
    ("hello", r"the text 'hello' at character 0 lies outside any turn"),
    (f"{USER}hi", r"the last turn \(user\) is unfinished: it must end with <\|end\|>"),
    (f"{USER}hi{ASSISTANT}", r"<\|assistant\|> at character 10 opens a turn inside the "
                             r"unfinished user turn"),
    (f"{END_OF_TURN}", r"<\|end\|> at character 0 closes no turn"),
    (f"{USER}a{END_OF_TURN}b", r"the text 'b' at character 16 lies outside any turn"),
])
def test_parse_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ChatFormatError, match=message):
        parse(text)


def test_decode_says_what_is_wrong(bpe_chat: Any) -> None:
    user, end = bpe_chat.special_tokens[USER], bpe_chat.special_tokens[END_OF_TURN]
    with pytest.raises(ChatFormatError, match=r"'<\|endoftext\|>' at token 1 has no place"):
        decode_conversation([user, bpe_chat.special_tokens["<|endoftext|>"], end], bpe_chat)
    with pytest.raises(ChatFormatError, match="at token 0 lies outside any turn"):
        decode_conversation(bpe_chat.encode("the end") + [user, end], bpe_chat)
    with pytest.raises(ValueError, match=r"lacks the chat tokens \['<\|user\|>'"):
        decode_conversation([1, 2], CharTokenizer.from_text("abc"))


def test_turns_are_checked() -> None:
    with pytest.raises(ChatFormatError, match="role must be one of"):
        Turn("system", "hi")  # type: ignore[arg-type]
    with pytest.raises(ChatFormatError, match=r"contains the special token '<\|end\|>' at "
                                              "position 2"):
        Turn("user", f"hi{END_OF_TURN}")
    with pytest.raises(ChatFormatError, match="a turn's text must be a str, got int"):
        Turn("user", 3)  # type: ignore[arg-type]
    for turns in ([Turn("assistant", "a")], []):
        with pytest.raises(ChatFormatError, match="last turn must be the user's"):
            prompt_ids(turns, CHAR)


@pytest.mark.parametrize("tie", [True, False])
def test_extending_the_vocabulary_keeps_every_old_weight(tie: bool) -> None:
    torch.manual_seed(0)
    old = GPT(GPTConfig.debug(vocab_size=10, tie_weights=tie)).eval()
    new = extend_vocabulary(old, 13)
    assert new.config.vocab_size == 13 and not new.training
    for name, p in old.state_dict().items():
        q = new.state_dict()[name]
        assert torch.equal(q[:10] if name in ("wte.weight", "lm_head.weight") else q, p), name
    assert torch.equal(new.wte.weight[10:], old.wte.weight.mean(0).expand(3, -1))
    assert (new.lm_head.weight is new.wte.weight) == tie
    ids = torch.randint(0, 10, (2, 8))
    torch.testing.assert_close(new(ids)[..., :10], old(ids), rtol=0, atol=1e-6)


def test_extending_the_vocabulary_errors() -> None:
    model = GPT(GPTConfig.debug(vocab_size=10))
    with pytest.raises(ValueError, match="vocab_size must be an int >= the model's 10 \\(a "
                                         "vocabulary only grows\\), got 9"):
        extend_vocabulary(model, 9)
    with pytest.raises(ValueError, match="the tokenizer has 3 tokens and the model 10"):
        add_chat_tokens(model, CharTokenizer.from_text("abc"))


@pytest.mark.parametrize("positional", ["rope", "sinusoidal"])
def test_extending_the_context_keeps_every_weight_and_logit(positional: str) -> None:
    torch.manual_seed(0)
    old = GPT(GPTConfig.debug(vocab_size=10, context_length=8, positional=positional)).eval()
    new = extend_context(old, 20)
    assert new.config.context_length == 20 and not new.training
    assert all(torch.equal(new.state_dict()[k], v) for k, v in old.state_dict().items())
    ids = torch.randint(0, 10, (2, 8))
    torch.testing.assert_close(new(ids), old(ids), rtol=0, atol=0)
    assert new(torch.randint(0, 10, (1, 20))).shape == (1, 20, 10)


def test_extending_the_context_errors() -> None:
    # extend_context is where finetune's context_length is first checked
    learned = GPT(GPTConfig.debug(vocab_size=10, context_length=8))
    with pytest.raises(ValueError, match="learned positions has weights for its 8 positions"):
        extend_context(learned, 16)
    rope = GPT(GPTConfig.debug(vocab_size=10, context_length=8, positional="rope"))
    with pytest.raises(ValueError, match=r"an int >= the model's 8 \(a context only grows"):
        extend_context(rope, 4)
    with pytest.raises(ValueError, match="context_length\n  Input should be a valid integer"):
        extend_context(rope, 12.5)  # type: ignore[arg-type]


def test_add_chat_tokens_and_reply() -> None:
    torch.manual_seed(0)
    base = CharTokenizer.from_text(ALPHABET)
    model, tok = add_chat_tokens(GPT(GPTConfig.debug(vocab_size=base.vocab_size,
                                                     context_length=16)), base)
    assert model.config.vocab_size == tok.vocab_size == base.vocab_size + 3
    answer = reply(model, tok, [Turn("user", "abc")], max_new_tokens=4)
    assert isinstance(answer, str) and len(answer) <= 4
    with pytest.raises(ValueError, match="prompt 0 has 16 tokens; a prompt needs 1 to 15"):
        greedy_replies(model, tok, [[0] * 16])


def test_fit_context_drops_the_oldest_turns_and_starts_with_the_user() -> None:
    turns = [Turn("user", "who"), Turn("assistant", "me"), Turn("user", "abc"),
             Turn("assistant", "cba"), Turn("user", "why")]
    assert len(prompt_ids(turns, CHAR)) == 25
    assert fit_context(turns, CHAR, 100) == turns
    assert fit_context(turns, CHAR, 26) == turns[2:]  # not turns[1:]: it opens with "me"
    assert fit_context(turns, CHAR, 8) == turns[4:]
    with pytest.raises(ValueError, match="this message makes a prompt of 6 tokens; the model "
                                         "reads 7, and an answer needs room"):
        fit_context(turns, CHAR, 7)
    # room for an answer of up to 10 tokens: the prompt keeps at most 90 of 100, 16 of 26
    assert fit_context(turns, CHAR, 100, room=10) == turns
    assert fit_context(turns, CHAR, 35, room=10) == turns
    assert fit_context(turns, CHAR, 34, room=10) == turns[2:]
    assert fit_context(turns, CHAR, 12, room=10) == turns[4:]  # alone it leaves only 6


def test_answer_turn_is_cut_before_any_chat_token(monkeypatch: pytest.MonkeyPatch) -> None:
    import minigpt.posttrain.chat

    torch.manual_seed(0)
    model = GPT(GPTConfig.debug(vocab_size=CHAR.vocab_size, context_length=16))
    turn = answer_turn(model, CHAR, [Turn("user", "abc")], max_new_tokens=4)
    assert turn.role == "assistant" and len(turn.text) <= 4
    monkeypatch.setattr(minigpt.posttrain.chat, "reply", lambda *args, **kwargs: f"hi{USER}more")
    assert answer_turn(model, CHAR, [Turn("user", "abc")]) == Turn("assistant", "hi")


# A conversation in a terminal, with a random model: what matters is the turns, not the words.
def chat_model(context_length: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.debug(vocab_size=CHAR.vocab_size, context_length=context_length))


def test_chat_turns_stay_in_the_chat_format() -> None:
    out = io.StringIO()
    turns = chat_loop(chat_model(), CHAR, io.StringIO("who\n\nand you\n"), out,
                      max_new_tokens=3)
    assert [t.role for t in turns] == ["user", "assistant"] * 2
    assert turns[2].text == "and you" and out.getvalue().count("you> ") == 4


def test_a_long_conversation_forgets_its_first_turns() -> None:
    out = io.StringIO()
    turns = chat_loop(chat_model(), CHAR, io.StringIO("abc\n" * 6), out, max_new_tokens=2)
    assert "(the conversation outgrew the context of 32 tokens: its first" in out.getvalue()
    assert turns[0].role == "user" and len(prompt_ids(turns[:-1], CHAR)) < 31


def test_chat_refuses_messages_it_cannot_take_and_goes_on() -> None:
    out = io.StringIO()
    turns = chat_loop(chat_model(), CHAR, io.StringIO(
        "moon " * 8 + "\n" + "h\u00e9llo\n" + f"{END_OF_TURN}\n" + "who\n"), out,
        max_new_tokens=2)
    text = out.getvalue()
    assert "(not sent: this message makes a prompt of 43 tokens; the model reads 32" in text
    assert "(not sent: character '\u00e9'" in text
    assert "(not sent: the user's text '<|end|>' contains the special token" in text
    assert len(turns) == 2 and text.rstrip().endswith("bye")


def test_ctrl_c_ends_the_chat_cleanly() -> None:
    class Interrupted(io.StringIO):
        def readline(self, *args: object) -> str:
            raise KeyboardInterrupt

    out = io.StringIO()
    assert chat_loop(chat_model(), CHAR, Interrupted(), out) == []
    assert out.getvalue().endswith("bye\n")
