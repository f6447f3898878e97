"""The key-value cache: masks with a past, the layer and model caches, and their errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minigpt import GPT, GPTConfig, products
from minigpt.attention import LayerKVCache, MultiHeadAttention, causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=23, context_length=12, d_model=16, n_heads=4,
                         n_layers=3)).eval()


# ----- the mask ----------------------------------------------------------------------


@pytest.mark.parametrize(("t", "past"), [(1, 0), (4, 0), (1, 5), (3, 5)])
def test_causal_mask_with_a_past(t: int, past: int) -> None:
    mask = causal_mask(t, past=past)
    assert mask.shape == (1, 1, t, past + t)
    for i in range(t):
        for j in range(past + t):
            assert bool(mask[0, 0, i, j]) == (j <= past + i)  # query i sits at position past + i
    assert torch.equal(causal_mask(t, past=past)[..., past:], causal_mask(t))


def test_causal_mask_refuses_a_negative_past() -> None:
    with pytest.raises(ValueError, match="past counts cached positions: an int >= 0, got -1"):
        causal_mask(3, past=-1)


# ----- one layer ---------------------------------------------------------------------


@pytest.mark.parametrize("use_fused", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_fed_in_chunks_equals_attention_over_the_whole(use_fused: bool,
                                                                 causal: bool) -> None:
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4, causal=causal).eval()
    mha.use_fused = use_fused
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        whole, whole_weights = mha(x, need_weights=True)
        cache = LayerKVCache(9)
        pieces = []
        for start, stop in ((0, 4), (4, 5), (5, 9)):
            y, _ = mha(x[:, start:stop], cache=cache)
            pieces.append(y)
        assert cache.length == 9
    if causal:  # without the mask a prefix cannot see later keys: only causal attention chunks
        assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-6)
    # the weights of the new queries cover all stored keys
    cache = LayerKVCache(9)
    with torch.no_grad():
        mha(x[:, :5], cache=cache)
        _, weights = mha(x[:, 5:], need_weights=True, cache=cache)
    assert weights is not None and weights.shape == (2, 4, 4, 9)
    if causal:
        assert torch.allclose(weights, whole_weights[:, :, 5:], atol=1e-6)


def test_layer_cache_appends() -> None:
    # Overflow is refused where the ids enter (GPT.embed: test_model_cache_errors).
    cache = LayerKVCache(4)
    k = torch.zeros(2, 1, 3, 8)
    keys, values = cache.append(k, k)
    assert keys.shape == (2, 1, 3, 8) and cache.length == 3


# ----- the whole model ---------------------------------------------------------------


@given(cuts=st.lists(st.integers(1, 11), max_size=4, unique=True),
       positional=st.sampled_from(["learned", "sinusoidal"]))
def test_model_fed_in_any_chunks_equals_one_pass(cuts: list[int], positional: str) -> None:
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=23, context_length=12, d_model=16, n_heads=4, n_layers=2,
                          positional=positional)).eval()
    ids = torch.randint(0, 23, (3, 12), generator=torch.Generator().manual_seed(3))
    bounds = [0, *sorted(cuts), 12]
    cache = model.new_cache()
    with torch.no_grad():
        whole = model(ids)
        chunks = [model(ids[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert cache.length == 12 and cache.batch_size == 3
    assert torch.allclose(torch.cat(chunks, dim=1), whole, atol=1e-5)


@pytest.mark.skipif(not products.applies(), reason="the package's products run on Linux "
                    "x86-64 (elsewhere PyTorch's own, whose sums follow the row count)")
@pytest.mark.parametrize("preset", ["shakespeare_cpu", "modern"])
def test_a_token_decoded_with_the_cache_has_the_training_forwards_bits(preset: str) -> None:
    # The book's models, decoded one token at a time: each token's logits are its row of
    # one training forward over the whole sequence, bit for bit (one order for every
    # product, whatever its rows; the softmax's sum whatever the masked keys after it).
    torch.manual_seed(0)
    model = GPT(getattr(GPTConfig, preset)(vocab_size=65)).eval()
    ids = torch.randint(0, 65, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    with torch.no_grad():
        whole = model(ids)
        decoded = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(40)], dim=1)
    assert torch.equal(decoded, whole)


def test_last_only_is_the_last_row(model: GPT) -> None:
    ids = torch.randint(0, 23, (2, 7))
    with torch.no_grad():
        assert model(ids, last_only=True).shape == (2, 1, 23)
        assert torch.allclose(model(ids, last_only=True), model(ids)[:, -1:], atol=1e-6)


def test_reorder_keeps_the_chosen_sequences(model: GPT) -> None:
    ids = torch.randint(0, 23, (3, 6), generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(0, 23, (4, 1), generator=torch.Generator().manual_seed(5))
    index = torch.tensor([2, 0, 2, 1])  # repeat one, reorder the others: batch 3 -> 4
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
        cache.reorder(index)
        cached = model(nxt, cache=cache)
        direct = model(torch.cat([ids[index], nxt], dim=1))[:, -1:]
    assert cache.batch_size == 4
    assert torch.allclose(cached, direct, atol=1e-5)


def test_reset_empties_the_cache(model: GPT) -> None:
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    cache.reset()
    assert cache.length == 0 and cache.batch_size is None
    with torch.no_grad():  # a new batch size is fine after a reset
        model(torch.zeros(1, 12, dtype=torch.long), cache=cache)
    assert cache.length == 12


def test_model_cache_errors(model: GPT) -> None:
    cache = model.new_cache()
    assert len(cache.layers) == 3 and cache.max_length == 12
    with torch.no_grad():
        model(torch.zeros(2, 10, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="holds 10 positions and T=3 new ones would make "
                                             "13 > context_length=12"):
            model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    assert cache.length == 10  # a refused call stores nothing


def test_crop_forgets_the_last_positions(model: GPT) -> None:
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
        cache.crop(3)  # keep 1, 2, 3; then read 9 at position 3
        cropped = model(torch.tensor([[9]]), cache=cache)[0, -1]
        direct = model(torch.tensor([[1, 2, 3, 9]]))[0, -1]
    assert cache.length == 4
    assert torch.allclose(cropped, direct, atol=1e-5)
    for bad in (5, -1):
        with pytest.raises(ValueError, match=f"keeps 0 to 4 of them, not {bad}: a longer "
                                             "crop would expose unwritten slots"):
            cache.crop(bad)
