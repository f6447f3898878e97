"""The book's trained models, published beside its site: fetched, verified, never trusted.

Set-up trains every model the chapters load (`minigpt.recipes.catalogue.MODELS`: about 40
CPU-minutes on a 2-core machine). The workflow that publishes the site also publishes each
of them (`tools/publish.py`) in a folder ``models/`` beside the pages:

    <weights sha256>.safetensors   the weights, as the cache holds them (tensors only)
    <record sha256>.json           the model's manifest (`record_sha256`)
    index.json                     name -> what tests/notebooks/models.json holds for it
    runs.json                      the chapters' kept runs (`minigpt.recipes.runs`), published
                                   the same way: key -> what tests/notebooks/runs.json holds

What a fetched model must be is never read from the server: the repository's
`tests/notebooks/models.json` (`INDEX`) holds, for each model, the cache key it was trained
at, the sha256 and size of its weights and the sha256 of its record (its manifest without
what a rerun measures differently: times and speeds, `VOLATILE`). `fetch`, called by
`minigpt.recipes.pretrained.cached_model` for a model missing from the cache, looks its key up
there, downloads the weights from `base_url()` while hashing them, and keeps the model only
if the hash, the size and the record all match; it is then written to the cache as a
trained model would be (weights first, manifest last, each atomically). Anything else (no
site configured, fetching turned off, the server unreachable or silent, a file missing,
truncated or not the one expected) is said, in one line, and `fetch` returns False: the
model is trained, as it would be without a site. A site that does not answer at all is not
asked again by the same process. Nothing half-written stays in the cache.

Where from: ``$MINIGPT_MODELS_URL``, an ``http://``, ``https://`` or ``file://`` address of
such a folder, or ``off``; unset, the book's own site: `_config.yml`'s ``repository.url``
(``https://github.com/OWNER/NAME``) gives ``https://OWNER.github.io/NAME/models``. With no
repository configured (or outside a clone of the book), nothing is fetched.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import textwrap
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minigpt.files import MANIFEST_NAME, WEIGHTS_NAME, atomic_write

log = logging.getLogger(__name__)

#: The clone of the book this package is installed from (an editable install).
ROOT = Path(__file__).resolve().parents[3]  # src/minigpt/recipes/published.py
#: What each published model must be: name -> key, weights' sha256 and size, record's sha256.
INDEX = ROOT / "tests" / "notebooks" / "models.json"
#: What each published run of a chapter must be (`minigpt.recipes.runs`): key -> its chapter,
#: weights' sha256 and size, record's sha256.
RUNS = ROOT / "tests" / "notebooks" / "runs.json"
CONFIG = ROOT / "_config.yml"
#: The environment variable that says where the published models are, or ``off``.
URL_VARIABLE = "MINIGPT_MODELS_URL"
#: Seconds to wait for a server to connect or to send the next bytes.
TIMEOUT = 30.0
#: A manifest larger than this is not one of the book's (theirs are under 2 MB).
MAX_MANIFEST_BYTES = 64 << 20
#: What a rerun of the same training measures differently (times and speeds): left out of
#: a manifest's record. Everything else in a manifest follows from the weights' training.
VOLATILE = {"metrics": ("median_step_ms", "tokens_per_second", "train_seconds",
                        "total_seconds", "train_cpu_seconds"),
            "history": ("step_ms",)}


#: The environment the book's models and kept runs are trained in, as
#: `minigpt.recipes.pretrained.environment` records it in their keys: Linux x86-64, the pinned
#: PyTorch's CPU build, its kernels pinned to AVX2 (`minigpt.PINNED_CPU_KERNELS`) and the
#: package's own products. A machine whose environment differs in any of these trains other
#: bits; it uses the book's models instead (`book_material`). tests/test_published.py checks
#: that the machine that runs the tests, the one that publishes, is in this environment.
BOOK_ENVIRONMENT: dict[str, Any] = {
    "torch": "2.13.0+cpu", "cpu_kernels": "AVX2",
    "kernel_settings": {"MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "products": "fma chains"}
#: Whether this process has said that it uses the book's models (`said_once`).
_SAID: list[str] = []


def book_material(material: dict[str, Any]) -> dict[str, Any] | None:
    """The key material of the book's own model of ``material`` (a model's or a kept run's,
    `minigpt.recipes.pretrained.model_material`) where this machine's environment is not
    `BOOK_ENVIRONMENT`: the same recipe, code and parent, in the book's environment. None
    where the environment is the book's (the machine trains the book's bits itself) or the
    draw is another (``seed_shift``: a redraw wants its own models)."""
    if material.get("seed_shift") or all(material.get(name) == value
                                          for name, value in BOOK_ENVIRONMENT.items()):
        return None
    return material | BOOK_ENVIRONMENT


def said_once(material: dict[str, Any]) -> None:
    """Say, once a process, on standard error, that the book's own models are used on this
    machine, which computes with other bits: what of its environment differs."""
    if _SAID:
        return
    differs = [f"{name} {material.get(name)!r}, not {value!r}"
               for name, value in BOOK_ENVIRONMENT.items() if material.get(name) != value]
    _SAID.append("; ".join(differs))
    said = (f"minigpt: this machine trains other bits than the book's ({_SAID[0]}). It uses "
            "the book's models as published, trained on Linux x86-64 with PyTorch's CPU build "
            "and the package's own matrix products; what it computes with them may differ "
            "from the book's printed numbers in the last digits.")
    print(textwrap.fill(said, 88), file=sys.stderr, flush=True)


class FetchError(RuntimeError):
    """Why a published model is not used (said in one line, then the model is trained)."""


class Unreachable(FetchError):
    """The site did not answer at all (refused, unresolved, silent): asking it again for the
    next model would only wait again."""


#: The sites this process found unreachable: nothing more is asked of them (a chapter that
#: fetches dozens of runs from a site that hangs waits `TIMEOUT` once, not once a run).
_UNREACHABLE: set[str] = set()


def record(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest without its `VOLATILE` entries."""
    kept = dict(manifest)
    for part, names in VOLATILE.items():
        if isinstance(kept.get(part), dict):
            kept[part] = {k: v for k, v in kept[part].items() if k not in names}
    return kept


def record_sha256(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of the manifest's `record`."""
    canonical = json.dumps(record(manifest), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def entry(folder: Path) -> dict[str, Any]:
    """What `INDEX` holds of the model cached in ``folder`` (already verified by loading)."""
    manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    return {"key": manifest["key"], "weights_sha256": manifest["weights_sha256"],
            "weights_bytes": (folder / WEIGHTS_NAME).stat().st_size,
            "record_sha256": record_sha256(manifest)}


def index() -> dict[str, dict[str, Any]]:
    """`INDEX`: name -> `entry`; empty outside a clone of the book."""
    if not INDEX.is_file():
        return {}
    stored: dict[str, dict[str, Any]] = json.loads(INDEX.read_text(encoding="utf-8"))
    return stored


def runs_index() -> dict[str, dict[str, Any]]:
    """`RUNS`: key -> the chapter that trains the run, and its `entry`; empty outside a clone
    of the book."""
    if not RUNS.is_file():
        return {}
    stored: dict[str, dict[str, Any]] = json.loads(RUNS.read_text(encoding="utf-8"))
    return stored


def _expected(key: str) -> tuple[str, dict[str, Any], str] | None:
    """What the stored indexes say the model or run of cache key ``key`` must be, a name for
    it and the index that says so; None if neither holds it."""
    found = [(f"{name} model", e, "tests/notebooks/models.json")
             for name, e in index().items() if e["key"] == key]
    if found:
        return found[0]
    run = runs_index().get(key)
    return None if run is None else (f"{run['chapter']} chapter's run {key[:12]}", run,
                                     "tests/notebooks/runs.json")


def base_url() -> str | None:
    """Where the published models are (no trailing slash), or None: fetch nothing."""
    given = os.environ.get(URL_VARIABLE)
    if given is not None:
        given = given.strip()
        if given == "off":
            return None
        if not given.startswith(("http://", "https://", "file://")):
            raise ValueError(f"{URL_VARIABLE}={given!r} is not an address: give the http://, "
                             "https:// or file:// address of a folder of published models "
                             "(tools/publish.py writes one), or 'off' to fetch nothing")
        return given.rstrip("/")
    if not CONFIG.is_file():
        return None
    found = re.search(r"^repository:\s*\n(?:\s+#.*\n|\s+\w+:.*\n)*?\s+url:\s*[\"']?"
                      r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?[\"']?\s*(?:#.*)?$",
                      CONFIG.read_text(encoding="utf-8"), flags=re.MULTILINE)
    if found is None:
        return None
    owner, name = found.groups()
    return f"https://{owner.lower()}.github.io/{name}/models"


def fetch(key: str, folder: Path, *, progress: bool = False,
          say: Callable[[str], None] = log.info) -> bool:
    """Fetch the published model of cache key ``key`` into the cache folder ``folder``;
    False, after saying why, if it is not published, not reachable or not the one `INDEX`
    holds (the caller then trains it)."""
    url = base_url()
    if url is None:
        return False
    found = _expected(key)
    if found is None or url in _UNREACHABLE:
        return False
    name, expected, stored = found
    partial = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp")
        os.close(fd)
        partial = Path(tmp)
        weights_url = f"{url}/{expected['weights_sha256']}.safetensors"
        _download(weights_url, partial, expected["weights_sha256"], expected["weights_bytes"],
                  label=name, progress=progress, stored=stored)
        manifest = _manifest(f"{url}/{expected['record_sha256']}.json", key, expected, stored)
        if folder.exists():
            shutil.rmtree(folder)  # whatever was there was found unusable
        folder.mkdir(parents=True)
        os.replace(partial, folder / WEIGHTS_NAME)
        partial = None
        atomic_write(folder / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    except FetchError as why:
        if isinstance(why, Unreachable):
            _UNREACHABLE.add(url)
        later = "; nothing more is fetched from there" if isinstance(why, Unreachable) else ""
        say(f"the {name} is not fetched: {why}; it is trained instead{later}")
        return False
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
    say(f"the {name} is fetched from {url} ({expected['weights_bytes'] / 1e6:.1f} MB), "
        f"its sha256 the one {stored} holds")
    return True


def _download(url: str, path: Path, sha256: str, size: int, *, label: str,
              progress: bool, stored: str) -> None:
    """Write what ``url`` serves to ``path``, hashing it as it arrives; `FetchError` unless
    it is ``size`` bytes of sha256 ``sha256``."""
    digest, got = hashlib.sha256(), 0
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"fetching the {label}",
               disable=not (progress and sys.stderr.isatty()), leave=False)
    with _answers(url) as response, path.open("wb") as out, bar:
        while chunk := _read(response, url):
            got += len(chunk)
            if got > size:
                raise FetchError(f"{url} sends more than the {size:,} bytes expected")
            digest.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
    if got < size:
        raise FetchError(f"{url} ended after {got:,} of {size:,} bytes (truncated)")
    if digest.hexdigest() != sha256:
        raise FetchError(f"{url} has sha256 {digest.hexdigest()[:12]}..., not the "
                         f"{sha256[:12]}... that {stored} holds")


def _manifest(url: str, key: str, expected: dict[str, Any], stored: str) -> dict[str, Any]:
    """The manifest ``url`` serves, if it is the record `INDEX` holds for ``key``."""
    with _answers(url) as response:
        data = b""
        while chunk := _read(response, url):
            data += chunk
            if len(data) > MAX_MANIFEST_BYTES:
                raise FetchError(f"{url} sends more than {MAX_MANIFEST_BYTES:,} bytes")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FetchError(f"{url} is not a JSON manifest ({type(err).__name__})") from None
    if not isinstance(manifest, dict) or record_sha256(manifest) != expected["record_sha256"]:
        raise FetchError(f"{url} is not the record that {stored} holds (its sha256 differs)")
    if manifest.get("key") != key or manifest.get("weights_sha256") != expected["weights_sha256"]:
        raise FetchError(f"{url} is the record of another model than its entry in {stored} "
                         "(key or weights differ)")
    return manifest


def _answers(url: str) -> Any:
    """The open response of ``url``; `FetchError` says why there is none."""
    try:
        return urllib.request.urlopen(url, timeout=TIMEOUT)  # noqa: S310 (http, https, file)
    except urllib.error.HTTPError as err:
        raise FetchError(f"{url} answered HTTP {err.code} ({err.reason})") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError | socket.timeout):
            raise Unreachable(f"{url} did not answer within {TIMEOUT:g} s") from None
        raise Unreachable(f"{url} is unreachable ({err.reason})") from None
    except TimeoutError:
        raise Unreachable(f"{url} did not answer within {TIMEOUT:g} s") from None
    except (OSError, http.client.HTTPException) as err:
        raise Unreachable(f"{url} is unreachable ({type(err).__name__}: {err})") from None


def _read(response: Any, url: str) -> bytes:
    """The next bytes of ``response``; `FetchError` if the server stops or breaks off."""
    try:
        chunk: bytes = response.read(1 << 16)
    except TimeoutError:
        raise FetchError(f"{url} stopped sending for {TIMEOUT:g} s") from None
    except http.client.IncompleteRead:
        raise FetchError(f"{url} broke off before its end (truncated)") from None
    except (OSError, http.client.HTTPException) as err:
        raise FetchError(f"the connection to {url} broke ({type(err).__name__})") from None
    return chunk


def publish(folder: Path, out: Path, found: dict[str, Any] | None = None) -> dict[str, Any]:
    """Put the model cached (and verified) in ``folder`` into the published folder ``out``,
    named by its hashes; its `entry` (``found``, if the caller has it already)."""
    found = entry(folder) if found is None else found
    out.mkdir(parents=True, exist_ok=True)
    _link_or_copy(folder / WEIGHTS_NAME, out / f"{found['weights_sha256']}.safetensors")
    _link_or_copy(folder / MANIFEST_NAME, out / f"{found['record_sha256']}.json")
    return found


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` where the file system allows, else a copy."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
