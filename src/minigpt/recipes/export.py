"""The cached models exported to ONNX for the site's playground, checked against PyTorch.

The site's playground runs three of the book's models in the reader's browser with
onnxruntime-web: the book model (GPT-2's recipe), the modern model and the fine-tuned
assistant ``sft-0``. Each is exported by PyTorch's exporter (`torch.onnx.export`) as one graph
that reads new ids after a key-value cache passed in (`WithCache`): with an empty cache it is
the whole forward pass, logits and the attention weights of every layer and head
(`GPT.forward_with_attention`, whose attention is the written-out softmax the chapters show,
`attention.scaled_dot_product_attention`; PyTorch's fused kernel returns no weights); with the
cache of the text so far it reads one new token, as `minigpt.decoding.generate` does. T and P
are dynamic. Every export is run by onnxruntime on held-out text at once, both ways, and
refused unless its logits and weights are the package's.

``python -m minigpt.recipes.export OUT`` writes into the folder OUT one ``<name>.onnx`` per
model and ``playground.json``: each model's vocabulary and shape, its chat tokens (the assistant's),
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

from minigpt.data import split_text
from minigpt.decoding import generate
from minigpt.model import GPT, eval_mode
from minigpt.posttrain import chat
from minigpt.recipes.assistant import MODELS
from minigpt.recipes.pretrained import BOOK_RECIPE, corpus, threads
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
#: How many of the held-out contexts each export also reads a token at a time after its cache.
CACHED_CONTEXTS = 5


class WithCache(nn.Module):
    """A GPT as the exported graph sees it: new ids after a key-value cache, passed in and out.

    ``ids`` (B, T) are positions P..P+T-1 of a text whose first P positions are in ``past``,
    (L, 2, B, H_kv, P, d_k): each layer's keys, then its values (`KVCache`), as `present`
    returned them; P may be 0. Returns the logits (B, T, V), the attention weights of every
    layer and head over the P + T keys, (B, L, H, T, P + T), and ``present``, the cache with
    the T new positions, (L, 2, B, H_kv, P + T, d_k). The caller keeps P + T within the
    context length, as `decoding.generate` does: the prompt with P = 0, then one token at a
    time, and the whole window afresh (P = 0) once it slides.
    """

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: Tensor, past: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cache = self.gpt.new_cache()
        for layer, (keys, values) in zip(cache.layers, past, strict=True):
            layer.append(keys, values)
        logits, maps = self.gpt.forward_with_attention(ids, cache=cache)
        present = []
        for layer in cache.layers:
            assert layer.keys is not None and layer.values is not None
            present.append(torch.stack([layer.keys[:, :, :layer.length],
                                        layer.values[:, :, :layer.length]]))
        return logits, torch.stack(maps, dim=1), torch.stack(present)


def empty_cache(gpt: GPT, batch_size: int = 1) -> Tensor:
    """The ``past`` of a text not yet read: (L, 2, B, H_kv, 0, d_k) zeros."""
    c = gpt.config
    return torch.zeros(c.n_layers, 2, batch_size, c.kv_heads, 0, c.d_head)


def _softmax_over_keys_onnx(scores: Any, mask: Any = None) -> Any:
    """ONNX's graph for the package's attention softmax (`minigpt.attention.softmax_over_keys`,
    an operator of the package's own that the exporter cannot read): a masked key's score set
    to -inf, then ONNX's Softmax over the keys. The runtime sums in its own order; the
    playground's check against PyTorch allows for that."""
    from onnxscript import opset18 as op

    if mask is not None:
        # the exported models are float32, as is value_float's constant
        scores = op.Where(mask, scores, op.Constant(value_float=float("-inf")))
    return op.Softmax(scores, axis=-1)


def export_onnx(gpt: GPT, path: Path, *, example_length: int = 8) -> Path:
    """Write ``gpt`` as an ONNX graph of `WithCache` to ``path``: inputs ``ids`` and ``past``,
    outputs ``logits``, ``attention`` and ``present``, with T dynamic (1 to the context
    length) and P dynamic (0 to the context length less 1).

    The example has ``example_length`` >= 2 new positions after ``example_length + 1`` cached
    ones: an example length of 1 (or 0) would let the exporter fix T or P to it, and two
    equal lengths would let it take T and P for the same size, silently. The graph is
    traced in eval mode (no dropout); ``gpt`` is given back in the mode it was in.
    Raises ValueError for an example length outside [2, (T_max - 1) // 2], or a context
    too short for any.
    """
    c = gpt.config
    top = (c.context_length - 1) // 2
    if top < 2:
        raise ValueError(f"a context of {c.context_length} positions is too short to export: "
                         "the example needs 2 new positions after 3 cached ones (5 in all)")
    if (isinstance(example_length, bool) or not isinstance(example_length, int)
            or not 2 <= example_length <= top):
        raise ValueError(
            f"example_length must be an int in [2, {top}] for a context of {c.context_length} "
            "(a length of 1 would make T static, and T + P = 2 example_length + 1 must fit "
            f"the context), got {example_length!r}")
    length = torch.export.Dim("T", min=1, max=c.context_length)
    cached = torch.export.Dim("P", min=0, max=c.context_length - 1)
    ids = torch.zeros(1, example_length, dtype=torch.long)
    past = torch.zeros(c.n_layers, 2, 1, c.kv_heads, example_length + 1, c.d_head)
    path.parent.mkdir(parents=True, exist_ok=True)
    quiet = logging.getLogger("torch.onnx")  # its notes on the operators it skips
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr), eval_mode(gpt):
            warnings.simplefilter("ignore")
            torch.onnx.export(WithCache(gpt), (ids, past), str(path),
                              input_names=["ids", "past"],
                              output_names=["logits", "attention", "present"],
                              dynamic_shapes={"ids": {1: length}, "past": {4: cached}},
                              dynamo=True, custom_translation_table=_translations(),
                              external_data=False, verbose=False)
    finally:
        quiet.setLevel(level)
    _strip_metadata(path)
    return path


def _translations() -> dict[Any, Any]:
    """How the exporter writes the package's own ops in ONNX: the fused softmax, where this
    process has loaded the package's kernels. Under ``MINIGPT_PRODUCTS=native`` (or where
    they do not apply) the op is never registered, and attention's softmax is PyTorch's
    operations, which the exporter knows."""
    fused = getattr(torch.ops.minigpt_products, "softmax_over_keys", None)
    return {} if fused is None else {fused.default: _softmax_over_keys_onnx}


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


def check_onnx(path: Path, gpt: GPT, contexts: Sequence[Sequence[int]], *,
               cached: int = CACHED_CONTEXTS) -> dict[str, float]:
    """Run the graph at ``path`` with onnxruntime on each context, both ways the page runs it,
    and compare with ``gpt``'s forward pass over the whole context: the largest |difference|
    of the logits and of the attention weights. Whole: every context read at once (P = 0).
    Cached, for the first ``cached`` contexts of T >= 2: the first half read at once, then one
    token at a time, each step fed the last step's ``present``; each step's logits and
    weights must be the whole pass's at that position. Raises `RuntimeError` if either
    exceeds its tolerance. ``gpt`` runs in eval mode and is given back in its own."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # as on the page
    session = onnxruntime.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])
    empty = empty_cache(gpt).numpy()
    worst = {"logits": 0.0, "attention": 0.0}

    def compare(name: str, got: np.ndarray, expected: Tensor) -> None:
        worst[name] = max(worst[name], float(np.abs(got - expected.numpy()).max()))

    with torch.no_grad(), eval_mode(gpt):  # the graph's pass: no dropout
        for k, context in enumerate(contexts):
            ids = torch.tensor([list(context)], dtype=torch.long)
            expected, maps = gpt.forward_with_attention(ids)
            weights = torch.stack(maps, dim=1)  # (1, L, H, T, T)
            logits, attention, past = session.run(None, {"ids": ids.numpy(), "past": empty})
            compare("logits", logits, expected)
            compare("attention", attention, weights)
            first = len(context) // 2
            if k >= cached or first == 0:
                continue
            _, _, past = session.run(None, {"ids": ids[:, :first].numpy(), "past": empty})
            for t in range(first, len(context)):
                logits, attention, past = session.run(
                    None, {"ids": ids[:, t:t + 1].numpy(), "past": past})
                compare("logits", logits[:, 0], expected[:, t])
                compare("attention", attention[..., 0, :], weights[..., t, :t + 1])
    if worst["logits"] > LOGITS_TOLERANCE or worst["attention"] > ATTENTION_TOLERANCE:
        raise RuntimeError(f"{path.name} differs from PyTorch: {worst} (tolerances "
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
    ``<|assistant|>`` (`minigpt.posttrain.chat.prompt_ids`)."""
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
    from minigpt.figures.charts import attention_explorer

    ids = torch.tensor([tokenizer.encode_ordinary("To be")])
    with torch.no_grad():
        _, maps = gpt.forward_with_attention(ids)
    return attention_explorer(maps, list("To be")).spec


def model_entry(name: str, gpt: GPT, tokenizer: CharTokenizer) -> dict[str, Any]:
    """What the page needs to know of one exported model."""
    c = gpt.config
    return {"file": f"{name}.onnx", "label": EXPORTED[name], "vocab": tokenizer.itos,
            "chars": len(tokenizer.chars), "context_length": c.context_length,
            "n_layers": c.n_layers, "n_heads": c.n_heads, "kv_heads": c.kv_heads,
            "d_head": c.d_head,
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
                                        "cached": min(CACHED_CONTEXTS, len(windows)),
                                        "seconds": round(time.perf_counter() - start, 1)}
    if "heatmap" not in manifest:
        manifest["heatmap"] = heatmap_spec(gpt, tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt.recipes.export",
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
              f"{check['attention']:.1e} on {check['contexts']} held-out contexts read whole, "
              f"{check['cached']} also a token at a time after the cache "
              f"({check['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
