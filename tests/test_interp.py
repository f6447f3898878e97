"""minigpt.interp on tiny random models: ablation against hand-edited weights, the residual
stream as a sum of its parts, activation patching (of positions and of heads), the scores
against their definitions, the circuits against the attention's own arithmetic, the copying
scores on maps whose eigenvalues are known, and the copiers' recipe, rows and cache."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import record_seeds
from pydantic import ValidationError

from minigpt.attention import attention_mass
from minigpt.config import GPTConfig
from minigpt.interp.circuits import (
    Copying,
    circuits,
    composition,
    copying_scores,
    effective_embedding,
    full_ov_circuit,
)
from minigpt.interp.heads import (
    Scores,
    copy_losses,
    head_scores,
    induction_keys,
    previous_keys,
    recorded_heads,
    repeated,
)
from minigpt.interp.interventions import (
    ablated,
    head_means,
    head_patching,
    patched_logits,
    patching_grid,
    read_ablated,
)
from minigpt.interp.stream import logit_lens, residual_parts, residual_stream
from minigpt.model import GPT
from minigpt.recipes import copiers, pretrained
from minigpt.recipes.copiers import CopyRecipe, copier, training_rows

pytestmark = pytest.mark.usefixtures("one_thread")

V, L, H, D, T = 11, 2, 4, 16, 16
D_K = D // H


def _gpt2(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig.shakespeare_cpu(vocab_size=V, n_layers=L, n_heads=H, d_model=D,
                                       context_length=T, activation="gelu_tanh", **overrides)
    return GPT(config).eval()


def _modern(seed: int = 0) -> GPT:
    # zero_init=False: the modern preset starts its projections and head at 0, which would
    # make every head's part (and the logits) vanish.
    torch.manual_seed(seed)
    config = GPTConfig.modern(V, n_layers=L, n_heads=H, d_model=D, context_length=T,
                              zero_init=False)
    return GPT(config).eval()


def _randomise_biases(model: GPT, seed: int = 1) -> GPT:
    """GPT-2's init sets every bias to 0; nonzero ones make the tests see them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def model() -> GPT:
    return _randomise_biases(_gpt2())


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(7))


def _no_hooks(model: GPT) -> bool:
    return all(not block.attn.c_proj._forward_pre_hooks for block in model.h)


# ----------------------------------------------------------------------------- ablation

def test_ablating_nothing_changes_nothing_and_the_hooks_leave(model, ids):
    with torch.no_grad():
        before = model(ids)
        with ablated(model, []) as inside:
            assert inside is model
            assert all(len(b.attn.c_proj._forward_pre_hooks) == 1 for b in model.h)
            during = model(ids)
        after = model(ids)
    assert torch.equal(during, before)
    assert torch.equal(after, before)
    assert _no_hooks(model)


def test_the_hooks_leave_even_when_the_block_raises(model, ids):
    with pytest.raises(RuntimeError, match="boom"), ablated(model, [(0, 1)]):
        raise RuntimeError("boom")
    assert _no_hooks(model)


@pytest.mark.parametrize("heads", [[(0, 1)], [(1, 3)], [(0, 0), (1, 2), (1, 0)]])
def test_zero_ablation_equals_zeroing_the_heads_columns_of_the_projection(model, ids, heads):
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for layer, head in heads:
            edited.h[layer].attn.c_proj.weight[:, head * D_K:(head + 1) * D_K] = 0.0
        expected, untouched = edited(ids), model(ids)
        with ablated(model, heads):
            got = model(ids)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, untouched, atol=1e-4)  # the ablation did something
    assert _no_hooks(model)


def test_head_means_are_each_heads_mean_output(model):
    rows = torch.randint(0, V, (4, 11), generator=torch.Generator().manual_seed(3))
    means = head_means(model, rows)
    assert means.shape == (L, H, D_K)
    # Layer 0 by hand: head h's output is its attention weights times its values.
    inputs = rows[:, :-1]
    with torch.no_grad():
        _, maps = model.forward_with_attention(inputs)
        attn = model.h[0].attn
        v = attn.c_attn(model.h[0].ln_1(model.embed(inputs))).split(attn.sizes, -1)[2]
        for head in range(H):
            out = maps[0][:, head] @ v[..., head * D_K:(head + 1) * D_K]  # (B, T, d_k)
            assert torch.allclose(means[0, head], out.mean(dim=(0, 1)), atol=1e-6)


def test_mean_ablation_writes_the_mean(model, ids):
    rows = torch.randint(0, V, (4, 11), generator=torch.Generator().manual_seed(4))
    means = head_means(model, rows)
    heads = [(0, 2), (1, 1)]
    # The recorder is hooked after the ablation, so it reads what the projection reads.
    with torch.no_grad(), ablated(model, heads, means), recorded_heads(model) as seen:
        got = model(ids)
    assert len(seen) == L and seen[0].shape == (*ids.shape, H, D_K)
    for layer, head in heads:
        assert torch.equal(seen[layer][..., head, :],
                           means[layer, head].expand(*ids.shape, D_K))
    assert not torch.equal(seen[0][..., 1, :], means[0, 1].expand(*ids.shape, D_K))
    # The same as a projection whose bias absorbs W_O[:, slice] @ mean, slice zeroed.
    edited = copy.deepcopy(model)
    with torch.no_grad():
        for layer, head in heads:
            proj, cols = edited.h[layer].attn.c_proj, slice(head * D_K, (head + 1) * D_K)
            proj.bias += proj.weight[:, cols] @ means[layer, head]
            proj.weight[:, cols] = 0.0
        expected = edited(ids)
    assert torch.allclose(got, expected, atol=1e-6)
    assert _no_hooks(model)


# -------------------------------------------------------------------- the residual stream

def _expected_names(bias: bool) -> list[str]:
    names = ["embed"]
    for layer in range(L):
        names += [f"{layer}.{h}" for h in range(H)]
        names += [f"{layer}.bias"] * bias + [f"{layer}.mlp"]
    return names


@pytest.mark.parametrize("layout", ["gpt2", "modern"])
def test_the_parts_sum_to_the_stream_and_the_stream_gives_the_logits(model, ids, layout):
    m = model if layout == "gpt2" else _modern()
    bias = layout == "gpt2"
    stream = residual_stream(m, ids)
    assert stream.shape == (L + 1, *ids.shape, D)
    with torch.no_grad():
        logits, embedded = m(ids), m.embed(ids)
        assert torch.equal(m.lm_head(m.ln_f(stream[-1])), logits)
    assert torch.equal(stream[0], embedded)
    assert torch.allclose(logit_lens(m, ids)[-1], logits, atol=1e-6)
    names, parts = residual_parts(m, ids)
    assert names == _expected_names(bias)
    assert parts.shape == (len(names), *ids.shape, D)
    assert (parts.sum(0) - stream[-1]).abs().max() < 1e-5
    # Every head writes something (a part of zeros would also sum right).
    assert all(parts[i].abs().max() > 1e-4 for i, n in enumerate(names) if n != "embed")


def test_logit_lens_reads_every_stream_through_the_head(model, ids):
    lens = logit_lens(model, ids)
    assert lens.shape == (L + 1, *ids.shape, V)
    stream = residual_stream(model, ids)
    with torch.no_grad():
        for after in range(L + 1):
            expected = model.lm_head(model.ln_f(stream[after]))
            assert torch.allclose(lens[after], expected, atol=1e-6)


# ---------------------------------------------------------------------- activation patching

def test_patching_a_prompt_into_itself_changes_nothing(model, ids):
    clean = residual_stream(model, ids)
    with torch.no_grad():
        expected = model(ids)
    for after in range(L + 1):
        for position in (0, 5, ids.shape[1] - 1):
            got = patched_logits(model, ids, clean, after, position)
            assert torch.equal(got, expected), (after, position)
    assert all(not b._forward_hooks for b in model.h) and not model.drop._forward_hooks


@pytest.mark.parametrize("after", range(L + 1))
def test_patching_changes_nothing_before_the_patched_position(model, ids, after):
    other = torch.randint(0, V, ids.shape, generator=torch.Generator().manual_seed(9))
    clean = residual_stream(model, other)
    position = 6
    with torch.no_grad():
        corrupt, reference = model(ids), model(other)
    got = patched_logits(model, ids, clean, after, position)
    assert torch.equal(got[:, :position], corrupt[:, :position])
    assert not torch.allclose(got[:, position], corrupt[:, position], atol=1e-4)
    if after == L:  # no block after the patch: only its position changes, to the clean one
        assert torch.equal(got[:, position + 1:], corrupt[:, position + 1:])
        assert torch.allclose(got[:, position], reference[:, position], atol=1e-6)
    else:  # later positions read the patched one
        assert not torch.allclose(got[:, position + 1:], corrupt[:, position + 1:], atol=1e-6)


def test_patching_grid_restores_at_the_answer_and_nothing_after_it(model):
    generator = torch.Generator().manual_seed(5)
    clean = torch.randint(0, V, (2, 10), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 3] = (clean[:, 3] + 1) % V  # one token differs
    answer, right, wrong = 7, 2, 5
    grid = patching_grid(model, clean, corrupt, answer, right, wrong)
    assert grid.shape == (L + 1, clean.shape[1])
    assert abs(float(grid[L, answer]) - 1.0) < 1e-5  # the whole last stream there is clean
    assert torch.all(grid[:, answer + 1:] == 0)  # causal: later positions do not matter
    assert torch.all(grid[L, :answer] == 0)  # the last stream elsewhere feeds nothing
    # The embeddings differ only where the tokens do: patching them elsewhere does nothing.
    assert torch.all(grid[0, torch.arange(clean.shape[1]) != 3] == 0)
    assert abs(float(grid[0, 3]) - 1.0) < 1e-5  # and patching that token restores it all


def _corrupted(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(seed))
    corrupt = clean.clone()
    corrupt[:, 3] = (clean[:, 3] + 1) % V  # one token differs in each row
    return clean, corrupt


def test_patching_grid_is_a_ratio_of_means_with_one_token_or_one_a_row(model):
    clean, corrupt = _corrupted()
    answer, right, wrong = 7, 2, 5
    grid = patching_grid(model, clean, corrupt, answer, right, wrong)
    assert torch.equal(grid, patching_grid(model, clean, corrupt, answer,
                                           torch.full((3,), right), torch.tensor(wrong)))
    rows = torch.arange(3)
    tokens = torch.tensor([2, 6, 9])  # a right token of each row's own

    def d(logits: torch.Tensor, right: torch.Tensor | int) -> torch.Tensor:
        return logits[rows, answer, right] - logits[rows, answer, wrong]

    own = patching_grid(model, clean, corrupt, answer, tokens, wrong)
    stream = residual_stream(model, clean)
    with torch.no_grad():
        logits_clean, logits_corrupt = model(clean), model(corrupt)
    for right_of, got in ((right, grid), (tokens, own)):
        d_clean, d_corrupt = d(logits_clean, right_of), d(logits_corrupt, right_of)
        for after, position in ((0, 3), (1, 3), (1, 5), (2, answer)):
            patched = d(patched_logits(model, corrupt, stream, after, position), right_of)
            expected = (patched - d_corrupt).mean() / (d_clean - d_corrupt).mean()
            assert float(got[after, position]) == pytest.approx(float(expected), abs=1e-5)
    assert not torch.allclose(own, grid)  # the rows' own tokens are read


def test_head_patching_by_hand_and_with_one_token_or_one_a_row(model):
    clean, corrupt = _corrupted()
    answer, right, wrong = 7, 2, 5
    grid = head_patching(model, clean, corrupt, answer, right, wrong)
    assert grid.shape == (L, H)
    assert torch.equal(grid, head_patching(model, clean, corrupt, answer,
                                           torch.full((3,), right), torch.tensor(wrong)))
    rows = torch.arange(3)

    def d(logits: torch.Tensor) -> torch.Tensor:
        return logits[rows, answer, right] - logits[rows, answer, wrong]

    with torch.no_grad(), recorded_heads(model) as seen:
        d_clean = d(model(clean))
    layer, head = 1, 2
    cols = slice(head * D_K, (head + 1) * D_K)

    def write_clean(_module, inputs):
        z = inputs[0].clone()
        z[..., cols] = seen[layer][..., head, :]
        return (z,)

    hook = model.h[layer].attn.c_proj.register_forward_pre_hook(write_clean)
    with torch.no_grad():
        d_patched = d(model(corrupt))
    hook.remove()
    with torch.no_grad():
        d_corrupt = d(model(corrupt))
    expected = (d_patched - d_corrupt).mean() / (d_clean - d_corrupt).mean()
    assert float(grid[layer, head]) == pytest.approx(float(expected), abs=1e-6)
    assert _no_hooks(model)


def test_head_patching_is_0_for_a_head_that_writes_alike_and_1_for_the_only_path():
    # Head 1 of layer 0 has no values: it writes 0 in both runs, so patching it restores
    # nothing. In one layer with no MLP and every head but 3 silenced, the corrupted token
    # reaches the answer through head 3 alone: patching it restores the clean preference.
    torch.manual_seed(0)
    one = GPT(GPTConfig.shakespeare_cpu(vocab_size=V, n_layers=1, n_heads=H, d_model=D,
                                        context_length=T, activation="gelu_tanh")).eval()
    with torch.no_grad():
        one.h[0].mlp.c_proj.weight.zero_()
        one.h[0].mlp.c_proj.bias.zero_()
        w_v = one.h[0].attn.c_attn.weight[2 * D:]
        b_v = one.h[0].attn.c_attn.bias[2 * D:]
        for head in range(H - 1):
            w_v[head * D_K:(head + 1) * D_K] = 0.0
            b_v[head * D_K:(head + 1) * D_K] = 0.0
    clean, corrupt = _corrupted()
    grid = head_patching(one, clean, corrupt, 7, 2, 5)
    assert torch.equal(grid[0, :H - 1], torch.zeros(H - 1))
    assert float(grid[0, H - 1]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    (dict(corrupt_ids=torch.zeros(3, 9, dtype=torch.long)), "one shape"),
    (dict(clean_ids=torch.zeros(10, dtype=torch.long),
          corrupt_ids=torch.zeros(10, dtype=torch.long)), "one shape"),
    (dict(answer=10), "0 <= answer < 10"),
    (dict(answer=-1), "0 <= answer < 10"),
    (dict(right=torch.tensor([1, 2])), "right must be one token id or 3 ids"),
    (dict(wrong=2.5), "wrong must be one token id or 3 ids"),
    (dict(corrupt_ids=None), "nothing to restore"),
])
@pytest.mark.parametrize("patching", [head_patching, patching_grid])
def test_patching_refuses_bad_input_with_the_reason(model, change, message, patching):
    clean, corrupt = _corrupted()
    args = dict(clean_ids=clean, corrupt_ids=corrupt, answer=7, right=2, wrong=5) | change
    if args["corrupt_ids"] is None:  # the corrupted run is the clean one
        args["corrupt_ids"] = clean
    with pytest.raises(ValueError, match=message):
        patching(model, **args)


# ------------------------------------------------------------------- repeated sequences

def test_induction_and_previous_keys_pick_exactly_their_entries():
    keys = induction_keys(6, 3)
    assert keys.shape == (6, 6) and keys.dtype == torch.bool
    assert keys.nonzero().tolist() == [[3, 1], [4, 2], [5, 3]]
    previous = previous_keys(4)
    assert previous.shape == (4, 4) and previous.dtype == torch.bool
    assert previous.nonzero().tolist() == [[1, 0], [2, 1], [3, 2]]


def test_scores_on_a_hand_built_pattern_equal_their_definition():
    length, half = 9, 5
    pattern = torch.zeros(2, 2, length, length)  # (B, H, T, T)
    for i in range(length):
        pattern[:, 0, i, i - half + 1 if i >= half else 0] = 1.0  # an induction head
        pattern[:, 1, i, :i + 1] = 1.0 / (i + 1)  # uniform over the causal keys
    induction = attention_mass(pattern, induction_keys(length, half))
    previous = attention_mass(pattern, previous_keys(length))
    uniform_induction = sum(1 / (i + 1) for i in range(half, length)) / (length - half)
    uniform_previous = sum(1 / (i + 1) for i in range(1, length)) / (length - 1)
    assert torch.allclose(induction, torch.tensor([1.0, uniform_induction], dtype=torch.float64))
    # Head 0's query 1 looks at key 0, its previous one; no other query does.
    assert torch.allclose(previous, torch.tensor([1 / (length - 1), uniform_previous],
                                                 dtype=torch.float64))


def test_repeated_rows_are_a_stretch_of_the_stream_twice():
    stream = torch.arange(100, 200)
    rows = repeated(stream, 5, 7, torch.Generator().manual_seed(0))
    assert rows.shape == (5, 14)
    assert torch.equal(rows[:, :7], rows[:, 7:])
    assert torch.all(rows[:, 1:7] - rows[:, :6] == 1)  # consecutive ids of the stream
    assert torch.all((rows >= 100) & (rows < 200))
    again = repeated(stream, 5, 7, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)


def test_top_picks_the_highest_score():
    grid = torch.tensor([[0.1, 0.9, 0.3], [0.5, 0.2, 0.95]])
    scores = Scores(grid, grid.flip(1))
    assert scores.top() == (1, 2)
    assert scores.top(layer=0) == (0, 1)
    assert scores.top("previous") == (1, 0)
    assert scores.top("previous", layer=0) == (0, 1)


def test_head_scores_and_copy_losses_agree_with_a_direct_computation(model):
    half, count = 6, 3
    rows = repeated(torch.arange(V).repeat(4), count, half, torch.Generator().manual_seed(2))
    scores, losses = head_scores(model, rows), copy_losses(model, rows)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    length = 2 * half - 1
    with torch.no_grad():
        logits, maps = model.forward_with_attention(inputs)
    induction = torch.zeros(L, H, dtype=torch.float64)
    previous = torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        w = maps[layer].double()
        induction[layer] = torch.stack([w[:, :, i, i - half + 1]
                                        for i in range(half, length)]).mean(dim=(0, 1))
        previous[layer] = torch.stack([w[:, :, i, i - 1]
                                       for i in range(1, length)]).mean(dim=(0, 1))
    assert scores.induction.shape == scores.previous.shape == (L, H)
    assert torch.allclose(scores.induction, induction, atol=1e-6)
    assert torch.allclose(scores.previous, previous, atol=1e-6)
    nll = -logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]  # (B, T)
    assert losses.per_position.shape == (length,)
    assert torch.allclose(losses.per_position, nll.mean(0), atol=1e-5)
    assert losses.first == pytest.approx(float(nll[:, :half - 1].mean()), abs=1e-5)
    assert losses.second == pytest.approx(float(nll[:, half:].mean()), abs=1e-5)
    ce = F.cross_entropy(logits[:, half:].reshape(-1, V), targets[:, half:].reshape(-1))
    assert losses.second == pytest.approx(float(ce), abs=1e-5)


# ---------------------------------------------------------------------------- circuits

def test_circuits_have_rank_d_k_and_give_the_attention_scores_and_writes():
    m = _gpt2(seed=3, bias=False)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    for layer, head in [(0, 0), (1, 3)]:
        qk, ov = circuits(m, layer, head)
        assert qk.shape == ov.shape == (D, D)
        assert int(torch.linalg.matrix_rank(qk)) == D_K
        assert int(torch.linalg.matrix_rank(ov)) == D_K
        attn, cols = m.h[layer].attn, slice(head * D_K, (head + 1) * D_K)
        with torch.no_grad():
            q, k, v = attn.c_attn(x).split(attn.sizes, dim=-1)
            scores = q[:, cols] @ k[:, cols].T  # (query t, key s)
            assert torch.allclose(x @ qk @ x.T, scores, atol=1e-6)
            z = torch.zeros(5, D)
            z[:, cols] = v[:, cols]  # all attention on x_s: the head outputs v_s
            assert torch.allclose(x @ ov.T, attn.c_proj(z), atol=1e-6)


def test_composition_lies_in_0_1_and_is_0_when_the_reader_ignores_the_writer():
    m = _gpt2(seed=4)
    for kind in ("q", "k", "v"):
        for earlier, later in [((0, 0), (1, 1)), ((0, 3), (1, 0))]:
            score = composition(m, earlier, later, kind)
            assert 0.0 < score <= 1.0
    # Head (0, 1) writes only in features 0..3; head (1, 2)'s keys and values ignore them.
    edited = copy.deepcopy(m)
    cols = slice(D_K, 2 * D_K)
    later = slice(2 * D_K, 3 * D_K)
    with torch.no_grad():
        edited.h[0].attn.c_proj.weight[4:, cols] = 0.0
        w_q, w_k, w_v = edited.h[1].attn.c_attn.weight.split(edited.h[1].attn.sizes, dim=0)
        w_k[later, :4] = 0.0
        w_v[later, :4] = 0.0
    assert composition(edited, (0, 1), (1, 2), "k") == 0.0
    assert composition(edited, (0, 1), (1, 2), "v") == 0.0
    assert composition(edited, (0, 1), (1, 2), "q") > 0.01  # the queries still read them
    # The later norm's gain is folded in: a gain of 0 on features 0..3 hides the writes.
    hidden = copy.deepcopy(m)
    with torch.no_grad():
        hidden.h[0].attn.c_proj.weight[4:, cols] = 0.0
        hidden.h[1].ln_1.weight[:4] = 0.0
    assert composition(hidden, (0, 1), (1, 2), "q") == 0.0
    assert composition(hidden, (0, 1), (1, 2), "k") == 0.0
    assert composition(hidden, (0, 1), (1, 2), "v") == 0.0


def _scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("layout", ["gpt2", "modern"])
def test_full_ov_circuit_is_the_heads_write_through_the_norms_without_their_scale(layout):
    # Without biases a norm's output times its input's scale is its linear part, so the
    # modules themselves give each column: the head's write of the normalised input, read
    # through the final norm and the unembedding.
    m = _gpt2(seed=3, bias=False) if layout == "gpt2" else _modern(seed=3)
    inputs = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    for layer, head in [(0, 1), (1, 3)]:
        out, into = full_ov_circuit(m, layer, head, inputs)
        assert out.shape == (V, D_K) and into.shape == (D_K, V)
        assert out.dtype == into.dtype == torch.float64
        _, ov = circuits(m, layer, head)
        norm, final = m.h[layer].ln_1, m.ln_f
        with torch.no_grad():
            read = norm(inputs) * _scale(inputs, norm.eps)  # (V, D)
            write = read @ ov.T
            expected = m.lm_head(final(write) * _scale(write, final.eps)).T  # (V, V)
        assert torch.allclose((out @ into).float(), expected, atol=1e-4)
    out, into = full_ov_circuit(m, 0, 0)  # by default, the token embeddings
    assert torch.equal(into, full_ov_circuit(m, 0, 0, m.wte.weight)[1])


def test_effective_embedding_is_the_stream_after_layer_0_without_attention_or_positions():
    m = _gpt2(seed=2)
    with torch.no_grad():
        m.h[0].attn.c_proj.weight.zero_()
        m.h[0].attn.c_proj.bias.zero_()
        m.wpe.weight.zero_()
        tokens = torch.arange(V)[None, :]
        after = residual_stream(m, tokens)[1][0]  # (V, D): token t at position t
    assert torch.allclose(effective_embedding(m), after, atol=1e-6)


def test_full_ov_circuit_refuses_a_missing_head_or_bad_inputs():
    m = _gpt2()
    with pytest.raises(ValueError, match=r"no head \(2, 0\): layers 0 to 1, heads 0 to 3"):
        full_ov_circuit(m, 2, 0)
    with pytest.raises(ValueError, match=r"no head \(0, 4\)"):
        full_ov_circuit(m, 0, 4)
    with pytest.raises(ValueError, match=r"inputs must be \(V, D\) = \(11, 16\)"):
        full_ov_circuit(m, 0, 0, torch.zeros(D, V))
    torch.manual_seed(0)
    shared = GPT(GPTConfig.shakespeare_cpu(vocab_size=V, n_layers=1, n_heads=H, d_model=D,
                                           context_length=T, n_kv_heads=2))
    with pytest.raises(ValueError, match="shares 2 among 4"):
        full_ov_circuit(shared, 0, 0)


def test_copying_scores_on_maps_whose_eigenvalues_are_known():
    x = torch.randn(V, D_K, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert copying_scores(x, x.T).eigen == pytest.approx(1.0)  # x x^T: eigenvalues >= 0
    assert copying_scores(-x, x.T).eigen == pytest.approx(-1.0)
    eye = torch.eye(V)
    assert copying_scores(eye, eye) == Copying(own_top=1.0, eigen=1.0)
    flipped = copying_scores(-eye, eye)  # each token lowers its own logit most
    assert flipped.own_top == 0.0 and flipped.eigen == pytest.approx(-1.0)
    shift = eye.roll(1, dims=0)  # token t raises t + 1: eigenvalues the V-th roots of 1
    shifted = copying_scores(shift, eye)
    assert shifted.own_top == 0.0 and shifted.eigen == pytest.approx(0.0, abs=1e-9)
    assert copying_scores(torch.zeros(V, 3), torch.zeros(3, V)).eigen == 0.0
    # Random factors copy by chance only: the own logit tops about 1 / V of the columns.
    g = torch.Generator().manual_seed(1)
    scores = [copying_scores(torch.randn(V, D_K, generator=g), torch.randn(D_K, V, generator=g))
              for _ in range(300)]
    assert abs(sum(s.eigen for s in scores) / 300) < 0.05
    assert abs(sum(s.own_top for s in scores) / 300 - 1 / V) < 0.03


def test_copying_scores_refuse_factors_that_do_not_make_a_square_map():
    with pytest.raises(ValueError, match=r"\(V, k\) and \(k, V\), got \(5, 3\) and \(3, 4\)"):
        copying_scores(torch.zeros(5, 3), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="got"):
        copying_scores(torch.zeros(5), torch.zeros(5))


def test_composition_needs_the_earlier_head_in_an_earlier_layer():
    m = _gpt2()
    for later in ((1, 1), (0, 1)):
        with pytest.raises(ValueError, match=re.escape(
                f"the earlier head's layer comes first: got earlier=(1, 0), later={later}")):
            composition(m, (1, 0), later)


# -------------------------------------------------------------------------- the copiers

@pytest.mark.parametrize(("overrides", "message"), [
    (dict(context_length=16, longest=9), "longest <= 8"),
    (dict(shortest=20, longest=10), "shortest <= longest"),
    (dict(context_length=17, shortest=4, longest=8), "context_length must be even"),
    (dict(n_heads=3), "divisible by n_heads"),
    (dict(repeat_fraction=1.5), "less than or equal to 1"),
    (dict(threads=2.0), "valid integer"),
    (dict(heads=2), "Extra inputs are not permitted"),
])
def test_a_bad_recipe_is_refused_with_the_reason(overrides, message):
    with pytest.raises(ValidationError, match=message):
        CopyRecipe(**overrides)


def _row_copy(row: torch.Tensor) -> tuple[int, int]:
    """(place, length) of the one repeated stretch of a row made from an arange stream."""
    step = row[1:] - row[:-1]
    back = (step != 1).nonzero()[:, 0].tolist()
    back = [j for j in back if step[j] < 0]
    assert len(back) == 1, row
    length = 1 - int(step[back[0]])
    return back[0] + 1 - length, length


def test_training_rows_repeat_one_stretch_each():
    recipe = CopyRecipe(context_length=24, shortest=3, longest=12, batch_size=64)
    stream = torch.arange(10_000)
    rows = training_rows(stream, recipe, torch.Generator().manual_seed(0))
    assert rows.shape == (64, 25)
    lengths = []
    for row in rows:
        place, length = _row_copy(row)
        assert recipe.shortest <= length <= recipe.longest
        assert place >= 0 and place + 2 * length <= len(row)
        assert torch.equal(row[place:place + length], row[place + length:place + 2 * length])
        # Outside the copy the row is the stream itself.
        outside = torch.ones(len(row), dtype=torch.bool)
        outside[place + length:place + 2 * length] = False
        j = torch.arange(len(row))
        assert torch.equal(row[outside], row[0] + j[outside])
        lengths.append(length)
    assert len(set(lengths)) > 3  # lengths vary
    again = training_rows(stream, recipe, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)
    other = training_rows(stream, recipe, torch.Generator().manual_seed(1))
    assert not torch.equal(rows, other)


def test_training_rows_without_repeats_are_windows_of_the_stream():
    recipe = CopyRecipe(context_length=24, shortest=3, longest=12, batch_size=32,
                        repeat_fraction=0.0)
    rows = training_rows(torch.arange(10_000), recipe, torch.Generator().manual_seed(0))
    assert rows.shape == (32, 25)
    assert torch.equal(rows, rows[:, :1] + torch.arange(25))


def test_training_rows_at_a_fixed_offset_repeat_the_first_half():
    recipe = CopyRecipe(context_length=24, shortest=3, longest=12, batch_size=32,
                        fixed_offset=True)
    rows = training_rows(torch.arange(10_000), recipe, torch.Generator().manual_seed(0))
    assert rows.shape == (32, 25)
    assert torch.equal(rows[:, 12:24], rows[:, :12])
    assert torch.equal(rows[:, :12], rows[:, :1] + torch.arange(12))
    assert torch.equal(rows[:, 24], rows[:, 0] + 24)


TEXT = "".join(f"the {a} cat sat on the {b} mat; "
               for a in ("red", "big", "old", "sly", "wet")
               for b in ("blue", "tall", "new", "dry")) * 10

# Context 24: the snapshots' shown row is 2 SHOWN_HALF - 1 = 23 ids.
TINY = CopyRecipe(n_layers=1, n_heads=2, d_model=16, context_length=24, shortest=4,
                  longest=8, steps=20, snapshot_every=10, probe_rows=4, batch_size=4)


def test_a_copiers_initial_weights_batches_and_probes_are_streams_apart(monkeypatch):
    # copy-1 trains with seed 1, the seed of the held-out probes: its batches must still be
    # no stream its weights or the probes were drawn from
    seeds = record_seeds(monkeypatch)
    copiers.train_copier(TINY.model_copy(update={"seed": copiers.PROBE_SEED, "steps": 1}),
                         TEXT)
    assert len(seeds.take()) == 3


def test_a_copier_trains_once_with_snapshots_then_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained, "corpus", lambda: TEXT)
    model, tokenizer, info = copier(TINY, cache=tmp_path)
    assert info.built and info.path.parent.parent == tmp_path
    history, metrics = info.manifest["history"], info.metrics
    assert history["step"] == [0, 10, 20]
    assert len(history["loss"]) == TINY.steps
    shown = 2 * copiers.SHOWN_HALF - 1
    assert len(history["pattern"]) == 3
    for pattern in history["pattern"]:
        grid = torch.tensor(pattern)
        assert grid.shape == (shown, shown)
        assert torch.allclose(grid.sum(-1), torch.ones(shown), atol=5e-3)  # rounded rows
        assert torch.all(grid.triu(1) == 0)  # causal
    assert len(history["pattern_text"]) == shown
    assert history["pattern_text"][:copiers.SHOWN_HALF - 1] == (
        history["pattern_text"][copiers.SHOWN_HALF:])
    for key in ("induction", "previous"):
        assert len(history[key]) == 3
        assert torch.tensor(history[key]).shape == (3, TINY.n_layers, TINY.n_heads)
    assert set(metrics) == {"first", "second", "induction", "previous", "top_induction",
                            "top_previous", "crossed_at", "plain_loss", "train_seconds"}
    assert metrics["first"] == history["first"][-1]
    assert metrics["induction"] == pytest.approx(max(map(max, history["induction"][-1])))
    assert history["pattern_head"] == metrics["top_induction"]
    assert model.config == TINY.gpt_config(tokenizer.vocab_size)
    assert not model.training

    def refuse(*_args: object) -> None:
        raise AssertionError("the second call must load, not train")

    monkeypatch.setattr(copiers, "_train_copier", refuse)
    again, _, info2 = copier(TINY, cache=tmp_path)
    assert not info2.built and info2.key == info.key
    first_state, second_state = model.state_dict(), again.state_dict()
    assert first_state.keys() == second_state.keys()
    assert all(torch.equal(first_state[k], second_state[k]) for k in first_state)


def test_a_recipe_too_short_for_the_shown_row_is_refused():
    # The snapshots keep the attention on a row of 2 SHOWN_HALF - 1 ids: a shorter context
    # is refused when the recipe is made, not after its training.
    with pytest.raises(ValidationError, match="at least 24"):
        CopyRecipe(n_layers=1, n_heads=2, d_model=16, context_length=16, shortest=4,
                    longest=8)


def _keys_queries_values(model: GPT, ids: torch.Tensor, layer: int,
                         heads: list[tuple[int, int]] | None = None,
                         means: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Layer ``layer``'s c_attn output split into q, k and v, on the intact stream or with
    ``heads`` ablated (mean-ablated with ``means``)."""
    seen: list[torch.Tensor] = []
    hook = model.h[layer].attn.c_attn.register_forward_hook(
        lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            if heads is None:
                model(ids)
            else:
                with ablated(model, heads, means):
                    model(ids)
    finally:
        hook.remove()
    return list(seen[0].split(model.h[layer].attn.sizes, dim=-1))


@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_read_ablated_cuts_only_the_path_into_one_input(part):
    model = _gpt2(3)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(4))
    means = head_means(model, torch.cat([ids, ids[:, :1]], dim=1))
    heads = [(0, 1), (0, 2)]
    intact = _keys_queries_values(model, ids, 1)
    cut = _keys_queries_values(model, ids, 1, heads, means)
    with read_ablated(model, ids, heads, means, part):
        read = _keys_queries_values(model, ids, 1)
        _, maps = model.forward_with_attention(ids)
    index = "qkv".index(part)
    for i in range(3):  # the chosen input from the ablated stream, the others intact
        assert torch.equal(read[i], cut[i] if i == index else intact[i])
    assert not torch.equal(cut[index], intact[index])  # the cut changes something
    _, intact_maps = model.forward_with_attention(ids)
    assert torch.equal(maps[0], intact_maps[0])  # the heads' own layer is untouched
    # values take no part in where a head looks; queries and keys do
    assert torch.equal(maps[1], intact_maps[1]) == (part == "v")
    assert not model.h[1].attn.c_attn._forward_hooks  # the hooks are gone


def test_read_ablated_refuses_other_ids():
    model = _gpt2(3)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(4))
    with read_ablated(model, ids, [(0, 0)], None, "k"), pytest.raises(
            ValueError, match=r"reads ids of shape \(2, 16\), those the ablated run read; "
                              r"got \(1, 16\)"):
        model(ids[:1])
