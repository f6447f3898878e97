"""The interactive figures: Vega-Lite specifications (built with Altair) that the site draws.

A reader of the site cannot run a cell, but can move a slider: these figures are Vega-Lite
specifications that the page's own vega draws, computing what the sliders change in the
browser. `interactive_chart` writes one as HTML: a container with a stable id, a text
alternative and the specification as JSON; the site's script (_ext/static/minigpt-charts.js)
draws every such container. Values are rounded so that a notebook's stored output is the same
on every run. The explorers: `sampling_explorer` (temperature, top-k, top-p),
`attention_explorer` (one head's weights at a time), `rotation_explorer` (the sinusoidal
encoding's rotations) and `training_explorer` (a run's learning rate and losses). Altair is
imported when a chart is built.

Shapes use the book's notation: L layers, H heads, T positions, D model width, V vocabulary
size, P prompts.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from minigpt.figures.viz import as_float64, display_token

_CHART_ID = re.compile(r"[a-z][a-z0-9-]*")
_JSON_IN_HTML = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


class InteractiveChart:
    """A Vega-Lite chart shown as HTML (`_repr_html_`), described in text (`repr`)."""

    def __init__(self, spec: dict[str, Any], chart_id: str, description: str) -> None:
        self.spec, self.chart_id, self.description = spec, chart_id, description

    @property
    def element_id(self) -> str:
        return f"minigpt-chart-{self.chart_id}"

    def to_json(self) -> str:
        """The specification as compact JSON that is safe inside a <script> element."""
        text = json.dumps(self.spec, separators=(",", ":"), sort_keys=True, allow_nan=False)
        return "".join(_JSON_IN_HTML.get(c, c) for c in text)

    def _repr_html_(self) -> str:
        alt_id = f"{self.element_id}-alt"
        return (f'<div class="minigpt-chart" id="{self.element_id}" role="figure" '
                f'aria-describedby="{alt_id}" data-chart-state="waiting">\n'
                f'<p class="minigpt-chart-alt" id="{alt_id}">{html.escape(self.description)}'
                f'</p>\n<div class="minigpt-chart-view"></div>\n'
                f'<script type="application/json" class="minigpt-chart-spec">{self.to_json()}'
                f"</script>\n</div>")

    def __repr__(self) -> str:
        return f"Interactive chart {self.chart_id!r}: {self.description}"


def interactive_chart(chart: Any, chart_id: str, *, description: str) -> InteractiveChart:
    """A Vega-Lite chart (an Altair chart or a specification dict) as a notebook output.

    Args:
        chart: an Altair chart, or a Vega-Lite specification as a dict.
        chart_id: the figure's name, unique on its page: lowercase letters, digits and
            hyphens (the container's id is ``minigpt-chart-<chart_id>``).
        description: the text alternative: what the chart shows and how to use it.
    """
    if not isinstance(chart_id, str) or not _CHART_ID.fullmatch(chart_id):
        raise ValueError(f"chart_id must be lowercase letters, digits and hyphens, starting "
                         f"with a letter, got {chart_id!r}")
    if not isinstance(description, str) or not description.strip():
        raise ValueError("description must be a non-empty text alternative of the chart")
    spec = dict(chart) if isinstance(chart, Mapping) else chart.to_dict()
    if "$schema" not in spec:
        raise ValueError("chart must be an Altair chart or a Vega-Lite specification "
                         "with a $schema")
    return InteractiveChart(spec, chart_id, " ".join(description.split()))


def _rounded(values: np.ndarray, digits: int) -> list[Any]:
    """Nested lists of floats rounded to ``digits`` decimals (stable, compact JSON)."""
    return np.round(values, digits).tolist()  # type: ignore[no-any-return]


def _sampling_sliders(names: list[str], V: int) -> list[Any]:
    """The selector of the prompt and the sliders of τ, k and ρ."""
    import altair as alt

    prompt = alt.param(name="prompt", value=names[0],
                       bind=alt.binding_select(options=names, name="prompt:"))
    tau = alt.param(name="temperature", value=1.0,
                    bind=alt.binding_range(min=0.05, max=3, step=0.05, name="temperature τ:"))
    top_k = alt.param(name="top_k", value=V,
                      bind=alt.binding_range(min=1, max=V, step=1, name="top-k:"))
    top_p = alt.param(name="top_p", value=1.0,
                      bind=alt.binding_range(min=0.05, max=1, step=0.01, name="top-p ρ:"))
    return [prompt, tau, top_k, top_p]


def _reshaped_distribution() -> Any:
    """The chosen prompt's rows with p_tau (tempered), kept (top-k, then top-p) and q."""
    import altair as alt

    by_logit: list[Any] = [alt.SortField("z", order="descending")]
    return (alt.Chart(alt.NamedData(name="logits"))
            .transform_filter("datum.prompt == prompt")
            .transform_calculate(zt="datum.z / temperature")
            .transform_joinaggregate(zmax="max(zt)")
            .transform_calculate(e="exp(datum.zt - datum.zmax)")
            .transform_joinaggregate(esum="sum(e)")
            .transform_calculate(p_tau="datum.e / datum.esum")
            .transform_window(rank="rank()", sort=by_logit)
            .transform_calculate(ek="datum.rank <= top_k ? datum.e : 0")
            .transform_joinaggregate(eksum="sum(ek)")
            .transform_calculate(pk="datum.ek / datum.eksum")
            .transform_window(cum="sum(pk)", sort=by_logit, frame=[None, 0])
            .transform_calculate(kept="datum.ek > 0 && (top_p >= 1 || datum.cum - datum.pk"
                                      " < top_p) ? 1 : 0")
            .transform_calculate(qk="datum.kept ? datum.pk : 0")
            .transform_joinaggregate(qsum="sum(qk)")
            .transform_calculate(q="datum.qk / datum.qsum"))


def _sampling_bars(base: Any, shown: int) -> Any:
    """Grey bars of p_tau behind blue bars of q, for the ``shown`` most likely tokens."""
    import altair as alt

    x = alt.X("token:N", sort=alt.EncodingSortField("z", order="descending"),
              title=f"the {shown} most likely next tokens", axis=alt.Axis(labelAngle=0))
    drawn = base.transform_filter(f"datum.rank <= {shown}")
    before = drawn.mark_bar(color="#d0d0d0", width={"band": 0.9}).encode(
        x=x, y=alt.Y("p_tau:Q", title="probability", scale=alt.Scale(domain=[0, 1])))
    after = drawn.mark_bar(color="#3b6fb6", width={"band": 0.5}).encode(
        x=x, y="q:Q", tooltip=[alt.Tooltip("token:N"), alt.Tooltip("p_tau:Q", format=".3f",
                                                                   title="p_tau"),
                               alt.Tooltip("q:Q", format=".3f", title="sampled from")])
    return alt.layer(before, after.properties(name="kept")).properties(width=620, height=220)


def _sampling_summary(base: Any, V: int) -> Any:
    """The line above the bars: tokens kept, the mass of p_tau they hold, the entropy."""
    return (base.transform_calculate(h="datum.q > 0 ? -datum.q * log(datum.q) : 0",
                                     mass="datum.kept ? datum.p_tau : 0")
            .transform_aggregate(entropy="sum(h)", kept_mass="sum(mass)",
                                 kept_tokens="sum(kept)")
            .transform_calculate(text=f"'keeps ' + datum.kept_tokens + ' of {V} tokens, "
                                      "holding ' + format(datum.kept_mass, '.3f') + ' of "
                                      "p_tau; entropy ' + format(datum.entropy, '.3f') + "
                                      "' nats'")
            .mark_text(align="left", x=0, fontSize=13).encode(text="text:N")
            .properties(name="summary", width=620, height=20))


def sampling_explorer(logits: Any, prompts: Sequence[str], tokens: Sequence[str], *,
                      shown: int = 20) -> InteractiveChart:
    """The next-token distributions after ``prompts``, reshaped by sliders in the browser.

    The page computes what `decoding.next_token_distribution` computes: softmax(z / tau),
    top-k (ties with the k-th logit kept), then the nucleus of the top-k distribution, and
    draws, for the ``shown`` most likely tokens, the tempered distribution and what is kept,
    with the entropy, the number of tokens kept and the mass of p_tau they hold.

    Args:
        logits: (P, V), one row per prompt.
        prompts: the P prompts (their last 12 characters name them in the selector).
        tokens: the V tokens, in id order.
        shown: how many of the most likely tokens are drawn.
    """
    import altair as alt

    z = as_float64(logits)
    if z.ndim != 2 or z.shape[0] != len(prompts) or z.shape[1] != len(tokens):
        raise ValueError(f"logits must have shape (P, V) = ({len(prompts)}, {len(tokens)}), "
                         f"got {z.shape}")
    names = ["…" + display_token(p[-12:]) for p in prompts]
    rows = [{"prompt": name, "token": display_token(t), "z": v}
            for name, row in zip(names, _rounded(z, 4), strict=True)
            for t, v in zip(tokens, row, strict=True)]
    sliders = _sampling_sliders(names, len(tokens))
    base = _reshaped_distribution()
    bars = _sampling_bars(base, shown)
    chart = (alt.vconcat(_sampling_summary(base, len(tokens)), bars)
             .add_params(*sliders)
             .properties(datasets={"logits": rows},
                         description="Next-token distribution with sampling sliders"))
    return interactive_chart(
        chart, "sampling-explorer",
        description=f"Bar chart of the book model's next-character distribution after a "
                    f"prompt (selector: {', '.join(names)}), the {shown} most likely "
                    f"characters: grey bars are softmax(z / τ), blue bars what sampling draws "
                    f"from after top-k and top-p. Sliders set τ, k and ρ; a line above reports "
                    f"the tokens kept, their mass and the entropy.")


def attention_explorer(maps: Sequence[Any], tokens: Sequence[str]) -> InteractiveChart:
    """One head's attention weights at a time, chosen by layer and head; hover a cell to
    read its query, key and weight.

    Args:
        maps: L tensors of shape (1, H, T, T) (`GPT.forward_with_attention`) or (H, T, T).
        tokens: the T tokens of the sequence.
    """
    import altair as alt

    layers = [w[0] if w.ndim == 4 else w for w in map(as_float64, maps)]  # (H, T, T)
    shapes = sorted({w.shape for w in layers})
    if len(shapes) != 1 or len(shapes[0]) != 3 or shapes[0][1] != shapes[0][2]:
        raise ValueError(f"maps must be one (1, H, T, T) or (H, T, T) tensor per layer, all of "
                         f"one shape; got shapes {shapes}")
    heads, length, _ = shapes[0]
    if len(tokens) != length:
        raise ValueError(f"got {len(tokens)} tokens, but the maps have T={length} positions; "
                         f"pass exactly one token per position")
    shown = [display_token(t) for t in tokens]
    # Weights in thousandths, the causal half only: compact and stable.
    rows = [{"layer": li, "head": h, "query": q,
             "w": np.rint(w[h, q, :q + 1] * 1000).astype(int).tolist()}
            for li, w in enumerate(layers) for h in range(heads) for q in range(length)]
    layer = alt.param(name="layer", value=0, bind=alt.binding_select(
        options=list(range(len(layers))), labels=[f"layer {i}" for i in range(len(layers))],
        name="layer:"))
    head = alt.param(name="head", value=0, bind=alt.binding_select(
        options=list(range(heads)), labels=[f"head {h}" for h in range(heads)], name="head:"))
    names = alt.param(name="tokens", value=shown)
    hover = alt.selection_point(name="cell", on="pointerover", clear="pointerout",
                                fields=["query", "key"], empty=False)
    label = "tokens[datum.value]"
    chart = (alt.Chart(alt.InlineData(values=rows))
             .transform_filter("datum.layer == layer && datum.head == head")
             .transform_flatten(["w"], as_=["thousandths"])
             .transform_window(index="row_number()", groupby=["query"])
             .transform_calculate(key="datum.index - 1", weight="datum.thousandths / 1000",
                                  query_token="tokens[datum.query]",
                                  key_token="tokens[datum.index - 1]")
             .mark_rect()
             .encode(x=alt.X("key:O", title="key (attended to)",
                             axis=alt.Axis(labelExpr=label, labelAngle=0, orient="top")),
                     y=alt.Y("query:O", title="query (attending)",
                             axis=alt.Axis(labelExpr=label)),
                     color=alt.Color("weight:Q", scale=alt.Scale(scheme="viridis",
                                                                 domain=[0, 1]),
                                     title="weight"),
                     stroke=alt.condition(hover, alt.value("#e4572e"), alt.value(None)),
                     strokeWidth=alt.condition(hover, alt.value(2), alt.value(0)),
                     tooltip=[alt.Tooltip("query_token:N", title="query"),
                              alt.Tooltip("query:O", title="query position"),
                              alt.Tooltip("key_token:N", title="key"),
                              alt.Tooltip("key:O", title="key position"),
                              alt.Tooltip("weight:Q", format=".3f")])
             .add_params(layer, head, names, hover)
             .properties(name="cells", width=14 * length, height=14 * length,
                         description="Attention weights of one head"))
    return interactive_chart(
        chart, "attention-explorer",
        description=f"Heatmap of the attention weights of one head of the book model on "
                    f"{length} held-out characters: rows are queries, columns keys, "
                    f"brighter is more weight, the upper triangle is masked. Selectors choose "
                    f"the layer (0 to {len(layers) - 1}) and the head (0 to {heads - 1}); "
                    f"hovering a cell shows its query, key and weight.")


def induction_explorer(steps: Sequence[int], scores: Any, patterns: Any,
                       tokens: Sequence[str], head: tuple[int, int]) -> InteractiveChart:
    """A model's heads as it trains, one snapshot at a time chosen by a slider: every head's
    induction score as a layer x head grid, beside one head's attention on a repeated row.

    Args:
        steps: the S snapshots' training steps.
        scores: (S, L, H) induction scores (`minigpt.interp.heads.head_scores`).
        patterns: (S, T, T) the attention weights of ``head`` on the row at each snapshot.
        tokens: the T tokens of the row.
        head: (layer, head) whose attention is shown.
    """
    import altair as alt

    grid, maps = as_float64(scores), as_float64(patterns)
    if grid.ndim != 3 or maps.ndim != 3 or maps.shape[1] != maps.shape[2] or not (
            len(steps) == len(grid) == len(maps)):
        raise ValueError(f"need S steps, (S, L, H) scores and (S, T, T) patterns; got "
                         f"{len(steps)} steps, scores {grid.shape}, patterns {maps.shape}")
    length = maps.shape[1]
    if len(tokens) != length:
        raise ValueError(f"got {len(tokens)} tokens for patterns of T={length} positions")
    shown = [display_token(t) for t in tokens]
    cells = [{"snap": i, "layer": f"layer {li}", "head": f"head {h}",
              "score": round(float(grid[i, li, h]), 2)}
             for i in range(len(steps)) for li in range(grid.shape[1])
             for h in range(grid.shape[2])]
    # Weights in thousandths, the causal half only: compact and stable.
    rows = [{"snap": i, "query": q, "w": np.rint(maps[i, q, :q + 1] * 1000).astype(int).tolist()}
            for i in range(len(steps)) for q in range(length)]
    snap = alt.param(name="snapshot", value=len(steps) - 1, bind=alt.binding_range(
        min=0, max=len(steps) - 1, step=1, name="snapshot:"))
    names = alt.param(name="tokens", value=shown)
    stepped = alt.param(name="steps", value=list(steps))
    heads = (alt.Chart(alt.InlineData(values=cells))
             .transform_filter("datum.snap == snapshot")
             .encode(x=alt.X("head:N", title=None, axis=alt.Axis(labelAngle=0)),
                     y=alt.Y("layer:N", title=None)))
    board = alt.layer(
        heads.mark_rect().encode(color=alt.Color(
            "score:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]), title="score"))
        .properties(name="grid"),
        heads.mark_text(fontSize=13).encode(
            text=alt.Text("score:Q", format=".2f"),
            color=alt.condition("datum.score > 0.5", alt.value("black"), alt.value("white"))),
    ).properties(width=55 * grid.shape[2], height=55 * grid.shape[1],
                 title=alt.TitleParams(
                     alt.ExprRef("'induction scores at step ' + steps[snapshot]")))
    label = "tokens[datum.value]"
    attention = (alt.Chart(alt.InlineData(values=rows))
                 .transform_filter("datum.snap == snapshot")
                 .transform_flatten(["w"], as_=["thousandths"])
                 .transform_window(index="row_number()", groupby=["query"])
                 .transform_calculate(key="datum.index - 1", weight="datum.thousandths / 1000")
                 .mark_rect()
                 .encode(x=alt.X("key:O", title="key", axis=alt.Axis(
                             labelExpr=label, labelAngle=0, orient="top")),
                         y=alt.Y("query:O", title="query", axis=alt.Axis(labelExpr=label)),
                         color=alt.Color("weight:Q", scale=alt.Scale(scheme="viridis",
                                                                     domain=[0, 1]),
                                         legend=None),
                         tooltip=[alt.Tooltip("query:O"), alt.Tooltip("key:O"),
                                  alt.Tooltip("weight:Q", format=".3f")])
                 .properties(name="pattern", width=12 * length, height=12 * length,
                             title=f"attention of layer {head[0]}, head {head[1]}"))
    chart = alt.hconcat(board, attention).add_params(snap, names, stepped)
    return interactive_chart(
        chart, "induction-explorer",
        description=f"Left, a grid of the induction scores of the {grid.shape[1]} x "
                    f"{grid.shape[2]} heads of a small model; right, the attention weights "
                    f"of layer {head[0]}, head {head[1]} on a held-out stretch written twice "
                    f"(rows are queries, columns keys). A slider picks one of {len(steps)} "
                    f"snapshots, from step {steps[0]} to step {steps[-1]} of training.")


def _rotation_layers(length: int, width: int, base: float) -> list[Any]:
    """One panel's layers: the unit circle, P[p] and its spoke, P[p] rotated by omega_i k
    with its spoke and angle, and the ring around P[p + k]."""
    import altair as alt

    axis: dict[str, Any] = {"scale": alt.Scale(domain=[-1.15, 1.15]), "axis": None,
                            "title": None}
    xy = {"x": alt.X("cos:Q", **axis), "y": alt.Y("sin:Q", **axis)}
    rotated_xy = {"x": alt.X("rot_cos:Q", **axis), "y": alt.Y("rot_sin:Q", **axis)}
    centre = {"x2": alt.datum(0), "y2": alt.datum(0)}
    base_chart = alt.Chart().properties(width=150, height=150)
    # The unit circle, drawn through one point per row of the pair.
    circle = (base_chart.transform_calculate(t=f"2 * PI * datum.pos / {length - 1}")
              .transform_calculate(cos="cos(datum.t)", sin="sin(datum.t)")
              .mark_line(color="#bbbbbb", strokeWidth=1).encode(**xy, order="pos:Q"))
    start = (base_chart.transform_filter("datum.pos == position")
             .transform_calculate(phi=f"pow({base}, -2 * datum.pair / {width}) * offset")
             .transform_calculate(
                 rot_cos="datum.cos * cos(datum.phi) - datum.sin * sin(datum.phi)",
                 rot_sin="datum.sin * cos(datum.phi) + datum.cos * sin(datum.phi)",
                 degrees="(datum.phi * 180 / PI) % 360")
             .transform_calculate(label="'ω k = ' + format(datum.degrees, '.0f') + '°'"))
    origin = start.mark_rule(color="#888888").encode(**xy, **centre)
    spoke = start.mark_rule(color="#e4572e").encode(**rotated_xy, **centre)
    from_p = start.mark_point(filled=True, color="#555555", size=50).encode(**xy)
    target = (base_chart.transform_filter("datum.pos == position + offset")
              .mark_point(color="black", size=220, strokeWidth=1.5)
              .encode(**xy).properties(name="target"))
    rotated = (start.mark_point(filled=True, color="#e4572e", size=70)
               .encode(**rotated_xy, tooltip=[alt.Tooltip("degrees:Q", format=".1f",
                                                          title="angle ω k (degrees)")])
               .properties(name="rotated"))
    angle = start.mark_text(x=4, y=8, align="left", fontSize=11).encode(text="label:N")
    return [circle, origin, spoke, from_p, target, rotated, angle]


def rotation_explorer(encoding: Any, pairs: Sequence[int], *, base: float = 10000.0,
                      max_offset: int | None = None) -> InteractiveChart:
    """Sliders over the position p and the offset k: for each pair i of dimensions, the
    point P[p] of the sinusoidal encoding rotated by the angle omega_i k, which lands on
    P[p + k].

    The page rotates P[p] itself; the ring drawn around the rotated point is P[p + k] as
    `encoding` holds it.

    Args:
        encoding: P, the (T, D) sinusoidal encoding (`nn.sinusoidal_encoding`).
        pairs: the pairs i of dimensions (2i, 2i + 1) to draw, one panel each.
        base: the encoding's base (omega_i = base^(-2i/D)).
        max_offset: the largest k of the slider (default T // 2); p runs to T - 1 - k_max.
    """
    import altair as alt

    P = as_float64(encoding)
    if P.ndim != 2:
        raise ValueError(f"encoding must have shape (T, D), got {P.shape}")
    length, width = P.shape
    if not pairs or any(not 0 <= i < width // 2 for i in pairs):
        raise ValueError(f"pairs must be a non-empty list of pairs in [0, {width // 2}), "
                         f"got {list(pairs)}")
    k_max = length // 2 if max_offset is None else max_offset
    if not 1 <= k_max < length:
        raise ValueError(f"max_offset must lie in [1, {length}), got {k_max}")
    rows = [{"pair": i, "pos": p, "cos": c, "sin": s} for i in pairs
            for p, (s, c) in enumerate(zip(_rounded(P[:, 2 * i], 4),
                                           _rounded(P[:, 2 * i + 1], 4), strict=True))]
    offset = alt.param(name="offset", value=min(5, k_max), bind=alt.binding_range(
        min=0, max=k_max, step=1, name="offset k:"))
    position = alt.param(name="position", value=min(20, length - 1 - k_max),
                         bind=alt.binding_range(min=0, max=length - 1 - k_max, step=1,
                                                name="position p:"))
    header = alt.Header(title=None, labelFontSize=12, labelFontWeight="bold",
                        labelExpr=f"'pair ' + datum.value + ': ω = ' + "
                                  f"format(pow({base}, -2 * datum.value / {width}), '.3g')")
    chart = (alt.layer(*_rotation_layers(length, width, base), data=alt.InlineData(values=rows))
             .facet(facet=alt.Facet("pair:O", header=header), columns=3)
             .add_params(offset, position)
             .properties(description="Rotations of sinusoidal encoding pairs"))
    return interactive_chart(
        chart, "rotation-explorer",
        description=f"For the pairs of dimensions {', '.join(map(str, pairs))} of the "
                    f"sinusoidal encoding (D = {width}), one circle each: the grey point is "
                    f"the pair of position p, the orange point the same pair rotated by the "
                    f"angle ω k (printed in degrees), the black ring the pair of position "
                    f"p + k. Sliders set p and k; the orange point always lands in the ring.")


def _evaluation_lines(evals: list[dict[str, Any]], x: Any) -> Any:
    """The train and validation evaluations, one coloured line each."""
    import altair as alt

    return (alt.Chart(alt.InlineData(values=evals))
            .mark_line(point=True, strokeWidth=2)
            .encode(x=x, y="eval_loss:Q",
                    color=alt.Color("split:N", title="evaluation",
                                    scale=alt.Scale(range=["#1b9e77", "#d95f02"])),
                    tooltip=[alt.Tooltip("step:Q"), alt.Tooltip("split:N"),
                             alt.Tooltip("eval_loss:Q", format=".3f", title="loss")]))


def _step_readout(base: Any, hover: Any) -> Any:
    """The line above the charts: the hovered step, its learning rate and batch loss."""
    return (base.transform_filter(hover)
            .transform_calculate(text="'step ' + datum.step + ': learning rate ' + "
                                      "format(datum.lr, '.3e') + ', batch loss ' + "
                                      "format(datum.loss, '.3f')")
            .mark_text(align="left", x=0, y=10, fontSize=13).encode(text="text:N")
            .properties(name="readout", height=20))


def training_explorer(history: Mapping[str, Sequence[float]], *,
                      every: int = 5) -> InteractiveChart:
    """The learning rate and the losses of a run (`train.History` as a dict); hover to read
    the step, its learning rate and its batch's loss, and the evaluations.

    Args:
        history: a run's history: step, loss, lr, eval_step, train_loss, val_loss.
        every: keep one step in ``every`` (the evaluations are all kept).
    """
    import altair as alt

    missing = {"step", "loss", "lr", "eval_step", "train_loss", "val_loss"} - set(history)
    if missing:
        raise ValueError(f"history lacks {sorted(missing)}; pass a History's fields")
    steps = [{"step": s, "lr": float(f"{lr:.6g}"), "loss": round(loss, 4)}
             for s, lr, loss in list(zip(history["step"], history["lr"], history["loss"],
                                         strict=True))[::every]]
    evals = [{"step": s, "split": split, "eval_loss": round(v, 4)}
             for split in ("train", "val")
             for s, v in zip(history["eval_step"], history[f"{split}_loss"], strict=True)]
    hover = alt.selection_point(name="hover", on="pointerover", nearest=True,
                                fields=["step"], empty=False, clear="pointerout")
    # A fixed domain: the hover rule's empty data would otherwise widen it to infinity.
    x = alt.X("step:Q", title="optimiser step",
              scale=alt.Scale(domain=[0, history["step"][-1] + 1], nice=False))
    base = alt.Chart(alt.NamedData(name="steps")).properties(width=620)
    lr = base.mark_line(color="#3b6fb6").encode(
        x=x, y=alt.Y("lr:Q", title="learning rate", axis=alt.Axis(format=".1e")))
    loss = base.mark_line(color="#c8c8c8", strokeWidth=1).encode(
        x=x, y=alt.Y("loss:Q", title="loss (nats)", scale=alt.Scale(zero=False)))
    tooltip = [alt.Tooltip("step:Q"), alt.Tooltip("lr:Q", format=".3e", title="learning rate"),
               alt.Tooltip("loss:Q", format=".3f", title="batch loss")]
    catcher = base.mark_point(opacity=0, size=30).encode(x=x, y="loss:Q", tooltip=tooltip)
    # Decorative (aria=False): empty until a step is hovered, it would be an unnamed graphic.
    rule = base.mark_rule(color="#e4572e", aria=False).encode(x=x).transform_filter(hover)
    evaluations = _evaluation_lines(evals, x)
    chart = (alt.vconcat(_step_readout(base, hover),
                         alt.layer(lr, rule).properties(height=120),
                         alt.layer(loss, evaluations, rule,
                                   catcher.add_params(hover).properties(name="steps"))
                         .properties(height=220))
             .resolve_scale(color="independent")
             .properties(datasets={"steps": steps},
                         description="Learning rate and losses of a training run"))
    return interactive_chart(
        chart, "training-explorer",
        description=f"Two line charts over the {history['step'][-1] + 1} optimiser steps of "
                    f"the run: the learning rate (warm-up, then cosine decay) and the loss of "
                    f"every {every}th batch, with the train and validation evaluations. "
                    f"Hovering a step shows its learning rate and batch loss.")
