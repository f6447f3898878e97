"""The book's own additions to Jupyter Book's site (a Sphinx extension).

1. One setting for a fork: `repository.url` in `_config.yml`. Left empty, the
   pages show no repository, issue, edit or launch button and refer to no other
   host. Set to a GitHub repository, the pages get the repository, issue and
   edit buttons, and each chapter gets a launch button for Binder (JupyterLab,
   with the package installed by `postBuild`), all derived here from that URL and
   `repository.branch`. There is no Colab button: Colab opens only `.ipynb` files
   from GitHub (the chapters are MyST markdown), and a notebook it opens arrives
   without the repository, whose URL its first cell would then need in a second
   place a fork edits.
2. The download menu of every page offers the whole book as one PDF (`make pdf`
   writes it and puts a copy at the root of the site, PDF_NAME) next to the
   chapter's own source.
3. A print style sheet (static/minigpt-print.css): the side bars and buttons
   stay off paper, code wraps instead of being cut, solutions print open.
4. Accessibility fixes for what axe-core finds in the markup our tools write
   (static/minigpt-a11y.css and fix_markup below; tests/book/test_site.py runs axe).
5. The interactive figures (`minigpt.figures.charts.interactive_chart`): a page that shows one
   loads vega, vega-lite and vega-embed (copied from npm to _static/vega/ by the
   Makefile) and static/minigpt-charts.js, which draws them; other pages load none of it.
6. The playground (a raw ``<div class="minigpt-playground">`` in a chapter): a page that
   holds one loads static/minigpt-playground.js, which builds the form and, when the reader
   first asks for text, onnxruntime-web and the models `make playground` exported
   (_static/onnxruntime/, _static/playground/). Each playground gets its static twin here,
   for paper and for a reader without scripts: a greedy sample of the model it opens with,
   from playground.json.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.config import Config

PDF_NAME = "minigpt-book.pdf"
BINDERHUB_URL = "https://mybinder.org"
REPOSITORY_BUTTONS = ("use_repository_button", "use_issues_button", "use_edit_page_button")
STATIC = Path(__file__).resolve().parent / "static"


def derive_buttons(app: Sphinx, config: Config) -> None:
    """Turn the repository URL (or its absence) into the theme's button options."""
    options: dict[str, Any] = dict(config.html_theme_options)
    url = str(options.get("repository_url") or "").strip().rstrip("/")
    launch = dict(options.get("launch_buttons") or {})
    if url:
        if not url.startswith("https://github.com/") or url.count("/") != 4:
            raise ValueError("repository.url in _config.yml must be a GitHub repository, "
                             f"https://github.com/OWNER/NAME (got {url!r})")
        options["repository_url"] = url
        options.update(dict.fromkeys(REPOSITORY_BUTTONS, True))
        launch.update(notebook_interface="jupyterlab", binderhub_url=BINDERHUB_URL,
                      colab_url="")
    else:
        options.update(dict.fromkeys(REPOSITORY_BUTTONS, False))
        launch.update(binderhub_url="", colab_url="", jupyterhub_url="", thebe=False)
    options["launch_buttons"] = launch
    config.html_theme_options = options


def add_static_files(app: Sphinx, config: Config) -> None:
    config.html_static_path = [*config.html_static_path, str(STATIC)]
    app.add_css_file("minigpt-a11y.css")
    app.add_css_file("minigpt-print.css", media="print")
    app.add_css_file("minigpt-charts.css")
    app.add_css_file("minigpt-playground.css")


# Deferred, in this order, before the page's DOMContentLoaded: vega-embed needs vega and
# vega-lite, and minigpt-charts.js needs all three.
CHART_SCRIPTS = ("vega/vega.min.js", "vega/vega-lite.min.js", "vega/vega-embed.min.js",
                 "minigpt-charts.js")
CHART_MARKER = 'class="minigpt-chart"'  # the container minigpt.figures.charts.interactive_chart writes


def add_chart_scripts(app: Sphinx, pagename: str, templatename: str,
                      context: dict[str, Any], doctree: Any) -> None:
    """Load the chart scripts on the pages (the single page too) that show a chart."""
    if CHART_MARKER in str(context.get("body", "")):
        for number, script in enumerate(CHART_SCRIPTS):
            app.add_js_file(script, priority=800 + number, loading_method="defer")


PLAYGROUND_MARKER = 'class="minigpt-playground"'
PLAYGROUND_JSON = Path("_playground") / "playground" / "playground.json"
_PLAYGROUND = re.compile(r'<div class="minigpt-playground"([^>]*)>\s*</div>')
_DATA_MODEL = re.compile(r'data-model="([^"]+)"')


def add_playground(app: Sphinx, pagename: str, templatename: str,
                   context: dict[str, Any], doctree: Any) -> None:
    """Load the playground's script on the pages that hold one, and fill each playground
    with its static twin: the prompt and a greedy sample of its model."""
    body = str(context.get("body", ""))
    if PLAYGROUND_MARKER not in body:
        return
    app.add_js_file("minigpt-playground.js", priority=900, loading_method="defer")
    path = Path(app.srcdir) / PLAYGROUND_JSON
    if not path.is_file():
        raise RuntimeError(f"{pagename} holds a playground but {path} is missing: "
                           "run `make playground` (make book does) before building")
    models = json.loads(path.read_text(encoding="utf-8"))["models"]

    def twin(match: re.Match[str]) -> str:
        attributes = match.group(1)
        found = _DATA_MODEL.search(attributes)
        model = models[found.group(1) if found else "book"]
        label = html.escape(model["label"])
        note = ("In the online edition this is a playground: the book's models write here, "
                "in the reader's browser, from any prompt, with the temperature, top-k, "
                "top-p and seed the reader chooses, and the attention of every layer and "
                f"head over what they wrote is drawn. This is what the {label} writes "
                "greedily (temperature 0):")
        sample = (f'<pre class="minigpt-playground-sample"><span class="minigpt-playground-'
                  f'prompt">{html.escape(model["prompt"])}</span>'
                  f'{html.escape(model["sample"])}</pre>')
        return (f'<div class="minigpt-playground"{attributes}>\n'
                f'<div class="minigpt-playground-static">\n<p>{note}</p>\n{sample}\n'
                f'</div>\n</div>')

    context["body"] = _PLAYGROUND.sub(twin, body)


# myst-nb labels the summary of a folded cell "Toggle hidden content" while it shows
# "Show code cell source": a name that differs from the visible label (WCAG 2.5.3).
# Without the label the summary is named by what it shows.
_TOGGLE_LABEL = re.compile(r'(<summary)\s+aria-label="Toggle hidden content"')
# docutils gives each bibliography entry the role doc-biblioentry, deprecated in ARIA
# and not allowed inside the role=list it also writes, which then has no list items.
_BIBLIOENTRY = re.compile(r'(<div class="citation"[^>]*?)\srole="doc-biblioentry"')


def fix_markup(app: Sphinx, pagename: str, templatename: str,
               context: dict[str, Any], doctree: Any) -> None:
    body = context.get("body")
    if isinstance(body, str):
        body = _TOGGLE_LABEL.sub(r"\1", body)
        context["body"] = _BIBLIOENTRY.sub(r'\1 role="listitem"', body)


# The theme's buttons whose accessible name differs from what they show (WCAG 2.5.3,
# axe-core's label-content-name-mismatch): the search field is labelled "Search" but shows
# "Search Ctrl+K", so it loses the label and is named by its text; the colour-mode button's
# icons carry titles ("Light", "Dark", ...), which Font Awesome's script turns into text
# inside the button that is not its name "Color mode": the icons lose their titles (the
# button's tooltip names it) and are hidden from assistive technology, as decorative
# icons are.
_SEARCH_FIELD_LABEL = re.compile(
    r'(<button class="btn search-button-field [^"]*"[^>]*?)\s+aria-label="Search"')
_THEME_ICON = re.compile(r'(<i class="theme-switch [^"]*"[^>]*?)\s+title="[^"]*"([^>]*?)(\s*>)')


def fix_theme_markup(app: Sphinx, exception: Exception | None) -> None:
    """Rewrite the theme's buttons in every written page (they come from its templates,
    outside the page body that `fix_markup` sees)."""
    if exception is not None or app.builder.format != "html":
        return
    for page in Path(app.outdir).rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        fixed = _SEARCH_FIELD_LABEL.sub(r"\1", html)
        fixed = _THEME_ICON.sub(r'\1\2 aria-hidden="true"\3', fixed)
        if fixed != html:
            page.write_text(fixed, encoding="utf-8")


def offer_the_book_pdf(app: Sphinx, pagename: str, templatename: str,
                       context: dict[str, Any], doctree: Any) -> None:
    """Add the whole book's PDF to the page's download menu (after the theme built it)."""
    for button in context.get("header_buttons", []):
        if button.get("label") == "download-buttons":
            button["buttons"].append({
                "type": "link",
                "url": context["pathto"](PDF_NAME, 1),
                "text": "book (.pdf)",
                "tooltip": "Download the whole book as one PDF",
                "icon": "fas fa-book",
                "label": "download-book-pdf-button",
            })


def setup(app: Sphinx) -> dict[str, Any]:
    # Before sphinx-book-theme's own config-inited handlers read the options (priority 500).
    app.connect("config-inited", derive_buttons, priority=400)
    app.connect("config-inited", add_static_files)
    # The theme fills the header buttons at priority 501.
    app.connect("html-page-context", offer_the_book_pdf, priority=600)
    app.connect("html-page-context", fix_markup)
    app.connect("html-page-context", add_chart_scripts)
    app.connect("html-page-context", add_playground)
    app.connect("build-finished", fix_theme_markup)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
