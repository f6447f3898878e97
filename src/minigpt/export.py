"""The cached models exported to ONNX for the site's playground, checked against PyTorch.

The site's playground runs three of the book's models in the reader's browser with
onnxruntime-web: the book model (GPT-2's recipe), the modern model and the fine-tuned
assistant ``sft-0``. Each is exported by PyTorch's exporter (`torch.onnx.export`) as a graph
from ids (1, T) to the logits (1, T, V) and the attention weights of every layer and head,
(1, L, H, T, T): `GPT.forward_with_attention`, whose attention is the written-out softmax
the chapters show (`attention.scaled_dot_product_attention`; PyTorch's fused kernel returns no
weights). T is dynamic, 1 to the context length. Every export is run by onnxruntime on
held-out text at once, and refused unless its logits and weights are the package's.

``python -m minigpt.export OUT`` writes into the folder OUT one ``<name>.onnx`` per model and
``playground.json``: each model's vocabulary and shape, its chat tokens (the assistant's),
the Vega-Lite specification of the attention heatmap (`charts.attention_explorer`), whose data
the page replaces with the weights it computes, and a greedy sample of each model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from minigpt import chat
from minigpt.assistant import MODELS
from minigpt.data import split_text
from minigpt.decoding import generate
from minigpt.model import GPT
from minigpt.pretrained import BOOK_RECIPE, corpus, threads
from minigpt.tokenizer import ASSISTANT, END_OF_TURN, USER, CharTokenizer

#: The exported models, by their cache name, and what the playground calls them.
EXPORTED: dict[str, str] = {"book": "GPT-2 recipe (the book model)",
                            "modern": "modern recipe",
                            "sft-0": "assistant (fine-tuned, chat format)"}
#: The largest differences an export may have from PyTorch (float32 on both sides).
LOGITS_TOLERANCE = 1e-4
ATTENTION_TOLERANCE = 1e-5
#: The prompts of the printed samples, and the playground's first prompts.
PROMPTS: dict[str, str] = {"book": "ROMEO:\nBut soft, what light",
                           "modern": "ROMEO:\nBut soft, what light",
                           "sft-0": "upper: storm"}
SAMPLE_LENGTH = 200


class WithAttention(nn.Module):
    """A GPT as the exported graph sees it: ids (B, T) -> logits (B, T, V) and the
    attention weights of every layer and head, (B, L, H, T, T)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        logits, maps = self.gpt.forward_with_attention(ids)
        return logits, torch.stack(maps, dim=1)


def export_onnx(gpt: GPT, path: Path, *, example_length: int = 8) -> Path:
    """Write ``gpt`` as an ONNX graph with a dynamic length (1 to its context) to ``path``.

    The example input has ``example_length`` >= 2 positions: an example of length 1 (or 0)
    would let the exporter fix T to it, silently.
    """
    assert 2 <= example_length <= gpt.config.context_length, (
        f"example_length must lie in [2, {gpt.config.context_length}] (a length of 1 would "
        f"make T static), got {example_length}")
    length = torch.export.Dim("T", min=1, max=gpt.config.context_length)
    example = torch.zeros(1, example_length, dtype=torch.long)
    path.parent.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger("torch.onnx")  # its notes on the operators it skips
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            torch.onnx.export(WithAttention(gpt.eval()), (example,), str(path),
                              input_names=["ids"], output_names=["logits", "attention"],
                              dynamic_shapes={"ids": {1: length}}, dynamo=True,
                              external_data=False, verbose=False)
    finally:
        quiet.setLevel(level)
    _strip_metadata(path)
    return path


def _strip_metadata(path: Path) -> None:
    """Drop what the exporter notes beside each operator (the Python stack that made it,
    with this machine's paths): the published graph holds only the computation."""
    import onnx

    graph = onnx.load(str(path))
    for node in graph.graph.node:
        node.doc_string = ""
        del node.metadata_props[:]
    for function in graph.functions:
        for node in function.node:
            node.doc_string = ""
            del node.metadata_props[:]
    graph.graph.doc_string = ""
    onnx.save(graph, str(path))


def held_out_contexts(tokenizer: CharTokenizer, n: int, max_length: int, *,
                      seed: int = 0) -> list[list[int]]:
    """``n`` windows of the validation text (the part no model trained on), of lengths
    1 .. ``max_length`` (the first of length 1, the second of ``max_length``)."""
    _, val_text = split_text(corpus(), BOOK_RECIPE.train_fraction)
    ids = tokenizer.encode_ordinary(val_text)
    rng = np.random.default_rng(seed)
    lengths = [1, max_length, *rng.integers(1, max_length + 1, size=max(0, n - 2)).tolist()]
    lengths = lengths[:n]
    starts = rng.integers(0, len(ids) - max_length, size=len(lengths)).tolist()
    return [ids[s:s + t] for s, t in zip(starts, lengths, strict=True)]


def check_onnx(path: Path, gpt: GPT, contexts: Sequence[Sequence[int]]) -> dict[str, float]:
    """Run the graph at ``path`` with onnxruntime on each context and compare with ``gpt``:
    the largest |difference| of the logits and of the attention weights. Raises
    `AssertionError` if either exceeds its tolerance."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # as on the page
    session = onnxruntime.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])
    worst = {"logits": 0.0, "attention": 0.0}
    with torch.no_grad():
        for context in contexts:
            ids = torch.tensor([list(context)], dtype=torch.long)
            logits, attention = session.run(None, {"ids": ids.numpy()})
            expected, maps = WithAttention(gpt.eval())(ids)
            worst["logits"] = max(worst["logits"],
                                  float(np.abs(logits - expected.numpy()).max()))
            worst["attention"] = max(worst["attention"],
                                     float(np.abs(attention - maps.numpy()).max()))
    if worst["logits"] > LOGITS_TOLERANCE or worst["attention"] > ATTENTION_TOLERANCE:
        raise AssertionError(f"{path.name} differs from PyTorch: {worst} (tolerances "
                             f"{LOGITS_TOLERANCE}, {ATTENTION_TOLERANCE})")
    return worst


def _chat_ids(tokenizer: CharTokenizer) -> dict[str, int] | None:
    special = tokenizer.special_tokens
    if USER not in special:
        return None
    return {"user": special[USER], "assistant": special[ASSISTANT],
            "end": special[END_OF_TURN]}


def prompt_ids(tokenizer: CharTokenizer, prompt: str) -> list[int]:
    """The ids the playground feeds a model for ``prompt``: its characters, or, for the
    assistant (a tokenizer with the chat tokens), the prompt as a user's turn followed by
    ``<|assistant|>`` (`minigpt.chat.prompt_ids`)."""
    if _chat_ids(tokenizer) is None:
        return tokenizer.encode_ordinary(prompt)
    return chat.prompt_ids([chat.Turn("user", prompt)], tokenizer)


def greedy_sample(gpt: GPT, tokenizer: CharTokenizer, prompt: str,
                  length: int = SAMPLE_LENGTH) -> str:
    """The text the playground writes greedily after ``prompt``: ``length`` characters
    (the assistant stops at the end of its turn)."""
    ids = prompt_ids(tokenizer, prompt)
    new = generate(gpt, ids, length, greedy=True)[len(ids):].tolist()
    special = _chat_ids(tokenizer)
    if special is not None and special["end"] in new:
        new = new[:new.index(special["end"])]
    return tokenizer.decode(new)


def heatmap_spec(gpt: GPT, tokenizer: CharTokenizer) -> dict[str, Any]:
    """The attention heatmap's Vega-Lite specification (`charts.attention_explorer`), drawn
    for a short text: the page keeps its marks and controls and replaces its data."""
    from minigpt.charts import attention_explorer

    ids = torch.tensor([tokenizer.encode_ordinary("To be")])
    with torch.no_grad():
        _, maps = gpt.forward_with_attention(ids)
    return attention_explorer(maps, list("To be")).spec


def model_entry(name: str, gpt: GPT, tokenizer: CharTokenizer) -> dict[str, Any]:
    """What the page needs to know of one exported model."""
    c = gpt.config
    return {"file": f"{name}.onnx", "label": EXPORTED[name], "vocab": tokenizer.itos,
            "chars": len(tokenizer.chars), "context_length": c.context_length,
            "n_layers": c.n_layers, "n_heads": c.n_heads,
            "parameters": gpt.num_parameters(), "chat": _chat_ids(tokenizer),
            "prompt": PROMPTS[name],
            "sample": greedy_sample(gpt, tokenizer, PROMPTS[name])}


def export_playground(out: Path, *, contexts: int = 20) -> dict[str, Any]:
    """Export every model of `EXPORTED` into ``out``, check each on ``contexts`` held-out
    windows (lengths 1 and T_max among them), and write ``playground.json``; return it."""
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"models": {}, "checks": {}}
    with threads(1):  # small models: a second thread only contends with other work
        for name in EXPORTED:
            _export_one(name, out, contexts, manifest)
    text = json.dumps(manifest, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    (out / "playground.json").write_text(text + "\n", encoding="utf-8")
    return manifest


def _export_one(name: str, out: Path, contexts: int, manifest: dict[str, Any]) -> None:
    """Export, check and describe one model into ``manifest``."""
    start = time.perf_counter()
    gpt, tokenizer, _ = MODELS[name]()
    assert isinstance(tokenizer, CharTokenizer)
    path = export_onnx(gpt, out / f"{name}.onnx")
    windows = held_out_contexts(tokenizer, contexts, gpt.config.context_length)
    worst = check_onnx(path, gpt, windows)
    manifest["models"][name] = model_entry(name, gpt, tokenizer)
    manifest["checks"][name] = worst | {"contexts": len(windows),
                                        "seconds": round(time.perf_counter() - start, 1)}
    if "heatmap" not in manifest:
        manifest["heatmap"] = heatmap_spec(gpt, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt.export",
        description="Export the playground's models to ONNX and check them with onnxruntime.")
    parser.add_argument("out", type=Path, help="the folder to write into")
    parser.add_argument("--contexts", type=int, default=20,
                        help="held-out windows each export is checked on (default 20)")
    args = parser.parse_args(argv)
    if args.contexts < 2:
        parser.error(f"--contexts must be >= 2 (lengths 1 and T_max), got {args.contexts}")
    manifest = export_playground(args.out, contexts=args.contexts)
    for name, check in manifest["checks"].items():
        print(f"{name}: max |Δ| logits {check['logits']:.1e}, attention "
              f"{check['attention']:.1e} on {check['contexts']} held-out contexts "
              f"({check['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
