"""The interactive figures: the HTML they write, the data and controls their specifications
carry, and what they refuse."""

import json
import re

import pytest
import torch

from minigpt.figures import charts
from minigpt.nn import sinusoidal_encoding


def _weights(batch: int, heads: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(batch, heads, length, length, generator=generator), dim=-1)


def _chart_spec(chart: charts.InteractiveChart) -> dict:
    """The specification a chart's HTML carries, read back from the HTML."""
    match = re.search(r'<script type="application/json" class="minigpt-chart-spec">(.*?)'
                      r"</script>", chart._repr_html_(), re.DOTALL)
    assert match
    return json.loads(match.group(1))


def _params(spec: dict) -> dict:
    return {p["name"]: p for p in spec.get("params", [])}


def test_interactive_chart_html_is_stable_and_self_contained():
    spec = {"$schema": "https://vega.github.io/schema/vega-lite/v6.json",
            "data": {"values": [{"a": "</script><b>&"}]}, "mark": "point"}
    first = charts.interactive_chart(spec, "demo-1", description="A  point,\n described.")
    second = charts.interactive_chart(dict(spec), "demo-1", description="A point, described.")
    page = first._repr_html_()
    assert page == second._repr_html_()  # no random id, no timestamp
    assert page.startswith('<div class="minigpt-chart" id="minigpt-chart-demo-1" role="figure" '
                           'aria-describedby="minigpt-chart-demo-1-alt"')
    assert '<p class="minigpt-chart-alt" id="minigpt-chart-demo-1-alt">A point, described.</p>' \
        in page
    # The JSON cannot close its <script> element early; it reads back as the same data.
    assert page.count("</script>") == 1 and "<b>" not in page
    assert _chart_spec(first) == spec
    assert repr(first) == "Interactive chart 'demo-1': A point, described."


def test_interactive_chart_refuses_bad_ids_and_empty_descriptions():
    spec = {"$schema": "https://vega.github.io/schema/vega-lite/v6.json", "mark": "point"}
    for bad in ("Demo", "1demo", "demo chart", "demo_chart", ""):
        with pytest.raises(ValueError, match="chart_id"):
            charts.interactive_chart(spec, bad, description="x")
    with pytest.raises(ValueError, match="description"):
        charts.interactive_chart(spec, "demo", description="  ")
    with pytest.raises(ValueError, match=r"\$schema"):
        charts.interactive_chart({"mark": "point"}, "demo", description="x")


def test_interactive_chart_is_an_html_output_with_a_text_repr():
    from IPython.core.formatters import DisplayFormatter

    spec = {"$schema": "https://vega.github.io/schema/vega-lite/v6.json", "mark": "point"}
    chart = charts.interactive_chart(spec, "demo", description="A point.")
    data, _ = DisplayFormatter().format(chart)
    assert set(data) == {"text/html", "text/plain"}
    assert data["text/plain"] == "Interactive chart 'demo': A point."


def test_sampling_explorer_carries_rounded_logits_and_labelled_sliders():
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    chart = charts.sampling_explorer(logits, ["to be or", "not to "], list("abcd "))
    spec = _chart_spec(chart)
    rows = spec["datasets"]["logits"]
    assert len(rows) == 10 and rows[4]["token"] == "␣"
    assert rows[1]["z"] == round(logits[0, 1].item(), 4)
    params = _params(spec)
    assert {"prompt", "temperature", "top_k", "top_p"} <= set(params)
    assert params["top_k"]["bind"]["max"] == 5 and params["top_k"]["value"] == 5
    assert all(params[n]["bind"].get("name") for n in ("temperature", "top_k", "top_p"))
    with pytest.raises(ValueError, match="shape"):
        charts.sampling_explorer(logits, ["one prompt"], list("abcde"))


def test_attention_explorer_keeps_the_causal_half_in_thousandths():
    maps = [_weights(1, 2, 4, seed=s) for s in range(3)]
    chart = charts.attention_explorer(maps, "abcd")
    spec = _chart_spec(chart)
    rows = spec["datasets"][spec["data"]["name"]]
    assert len(rows) == 3 * 2 * 4
    row = next(r for r in rows if (r["layer"], r["head"], r["query"]) == (2, 1, 3))
    assert row["w"] == [round(1000 * w) for w in maps[2][0, 1, 3].tolist()]
    assert [len(r["w"]) for r in rows[:4]] == [1, 2, 3, 4]
    params = _params(spec)
    assert params["tokens"]["value"] == list("abcd")
    assert params["layer"]["bind"]["options"] == [0, 1, 2]
    assert params["head"]["bind"]["labels"] == ["head 0", "head 1"]
    with pytest.raises(ValueError, match="T=4"):
        charts.attention_explorer(maps, "abc")


def test_rotation_explorer_carries_the_encoding_of_the_pairs_shown():
    P = sinusoidal_encoding(16, 8)
    spec = _chart_spec(charts.rotation_explorer(P, [0, 3], max_offset=6))
    rows = spec["datasets"][spec["data"]["name"]]
    assert len(rows) == 2 * 16
    row = next(r for r in rows if (r["pair"], r["pos"]) == (3, 11))
    assert row["sin"] == pytest.approx(P[11, 6].item(), abs=1e-4)
    assert row["cos"] == pytest.approx(P[11, 7].item(), abs=1e-4)
    params = _params(spec)
    assert params["offset"]["bind"]["max"] == 6 and params["position"]["bind"]["max"] == 9
    for bad in ([], [4]):
        with pytest.raises(ValueError, match="pairs"):
            charts.rotation_explorer(P, bad)


def test_training_explorer_thins_the_steps_and_keeps_every_evaluation():
    steps = list(range(20))
    history = {"step": steps, "loss": [3 - s / 10 for s in steps],
               "lr": [1e-3 * (s + 1) / 20 for s in steps], "eval_step": [0, 10, 20],
               "train_loss": [3.0, 2.0, 1.5], "val_loss": [3.1, 2.2, 1.7]}
    spec = _chart_spec(charts.training_explorer(history, every=5))
    assert [r["step"] for r in spec["datasets"]["steps"]] == [0, 5, 10, 15]
    assert spec["datasets"]["steps"][1]["lr"] == pytest.approx(3e-4)
    assert _params(spec)["hover"]["select"]["nearest"] is True
    with pytest.raises(ValueError, match="lr"):
        charts.training_explorer({k: v for k, v in history.items() if k != "lr"})
