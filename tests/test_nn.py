"""Components against PyTorch's own implementations, and their documented identities."""

import math

import pytest
import torch
import torch.nn.functional as F

from minigpt.nn import (
    Block,
    FeedForward,
    LayerNorm,
    LearnedPositionalEmbedding,
    PostLNBlock,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    gelu,
    one_hot_embedding,
    sinusoidal_encoding,
)


def test_embedding_equals_one_hot_matmul_exactly():
    torch.manual_seed(0)
    embedding = TokenEmbedding(vocab_size=6, d_model=4)
    ids = torch.tensor([[0, 5, 2, 2], [1, 3, 4, 0]])
    lookup = embedding(ids)
    assert lookup.shape == (2, 4, 4)
    assert torch.equal(lookup, one_hot_embedding(ids, embedding.weight))


@pytest.mark.parametrize("cls", [TokenEmbedding, LearnedPositionalEmbedding])
def test_embedding_rule_is_gpt2s_normal_and_reset_redraws_it(cls):
    torch.manual_seed(0)
    embedding = cls(300, 64)
    torch.manual_seed(0)
    assert torch.equal(embedding.weight.detach(), torch.empty(300, 64).normal_(0.0, 0.02))
    assert embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    before = embedding.weight.detach().clone()
    embedding.reset_parameters()
    assert not torch.equal(embedding.weight.detach(), before)


def test_sinusoidal_worked_example_d4():
    encoding = sinusoidal_encoding(3, 4)
    # Position 0 is [sin 0, cos 0, sin 0, cos 0].
    assert torch.equal(encoding[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    expected_p1 = torch.tensor([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)])
    assert torch.allclose(encoding[1], expected_p1, atol=1e-7)
    expected_p2 = torch.tensor([math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)])
    assert torch.allclose(encoding[2], expected_p2, atol=1e-7)


@pytest.mark.parametrize("d_model", [1, 5, 48])
def test_sinusoidal_formula(d_model):
    encoding = sinusoidal_encoding(20, d_model)
    assert encoding.shape == (20, d_model)
    for p in (0, 3, 19):
        for j in range(d_model):
            i2 = j - j % 2
            angle = p / 10000 ** (i2 / d_model)
            value = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert encoding[p, j].item() == pytest.approx(value, abs=1e-6)


def test_sinusoidal_rejects_empty_shapes():
    with pytest.raises(ValueError, match="must be positive"):
        sinusoidal_encoding(0, 4)


def test_positional_modules():
    fixed = SinusoidalPositionalEncoding(16, 8)
    assert "encoding" not in fixed.state_dict()  # derived, not saved
    assert not list(fixed.parameters())
    positions = torch.arange(5)
    assert torch.equal(fixed(positions), sinusoidal_encoding(16, 8)[:5])
    learned = LearnedPositionalEmbedding(16, 8)
    assert learned(positions).shape == (5, 8)
    assert learned.weight.requires_grad


@pytest.mark.parametrize("use_fused", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_pytorch(bias, use_fused):
    torch.manual_seed(0)
    ours = LayerNorm(32, eps=1e-5, bias=bias)
    ours.use_fused = use_fused
    theirs = torch.nn.LayerNorm(32, eps=1e-5, bias=bias)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
        if bias:
            ours.bias.normal_()
            theirs.bias.copy_(ours.bias)
    x = torch.randn(4, 7, 32) * 3 + 1
    assert torch.allclose(ours(x), theirs(x), atol=1e-5)
    # gradients agree too
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(x1).pow(2).sum().backward()
    theirs(x2).pow(2).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-4)


def test_layer_norm_written_out_and_fused_paths_agree():
    torch.manual_seed(1)
    norm = LayerNorm(48)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 5, 48) * 10 - 4
    assert norm.use_fused  # the default is PyTorch's kernel
    fused = norm(x)
    norm.use_fused = False
    written = norm(x)
    assert torch.allclose(fused, written, atol=1e-5)


def test_layer_norm_eps_inside_the_root_matters_for_tiny_variance():
    x = torch.tensor([[1.0, 1.0 + 1e-3, 1.0 - 1e-3, 1.0]])
    norm = LayerNorm(4)
    norm.use_fused = False  # the written-out formula, not PyTorch's kernel
    ours = norm(x)
    reference = F.layer_norm(x, (4,), eps=1e-5)
    wrong = (x - x.mean(-1, keepdim=True)) / (x.std(-1, unbiased=False, keepdim=True) + 1e-5)
    assert torch.allclose(ours, reference, atol=1e-5)
    assert not torch.allclose(wrong, reference, atol=1e-2)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_pytorch(approximate):
    x = torch.linspace(-8, 8, 2001)
    assert torch.allclose(gelu(x, approximate), F.gelu(x, approximate=approximate), atol=1e-6)


def test_gelu_minimum_and_bad_argument():
    x = torch.linspace(-3, 0, 30001, dtype=torch.float64)
    assert gelu(x).min().item() == pytest.approx(-0.170, abs=1e-3)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        gelu(x, "sigmoid")


def test_feed_forward_is_position_wise():
    torch.manual_seed(0)
    ffn = FeedForward(8, 32)
    x = torch.randn(2, 5, 8)
    full = ffn(x)
    one = ffn(x[:, 3:4])
    assert torch.allclose(full[:, 3:4], one, atol=1e-6)
    assert ffn.c_fc.weight.shape == (32, 8) and ffn.c_proj.weight.shape == (8, 32)


@pytest.mark.parametrize("activation, approximate", [("gelu_tanh", "tanh"), ("gelu", "none")])
def test_feed_forward_activation(activation, approximate):
    torch.manual_seed(0)
    ffn = FeedForward(8, 32, activation=activation)
    x = torch.randn(2, 5, 8) * 3
    expected = ffn.c_proj(F.gelu(ffn.c_fc(x), approximate=approximate))
    assert torch.allclose(ffn(x), expected, atol=1e-6)
    other = FeedForward(8, 32, activation="gelu" if activation == "gelu_tanh" else "gelu_tanh")
    other.load_state_dict(ffn.state_dict())
    assert not torch.allclose(other(x), ffn(x), atol=1e-6)  # the switch changes the output
    with pytest.raises(ValueError, match=r"activation must be one of \['gelu_tanh', 'gelu', "
                                         r"'relu2', 'swiglu'\], got 'relu'"):
        FeedForward(8, 32, activation="relu")


def test_pre_ln_block_keeps_identity_path_post_ln_does_not():
    torch.manual_seed(0)
    pre = Block(8, 2, 32)
    post = PostLNBlock(8, 2, 32)
    post.load_state_dict(pre.state_dict())
    for block in (pre, post):
        with torch.no_grad():
            block.attn.c_proj.weight.zero_()
            block.attn.c_proj.bias.zero_()
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    x = torch.randn(2, 5, 8) * 4 + 2
    # With every sub-layer switched off, pre-LN is the identity; post-LN still normalises.
    assert torch.equal(pre(x)[0], x)
    out = post(x)[0]
    assert not torch.allclose(out, x, atol=1e-2)
    assert torch.allclose(out.mean(-1), torch.zeros(2, 5), atol=1e-5)
