"""Supervised fine-tuning: the masked loss, accumulation weighted by answer tokens, train()
on an ExampleSet, and minigpt.posttrain.sft's encoding of the tasks."""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_parallel import run_script_on_ranks
from torch import Tensor, nn

from minigpt import GPT, GPTConfig
from minigpt.config import TrainConfig
from minigpt.data import ExampleSet
from minigpt.losses import estimate_loss, lm_loss, masked_lm_loss
from minigpt.posttrain import sft
from minigpt.posttrain.chat import decode_conversation
from minigpt.posttrain.sft import encode_conversations, encode_tasks, finetune
from minigpt.posttrain.tasks import Task, conversations
from minigpt.tokenizer import CharTokenizer, with_special_tokens
from minigpt.train import train, train_step

V = 12
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, context_length=12, d_model=16, n_heads=2, n_layers=2))


def examples(n: int = 8, seed: int = 0) -> ExampleSet:
    """Sequences of 4..12 ids whose last 1..6 tokens are the 'answer': unequal counts."""
    rng = np.random.default_rng(seed)
    seqs, masks = [], []
    for _ in range(n):
        length = int(rng.integers(4, 13))
        answer = int(rng.integers(1, min(6, length - 1) + 1))
        seqs.append(rng.integers(0, V, length).tolist())
        masks.append([False] * (length - answer) + [True] * answer)
    return ExampleSet(seqs, masks)


# ----- the loss -------------------------------------------------------------------------

def test_masked_loss_is_the_mean_over_the_answer_tokens() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, V), torch.randint(0, V, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    each = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    expected = each[mask.flatten()]
    torch.testing.assert_close(masked_lm_loss(logits, targets, mask), expected.mean())
    torch.testing.assert_close(masked_lm_loss(logits, targets, mask, reduction="sum"),
                               expected.sum())
    full = torch.ones_like(mask)
    torch.testing.assert_close(masked_lm_loss(logits, targets, full),
                               F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_targets_outside_the_mask_get_no_gradient() -> None:
    logits = torch.randn(1, 4, V, requires_grad=True)
    mask = torch.tensor([[False, True, False, True]])
    masked_lm_loss(logits, torch.randint(0, V, (1, 4)), mask).backward()
    assert logits.grad is not None
    assert not logits.grad[0, [0, 2]].any() and logits.grad[0, [1, 3]].any()


@pytest.mark.parametrize("args, error, message", [
    ((torch.zeros(2, 3, V), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=bool)),
     ValueError, r"logits \(B, T, V\), targets and mask \(B, T\); got \(2, 3, 12\), \(2, 4\)"),
    ((torch.zeros(1, 2, V), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)),
     TypeError, r"the mask says which targets count: .* got torch.float32"),
])
def test_masked_loss_refuses_other_shapes_and_a_mask_of_numbers(
        args: tuple[Tensor, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        masked_lm_loss(*args)


def test_masked_mean_over_no_target_is_nan() -> None:
    """Not checked (it would wait for the device every step): the mean over none is NaN."""
    args = (torch.zeros(1, 2, V), torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, 2, dtype=torch.bool))
    assert masked_lm_loss(*args).isnan()
    assert masked_lm_loss(*args, reduction="sum") == 0


# ----- gradient accumulation --------------------------------------------------------------

def naive_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: Sequence[tuple[Tensor, ...]], **_: object) -> None:
    """The pitfall: the mean of the micro-batches' means (each micro-batch weighs the same,
    whatever its number of answer tokens)."""
    for x, y, mask in micro_batches:
        (lm_loss(model, x, y, mask) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


Step = Callable[..., object]


@pytest.mark.parametrize("step, exact", [(train_step, True), (naive_step, False)])
def test_accumulation_weights_micro_batches_by_their_answer_tokens(step: Step,
                                                                   exact: bool) -> None:
    data = examples(6)
    whole = data.batch(range(6))
    micro = [data.batch([0]), data.batch([1, 2]), data.batch([3, 4, 5])]
    counts = [int(b[2].sum()) for b in micro]
    assert len(set(counts)) > 1  # unequal answer lengths: where the pitfall shows
    reference = tiny()
    lm_loss(reference, *whole).backward()  # the per-token mean over the whole batch
    model = tiny()
    before = copy.deepcopy(model)
    # SGD with rate 1: the update is minus the accumulated gradient.
    step(model, torch.optim.SGD(model.parameters(), lr=1.0), micro, grad_clip=0.0)
    updates = [(p0 - p1).detach() for p0, p1 in
               zip(before.parameters(), model.parameters(), strict=True)]
    grads = [p.grad for p in reference.parameters()]
    matches = all(torch.allclose(u, g, rtol=1e-4, atol=1e-6)  # type: ignore[arg-type]
                  for u, g in zip(updates, grads, strict=True))
    assert matches == exact


def test_a_masked_step_reports_the_per_token_mean() -> None:
    data = examples(4)
    model = tiny()
    with torch.no_grad():
        expected = lm_loss(model, *data.batch(range(4))).item()
    result = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                        [data.batch([0, 1]), data.batch([2, 3])], grad_clip=0.0)
    assert float(result.loss) == pytest.approx(expected, rel=1e-5)


def run_config(**overrides: object) -> TrainConfig:
    values: dict[str, object] = dict(batch_size=4, max_steps=1, warmup_steps=0, lr=0.05,
                                     min_lr=0.0, grad_clip=0.0, eval_interval=100,
                                     eval_steps=2, seed=7)
    return TrainConfig(**(values | overrides))


def test_train_on_examples_accumulates_like_one_batch() -> None:
    # The same 4 sequences in one batch or in 2 micro-batches of 2 (the generator draws
    # the same indices either way): the same step.
    data = examples(16)
    whole = train(tiny(), run_config(batch_size=4), data, examples(4, 1), progress=False)
    split = train(tiny(), run_config(batch_size=2, grad_accum=2), data, examples(4, 1),
                  progress=False)
    assert whole.history.loss[0] == pytest.approx(split.history.loss[0], rel=1e-5)
    # AdamW's first step moves a weight by lr * g / (|g| + eps): by about lr wherever |g| is
    # well above eps, whatever rounding the two ways of summing g leave. Where |g| is near
    # eps, a rounding difference of g moves the step by a fraction of lr (9e-6 seen on
    # AVX2 kernels, with lr 0.05), so the weights agree to a thousandth of lr, not to a fixed
    # 1e-6. Summing the micro-batches wrongly changes the step's sign in places: 2 lr.
    lr = run_config().lr
    for p1, p2 in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, rtol=0, atol=1e-3 * lr)


def test_train_on_examples_learns_the_answers() -> None:
    data = examples(8)
    result = train(tiny(), run_config(max_steps=60, lr=1e-2, eval_interval=60), data, data,
                   progress=False)
    assert result.history.val_loss[-1] < result.history.val_loss[0] / 2


def test_train_refuses_examples_too_long_and_full_evaluation() -> None:
    with pytest.raises(ValueError, match="sequence 0 has 14 ids; a model with a context of "
                                         "T=12 reads at most T"):
        train(tiny(), run_config(), ExampleSet([[1] * 14], [[True] * 14]), examples(),
              progress=False)
    with pytest.raises(ValueError, match="eval_full scores a stream of ids; train_data is an "
                                         "ExampleSet"):
        train(tiny(), run_config(eval_full=True), examples(), examples(), progress=False)


def test_estimate_loss_on_examples_is_the_masked_loss() -> None:
    data = examples(1)
    model = tiny().eval()
    got = estimate_loss(model, {"val": data}, batch_size=2, context_length=12, eval_steps=2)
    with torch.no_grad():
        assert got["val"] == pytest.approx(lm_loss(model, *data.batch([0, 0])).item(), rel=1e-6)


# ----- minigpt.posttrain.sft ----------------------------------------------------------------------

def test_tasks_become_masked_conversations() -> None:
    tok = with_special_tokens(CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :"))
    tasks = [Task("reverse", "reverse: abc", "cba", "abc de"), Task("upper", "upper: ab",
                                                                    "AB", "ab cd")]
    with pytest.raises(ValueError, match="'A'"):  # not in this alphabet
        encode_tasks(tasks, tok)
    data = encode_tasks(tasks[:1], tok)
    assert decode_conversation(data.sequences[0].tolist(), tok) == tasks[0].conversation()
    said = tok.decode(data.sequences[0][data.masks[0]].tolist())
    assert said == "cba<|end|>"


def test_finetune_gives_the_model_the_chat_tokens_and_leaves_the_base_alone() -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=24, d_model=16,
                         n_heads=2, n_layers=1))
    before = copy.deepcopy(base.state_dict())
    tasks = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in ("abc", "hello", "dog")]
    result, chat = finetune(base, tok, tasks, tasks, run_config(max_steps=3), progress=False)
    assert chat.vocab_size == result.model.config.vocab_size == tok.vocab_size + 3
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())


def test_conversations_ask_every_task_once_in_groups_of_up_to_max_turns() -> None:
    tasks = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in map(str, range(100))]
    groups = conversations(tasks, 4, seed=3)
    assert groups == conversations(tasks, 4, seed=3) != conversations(tasks, 4, seed=4)
    assert {len(g) // 2 for g in groups} == {1, 2, 3, 4}
    asked = [turn.text for g in groups for turn in g[::2]]
    assert sorted(asked) == sorted(t.question for t in tasks)
    assert all(g[k + 1].text == g[k].text[9:][::-1] for g in groups for k in range(0, len(g), 2))
    assert len(conversations(tasks, 1)) == 100
    with pytest.raises(ValueError, match="max_turns must be an int >= 1, got 0"):
        conversations(tasks, 0)


def test_a_conversation_too_long_for_the_context_loses_its_oldest_exchanges() -> None:
    tok = with_special_tokens(CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :"))
    tasks = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in ("abc", "hello", "dog")]
    turns = [turn for t in tasks for turn in t.conversation()]  # exchanges of 19, 23, 19 ids
    assert len(encode_conversations([turns], tok, 60).sequences[0]) == 61  # T + 1 fit
    kept = encode_conversations([turns], tok, 59).sequences[0]  # 61 > 60: the first goes
    assert decode_conversation(kept.tolist(), tok) == turns[2:]
    assert decode_conversation(encode_conversations([turns], tok, 30).sequences[0].tolist(),
                               tok) == turns[4:]
    with pytest.raises(ValueError, match="conversation 0's last exchange alone is 19 tokens"):
        encode_conversations([turns], tok, 10)
    whole = encode_conversations([turns], tok).sequences[0]  # no context: nothing is cut
    assert decode_conversation(whole.tolist(), tok) == turns and len(whole) == 61


def test_finetune_on_conversations_with_a_longer_context(monkeypatch) -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=24, d_model=16,
                         n_heads=2, n_layers=1, positional="rope"))
    words = ("abc", "hello", "dog", "cat", "bird", "fish", "ant", "bee")
    tasks = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in words]
    result, chat = finetune(base, tok, tasks, tasks, run_config(max_steps=2), max_turns=3,
                            context_length=72, progress=False)
    assert result.model.config.context_length == 72 and base.config.context_length == 24
    seen = {}
    monkeypatch.setattr(sft, "train", lambda model, config, data, val, **_: seen.update(
        data=data))
    finetune(base, tok, tasks, tasks, run_config(max_steps=2), max_turns=3, context_length=72)
    assert len(seen["data"]) < len(tasks)  # some conversations hold several questions
    learned = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=24, d_model=16,
                            n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="learned positions"):
        finetune(learned, tok, tasks, tasks, run_config(max_steps=2), context_length=72)


def test_replayed_text_is_trained_on_with_every_target_counted(monkeypatch) -> None:
    # Imported here: the DDP test's worker processes import this module with whichever
    # minigpt their environment installs.
    from minigpt.posttrain.sft import text_windows

    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz :")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=tok.vocab_size, context_length=24, d_model=16,
                         n_heads=2, n_layers=1))
    tasks = [Task("reverse", f"reverse: {w}", w[::-1], w) for w in ("abc", "hello", "dog")]
    seen = {}

    def spy(model, config, train_data, val_data, **kwargs):
        seen["train"], seen["val"] = train_data, val_data
        return "result"

    monkeypatch.setattr(sft, "train", spy)
    windows = text_windows("the quick brown fox jumps over the lazy dog", 2, 10, seed=1)
    assert windows == text_windows("the quick brown fox jumps over the lazy dog", 2, 10, seed=1)
    assert [len(w) for w in windows] == [10, 10]
    finetune(base, tok, tasks, tasks, run_config(max_steps=3), replay=windows)
    data = seen["train"]
    assert len(data) == 5 and len(seen["val"]) == 3
    assert tok.decode(data.sequences[3].tolist()) == windows[0] and data.masks[3].all()
    with pytest.raises(ValueError, match="need n >= 1 windows"):
        text_windows("abc", 1, 5)


# ----- several processes --------------------------------------------------------------------

DDP_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_sft import examples, run_config, tiny
    from minigpt.parallel import init_distributed, shutdown
    from minigpt.train import train
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    result = train(tiny(), run_config(batch_size=2, grad_accum=2, lr=1e-3), examples(16),
                   examples(4, 1), ctx=ctx, progress=False)
    if ctx.rank == 0:
        torch.save(result.model.state_dict(), sys.argv[1] + "/ddp.pt")
        print(result.history.loss[0])
    shutdown(ctx)
""")


EVAL_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_sft import examples, tiny
    from minigpt.parallel import init_distributed, shutdown
    from minigpt.losses import estimate_loss
    torch.set_num_threads(1)
    ctx = init_distributed("cpu")
    losses = estimate_loss(tiny(), {"val": examples(16, 2)}, batch_size=2, context_length=12,
                           eval_steps=3, ctx=ctx)
    if ctx.rank == 0:
        print(losses["val"])
    shutdown(ctx)
""")


@pytest.mark.slow
def test_two_ranks_evaluate_as_one_process_over_all_their_answer_tokens(
        tmp_path: Path) -> None:
    # Each rank scores 2 of every 4 sequences, with unequal answers: the validation loss is
    # each global batch's mean over all its answer tokens, as one process computes it (the
    # mean of the ranks' means differs).
    results = run_script_on_ranks(2, EVAL_SCRIPT, tmp_path)
    data = examples(16, 2)
    one = estimate_loss(tiny(), {"val": data}, batch_size=4, context_length=12,
                        eval_steps=3)["val"]
    assert float(results[0].stdout) == pytest.approx(one, rel=1e-6)
    gen, means = torch.Generator().manual_seed(0), []
    for _ in range(3):  # what averaging the ranks' means would give
        x, y, mask = data.get_batch(4, 12, generator=gen)
        means += [lm_loss(tiny(), x[r], y[r], mask[r]).item() for r in (slice(0, 2),
                                                                        slice(2, 4))]
    assert abs(sum(means) / 6 - one) > 1e-3


@pytest.mark.slow
def test_two_ranks_take_the_mean_over_all_their_answer_tokens(tmp_path: Path) -> None:
    # 2 ranks x 2 micro-batches x 2 sequences, unequal answers: the step of one process on
    # the same 8 sequences at once (not the mean of the ranks' means).
    results = run_script_on_ranks(2, DDP_SCRIPT, tmp_path)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    one = train(tiny(), run_config(batch_size=8, lr=1e-3), examples(16), examples(4, 1),
                progress=False)
    # The loss is weighted as the gradients are: the mean of the ranks' means is 1e-4 off.
    assert float(results[0].stdout) == pytest.approx(one.history.loss[0], rel=1e-6)
    # Adam's first step is about lr times the gradient's sign: where a gradient is near 0,
    # rounding may move it by a part of a step (lr = 1e-3).
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(ddp[name], value, rtol=0, atol=1e-5)
