"""The plots of numbers the chapters show: curves (one run, or several seeds with their
spread), a run's training curves, next-token distributions side by side, histograms.

Like `minigpt.figures.viz`'s figures, each is drawn on axes made with pyplot and returned as a
`Figure` (nothing here calls `plt.show()`), keeps matplotlib's style (an opaque white
background that reads the same in the site's light and dark modes), and checks the data a
reader passes before drawing: a series of the wrong length, an empty mapping or a history
without its steps raises a `ValueError` saying what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minigpt.figures.viz import as_float64, display_token


def _named(entries: Mapping[str, Any], name: str) -> dict[str, np.ndarray]:
    """A non-empty {label: values} mapping as {label: float64 array}."""
    if not entries:
        raise ValueError(f"{name} is empty; pass at least one {{label: values}} entry")
    return {label: as_float64(v) for label, v in entries.items()}


def _check_series(x: Any,
                  series: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """x as (N,), each series as (N,) (one curve) or (S, N) (S runs, e.g. seeds)."""
    xs = as_float64(x)
    if xs.ndim != 1 or xs.size == 0:
        raise ValueError(f"x must be a non-empty 1-D sequence, got shape {xs.shape}")
    arrays = _named(series, "series")
    for label, ys in arrays.items():
        if ys.shape[-1:] != xs.shape or ys.ndim > 2 or 0 in ys.shape:
            raise ValueError(f"series {label!r} has shape {ys.shape}, x has {xs.shape}; "
                             f"pass (N,) values or (S, N) for S runs")
    return xs, arrays


def _check_history(history: Mapping[str, Sequence[float]],
                   smooth: int) -> tuple[np.ndarray, np.ndarray]:
    """A History's steps and batch losses, at least `smooth` of them."""
    missing = {"step", "loss", "eval_step", "train_loss", "val_loss"} - set(history)
    if missing:
        raise ValueError(f"history lacks {sorted(missing)}; pass a History's fields")
    steps, loss = as_float64(history["step"]), as_float64(history["loss"])
    if loss.size < smooth or steps.shape != loss.shape:
        raise ValueError(f"need at least smooth={smooth} steps of matching step and loss, "
                         f"got {steps.shape} and {loss.shape}")
    return steps, loss


def _distributions(distributions: Mapping[str, Any], size: int) -> dict[str, np.ndarray]:
    """Each distribution as a (V,) probability vector, V = `size`."""
    arrays = {k: v.ravel() for k, v in _named(distributions, "distributions").items()}
    for label, probs in arrays.items():
        if probs.shape != (size,):
            raise ValueError(f"distribution {label!r} has {probs.size} entries, tokens "
                             f"{size}")
    return arrays


def _samples(samples: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.ravel() for k, v in _named(samples, "samples").items()}


def _mean_with_band(ax: Axes, xs: np.ndarray, runs: np.ndarray, label: str,
                    style: dict[str, Any], errorbar: Any) -> None:
    """The mean of S runs (S, N) with seaborn's band; the bootstrap's seed is fixed so
    the figure is the same every time. Markers keep matplotlib's look (seaborn's default
    white edge would hide 'x' and '+')."""
    sns.lineplot(x=np.tile(xs, len(runs)), y=runs.ravel(), ax=ax, label=label,
                 errorbar=errorbar, seed=0,
                 **({"markeredgecolor": None, "markeredgewidth": None} | style))


def line_plot(
    x: Any,
    series: Mapping[str, Any],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    marker: str | None = "o",
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    logy: bool = False,
    errorbar: Any = ("ci", 95),
) -> Figure:
    """Several named curves y(x) on one pair of axes, with a legend.

    A series of shape (N,) is one curve; one of shape (S, N) holds S runs (seeds) and
    is drawn as their mean with a band, seaborn's ``errorbar`` (default the 95%
    bootstrap confidence interval of the mean; ``"sd"`` for +-1 standard deviation).
    ``styles`` maps a series' label to extra `Axes.plot` keyword arguments (e.g. a wide
    pale line for a reference curve that other curves lie on); ``logy`` puts y on a log
    scale.
    """
    styles = {} if styles is None else styles
    xs, arrays = _check_series(x, series)
    fig, ax = plt.subplots(layout="constrained", figsize=(6.4, 3.6))
    for label, ys in arrays.items():
        style = {"marker": marker, "markersize": 3} | dict(styles.get(label, {}))
        if ys.ndim == 1:
            ax.plot(xs, ys, label=label, **style)
        else:
            _mean_with_band(ax, xs, ys, label, style, errorbar)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    return fig


def training_curves(history: Mapping[str, Sequence[float]], *, title: str,
                    smooth: int = 50) -> Figure:
    """The loss of a training run: each step's batch loss (pale), its running mean over
    ``smooth`` steps, and the evaluated train and validation losses (markers).

    ``history`` holds the lists of a `minigpt.train.History` (or its ``asdict``): step,
    loss, eval_step, train_loss, val_loss.
    """
    steps, loss = _check_history(history, smooth)
    mean = np.convolve(loss, np.ones(smooth) / smooth, mode="valid")
    fig, ax = plt.subplots(layout="constrained", figsize=(6.4, 3.6))
    ax.plot(steps + 1, loss, color="tab:blue", alpha=0.25, linewidth=0.8,
            label="batch loss")
    ax.plot(steps[smooth - 1:] + 1, mean, color="tab:blue", label=f"mean of {smooth} steps")
    for key, colour, label in (("train_loss", "tab:green", "train (evaluated)"),
                               ("val_loss", "tab:red", "validation (evaluated)")):
        ax.plot(history["eval_step"], history[key], "o-", color=colour, markersize=4,
                label=label)
    ax.set(title=title, xlabel="optimiser steps", ylabel="loss (nats per token)")
    ax.legend()
    return fig


def distribution_bars(distributions: Mapping[str, Any], tokens: Sequence[str], *,
                      title: str, top: int = 20, same_order: bool = True) -> Figure:
    """Several distributions over one vocabulary as bar charts, one panel each.

    With ``same_order`` every panel shows the ``top`` tokens most likely under the first
    distribution, in that order, so that panels compare bar by bar (one distribution
    reshaped several ways); otherwise each panel shows its own ``top`` (distributions
    after different prompts). The title of each panel gives the mass its bars hold.
    ``tokens[i]`` labels id i (whitespace made visible).
    """
    arrays = _distributions(distributions, len(tokens))
    first = np.argsort(-next(iter(arrays.values())), kind="stable")[:top]
    fig, axes = plt.subplots(1, len(arrays), layout="constrained", sharey=True,
                             figsize=(3.2 * len(arrays) + 0.6, 3.2), squeeze=False)
    for ax, (label, probs) in zip(axes[0], arrays.items(), strict=True):
        order = first if same_order else np.argsort(-probs, kind="stable")[:top]
        ax.bar(range(len(order)), probs[order], color="tab:blue")
        ax.set_xticks(range(len(order)), [display_token(tokens[i]) for i in order],
                      fontsize=8)
        ax.set_title(f"{label}\n(mass shown {probs[order].sum():.2f})", fontsize=10)
        ax.set_xlabel("next token")
    axes[0][0].set_ylabel("probability")
    fig.suptitle(title)
    return fig


def histogram_plot(
    samples: Mapping[str, Any],
    *,
    title: str,
    xlabel: str,
    bins: int = 60,
    value_range: tuple[float, float] | None = None,
) -> Figure:
    """Overlaid density histograms of several named samples (same bins for all; each
    sample's density integrates to 1)."""
    arrays = _samples(samples)
    values = np.concatenate(list(arrays.values()))
    names = np.repeat(list(arrays), [a.size for a in arrays.values()])
    fig, ax = plt.subplots(layout="constrained", figsize=(6.4, 3.6))
    sns.histplot(x=values, hue=names, bins=bins, binrange=value_range, stat="density",
                 common_norm=False, element="step", alpha=0.45, ax=ax)
    ax.set(title=title, xlabel=xlabel, ylabel="density")
    return fig
