"""minigpt.recipes.export: the playground's ONNX graphs, checked with onnxruntime.

A small random GPT of each layout is exported here (seconds); the book's three cached models
are exported and checked by `make playground`, and run in the browser by
tests/book/test_playground.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch

from minigpt import GPT, GPTConfig
from minigpt.config import MODERN_LAYOUT
from minigpt.recipes.export import WithCache, check_onnx, empty_cache, export_onnx, main, prompt_ids
from minigpt.tokenizer import CHAT_TOKENS, CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUTS = {"gpt2": {}, "modern": dict(MODERN_LAYOUT)}


def _model(layout: str) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, context_length=64, d_model=32, n_heads=4, n_layers=2,
                       **LAYOUTS[layout])
    model = GPT(config).eval()
    if layout == "modern":  # zero-initialised projections would make every logit equal
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             ) -> tuple[GPT, Path]:
    model = _model(request.param)
    return model, export_onnx(model, tmp_path_factory.mktemp("onnx") / "model.onnx")


@pytest.mark.parametrize("length", [1, 2, 17, 64])
def test_the_graph_is_the_model_at_every_length(exported: tuple[GPT, Path],
                                                length: int) -> None:
    model, path = exported
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 11, (1, length), generator=torch.Generator().manual_seed(length))
    logits, attention, present = session.run(
        None, {"ids": ids.numpy(), "past": empty_cache(model).numpy()})
    cache = model.new_cache()
    with torch.no_grad():
        expected, maps = model.forward_with_attention(ids, cache=cache)
    assert logits.shape == (1, length, 11)
    assert attention.shape == (1, 2, 4, length, length)  # (B, L, H, T, T)
    assert present.shape == (2, 2, 1, 4, length, 8)  # (L, keys and values, B, H_kv, T, d_k)
    assert np.abs(logits - expected.numpy()).max() <= 1e-4
    for layer, weights in enumerate(maps):
        assert np.abs(attention[0, layer] - weights[0].numpy()).max() <= 1e-5
    for layer, stored in enumerate(cache.layers):  # the package's own cache, as generate fills it
        assert stored.keys is not None and stored.values is not None
        assert np.abs(present[layer, 0] - stored.keys[:, :, :length].numpy()).max() <= 1e-5
        assert np.abs(present[layer, 1] - stored.values[:, :, :length].numpy()).max() <= 1e-5


@pytest.mark.parametrize("first", [1, 17, 63])
def test_the_graph_reads_one_token_after_its_cache(exported: tuple[GPT, Path],
                                                   first: int) -> None:
    """After ``first`` tokens read at once, the rest of a full context one at a time, each
    fed the last call's ``present``: the logits and weights of the whole pass, up to P + T
    = T_max."""
    model, path = exported
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 11, (1, 64), generator=torch.Generator().manual_seed(first))
    with torch.no_grad():
        expected, maps = model.forward_with_attention(ids)
    _, _, past = session.run(None, {"ids": ids[:, :first].numpy(),
                                    "past": empty_cache(model).numpy()})
    for t in range(first, 64):
        logits, attention, past = session.run(None, {"ids": ids[:, t:t + 1].numpy(),
                                                     "past": past})
        assert past.shape[4] == t + 1 and attention.shape == (1, 2, 4, 1, t + 1)
        assert np.abs(logits[0, 0] - expected[0, t].numpy()).max() <= 1e-4
        for layer, weights in enumerate(maps):
            assert np.abs(attention[0, layer, :, 0] - weights[0, :, t, :t + 1].numpy()
                          ).max() <= 1e-5


def test_the_lengths_stay_dynamic(exported: tuple[GPT, Path]) -> None:
    import onnx

    _, path = exported
    ids, past = onnx.load(str(path)).graph.input
    for graph_input, axis in ((ids, 1), (past, 4)):  # T and P
        dim = graph_input.type.tensor_type.shape.dim[axis]
        assert dim.dim_param and not dim.HasField("dim_value"), (graph_input.name, dim)


def test_check_passes_on_the_model_and_fails_on_another(exported: tuple[GPT, Path]) -> None:
    model, path = exported
    contexts = [[1], list(range(11)) * 5, [3, 4]]
    worst = check_onnx(path, model, contexts)
    assert worst["logits"] <= 1e-4 and worst["attention"] <= 1e-5
    other = _model("gpt2") if model.config.positional == "rope" else _model("modern")
    with pytest.raises(RuntimeError, match="differs from PyTorch"):
        check_onnx(path, other, contexts)


def test_the_written_out_attention_is_exported() -> None:
    model = _model("gpt2")
    logits, attention, _ = WithCache(model)(torch.tensor([[1, 2, 3]]), empty_cache(model))
    rows = attention.sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows))
    assert attention[..., 0, 1:].abs().max() == 0  # causal: the first query sees itself only


@pytest.mark.parametrize("length", [0, 1, 32])  # 32 new after 33 cached: 65 > 64
def test_an_example_that_would_fix_the_length_is_refused(length: int,
                                                         tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"example_length must be an int in \[2, 31\] for "
                       rf"a context of 64 .*, got {length}$"):
        export_onnx(_model("gpt2"), tmp_path / "m.onnx", example_length=length)
    assert not (tmp_path / "m.onnx").exists()


def test_export_and_check_give_the_model_back_in_its_mode(tmp_path: Path) -> None:
    """A model in training mode, with dropout, is exported and checked in eval mode (the
    check compares with the model's forward pass without dropout) and comes back training."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, context_length=16, d_model=16, n_heads=2,
                          n_layers=1, dropout=0.5)).train()
    path = export_onnx(model, tmp_path / "m.onnx", example_length=2)
    assert model.training and all(m.training for m in model.modules())
    check_onnx(path, model, [[1, 2, 3, 4], [5]])
    assert model.training and all(m.training for m in model.modules())


def test_prompt_ids_use_the_chat_format_for_the_assistant() -> None:
    plain = CharTokenizer("abc")
    chat = CharTokenizer("abc", CHAT_TOKENS)
    assert prompt_ids(plain, "cab") == [2, 0, 1]
    user, assistant, end = (chat.special_tokens[t] for t in CHAT_TOKENS)
    assert prompt_ids(chat, "ab") == [user, 0, 1, end, assistant]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        prompt_ids(plain, "abx")


def test_the_command_refuses_too_few_contexts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["out", "--contexts", "1"])
    assert "--contexts must be >= 2" in capsys.readouterr().err


def test_the_graph_holds_no_path_of_the_machine_and_is_reproducible(
        exported: tuple[GPT, Path], tmp_path: Path) -> None:
    model, path = exported
    data = path.read_bytes()
    assert str(Path(__file__).resolve().parents[1]).encode() not in data
    assert b".py" not in data, "the exporter's stack notes were kept"
    assert export_onnx(model, tmp_path / "again.onnx").read_bytes() == data


def test_a_process_with_pytorchs_own_products_exports_too(tmp_path: Path) -> None:
    # Under MINIGPT_PRODUCTS=native (a reader off Linux x86-64 is so, in kind) the package's
    # kernels are never loaded and attention's softmax is PyTorch's operations: the export
    # must not name the fused softmax's op, which that process has not registered.
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from minigpt import GPT, GPTConfig, products\n"
        "from minigpt.recipes.export import check_onnx, export_onnx\n"
        "assert products.mode() == 'native', products.mode()\n"
        "torch.manual_seed(0)\n"
        "model = GPT(GPTConfig(vocab_size=11, context_length=64, d_model=32, n_heads=4,\n"
        "                      n_layers=2)).eval()\n"
        "path = export_onnx(model, Path(sys.argv[1]) / 'model.onnx')\n"
        "worst = check_onnx(path, model, [[1], list(range(11)) * 5, [3, 4]])\n"
        "assert worst['logits'] <= 1e-4 and worst['attention'] <= 1e-5, worst\n")
    env = {**os.environ, "MINIGPT_PRODUCTS": "native", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "model.onnx").stat().st_size > 0
