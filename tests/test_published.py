"""Published models: fetched from a site, verified against the stored index, else trained.

A tiny recipe is trained once into a publisher's cache and published into a folder
(`minigpt.recipes.published.publish`), which a local HTTP server serves as it is, tampered with,
cut short, without the file, or not at all; a reader's empty cache then asks for the model.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT

from minigpt import products
from minigpt.config import TrainConfig
from minigpt.files import cache_dir
from minigpt.recipes import catalogue, pretrained, published
from minigpt.recipes.pretrained import MANIFEST_NAME, WEIGHTS_NAME, Recipe, load_or_build

TEXT = ("ROMEO:\nBut, soft! what light through yonder window breaks?\n\n"
        "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n\n") * 20
#: The cache set-up filled, and the index stored beside the chapters' outputs.
SET_UP_CACHE = cache_dir()
STORED_INDEX = published.index
TINY = Recipe(n_layers=1, n_heads=2, d_model=16, context_length=16,
              training=TrainConfig(batch_size=4, max_steps=10, warmup_steps=2,
                                   eval_interval=5, eval_steps=2, seed=0))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The tiny model, trained once into a publisher's cache and published into a folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(published.URL_VARIABLE, "off")
        _, _, info = load_or_build(TINY, TEXT, cache=tmp_path_factory.mktemp("publisher"))
    folder = tmp_path_factory.mktemp("site")
    return folder, published.publish(info.path, folder)


@pytest.fixture(autouse=True)
def reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           site: tuple[Path, dict[str, Any]]) -> Path:
    """An empty cache whose index holds the tiny model, and a count of training runs."""
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(published, "index", lambda: {"tiny": site[1]})
    monkeypatch.setattr(published, "_UNREACHABLE", set())  # no site given up on yet
    return tmp_path / "cache"


@pytest.fixture
def trainings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs: list[int] = []
    train = pretrained.train

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return train(*args, **kwargs)

    monkeypatch.setattr(pretrained, "train", counted)
    return runs


class _Site(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; ``cut`` sends only the first half of each file, under its full
    length."""

    cut = False
    requests: list[str]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.requests.append(self.path)
        path = Path(self.translate_path(self.path))
        if not self.cut or not path.is_file():
            super().do_GET()
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        self.close_connection = True


@contextlib.contextmanager
def serving(folder: Path, *, cut: bool = False) -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server of ``folder``: its address and the paths it was asked for."""
    requests: list[str] = []
    handler = type("Handler", (_Site,), {"cut": cut, "requests": requests})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def _served(site: tuple[Path, dict[str, Any]], tmp_path: Path,
            change: str | None = None) -> Path:
    """A copy of the published folder with one change: ``tamper`` (one byte of the weights
    flipped), ``missing`` (no weights), ``record`` (a loss of the manifest changed)."""
    folder = tmp_path / "served"
    shutil.copytree(site[0], folder)
    weights = folder / f"{site[1]['weights_sha256']}.safetensors"
    manifest = folder / f"{site[1]['record_sha256']}.json"
    if change == "tamper":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
    elif change == "missing":
        weights.unlink()
    elif change == "record":
        record = json.loads(manifest.read_text(encoding="utf-8"))
        record["metrics"]["final_val_loss"] += 0.25
        manifest.write_text(json.dumps(record), encoding="utf-8")
    return folder


def _left_in(cache: Path) -> list[str]:
    """What the cache's models folder holds, lock files aside."""
    return sorted(str(p.relative_to(cache / "models")) for p in (cache / "models").rglob("*")
                  if not p.name.endswith(".lock"))


def test_a_published_model_is_fetched_verified_and_not_trained(
        site: tuple[Path, dict[str, Any]], reader: Path, trainings: list[int],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="minigpt")
    with serving(site[0]) as (url, requests):
        monkeypatch.setenv(published.URL_VARIABLE, url)
        model, _, info = load_or_build(TINY, TEXT)
        assert info.fetched and not info.built and trainings == []
        assert "tiny model is fetched" in caplog.text
        assert info.manifest["weights_sha256"] == site[1]["weights_sha256"]
        assert published.entry(info.path) == site[1]
        assert _left_in(reader) == sorted([info.path.name, f"{info.path.name}/{MANIFEST_NAME}",
                                           f"{info.path.name}/{WEIGHTS_NAME}"])
        asked = len(requests)
        assert asked == 2  # the weights and the manifest
        # The second call loads the cache and asks the site nothing.
        again, _, info2 = load_or_build(TINY, TEXT)
        assert not info2.fetched and not info2.built and len(requests) == asked
    # What training would have made, bit for bit.
    monkeypatch.setenv(published.URL_VARIABLE, "off")
    trained, _, _ = load_or_build(TINY, TEXT, cache=reader.parent / "trained")
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.parametrize(("change", "cut", "said"), [
    ("tamper", False, "has sha256"),
    ("missing", False, "answered HTTP 404"),
    ("record", False, "is not the record that tests/notebooks/models.json holds"),
    (None, True, "truncated"),
])
def test_a_bad_published_model_is_said_and_trained_instead(
        site: tuple[Path, dict[str, Any]], reader: Path, trainings: list[int],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        change: str | None, cut: bool, said: str) -> None:
    caplog.set_level(logging.INFO, logger="minigpt")
    with serving(_served(site, tmp_path, change), cut=cut) as (url, requests):
        monkeypatch.setenv(published.URL_VARIABLE, url)
        _, _, info = load_or_build(TINY, TEXT)
    assert requests and info.built and not info.fetched and trainings == [1]
    assert "tiny model is not fetched" in caplog.text and said in caplog.text
    assert "it is trained instead" in caplog.text
    # Nothing half-written: the trained model's two files, no temporary file.
    assert _left_in(reader) == sorted([info.path.name, f"{info.path.name}/{MANIFEST_NAME}",
                                       f"{info.path.name}/{WEIGHTS_NAME}"])
    assert info.manifest["weights_sha256"] == site[1]["weights_sha256"]


def test_a_server_that_never_answers_is_given_up_on(
        reader: Path, trainings: list[int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="minigpt")
    monkeypatch.setattr(published, "TIMEOUT", 0.5)
    with socket.socket() as silent:  # listens, and never reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv(published.URL_VARIABLE, f"http://127.0.0.1:{silent.getsockname()[1]}")
        start = time.perf_counter()
        _, _, info = load_or_build(TINY, TEXT)
        assert time.perf_counter() - start < 30
        assert info.built and trainings == [1]
        assert "did not answer within 0.5 s" in caplog.text
        assert "nothing more is fetched from there" in caplog.text
        # The next model (a chapter's run, another of set-up's) waits no more: not asked.
        caplog.clear()
        shutil.rmtree(info.path)
        _, _, again = load_or_build(TINY, TEXT)
        assert again.built and trainings == [1, 1]
        assert "did not answer" not in caplog.text  # it would have, after 0.5 s
    assert not [p for p in _left_in(reader) if p.endswith(".tmp")]


def test_an_unreachable_site_is_said_and_the_model_trained(
        reader: Path, trainings: list[int], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="minigpt")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv(published.URL_VARIABLE, f"http://127.0.0.1:{port}/models/")
    _, _, info = load_or_build(TINY, TEXT)
    assert info.built and trainings == [1]
    assert f"http://127.0.0.1:{port}/models/" in caplog.text and "is unreachable" in caplog.text


def test_a_folder_on_disk_serves_as_a_site(
        site: tuple[Path, dict[str, Any]], trainings: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(published.URL_VARIABLE, site[0].as_uri())
    _, _, info = load_or_build(TINY, TEXT)
    assert info.fetched and trainings == []


def test_off_and_unlisted_models_ask_nothing(
        site: tuple[Path, dict[str, Any]], trainings: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(site[0]) as (url, requests):
        monkeypatch.setenv(published.URL_VARIABLE, "off")
        assert load_or_build(TINY, TEXT)[2].built
        monkeypatch.setenv(published.URL_VARIABLE, url)
        other = TINY.model_copy(update={"training": TINY.training.model_copy(
            update={"seed": 1})})  # another key: not in the index
        assert load_or_build(other, TEXT)[2].built
        assert requests == [] and trainings == [1, 1]


@pytest.mark.parametrize("value", ["ftp://example.org/models", "example.org/models", ""])
def test_an_address_that_is_not_one_is_refused(monkeypatch: pytest.MonkeyPatch,
                                               value: str) -> None:
    monkeypatch.setenv(published.URL_VARIABLE, value)
    with pytest.raises(ValueError, match=r"MINIGPT_MODELS_URL=.* is not an address: give the "
                                         r"http://, https:// or file:// address .* or 'off'"):
        load_or_build(TINY, TEXT)


@pytest.mark.parametrize(("config", "url"), [
    ('repository:\n  url: ""          # the one setting a fork changes\n', None),
    ("repository:\n  url: https://github.com/Some-One/mini.gpt\n  branch: main\n",
     "https://some-one.github.io/mini.gpt/models"),
    ('repository:\n  url: "https://github.com/a/b.git"  # a fork\n',
     "https://a.github.io/b/models"),
])
def test_the_default_site_is_the_books_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           config: str, url: str | None) -> None:
    monkeypatch.delenv(published.URL_VARIABLE, raising=False)
    (tmp_path / "_config.yml").write_text("title: x\n" + config, encoding="utf-8")
    monkeypatch.setattr(published, "CONFIG", tmp_path / "_config.yml")
    assert published.base_url() == url


def test_the_record_leaves_out_only_what_a_rerun_measures_differently(
        site: tuple[Path, dict[str, Any]]) -> None:
    manifest = json.loads((site[0] / f"{site[1]['record_sha256']}.json").read_text())
    timed = json.loads(json.dumps(manifest))
    timed["metrics"]["train_seconds"] += 1.0
    timed["history"]["step_ms"] = [t + 1.0 for t in timed["history"]["step_ms"]]
    assert published.record_sha256(timed) == published.record_sha256(manifest)
    for change in ("final_val_loss", "steps"):
        other = json.loads(json.dumps(manifest))
        other["metrics"][change] += 1
        assert published.record_sha256(other) != published.record_sha256(manifest), change


@pytest.fixture(scope="module")
def book_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/publish.py over set-up's cache (as `make book` runs it): the book's site."""
    site = tmp_path_factory.mktemp("book") / "site"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "publish.py"), str(site)],
                          env=os.environ | {"MINIGPT_CACHE": str(SET_UP_CACHE)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return site


def _with_assets(reader: Path) -> None:
    """The reader's cache holds set-up's corpus and other assets, but no model or run."""
    reader.mkdir(parents=True)
    for asset in SET_UP_CACHE.iterdir():
        if asset.name not in ("models", "runs"):
            (reader / asset.name).symlink_to(asset)


@pytest.mark.book
def test_the_books_own_models_are_published_and_a_reader_fetches_them(
        book_site: Path, reader: Path, trainings: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every model of the book, each named by its hashes, and an index that is models.json.
    site = book_site
    stored = STORED_INDEX()
    assert json.loads((site / "index.json").read_text(encoding="utf-8")) == stored
    assert sorted(stored) == sorted(catalogue.MODELS)
    runs = published.runs_index()
    assert json.loads((site / "runs.json").read_text(encoding="utf-8")) == runs
    everything = [*stored.values(), *runs.values()]
    assert len(list(site.glob("*.safetensors"))) == len(list(site.glob("*.json"))) - 2 == len(
        {e["weights_sha256"] for e in everything})
    # A reader with the corpus but no model fetches one model of each kind, and trains none.
    monkeypatch.setattr(published, "index", STORED_INDEX)
    _with_assets(reader)
    with serving(site) as (url, requests):
        monkeypatch.setenv(published.URL_VARIABLE, url)
        for name in ("book", "sft-0", "rl-grpo-0", "copy-0"):
            info = catalogue.MODELS[name]()[2]
            assert info.fetched and published.entry(info.path) == stored[name], name
        # and a kept run of each chapter that keeps some (minigpt.recipes.runs)
        for chapter in sorted({e["chapter"] for e in runs.values()}):
            key = next(k for k, e in runs.items() if e["chapter"] == chapter)
            folder = reader / "runs" / key[:20]
            assert published.fetch(key, folder), chapter
            assert {"chapter": chapter, **published.entry(folder)} == runs[key]
    assert trainings == []


def test_the_machine_that_publishes_trains_in_the_books_environment() -> None:
    # The tests run where the book is built and published (Linux x86-64, the pinned PyTorch's
    # CPU build, the package's products); anywhere else this machine's models are not the
    # book's, and the book's own are used (book_material).
    pinned = next(line.split("==")[1] for line in
                  (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
                  if line.startswith("torch=="))
    assert published.BOOK_ENVIRONMENT["torch"] == f"{pinned}+cpu"
    mine = pretrained.environment()
    reference = (sys.platform == "linux" and platform.machine() == "x86_64"
                 and torch.__version__ == f"{pinned}+cpu" and products.mode() == "fma chains")
    assert (published.book_material(mine) is None) == reference
    assert published.book_material(mine | {"products": "native"}) == mine | {
        "products": "fma chains"} | published.BOOK_ENVIRONMENT
    assert published.book_material(mine | {"seed_shift": 1, "torch": "2.13.0"}) is None


#: A reader whose products are PyTorch's own (as on a machine where the package's do not
#: give the book's bits): the book's models and a kept run, asked for as the chapters ask.
NATIVE_READER = """
import json, sys
from pathlib import Path
from minigpt import products
from minigpt.recipes import catalogue, pretrained, published
from minigpt.recipes.runs import run_folder

assert products.mode() == "native"
setup, run_key = Path(sys.argv[1]), sys.argv[2]
infos = {name: catalogue.MODELS[name]()[2] for name in ("book", "sft-0", "rl-grpo-0", "copy-0")}
# a kept run as trained_runs asks for it: its recipe in this machine's environment
recipe = json.loads((setup / "runs" / run_key[:20] / "manifest.json").read_text())
mine = recipe["key_material"] | pretrained.environment()
key = pretrained.cache_key(mine)
run = pretrained.kept_model(run_folder(key), key, mine)
print(json.dumps({"models": {n: [i.built, i.fetched, published.entry(i.path)]
                             for n, i in infos.items()},
                  "run": [run.key, run.fetched, key]}))
"""


@pytest.mark.book
def test_a_machine_with_other_bits_uses_the_books_models_and_says_so_once(
        book_site: Path, reader: Path) -> None:
    _with_assets(reader)
    run_key = next(iter(published.runs_index()))
    with serving(book_site) as (url, _):
        done = subprocess.run(
            [sys.executable, "-c", NATIVE_READER, str(SET_UP_CACHE), run_key],
            env=os.environ | {"MINIGPT_PRODUCTS": "native", "MINIGPT_CACHE": str(reader),
                              published.URL_VARIABLE: url},
            capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    stored = STORED_INDEX()
    for name, (built, fetched, entry) in got["models"].items():
        assert not built and fetched and entry == stored[name], name
    found_key, fetched, local_key = got["run"]
    assert found_key == run_key and fetched and local_key != run_key
    said = done.stderr.count("minigpt: this machine trains other bits than the book's")
    assert said == 1, done.stderr
    assert "products 'native', not 'fma chains'" in " ".join(done.stderr.split())
    # nothing of this machine's own was trained or kept: the book's models (those asked for
    # and their parents), under the book's keys
    kept = {p.name for p in (reader / "models").iterdir() if not p.name.startswith(".")}
    assert {stored[name]["key"][:20] for name in got["models"]} <= kept
    assert kept <= {e["key"][:20] for e in stored.values()}


#: A reader whose products are PyTorch's own, as on a machine where the package's do not
#: give the book's bits: the tiny model, published from the book's environment, asked for
#: twice as a model and once as a kept run would be (its key material in this machine's
#: environment).
TINY_NATIVE_READER = """
import json, sys
from minigpt import products
from minigpt.recipes import pretrained, published
from minigpt.recipes.runs import run_folder
sys.path.insert(0, sys.argv[1])
from test_published import TEXT, TINY

assert products.mode() == "native"
entry = json.loads(sys.argv[2])
published.index = lambda: {"tiny": entry}
first = pretrained.load_or_build(TINY, TEXT)[2]
again = pretrained.load_or_build(TINY, TEXT)[2]
mine = pretrained.key_material(TINY, TEXT)
key = pretrained.cache_key(mine)
run = pretrained.kept_model(run_folder(key), key, mine)
print(json.dumps({"first": [first.key, first.built, first.fetched],
                  "again": [again.key, again.built, again.fetched],
                  "run": run and [run.key, run.fetched], "mine": key}))
"""


def test_a_machine_with_other_bits_fetches_the_books_model_and_says_so_once(
        site: tuple[Path, dict[str, Any]], reader: Path) -> None:
    with serving(site[0]) as (url, requests):
        done = subprocess.run(
            [sys.executable, "-c", TINY_NATIVE_READER, str(ROOT / "tests"),
             json.dumps(site[1])],
            env=os.environ | {"MINIGPT_PRODUCTS": "native", "MINIGPT_CACHE": str(reader),
                              published.URL_VARIABLE: url},
            capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    book = site[1]["key"]
    assert got["mine"] != book  # this machine's own key: another environment
    assert got["first"] == [book, False, True]  # the book's, fetched, not trained
    assert got["again"] == [book, False, False]  # then kept, and the site not asked again
    assert got["run"] == [book, True] and len(requests) == 4  # a run's folder fetches its own
    assert done.stderr.count("this machine trains other bits than the book's") == 1
    assert "products 'native', not 'fma chains'" in " ".join(done.stderr.split())
    assert [p.name for p in (reader / "models").iterdir() if not p.name.startswith(".")] == [
        book[:20]]


def test_without_the_books_model_a_machine_with_other_bits_trains_its_own(
        site: tuple[Path, dict[str, Any]], reader: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TINY_NATIVE_READER, str(ROOT / "tests"), json.dumps(site[1])],
        env=os.environ | {"MINIGPT_PRODUCTS": "native", "MINIGPT_CACHE": str(reader),
                          published.URL_VARIABLE: "off"},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    mine = got["mine"]
    assert got["first"] == [mine, True, False] and got["again"] == [mine, False, False]
    assert got["run"] is None  # (a run is kept in a folder of its own: none yet)
    assert "other bits" not in done.stderr
