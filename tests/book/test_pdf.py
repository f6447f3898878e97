"""The whole book as one PDF (`make pdf` -> _build/pdf/minigpt-book.pdf).

The PDF is not made here: `make test` makes it (after the site) before it runs the
tests. The tests read it with PDFium (pypdfium2) and check what a reader would:
a title page, a table of contents whose page numbers lead to the chapters, every
chapter with its printed outputs and figures, numbered theorems, the
bibliography, and no TeX left untypeset. A missing PDF is a failure, not a skip.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from helpers import load_baseline_tool

ROOT = Path(__file__).resolve().parents[2]
# The book to check; another folder with the same layout only for trying the tests on
# a scratch copy of the book (as in test_site.py).
BOOK_ROOT = Path(os.environ.get("MINIGPT_BOOK_ROOT", ROOT)).resolve()
PDF = BOOK_ROOT / "_build" / "pdf" / "minigpt-book.pdf"
# The single page that tools/make_pdf.py printed.
SINGLE_PAGE = BOOK_ROOT / "_build" / "pdf" / "_build" / "singlehtml" / "book.html"
RAW_TEX = ("$$", "\\(", "\\)", "\\[", "\\]", "\\begin{")

pytestmark = [pytest.mark.book, pytest.mark.pdf]  # reads the PDF that `make pdf` wrote


@functools.cache
def _read() -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """The text, the number of images and the number of objects of every page, read in
    one pass."""
    if not PDF.is_file():
        pytest.fail(f"{PDF} is missing: run `make pdf` (make test does)")
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    document = pdfium.PdfDocument(PDF)
    texts, images, objects = [], [], []
    try:
        for page in document:
            texts.append(page.get_textpage().get_text_range().replace("\r\n", "\n"))
            # Every glyph run and path is an object: count them through the C API.
            count = raw.FPDFPage_CountObjects(page.raw)
            objects.append(count)
            images.append(sum(
                raw.FPDFPageObj_GetType(raw.FPDFPage_GetObject(page.raw, i))
                == raw.FPDF_PAGEOBJ_IMAGE for i in range(count)))
    finally:
        document.close()
    return tuple(texts), tuple(images), tuple(objects)


def pages() -> tuple[str, ...]:
    """The text of every page of the PDF."""
    return _read()[0]


def images_per_page() -> tuple[int, ...]:
    return _read()[1]


def objects_per_page() -> tuple[int, ...]:
    return _read()[2]


def _flat(text: str) -> str:
    """Text without any white space: lines a PDF wraps still match."""
    return re.sub(r"\s+", "", text)


@functools.cache
def _flat_text() -> str:
    return _flat("".join(pages()))


def _spaced(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _entries() -> list[str]:
    return list(load_baseline_tool().toc_files(BOOK_ROOT / "_toc.yml"))


def _single_page() -> str:
    if not SINGLE_PAGE.is_file():
        pytest.fail(f"{SINGLE_PAGE} is missing: run `make pdf` (make test does)")
    return SINGLE_PAGE.read_text(encoding="utf-8")


def _chapter_titles() -> list[str]:
    """The title of the root page and of every chapter, as the single page prints them."""
    page = _single_page()
    article = page[page.index('<article class="bd-article">'):]
    root = re.search(r"<h1>(.*?)<a class=\"headerlink\"", article, re.DOTALL)
    assert root, "the single page has no title"
    titles = [root.group(1)]
    titles += re.findall(r'<span id="document-[^"]+"></span><section[^>]*>\s*<h2>(.*?)'
                         r'<a class="headerlink"', article, re.DOTALL)
    return [_spaced(re.sub(r"<[^>]+>", "", t)).strip() for t in titles]


def test_page_count_is_plausible() -> None:
    text = sum(len(p) for p in pages())
    n = len(pages())
    chapters = len(_entries())
    # At least a title page, the contents and a page a chapter; and pages neither
    # nearly empty nor overfull (this book prints about 2,200 characters a page).
    assert n >= chapters + 2, f"{n} pages for {chapters} chapters"
    assert 800 < text / n < 5000, f"{text} characters on {n} pages"


def test_pages_hold_only_what_they_print() -> None:
    """A page of text, code and figures is some hundreds of objects (glyph runs, paths,
    images); the contents' dotted leaders (a path a dot) fill their own pages. Drawn on
    every page (as Chromium does for a transformed element), clipped away but kept, the
    leaders made every page of this book 44,000 objects: a PDF of 27 MB rather than 22,
    a quarter slower to print and fifteen times slower to read."""
    objects = sorted(objects_per_page())
    median = objects[len(objects) // 2]
    assert median < 3000, f"the median page holds {median} objects (the fullest: {objects[-5:]})"


def test_title_page() -> None:
    config = yaml.safe_load((BOOK_ROOT / "_config.yml").read_text(encoding="utf-8"))
    first = pages()[0]
    assert config["title"] in first and config["author"] in first, first


def _contents() -> list[tuple[str, int]]:
    """The (title, page) entries of the table of contents, in order."""
    assert pages()[1].startswith("Contents"), pages()[1][:200]
    listed: list[tuple[str, int]] = []
    for text in pages()[1:]:
        lines = text.splitlines()
        if not lines or (listed and not re.fullmatch(r".+ \d+", lines[0])):
            break
        for line in lines:
            match = re.fullmatch(r"(.+) (\d+)", line.strip())
            if match:
                listed.append((_spaced(match.group(1)), int(match.group(2))))
    return listed


def _chapter_pages() -> dict[str, int]:
    """{chapter title: page}: the chapters' entries, found in order (a section of one
    chapter may bear the title of a later chapter)."""
    listed = _contents()
    found: dict[str, int] = {}
    position = 0
    for title in _chapter_titles():
        while position < len(listed) and listed[position][0] != title:
            position += 1
        assert position < len(listed), (
            f"the contents do not list {title!r} after {list(found)}: {listed[:40]}")
        found[title] = listed[position][1]
    return found


def test_contents_lead_to_every_chapter() -> None:
    titles = _chapter_titles()
    assert len(titles) == len(_entries()), (titles, _entries())
    chapters = _chapter_pages()
    for title, number in chapters.items():
        # The chapter's title is a line of the page the contents give, not of the one
        # before (each chapter starts a page).
        lines = [_spaced(line).strip() for line in pages()[number - 1].splitlines()]
        assert title in lines, f"the contents put {title!r} on page {number}: {lines[:20]}"
        before = [_spaced(line).strip() for line in pages()[number - 2].splitlines()]
        assert title not in before, f"{title!r} is on page {number - 1} too"
    numbers = list(chapters.values())
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), numbers
    assert numbers[-1] <= len(pages())
    # Every entry's page is one of the pages its chapter spans.
    listed = [number for _, number in _contents()]
    assert listed == sorted(listed) and listed[-1] <= len(pages()), listed


def test_theorems_are_numbered_with_their_titles() -> None:
    text = _spaced(" ".join(pages()))
    titles = [title.strip() for entry in _entries()
              for title in re.findall(r"^\s*(?:`{3,}|:{3,})\{prf:theorem\}[ \t]*(.*)$",
                                      _source(entry), re.MULTILINE)]
    plain = [t for t in titles if t and "$" not in t and "{" not in t]
    assert plain, "no theorem with a plain-text title in the book"
    for title in plain:
        assert re.search(rf"Theorem \d+ \({re.escape(title)}\)", text), (
            f"the PDF does not print a numbered theorem titled {title!r}")
    proofs = sum(len(re.findall(r"^\s*(?:`{3,}|:{3,})\{prf:proof\}", _source(e), re.MULTILINE))
                 for e in _entries())
    assert text.count("Proof.") >= proofs > 0


def test_bibliography_is_printed() -> None:
    keys = re.findall(r"^@\w+\{([^,]+),", (BOOK_ROOT / "references.bib").read_text("utf-8"),
                      re.MULTILINE)
    assert keys
    last = pages()[list(_chapter_pages().values())[-1] - 1:]
    # Each printed entry ends with its year; sphinxcontrib-bibtex lists the cited entries.
    cited = re.findall(r"(?m)^\[\d+\]", "\n".join(last))
    assert cited, "the bibliography's entries are missing"


def _source(entry: str) -> str:
    for suffix in (".md", ".ipynb"):
        path = BOOK_ROOT / (entry + suffix)
        if path.exists():
            return path.read_text(encoding="utf-8")
    raise FileNotFoundError(entry)


@functools.cache
def _masks() -> list[re.Pattern[str]]:
    """nbval's sanitiser patterns: the parts of an output that vary from run to run."""
    cfg = (ROOT / "tests" / "notebooks" / "sanitize.cfg").read_text(encoding="utf-8")
    return [re.compile(line.split(":", 1)[1].strip()) for line in cfg.splitlines()
            if line.startswith("regex:")]


def _printed_lines(entry: str) -> list[str]:
    """The text lines a chapter printed, from its stored notebook, less the volatile ones."""
    stored = ROOT / "tests" / "notebooks" / f"{Path(entry).name}.ipynb"
    if not stored.exists():
        return []
    lines = []
    for cell in json.loads(stored.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                text = "".join(output["text"])
            elif (output.get("output_type") in ("execute_result", "display_data")
                  and set(output.get("data", {})) == {"text/plain"}):
                # (An output that also has HTML, Markdown or an image shows that instead.)
                text = "".join(output["data"]["text/plain"])
            else:
                continue
            for line in text.splitlines():
                line = line.split("\r")[-1]
                if (line.strip() and not line.startswith("<Figure")
                        and not any(mask.search(line) for mask in _masks())):
                    lines.append(line)
    return lines


def test_the_chapters_print_something() -> None:
    """The next test runs over the pages whose stored notebooks print text: every page
    but the bibliography, which has no code."""
    silent = [entry for entry in _entries() if not _printed_lines(entry)]
    assert silent == ["book/bibliography"], silent


@pytest.mark.parametrize("entry", [entry for entry in _entries() if _printed_lines(entry)])
def test_printed_outputs_are_in_the_pdf(entry: str) -> None:
    lines = _printed_lines(entry)
    text = _flat_text()
    missing = [line for line in lines if _flat(line) not in text]
    assert not missing, (f"{entry}: {len(missing)} of {len(lines)} printed lines are not in "
                         "the PDF:\n" + "\n".join(missing[:20]))


def test_no_raw_tex() -> None:
    found = {d: [i + 1 for i, page in enumerate(pages()) if d in page] for d in RAW_TEX}
    found = {d: where for d, where in found.items() if where}
    assert not found, f"raw TeX left in the PDF (delimiter: pages): {found}"


def test_every_figure_is_embedded() -> None:
    page = _single_page()
    article = page[page.index('<article class="bd-article">'):]
    figures = re.findall(r"<img [^>]*src=\"([^\"]+)\"", article)
    assert figures, "the single page holds no figure"
    embedded = sum(images_per_page())
    assert embedded >= len(figures), (
        f"{len(figures)} figures on the single page, {embedded} images in the PDF")


def test_interactive_figures_print_as_first_drawn_without_controls() -> None:
    page = _single_page()
    charts = re.findall(r'<div class="minigpt-chart" id="minigpt-chart-([a-z0-9-]+)"', page)
    assert len(charts) >= 4, charts
    text = _spaced("".join(pages()))
    # The sampling figure opens at tau = 1, k = V, rho = 1: every token kept.
    assert re.search(r"keeps (\d+) of \1 tokens, holding 1\.000 of p_tau", text), (
        "the sampling figure's first state is not in the PDF")
    # The rotation figure prints each pair's angle; the sliders' labels do not print.
    assert len(re.findall(r"ω k = \d+°", text)) >= 6, "the rotation figure is not in the PDF"
    controls = [label for label in ("temperature τ:", "top-k:", "top-p ρ:", "offset k:",
                                    "position p:") if label in text]
    assert not controls, f"controls printed: {controls}"


def test_playgrounds_print_as_their_static_twin() -> None:
    """Each playground prints a note and its model's greedy sample, not its form."""
    import json

    page = _single_page()
    playgrounds = page.count('<div class="minigpt-playground"')
    assert playgrounds >= 3, playgrounds
    text = _spaced("".join(pages()))
    assert text.count("In the online edition this is a playground") == playgrounds
    manifest = BOOK_ROOT / "_playground" / "playground" / "playground.json"
    sample = json.loads(manifest.read_text(encoding="utf-8"))["models"]["book"]["sample"]
    first_line = _spaced(sample.strip().splitlines()[0])
    assert first_line in text, f"the greedy sample {first_line!r} is not in the PDF"
    controls = [label for label in ("Temperature τ", "0: greedy")
                if label in text]
    assert not controls, f"the playground's controls printed: {controls}"
