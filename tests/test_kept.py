"""tools/kept.py: what is kept between builds is kept under a key over what made it, and
appears whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tool

kept = load_tool("kept")


def test_the_files_are_read_by_their_code_and_the_book_by_its_data(tmp_path: Path) -> None:
    package = tmp_path / "src" / "minigpt"
    package.mkdir(parents=True)
    module = package / "step.py"
    module.write_text('"""Steps."""\n\n\ndef step(x):\n    return x + 1\n', "utf-8")
    digest = kept.files_digest(tmp_path)
    module.write_text('"""Steps, said again."""\n\n\ndef step(x):  # one more\n'
                      '    return x + 1\n', "utf-8")
    assert kept.files_digest(tmp_path) == digest  # a comment and a docstring are not code
    module.write_text('"""Steps."""\n\n\ndef step(x):\n    return x + 2\n', "utf-8")
    changed = kept.files_digest(tmp_path)
    assert changed != digest
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "step.cpython-311.pyc").write_bytes(b"\0")
    assert kept.files_digest(tmp_path) == changed  # what Python compiled is not an input
    (tmp_path / "book" / "data").mkdir(parents=True)
    (tmp_path / "book" / "chapter.md").write_text("# A page\n", "utf-8")
    assert kept.files_digest(tmp_path) == changed  # nor a page (its key reads its code)
    (tmp_path / "book" / "data" / "table.json").write_text("[]", "utf-8")
    assert kept.files_digest(tmp_path) != changed
    (tmp_path / "tests" / "notebooks").mkdir(parents=True)
    with_data = kept.files_digest(tmp_path)
    (tmp_path / "tests" / "notebooks" / "models.json").write_text("{}", "utf-8")
    assert kept.files_digest(tmp_path) != with_data  # the models set-up should have


def test_a_key_reads_its_parts_and_the_environment_that_steers() -> None:
    environ = {"HOME": "/root", "MINIGPT_CENSUS": "/a"}
    key = kept.key({"a": "1"}, environ)
    assert kept.key({"a": "2"}, environ) != key
    assert kept.key({"b": "1"}, environ) != key
    assert kept.key({"a": "1"}, {**environ, "TERM": "dumb", "MINIGPT_CENSUS": "/b"}) == key
    for steering in ("MINIGPT_PRODUCTS", "MKL_CBWR", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY",
                     "PYTHONHASHSEED"):
        assert kept.key({"a": "1"}, {**environ, steering: "x"}) != key, steering


def test_a_record_is_recalled_under_its_key_only(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path))
    assert kept.recall("kind", "name", "k") is None
    kept.keep("kind", "name", "k", {"seconds": 1.5})
    assert kept.recall("kind", "name", "k") == {"seconds": 1.5}
    assert kept.recall("kind", "name", "other") is None
    kept.keep("kind", "name", "other", [1])
    assert kept.recall("kind", "name", "k") is None  # one a name, the newest
    kept.record_path("kind", "name").write_text("{not json", "utf-8")
    assert kept.recall("kind", "name", "other") is None


def test_a_folder_is_kept_whole_under_its_key(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    made = tmp_path / "made"
    (made / "sub").mkdir(parents=True)
    (made / "a.onnx").write_bytes(b"\0\1")
    (made / "sub" / "b.json").write_text("{}", "utf-8")
    assert not kept.recall_folder("export", "k", tmp_path / "out")
    kept.keep_folder("export", "k", made)
    assert kept.recall_folder("export", "k", tmp_path / "out")
    assert (tmp_path / "out" / "a.onnx").read_bytes() == b"\0\1"
    assert (tmp_path / "out" / "sub" / "b.json").read_text("utf-8") == "{}"
    kept.keep_folder("export", "k2", made)
    assert [p.name for p in (tmp_path / "cache" / "kept" / "export").iterdir()] == ["k2"]
    assert not kept.recall_folder("export", "k", tmp_path / "out2")


def test_the_playground_tool_refuses_a_folder_that_exists(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_tool("playground").main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path} exists: remove it first" in capsys.readouterr().err
