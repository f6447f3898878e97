"""tools/ablate_modern.py: its rows are the modern layout with one change undone each, bad
arguments are refused before anything trains, and the record the modern-GPT chapter prints
(book/data/modern_ablation.json) holds the runs the tool would train now."""

from __future__ import annotations

import json
import re

import pytest
from helpers import ROOT, load_tool

from minigpt import GPTConfig
from minigpt.config import MODERN_LAYOUT
from minigpt.data import shakespeare_text
from minigpt.sweep import paired_difference
from minigpt.tokenizer import CharTokenizer

ablate = load_tool("ablate_modern")
RECORD = ROOT / "book" / "data" / "modern_ablation.json"


def test_each_row_undoes_part_of_the_modern_layout() -> None:
    assert ablate.ROWS["modern recipe"] == {}
    assert set(ablate.SIMPLIFICATIONS) < set(ablate.ROWS)
    for row, undo in ablate.ROWS.items():
        assert set(undo) <= set(MODERN_LAYOUT), row
        assert all(MODERN_LAYOUT[k] != v for k, v in undo.items()), row


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0"], "--seeds needs at least two distinct seeds"),
    (["--seeds", "0,0"], "--seeds needs at least two distinct seeds"),
    (["--seeds", "0,x"], "--seeds must be comma-separated integers, got '0,x'"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--rows", "no such row"], "unknown rows \\['no such row'\\]"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ablate.main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_chapter_s_record_is_what_the_tool_trains_now() -> None:
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    assert record["tool"] == "tools/ablate_modern.py"
    assert [row["name"] for row in record["rows"]] == list(ablate.ROWS)
    vocab_size = CharTokenizer.from_text(shakespeare_text()).vocab_size
    runs = ablate.plan(vocab_size, list(ablate.ROWS), record["seeds"], record["steps"])
    recorded = [run for row in record["rows"] for run in row["runs"]]
    assert len(recorded) == len(runs)
    for (model, training), run in zip(runs, recorded, strict=True):
        wanted = {"model": model.model_dump(), "training": training.model_dump()}
        assert run == json.loads(json.dumps(wanted))  # as JSON stores it (tuples as lists)
    assert record["rows"][0]["runs"][0]["model"] == GPTConfig.modern(vocab_size).model_dump()
    for row in record["rows"]:
        assert len(row["losses"]) == len(record["seeds"])
        assert row["undo"] == ablate.ROWS[row["name"]]
        assert row["simplification"] == (row["name"] in ablate.SIMPLIFICATIONS)
    # every row's paired difference is computable (finite t) from what is recorded
    reference = record["rows"][0]["losses"]
    for row in record["rows"][1:]:
        change = paired_difference(row["losses"], reference)
        assert change.se > 0, row["name"]
