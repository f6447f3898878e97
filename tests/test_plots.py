"""The plots of numbers: curves with their spread, training curves, distributions side by
side, histograms; what they show and what they refuse."""

import matplotlib

matplotlib.use("Agg")  # no display: figures are inspected, never shown

import numpy as np
import pytest
import torch
from matplotlib.collections import PolyCollection

from minigpt.figures import plots


def _labels(texts):
    return [t.get_text() for t in texts]


def _area(polygon):
    x, y = polygon.get_paths()[0].vertices.T  # shoelace formula
    return abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))) / 2


def test_line_plot_and_histogram():
    fig = plots.line_plot([0, 1, 2], {"a": [1, 2, 3], "b": [3, 2, 1]}, title="t", xlabel="x",
                        ylabel="y")
    (ax,) = fig.axes
    assert len(ax.lines) == 2 and ax.get_title() == "t" and ax.get_legend() is not None
    with pytest.raises(ValueError, match="shape"):
        plots.line_plot([0, 1], {"a": [1, 2, 3]}, title="t", xlabel="x", ylabel="y")
    fig = plots.line_plot([0, 1], {"a": [1, 2], "b": [2, 1]}, title="t", xlabel="x", ylabel="y",
                        styles={"a": {"linewidth": 6, "marker": None}})
    wide, thin = fig.axes[0].lines
    assert wide.get_linewidth() == 6 and wide.get_marker() in (None, "None", "")
    assert thin.get_marker() == "o"


def test_histogram_plot_draws_each_sample_as_its_own_density():
    samples = {"wide": np.linspace(-1, 1, 400), "narrow": np.linspace(-0.1, 0.1, 50)}
    fig = plots.histogram_plot(samples, title="h", xlabel="cos", bins=20,
                             value_range=(-1, 1))
    (ax,) = fig.axes
    assert ax.get_ylabel() == "density" and ax.get_xlabel() == "cos"
    assert _labels(ax.get_legend().get_texts()) == ["wide", "narrow"]
    areas = [_area(c) for c in ax.collections if isinstance(c, PolyCollection)]
    assert areas == pytest.approx([1.0, 1.0])  # each integrates to 1, not to its share
    with pytest.raises(ValueError, match="empty"):
        plots.histogram_plot({}, title="h", xlabel="cos")


def test_line_plot_log_scale_and_training_curves():
    fig = plots.line_plot([0, 1], {"a": [1, 100]}, title="t", xlabel="x", ylabel="y", logy=True)
    assert fig.axes[0].get_yscale() == "log"
    history = {"step": list(range(100)), "loss": [4.0 - 0.02 * k for k in range(100)],
               "eval_step": [0, 50, 100], "train_loss": [4.0, 3.0, 2.0],
               "val_loss": [4.1, 3.2, 2.3]}
    fig = plots.training_curves(history, title="run", smooth=10)
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["batch loss", "mean of 10 steps", "train (evaluated)",
                      "validation (evaluated)"]
    mean = ax.lines[1]
    assert len(mean.get_xdata()) == 91 and mean.get_ydata()[0] == pytest.approx(3.91)
    assert list(ax.lines[3].get_ydata()) == [4.1, 3.2, 2.3]
    with pytest.raises(ValueError, match="lacks"):
        plots.training_curves({"step": [0]}, title="run")
    with pytest.raises(ValueError, match="at least smooth=50"):
        plots.training_curves(history | {"step": [0], "loss": [1.0]}, title="run")


def test_distribution_bars_share_one_token_order():
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.25, 0.25])
    fig = plots.distribution_bars({"p": p, "q": q}, ["a", " ", "c"], title="two", top=2)
    left, right = fig.axes
    assert [t.get_text() for t in left.get_xticklabels()] == ["␣", "c"]  # p's top two
    assert [b.get_height() for b in right.patches] == pytest.approx([0.25, 0.25])
    assert "mass shown 0.90" in left.get_title() and fig.get_suptitle() == "two"
    own = plots.distribution_bars({"p": p, "q": q}, ["a", " ", "c"], title="t", top=2,
                                same_order=False)
    assert [t.get_text() for t in own.axes[1].get_xticklabels()] == ["a", "␣"]  # q's own
    with pytest.raises(ValueError, match="has 2 entries, tokens 3"):
        plots.distribution_bars({"p": [0.5, 0.5]}, ["a", "b", "c"], title="t")


def test_line_plot_draws_runs_as_their_mean_with_a_band():
    runs = np.array([[1.0, 2.0, 3.0], [3.0, 4.0, 7.0]])  # two seeds
    fig = plots.line_plot([0, 1, 2], {"seeds": runs, "single": [1.0, 1.0, 1.0]}, title="t",
                        xlabel="x", ylabel="y", errorbar="sd")
    (ax,) = fig.axes
    mean, single = ax.lines
    np.testing.assert_allclose(mean.get_ydata(), [2.0, 3.0, 5.0])
    assert mean.get_markeredgecolor() == mean.get_color()  # not seaborn's white edge
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    _, y = band.get_paths()[0].vertices.T
    sd = runs.std(axis=0, ddof=1)
    assert y.min() == pytest.approx((runs.mean(0) - sd).min())
    assert y.max() == pytest.approx((runs.mean(0) + sd).max())
    assert _labels(ax.get_legend().get_texts()) == ["seeds", "single"]
    with pytest.raises(ValueError, match=r"\(S, N\)"):
        plots.line_plot([0, 1], {"a": np.ones((2, 2, 2))}, title="t", xlabel="x", ylabel="y")
