"""tools/linkcheck.py, the weekly check of the book's external links (links.yml).

The real check needs the network, which tests do not have; here it runs over a one-page
book whose links point at a server on this machine: a page that answers, one that is
missing, a port where nothing listens, and a host on the ignore list.
"""

from __future__ import annotations

import http.server
import importlib.util
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "linkcheck.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("linkcheck", TOOL)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    """A local web server with one page, ok.html; yields its base address."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "ok.html").write_text("<p>here</p>", encoding="utf-8")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_ignored_host_says_why() -> None:
    ignored = _tool().IGNORED
    assert ignored, "no host is ignored: drop the list's mention in links.yml"
    for pattern, reason in ignored.items():
        re.compile(pattern)
        assert pattern.startswith("https://"), pattern
        assert len(reason.split()) >= 8, f"{pattern}: say why its answers cannot be trusted"


@pytest.mark.slow
def test_the_link_check_reports_missing_and_unreachable_links(tmp_path: Path, site: str) -> None:
    book = tmp_path / "book"
    book.mkdir()
    (book / "_config.yml").write_text("title: links\nonly_build_toc_files: true\n",
                                      encoding="utf-8")
    (book / "_toc.yml").write_text("format: jb-book\nroot: index\n", encoding="utf-8")
    dead = f"http://127.0.0.1:{_closed_port()}/gone"
    (book / "index.md").write_text(
        "# Links\n\n"
        f"[answers]({site}/ok.html), [missing]({site}/missing.html), [nobody]({dead}),\n"
        "[ignored](https://github.com/karpathy/nanoGPT).\n", encoding="utf-8")
    out = tmp_path / "report"
    result = subprocess.run([sys.executable, str(TOOL), "--root", str(book), "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    statuses = {link["uri"]: link["status"] for link in _tool().read_report(out)}
    assert statuses == {f"{site}/ok.html": "working", f"{site}/missing.html": "broken",
                        dead: "broken", "https://github.com/karpathy/nanoGPT": "ignored"}
    assert f"broken: {site}/missing.html (index.md:3)" in result.stdout
    assert f"broken: {dead} (index.md:3)" in result.stdout
    assert "404" in (out / "output.txt").read_text(encoding="utf-8")
