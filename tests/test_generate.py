"""Sampling: the three filters, the generate loop, and every argument it refuses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from minigpt import GPT, GPTConfig
from minigpt.generate import apply_temperature, generate, top_k_filter, top_p_filter

V = 16


# Tiny models gain nothing from intra-op threads (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.debug(vocab_size=V)).eval()


class FixedLogits(nn.Module):
    """A stand-in model whose next-token logits are always `logits`; records input lengths."""

    def __init__(self, logits: list[float], context_length: int = 3) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.tensor(logits))
        self.config = SimpleNamespace(vocab_size=len(logits), context_length=context_length)
        self.seen_lengths: list[int] = []

    def forward(self, ids: Tensor) -> Tensor:
        self.seen_lengths.append(ids.shape[1])
        return self.logits.expand(ids.shape[0], ids.shape[1], -1)


# ----- the filters -------------------------------------------------------------------


def test_package_exports_the_generate_function() -> None:
    import minigpt
    import minigpt.generate  # noqa: F401  (importing the submodule must not shadow the function)

    assert minigpt.generate is generate


def test_apply_temperature_divides_and_does_not_mutate() -> None:
    logits = torch.tensor([[1.0, 2.0, -3.0]])
    before = logits.clone()
    out = apply_temperature(logits, 2.0)
    assert torch.equal(out, before / 2.0)
    assert torch.equal(logits, before)
    same = apply_temperature(logits, 1)
    assert torch.equal(same, logits) and same is not logits


def test_temperature_limits_greedy_and_uniform() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    cold = torch.softmax(apply_temperature(logits, 1e-3), dim=-1)
    hot = torch.softmax(apply_temperature(logits, 1e4), dim=-1)
    assert torch.allclose(cold, torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(hot, torch.full((3,), 1 / 3), atol=1e-3)


@pytest.mark.parametrize("bad", [0.0, -1.0, 0])
def test_apply_temperature_rejects_non_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        apply_temperature(torch.zeros(3), bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_apply_temperature_rejects_non_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="temperature must be finite"):
        apply_temperature(torch.zeros(3), bad)


@pytest.mark.parametrize("bad", ["1.0", True, None])
def test_apply_temperature_rejects_non_numbers(bad: object) -> None:
    with pytest.raises(TypeError, match="temperature must be a real number"):
        apply_temperature(torch.zeros(3), bad)  # type: ignore[arg-type]


def test_top_k_keeps_the_k_largest_per_row() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [4.0, 1.0, 2.0, 3.0]])
    before = logits.clone()
    out = top_k_filter(logits, 2)
    inf = float("-inf")
    assert torch.equal(out, torch.tensor([[inf, 3.0, inf, 2.0], [4.0, inf, inf, 3.0]]))
    assert torch.equal(logits, before)
    assert torch.equal(top_k_filter(logits, 4), logits)


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    out = top_k_filter(torch.tensor([1.0, 2.0, 2.0, 0.0]), 1)
    assert torch.isfinite(out).tolist() == [False, True, True, False]


@pytest.mark.parametrize("bad", [0, -2, 5])
def test_top_k_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, V\] = \[1, 4\]"):
        top_k_filter(torch.zeros(4), bad)


@pytest.mark.parametrize("bad", [2.0, True, "2"])
def test_top_k_must_be_an_int(bad: object) -> None:
    with pytest.raises(TypeError, match="top_k must be an int"):
        top_k_filter(torch.zeros(4), bad)  # type: ignore[arg-type]


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    before = logits.clone()
    kept = {p: torch.isfinite(top_p_filter(logits, p)).tolist() for p in (0.4, 0.6, 0.9, 1.0)}
    assert kept[0.4] == [False, True, False]  # 0.5 alone reaches 0.4
    assert kept[0.6] == [False, True, True]  # 0.5 < 0.6, 0.5 + 0.3 reaches it
    assert kept[0.9] == [True, True, True]
    assert kept[1.0] == [True, True, True]
    assert torch.equal(logits, before)
    # Kept logits are unchanged, not renormalised.
    assert torch.equal(top_p_filter(logits, 0.6)[1:], logits[1:])


def test_top_p_rows_are_independent() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.45, 0.45]]))
    kept = torch.isfinite(top_p_filter(logits, 0.6)).tolist()
    assert kept == [[True, False, False], [False, True, True]]


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, 2])
def test_top_p_out_of_range(bad: float) -> None:
    with pytest.raises(ValueError, match=r"top_p must lie in \(0, 1\]"):
        top_p_filter(torch.zeros(3), bad)


def test_top_p_rejects_nan_and_non_numbers() -> None:
    with pytest.raises(ValueError, match="top_p must be finite"):
        top_p_filter(torch.zeros(3), float("nan"))
    with pytest.raises(TypeError, match="top_p must be a real number"):
        top_p_filter(torch.zeros(3), "0.5")  # type: ignore[arg-type]


# ----- generate: results ---------------------------------------------------------------


def test_shapes_follow_the_prompt(model: GPT) -> None:
    one = generate(model, torch.tensor([1, 2, 3]), 4, greedy=True)
    batch = generate(model, torch.tensor([[1, 2], [3, 4]]), 5, greedy=True)
    from_list = generate(model, [1, 2, 3], 4, greedy=True)
    assert one.shape == (7,) and batch.shape == (2, 7) and one.dtype == torch.long
    assert torch.equal(one, from_list)
    assert one[:3].tolist() == [1, 2, 3] and batch[:, :2].tolist() == [[1, 2], [3, 4]]
    assert int(batch.min()) >= 0 and int(batch.max()) < V


def test_zero_new_tokens_returns_a_copy(model: GPT) -> None:
    prompt = torch.tensor([[5, 6]])
    out = generate(model, prompt, 0)
    assert torch.equal(out, prompt)
    out[0, 0] = 0
    assert prompt[0, 0] == 5


def test_greedy_is_the_argmax_and_deterministic(model: GPT) -> None:
    prompt = torch.tensor([[3, 1, 4]])
    out = generate(model, prompt, 6, greedy=True)
    assert torch.equal(out, generate(model, prompt, 6, greedy=True))
    seq = prompt.clone()
    for _ in range(6):  # the same loop written out
        with torch.no_grad():
            nxt = model(seq[:, -model.config.context_length:])[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_temperature_zero_is_greedy(model: GPT) -> None:
    prompt = torch.tensor([[2, 7]])
    greedy = generate(model, prompt, 10, greedy=True)
    assert torch.equal(generate(model, prompt, 10, temperature=0.0), greedy)
    assert torch.equal(generate(model, prompt, 10, temperature=0), greedy)


def test_top_k_one_and_tiny_top_p_equal_greedy(model: GPT) -> None:
    prompt = torch.tensor([[9, 9, 1]])
    greedy = generate(model, prompt, 10, greedy=True)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(generate(model, prompt, 10, top_k=1, temperature=1.5, generator=g), greedy)
    assert torch.equal(generate(model, prompt, 10, top_p=1e-6, generator=g), greedy)


def test_seeded_sampling_is_reproducible(model: GPT) -> None:
    prompt = torch.tensor([[1], [2], [3]])

    def draw(seed: int) -> Tensor:
        return generate(model, prompt, 30, temperature=2.0,
                        generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_prompt_longer_than_the_context_is_cropped() -> None:
    stub = FixedLogits([0.0, 5.0, 1.0], context_length=3)
    out = generate(stub, [0, 0, 0, 0, 0], 4, greedy=True)
    assert out.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert stub.seen_lengths == [3, 3, 3, 3]


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    logits = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
    stub = FixedLogits(logits, context_length=1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.zeros(4000, 1, dtype=torch.long)

    def freqs(**kw: object) -> list[float]:
        drawn = generate(stub, prompt, 1, generator=g, **kw)[:, -1]  # type: ignore[arg-type]
        return (torch.bincount(drawn, minlength=4).float() / len(drawn)).tolist()

    assert freqs() == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=0.03)
    assert freqs(top_k=2) == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7], abs=0.03)
    assert freqs(top_p=0.65) == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7], abs=0.03)
    # tau = 0.5 squares the probabilities (then renormalises).
    squared = [p * p / 0.3 for p in (0.1, 0.2, 0.3, 0.4)]
    assert freqs(temperature=0.5) == pytest.approx(squared, abs=0.03)


def test_inputs_are_not_mutated_and_mode_is_restored(model: GPT) -> None:
    prompt = torch.tensor([[4, 2, 0]])
    before = prompt.clone()
    as_list = [4, 2, 0]
    model.train()
    generate(model, prompt, 5, top_k=3, top_p=0.9, generator=torch.Generator().manual_seed(0))
    generate(model, as_list, 5)
    assert model.training
    model.eval()
    generate(model, prompt, 2)
    assert not model.training
    assert torch.equal(prompt, before) and as_list == [4, 2, 0]


def test_accepts_narrower_integer_dtypes(model: GPT) -> None:
    wide = generate(model, torch.tensor([1, 2]), 3, greedy=True)
    assert torch.equal(generate(model, torch.tensor([1, 2], dtype=torch.int32), 3, greedy=True),
                       wide)


# ----- generate: errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temperature": -0.5}, ValueError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
        ({"temperature": "hot"}, TypeError, "temperature must be a real number"),
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_k": 0}, ValueError, r"top_k must lie in \[1, V\] = \[1, 16\]"),
        ({"top_k": V + 1}, ValueError, r"top_k must lie in \[1, V\] = \[1, 16\]"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int"),
        ({"greedy": 1}, TypeError, "greedy must be a bool"),
        ({"generator": 0}, TypeError, "generator must be a torch.Generator"),
    ],
)
def test_bad_sampling_arguments(model: GPT, kwargs: dict[str, object], error: type,
                                message: str) -> None:
    with pytest.raises(error, match=message):
        generate(model, [1, 2], 3, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([], ValueError, "prompt_ids is empty"),
        (torch.zeros(0, dtype=torch.long), ValueError, "prompt_ids is empty"),
        (torch.zeros(2, 0, dtype=torch.long), ValueError, "prompt_ids is empty"),
        (torch.tensor([1.0, 2.0]), TypeError, "integer token ids, got dtype torch.float32"),
        ([1.0, 2.0], TypeError, "integer token ids"),
        ([True, False], TypeError, "integer token ids"),
        ([[1, 2], [3]], TypeError, "equal-length lists of ints"),
        ("hello", TypeError, "tensor or a list of ints"),
        (torch.zeros(1, 1, 2, dtype=torch.long), ValueError, r"shape \(T,\) or \(B, T\)"),
        ([1, V], ValueError, rf"token id {V} in prompt_ids is out of range \[0, {V}\)"),
        (torch.tensor([[-1, 2]]), ValueError, r"token id -1 in prompt_ids is out of range"),
    ],
)
def test_bad_prompts(model: GPT, prompt: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        generate(model, prompt, 3)  # type: ignore[arg-type]


def test_model_must_be_a_gpt() -> None:
    with pytest.raises(TypeError, match="model must be a GPT"):
        generate(object(), [1], 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "error"), [(-1, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_max_new_tokens(model: GPT, n: object, error: type) -> None:
    with pytest.raises(error, match="max_new_tokens must"):
        generate(model, [1], n)  # type: ignore[arg-type]

