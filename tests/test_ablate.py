"""tools/ablate_modern.py: its rows are the modern layout with one change undone each, and
bad arguments are refused before anything trains."""

from __future__ import annotations

import re
import sys

import pytest
from helpers import load_tool

from minigpt.config import MODERN_LAYOUT

ablate = load_tool("ablate_modern")


def test_each_row_undoes_part_of_the_modern_layout() -> None:
    assert ablate.ROWS["modern recipe"] == {}
    for row, undo in ablate.ROWS.items():
        assert set(undo) <= set(MODERN_LAYOUT), row
        assert all(MODERN_LAYOUT[k] != v for k, v in undo.items()), row


@pytest.mark.parametrize(("argv", "message"), [
    (["--seeds", "0"], "--seeds needs at least two seeds"),
    (["--rows", "no such row"], "unknown rows \\['no such row'\\]"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["ablate_modern.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        ablate.main()
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
