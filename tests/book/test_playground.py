"""The playground: the book's models run in the reader's browser, offline, and agree with
PyTorch.

Headless Chromium (as in tests/book/test_site.py) opens the built site served under a sub-path,
with every host but the local one unresolvable, and drives the page's own code
(window.minigptPlayground, _ext/static/minigpt-playground.js) and its form:

- logits of 100 held-out contexts of lengths 1 to 64 within 1e-4 of PyTorch's, for each
  exported model; attention weights of every layer and head within 1e-5 on 5 contexts;
- 200 characters of greedy text equal to `minigpt.generate(..., greedy=True)`;
- the next-token distribution equal to `next_token_distribution` within 1e-6 for 20
  settings of temperature, top-k and top-p, and the inverse-CDF choice for fixed uniform
  draws equal to `decoding.inverse_cdf`;
- every control reachable and usable with the keyboard alone, clear errors for bad input,
  axe-core finding nothing serious in the playground;
- no request leaving the host (Chromium's own network log), nothing of the runtime fetched
  before a reader asks for text; speed and transfer size are measured and printed.

The site is not built here: `make test` builds it first.
"""

from __future__ import annotations

import base64
import functools
import gzip
import http.server
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

from minigpt.decoding import generate, inverse_cdf, next_token_distribution
from minigpt.posttrain import chat
from minigpt.recipes.assistant import MODELS
from minigpt.recipes.export import EXPORTED, PROMPTS, held_out_contexts, prompt_ids

pytestmark = [pytest.mark.book, pytest.mark.browser, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
BOOK_ROOT = Path(os.environ.get("MINIGPT_BOOK_ROOT", ROOT)).resolve()
SITE = BOOK_ROOT / "_build" / "html"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"
PREFIX = "/a/sub-path/"
# The pages that hold a playground.
PAGES = ("book/intro", "book/sampling", "book/attention_heatmaps")
TIMEOUT = 120  # seconds for a script: loading the runtime and a model, then generating
TRANSFER_BUDGET = 8_000_000  # bytes, gzipped: the runtime and a model a reader loads


def _require_site() -> None:
    if not (SITE / "_static" / "playground" / "playground.json").is_file():
        pytest.fail(f"{SITE} has no playground: run `make book` first")


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The site under PREFIX (as a project page of a static host is); every path asked for
    is recorded."""

    requested: list[str] = []

    def translate_path(self, path: str) -> str:
        self.requested.append(path)
        if not path.startswith(PREFIX):
            return str(SITE / "no-such-file")
        return super().translate_path("/" + path[len(PREFIX):])

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    _require_site()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Handler, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{PREFIX}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    for tool in (CHROMIUM, CHROMEDRIVER):
        if not tool.exists():
            pytest.fail(f"{tool} is missing: run `make system-deps`")
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="minigpt-playground-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # The network off: no name resolves but the local host's.
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                 "--window-size=1400,1600", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    browser = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                               options=options)
    browser.set_page_load_timeout(TIMEOUT)
    browser.set_script_timeout(TIMEOUT)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _requests(driver: Any) -> list[str]:
    """The URLs the browser asked for since the last call (its network log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _open(driver: Any, base_url: str, page: str) -> None:
    driver.get(base_url + page + ".html")
    started = time.monotonic()
    while driver.execute_script(
            "return Array.from(document.querySelectorAll('div.minigpt-playground'))"
            ".every((p) => p.dataset.state === 'ready')") is not True:
        assert time.monotonic() - started < 30, f"{page}: the playground was not built"
        time.sleep(0.05)


# Run the page's code: arguments[0] is an async function's body, given `api` and `args`.
_RUN = """
const [body, args] = arguments;
const done = arguments[arguments.length - 1];
const api = window.minigptPlayground;
const f64 = (values) => {
  const bytes = new Uint8Array(Float32Array.from(values).buffer);
  let text = '';
  for (let i = 0; i < bytes.length; i += 32768) {
    text += String.fromCharCode.apply(null, bytes.subarray(i, i + 32768));
  }
  return btoa(text);
};
(new Function('api', 'args', 'f64', 'return (async () => {' + body + '})();'))(api, args, f64)
  .then((value) => done({value}), (error) => done({error: String(error && error.stack
                                                                 || error)}));
"""


def _run(driver: Any, body: str, *args: Any) -> Any:
    result = driver.execute_async_script(_RUN, body, list(args))
    assert "error" not in result, result["error"]
    return result["value"]


def _floats(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.float32)


@functools.cache
def _model(name: str) -> Any:
    return MODELS[name]()


@pytest.fixture(scope="module")
def page(driver: Any, base_url: str) -> Any:
    _open(driver, base_url, "book/intro")
    before = [urlsplit(u).path for u in _requests(driver)]
    assert not [p for p in before if "/onnxruntime/" in p or "/playground/" in p], (
        "the runtime or a model was fetched before the reader asked for text")
    return driver


@pytest.mark.parametrize("name", list(EXPORTED))
def test_logits_and_attention_equal_pytorch(page: Any, name: str) -> None:
    model, tokenizer, _ = _model(name)
    contexts = held_out_contexts(tokenizer, 100, model.config.context_length, seed=1)
    assert {len(c) for c in contexts} >= {1, 64} and len(contexts) == 100
    got = _run(page, """
      const loaded = await api.session(args[0]);
      const out = [];
      for (const ids of args[1]) { out.push(f64((await api.forward(loaded, ids)).logits)); }
      return out;""", name, contexts)
    worst = 0.0
    with torch.no_grad():
        for ids, text in zip(contexts, got, strict=True):
            expected = model(torch.tensor([ids]))[0].numpy()
            worst = max(worst, float(np.abs(_floats(text).reshape(expected.shape)
                                            - expected).max()))
    T = model.config.context_length
    print(f"{name}: max |Δlogit| {worst:.2e} over 100 held-out contexts of lengths 1-{T}")
    assert worst <= 1e-4
    # As the page generates: the first half of a context, then a token at a time after the
    # key-value cache (api.nextLogits); each step's logits are the whole pass's there.
    long = [c for c in contexts if len(c) >= 8][:5]
    got = _run(page, """
      const loaded = await api.session(args[0]);
      const out = [];
      for (const ids of args[1]) {
        const cache = {past: null, length: 0};
        const steps = [];
        for (let t = Math.floor(ids.length / 2); t <= ids.length; t++) {
          steps.push(f64(await api.nextLogits(loaded, ids.slice(0, t), cache)));
        }
        out.push({steps, cached: cache.length});
      }
      return out;""", name, long)
    worst = 0.0
    with torch.no_grad():
        for ids, seen in zip(long, got, strict=True):
            assert seen["cached"] == len(ids)
            expected = model(torch.tensor([ids]))[0].numpy()  # (T, V)
            for t, text in zip(range(len(ids) // 2, len(ids) + 1), seen["steps"], strict=True):
                worst = max(worst, float(np.abs(_floats(text) - expected[t - 1]).max()))
    print(f"{name}: max |Δlogit| {worst:.2e}, a token at a time after the cache, 5 contexts")
    assert worst <= 1e-4
    five = contexts[:5]
    got = _run(page, """
      const loaded = await api.session(args[0]);
      const out = [];
      for (const ids of args[1]) { out.push(f64((await api.forward(loaded, ids)).attention)); }
      return out;""", name, five)
    worst = 0.0
    with torch.no_grad():
        for ids, text in zip(five, got, strict=True):
            _, maps = model.forward_with_attention(torch.tensor([ids]))
            expected = torch.stack(maps, 1)[0].numpy()  # (L, H, T, T)
            attention = _floats(text).reshape(expected.shape)
            for layer in range(expected.shape[0]):
                for head in range(expected.shape[1]):
                    worst = max(worst, float(np.abs(attention[layer, head]
                                                    - expected[layer, head]).max()))
    print(f"{name}: max |Δweight| {worst:.2e}, every layer and head, 5 contexts")
    assert worst <= 1e-5


@pytest.mark.parametrize("name", list(EXPORTED))
def test_greedy_text_equals_generate(page: Any, name: str) -> None:
    model, tokenizer, _ = _model(name)
    prompt = PROMPTS[name]
    assert _run(page, "return api.FIRST_PROMPTS[args[0]];", name) == prompt
    ids = prompt_ids(tokenizer, prompt)
    length = 20 if name == "sft-0" else 200
    got = _run(page, """
      const loaded = await api.session(args[0]);
      return await api.generate(loaded, args[1], args[2],
                                {greedy: true, temperature: 0, seed: 0});""",
               name, ids, length)
    expected = generate(model, ids, length, greedy=True).tolist()
    if name == "sft-0":  # the page stops at the end of the assistant's turn
        end = tokenizer.special_tokens["<|end|>"]
        expected = expected[:expected.index(end, len(ids))]
        question = prompt.removeprefix("upper: ")  # the page's first prompt is answered right
        assert tokenizer.decode(expected[len(ids):]) == question.upper()
    assert got == expected, (tokenizer.decode(got[len(ids):]),
                             tokenizer.decode(expected[len(ids):]))


def test_speed_is_reported(page: Any) -> None:
    """Each model, its runtime loaded, writes 200 characters after its first prompt as the
    form does (τ 0.8, seed 7): the time to the first character and characters a second."""
    speeds = _run(page, """
      const out = {};
      for (const name of args[0]) {
        const loaded = await api.session(name);
        const text = name === "sft-0" ? "ROMEO:\\nBut soft" : api.FIRST_PROMPTS[name];
        const ids = api.tokenizer(loaded.model).encode(text);
        const settings = {temperature: 0.8, topK: null, topP: null, seed: 7, greedy: false};
        const started = performance.now();
        let first = null;
        let count = 0;
        await api.generate(loaded, ids, 200, settings, () => {
          if (first === null) { first = performance.now() - started; }
          count += 1;
        });
        out[name] = {first, count, seconds: (performance.now() - started) / 1000};
      }
      return out;""", list(EXPORTED))
    for name, speed in speeds.items():
        print(f"{name}: first character after {speed['first']:.0f} ms, {speed['count']} "
              f"characters at {speed['count'] / speed['seconds']:.0f} characters/s")
        assert speed["count"] > 0 and speed["first"] < 1000


# (temperature, top-k, top-p): 20 settings, None for no filter.
SETTINGS = [(1.0, None, None), (0.7, None, 0.9), (1.5, 5, None), (2.0, 12, 0.8),
            (0.5, 3, None), (0.05, None, None), (3.0, None, None), (1.0, 1, None),
            (1.0, None, 0.01), (0.8, 40, 0.95), (1.2, 70, 0.5), (0.3, 10, 0.3),
            (1.0, None, 1.0), (0.9, 2, 0.99), (4.0, 20, 0.7), (0.6, 73, None),
            (1.1, 8, 0.6), (2.5, None, 0.2), (0.75, 30, None), (1.0, 64, 0.85)]


def test_next_token_distribution_and_inverse_cdf_equal_the_package(page: Any) -> None:
    model, tokenizer, _ = _model("sft-0")  # 73 tokens: every k of SETTINGS is valid
    rows = []
    with torch.no_grad():
        for ids in held_out_contexts(tokenizer, 4, 64, seed=2):
            rows.append(model(torch.tensor([ids]))[0, -1].tolist())
    draws = np.random.default_rng(0).random(25).tolist() + [0.0, 0.5, 0.999999]
    cases = [{"logits": rows[i % len(rows)], "temperature": tau, "topK": k, "topP": p}
             for i, (tau, k, p) in enumerate(SETTINGS)]
    got = _run(page, """
      return args[0].map((c) => {
        const q = Array.from(api.nextTokenDistribution(c.logits, c));
        return {q, picks: args[1].map((u) => api.inverseCdf(q, u))};
      });""", cases, draws)
    assert len(got) == 20
    worst = 0.0
    for case, seen in zip(cases, got, strict=True):
        logits = torch.tensor(case["logits"], dtype=torch.float32)
        q = next_token_distribution(logits, temperature=case["temperature"],
                                    top_k=case["topK"], top_p=case["topP"])
        worst = max(worst, float((torch.tensor(seen["q"]) - q.double()).abs().max()))
        page_q = torch.tensor(seen["q"], dtype=torch.float64)
        assert seen["picks"] == [inverse_cdf(page_q, u) for u in draws], case
        # the same tokens filtered out (float32 may also round a tiny probability to 0)
        assert bool((page_q[q > 0] > 0).all()), case
    print(f"next-token distribution: max |Δq| {worst:.1e} over 20 settings")
    assert worst <= 1e-6


_SET = """
const [selector, value] = arguments;
const control = document.querySelector(selector);
control.value = value;
"""


def _form(driver: Any) -> Any:
    return driver.find_element("css selector", "div.minigpt-playground")


def _wait_state(driver: Any, wanted: tuple[str, ...], timeout: float = TIMEOUT) -> str:
    started = time.monotonic()
    while True:
        state = _form(driver).get_attribute("data-state")
        if state in wanted:
            return str(state)
        assert time.monotonic() - started < timeout, f"state {state}"
        time.sleep(0.05)


def test_keyboard_alone_writes_and_picks_a_head(driver: Any, base_url: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    _open(driver, base_url, "book/intro")
    _requests(driver)
    box = _form(driver)
    prompt = box.find_element("css selector", "textarea")
    prompt.click()
    ActionChains(driver).key_down(Keys.CONTROL).send_keys("a").key_up(Keys.CONTROL) \
        .send_keys("JULIET:\nO Romeo").perform()
    # Tab through every control to the Write button, as a keyboard user does.
    names = []
    for _ in range(7):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        names.append(driver.switch_to.active_element.get_attribute("id")
                     or driver.switch_to.active_element.text)
    assert [n.rsplit("-", 1)[-1] for n in names[:6]] == [
        "model", "temperature", "k", "p", "seed", "length"], names
    assert names[6] == "Write", names
    focused = driver.switch_to.active_element
    ActionChains(driver).send_keys(Keys.ENTER).perform()
    assert _wait_state(driver, ("done", "error")) == "done", box.text
    written = box.find_element("css selector", ".minigpt-playground-written").text
    assert len(written) > 100, written
    speed = {k: box.get_attribute(f"data-{k}") for k in ("load-ms", "first-char-ms",
                                                         "chars-per-second")}
    print(f"book model in headless Chromium: loaded in {speed['load-ms']} ms (runtime and "
          f"model), first character after {speed['first-char-ms']} ms, "
          f"{float(speed['chars-per-second']):.0f} characters/s")
    assert focused.text == "Write"
    # The heatmap's selectors, by keyboard: another head draws another picture.
    heatmap = box.find_element("css selector", ".minigpt-playground-heatmap")
    selects = heatmap.find_elements("css selector", "select")
    assert len(selects) == 2
    pictures = set()
    for presses in range(3):
        selects[1].send_keys(Keys.ARROW_DOWN) if presses else None
        driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "setTimeout(() => arguments[0].minigptView.runAsync().then(() => done()), 0);",
            heatmap)
        pictures.add(driver.execute_script(
            "return arguments[0].querySelector('canvas').toDataURL()", heatmap))
    assert len(pictures) == 3, "the head selector did not change the heatmap"
    # The cells by keyboard: Shift+Tab from the head selector reaches them (they come before
    # their selectors), arrow keys choose one, the readout says its weight, which is
    # PyTorch's (as drawn, in thousandths).
    for _ in range(3):
        if "minigpt-playground-view" in (driver.switch_to.active_element.get_attribute("class")
                                         or ""):
            break
        ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT) \
            .perform()
    assert "minigpt-playground-view" in driver.switch_to.active_element.get_attribute("class")
    ActionChains(driver).send_keys(Keys.ARROW_UP, Keys.ARROW_UP, Keys.ARROW_LEFT,
                                   Keys.ARROW_LEFT, Keys.ARROW_LEFT).perform()
    readout = heatmap.find_element("css selector", ".minigpt-playground-readout").text
    found = re.fullmatch(r"Layer (\d+), head (\d+): query (\d+) \(.+\) gives key (\d+) "
                         r"\(.+\) weight (\d\.\d{3})\.", readout)
    assert found, readout
    layer, head, query, key = (int(found[i]) for i in range(1, 5))
    model, tokenizer, _ = _model("book")
    window = tokenizer.encode_ordinary("JULIET:\nO Romeo" + written)[-64:]
    assert (layer, head, query, key) == (0, 2, len(window) - 3, len(window) - 6), readout
    with torch.no_grad():
        _, maps = model.forward_with_attention(torch.tensor([window]))
    assert abs(float(found[5]) - float(maps[layer][0, head, query, key])) <= 0.0011, readout
    # Nothing left the host: Chromium's network log and the server's own.
    leaving = [u for u in _requests(driver)
               if urlsplit(u).scheme not in ("data", "blob")
               and urlsplit(u).hostname != "127.0.0.1"]
    assert not leaving, leaving
    assert all(p.startswith(PREFIX) for p in _Handler.requested), _Handler.requested


@pytest.mark.parametrize(("field", "value", "message"), [
    ("textarea", "", "the prompt is empty"),
    ("textarea", "Romeo — and", "character \"—\" (U+2014) at position 6 is not in the "
                                "vocabulary"),
    ("input[id$=top-k]", "0", "top-k must be a whole number from 1 to 70"),
    ("input[id$=top-k]", "2.5", "top-k must be a whole number"),
    ("input[id$=top-p]", "0", "top-p must lie in (0, 1]"),
    ("input[id$=top-p]", "1.5", "top-p must lie in (0, 1]"),
    ("input[id$=temperature]", "-1", "temperature must be >= 0"),
    ("input[id$=seed]", "-3", "the seed must be a whole number"),
    ("input[id$=length]", "0", "characters must be a whole number from 1 to 1000"),
])
def test_bad_input_is_refused_with_a_clear_error(driver: Any, base_url: str, field: str,
                                                 value: str, message: str) -> None:
    _open(driver, base_url, "book/intro")
    driver.execute_script(_SET, f"div.minigpt-playground {field}", value)
    _form(driver).find_element("css selector", "button[type=submit]").click()
    assert _wait_state(driver, ("error", "done"), timeout=20) == "error"
    alert = _form(driver).find_element("css selector", "[role=alert]").text
    assert message in alert, alert


def test_axe_finds_nothing_serious_in_the_playground(driver: Any, base_url: str) -> None:
    for entry in PAGES:
        _open(driver, base_url, entry)
        if entry == "book/intro":  # with the text written and the heatmap drawn
            driver.execute_script(_SET, "div.minigpt-playground input[id$=length]", "20")
            _form(driver).find_element("css selector", "button[type=submit]").click()
            assert _wait_state(driver, ("done", "error")) == "done"
        driver.execute_script(AXE.read_text(encoding="utf-8"))
        violations = driver.execute_async_script("""
          const done = arguments[arguments.length - 1];
          axe.run(Array.from(document.querySelectorAll('div.minigpt-playground')),
                  {resultTypes: ['violations']}).then((r) => done(r.violations.map(
            (v) => [v.id, v.impact, v.nodes.map((n) => n.html.slice(0, 120))])));""")
        serious = [v for v in violations if v[1] in ("critical", "serious")]
        assert not serious, (entry, serious)
        labelled = driver.execute_script("""
          return Array.from(document.querySelectorAll('div.minigpt-playground-live '
            + 'textarea, div.minigpt-playground-live input, '
            + 'div.minigpt-playground-live select')).map((c) => c.labels.length
              || c.closest('label') !== null);""")
        assert labelled and all(labelled), (entry, labelled)


def test_pages_load_the_playground_and_only_those() -> None:
    _require_site()
    for html in SITE.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        entry = html.relative_to(SITE).with_suffix("").as_posix()
        holds = 'class="minigpt-playground"' in text
        assert holds == (entry in PAGES), entry
        assert ("_static/minigpt-playground.js" in text) == holds, entry
        assert "ort.wasm.min.js" not in text and ".onnx" not in text, entry
        if holds:  # the static twin: a note and a printed sample
            assert "minigpt-playground-static" in text and "minigpt-playground-sample" in text


def _gzipped(path: Path) -> int:
    return len(gzip.compress(path.read_bytes(), compresslevel=9))


def test_transfer_size() -> None:
    _require_site()
    static = SITE / "_static"
    runtime = sum(_gzipped(f) for f in (static / "onnxruntime").iterdir())
    script = _gzipped(static / "minigpt-playground.js") + _gzipped(
        static / "minigpt-playground.css") + _gzipped(static / "playground" / "playground.json")
    models = {name: _gzipped(static / "playground" / f"{name}.onnx") for name in EXPORTED}
    one = runtime + script + max(models.values())
    every = runtime + script + sum(models.values())
    print(f"gzipped: runtime {runtime / 1e6:.2f} MB, script and manifest {script / 1e3:.0f} kB, "
          + ", ".join(f"{n} {s / 1e6:.2f} MB" for n, s in models.items())
          + f"; a reader who runs one model fetches {one / 1e6:.2f} MB, all three "
          f"{every / 1e6:.2f} MB")
    assert one <= TRANSFER_BUDGET


def test_the_assistant_answers_in_its_chat_format(driver: Any, base_url: str) -> None:
    from selenium.webdriver.support.ui import Select

    _open(driver, base_url, "book/intro")
    box = _form(driver)
    Select(box.find_element("css selector", "select")).select_by_value("sft-0")
    prompt = box.find_element("css selector", "textarea")
    assert prompt.get_attribute("value") == PROMPTS["sft-0"]  # the model's first prompt
    driver.execute_script(_SET, "div.minigpt-playground input[id$=temperature]", "0")
    box.find_element("css selector", "button[type=submit]").click()
    assert _wait_state(driver, ("done", "error")) == "done"
    model, tokenizer, _ = _model("sft-0")
    ids = prompt_ids(tokenizer, PROMPTS["sft-0"])
    answer = generate(model, ids, 20, greedy=True).tolist()[len(ids):]
    answer = answer[:answer.index(tokenizer.special_tokens["<|end|>"])]
    written = box.find_element("css selector", ".minigpt-playground-written").text
    assert written == tokenizer.decode(answer) == PROMPTS["sft-0"].removeprefix("upper: ").upper()
    T = model.config.context_length
    too_long = "upper: " + "a" * (T - 3)
    with pytest.raises(ValueError) as refused:
        chat.fit_context([chat.Turn("user", too_long)], tokenizer, T, room=200)
    assert "this message makes a prompt of" in str(refused.value)
    driver.execute_script(_SET, "div.minigpt-playground textarea", too_long)
    box.find_element("css selector", "button[type=submit]").click()
    assert _wait_state(driver, ("error",), timeout=20) == "error"
    alert = box.find_element("css selector", "[role=alert]").text
    assert alert == str(refused.value), alert


# The prompt the live form shows (the static twin has one too).
_SHOWN = ".minigpt-playground-live .minigpt-playground-prompt"

# Questions of the five task families, the fifth long enough that the conversation outgrows
# the assistant's context and its first turns are forgotten.
CONVERSATION = ["upper: storm", "reverse: night", "letters in: crown",
                "first word: What light through yonder window breaks",
                "last word: " + "Romeo, Romeo, wherefore art thou Romeo, " * 3 + "and Juliet"]


def test_the_assistant_holds_a_conversation(driver: Any, base_url: str) -> None:
    """Greedy, with the page's default Characters (200): each answer the page writes is the
    one `python -m minigpt chat` gives after the same turns (chat.fit_context with the chat's
    room of 32 tokens for the answer, then chat.answer_turn); the page forgets the turns the
    chat forgets, and says so (not before the long fifth question: the first four fit);
    "New conversation" starts afresh."""
    from selenium.webdriver.support.ui import Select

    _open(driver, base_url, "book/intro")
    box = _form(driver)
    restart = box.find_element("xpath", ".//button[text()='New conversation']")
    assert not restart.is_displayed()  # the book model continues text, it holds no conversation
    Select(box.find_element("css selector", "select")).select_by_value("sft-0")
    assert restart.is_displayed() and not restart.is_enabled()
    driver.execute_script(_SET, "div.minigpt-playground input[id$=temperature]", "0")
    length = box.find_element("css selector", "input[id$=length]")
    assert length.get_attribute("value") == "200"  # the default a reader meets
    model, tokenizer, _ = _model("sft-0")
    T = model.config.context_length
    turns: list[chat.Turn] = []
    forgot = []
    for question in CONVERSATION:
        kept = chat.fit_context([*turns, chat.Turn("user", question)], tokenizer, T, room=32)
        forgot.append(len(turns) + 1 - len(kept))
        answer = chat.answer_turn(model, tokenizer, kept, max_new_tokens=32)
        turns = [*kept, answer]
        driver.execute_script(_SET, "div.minigpt-playground textarea", question)
        box.find_element("css selector", "button[type=submit]").click()
        assert _wait_state(driver, ("done", "error")) == "done", box.text
        written = box.find_element("css selector", ".minigpt-playground-written")
        assert written.get_attribute("textContent") == answer.text, question
        shown = box.find_element("css selector", _SHOWN)
        assert shown.get_attribute("textContent").endswith("you: " + question + "\n→ ")
        status = box.find_element("css selector", ".minigpt-playground-status").text
        assert ("forgotten" in status) == (forgot[-1] > 0), (question, status)
    assert forgot == [0, 0, 0, 0, forgot[-1]] and forgot[-1] > 0, forgot
    assert restart.is_enabled()
    restart.click()
    driver.execute_script(_SET, "div.minigpt-playground textarea", CONVERSATION[1])
    box.find_element("css selector", "button[type=submit]").click()
    assert _wait_state(driver, ("done", "error")) == "done"
    alone = chat.answer_turn(model, tokenizer, [chat.Turn("user", CONVERSATION[1])],
                             max_new_tokens=32)
    shown = box.find_element("css selector", _SHOWN)
    assert shown.get_attribute("textContent") == "you: " + CONVERSATION[1] + "\n→ "
    written = box.find_element("css selector", ".minigpt-playground-written")
    assert written.get_attribute("textContent") == alone.text
