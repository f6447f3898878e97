"""The architecture diagram: every stage of the GPT named, and a config's sizes filled in."""

import matplotlib

matplotlib.use("Agg")  # no display: figures are inspected, never shown

import matplotlib.pyplot as plt

from minigpt import GPTConfig
from minigpt.figures.diagram import architecture_diagram


def test_architecture_diagram_names_every_stage_and_fills_in_sizes() -> None:
    texts = lambda fig: " ".join(t.get_text() for t in fig.axes[0].texts)  # noqa: E731
    symbolic = architecture_diagram()
    words = texts(symbolic)
    for stage in ("token embedding", "position embedding", "LayerNorm  ln_1",
                  "masked multi-head attention", "feed-forward", "final LayerNorm",
                  "LM head", "softmax", "residual"):
        assert stage in words, stage
    assert "x L" in words and symbolic.axes[0].get_title()
    sized = texts(architecture_diagram(GPTConfig.gpt2("small")))
    assert "(50257 x 768)" in sized and "H = 12" in sized and "L = 12" in sized
    assert "d_ff = 3072" in sized and "(B, T, 50257)" in sized
    plt.close("all")
