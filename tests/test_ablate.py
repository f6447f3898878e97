"""tools/ablate_modern.py: its rows are the modern layout with one change undone each, bad
arguments are refused before anything trains, and the record the modern-GPT chapter prints
(book/data/modern_ablation.json) holds the runs the tool would train now, made by today's
code in this environment: a record left from older code, or made under another draw of the
bits, fails here with the command that makes it again."""

from __future__ import annotations

import json
import platform
import re
import sys
from typing import Any

import pytest
from helpers import load_tool

from minigpt import GPTConfig
from minigpt.config import MODERN_LAYOUT
from minigpt.files import MANIFEST_NAME
from minigpt.recipes.pretrained import environment, source_sha256
from minigpt.recipes.runs import RUN_MODULES, ids_sha256, run_folder
from minigpt.sweep import paired_difference

ablate = load_tool("ablate_modern")
LINUX_X86_64 = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
STALE = f"book/data/modern_ablation.json is stale: make it again with {ablate.REGENERATE}"


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ablate.RECORD.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def book() -> tuple[int, Any, Any]:
    """The vocabulary's size and the book's training and validation ids, as the tool reads
    them."""
    result: tuple[int, Any, Any] = ablate.book_ids()
    return result


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


def test_the_chapter_s_record_is_what_the_tool_trains_now(
        record: dict[str, Any], book: tuple[int, Any, Any]) -> None:
    assert record["tool"] == "tools/ablate_modern.py"
    assert [row["name"] for row in record["rows"]] == list(ablate.ROWS), STALE
    vocab_size = book[0]
    runs = ablate.plan(vocab_size, list(ablate.ROWS), record["seeds"], record["steps"])
    recorded = [run for row in record["rows"] for run in row["runs"]]
    assert len(recorded) == len(runs), STALE
    for (model, training), run in zip(runs, recorded, strict=True):
        wanted = {"model": model.model_dump(), "training": training.model_dump()}
        # as JSON stores it (tuples as lists)
        assert {k: run[k] for k in wanted} == json.loads(json.dumps(wanted)), STALE
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


def test_the_record_was_made_by_today_s_code(record: dict[str, Any]) -> None:
    # The runs are kept runs (minigpt.recipes.runs): the code that trains them is RUN_MODULES,
    # and a change to it (not to its comments) may move every loss of the table.
    assert record.get("modules") == list(RUN_MODULES), STALE
    assert record.get("source_sha256") == source_sha256(RUN_MODULES), (
        f"the package's training code changed since the record was made; {STALE}")
    assert all(name in record.get("bits", "") for name in (
        "MINIGPT_SEED_SHIFT", "MINIGPT_PRODUCTS")), STALE
    for row in record["rows"]:
        for run in row["runs"]:
            assert re.fullmatch("[0-9a-f]{64}", run.get("key", "")), STALE
            assert re.fullmatch("[0-9a-f]{64}", run.get("weights_sha256", "")), STALE


@pytest.mark.skipif(not LINUX_X86_64, reason="the record's bits are those of PyTorch's Linux "
                    "x86-64 build; elsewhere the runs train other bits")
def test_the_record_was_made_in_this_environment_on_the_book_s_data(
        record: dict[str, Any], book: tuple[int, Any, Any]) -> None:
    # The environment decides the bits too: the PyTorch version and its kernels, how the
    # products are summed (MINIGPT_PRODUCTS=native) and the redraw (MINIGPT_SEED_SHIFT).
    here = environment()
    assert record.get("environment") == json.loads(json.dumps(here)), (
        f"the record was made in another environment ({record.get('environment')}, here "
        f"{here}); {STALE}")
    vocab_size, train_ids, val_ids = book
    assert (record.get("train_sha256"), record.get("val_sha256")) == (
        ids_sha256(train_ids), ids_sha256(val_ids)), f"the book's text changed; {STALE}"
    # Each run's key is over all of it (code, configurations, data, environment): the key
    # today's code gives it, and where this cache keeps the run, the weights it holds.
    runs = ablate.plan(vocab_size, list(ablate.ROWS), record["seeds"], record["steps"])
    keys = ablate.run_keys(runs, train_ids, val_ids)
    recorded = [run for row in record["rows"] for run in row["runs"]]
    assert [run.get("key") for run in recorded] == keys, STALE
    for run in recorded:
        manifest = run_folder(run["key"]) / MANIFEST_NAME
        if manifest.is_file():
            kept = json.loads(manifest.read_text(encoding="utf-8"))
            assert kept["weights_sha256"] == run["weights_sha256"], (
                f"run {run['key'][:12]} is kept with other weights than the record's; {STALE}")
