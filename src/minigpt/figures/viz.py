"""The static figures the chapters show about attention and positions: attention
heatmaps, positional encodings (heatmap and curves), similarity matrices and the distance
bars of heads (the plots of numbers are `plots`'s, the architecture diagram `diagram`'s).

Heatmaps and grouped bars are drawn by seaborn, curves by matplotlib, always on axes made
with pyplot (a notebook shows a figure with `plt.show()`; nothing here calls it); every
function returns the `Figure`, which tests inspect. seaborn's theme is never set: figures
keep matplotlib's style, whose opaque white background reads the same in the site's light
and dark modes. The data a reader passes is checked before anything is drawn (a wrong
rank, a token list of the wrong length or weights outside [0, 1] raise a `ValueError`
saying what was expected). Colour maps follow the data: sequential with limits fixed to
[0, 1] for attention weights, diverging and centred at 0 for signed values. The
interactive figures are in `charts`; the measures of what heads attend to are in
`attention`.

Shapes use the book's notation: B batch, H heads, L layers, T positions, D model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

SEQUENTIAL_CMAP = "viridis"  # weights in [0, 1]: dark = 0, bright = 1
DIVERGING_CMAP = "RdBu_r"  # signed values: blue < 0 < red, white at 0
_VISIBLE = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_WEIGHT_TOLERANCE = 1e-6  # float rounding of a softmax, not a licence to clamp


def display_token(token: str) -> str:
    """How a token is written on an axis: whitespace made visible (' ' -> '␣').

    Multi-character tokens (BPE) have each whitespace character replaced (newline ->
    '\\n'); an empty token is shown as '∅'.
    """
    if token == "":
        return "∅"
    return "".join(_VISIBLE.get(c, c) for c in token)


# ------------------------------------------------------------------ checks of the input

def as_float64(values: Any) -> np.ndarray:
    """A float64 NumPy copy of a tensor or array-like."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


def _check_weights(weights: Any) -> np.ndarray:
    """Attention weights as a (B, H, T, T) array; (H, T, T) and (T, T) gain leading axes."""
    array = as_float64(weights)
    if not 2 <= array.ndim <= 4 or array.shape[-1] != array.shape[-2] or 0 in array.shape:
        raise ValueError(f"weights must have shape (B, H, T, T), (H, T, T) or (T, T), "
                         f"queries x keys; got shape {array.shape}")
    low, high = float(array.min()), float(array.max())
    if low < -_WEIGHT_TOLERANCE or high > 1 + _WEIGHT_TOLERANCE:
        raise ValueError(f"weights must lie in [0, 1] (they are probabilities), found values "
                         f"in [{low:.4g}, {high:.4g}]; pass softmax outputs, not raw scores")
    while array.ndim < 4:
        array = array[None]
    return array


def _token_rows(tokens: Any, batch: int, length: int) -> list[list[str]]:
    """One list of T display strings per batch row, from shared or per-row tokens."""
    if isinstance(tokens, str):
        tokens = list(tokens)  # a string is its characters: handy for character models
    if all(isinstance(t, str) for t in tokens):
        rows = [list(tokens)] * batch
    else:  # one list per batch row
        if len(tokens) != batch:
            raise ValueError(f"got {len(tokens)} token lists for a batch of B={batch}; pass "
                             f"one list per batch row, or one list shared by all rows")
        rows = [list(t) for t in tokens]
    for b, row in enumerate(rows):
        if len(row) != length:
            raise ValueError(f"got {len(row)} tokens for batch row {b}, but the weights have "
                             f"T={length} positions; pass exactly one token per position")
    return [[display_token(t) for t in row] for row in rows]


def _titles(titles: Sequence[str] | None, default: list[str], count: str) -> list[str]:
    """The panel titles given (exactly one per panel) or the default ones."""
    if titles is None:
        return default
    if isinstance(titles, str) or len(titles) != len(default):
        raise ValueError(f"titles must be a sequence of {count} strings, got {titles!r}")
    return list(titles)


def _head_titles(titles: Sequence[str] | None, batch: int, heads: int,
                 row_name: str) -> list[str]:
    default = [f"{row_name} {b}, head {h}" if batch > 1 else f"head {h}"
               for b in range(batch) for h in range(heads)]
    return _titles(titles, default, f"B*H = {batch * heads} (row-major)")


def _encoding(encoding: Any) -> np.ndarray:
    array = as_float64(encoding)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"encoding must have shape (T, D), got {array.shape}")
    return array


def _line_grid(dims: Sequence[int], width: int, num_positions: int, total: int,
               ncols: int | None) -> tuple[int, int]:
    """Checks `encoding_lines`' arguments; (rows, columns) of its panels."""
    for d in dims:
        if not 0 <= d < width:
            raise ValueError(f"dimension {d!r} is out of range: dims must be integers in "
                             f"[0, {width})")
    if not 1 <= num_positions <= total:
        raise ValueError(f"num_positions must lie in [1, {total}] (the encoding has "
                         f"T={total} rows), got {num_positions}")
    ncols = min(len(dims) if ncols is None else ncols, len(dims))
    return -(-len(dims) // ncols), ncols


def _square_matrices(matrices: Any) -> list[np.ndarray]:
    """One (N, N) matrix, a (K, N, N) stack or a sequence of K matrices, as K arrays."""
    if isinstance(matrices, list | tuple):
        arrays = [as_float64(m) for m in matrices]
    else:
        stacked = as_float64(matrices)
        arrays = [stacked] if stacked.ndim == 2 else list(stacked)
    if not arrays or any(a.ndim != 2 or a.shape[0] != a.shape[1] or 0 in a.shape
                         for a in arrays):
        raise ValueError(f"matrices must be square (N, N), one, a (K, N, N) stack or a "
                         f"sequence; got shapes {[a.shape for a in arrays]}")
    return arrays


def _distances(distances: Any) -> np.ndarray:
    """Mean attention distances as (L, H); (H,) is one layer."""
    array = as_float64(distances)
    array = array[None] if array.ndim == 1 else array
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"distances must have shape (L, H) or (H,), got {array.shape}")
    return array


# ---------------------------------------------------------------------- drawing helpers

def _panels(nrows: int, ncols: int, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    """A grid of axes for heatmaps, laid out by `_colorbar` once they are drawn."""
    return plt.subplots(nrows, ncols, squeeze=False, figsize=figsize)


def _heatmaps(axes: Any, matrices: Any, cmap: str, limits: tuple[float, float], *,
              labels: Sequence[list[str]] | None = None, cell: float = 0.25,
              annotate: bool = False, square: bool = True) -> None:
    """seaborn heatmaps of matrices[r][c] on axes[r, c], without colour bars, for cells
    about `cell` inches wide. Rows and columns are named by labels[r] (tokens) or by a
    few round indices; `annotate` writes each value in its cell.

    seaborn draws the whole figure after each heatmap (to see whether tick labels
    overlap), so ticks and layout wait until every panel is drawn: a 4 x 4 grid of
    T = 64 then takes 6 s, against 7.5 s laid out and 15 s labelled as drawn."""
    points = 72 * cell
    annot = {"annot": annotate, "fmt": ".2f",
             "annot_kws": {"fontsize": float(np.clip(0.3 * points, 3.0, 9.0))}}
    for (r, c), ax in np.ndenumerate(axes):
        sns.heatmap(matrices[r][c], ax=ax, cmap=cmap, vmin=limits[0], vmax=limits[1],
                    cbar=False, square=square, xticklabels=False, yticklabels=False,
                    **annot)
    fontsize = float(np.clip(0.8 * points, 3.0, 10.0))  # 80% of a cell, 3 to 10 points
    for (r, c), ax in np.ndenumerate(axes):
        _label_cells(ax, np.shape(matrices[r][c]), None if labels is None else labels[r],
                     fontsize)


def _label_cells(ax: Axes, shape: tuple[int, ...], labels: list[str] | None,
                 fontsize: float) -> None:
    """Ticks at cell centres (cell k spans [k, k + 1)): one per token, rotated on the x
    axis, or without tokens a few round indices."""
    for axis, n in ((ax.yaxis, shape[0]), (ax.xaxis, shape[1])):
        if labels is not None:
            axis.set_ticks(np.arange(n) + 0.5, labels, fontsize=fontsize)
        else:
            ticks = np.asarray(MaxNLocator(8, steps=[1, 2, 5, 10]).tick_values(0, n - 1))
            ticks = ticks[ticks <= n - 1]
            axis.set_ticks(ticks + 0.5, [f"{t:.0f}" for t in ticks])
    if labels is not None:
        ax.tick_params(axis="x", labelrotation=90)


def _colorbar(fig: Figure, axes: Any, label: str) -> None:
    """One colour bar for every heatmap in `axes` (they share the colour range)."""
    fig.set_layout_engine("constrained")
    mesh = np.ravel(axes)[0].collections[0]
    shrink = 1.0 if np.size(axes) == 1 else 0.8
    fig.colorbar(mesh, ax=list(np.ravel(axes)), shrink=shrink).set_label(label)


# ------------------------------------------------------------------------------ figures

def attention_heatmap(
    weights: Any,
    tokens: Any,
    *,
    titles: Sequence[str] | None = None,
    title: str = "Attention weights",
    row_name: str = "batch",
    panel_size: float = 3.0,
    cmap: str = SEQUENTIAL_CMAP,
    annotate: bool = False,
) -> Figure:
    """Heatmaps of attention weights, one panel per (row, head): queries down, keys
    across.

    Args:
        weights: (B, H, T, T), or (H, T, T) / (T, T) for one row / one head; entry
            [b, h, i, j] is how much query i attends to key j. Values in [0, 1].
        tokens: the T tokens (shared by every row; a str counts as its characters),
            or B lists of T tokens. They label both axes, whitespace made visible.
        titles: B * H panel titles in row-major order (default: "head h", prefixed
            by "<row_name> b" when B > 1).
        title: the figure's title.
        row_name: what the rows are ("batch", or "layer" for an (L, H, T, T) stack).
        panel_size: inches per panel side.
        cmap: a sequential colour map; the colour range is fixed to [0, 1].
        annotate: write each weight in its cell (two decimals; for small T).

    Returns: the Figure, with B x H panels laid out as B rows and H columns and one
    shared colour bar.
    """
    array = _check_weights(weights)
    batch, heads, length, _ = array.shape
    rows = _token_rows(tokens, batch, length)
    titles = _head_titles(titles, batch, heads, row_name)
    fig, axes = _panels(batch, heads,
                        (panel_size * heads + 1.2, panel_size * batch + 0.6))
    _heatmaps(axes, array, cmap, (0.0, 1.0), labels=rows, cell=panel_size / length,
              annotate=annotate)
    for (b, h), ax in np.ndenumerate(axes):
        ax.set(xlabel="key (attended to)", ylabel="query (attending)")
        ax.set_title(titles[b * heads + h], fontsize=10)
    _colorbar(fig, axes, "attention weight")
    fig.suptitle(title)
    return fig


def positional_heatmap(
    encoding: Any,
    *,
    title: str = "Positional encoding",
    cmap: str = DIVERGING_CMAP,
) -> Figure:
    """A (T, D) encoding matrix as an image: positions across, dimensions down.

    The colour map is diverging and centred at 0 (limits +-max|P|), since entries are
    signed.
    """
    array = _encoding(encoding)
    limit = float(np.abs(array).max()) or 1.0
    num_positions, width = array.shape
    fig, axes = _panels(1, 1, (min(12.0, 2.0 + num_positions / 8), min(8.0, 2 + width / 8)))
    _heatmaps(axes, [[array.T]], cmap, (-limit, limit), square=False)
    axes[0, 0].set(xlabel="position p", ylabel="dimension", title=title)
    _colorbar(fig, axes, "value")
    return fig


def encoding_lines(
    encoding: Any,
    dims: Sequence[int],
    *,
    num_positions: int = 16,
    ncols: int | None = None,
    title: str = "Single dimensions of the positional encoding",
) -> Figure:
    """One panel per dimension d: P[p, d] against p for the first `num_positions` positions.

    Args:
        encoding: (T, D).
        dims: the dimensions to draw, each in [0, D).
        num_positions: how many positions (from 0) to draw; at most T.
        ncols: panels per row (default: all in one row).
    """
    array = _encoding(encoding)
    total, width = array.shape
    nrows, ncols = _line_grid(dims, width, num_positions, total, ncols)
    positions = np.arange(num_positions)
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, sharey=True, layout="constrained",
                             figsize=(3.2 * ncols, 2.6 * nrows + 0.3))
    for ax in axes.ravel()[len(dims):]:
        ax.remove()  # a last row that is not full
    for ax, d in zip(axes.ravel(), dims, strict=False):
        ax.plot(positions, array[:num_positions, d], marker="o", markersize=3)
        ax.axhline(0.0, color="0.7", linewidth=0.8)
        ax.set(title=f"dimension {d}", xlabel="position p", ylabel="value")
    fig.suptitle(title)
    return fig


def cosine_similarity_matrix(vectors: Any) -> torch.Tensor:
    """Pairwise cosine similarities of N vectors: (N, D) -> (N, N), entries in [-1, 1].

    A zero vector has no direction, so it is refused rather than given similarity 0.
    """
    x = torch.from_numpy(as_float64(vectors))  # float64, finite
    if x.dim() != 2 or 0 in x.shape:
        raise ValueError(f"vectors must have shape (N, D), got {tuple(x.shape)}")
    norms = x.norm(dim=1, keepdim=True)
    if bool((norms == 0).any()):
        zero = int(torch.nonzero(norms[:, 0] == 0)[0])
        raise ValueError(f"vector {zero} is zero; cosine similarity is undefined for it")
    unit = x / norms
    similarity: torch.Tensor = (unit @ unit.T).clamp(-1.0, 1.0)
    return similarity  # rounding can push |cos| a hair above 1


def similarity_heatmap(
    matrices: Any,
    *,
    titles: Sequence[str] | None = None,
    title: str = "Cosine similarity",
    axis_label: str = "position",
    limit: float | None = None,
    cmap: str = DIVERGING_CMAP,
) -> Figure:
    """Square similarity matrices side by side, with one shared diverging colour bar at 0.

    Args:
        matrices: one (N, N) matrix, or a sequence / (K, N, N) stack of them (sizes may
            differ between panels in a sequence).
        titles: one title per panel.
        axis_label: what rows and columns index (both axes get it).
        limit: the colour range is [-limit, limit]; default max |entry| over all panels.
    """
    arrays = _square_matrices(matrices)
    default = [f"matrix {k}" for k in range(len(arrays))] if len(arrays) > 1 else [title]
    titles = _titles(titles, default, str(len(arrays)))
    if limit is None:
        limit = max(float(np.abs(a).max()) for a in arrays) or 1.0
    fig, axes = _panels(1, len(arrays), (4.0 * len(arrays) + 1.0, 4.2))
    _heatmaps(axes, [arrays], cmap, (-limit, limit))
    for ax, panel_title in zip(axes[0], titles, strict=True):
        ax.set(xlabel=axis_label, ylabel=axis_label)
        ax.set_title(panel_title, fontsize=10)
    _colorbar(fig, axes, "similarity")
    if len(arrays) > 1:
        fig.suptitle(title)
    return fig


def attention_distance_bars(
    distances: Any,
    *,
    title: str = "Mean attention distance per head",
    reference: float | None = None,
    reference_label: str = "uniform attention",
) -> Figure:
    """Grouped bars of mean attention distance: one group per layer, one bar per head.

    Args:
        distances: (L, H) or (H,), e.g. from `attention.mean_attention_distance`.
        reference: draw a dashed horizontal line at this distance (e.g. (T - 1) / 4, the
            distance of a head that spreads evenly over a causal context of T positions).
    """
    array = _distances(distances)
    layers, heads = array.shape
    fig, ax = plt.subplots(layout="constrained", figsize=(max(5.0, 1.6 * layers + 2), 3.6))
    sns.barplot(x=np.repeat([f"layer {ell}" for ell in range(layers)], heads),
                y=array.ravel(), hue=np.tile([f"head {h}" for h in range(heads)], layers),
                errorbar=None, saturation=1.0, ax=ax)
    if reference is not None:
        ax.axhline(reference, color="0.3", linestyle="--", linewidth=1,
                   label=reference_label)
    ax.set(title=title, xlabel="layer", ylabel="mean distance (positions)")
    ax.legend(ncols=min(heads + (reference is not None), 5), fontsize=8)
    return fig
