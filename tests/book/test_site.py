"""The built site (`make book` -> _build/html) works offline in a real browser.

Headless Chromium (Debian's `chromium` and `chromedriver`, installed by
`make system-deps`) opens every page listed in `_toc.yml`, served from
127.0.0.1, and the tests check what a reader would see: math typeset by the
project's own MathJax (no raw TeX left), proof boxes, citation links that lead
to bibliography entries, images that load, a console without errors, and no
request to any other host, and axe-core (from npm, like MathJax) finds no critical
accessibility violation and no serious one in the book's own content. A static
scan checks that no built page or style sheet refers to another host for scripts,
styles or fonts, and that every page's download menu offers the page's source and
the whole book's PDF. One more build, with a placeholder repository URL and
execution off, checks the buttons that `repository.url` turns on.

The site is not built here: `make test` builds it first. A missing build is a
failure, not a skip.
"""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

import pytest
import yaml
from helpers import load_baseline_tool

ROOT = Path(__file__).resolve().parents[2]
# The book to check; another folder with the same layout only for trying the
# tests on a scratch copy of the book.
BOOK_ROOT = Path(os.environ.get("MINIGPT_BOOK_ROOT", ROOT)).resolve()
SITE = BOOK_ROOT / "_build" / "html"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# axe-core, from npm (package.json), injected into every page by the browser test.
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"
# The whole book's PDF (`make pdf`), which the site's download menu offers.
PDF_NAME = "minigpt-book.pdf"
#: Seconds for a page, its images, MathJax and the accessibility pass (the pass took over 60 s
#: twice on a 2-core machine while `make test` emulated CPUs beside it).
PAGE_TIMEOUT = 180
# A common laptop window: no code or output block may scroll sideways at this width.
WINDOW_WIDTH = 1400

# Raw TeX delimiters that must not survive typesetting in the visible text.
RAW_TEX = ("\\(", "\\)", "\\[", "\\]", "$$", "\\begin{")
PROOF_DIRECTIVE = re.compile(r"^\s*(?:`{3,}|:{3,})\{prf:[a-z]+\}", re.MULTILINE)
CITE_ROLE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
DISPLAY_MATH = re.compile(r"^\s*(?:\$\$|\\begin\{|(?:`{3,}|:{3,})\{math\})", re.MULTILINE)
BIBLIOGRAPHY_DIRECTIVE = re.compile(r"^\s*(?:`{3,}|:{3,})\{bibliography\}", re.MULTILINE)

pytestmark = pytest.mark.book  # every test here reads the built site



def _toc_entries() -> list[str]:
    tool = load_baseline_tool()
    return list(tool.toc_files(BOOK_ROOT / "_toc.yml"))


PAGES = _toc_entries()


def _source(entry: str) -> str:
    for suffix in (".md", ".ipynb"):
        path = BOOK_ROOT / (entry + suffix)
        if path.exists():
            return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"_toc.yml lists {entry!r} but neither {entry}.md nor .ipynb exists")


def _require_site() -> None:
    if not (SITE / "index.html").exists():
        pytest.fail(f"{SITE} holds no built book: run `make book` first (make test does)")


# --------------------------------------------------------------------------
# Static scan: nothing on the pages comes from another host.
# --------------------------------------------------------------------------


def _is_external(url: str) -> bool:
    url = url.strip()
    if url.startswith("//"):
        return True
    scheme = urlsplit(url).scheme.lower()
    return scheme not in ("", "data", "blob", "about", "javascript", "mailto")


_SCRIPT_TYPES = ("", "text/javascript", "application/javascript", "module")


class _ResourceRefs(HTMLParser):
    """Collects the URLs a page *loads* (scripts, styles, fonts, images, frames)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag in ("script", "img", "iframe", "embed", "source", "video", "audio", "input"):
            if a.get("src"):
                self.refs.append((tag, a["src"]))
        if tag == "link":
            # rel=stylesheet/preload/icon/modulepreload... all make the browser fetch;
            # navigation-only relations do not.
            rels = set(a.get("rel", "").lower().split())
            if a.get("href") and not rels <= {"index", "search", "next", "prev", "canonical"}:
                self.refs.append((f"link rel={a.get('rel')}", a["href"]))
        if tag == "object" and a.get("data"):
            self.refs.append((tag, a["data"]))
        if "style" in a:
            self.refs += [("style attribute", u) for u in _css_urls(a["style"])]
        self._in = tag if tag in ("script", "style") else None
        if tag == "script" and a.get("type", "text/javascript") not in _SCRIPT_TYPES:
            # A data block (an interactive figure's JSON, whose "$schema" names
            # vega.github.io) is never run, so it loads nothing.
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "style":
            self.refs += [("<style>", u) for u in _css_urls(data)]
        elif self._in == "script":
            # An inline script that names another host would load from it.
            self.refs += [("inline <script>", u) for u in re.findall(r"https?://[^\s'\"`)]+", data)]

    def handle_endtag(self, tag: str) -> None:
        self._in = None


def _css_urls(css: str) -> list[str]:
    urls = re.findall(r"url\(\s*['\"]?([^'\")]+)['\"]?\s*\)", css)
    urls += re.findall(r"@import\s+['\"]([^'\"]+)['\"]", css)
    return urls


def test_site_is_built() -> None:
    _require_site()
    missing = [p for p in PAGES if not (SITE / f"{p}.html").exists()]
    assert not missing, f"pages in _toc.yml that the build did not produce: {missing}"


def test_scripts_that_would_run_are_scanned_and_data_blocks_are_not() -> None:
    parser = _ResourceRefs()
    parser.feed('<script>fetch("https://example.org/a.js")</script><script type="application/'
                'json">{"$schema": "https://vega.github.io/schema/vega-lite/v6.json"}</script>')
    assert parser.refs == [("inline <script>", "https://example.org/a.js")]


def test_pages_load_nothing_from_other_hosts() -> None:
    _require_site()
    found: list[str] = []
    pages = sorted(SITE.rglob("*.html"))
    assert pages
    for page in pages:
        parser = _ResourceRefs()
        parser.feed(page.read_text(encoding="utf-8"))
        found += [f"{page.relative_to(SITE)}: {kind} {url}" for kind, url in parser.refs
                  if _is_external(url)]
    for sheet in sorted(SITE.rglob("*.css")):
        found += [f"{sheet.relative_to(SITE)}: url {u}"
                  for u in _css_urls(sheet.read_text(encoding="utf-8", errors="replace"))
                  if _is_external(u)]
    assert not found, "the site refers to other hosts:\n" + "\n".join(found[:50])


def test_mathjax_is_served_from_the_site() -> None:
    _require_site()
    mathjax = SITE / "_static" / "mathjax" / "es5"
    assert (mathjax / "tex-mml-chtml.js").is_file(), "MathJax was not copied: run `make book`"
    fonts = list((mathjax / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    assert len(fonts) > 10, f"MathJax's CHTML fonts are missing from {mathjax}"
    # Only the files the site uses are copied, not the whole npm package (24 MB).
    assert not (mathjax / "tex-svg-full.js").exists(), "the whole MathJax package was copied"
    size = sum(f.stat().st_size for f in mathjax.rglob("*") if f.is_file())
    assert size < 8_000_000, f"{mathjax} holds {size / 1e6:.1f} MB"


MAX_OUTPUT_LINES = 60  # a cell output longer than this is a wall of log, not a result
OUTPUT_BLOCK = re.compile(r'<div class="output [^"]*">\s*<div class="highlight[^"]*">\s*'
                          r"<pre>(.*?)</pre>", re.DOTALL)


def output_blocks(page_html: str) -> list[str]:
    """The text of every cell-output block of a built page."""
    return [html.unescape(re.sub(r"<[^>]+>", "", block))
            for block in OUTPUT_BLOCK.findall(page_html)]


@pytest.mark.parametrize("entry", PAGES)
def test_no_output_is_a_wall_of_text(entry: str) -> None:
    _require_site()
    blocks = output_blocks((SITE / f"{entry}.html").read_text(encoding="utf-8"))
    long = [(len(b.splitlines()), b.splitlines()[0][:60]) for b in blocks
            if len(b.splitlines()) > MAX_OUTPUT_LINES]
    assert not long, f"{entry}: outputs over {MAX_OUTPUT_LINES} lines (lines, first line): {long}"


def test_every_text_output_of_the_site_is_scanned() -> None:
    # Should the theme change its markup, the line count above must fail, not pass on nothing.
    _require_site()
    missed = {}
    for entry in PAGES:
        page = (SITE / f"{entry}.html").read_text(encoding="utf-8")
        # Interactive figures are HTML outputs, checked by the chart tests below.
        outputs = page.count('<div class="output ') - page.count('<div class="output text_html')
        if outputs != len(output_blocks(page)):
            missed[entry] = (outputs, len(output_blocks(page)))
    assert not missed, f"output divs vs text blocks found, per page: {missed}"
    assert sum(len(output_blocks((SITE / f"{e}.html").read_text(encoding="utf-8")))
               for e in PAGES) > 0, "no cell output found on any page"


def test_output_blocks_are_found() -> None:
    page = ('<div class="cell_output docutils container"><div class="output stream '
            'highlight-myst-ansi notranslate"><div class="highlight"><pre><span></span>a &lt; b\n'
            "c\n</pre></div></div></div>")
    assert output_blocks(page) == ["a < b\nc\n"]


# --------------------------------------------------------------------------
# The header's buttons: the download menu, and what repository.url turns on.
# --------------------------------------------------------------------------


class _HeaderButtons(HTMLParser):
    """The theme's header buttons of a page: {tooltip: href}."""

    def __init__(self) -> None:
        super().__init__()
        self.buttons: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "a" and "btn" in a.get("class", "").split() and a.get("title"):
            self.buttons[a["title"]] = a.get("href", "")


def header_buttons(page_html: str) -> dict[str, str]:
    parser = _HeaderButtons()
    parser.feed(page_html)
    return parser.buttons


def _config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((BOOK_ROOT / "_config.yml").read_text("utf-8"))
    return config


@pytest.mark.pdf  # the PDF must be in the site
@pytest.mark.parametrize("entry", PAGES)
def test_download_menu_offers_the_source_and_the_book_pdf(entry: str) -> None:
    _require_site()
    page = SITE / f"{entry}.html"
    buttons = header_buttons(page.read_text(encoding="utf-8"))
    source = buttons.get("Download source file")
    assert source, f"{entry}: the download menu offers no source file: {buttons}"
    assert (page.parent / source).resolve() == (SITE / "_sources" / entry).with_suffix(
        Path(source).suffix).resolve()
    assert (page.parent / source).is_file(), f"{entry}: {source} is not in the site"
    book = buttons.get("Download the whole book as one PDF")
    assert book, f"{entry}: the download menu does not offer the book's PDF: {buttons}"
    assert (page.parent / book).resolve() == (SITE / PDF_NAME).resolve()
    assert (SITE / PDF_NAME).is_file(), (
        f"{SITE / PDF_NAME} is missing: `make pdf` puts it there (make test does)")


REPOSITORY_BUTTONS = ("Source repository", "Open an issue", "Suggest edit", "Launch on Binder",
                      "Launch on Colab")


def test_no_repository_or_launch_button_without_a_repository_url() -> None:
    _require_site()
    if _config()["repository"].get("url"):
        pytest.skip("_config.yml sets repository.url: test_repository_url_turns_on_the_"
                    "buttons checks them")
    for entry in PAGES:
        shown = set(header_buttons((SITE / f"{entry}.html").read_text("utf-8")))
        assert not shown & set(REPOSITORY_BUTTONS), f"{entry}: {shown & set(REPOSITORY_BUTTONS)}"


PLACEHOLDER_REPOSITORY = "https://github.com/example-owner/example-fork"


@pytest.fixture(scope="module")
def placeholder_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root page and one chapter built with a placeholder repository.url, not executed.

    A scratch configuration beside a two-page table of contents; the sources are the
    book's own. No chapter runs, so this takes seconds.
    """
    scratch = tmp_path_factory.mktemp("placeholder-site")
    config = yaml.safe_load((ROOT / "_config.yml").read_text("utf-8"))
    config["repository"]["url"] = PLACEHOLDER_REPOSITORY
    config["execute"]["execute_notebooks"] = "off"
    # Paths in the configuration are relative to its file: point back at the book's.
    extensions = config["sphinx"]["local_extensions"]
    config["sphinx"]["local_extensions"] = {name: str(ROOT / path)
                                            for name, path in extensions.items()}
    (scratch / "_config.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text("utf-8"))
    chapter = toc["chapters"][0]["file"]
    (scratch / "_toc.yml").write_text(yaml.safe_dump(
        {"format": "jb-book", "root": toc["root"], "chapters": [{"file": chapter}]}), "utf-8")
    jupyter_book = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run(
        [str(jupyter_book), "build", "--config", str(scratch / "_config.yml"), "--toc",
         str(scratch / "_toc.yml"), "--path-output", str(scratch), str(ROOT)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return scratch / "_build" / "html"


def test_repository_url_turns_on_the_buttons(placeholder_site: Path) -> None:
    config = _config()
    branch = config["repository"]["branch"]
    chapter = yaml.safe_load((ROOT / "_toc.yml").read_text("utf-8"))["chapters"][0]["file"]
    page = placeholder_site / f"{chapter}.html"
    buttons = header_buttons(page.read_text(encoding="utf-8"))
    owner_repo = PLACEHOLDER_REPOSITORY.removeprefix("https://github.com/")
    source = f"{chapter}.md"
    assert buttons["Source repository"] == PLACEHOLDER_REPOSITORY
    assert buttons["Open an issue"].startswith(f"{PLACEHOLDER_REPOSITORY}/issues/new?")
    assert buttons["Suggest edit"] == f"{PLACEHOLDER_REPOSITORY}/edit/{branch}/{source}"
    # Binder builds the repository (postBuild installs the package) and opens the chapter
    # in JupyterLab; Colab, which opens only .ipynb files, is not offered.
    assert buttons["Launch on Binder"] == (
        f"https://mybinder.org/v2/gh/{owner_repo}/{branch}?urlpath=lab/tree/{source}")
    assert "Launch on Colab" not in buttons
    # Still nothing is loaded from another host: the buttons are links.
    parser = _ResourceRefs()
    parser.feed(page.read_text(encoding="utf-8"))
    assert not [url for _, url in parser.refs if _is_external(url)]


def test_the_root_page_gets_the_buttons_too(placeholder_site: Path) -> None:
    root = yaml.safe_load((ROOT / "_toc.yml").read_text("utf-8"))["root"]
    buttons = header_buttons((placeholder_site / f"{root}.html").read_text("utf-8"))
    assert buttons["Source repository"] == PLACEHOLDER_REPOSITORY
    # A page with code cells (a jupytext notebook) can be launched; prose alone cannot.
    assert ("Launch on Binder" in buttons) == ("kernelspec" in _source(root))


# --------------------------------------------------------------------------
# The browser.
# --------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    _require_site()
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    for tool in (CHROMIUM, CHROMEDRIVER):
        if not tool.exists():
            pytest.fail(f"{tool} is missing: run `make system-deps` (Debian chromium, "
                        "chromium-driver)")
    # Never let Selenium Manager look for (or download) a browser or driver.
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="minigpt-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--window-size={WINDOW_WIDTH},1600",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                               options=options)
    browser.set_page_load_timeout(PAGE_TIMEOUT)
    browser.set_script_timeout(PAGE_TIMEOUT)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


@dataclass
class _Page:
    """What the browser saw on one page, once MathJax and the images are done."""

    text: str  # visible text of the article, code and typeset math left out
    math: int  # math elements Sphinx emitted (span.math, div.math)
    typeset: int  # of those, how many hold an mjx-container
    mathjax: str  # "ok", "absent", or the error MathJax's startup promise gave
    proofs: int  # sphinx-proof boxes
    citation_hrefs: list[str]
    bib_entries: int
    broken_images: list[str]
    images: int
    resources: list[str]  # every URL the page loaded
    scrolling: list[str]  # the widest line of each code/output block that scrolls sideways
    page_width: list[int]  # the page's scroll width and the window's, in CSS pixels
    charts: list[list[str]]  # each interactive figure's id and state ("drawn", "error")
    # each drawn figure's text alternative (aria-describedby) and its controls' labels
    chart_labels: dict[str, dict[str, Any]]
    console: list[dict[str, Any]]
    axe: list[dict[str, Any]]  # axe-core's violations: id, impact, nodes (in the article?)


_MATHJAX_DONE = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function wait() {
  const mj = window.MathJax;
  const script = document.querySelector('script[src*="tex-mml-chtml"]');
  if (!script) { done('absent'); return; }
  if (mj && mj.startup && mj.startup.promise) {
    mj.startup.promise.then(() => done('ok'), (e) => done('error: ' + e));
  } else if (Date.now() - started > 50000) {
    done('error: MathJax did not start');
  } else { setTimeout(wait, 50); }
})();
"""

_IMAGES_DONE = """
const done = arguments[arguments.length - 1];
const images = Array.from(document.images);
images.forEach((img) => { img.loading = 'eager'; });
Promise.all(images.map((img) => img.complete ? null :
  new Promise((r) => { img.addEventListener('load', r); img.addEventListener('error', r); })))
  .then(() => done(images.filter((i) => !(i.complete && i.naturalWidth > 0))
                         .map((i) => i.currentSrc || i.src)));
"""

# Resolves once the page's interactive figures are drawn (at once on a page without one);
# returns each figure's id and state.
_CHARTS_DONE = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function wait() {
  if (!document.querySelector('div.minigpt-chart')) { done([]);
  } else if (window.minigptCharts) {
    window.minigptCharts.then(() => done(Array.from(document.querySelectorAll(
      'div.minigpt-chart')).map((c) => [c.id, c.dataset.chartState])));
  } else if (Date.now() - started > 30000) { done('no chart script ran');
  } else { setTimeout(wait, 50); }
})();
"""

_INSPECT = """
const article = document.querySelector('article.bd-article') || document.body;
const chartLabels = {};
for (const chart of document.querySelectorAll('div.minigpt-chart')) {
  const described = document.getElementById(chart.getAttribute('aria-describedby'));
  chartLabels[chart.id.replace('minigpt-chart-', '')] = {
    alt: described ? described.textContent : '',
    controls: Array.from(chart.querySelectorAll('input, select')).map(
      (c) => c.closest('label') ? c.closest('label').textContent.trim() : '')};
}
const clone = article.cloneNode(true);
clone.querySelectorAll('pre, code, script, style, mjx-container, .cell_output')
     .forEach((e) => e.remove());
const math = Array.from(article.querySelectorAll('span.math, div.math'));
return {
  text: clone.textContent,
  math: math.length,
  typeset: math.filter((m) => m.querySelector('mjx-container')).length,
  proofs: article.querySelectorAll('div.admonition.proof').length,
  citation_hrefs: Array.from(article.querySelectorAll('a[href*="bibliography.html#"]'))
                       .map((a) => a.href),
  bib_entries: article.querySelectorAll('div.citation, dl.citation > dt').length,
  images: document.images.length,
  resources: performance.getEntriesByType('resource').map((r) => r.name),
  scrolling: Array.from(article.querySelectorAll('pre'))
                  .filter((p) => p.scrollWidth > p.clientWidth)
                  .map((p) => p.textContent.split('\\n')
                                .reduce((a, b) => (b.length > a.length ? b : a), '')),
  page_width: [document.scrollingElement.scrollWidth, document.scrollingElement.clientWidth],
  chart_labels: chartLabels,
};
"""


# axe-core over the whole page (the theme included), once MathJax is done. Each node of
# a violation says whether it lies in the article (the book's content) or around it.
_AXE = """
const done = arguments[arguments.length - 1];
axe.run(document, {resultTypes: ['violations']}).then((result) => done(
  result.violations.map((v) => ({
    id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.map((n) => {
      const element = document.querySelector(n.target[0]);
      return {target: n.target.join(' '), html: n.html.slice(0, 200),
              article: !!(element && element.closest('article.bd-article'))};
    }),
  }))), (error) => done([{id: 'axe-error', impact: 'critical', help: String(error),
                          nodes: []}]));
"""


@functools.cache
def _axe_source() -> str:
    if not AXE.is_file():
        pytest.fail(f"{AXE} is missing: `make setup` installs it from npm (package.json)")
    return AXE.read_text(encoding="utf-8")


@functools.cache
def _visit(browser: Any, url: str) -> _Page:
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(url)
    mathjax = browser.execute_async_script(_MATHJAX_DONE)
    broken = browser.execute_async_script(_IMAGES_DONE)
    charts = browser.execute_async_script(_CHARTS_DONE)
    seen = browser.execute_script(_INSPECT)
    console = browser.get_log("browser")
    browser.execute_script(_axe_source())
    axe = browser.execute_async_script(_AXE)
    return _Page(mathjax=mathjax, broken_images=broken, charts=charts, console=console, axe=axe,
                 **seen)


@pytest.fixture(params=PAGES)
def page(request: pytest.FixtureRequest, driver: Any, base_url: str) -> tuple[str, _Page]:
    entry: str = request.param
    if not (SITE / f"{entry}.html").exists():
        pytest.fail(f"{entry}.html was not built: run `make book`")
    return entry, _visit(driver, urljoin(base_url, f"{entry}.html"))


@pytest.mark.browser
def test_math_is_typeset(page: tuple[str, _Page]) -> None:
    entry, seen = page
    if seen.math > 0 or DISPLAY_MATH.search(_source(entry)):
        assert seen.math > 0, f"{entry}: the source has math but the page has no math element"
        assert seen.mathjax == "ok", f"{entry}: MathJax {seen.mathjax}"
        assert seen.typeset == seen.math, (
            f"{entry}: only {seen.typeset} of {seen.math} math elements were typeset"
        )
    raw = [d for d in RAW_TEX if d in seen.text]
    assert not raw, f"{entry}: raw TeX {raw} left in the visible text"


@pytest.mark.browser
def test_proofs_are_boxed(page: tuple[str, _Page]) -> None:
    entry, seen = page
    expected = len(PROOF_DIRECTIVE.findall(_source(entry)))
    assert seen.proofs == expected, (
        f"{entry}: {expected} prf directives in the source, {seen.proofs} proof boxes on the page"
    )


@pytest.mark.browser
def test_citations_link_to_entries(page: tuple[str, _Page], base_url: str) -> None:
    entry, seen = page
    roles = CITE_ROLE.findall(_source(entry))
    keys = [k for role in roles for k in role.split(",")]
    assert len(seen.citation_hrefs) >= len(keys), (
        f"{entry}: {len(keys)} cited keys in the source, {len(seen.citation_hrefs)} citation "
        "links on the page"
    )
    for href in seen.citation_hrefs:
        target, fragment = urldefrag(href)
        path = SITE / target.removeprefix(base_url)
        assert fragment and f'id="{fragment}"' in path.read_text(encoding="utf-8"), (
            f"{entry}: citation link {href} leads to no entry"
        )
    if BIBLIOGRAPHY_DIRECTIVE.search(_source(entry)):
        assert seen.bib_entries > 0, f"{entry}: the bibliography lists no entry"


@pytest.mark.browser
def test_images_load(page: tuple[str, _Page]) -> None:
    entry, seen = page
    assert not seen.broken_images, f"{entry}: images that did not load: {seen.broken_images}"


@pytest.mark.browser
def test_interactive_figures_are_drawn(page: tuple[str, _Page]) -> None:
    entry, seen = page
    assert all(state == "drawn" for _, state in seen.charts), f"{entry}: {seen.charts}"
    assert len(seen.charts) == list(CHARTS.values()).count(entry), (entry, seen.charts)


@pytest.mark.browser
def test_console_is_clean(page: tuple[str, _Page]) -> None:
    entry, seen = page
    severe = [e["message"] for e in seen.console if e.get("level") == "SEVERE"]
    assert not severe, f"{entry}: console errors:\n" + "\n".join(severe)


@pytest.mark.browser
def test_nothing_loads_from_other_hosts(page: tuple[str, _Page], base_url: str) -> None:
    entry, seen = page
    foreign = [url for url in seen.resources if not url.startswith(base_url)]
    assert not foreign, f"{entry}: requests to other hosts: {foreign}"


@pytest.mark.browser
def test_code_fits_the_column(page: tuple[str, _Page], driver: Any) -> None:
    entry, seen = page
    width = driver.execute_script("return window.innerWidth")
    assert width >= WINDOW_WIDTH - 20, f"the browser window is {width} px wide"
    assert not seen.scrolling, (
        f"{entry}: {len(seen.scrolling)} code or output blocks scroll sideways at a "
        f"{WINDOW_WIDTH}-px window; their widest lines:\n"
        + "\n".join(f"  ({len(line)} chars) {line[:100]}" for line in seen.scrolling)
    )
    scroll_width, window_width = seen.page_width  # nor the page itself (a wide figure)
    assert scroll_width <= window_width, (
        f"{entry}: the page is {scroll_width} px wide in a {window_width}-px window, so it "
        "scrolls sideways")


# No critical or serious violation anywhere on a page. The theme's own markup had one
# serious violation, label-content-name-mismatch (the search field and the colour-mode
# button); _ext/minigpt_site.py rewrites those buttons.
def _describe(violations: list[dict[str, Any]]) -> str:
    return "\n".join(f"  {v['id']} ({v['impact']}): {v['help']}\n" + "\n".join(
        f"    {n['target']}{' (in the article)' if n['article'] else ''}: {n['html'][:120]}"
        for n in v["nodes"][:5]) for v in violations)


@pytest.mark.browser
def test_no_critical_or_serious_accessibility_violation(page: tuple[str, _Page]) -> None:
    entry, seen = page
    found = [v for v in seen.axe if v["impact"] in ("critical", "serious")]
    assert not found, f"{entry}: axe-core finds violations:\n" + _describe(found)


@pytest.mark.browser
def test_axe_finds_what_it_should(driver: Any) -> None:
    # A check that cannot fail checks nothing: an image without a text alternative and a
    # list without list items must be reported.
    driver.get("about:blank")
    driver.execute_script(
        "document.body.innerHTML = '<main><img src=\"x.png\"><div role=\"list\"><a '"
        " + 'href=\"#\">x</a></div></main>';")
    driver.execute_script(_axe_source())
    found = {v["id"]: v["impact"] for v in driver.execute_async_script(_AXE)}
    assert found.get("image-alt") == "critical" and "aria-required-children" in found, found


# --------------------------------------------------------------------------
# The interactive figures (minigpt.figures.charts.interactive_chart): drawn by the site's own vega,
# and what they draw for a setting of their controls is what the package computes.
# --------------------------------------------------------------------------

CHART_ID = re.compile(r'<div class="minigpt-chart" id="minigpt-chart-([a-z0-9-]+)"')
# Every interactive figure of the book, and the page that shows it.
CHARTS = {"sampling-explorer": "book/sampling", "attention-explorer": "book/attention_heatmaps",
          "rotation-explorer": "book/positional_encodings",
          "training-explorer": "book/training", "induction-explorer": "book/induction_heads"}
JS_BUDGET = 1_000_000  # bytes of vega, vega-lite and vega-embed served (830 kB with 6.4.0)


# The data of every drawn item of the marks whose name starts with arguments[1] (Vega-Lite
# names a unit chart's marks "<name>_<n>_marks" or "<name>_marks").
_DRAWN = """
const [id, prefix] = arguments;
const view = document.getElementById('minigpt-chart-' + id).minigptView;
const found = [];
(function walk(mark) {
  if (mark.marktype && mark.name && mark.name.startsWith(prefix) && mark.name.endsWith('marks')) {
    for (const item of mark.items) { found.push(Object.assign({}, item.datum)); }
  }
  for (const item of mark.items || []) { for (const sub of item.items || []) { walk(sub); } }
})(view.scenegraph().root);
return found;
"""

# Move a range slider of a chart (labelled input, as a reader would) and wait for the redraw.
_SLIDE = """
const [id, name, value] = arguments;
const done = arguments[arguments.length - 1];
const chart = document.getElementById('minigpt-chart-' + id);
const input = chart.querySelector('.vega-bindings input[name="' + name + '"]');
if (!input) { done('no control ' + name); return; }
input.value = String(value);
input.dispatchEvent(new Event('input', {bubbles: true}));
setTimeout(() => chart.minigptView.runAsync().then(() => done(input.value)), 0);
"""

# The drawn element of a chart's item whose data has the given values, scrolled to the middle
# of the window (clear of the page's sticky header) for the mouse to reach it.
_ELEMENT = """
const [id, marktype, wanted] = arguments;
const chart = document.getElementById('minigpt-chart-' + id);
const element = Array.from(chart.querySelectorAll('.mark-' + marktype + ' path')).find((e) =>
  e.__data__ && e.__data__.datum
  && Object.entries(wanted).every(([key, value]) => e.__data__.datum[key] === value));
if (element) { element.scrollIntoView({block: 'center'}); }
return element || null;
"""

_TOOLTIP = """
const done = arguments[arguments.length - 1];
const started = Date.now();
(function wait() {
  const tip = document.getElementById('vg-tooltip-element');
  if (tip && tip.classList.contains('visible') && tip.textContent) { done(tip.textContent);
  } else if (Date.now() - started > 5000) { done('');
  } else { setTimeout(wait, 50); }
})();
"""

_SETTLE = """
const done = arguments[arguments.length - 1];
const view = document.getElementById('minigpt-chart-' + arguments[0]).minigptView;
setTimeout(() => view.runAsync().then(() => done(true)), 0);
"""


def test_every_chart_is_on_its_page() -> None:
    _require_site()
    found = {}
    for entry in PAGES:
        for chart in CHART_ID.findall((SITE / f"{entry}.html").read_text(encoding="utf-8")):
            found[chart] = entry
    assert found == CHARTS


def test_chart_scripts_are_served_once_and_only_where_needed() -> None:
    _require_site()
    vega = SITE / "_static" / "vega"
    sizes = {f.name: f.stat().st_size for f in sorted(vega.glob("*.js"))}
    assert set(sizes) == {"vega.min.js", "vega-lite.min.js", "vega-embed.min.js"}, sizes
    assert sum(sizes.values()) < JS_BUDGET, sizes
    for entry in PAGES:
        page = (SITE / f"{entry}.html").read_text(encoding="utf-8")
        loads = "_static/vega/vega.min.js" in page and "_static/minigpt-charts.js" in page
        assert loads == (entry in CHARTS.values()), f"{entry}: chart scripts loaded: {loads}"


def _chart_page(driver: Any, base_url: str, chart: str) -> None:
    """Open the chart's page afresh and wait until its charts are drawn."""
    driver.get(urljoin(base_url, CHARTS[chart] + ".html"))
    states = driver.execute_async_script(_CHARTS_DONE)
    assert states and all(state == "drawn" for _, state in states), states
    severe = [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe


def _spec(driver: Any, chart: str) -> dict[str, Any]:
    spec: dict[str, Any] = driver.execute_script(
        "return JSON.parse(document.querySelector('#minigpt-chart-' + arguments[0] + "
        "' script.minigpt-chart-spec').textContent);", chart)
    return spec


def _slide(driver: Any, chart: str, name: str, value: float) -> None:
    assert float(driver.execute_async_script(_SLIDE, chart, name, value)) == value


@pytest.mark.browser
def test_controls_are_labelled_and_charts_described(driver: Any, base_url: str) -> None:
    # Read on each chart's page as first drawn, in the visit the page tests above made.
    for chart, entry in CHARTS.items():
        seen = _visit(driver, urljoin(base_url, f"{entry}.html"))
        assert [f"minigpt-chart-{chart}", "drawn"] in seen.charts, (chart, seen.charts)
        found = seen.chart_labels[chart]
        assert len(found["alt"]) > 80, f"{chart}: text alternative {found['alt']!r}"
        assert all(found["controls"]), f"{chart}: unlabelled controls {found['controls']}"
        assert found["controls"] or chart == "training-explorer", f"{chart} has no control"


@pytest.mark.browser
def test_sampling_sliders_draw_the_package_distribution(driver: Any, base_url: str) -> None:
    import torch

    from minigpt.decoding import next_token_distribution, top_p_filter

    chart = "sampling-explorer"
    _chart_page(driver, base_url, chart)
    rows = _spec(driver, chart)["datasets"]["logits"]
    prompt = rows[0]["prompt"]  # the selector's first prompt, shown first
    logits = torch.tensor([r["z"] for r in rows if r["prompt"] == prompt], dtype=torch.float64)
    tokens = [r["token"] for r in rows if r["prompt"] == prompt]
    seen = []
    for tau, k, p in ((1.0, len(tokens), 1.0), (0.7, len(tokens), 0.9), (1.5, 5, 1.0),
                      (2.0, 12, 0.8), (0.5, 3, 1.0)):
        _slide(driver, chart, "temperature", tau)
        _slide(driver, chart, "top_k", k)
        _slide(driver, chart, "top_p", p)
        q = next_token_distribution(logits, temperature=tau, top_k=k, top_p=p)
        drawn = {d["token"]: d["q"] for d in driver.execute_script(_DRAWN, chart, "kept_")}
        assert len(drawn) == 20
        for token, value in drawn.items():
            assert value == pytest.approx(q[tokens.index(token)].item(), abs=1e-9), (
                f"tau={tau}, k={k}, p={p}: {token!r}")
        (summary,) = driver.execute_script(_DRAWN, chart, "summary")
        assert summary["kept_tokens"] == int((q > 0).sum()), (tau, k, p)
        entropy = torch.special.entr(q).sum().item()
        assert summary["entropy"] == pytest.approx(entropy, abs=1e-9)
        tempered = torch.softmax(logits / tau, -1)
        assert summary["kept_mass"] == pytest.approx(tempered[q > 0].sum().item(), abs=1e-9)
        seen.append(tuple(sorted(drawn.items())))
    # The issue's example: the kept tokens for tau = 0.7, p = 0.9 are top_p_filter's.
    _slide(driver, chart, "temperature", 0.7)
    _slide(driver, chart, "top_k", len(tokens))
    _slide(driver, chart, "top_p", 0.9)
    nucleus = top_p_filter(logits / 0.7, 0.9) > float("-inf")
    drawn_kept = {d["token"] for d in driver.execute_script(_DRAWN, chart, "kept_") if d["kept"]}
    in_nucleus = {t for t, keep in zip(tokens, nucleus.tolist(), strict=True) if keep}
    drawn_tokens = {d["token"] for d in driver.execute_script(_DRAWN, chart, "kept_")}
    assert drawn_kept == in_nucleus & drawn_tokens
    assert len(set(seen)) == len(seen), "moving the sliders did not change the drawing"
    # Another prompt: the selector redraws from that prompt's logits.
    from selenium.webdriver.support.ui import Select

    chooser = driver.find_element("css selector", "#minigpt-chart-sampling-explorer select")
    other = Select(chooser).options[-1].text
    Select(chooser).select_by_visible_text(other)
    driver.execute_async_script(_SETTLE, chart)
    logits = torch.tensor([r["z"] for r in rows if r["prompt"] == other], dtype=torch.float64)
    q = next_token_distribution(logits, temperature=0.7, top_p=0.9)
    drawn = {d["token"]: d["q"] for d in driver.execute_script(_DRAWN, chart, "kept_")}
    assert all(v == pytest.approx(q[tokens.index(t)].item(), abs=1e-9) for t, v in drawn.items())


def _book_model() -> Any:
    from minigpt.recipes.pretrained import book_model

    return book_model()


_VISIBLE_BACK = {"␣": " ", "\\n": "\n", "\\t": "\t"}


@pytest.mark.browser
def test_attention_selectors_and_hover_show_the_model_weights(driver: Any,
                                                              base_url: str) -> None:
    import torch
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    chart = "attention-explorer"
    _chart_page(driver, base_url, chart)
    spec = _spec(driver, chart)
    shown = next(p["value"] for p in spec["params"] if p["name"] == "tokens")
    text = "".join(_VISIBLE_BACK.get(t, t) for t in shown)
    model, tokenizer, _ = _book_model()
    with torch.no_grad():
        _, maps = model.forward_with_attention(torch.tensor([tokenizer.encode(text)]))
    selects = driver.find_elements("css selector", f"#minigpt-chart-{chart} select")
    assert len(selects) == 2
    pictures = set()
    for layer, head in ((0, 0), (1, 0), (2, 3), (3, 1)):
        Select(selects[0]).select_by_visible_text(f"layer {layer}")
        Select(selects[1]).select_by_visible_text(f"head {head}")
        driver.execute_async_script(_SETTLE, chart)
        cells = driver.execute_script(_DRAWN, chart, "cells")
        T = len(shown)
        assert len(cells) == T * (T + 1) // 2, "the causal half, one cell per (query, key)"
        expected = maps[layer][0, head]
        for cell in cells:
            assert cell["weight"] == pytest.approx(
                expected[cell["query"], cell["key"]].item(), abs=6e-4), (layer, head, cell)
        pictures.add(tuple(round(c["weight"], 3) for c in cells))
        # Hover one cell, the brightest off the diagonal: the tooltip names it.
        query, key = max(((c["query"], c["key"]) for c in cells if c["key"] < c["query"]),
                         key=lambda qk: expected[qk].item())
        element = driver.execute_script(_ELEMENT, chart, "rect", {"query": query, "key": key})
        ActionChains(driver).move_to_element(element).perform()
        tooltip = driver.execute_async_script(_TOOLTIP)
        assert f"{expected[query, key].item():.3f}" in tooltip, tooltip
        assert shown[query] in tooltip and shown[key] in tooltip, tooltip
    assert len(pictures) == 4, "choosing another layer and head did not change the drawing"


@pytest.mark.browser
def test_rotation_sliders_land_on_the_encoding(driver: Any, base_url: str) -> None:
    from minigpt.nn import sinusoidal_encoding

    chart = "rotation-explorer"
    _chart_page(driver, base_url, chart)
    spec = _spec(driver, chart)
    pairs = sorted({r["pair"] for r in spec["datasets"][spec["data"]["name"]]})
    P = sinusoidal_encoding(96, 48).double()
    drawn_before = None
    for position, offset in ((20, 5), (0, 1), (47, 48), (13, 30)):
        _slide(driver, chart, "position", position)
        _slide(driver, chart, "offset", offset)
        points = []
        rotations = {d["pair"]: d for d in driver.execute_script(_DRAWN, chart, "rotated")}
        rings = {d["pair"]: d for d in driver.execute_script(_DRAWN, chart, "target")}
        assert sorted(rotations) == sorted(rings) == pairs
        for i in pairs:
            rotated, ring = rotations[i], rings[i]
            assert ring["pos"] == position + offset
            # P[p] turned by omega_i k in the browser is the package's P[p + k].
            target = P[position + offset]
            assert rotated["rot_cos"] == pytest.approx(target[2 * i + 1].item(), abs=2e-4)
            assert rotated["rot_sin"] == pytest.approx(target[2 * i].item(), abs=2e-4)
            points.append((rotated["rot_cos"], rotated["rot_sin"]))
        assert points != drawn_before
        drawn_before = points


@pytest.mark.browser
def test_induction_slider_shows_each_snapshot_of_the_copier(driver: Any, base_url: str) -> None:
    from minigpt.recipes.copiers import RECIPES, copier

    history = copier(RECIPES["copy-0"])[2].manifest["history"]
    chart = "induction-explorer"
    _chart_page(driver, base_url, chart)
    drawn_before = None
    for snapshot in (len(history["step"]) - 1, 0, 20, 33):
        _slide(driver, chart, "snapshot", snapshot)
        grid = {(d["layer"], d["head"]): d["score"]
                for d in driver.execute_script(_DRAWN, chart, "grid")}
        expected = {(f"layer {layer}", f"head {head}"): round(score, 2)
                    for layer, row in enumerate(history["induction"][snapshot])
                    for head, score in enumerate(row)}
        assert grid == pytest.approx(expected, abs=1e-9)
        weights = {(d["query"], d["key"]): d["weight"]
                   for d in driver.execute_script(_DRAWN, chart, "pattern")}
        pattern = history["pattern"][snapshot]
        assert len(weights) == len(pattern) * (len(pattern) + 1) // 2  # the causal half
        for (query, key), weight in weights.items():
            assert weight == pytest.approx(pattern[query][key], abs=6e-4)
        assert weights != drawn_before
        drawn_before = weights


@pytest.mark.browser
def test_training_hover_reads_the_schedule_and_the_losses(driver: Any, base_url: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    from minigpt.optim import schedule_lr
    from minigpt.recipes.pretrained import BOOK_RECIPE

    chart = "training-explorer"
    _chart_page(driver, base_url, chart)
    history = _book_model()[2].manifest["history"]
    assert driver.execute_script(_DRAWN, chart, "readout") == []  # nothing hovered yet
    steps = [d["step"] for d in driver.execute_script(_DRAWN, chart, "steps")]
    read = []
    for wanted in steps[3:: max(1, len(steps) // 5)]:
        element = driver.execute_script(_ELEMENT, chart, "symbol", {"step": wanted})
        ActionChains(driver).move_to_element(element).perform()
        driver.execute_async_script(_SETTLE, chart)
        (shown,) = driver.execute_script(_DRAWN, chart, "readout")
        step = shown["step"]
        assert step == wanted
        assert shown["lr"] == pytest.approx(schedule_lr(step, BOOK_RECIPE.training), rel=1e-5)
        assert shown["loss"] == pytest.approx(history["loss"][step], abs=1e-4)
        read.append(step)
    assert len(set(read)) == len(read) > 1, read


@pytest.mark.browser
def test_charts_are_drawn_under_a_sub_path(driver: Any) -> None:
    # A site hosted under a sub-path (https://owner.github.io/book/) finds its scripts too:
    # every page refers to _static/ by a relative path.
    prefix = "/a/sub-path/"

    class Handler(_QuietHandler):
        def translate_path(self, path: str) -> str:
            if not path.startswith(prefix):
                return str(SITE / "no-such-file")
            return super().translate_path("/" + path[len(prefix):])

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}{prefix}"
        for chart in CHARTS:
            _chart_page(driver, base, chart)
    finally:
        server.shutdown()
        server.server_close()
