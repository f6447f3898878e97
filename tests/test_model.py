"""The GPT: shapes, input checks, parameter count, initialisation, GPT-2 parity."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from minigpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    return GPT(GPTConfig.debug()).eval()


def test_logits_shape(debug_model):
    ids = torch.randint(0, 16, (2, 8))
    assert debug_model(ids).shape == (2, 8, 16)
    logits, maps = debug_model.forward_with_attention(ids)
    assert torch.allclose(logits, debug_model(ids), atol=1e-6)
    assert len(maps) == 2 and all(m.shape == (2, 2, 8, 8) for m in maps)


def test_ids_are_read_by_the_embedding_alone():
    # The ids' type, shape and range are checked where they enter (`generate` its prompt,
    # `train` its data); the forward pass reads them as given, on any device: a meta
    # tensor (standing in for a GPU's) has no values, so any host read would raise.
    model = GPT(GPTConfig.debug()).to("meta")
    for ids in (torch.tensor([[0, 15, 7]]), torch.tensor([[3, 200, 1]])):
        assert model(ids.to("meta")).shape == (1, 3, 16)


def test_activation_reaches_every_block():
    torch.manual_seed(0)
    exact = GPT(GPTConfig.debug(activation="gelu")).eval()
    tanh = GPT(GPTConfig.debug(activation="gelu_tanh")).eval()
    with torch.no_grad():  # GELU inputs of order 1, where the two forms differ (at 0.02: not)
        for block in exact.h:
            block.mlp.c_fc.weight.mul_(100.0)
    tanh.load_state_dict(exact.state_dict())
    assert [b.mlp.gelu.approximate for b in exact.h] == ["none", "none"]
    assert [b.mlp.gelu.approximate for b in tanh.h] == ["tanh", "tanh"]
    ids = torch.randint(0, 16, (2, 8))
    assert not torch.allclose(exact(ids), tanh(ids), atol=1e-7)  # the switch changes logits


def test_a_sequence_longer_than_the_context_is_refused(debug_model):
    # the one check of the forward pass: positions past T_max have no embedding
    for call in (debug_model, debug_model.forward_with_attention, debug_model.hidden_states):
        with pytest.raises(ValueError, match="sequence length T=9 exceeds context_length=8; "
                                             "crop the input to its last 8 tokens"):
            call(torch.zeros(1, 9, dtype=torch.long))


def test_forward_with_attention_and_hidden_states_agree_with_forward(debug_model):
    ids = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = debug_model(ids)
        hidden = debug_model.hidden_states(ids)
        assert torch.equal(debug_model.lm_head(hidden), logits)
        assert torch.allclose(debug_model(ids, last_only=True), logits[:, -1:], atol=1e-6)


def test_gpt2_small_parameter_count():
    model = GPT(GPTConfig.gpt2("small"))
    assert model.num_parameters() == 124_439_808
    assert model.lm_head.weight is model.wte.weight
    assert model.num_parameters(exclude_positional=True) == 124_439_808 - 1024 * 768


def test_untied_head_counts_its_own_matrix():
    tied = GPT(GPTConfig.debug())
    untied = GPT(GPTConfig.debug(tie_weights=False))
    assert untied.num_parameters() - tied.num_parameters() == 16 * 4


def test_gpt2_initialisation_statistics():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, context_length=64, d_model=256, n_heads=4, n_layers=8)
    model = GPT(config)
    assert model.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * 8)
    assert model.h[3].attn.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.h[3].mlp.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.count_nonzero(model.h[2].mlp.c_fc.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones(256))


def test_embeddings_are_initialised_by_their_own_rule(monkeypatch):
    """GPT's initialisation re-draws each embedding with the module's reset_parameters (one
    copy of the N(0, 0.02) rule): the weights equal that rule's draw from the generator
    state the model's last call started from."""
    from minigpt.nn import LearnedPositionalEmbedding, TokenEmbedding

    calls = []
    for cls in (TokenEmbedding, LearnedPositionalEmbedding):
        def recorded(self, _reset=cls.reset_parameters):
            calls.append((self, torch.get_rng_state()))
            _reset(self)
        monkeypatch.setattr(cls, "reset_parameters", recorded)
    torch.manual_seed(0)
    model = GPT(GPTConfig.debug(tie_weights=False))
    for module in (model.wte, model.wpe):
        states = [state for m, state in calls if m is module]
        assert len(states) == 2  # the constructor's draw, then the model's
        torch.set_rng_state(states[-1])
        expected = torch.empty_like(module.weight).normal_(mean=0.0, std=0.02)
        assert torch.equal(module.weight.detach(), expected)


def test_untrained_loss_is_near_log_v():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, context_length=32, d_model=64, n_heads=4, n_layers=2)
    model = GPT(config).eval()
    ids = torch.randint(0, 65, (8, 32))
    targets = torch.randint(0, 65, (8, 32))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 65), targets.view(-1)).item()
    assert loss == pytest.approx(math.log(65), abs=0.05)


def test_causality_of_the_whole_model(debug_model):
    ids = torch.randint(0, 16, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 16
    assert torch.allclose(debug_model(ids)[:, :5], debug_model(changed)[:, :5], atol=1e-6)


def test_sinusoidal_variant_runs():
    model = GPT(GPTConfig.debug(positional="sinusoidal"))
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 16)


def _hf_model(n_layers, d_model, n_heads, vocab, positions, seed):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0,
    )
    config._attn_implementation = "eager"  # so that it can return its attention weights
    model = GPT2LMHeadModel(config).eval()
    # Make every tensor large and distinct so that a misplaced or untransposed
    # weight (or a layer norm left at identity) cannot hide.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize(
    ("n_layers", "d_model", "n_heads", "vocab", "positions"),
    [(1, 8, 1, 11, 16), (2, 32, 4, 97, 24), (3, 48, 6, 50, 12)],
)
def test_logits_equal_hugging_face_gpt2(n_layers, d_model, n_heads, vocab, positions):
    hf = _hf_model(n_layers, d_model, n_heads, vocab, positions, seed=n_layers)
    config = GPTConfig(vocab_size=vocab, context_length=positions, d_model=d_model,
                       n_heads=n_heads, n_layers=n_layers)
    ours = GPT.from_gpt2_state_dict(hf.state_dict(), config).eval()
    ids = torch.randint(0, vocab, (3, positions), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
        _, maps = ours.forward_with_attention(ids)
        hf_maps = hf(ids, output_attentions=True).attentions
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    for a, b in zip(maps, hf_maps, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_loading_rejects_mismatched_state_dicts():
    hf = _hf_model(1, 8, 2, 11, 16, seed=0)
    state = hf.state_dict()
    wrong = GPTConfig(vocab_size=12, context_length=16, d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match="shape mismatch for 'transformer.wte.weight'"):
        GPT.from_gpt2_state_dict(state, wrong)
    right = GPTConfig(vocab_size=11, context_length=16, d_model=8, n_heads=2, n_layers=1)
    partial = {k: v for k, v in state.items() if "ln_f" not in k}
    with pytest.raises(ValueError, match="lacks .*ln_f"):
        GPT.from_gpt2_state_dict(partial, right)
    extra = dict(state) | {"transformer.h.5.ln_1.weight": torch.ones(8)}
    with pytest.raises(ValueError, match="unexpected tensor 'transformer.h.5.ln_1.weight'"):
        GPT.from_gpt2_state_dict(extra, right)
    with pytest.raises(ValueError, match="positional='sinusoidal' \\(GPT-2: 'learned'\\)"):
        GPT.from_gpt2_state_dict(state, right.model_copy(update={"positional": "sinusoidal"}))
    with pytest.raises(ValueError, match="activation='relu2'"):  # same shapes, other function
        GPT.from_gpt2_state_dict(state, right.model_copy(update={"activation": "relu2"}))
