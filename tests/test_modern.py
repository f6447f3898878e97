"""The modern layout's parts: RMSNorm, rotary positions, QK-norm, ReLU^2 and SwiGLU,
grouped-query attention, Muon + AdamW, the trapezoid schedule; and every switch through
the cache, beam search, speculative decoding, classification and resumed training."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from minigpt import GPT, GPTConfig
from minigpt.attention import MultiHeadAttention
from minigpt.config import MODERN_LAYOUT, TrainConfig
from minigpt.decoding import beam_search, generate
from minigpt.nn import FeedForward, RMSNorm, RotaryEmbedding, apply_rope, rope_angles
from minigpt.optim import (
    Muon,
    MuonAdamW,
    muon_and_adamw_parameters,
    newton_schulz,
    schedule_lr,
    set_lr,
    trapezoid_lr_at,
)
from minigpt.posttrain.classify import GPTClassifier
from minigpt.speculative import speculative_generate
from minigpt.train import train

pytestmark = pytest.mark.usefixtures("one_thread")

V = 13

#: Every layout switch on its own, the modern layout whole, and grouped/multi-query heads.
LAYOUTS: dict[str, dict[str, object]] = {
    "gpt2": {},
    "rope": {"positional": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "qk_norm": {"qk_norm": True},
    "relu2": {"activation": "relu2"},
    "swiglu": {"activation": "swiglu"},
    "gqa": {"n_kv_heads": 2},
    "mqa": {"n_kv_heads": 1},
    "modern": dict(MODERN_LAYOUT),
    "modern_rms": dict(MODERN_LAYOUT) | {"norm": "rmsnorm"},
    "modern_ln": dict(MODERN_LAYOUT) | {"norm": "layernorm"},
    "modern_gqa": dict(MODERN_LAYOUT) | {"n_kv_heads": 2, "activation": "swiglu"},
}


def tiny(layout: str, **overrides: object) -> GPTConfig:
    values: dict[str, object] = dict(vocab_size=V, context_length=12, d_model=16, n_heads=4,
                                     n_layers=2)
    return GPTConfig(**(values | LAYOUTS[layout] | overrides))


def randomised(config: GPTConfig, seed: int = 0) -> GPT:
    """A model whose zero-initialised projections are given random values, so that every
    part of it acts on the output (a zero head would make every comparison vacuous)."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.normal_(0.0, 0.1)
    return model.eval()


# ----- RMSNorm ------------------------------------------------------------------------


def test_rms_norm_is_the_formula_and_torch_s() -> None:
    x = torch.randn(3, 5, 8)
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # type: ignore[union-attr]
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), want, atol=1e-6)
    assert torch.allclose(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6), atol=1e-6)
    assert RMSNorm(8, weight=False).weight is None
    assert sum(p.numel() for p in RMSNorm(8, weight=False).parameters()) == 0


@given(st.floats(min_value=1e-2, max_value=1e3))
def test_rms_norm_ignores_the_input_s_scale(c: float) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    norm = RMSNorm(16, eps=0.0).double()
    assert torch.allclose(norm(c * x), norm(x), atol=1e-10)


# ----- rotary positions ---------------------------------------------------------------


def test_rope_keeps_lengths_and_position_zero() -> None:
    x = torch.randn(2, 3, 10, 8)
    cos, sin = rope_angles(10, 8)
    y = apply_rope(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # angle 0: no rotation
    assert not torch.allclose(y[:, :, 1:], x[:, :, 1:])


@given(m=st.integers(0, 40), n=st.integers(0, 40), shift=st.integers(0, 40))
def test_rope_scores_depend_on_the_offset_only(m: int, n: int, shift: int) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, generator=gen, dtype=torch.float64), torch.randn(
        8, generator=gen, dtype=torch.float64)
    cos, sin = (a.double() for a in rope_angles(100, 8))

    def score(i: int, j: int) -> float:
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i], sin[i])
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j], sin[j])
        return float((qi * kj).sum())

    # the angles are stored in float32: equal up to their rounding
    assert math.isclose(score(m, n), score(m + shift, n + shift), abs_tol=1e-6)


def test_rotary_embedding_offsets_match_a_full_pass() -> None:
    rope = RotaryEmbedding(16, 8)
    x = torch.randn(1, 2, 16, 8)
    whole = rope(x)
    assert torch.allclose(torch.cat([rope(x[:, :, :5]), rope(x[:, :, 5:], offset=5)], 2),
                          whole)


# ----- attention: QK-norm and grouped-query -----------------------------------------


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_qk_norm_bounds_the_logits(norm: str) -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, qk_norm=True, norm=norm).eval()
    with torch.no_grad():
        attn.c_attn.weight.mul_(1000.0)  # huge queries and keys
    x = torch.randn(1, 6, 16)
    _, weights = attn(x, need_weights=True)
    # |q . k| <= d_k when both have RMS 1, so a logit is at most sqrt(d_k) = sqrt(8).
    assert weights is not None
    bound = math.exp(2 * math.sqrt(8))  # largest ratio of two weights in a row
    row = weights[0, :, -1]
    assert float(row.max().detach() / row.min().detach()) <= bound * (1 + 1e-4)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_is_multi_head_with_shared_keys(n_kv_heads: int) -> None:
    torch.manual_seed(0)
    gqa = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads).eval()
    mha = MultiHeadAttention(16, 4).eval()
    d_k, r = 4, 4 // n_kv_heads
    with torch.no_grad():  # MHA whose K and V heads are the GQA ones, each repeated r times
        q_w, k_w, v_w = gqa.c_attn.weight.split((16, n_kv_heads * d_k, n_kv_heads * d_k))
        q_b, k_b, v_b = gqa.c_attn.bias.split((16, n_kv_heads * d_k, n_kv_heads * d_k))

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.view(n_kv_heads, d_k, *t.shape[1:]).repeat_interleave(r, 0).flatten(0, 1)

        mha.c_attn.weight.copy_(torch.cat([q_w, repeat(k_w), repeat(v_w)]))
        mha.c_attn.bias.copy_(torch.cat([q_b, repeat(k_b), repeat(v_b)]))
        mha.c_proj.load_state_dict(gqa.c_proj.state_dict())
    x = torch.randn(2, 7, 16)
    for fused in (True, False):
        gqa.use_fused = mha.use_fused = fused
        assert torch.allclose(gqa(x)[0], mha(x)[0], atol=1e-5)
    assert gqa.c_attn.weight.shape == (16 + 2 * n_kv_heads * d_k, 16)


def test_n_kv_heads_equal_to_n_heads_is_gpt2_s_attention() -> None:
    torch.manual_seed(0)
    a = GPT(tiny("gpt2"))
    torch.manual_seed(0)
    b = GPT(tiny("gpt2", n_kv_heads=4))
    ids = torch.randint(0, V, (2, 9))
    assert torch.equal(a(ids), b(ids))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_cache_size_follows_the_formula(n_kv_heads: int) -> None:
    model = GPT(tiny("gpt2", n_kv_heads=n_kv_heads)).eval()
    cache = model.new_cache()
    model(torch.randint(0, V, (3, 12)), cache=cache)
    stored = sum(t.numel() * t.element_size() for layer in cache.layers
                 for t in (layer.keys, layer.values) if t is not None)
    assert stored == model.kv_cache_bytes(12, batch_size=3) == 2 * 2 * 12 * n_kv_heads * 4 * 4 * 3


# ----- feed-forward ---------------------------------------------------------------------


def test_relu2_and_swiglu_feed_forwards() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    relu = FeedForward(8, 32, activation="relu2")
    want = relu.c_proj(F.relu(relu.c_fc(x)) ** 2)
    assert torch.allclose(relu(x), want)
    glu = FeedForward(8, 32, activation="swiglu")
    want = glu.c_proj(F.silu(glu.c_gate(x)) * glu.c_fc(x))
    assert torch.allclose(glu(x), want)


def test_swiglu_default_width_keeps_gpt2_s_parameter_count() -> None:
    gelu = GPTConfig.shakespeare_cpu(65)
    glu = GPTConfig.shakespeare_cpu(65, activation="swiglu")
    assert glu.d_ff == 344 and glu.d_ff % 8 == 0  # 8 * 128 / 3 = 341.3, rounded up to 8
    count = [GPT(c).num_parameters() for c in (gelu, glu)]
    assert abs(count[1] - count[0]) / count[0] < 0.01


# ----- the GPT with every switch -----------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_logits_equal_uncached_ones(layout: str) -> None:
    model = randomised(tiny(layout))
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    full = model(ids)
    cache = model.new_cache()
    parts = [model(ids[:, :5], cache=cache), model(ids[:, 5:6], cache=cache),
             model(ids[:, 6:], cache=cache)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_future_does_not_change_the_past(layout: str) -> None:
    model = randomised(tiny(layout))
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % V
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("layout", ["modern", "modern_gqa"])
def test_decoding_works_with_the_modern_layout(layout: str) -> None:
    target, draft = randomised(tiny(layout)), randomised(tiny(layout, n_layers=1), seed=1)
    prompt = [1, 2, 3]
    cached = generate(target, prompt, 6, greedy=True)
    assert torch.equal(cached, generate(target, prompt, 6, greedy=True, use_cache=False))
    beams = beam_search(target, prompt, 4, num_beams=3)
    assert len(beams.sequences[0]) == 7
    spec = speculative_generate(target, draft, prompt, 6, k=3, greedy=True)
    assert torch.equal(spec.ids, cached.view(-1))  # greedy: the target's own argmax path


def test_classifier_reads_the_modern_hidden_states() -> None:
    gpt = randomised(tiny("modern"))
    clf = GPTClassifier(gpt, 3).eval()
    ids = torch.randint(0, V, (2, 6))
    class_logits, lm_logits = clf(ids, torch.tensor([6, 4]))
    assert class_logits.shape == (2, 3) and torch.allclose(lm_logits, gpt(ids))
    assert torch.equal(gpt.hidden_states(ids)[1, 3], clf.gpt.hidden_states(ids[:, :4])[1, 3])


def test_zero_init_starts_every_block_as_the_identity() -> None:
    model = GPT(tiny("modern"))
    assert not model.lm_head.weight.any()
    assert all(not b.attn.c_proj.weight.any() and not b.mlp.c_proj.weight.any()
               for b in model.h)
    assert model.wpe is None and model.lm_head.weight is not model.wte.weight


def test_gpt2_weights_need_gpt2_s_layout() -> None:
    config = GPTConfig.gpt2("small", n_layers=1, positional="rope")
    with pytest.raises(ValueError, match="GPT-2's layout"):
        GPT.from_gpt2_state_dict({}, config)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_kv_heads": 3}, "n_kv_heads \\(=3\\) must divide n_heads \\(=4\\)"),
    ({"n_kv_heads": 0}, "greater than 0"),
    ({"positional": "rope", "d_model": 12, "n_heads": 4}, "must be even"),
    ({"norm": "batchnorm"}, "'layernorm' or 'rmsnorm'"),
    ({"activation": "tanh"}, "'relu2' or 'swiglu'"),
])
def test_bad_switches_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny("gpt2", **kwargs)


def test_rope_model_runs_past_its_trained_context() -> None:
    model = randomised(tiny("modern"))
    longer = GPT(model.config.model_copy(update={"context_length": 24})).eval()
    longer.load_state_dict(model.state_dict())  # rotary angles are buffers, not weights
    ids = torch.randint(0, V, (1, 24))
    assert torch.allclose(longer(ids)[:, :12], model(ids[:, :12]), atol=1e-5)


# ----- Muon + AdamW and the trapezoid -------------------------------------------------


def test_muon_gets_the_hidden_matrices_only() -> None:
    model = GPT(tiny("modern"))
    hidden, rest = muon_and_adamw_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].split(".")[-2] for p in hidden} == {"c_attn", "c_proj", "c_fc"}
    assert all(p.dim() == 2 for p in hidden)
    assert {names[id(p)] for p in rest} == {"wte.weight", "lm_head.weight"}
    assert len(hidden) + len(rest) == len([p for p in model.parameters() if p.requires_grad])


def test_muon_update_is_orthogonalised_momentum() -> None:
    # One step from zero momentum on a square matrix: the update is lr * NS(g), close to
    # the orthogonal factor U V^T of g = U S V^T, with singular values near 1 (Newton-
    # Schulz's quintic lands them in about [0.7, 1.2], not exactly at 1).
    torch.manual_seed(0)
    model = GPT(tiny("gpt2", bias=False))
    opt = MuonAdamW(model, TrainConfig(optimizer="muon", muon_lr=0.1, lr=1e-3))
    w = model.h[0].attn.c_proj.weight
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    g = w.grad.clone()  # type: ignore[union-attr]
    opt.step()
    update = (before - w.detach()) / 0.1
    s = torch.linalg.svdvals(update)
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25
    u, _, vh = torch.linalg.svd(g)
    polar = u @ vh
    cosine = float((update * polar).sum() / (update.norm() * polar.norm()))
    assert cosine > 0.95


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_written_out_muon_is_torchs_with_the_float32_iteration(nesterov: bool) -> None:
    # torch.optim.Muon, its bfloat16 iteration swapped for `newton_schulz`, takes exactly
    # the steps the package's Muon takes: the same weights, bit for bit, and the same
    # momentum, over steps of changing gradients and rates, on tall, wide and square
    # matrices.
    from unittest import mock

    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 8), (8, 24), (16, 16)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = Muon(ours, lr=0.02, momentum=0.95, nesterov=nesterov)
    torchs = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.0, momentum=0.95,
                              nesterov=nesterov, adjust_lr_fn="original")
    for step in range(4):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        for group in (*mine.param_groups, *torchs.param_groups):
            group["lr"] = 0.02 / (step + 1)
        mine.step()
        with mock.patch.object(torch.optim._muon, "_zeropower_via_newtonschulz",
                               newton_schulz):
            torchs.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)
            assert torch.equal(mine.state[a]["momentum_buffer"],
                               torchs.state[b]["momentum_buffer"])


def test_trapezoid_schedule() -> None:
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=100, cooldown_fraction=0.4)
    lrs = [trapezoid_lr_at(s, **kw) for s in range(0, 110)]  # type: ignore[arg-type]
    assert lrs[0] == 0.1 and lrs[9] == 1.0
    assert all(v == 1.0 for v in lrs[9:60]) and lrs[60] == 1.0 and lrs[61] < 1.0
    assert lrs[100] == 0.1 and lrs[109] == 0.1
    assert all(a >= b for a, b in zip(lrs[60:], lrs[61:], strict=False))
    tc = TrainConfig(schedule="trapezoid", max_steps=100, warmup_steps=10, lr=1.0,
                     min_lr=0.1)
    assert [schedule_lr(s, tc) for s in range(100)] == lrs[:100]


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = (np.arange(3000) % V + (rng.random(3000) < 0.1)) % V
    return ids[:2700].astype(np.uint16), ids[2700:].astype(np.uint16)


def test_muon_run_learns_and_resumes_exactly(tmp_path: Path,
                                             data: tuple[np.ndarray, np.ndarray]) -> None:
    cfg = tiny("modern_gqa")
    tc = TrainConfig(batch_size=4, max_steps=12, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                     eval_interval=4, eval_steps=2, seed=7, optimizer="muon",
                     schedule="trapezoid", grad_accum=2)
    straight = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "a")
    train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", stop_at=6)
    resumed = train(cfg, tc, *data, progress=False, out_dir=tmp_path / "b", resume=True)
    assert straight.history.loss == resumed.history.loss
    assert straight.history.val_loss == resumed.history.val_loss
    for (name, a), b in zip(straight.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert straight.history.val_loss[-1] < straight.history.val_loss[0] - 0.3


def test_muon_lr_follows_the_schedule(data: tuple[np.ndarray, np.ndarray]) -> None:
    tc = TrainConfig(batch_size=2, max_steps=3, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                     eval_interval=10, eval_steps=1, optimizer="muon", muon_lr=0.05)
    result = train(tiny("modern"), tc, *data, progress=False)
    assert result.history.lr == pytest.approx([5e-3, 1e-2, 1e-2])  # AdamW's: warm-up, then the peak
    opt = MuonAdamW(GPT(tiny("modern")), tc)
    set_lr(opt, 5e-3, tc)  # half the peak: every group at half its own peak
    assert [g["lr"] for g in opt.muon.param_groups] == [0.025]
    assert [g["lr"] for g in opt.adamw.param_groups] == [5e-3, 5e-3]


def test_eval_full_scores_the_whole_validation_split(
        data: tuple[np.ndarray, np.ndarray]) -> None:
    from minigpt.losses import full_loss
    tc = TrainConfig(batch_size=2, max_steps=2, warmup_steps=1, eval_interval=2,
                     eval_steps=1, eval_full=True)
    result = train(tiny("gpt2"), tc, *data, progress=False)
    assert result.history.val_loss[-1] == pytest.approx(full_loss(result.model, data[1]))


# ----- two processes -------------------------------------------------------------------

STEP_SCRIPT = """
import sys, torch
from minigpt import GPT, GPTConfig
from minigpt.config import MODERN_LAYOUT, TrainConfig
from minigpt.data import Batch
from minigpt.optim import MuonAdamW
from minigpt.parallel import init_distributed, shutdown, wrap_model
from minigpt.train import train_step
torch.set_num_threads(1)
ctx = init_distributed("cpu")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=4, n_layers=2,
                      n_kv_heads=2, **MODERN_LAYOUT))
x = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(1))
y = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(2))
mine = slice(4 * ctx.rank, 4 * ctx.rank + 4)
opt = MuonAdamW(model, TrainConfig(optimizer="muon", lr=1e-2))
for _ in range(3):
    train_step(wrap_model(model, ctx), opt, [Batch(x[mine], y[mine])], grad_clip=1.0)
torch.save(model.state_dict(), sys.argv[1] + f"/rank{ctx.rank}.pt")
shutdown(ctx)
"""


@pytest.mark.slow
def test_two_ranks_with_muon_equal_one_process(tmp_path: Path) -> None:
    from test_parallel import _ranks

    from minigpt.data import Batch
    from minigpt.train import train_step

    script = tmp_path / "step.py"
    script.write_text(STEP_SCRIPT)
    for r in _ranks(2, [str(script), str(tmp_path)], tmp_path):
        assert r.returncode == 0, r.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, context_length=8, d_model=16, n_heads=4,
                          n_layers=2, n_kv_heads=2, **MODERN_LAYOUT))  # type: ignore[arg-type]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 11, (8, 8), generator=torch.Generator().manual_seed(2))
    opt = MuonAdamW(model, TrainConfig(optimizer="muon", lr=1e-2))
    for _ in range(3):  # zero-initialised: the head moves first, the inner maps third
        train_step(model, opt, [Batch(x, y)], grad_clip=1.0)
    for name, value in model.state_dict().items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.allclose(ranks[0][name], value, rtol=0, atol=2e-5), name
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items()
               if k in trained)
