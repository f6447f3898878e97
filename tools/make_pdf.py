"""Print the whole book to one PDF: `make pdf` writes _build/pdf/minigpt-book.pdf.

The route reuses what the site already needs, not a TeX installation: Sphinx's
single-page HTML builder (`jupyter-book build --builder singlehtml`, which
starts from the Sphinx environment the site's build has just filled, so
nothing is read or run twice) is opened in the headless Chromium of the browser test
and printed with the DevTools command Page.printToPDF once the project's MathJax
has typeset every formula and every figure has loaded. The PDF thus shows
exactly what the site shows: the chapters with their outputs and figures,
numbered definitions, theorems and proofs, and the bibliography.

Before printing, a title page and a table of contents are put in front of the
first chapter. The contents list page numbers: a first print leaves room for
them, the links of the contents in that PDF tell on which page each heading
landed, and a second print fills them in (same layout, so the same pages).

    .venv/bin/python tools/make_pdf.py                 # build, then print
    .venv/bin/python tools/make_pdf.py --no-build      # print the last build again

The PDF is also copied to the root of the built site (_build/html), where the
download menu of every page links to it.

The print is kept in the cache (`tools/kept.py`) under a key over every file of the single
page's build (the page, its images and static files), this tool, Chromium's and its driver's
versions, the installed distributions, Python, the machine and the steering environment.
With the same key the kept PDF is used (the single page is still built, to compute the key);
``--fresh`` prints regardless. An empty cache (`make reproduce`) prints.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kept  # noqa: E402  (tools/kept.py: what is kept between builds, and its keys)

ROOT = Path(__file__).resolve().parents[1]
PDF_NAME = "minigpt-book.pdf"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# Seconds for the page, MathJax, the images and each print (the final print of 287 pages
# takes about 25 s on one core, more while the tests keep both cores busy).
TIMEOUT = 600
# A4, 14 mm margins; at 80 % the column holds the package's 100-character lines.
PRINT_OPTIONS = {
    "paperWidth": 8.27,
    "paperHeight": 11.69,
    "marginTop": 0.55,
    "marginBottom": 0.65,
    "marginLeft": 0.55,
    "marginRight": 0.55,
    "scale": 0.8,
    "printBackground": True,
    "displayHeaderFooter": True,
    "headerTemplate": "<span></span>",
    "footerTemplate": ('<div style="width:100%;font-size:8px;text-align:center;color:#555">'
                       '<span class="pageNumber"></span></div>'),
    "generateTaggedPDF": True,
    "generateDocumentOutline": True,
}
# The first print only finds the page of every contents entry, so it needs no tags and no
# outline, and it paints only the entries' headings (_FIRST_PRINT_ONLY); its pages are the
# final print's (which checks that no entry moved).
FIRST_PRINT = PRINT_OPTIONS | {"generateTaggedPDF": False, "generateDocumentOutline": False}
PLACEHOLDER = "000"  # as wide as any page number the contents will hold


def build_single_page(root: Path, work: Path) -> Path:
    """Build the book with Sphinx's singlehtml builder into work/; return the page.

    The site's build has just read every chapter into its Sphinx environment
    (root/_build/.doctrees); a copy of it starts this build, so Sphinx reads again only
    what changed since (nothing, after `make book`) and the builder only writes the page.
    Without a site build every chapter is read; its outputs come from the execution cache
    (_config.yml's execute.cache), which `make book` fills.
    """
    site_doctrees, doctrees = root / "_build" / ".doctrees", work / "_build" / ".doctrees"
    shutil.rmtree(doctrees, ignore_errors=True)
    if site_doctrees.is_dir():
        shutil.copytree(site_doctrees, doctrees)
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    subprocess.run([str(jupyter_book), "build", "--builder", "singlehtml",
                    "--warningiserror", "--keep-going", "--path-output", str(work), str(root)],
                   check=True, cwd=root, env=env)
    return single_page(root, work)


def single_page(root: Path, work: Path) -> Path:
    """The single page, copied to the top of its build.

    The builder writes it under the root document's name (book/intro.html) but with links
    relative to the top of the build (_static/...), so it is read from there.
    """
    toc = yaml.safe_load((root / "_toc.yml").read_text(encoding="utf-8"))
    built = work / "_build" / "singlehtml"
    page = built / f"{toc['root']}.html"
    if not page.is_file():
        raise SystemExit(f"{page} is missing: build the single page first (without --no-build)")
    top = built / "book.html"
    shutil.copyfile(page, top)
    return top


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serve(folder: Path) -> Iterator[str]:
    """Serve folder on 127.0.0.1 (MathJax loads its fonts and extensions by URL)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def chromium() -> Iterator[Any]:
    for tool in (CHROMIUM, CHROMEDRIVER):
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: run `make system-deps`")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="minigpt-pdf-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1600",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                               options=options)
    browser.set_page_load_timeout(TIMEOUT)
    browser.set_script_timeout(TIMEOUT)
    browser.command_executor.client_config.timeout = TIMEOUT  # printing: one long command
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


# Resolves once MathJax has typeset the page (or at once if the page has no MathJax).
_MATHJAX_DONE = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function wait() {
  const mj = window.MathJax;
  if (!document.querySelector('script[src*="tex-mml-chtml"]')) { done('absent'); return; }
  if (mj && mj.startup && mj.startup.promise) {
    mj.startup.promise.then(() => done('ok'), (e) => done('error: ' + e));
  } else if (Date.now() - started > 120000) { done('error: MathJax did not start');
  } else { setTimeout(wait, 100); }
})();
"""

# Resolves once every interactive figure (minigpt.figures.charts.interactive_chart) is drawn, in the
# state it opens in (its controls are hidden on paper); returns each figure's id and state.
_CHARTS_DONE = """
const done = arguments[arguments.length - 1];
const charts = Array.from(document.querySelectorAll('div.minigpt-chart'));
const started = Date.now();
(function wait() {
  if (!charts.length) { done([]); return; }
  if (window.minigptCharts) {
    window.minigptCharts.then(() => done(charts.map((c) => [c.id, c.dataset.chartState])));
  } else if (Date.now() - started > 120000) { done([['charts', 'no chart script ran']]);
  } else { setTimeout(wait, 100); }
})();
"""

# Resolves once every image has loaded; returns the sources of those that failed.
_IMAGES_DONE = """
const done = arguments[arguments.length - 1];
const images = Array.from(document.images);
images.forEach((img) => { img.loading = 'eager'; });
Promise.all(images.map((img) => img.complete ? null :
  new Promise((r) => { img.addEventListener('load', r); img.addEventListener('error', r); })))
  .then(() => done(images.filter((i) => !(i.complete && i.naturalWidth > 0))
                         .map((i) => i.currentSrc || i.src)));
"""

# Puts the title page and the contents in front of the first chapter and makes the
# page a book: light colours, solutions open, links that lead nowhere on paper removed.
# arguments: title, author, copyright, placeholder. Returns the contents' targets (ids).
_MAKE_BOOK = """
const [title, author, copyright, placeholder] = arguments;
const html = document.documentElement;
html.classList.add('minigpt-book-print');
html.dataset.theme = 'light';
html.dataset.mode = 'light';
const article = document.querySelector('article.bd-article');
// The code cells of worked solutions are folded whole on the site: open them.
for (const details of article.querySelectorAll('.tag_hide-cell details.hide')) {
  details.open = true;
}
// The toggled admonitions (worked solutions) open as sphinx-togglebutton opens them before a
// print, but once and without a click: its print handler clicks each of them before every
// print and again after it, and each click runs Bootstrap's document-wide click handlers,
// which search the whole page (seconds, on this page of 150,000 elements).
if (typeof toggleHidden === 'function') {
  for (const button of article.querySelectorAll(
      '.toggle-hidden > .admonition-title > button.toggle-button')) {
    toggleHidden(button);
  }
}

// Links: within the book they become in-document links; any other link to this
// server (the site's other pages, its sources) means nothing in a PDF.
for (const a of article.querySelectorAll('a[href]')) {
  const url = new URL(a.href, document.baseURI);
  if (url.origin !== location.origin) continue;
  const id = decodeURIComponent(url.hash.slice(1));
  if (id && document.getElementById(id)) { a.setAttribute('href', '#' + id); }
  else { a.removeAttribute('href'); }
}

const front = document.createElement('div');
front.id = 'minigpt-print-front';
const page = document.createElement('section');
page.className = 'minigpt-title-page';
page.style.cssText = 'break-after: page; text-align: center; padding-top: 35vh;';
const h = document.createElement('div');
h.textContent = title;
h.style.cssText = 'font-size: 3.2rem; font-weight: 600; margin-bottom: 2rem;';
const by = document.createElement('div');
by.textContent = author;
by.style.cssText = 'font-size: 1.4rem; margin-bottom: 1rem;';
const c = document.createElement('div');
c.textContent = '\\u00a9 ' + copyright;
c.style.cssText = 'font-size: 1rem; color: #555;';
page.append(h, by, c);

const contents = document.createElement('nav');
contents.className = 'minigpt-contents';
contents.style.cssText = 'break-after: page;';
const ch = document.createElement('div');
ch.textContent = 'Contents';
ch.style.cssText = 'font-size: 2rem; font-weight: 600; margin: 0 0 1.5rem;';
contents.append(ch);
const targets = [];
// The book's parts: the root page, then every chapter the single page inlines.
const parts = [article.querySelector(':scope > section')];
for (const span of article.querySelectorAll('span[id^="document-"]')) {
  const next = span.nextElementSibling;
  if (next && next.tagName === 'SECTION') parts.push(next);
}
// Each entry links to its heading, given an id of its own: on a single page the
// sections' ids such as "summary" repeat from chapter to chapter.
function entry(section, level) {
  const heading = section.querySelector(":scope > h1, :scope > h2, :scope > h3");
  if (!heading) return;
  const mark = heading;
  mark.id = 'minigpt-contents-' + targets.length;
  const row = document.createElement('div');
  row.style.cssText = 'display: flex; align-items: baseline; gap: 0.4rem; ' +
    (level === 1 ? 'font-weight: 600; margin-top: 0.7rem;' : 'margin-left: 1.5rem;');
  const link = document.createElement('a');
  link.href = '#' + mark.id;
  const copy = heading.cloneNode(true);  // typeset math and all
  copy.querySelectorAll('a.headerlink').forEach((e) => e.remove());
  copy.querySelectorAll('[id]').forEach((e) => e.removeAttribute('id'));
  link.append(...copy.childNodes);
  link.style.cssText = 'text-decoration: none; color: inherit;';
  const dots = document.createElement('span');
  // Raised by relative positioning, not a transform: Chromium prints a transformed
  // element's dots (a path each) on every page of the PDF, clipped away but there,
  // 40,000 of them a page: slow to print and to read.
  dots.style.cssText = 'flex: 1; border-bottom: 1px dotted #999; position: relative; top: -0.3em;';
  const number = document.createElement('span');
  number.className = 'minigpt-page-number';
  number.dataset.target = mark.id;
  number.textContent = placeholder;
  number.style.cssText = 'font-variant-numeric: tabular-nums; min-width: 2em; text-align: right;';
  row.append(link, dots, number);
  contents.append(row);
  targets.push(mark.id);
}
for (const part of parts) {
  entry(part, 1);
  for (const sub of part.querySelectorAll(':scope > section')) entry(sub, 2);
}
front.append(page, contents);
article.prepend(front);
return targets;
"""

# Hides all but the contents' targets for the first print, and back: hidden elements keep
# their boxes, so the pages are the same, but are not painted (a print in half the time).
# arguments: true to hide, false to show again.
_FIRST_PRINT_ONLY = """
const hide = arguments[0];
let style = document.getElementById('minigpt-first-print');
if (hide && !style) {
  style = document.createElement('style');
  style.id = 'minigpt-first-print';
  style.textContent = 'body * { visibility: hidden !important; } ' +
    '[id^="minigpt-contents-"] { visibility: visible !important; }';
  document.head.append(style);
} else if (!hide && style) {
  style.remove();
}
"""

_SET_PAGE_NUMBERS = """
const numbers = arguments[0];
for (const span of document.querySelectorAll('.minigpt-page-number')) {
  span.textContent = String(numbers[span.dataset.target]);
}
"""


def link_targets(pdf: bytes) -> dict[str, int]:
    """Page (1-based) of every in-document link target, by the target's id.

    Chromium writes every element that a link of the page points to as a named
    destination of the PDF, named by the element's id.
    """
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    document = pdfium.PdfDocument(pdf)
    pages: dict[str, int] = {}
    try:
        for index in range(raw.FPDF_CountNamedDests(document.raw)):
            size = ctypes.c_long(0)
            raw.FPDF_GetNamedDest(document.raw, index, None, ctypes.byref(size))
            name = ctypes.create_string_buffer(size.value)
            destination = raw.FPDF_GetNamedDest(document.raw, index, name, ctypes.byref(size))
            page = raw.FPDFDest_GetDestPageIndex(document.raw, destination)
            if destination and page >= 0:
                pages[name.raw[:size.value].decode("utf-16-le").rstrip("\x00")] = page + 1
    finally:
        document.close()
    return pages


def lay_out_as_printed(browser: Any) -> None:
    """Give the page the print's media and the size of the printed column.

    Every Page.printToPDF lays the whole page out for paper and, once printed, again for
    the screen; with the screen already the size of the paper's column, in print media,
    both passes are short (a print of one page of this book: 12 to 13 s before, 3 to 5 s after,
    the same pages to the pixel).
    """
    paper = PRINT_OPTIONS
    inch = 96 / paper["scale"]  # CSS pixels in an inch of paper at the print's scale
    width = paper["paperWidth"] - paper["marginLeft"] - paper["marginRight"]
    height = paper["paperHeight"] - paper["marginTop"] - paper["marginBottom"]
    browser.execute_cdp_cmd("Emulation.setEmulatedMedia", {"media": "print"})
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": round(width * inch), "height": round(height * inch), "deviceScaleFactor": 1,
        "mobile": False})


def print_book(page: Path, root: Path) -> tuple[bytes, dict[str, Any]]:
    """Open the single page in Chromium and print it; return the PDF and what was seen."""
    config = yaml.safe_load((root / "_config.yml").read_text(encoding="utf-8"))
    with serve(page.parent) as base, chromium() as browser:
        browser.get(base + page.name)
        mathjax = browser.execute_async_script(_MATHJAX_DONE)
        if mathjax not in ("ok", "absent"):
            raise SystemExit(f"MathJax failed on {page.name}: {mathjax}")
        broken = browser.execute_async_script(_IMAGES_DONE)
        if broken:
            raise SystemExit(f"images that did not load: {broken}")
        charts = browser.execute_async_script(_CHARTS_DONE)
        undrawn = [chart for chart in charts if chart[1] != "drawn"]
        if undrawn:
            raise SystemExit(f"interactive figures that were not drawn: {undrawn}")
        targets = browser.execute_script(_MAKE_BOOK, str(config.get("title", "")),
                                         str(config.get("author", "")),
                                         str(config.get("copyright", "")), PLACEHOLDER)
        lay_out_as_printed(browser)
        browser.execute_script(_FIRST_PRINT_ONLY, True)
        first = base64.b64decode(browser.execute_cdp_cmd("Page.printToPDF", FIRST_PRINT)["data"])
        browser.execute_script(_FIRST_PRINT_ONLY, False)
        found = link_targets(first)
        missing = [t for t in targets if t not in found]
        if missing:
            raise SystemExit(f"the contents' links to {missing} have no page in the PDF")
        numbers = {t: found[t] for t in targets}
        browser.execute_script(_SET_PAGE_NUMBERS, numbers)
        pdf = base64.b64decode(browser.execute_cdp_cmd("Page.printToPDF", PRINT_OPTIONS)["data"])
        moved = {t: p for t, p in link_targets(pdf).items() if t in numbers and p != numbers[t]}
        if moved:
            raise SystemExit(f"the final print moved contents entries to other pages: {moved}")
        images = browser.execute_script(
            "return document.querySelectorAll('article.bd-article img').length")
    return pdf, {"contents": numbers, "images": images, "charts": len(charts)}


def print_key(page: Path) -> str:
    """The key a print of ``page`` is kept under: every file of its build
    (`kept.files_digest`: byte for byte, as a build holds no package source), this tool,
    the browser and its driver, and `kept.setting_parts`."""
    built = page.parent
    files = kept.files_digest(built, sorted(p for p in built.rglob("*") if p.is_file()))
    versions = [subprocess.run([str(tool), "--version"], capture_output=True, text=True,
                               check=True).stdout.strip() for tool in (CHROMIUM, CHROMEDRIVER)]
    return kept.key({"single page": files, "browser": "\n".join(versions),
                     "tool": Path(__file__).read_text(encoding="utf-8")})


def kept_print(key: str) -> tuple[bytes, dict[str, Any]] | None:
    """The PDF and what was seen, kept from a print under ``key``; None if none is."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "print"
        if not kept.recall_folder("pdf", key, folder):
            return None
        seen: dict[str, Any] = json.loads((folder / "seen.json").read_text(encoding="utf-8"))
        return (folder / PDF_NAME).read_bytes(), seen


def keep_print(key: str, pdf: bytes, seen: dict[str, Any]) -> None:
    """Keep the PDF and what was seen under ``key``."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "print"
        folder.mkdir()
        (folder / PDF_NAME).write_bytes(pdf)
        (folder / "seen.json").write_text(json.dumps(seen), encoding="utf-8")
        kept.keep_folder("pdf", key, folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the book (default: this one)")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the single page is built (default: ROOT/_build/pdf)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the PDF (default: ROOT/_build/pdf/{PDF_NAME})")
    parser.add_argument("--site", type=Path, default=None,
                        help="built site that gets a copy of the PDF (default: ROOT/_build/html)")
    parser.add_argument("--no-build", action="store_true",
                        help="print the single page already built in --work")
    parser.add_argument("--fresh", action="store_true",
                        help="print even if a print of the same single page is kept")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    work = (args.work or root / "_build" / "pdf").resolve()
    out = (args.out or root / "_build" / "pdf" / PDF_NAME).resolve()
    site = (args.site or root / "_build" / "html").resolve()

    started = time.perf_counter()
    page = single_page(root, work) if args.no_build else build_single_page(root, work)
    built = time.perf_counter()
    key = print_key(page)
    recalled = None if args.fresh else kept_print(key)
    if recalled is None:
        pdf, seen = print_book(page, root)
        keep_print(key, pdf, seen)
    else:
        pdf, seen = recalled
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".pdf.partial")
    partial.write_bytes(pdf)
    partial.replace(out)
    import pypdfium2 as pdfium

    document = pdfium.PdfDocument(out)
    pages = len(document)
    document.close()
    if (site / "index.html").is_file():
        shutil.copyfile(out, site / PDF_NAME)
    done = time.perf_counter()
    print(f"{out}: {pages} pages, {seen['images']} figures, {seen['charts']} interactive "
          f"figures, {len(seen['contents'])} entries in the contents; single page built in "
          f"{built - started:.0f} s, "
          + (f"printed in {done - built:.0f} s" if recalled is None else
             f"kept from a print of the same page, copied in {done - built:.0f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
