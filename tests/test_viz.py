"""The book's figures: what they show (ticks, panels, colour limits, labels), what they refuse."""

import io
import math
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")  # no display: figures are inspected, never shown

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.collections import QuadMesh

from minigpt.attention import causal_mask, scaled_dot_product_attention
from minigpt.figures import plots, viz
from minigpt.nn import sinusoidal_encoding


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(batch: int, heads: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, heads, length, length, generator=generator), dim=-1)


def _panels(fig):
    """The heatmap panels: axes holding a seaborn mesh, colour bars left out."""
    return [ax for ax in fig.axes
            if ax.get_label() != "<colorbar>" and any(isinstance(c, QuadMesh)
                                                      for c in ax.collections)]


def _mesh(ax):
    (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    return mesh


def _colorbars(fig):
    return [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]


def _labels(ticks):
    return [t.get_text() for t in ticks]


# ------------------------------------------------------------------------- attention heatmap

def test_heatmap_panels_ticks_and_colour_range():
    tokens = ["To", " be", ",", " or", "\n"]
    fig = viz.attention_heatmap(_weights(2, 3, 5), tokens)
    panels = _panels(fig)
    assert len(panels) == 2 * 3
    assert len(_colorbars(fig)) == 1  # one shared colour bar
    shown = ["To", "␣be", ",", "␣or", "\\n"]
    for ax in panels:
        assert _labels(ax.get_xticklabels()) == shown  # keys across
        assert _labels(ax.get_yticklabels()) == shown  # queries down
        assert _mesh(ax).get_clim() == (0.0, 1.0)
        assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
        assert ax.get_title()
    assert fig.get_suptitle() == "Attention weights"


def test_heatmap_layout_is_batch_rows_by_head_columns():
    w = _weights(2, 3, 4)
    fig = viz.attention_heatmap(w, "abcd")
    panels = _panels(fig)
    # Row-major: panel b*H + h shows weights[b, h], queries down (row i of the image = query i).
    for b in range(2):
        for h in range(3):
            ax = panels[b * 3 + h]
            assert ax.get_title() == f"batch {b}, head {h}"
            np.testing.assert_allclose(_mesh(ax).get_array(), w[b, h].double().numpy())
    rows = {round(ax.get_position().y0, 3) for ax in panels}
    cols = {round(ax.get_position().x0, 3) for ax in panels}
    assert len(rows) == 2 and len(cols) == 3


def test_heatmap_accepts_lower_ranks_and_a_string_of_characters():
    one_head = _weights(1, 1, 6)[0, 0]
    fig = viz.attention_heatmap(one_head, "ab \ncd", titles=["only head"])
    (ax,) = _panels(fig)
    assert _labels(ax.get_xticklabels()) == ["a", "b", "␣", "\\n", "c", "d"]
    assert ax.get_title() == "only head"
    fig = viz.attention_heatmap(_weights(1, 4, 3)[0], ["x", "y", "z"])
    assert len(_panels(fig)) == 4


def test_heatmap_per_row_tokens_and_row_name():
    fig = viz.attention_heatmap(_weights(2, 1, 3), [["a", "b", "c"], ["d", "e", "f"]],
                                row_name="layer")
    first, second = _panels(fig)
    assert _labels(first.get_xticklabels()) == ["a", "b", "c"]
    assert _labels(second.get_yticklabels()) == ["d", "e", "f"]
    assert second.get_title() == "layer 1, head 0"


def test_heatmap_of_causal_attention_has_an_empty_upper_triangle():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=generator) for _ in range(3))
    _, w = scaled_dot_product_attention(q, k, v, causal_mask(5))
    fig = viz.attention_heatmap(w, "hello")
    for ax in _panels(fig):
        image = np.asarray(_mesh(ax).get_array())
        assert np.all(np.triu(image, k=1) == 0.0)


@pytest.mark.parametrize(
    ("weights", "tokens", "message"),
    [
        (torch.rand(2, 2, 2, 3, 3), "abc", r"got shape \(2, 2, 2, 3, 3\)"),
        (torch.rand(3), "abc", r"\(B, H, T, T\), \(H, T, T\) or \(T, T\)"),
        (torch.rand(1, 1, 3, 4), "abc", r"got shape \(1, 1, 3, 4\)"),
        (torch.softmax(torch.randn(1, 1, 3, 3), -1), "abcd", "got 4 tokens"),
        (torch.softmax(torch.randn(1, 1, 3, 3), -1), ["a", "b"], "got 2 tokens"),
        (torch.randn(1, 1, 3, 3) * 5, "abc", r"\[0, 1\]"),
        (torch.softmax(torch.randn(2, 1, 3, 3), -1), [["a", "b", "c"]], "B=2"),
    ],
)
def test_heatmap_rejects_bad_input(weights, tokens, message):
    with pytest.raises(ValueError, match=message):
        viz.attention_heatmap(weights, tokens)


def test_heatmap_rejects_wrong_titles():
    w = _weights(1, 2, 3)
    with pytest.raises(ValueError, match="B\\*H = 2"):
        viz.attention_heatmap(w, "abc", titles=["one"])


def test_display_token():
    assert viz.display_token(" the") == "␣the"
    assert viz.display_token("\n\n") == "\\n\\n"
    assert viz.display_token("") == "∅"


# ------------------------------------------------------------------ attention distance bars

def test_distance_bar_chart():
    distances = torch.tensor([[0.5, 1.0, 2.0], [3.0, 0.2, 1.5]])
    fig = viz.attention_distance_bars(distances)
    (ax,) = fig.axes
    # One group per layer, one bar (and legend entry) per head, in head order.
    heights = [[bar.get_height() for bar in bars] for bars in ax.containers]
    np.testing.assert_allclose(heights, distances.T.numpy())
    assert _labels(ax.get_legend().get_texts()) == ["head 0", "head 1", "head 2"]
    assert _labels(ax.get_xticklabels()) == ["layer 0", "layer 1"]
    assert ax.get_title() and ax.get_xlabel() == "layer" and "distance" in ax.get_ylabel()
    assert not ax.lines
    fig = viz.attention_distance_bars(distances, reference=2.5)
    (line,) = fig.axes[0].lines
    assert list(line.get_ydata()) == [2.5, 2.5]
    assert _labels(fig.axes[0].get_legend().get_texts())[-1] == "uniform attention"


# --------------------------------------------------------------------- positional encodings

def test_positional_heatmap_is_positions_across_and_diverging_at_zero():
    encoding = sinusoidal_encoding(96, 48)
    fig = viz.positional_heatmap(encoding, title="Sinusoids")
    ax = _panels(fig)[0]
    image = np.asarray(_mesh(ax).get_array())
    assert image.shape == (48, 96)  # dimensions down, positions across
    low, high = _mesh(ax).get_clim()
    assert low == -high and high == pytest.approx(1.0, abs=1e-6)
    assert _mesh(ax).get_cmap().name == viz.DIVERGING_CMAP
    assert len(_colorbars(fig)) == 1
    # Round indices at cell centres: cell k spans [k, k + 1).
    assert _labels(ax.get_xticklabels()) == ["0", "20", "40", "60", "80"]
    assert list(ax.get_xticks()) == [0.5, 20.5, 40.5, 60.5, 80.5]
    assert ax.get_title() == "Sinusoids" and ax.get_xlabel() == "position p"
    assert ax.get_ylabel() == "dimension"
    with pytest.raises(ValueError, match=r"\(T, D\)"):
        viz.positional_heatmap(torch.zeros(2, 3, 4))


def test_encoding_lines_draw_the_requested_dimensions():
    encoding = sinusoidal_encoding(32, 8)
    fig = viz.encoding_lines(encoding, [0, 1, 6], num_positions=16)
    assert [ax.get_title() for ax in fig.axes] == ["dimension 0", "dimension 1", "dimension 6"]
    for ax, d in zip(fig.axes, [0, 1, 6], strict=True):
        x, y = ax.lines[0].get_data()
        np.testing.assert_array_equal(x, np.arange(16))
        np.testing.assert_allclose(y, encoding[:16, d].double().numpy())
        assert ax.get_xlabel() == "position p" and ax.get_ylabel() == "value"
    fig = viz.encoding_lines(encoding, [0, 1, 2], ncols=2)  # two rows, the last one short
    assert len(fig.axes) == 3
    assert len({round(ax.get_position().y0, 3) for ax in fig.axes}) == 2
    with pytest.raises(ValueError, match=r"in \[0, 8\)"):
        viz.encoding_lines(encoding, [8])
    with pytest.raises(ValueError, match="num_positions"):
        viz.encoding_lines(encoding, [0], num_positions=33)


def test_cosine_similarity_matrix():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [1.0, 1.0]])
    sim = viz.cosine_similarity_matrix(x)
    expected = torch.tensor([[1, 0, -1, 1 / math.sqrt(2)], [0, 1, 0, 1 / math.sqrt(2)],
                             [-1, 0, 1, -1 / math.sqrt(2)],
                             [1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2), 1]],
                            dtype=torch.float64)
    torch.testing.assert_close(sim, expected)
    with pytest.raises(ValueError, match="vector 1 is zero"):
        viz.cosine_similarity_matrix(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        viz.cosine_similarity_matrix(torch.ones(3))


def test_similarity_heatmap_side_by_side_with_shared_symmetric_limits():
    a = viz.cosine_similarity_matrix(sinusoidal_encoding(10, 8))
    b = viz.cosine_similarity_matrix(torch.randn(10, 8, generator=torch.Generator().manual_seed(0)))
    fig = viz.similarity_heatmap([a, b], titles=["sinusoidal", "random"], title="Both")
    panels = _panels(fig)
    assert [ax.get_title() for ax in panels] == ["sinusoidal", "random"]
    assert len(_colorbars(fig)) == 1
    for ax in panels:
        assert _mesh(ax).get_clim() == (-1.0, 1.0)  # both have 1 on the diagonal
        assert ax.get_xlabel() == "position" and ax.get_ylabel() == "position"
    assert fig.get_suptitle() == "Both"
    with pytest.raises(ValueError, match="square"):
        viz.similarity_heatmap(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="2 strings"):
        viz.similarity_heatmap([a, b], titles=["only one"])



# ------------------------------------------------------------ seaborn: annotations, bands

def test_heatmap_annotations_write_each_weight():
    w = _weights(1, 2, 3)
    fig = viz.attention_heatmap(w, "abc", annotate=True)
    for h, ax in enumerate(_panels(fig)):
        written = [float(t.get_text()) for t in ax.texts]
        np.testing.assert_allclose(written, w[0, h].flatten().numpy(), atol=0.005)
    assert not any(ax.texts for ax in _panels(viz.attention_heatmap(w, "abc")))


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


@pytest.mark.slow
def test_figures_render_the_same_every_time():
    runs = np.random.default_rng(0).normal(size=(5, 30))
    def seeds():  # noqa: E306
        return plots.line_plot(np.arange(30), {"runs": runs}, title="t", xlabel="x",
                             ylabel="y")  # bootstrap confidence band
    assert _png(seeds()) == _png(seeds())
    w = _weights(2, 2, 6)
    assert _png(viz.attention_heatmap(w, "abcdef", annotate=True)) == _png(
        viz.attention_heatmap(w, "abcdef", annotate=True))


@pytest.mark.slow
def test_seaborn_leaves_matplotlib_style_alone():
    # seaborn's theme is never set: importing viz and drawing every kind of figure
    # changes no rcParams, so figures that do not use seaborn keep matplotlib's look.
    script = """
import matplotlib
matplotlib.use("Agg")
before = dict(matplotlib.rcParams)
import numpy as np, torch
from minigpt.figures import plots, viz
w = torch.softmax(torch.randn(1, 2, 4, 4), -1)
viz.attention_heatmap(w, "abcd", annotate=True)
viz.similarity_heatmap(torch.eye(3))
viz.positional_heatmap(torch.randn(5, 4))
plots.line_plot([0, 1], {"a": np.ones((3, 2))}, title="t", xlabel="x", ylabel="y")
plots.histogram_plot({"a": [0.0, 1.0]}, title="t", xlabel="x")
viz.attention_distance_bars(torch.ones(2, 2))
changed = sorted(k for k, v in matplotlib.rcParams.items() if before[k] != v)
print(changed)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
