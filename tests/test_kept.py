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


def test_given_files_are_read_alone_and_byte_for_byte(tmp_path: Path) -> None:
    page, style = tmp_path / "index.html", tmp_path / "_static" / "page.css"
    style.parent.mkdir()
    page.write_text("<p>a</p>\n", "utf-8")
    style.write_text("p {}  /* a comment counts */\n", "utf-8")
    digest = kept.files_digest(tmp_path, [page, style])
    (tmp_path / "unlisted.txt").write_text("x", "utf-8")
    assert kept.files_digest(tmp_path, [page, style]) == digest  # only the files given
    assert kept.files_digest(tmp_path, [page]) != digest
    style.write_text("p {}  /* another comment */\n", "utf-8")
    assert kept.files_digest(tmp_path, [page, style]) != digest


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


def _a_pdf() -> bytes:
    import io

    import pypdfium2 as pdfium

    document = pdfium.PdfDocument.new()
    document.new_page(100, 100)
    buffer = io.BytesIO()
    document.save(buffer)
    document.close()
    return buffer.getvalue()


def test_the_pdf_is_printed_again_only_when_the_single_page_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    make_pdf = load_tool("make_pdf")
    root, work = tmp_path / "book", tmp_path / "work"
    root.mkdir()
    (root / "_toc.yml").write_text("root: intro\n", "utf-8")
    built = work / "_build" / "singlehtml"
    (built / "_static").mkdir(parents=True)
    (built / "intro.html").write_text("<p>one</p>", "utf-8")
    (built / "_static" / "book.css").write_text("p {}", "utf-8")
    printed: list[str] = []

    def print_book(page: Path, root_: Path) -> tuple[bytes, dict[str, object]]:
        printed.append(page.read_text("utf-8"))
        return _a_pdf(), {"contents": {"intro": 1}, "images": 0, "charts": 0}

    monkeypatch.setattr(make_pdf, "print_book", print_book)
    args = ["--root", str(root), "--work", str(work), "--no-build",
            "--site", str(tmp_path / "site"), "--out", str(tmp_path / "out.pdf")]
    assert make_pdf.main(args) == 0
    assert printed == ["<p>one</p>"]
    first = (tmp_path / "out.pdf").read_bytes()
    (tmp_path / "out.pdf").unlink()
    assert make_pdf.main(args) == 0  # the same page: the kept print, not a new one
    assert printed == ["<p>one</p>"]
    assert (tmp_path / "out.pdf").read_bytes() == first
    assert "kept from a print of the same page" in capsys.readouterr().out
    (built / "_static" / "book.css").write_text("p {color: red}", "utf-8")
    assert make_pdf.main(args) == 0  # a static file the page reads has changed
    assert len(printed) == 2
    assert make_pdf.main(args + ["--fresh"]) == 0
    assert len(printed) == 3
    (built / "intro.html").write_text("<p>two</p>", "utf-8")
    assert make_pdf.main(args) == 0
    assert printed[-1] == "<p>two</p>"
    monkeypatch.setenv("MINIGPT_PRODUCTS", "native")  # a steering variable: printed again
    key = make_pdf.print_key(built / "book.html")
    monkeypatch.delenv("MINIGPT_PRODUCTS")
    assert make_pdf.print_key(built / "book.html") != key


def test_a_chapter_reads_the_modules_it_imports(tmp_path: Path) -> None:
    # The package's files a chapter's key reads: what its code imports, the packages above,
    # and what those import in turn (in a function too); not the modules it never loads.
    package = tmp_path / "src" / "minigpt"
    (package / "figures").mkdir(parents=True)
    (package / "__init__.py").write_text("from minigpt import core\n", "utf-8")
    (package / "core.py").write_text("def f():\n    from minigpt.kernel import g\n", "utf-8")
    (package / "kernel.py").write_text("g = 1\n", "utf-8")
    (package / "kernel.cpp").write_text("int g = 1;\n", "utf-8")
    (package / "figures" / "__init__.py").write_text("", "utf-8")
    (package / "figures" / "plot.py").write_text("import minigpt.core\n", "utf-8")
    (package / "cli.py").write_text("import minigpt.figures.plot\n", "utf-8")
    cells = ["%matplotlib inline\nfrom minigpt.figures import plot", "print(1)"]
    assert [p.relative_to(package).as_posix() for p in kept.imported_files(cells, package)] == [
        "__init__.py", "core.py", "figures/__init__.py", "figures/plot.py", "kernel.cpp",
        "kernel.py"]
    digest = kept.files_digest(tmp_path, kept.inputs(tmp_path, cells))
    (package / "cli.py").write_text("import minigpt.core\n", "utf-8")
    assert kept.files_digest(tmp_path, kept.inputs(tmp_path, cells)) == digest
    (package / "kernel.cpp").write_text("int g = 2;\n", "utf-8")
    assert kept.files_digest(tmp_path, kept.inputs(tmp_path, cells)) != digest
    # Code that is not Python ast reads: every file of the package counts.
    assert kept.imported_files(["x = (", "import minigpt"], package) is None
    assert package / "cli.py" in kept.inputs(tmp_path, ["x = ("])
