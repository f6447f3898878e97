"""minigpt.decoding: the three filters, the generate loop, and every argument it refuses."""

from __future__ import annotations

import importlib
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from minigpt import GPT, GPTConfig, products
from minigpt.decoding import (
    apply_temperature,
    beam_search,
    eval_mode,
    generate,
    generate_by_length,
    inverse_cdf,
    top_k_filter,
    top_p_filter,
)

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
    import minigpt.decoding

    # The module has a name of its own, so `minigpt.generate` is always the function.
    assert minigpt.generate is minigpt.decoding.generate is generate
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("minigpt.generate")


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
    out = generate(stub, [0, 0, 0, 0, 0], 4, greedy=True, use_cache=False)
    assert out.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert stub.seen_lengths == [3, 3, 3, 3]


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    logits = [math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]
    stub = FixedLogits(logits, context_length=1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.zeros(4000, 1, dtype=torch.long)

    def freqs(**kw: object) -> list[float]:
        drawn = generate(stub, prompt, 1, generator=g, use_cache=False,
                         **kw)[:, -1]  # type: ignore[arg-type]
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


def test_eval_mode_gives_each_model_its_mode_back_even_on_error(model: GPT) -> None:
    other = GPT(GPTConfig.debug(vocab_size=V)).eval()
    model.train()
    with pytest.raises(RuntimeError, match="inside"), eval_mode(model, other):
        assert not model.training and not other.training
        raise RuntimeError("inside")
    assert model.training and not other.training


def test_accepts_narrower_integer_dtypes(model: GPT) -> None:
    wide = generate(model, torch.tensor([1, 2]), 3, greedy=True)
    assert torch.equal(generate(model, torch.tensor([1, 2], dtype=torch.int32), 3, greedy=True),
                       wide)


# ----- generate: errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temperature": -0.5}, ValueError, "temperature must be >= 0"),
        ({"temperature": float("nan")}, ValueError, "temperature must be >= 0"),
        ({"top_p": 0.0}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_p": float("nan")}, ValueError, r"top_p must lie in \(0, 1\]"),
        ({"top_k": 0}, ValueError, r"top_k must lie in \[1, V\] = \[1, 16\]"),
        ({"top_k": V + 1}, ValueError, r"top_k must lie in \[1, V\] = \[1, 16\]"),
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
        ([[1, 2], [3]], ValueError, "expected sequence of length 2"),  # torch's own
        (torch.zeros(1, 1, 2, dtype=torch.long), ValueError, r"shape \(T,\) or \(B, T\)"),
        ([1, V], ValueError, rf"token id {V} in prompt_ids is out of range \[0, {V}\)"),
        (torch.tensor([[-1, 2]]), ValueError, r"token id -1 in prompt_ids is out of range"),
    ],
)
def test_bad_prompts(model: GPT, prompt: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        generate(model, prompt, 3)  # type: ignore[arg-type]


def test_bad_max_new_tokens(model: GPT) -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
        generate(model, [1], -1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"repeats": 0}, "repeats must be an int >= 1, got 0"),
    ({"repeats": 2.0}, "repeats must be an int >= 1, got 2.0"),
    ({"stop_id": V}, rf"stop_id must be an int from 0 to {V - 1}, got {V}"),
    ({"stop_id": -1}, rf"stop_id must be an int from 0 to {V - 1}, got -1"),
])
def test_bad_repeats_and_stop(model: GPT, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(model, [1, 2], 3, **kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(products.mode() == "native", reason="the package's products run on "
                    "Linux x86-64 (elsewhere PyTorch's own, whose sums follow the row count)")
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_prompt_read_once_for_its_rows_gives_the_bits_of_reading_it_for_each(
        model: GPT, use_cache: bool, greedy: bool) -> None:
    """The package's products compute a row whatever the other rows, so reading each
    prompt once and copying its logits, keys and values to its r rows is exact."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    once, each = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    got = generate(model, prompts, 6, repeats=3, generator=once, greedy=greedy,
                   use_cache=use_cache)
    want = generate(model, [p for p in prompts for _ in range(3)], 6, generator=each,
                    greedy=greedy, use_cache=use_cache)
    assert got.shape == (6, 11) and torch.equal(got, want)
    assert torch.equal(once.get_state(), each.get_state())
    assert generate(model, [1, 2], 2, repeats=2).shape == (2, 4)  # a 1-D prompt, r rows


def test_stopping_once_every_row_has_ended_draws_what_the_full_run_draws() -> None:
    """Row b's tokens up to its first stop token are those of the run that does not stop,
    the rest is the stop token, and the generator ends where that run's ends."""
    torch.manual_seed(0)
    small = GPT(GPTConfig.debug(vocab_size=4)).eval()  # a stop token comes soon
    stop, n = 3, 2
    for seed in range(20):
        short, full = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = generate(small, [[0, 1], [1, 2]], 12, repeats=4, stop_id=stop, generator=short)
        want = generate(small, [[0, 1], [1, 2]], 12, repeats=4, generator=full)
        assert torch.equal(short.get_state(), full.get_state())
        for row, whole in zip(got.tolist(), want.tolist(), strict=True):
            cut = row.index(stop, n) + 1 if stop in row[n:] else len(row)
            assert set(row[cut:]) <= {stop}  # an ended row holds the stop token alone
            if products.mode() != "native":  # rows independent of each other: the
                assert row[:cut] == whole[:cut]  # full run's tokens up to the stop
    ended = generate(small, [[0, 1]], 30, repeats=8, stop_id=stop,
                     generator=torch.Generator().manual_seed(0))
    assert ended.shape == (8, 32) and ended[:, -1].eq(stop).all()



# ----- the key-value cache -------------------------------------------------------------


class Spy(GPT):
    """A GPT that records how many tokens each forward pass reads."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.read: list[int] = []

    def forward(self, input_ids: Tensor, **kwargs: object) -> Tensor:  # type: ignore[override]
        self.read.append(input_ids.shape[1])
        return super().forward(input_ids, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt_len", [1, 3, 8, 11])
@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.3, "top_k": 9},
                                      {"top_p": 0.8}])
def test_cache_gives_the_same_tokens(model: GPT, prompt_len: int,
                                     sampling: dict[str, object]) -> None:
    # T_max = 8: the longer runs slide the window and the prompt of 11 starts beyond it.
    prompt = torch.randint(0, V, (3, prompt_len), generator=torch.Generator().manual_seed(7))
    outs = [generate(model, prompt, 12, use_cache=use_cache,
                     generator=torch.Generator().manual_seed(8), **sampling)  # type: ignore[arg-type]
            for use_cache in (True, False)]
    assert torch.equal(outs[0], outs[1])


def test_cache_reads_each_token_once_while_the_sequence_fits() -> None:
    torch.manual_seed(0)
    spy = Spy(GPTConfig.debug(vocab_size=V)).eval()  # T_max = 8
    generate(spy, [1, 2, 3], 7, greedy=True)
    # the prompt of 3, then one token per step up to 8 tokens; at 9 the window slides and
    # all 8 of its tokens are read again
    assert spy.read == [3, 1, 1, 1, 1, 1, 8]
    spy.read.clear()
    generate(spy, [1, 2, 3], 7, greedy=True, use_cache=False)
    assert spy.read == [3, 4, 5, 6, 7, 8, 8]


# ----- beam search ---------------------------------------------------------------------


def _continuation_log_prob(model: GPT, seq: list[int], prompt_len: int, upto: int) -> float:
    """log p(seq[prompt_len:prompt_len + upto] | prompt) by one plain forward pass."""
    with torch.no_grad():
        log_p = torch.log_softmax(model(torch.tensor([seq]))[0].double(), dim=-1)
    return sum(float(log_p[t - 1, seq[t]]) for t in range(prompt_len, prompt_len + upto))


def test_package_exports_beam_search() -> None:
    import minigpt

    assert minigpt.beam_search is beam_search


def test_one_beam_is_greedy(model: GPT) -> None:
    result = beam_search(model, [4, 5], 10, num_beams=1)
    assert torch.equal(result.sequences[0], generate(model, [4, 5], 10, greedy=True))
    assert result.sequences.shape == (1, 12)


def test_wide_enough_beams_find_the_most_likely_continuation() -> None:
    torch.manual_seed(3)
    tiny = GPT(GPTConfig(vocab_size=5, context_length=8, d_model=8, n_heads=2,
                         n_layers=1)).eval()
    prompt, n = [1, 2], 3
    every = {cont: _continuation_log_prob(tiny, prompt + list(cont), 2, n)
             for cont in itertools.product(range(5), repeat=n)}
    ranked = sorted(every, key=every.__getitem__, reverse=True)
    result = beam_search(tiny, prompt, n, num_beams=5 ** (n - 1))  # nothing pruned early
    assert tuple(result.sequences[0, 2:].tolist()) == ranked[0]
    # the 25 beams are the 25 most likely of all 125 continuations, in order
    assert [tuple(s[2:]) for s in result.sequences.tolist()] == ranked[:25]
    assert result.log_probs[0].item() == pytest.approx(every[ranked[0]], abs=1e-5)


def test_beam_log_probs_are_the_models(model: GPT) -> None:
    result = beam_search(model, [3, 1, 4], 6, num_beams=4)  # 9 tokens > T_max: slides
    assert result.sequences.shape == (4, 9)
    assert torch.all(result.scores[:-1] >= result.scores[1:])  # best first
    for seq, log_p in zip(result.sequences.tolist(), result.log_probs.tolist(), strict=True):
        # the window slides beyond T_max = 8, so score the sequence as the search read it
        expected = 0.0
        for t in range(3, 9):
            window = seq[max(0, t - 8):t]
            with torch.no_grad():
                row = torch.log_softmax(model(torch.tensor([window]))[0, -1].double(), dim=-1)
            expected += float(row[seq[t]])
        assert log_p == pytest.approx(expected, abs=1e-4)
    assert len({tuple(s) for s in result.sequences.tolist()}) == 4  # distinct hypotheses


def test_beam_search_with_and_without_cache_agree(model: GPT) -> None:
    kwargs: dict[str, object] = {"num_beams": 3, "eos_id": 0, "length_penalty": 0.7}
    with_cache = beam_search(model, [2, 9], 9, **kwargs)  # type: ignore[arg-type]
    without = beam_search(model, [2, 9], 9, use_cache=False, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(with_cache.sequences, without.sequences)
    assert torch.allclose(with_cache.scores, without.scores, atol=1e-5)


def test_eos_ends_a_hypothesis() -> None:
    torch.manual_seed(5)
    tiny = GPT(GPTConfig(vocab_size=4, context_length=8, d_model=8, n_heads=2,
                         n_layers=1)).eval()
    result = beam_search(tiny, [1], 5, num_beams=6, eos_id=0)
    assert result.sequences.shape[1] == 6
    for seq, length, log_p in zip(result.sequences.tolist(), result.lengths.tolist(),
                                  result.log_probs.tolist(), strict=True):
        new = seq[1:]
        if 0 in new:  # ended: length counts up to the first eos, the rest is eos padding
            assert length == new.index(0) + 1 and set(new[length:]) <= {0}
        else:
            assert length == 5
        assert log_p == pytest.approx(_continuation_log_prob(tiny, seq, 1, length), abs=1e-5)
    # alpha = 0 ranks by total log-probability, alpha = 1 by the mean per token
    for alpha in (0.0, 1.0):
        ranked = beam_search(tiny, [1], 5, num_beams=6, eos_id=0, length_penalty=alpha)
        expected = ranked.log_probs / ranked.lengths.double() ** alpha
        assert torch.allclose(ranked.scores.double(), expected, atol=1e-6)
        assert torch.all(ranked.scores[:-1] >= ranked.scores[1:])


def test_all_beams_ending_early_are_padded_with_eos() -> None:
    stub = GPT(GPTConfig(vocab_size=3, context_length=8, d_model=8, n_heads=2, n_layers=1))
    with torch.no_grad():  # make eos (id 2) by far the most likely token everywhere
        stub.lm_head.weight.zero_()
        stub.ln_f.bias.zero_()
        stub.ln_f.weight.zero_()
        stub.ln_f.bias[0] = 1.0
        stub.wte.weight[2, 0] = 50.0  # tied: the head scores token 2 at 50, the others 0
    result = beam_search(stub, [0], 4, num_beams=1, eos_id=2)
    assert result.sequences.tolist() == [[0, 2, 2, 2, 2]]
    assert result.lengths.tolist() == [1]


def test_beam_search_keeps_inputs_and_mode(model: GPT) -> None:
    prompt = torch.tensor([1, 2, 3])
    model.train()
    beam_search(model, prompt, 3, num_beams=2)
    assert model.training and torch.equal(prompt, torch.tensor([1, 2, 3]))
    model.eval()
    assert beam_search(model, prompt, 0, num_beams=3).sequences.tolist() == [[1, 2, 3]]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"num_beams": 0}, ValueError, "num_beams must be >= 1, got 0"),
        ({"num_beams": 2, "eos_id": V}, ValueError, rf"eos_id must lie in \[0, {V}\), got {V}"),
        ({"num_beams": 2, "eos_id": -1}, ValueError, rf"eos_id must lie in \[0, {V}\), got -1"),
    ],
)
def test_bad_beam_search_arguments(model: GPT, kwargs: dict[str, object], error: type,
                                   message: str) -> None:
    with pytest.raises(error, match=message):
        beam_search(model, [1, 2], 3, **kwargs)  # type: ignore[arg-type]


def test_beam_search_takes_one_prompt(model: GPT) -> None:
    with pytest.raises(ValueError, match=r"one prompt of shape \(T,\), got \(2, 2\)"):
        beam_search(model, [[1, 2], [3, 4]], 3, num_beams=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        beam_search(model, [1], -1, num_beams=2)


def test_generation_benchmark_tool_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from helpers import load_tool

    bench = load_tool("bench_generate")
    assert bench.main(["--models", "book", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "book: prompt 8 + 56 new tokens" in out and "same tokens: True" in out


def test_inverse_cdf_picks_the_first_token_whose_cumulative_mass_exceeds_u() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25])
    picks = [inverse_cdf(probs, u) for u in (0.0, 0.2499, 0.25, 0.74, 0.75, 0.999)]
    assert picks == [1, 1, 3, 3, 4, 4]
    # rounding that leaves the total below u: the last token of non-zero probability
    assert inverse_cdf(torch.tensor([0.3, 0.3, 0.0]), 0.9) == 1


def test_inverse_cdf_of_uniform_draws_follows_the_distribution() -> None:
    probs = torch.softmax(torch.randn(7, generator=torch.Generator().manual_seed(0)), -1)
    draws = torch.rand(20_000, generator=torch.Generator().manual_seed(1)).tolist()
    counts = torch.bincount(torch.tensor([inverse_cdf(probs, u) for u in draws]),
                            minlength=7)
    assert torch.allclose(counts / len(draws), probs, atol=0.015)


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan")])
def test_inverse_cdf_refuses_a_draw_outside_the_unit_interval(bad: float) -> None:
    with pytest.raises(ValueError, match="u must"):
        inverse_cdf(torch.tensor([0.5, 0.5]), bad)


def test_generation_by_length_batches_each_length_in_order_of_appearance(model: GPT) -> None:
    T = model.config.context_length
    prompts = [[1, 2], [3], [4, 5], [6], [7] * (T - 1)]
    groups = generate_by_length(model, prompts, 4, repeats=2,
                                generator=torch.Generator().manual_seed(0))
    assert [rows for rows, _ in groups] == [[0, 2], [1, 3], [4]]
    draws = torch.Generator().manual_seed(0)  # the same draws, batch after batch
    for rows, ids in groups:
        n = len(prompts[rows[0]])
        # With the package's products, each prompt read in each of its rows; elsewhere
        # (rows summed by PyTorch's own products, whose bits follow the row count) read
        # once for its rows, as generate_by_length reads it.
        again = (generate(model, [prompts[k] for k in rows for _ in range(2)],
                          min(4, T - n), generator=draws)
                 if products.mode() != "native" else
                 generate(model, [prompts[k] for k in rows], min(4, T - n), repeats=2,
                          generator=draws))
        assert torch.equal(ids, again) and ids.shape == (2 * len(rows), n + min(4, T - n))
        assert all(ids[i, :n].tolist() == prompts[rows[i // 2]] for i in range(len(ids)))
    with pytest.raises(ValueError, match=f"prompt 1 has {T} tokens; a prompt needs 1 to"):
        generate_by_length(model, [[1], [1] * T], 4)
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        generate_by_length(model, [[]], 4)
