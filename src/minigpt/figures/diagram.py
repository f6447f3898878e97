"""The diagram of the GPT's architecture the chapters draw: GPT-2's layout as a flow chart,
input at the top, with the shape of the residual stream beside it, and the sizes of a
`GPTConfig` filled in when one is given. Drawn with matplotlib (boxes, arrows, sums); the
`Figure` is returned, never shown.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from minigpt.config import GPTConfig


class _Sketch:
    """Boxes, arrows, sums and shape labels drawn on one axes (for `architecture_diagram`)."""

    COLOURS = {"io": "#eeeeee", "embed": "#cfe2f3", "norm": "#fff2cc", "attn": "#f9cb9c",
               "ffn": "#d9ead3", "head": "#d9d2e9"}

    def __init__(self, ax: Axes) -> None:
        self.ax = ax

    def box(self, x: float, y: float, text: str, kind: str, width: float = 5.0,
            height: float = 0.9) -> None:
        self.ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height,
                                         boxstyle="round,pad=0.08", fc=self.COLOURS[kind],
                                         ec="black"))
        self.ax.text(x, y, text, ha="center", va="center", fontsize=9)

    def arrow(self, x1: float, y1: float, x2: float, y2: float) -> None:
        self.ax.annotate("", xy=(x2, y2), xytext=(x1, y1),
                         arrowprops={"arrowstyle": "->", "lw": 1.2})

    def plus(self, y: float) -> None:
        self.ax.text(5, y, "+", ha="center", va="center", fontsize=11,
                     bbox={"boxstyle": "circle,pad=0.15", "fc": "white", "ec": "black"})

    def shape(self, y: float, text: str) -> None:
        self.ax.text(5.25, y, text, ha="left", va="center", fontsize=8.5, color="#444444",
                     family="monospace")


def architecture_diagram(config: GPTConfig | None = None) -> Figure:
    """The GPT as a flow chart, input at the top, with the shape of the residual stream.

    Args:
        config: fills in the sizes (D = 768, ...); without one the symbols stay.

    Returns: a Figure with one axes (drawn, not plotted: its axis lines are hidden).
    """
    if config is None:
        size = {"D": "D", "V": "V", "H": "H", "L": "L", "F": "d_ff"}
    else:
        size = {"D": f"D = {config.d_model}", "V": f"V = {config.vocab_size}",
                "H": f"H = {config.n_heads}", "L": f"L = {config.n_layers}",
                "F": f"d_ff = {config.d_ff}"}
    d = size["D"].split(" = ")[-1]
    v = size["V"].split(" = ")[-1]
    fig, ax = plt.subplots(figsize=(7.5, 10.5))
    ax.set_xlim(0, 10)
    ax.set_ylim(0.5, 23.5)
    ax.axis("off")
    sk = _Sketch(ax)
    sk.box(5, 22.6, "token ids  x_0 .. x_{T-1}", "io")
    sk.arrow(4.0, 22.1, 2.9, 21.15)
    sk.arrow(6.0, 22.1, 7.1, 21.15)
    sk.shape(21.75, "(B, T)")
    sk.box(2.7, 20.5, f"token embedding W_e\n({v} x {d})", "embed", width=4.0, height=1.2)
    sk.box(7.3, 20.5, f"position embedding W_p\n(T_max x {d})", "embed", width=4.0,
           height=1.2)
    sk.arrow(2.9, 19.85, 4.75, 19.4)
    sk.arrow(7.1, 19.85, 5.25, 19.4)
    sk.plus(19.2)
    sk.arrow(5, 18.9, 5, 18.35)
    sk.box(5, 17.9, "dropout", "io", width=3.0)
    sk.arrow(5, 17.45, 5, 16.45)
    sk.shape(16.9, f"(B, T, {d})")
    _decoder_block(sk, size)
    sk.arrow(5, 8.6, 5, 7.25)
    sk.shape(7.85, f"(B, T, {d})")
    sk.box(5, 6.8, "final LayerNorm  ln_f", "norm", width=3.4)
    sk.arrow(5, 6.35, 5, 5.65)
    sk.box(5, 5.2, "LM head  W_s = W_e^T  (tied)", "head")
    sk.arrow(5, 4.75, 5, 3.65)
    sk.shape(4.2, f"(B, T, {v})  logits")
    sk.box(5, 3.2, "softmax over the vocabulary", "head", width=4.0)
    sk.arrow(5, 2.75, 5, 2.05)
    sk.box(5, 1.6, "P(x_{t+1} | x_0 .. x_t) for every position t", "io", width=5.6)
    ax.set_title("GPT-2's layout: data flows from the top down", fontsize=12)
    return fig


def _decoder_block(sk: _Sketch, size: dict[str, str]) -> None:
    """The decoder block, repeated L times, with its two residual paths."""
    sk.ax.add_patch(FancyBboxPatch((1.0, 7.9), 8.0, 8.45, boxstyle="round,pad=0.1", fc="none",
                                   ec="#666666", ls="--"))
    sk.ax.text(8.9, 16.0, f"decoder block\n(pre-LN), x {size['L']}", ha="right", va="center",
               fontsize=9, style="italic")
    sk.box(5, 15.9, "LayerNorm  ln_1", "norm", width=3.4)
    sk.arrow(5, 15.45, 5, 14.75)
    sk.box(5, 14.3, f"masked multi-head attention ({size['H']})", "attn")
    sk.arrow(5, 13.85, 5, 13.3)
    sk.plus(13.0)
    sk.box(5, 11.8, "LayerNorm  ln_2", "norm", width=3.4)
    sk.arrow(5, 12.7, 5, 12.25)
    sk.arrow(5, 11.35, 5, 10.65)
    sk.box(5, 10.2, f"feed-forward  D -> {size['F']} -> D, GELU", "ffn", width=6.2)
    sk.arrow(5, 9.75, 5, 9.2)
    sk.plus(8.9)
    # Residual paths: the stream skips each sub-layer and is added back.
    for top, bottom in ((16.4, 13.0), (12.55, 8.9)):
        sk.ax.plot([5, 1.6, 1.6], [top, top, bottom], color="black", lw=1.2)
        sk.arrow(1.6, bottom, 4.7, bottom)
    sk.ax.text(1.45, 14.7, "residual", rotation=90, ha="right", va="center", fontsize=8.5)
    sk.ax.text(1.45, 10.7, "residual", rotation=90, ha="right", va="center", fontsize=8.5)
