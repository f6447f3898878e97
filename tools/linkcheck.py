"""Check the book's external links: `make linkcheck` (CI: .github/workflows/links.yml, weekly).

Sphinx's linkcheck builder, run through Jupyter Book with the book's own configuration
(_config.yml, _toc.yml), requests every external link of the chapters and of the
bibliography page, which renders references.bib (its `url` and `doi` fields). The
chapters are not executed: their links are in their text, not in their outputs. Internal
links and anchors are not checked here: the site's build (`-W`) already fails on them.

The report is _build/linkcheck/output.txt (the failures) and output.json (every link, one
JSON object a line); the command prints a summary and exits 1 if a link is broken or
timed out. It needs the network, so it is not part of `make test`.

    .venv/bin/python tools/linkcheck.py
    .venv/bin/python tools/linkcheck.py --root OTHER_BOOK --out OTHER_BOOK/_build/linkcheck
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Hosts whose answers to a link checker say nothing about the link, each with the reason.
# Their links are reported as "ignored", never requested.
IGNORED: dict[str, str] = {
    r"https://github\.com/": (
        "GitHub rate-limits requests without a login, and CI runners share their addresses "
        "with many other jobs: it answers 429 Too Many Requests (or 403) at random"),
    r"https://doi\.org/10\.3390/": (
        "MDPI's journals (DOI prefix 10.3390) answer automated clients with 403 Forbidden "
        "while the same page opens in a browser"),
}

FAILED = ("broken", "timeout")


def settings() -> dict[str, Any]:
    """Sphinx settings for the link check, on top of the book's own."""
    return {
        "nb_execution_mode": "off",
        "linkcheck_ignore": list(IGNORED),
        "linkcheck_timeout": 30,
        "linkcheck_retries": 3,
        "linkcheck_workers": 4,
        # A server that answers 429 is asked again after the delay it names, for up to 5 min.
        "linkcheck_rate_limit_timeout": 300.0,
        "linkcheck_report_timeouts_as_broken": False,  # their own status; they fail too
        "linkcheck_allow_unauthorized": False,  # a page a reader cannot open is broken
    }


def check_links(root: Path, out: Path) -> int:
    """Run the linkcheck builder over the book in root; its report goes to out. Sphinx's status."""
    from jupyter_book.sphinx import build_sphinx

    out.mkdir(parents=True, exist_ok=True)
    overrides = {**settings(), "external_toc_path": (root / "_toc.yml").as_posix(),
                 "latex_individualpages": False}  # what `jupyter-book build` passes too
    result = build_sphinx(root, out, noconfig=True, path_config=str(root / "_config.yml"),
                          confoverrides=overrides, builder="linkcheck",
                          doctreedir=out / ".doctrees", freshenv=True, keep_going=True)
    if isinstance(result, Exception):
        raise result
    return int(result)


def read_report(out: Path) -> list[dict[str, Any]]:
    """The links of output.json, one dict each (filename, lineno, status, code, uri, info)."""
    lines = (out / "output.json").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summary(links: list[dict[str, Any]]) -> str:
    counts = Counter(link["status"] for link in links)
    lines = ["links: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))]
    for link in links:
        if link["status"] in FAILED:
            lines.append(f"{link['status']}: {link['uri']} ({link['filename']}:{link['lineno']})"
                         f" - {link['info']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the book (holds _config.yml)")
    parser.add_argument("--out", type=Path, help="report folder (default: ROOT/_build/linkcheck)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    out = (args.out or root / "_build" / "linkcheck").resolve()
    os.chdir(root)  # as `jupyter-book build` runs: _config.yml's paths are relative to it
    status = check_links(root, out)
    links = read_report(out)
    print(summary(links))
    print(f"report: {out / 'output.txt'} and output.json")
    failed = any(link["status"] in FAILED for link in links)
    return 1 if status or failed else 0


if __name__ == "__main__":
    sys.exit(main())
