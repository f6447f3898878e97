"""The book's small trained model: trained once by `minigpt.train`, cached on disk, verified.

Several chapters look inside a *trained* GPT (its attention maps, its positional embeddings,
its samples). `book_model()` gives them the same one: a character-level GPT trained on the
book's corpus (`minigpt.data.shakespeare_text()`) by `minigpt.train.train`, seeded, with a
fixed number of threads, so that every build on a machine yields the same weights.

Set-up (`python -m minigpt pretrained`, run by `make setup`) trains it (a few minutes on a
2-core CPU, with a progress display) and stores it under `<cache>/models/<key>/` (the cache
root is `minigpt.files.cache_dir()`); a chapter's call then only loads it. Called from a
chapter, `book_model()` prints nothing whether it loads or trains (a reader who skipped
set-up waits a few minutes, and sees the same outputs): only `logging` at INFO says which.
The cached model is two files:

    model.safetensors  the weights (a state dict in the safetensors format: tensors only,
                       read without unpickling anything)
    manifest.json      the key, everything the key was hashed from, the sha256 of the
                       weights, and what training measured (losses, evaluations, times)

The key is a hash of everything that determines the weights: the model configuration, the
training settings (seed included), the corpus's sha256, the tokenizer, the split, the thread
count, the PyTorch version, the CPU kernels it runs and the code of the package's modules
that train it (`TRAINING_MODULES`: any change to their code rebuilds it; their comments,
docstrings and blank lines are not part of it, `code_text`). Later calls load the cache in
seconds after checking it: a manifest that is unreadable or describes another recipe, a
weights file whose hash differs from the manifest's or that does not load into the model,
is reported (a `RuntimeWarning` and a log line) and the model is rebuilt; a damaged cache is
never used. Files are written atomically (temporary file, then rename), the manifest last, so
an interrupted build leaves no cache that looks complete.

A model missing from the cache is fetched, if it is published (`minigpt.recipes.published`: the
book's site serves every set-up model, and `tests/notebooks/models.json` holds the hashes a
fetched model must have), before it is trained.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import sys
import time
import tokenize
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import safetensors.torch
import torch
from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tqdm import tqdm

from minigpt import PINNED_CPU_KERNELS, products
from minigpt.config import MODERN_LAYOUT, MODERN_TRAINING, SEED_SHIFT, GPTConfig, TrainConfig
from minigpt.data import shakespeare_text, split_text
from minigpt.files import MANIFEST_NAME, WEIGHTS_NAME, atomic_write, cache_dir, sha256_file
from minigpt.model import GPT
from minigpt.tokenizer import CharTokenizer
from minigpt.train import train

log = logging.getLogger(__name__)

#: The package's modules that importing this one loads: the code that trains a model. Their
#: source is part of the cache key (`source_sha256`), so a change to any of them rebuilds the
#: models (tests/test_pretrained.py checks that the list is what importing this module loads).
TRAINING_MODULES = ("__init__", "attention", "checkpoint", "config", "data", "files", "losses",
                    "model", "nn", "optim", "parallel", "products", "recipes",
                    "recipes.pretrained", "tokenizer", "train")
#: The package's folder: `source_sha256` reads its modules there.
PACKAGE = Path(__file__).resolve().parent.parent
#: Optimiser steps of the modern book model.
MODERN_BOOK_STEPS = 400


class Recipe(BaseModel):
    """How the book's model is made: its shape, its training run, its data split, its threads.

    The vocabulary size is not part of the recipe: it is the number of distinct characters
    of the corpus. A shape the heads cannot share is refused when the recipe is made, not
    after the corpus is loaded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_layers: int = Field(default=4, gt=0)
    n_heads: int = Field(default=4, gt=0)
    d_model: int = Field(default=128, gt=0)
    context_length: int = Field(default=64, gt=0)
    training: TrainConfig = Field(default_factory=lambda: TrainConfig(
        batch_size=12, max_steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100,
        eval_interval=500, eval_steps=20, seed=1337))
    train_fraction: float = Field(default=0.9, gt=0.0, lt=1.0)
    #: GPTConfig fields that differ from the book model's GPT-2 layout (`MODERN_LAYOUT` for
    #: the modern model).
    layout: dict[str, Any] = Field(default_factory=dict)
    # CPU reductions may split work differently for another thread count; fixing it keeps
    # the weights bit-identical from run to run. One thread: this model is too small to gain
    # much from two, and on a busy shared machine two threads can be several times slower.
    threads: int = Field(default=1, ge=1, strict=True)

    @field_validator("layout")
    @classmethod
    def _layout_names_config_fields(cls, layout: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(layout) - set(GPTConfig.model_fields))
        if unknown:
            raise ValueError(f"{unknown} are not GPTConfig fields; a layout sets some of "
                             f"{sorted(GPTConfig.model_fields)}")
        return layout

    @model_validator(mode="after")
    def _a_model_of_this_shape_exists(self) -> Recipe:
        self.gpt_config(vocab_size=2)  # GPTConfig's own checks: heads, layout fields
        return self

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model's `GPTConfig` for a vocabulary of `vocab_size` tokens."""
        # GPT-2's tanh GELU: the chapters' observations were made on this model.
        values: dict[str, Any] = dict(
            n_layers=self.n_layers, n_heads=self.n_heads, d_model=self.d_model,
            context_length=self.context_length, activation="gelu_tanh")
        return GPTConfig.shakespeare_cpu(vocab_size, **(values | self.layout))


BOOK_RECIPE = Recipe()
#: A much smaller model of the same text and tokenizer: the draft of speculative sampling,
#: its MLP 3 D wide.
DRAFT_RECIPE = Recipe(n_layers=1, n_heads=2, d_model=64, layout=dict(d_ff=192))
#: The modern recipe (`MODERN_LAYOUT`, `MODERN_TRAINING`) at the book model's size, trained
#: for no longer than the book model takes.
MODERN_RECIPE = Recipe(layout=dict(MODERN_LAYOUT),
                       training=TrainConfig(**(MODERN_TRAINING | dict(
                           max_steps=MODERN_BOOK_STEPS, eval_interval=100, eval_steps=20,
                           seed=1337))))


@dataclass(frozen=True)
class ModelInfo:
    """What `book_model` returns besides the model and the tokenizer.

    Attributes:
        key: the cache key (hex) of the model loaded: on a machine whose environment is not
            the book's, the book's own model's (`minigpt.recipes.published.book_material`)
            when that one is used.
        path: the cache folder, `<cache>/models/<key>/`.
        built: True if this call trained the model, False if it loaded it.
        fetched: True if this call fetched the model (`minigpt.recipes.published`) and loaded it.
        load_seconds: wall time of this call's loading (or building) step.
        manifest: the manifest: recipe, metrics (final losses, train_seconds, ...) and the
            training history (per-step loss, evaluations).
    """

    key: str
    path: Path
    built: bool
    load_seconds: float
    manifest: dict[str, Any]
    fetched: bool = False

    @property
    def metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = self.manifest["metrics"]
        return metrics


class CacheError(RuntimeError):
    """A cached model that must not be used (corrupted or made by another recipe)."""


def corpus() -> str:
    """The text the book's model is trained on (a seam for tests, which pass a tiny text)."""
    return shakespeare_text()


def key_material(recipe: Recipe, text: str) -> dict[str, Any]:
    """Everything that determines the trained weights, as plain JSON-able data."""
    tokenizer = CharTokenizer.from_text(text)
    return model_material(TRAINING_MODULES, recipe.gpt_config(tokenizer.vocab_size),
                          train_config=recipe.training.model_dump(),
                          train_fraction=recipe.train_fraction, threads=recipe.threads,
                          corpus_sha256=corpus_sha256(text), tokenizer=tokenizer.to_dict())


def model_material(modules: tuple[str, ...], config: GPTConfig, **recipe: Any) -> dict[str, Any]:
    """What a cached model's key is hashed from (`cache_key`), as plain JSON-able data: the
    code of the package's ``modules`` that train it (`source_sha256`), its ``config``, the
    ``recipe`` (JSON-able values: its settings, its parent's key, ...) and the `environment`.
    The book model's (`key_material`), the assistants', the rewards runs' and the copiers'
    keys are all made here."""
    return {"source_sha256": source_sha256(modules), "model_config": config.model_dump(),
            **recipe, **environment()}


def corpus_sha256(text: str) -> str:
    """sha256 of ``text`` in UTF-8: the corpus a model is trained on, in its key."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_sha256(modules: tuple[str, ...]) -> str:
    """sha256 of the code of these modules of the package (names and `code_text`, in order;
    a module's C++ source, as ``products.cpp``, after its Python)."""
    digest = hashlib.sha256()
    for name in modules:
        for path in module_files(name):
            code = _package_code(path).encode("utf-8")
            digest.update(f"\0{path.relative_to(PACKAGE).as_posix()}\0{len(code)}\0".encode())
            digest.update(code)
    return digest.hexdigest()


def module_files(name: str) -> list[Path]:
    """The source files of the package's module ``name`` (``"nn"``, ``"recipes.pretrained"``;
    a subpackage is its ``__init__.py``): its Python, then its C++ if it has one, then the
    package's headers that C++ includes (``#include "gemm.h"``), in the order it does."""
    module = PACKAGE.joinpath(*name.split("."))
    python = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
    cpp = module.with_suffix(".cpp")
    if not cpp.is_file():
        return [python]
    headers = re.findall(r'^#include "([^"]+)"', cpp.read_text(encoding="utf-8"), flags=re.M)
    return [python, cpp, *(cpp.parent / header for header in headers)]


@functools.cache
def _package_code(path: Path) -> str:
    """`code_text` of a file of the package, read once a process: the code it imported."""
    return code_text(path)


def code_text(path: Path) -> str:
    """The source of a Python or C++ file without what cannot change what it computes: its
    comments, its docstrings (any statement that is a string alone), trailing spaces and
    blank lines. What is left is still the file's own text, so it does not depend on the
    Python that reads it."""
    source = path.read_text(encoding="utf-8")
    spans = _python_prose(source) if path.suffix == ".py" else _cpp_comments(source)
    starts = [0]  # the offset of each line's first character
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    chars = list(source)
    for (line0, col0), (line1, col1) in spans:
        for i in range(starts[line0 - 1] + col0, starts[line1 - 1] + col1):
            if chars[i] != "\n":
                chars[i] = " "
    lines = (line.rstrip() for line in "".join(chars).splitlines())
    return "\n".join(line for line in lines if line) + "\n"


Span = tuple[tuple[int, int], tuple[int, int]]  # (line, column) from, to; lines from 1


def _python_prose(source: str) -> list[Span]:
    """Where a Python source has comments and string-only statements (docstrings)."""
    spans: list[Span] = [(t.start, t.end) for t in tokenize.generate_tokens(
        io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            assert node.end_lineno is not None and node.end_col_offset is not None
            spans.append(((node.lineno, _column(source, node.lineno, node.col_offset)),
                          (node.end_lineno, _column(source, node.end_lineno,
                                                    node.end_col_offset))))
    return spans


def _column(source: str, line: int, byte_offset: int) -> int:
    """The character column of `ast`'s UTF-8 byte offset into a line."""
    text = source.splitlines(keepends=True)[line - 1]
    return len(text.encode("utf-8")[:byte_offset].decode("utf-8"))


def _cpp_comments(source: str) -> list[Span]:
    """Where a C++ source has ``//`` and ``/* */`` comments (outside string and character
    literals)."""
    spans: list[Span] = []
    line, col, i, quote = 1, 0, 0, ""
    start = (0, 0)
    mode = "code"  # or "line", "block"
    while i < len(source):
        c, pair = source[i], source[i:i + 2]
        step = 1
        if mode == "code":
            if quote:
                if c == "\\":
                    step = 2
                elif c == quote:
                    quote = ""
            elif c in "\"'":
                quote = c
            elif pair in ("//", "/*"):
                mode, start, step = ("line" if pair == "//" else "block"), (line, col), 2
        elif mode == "line" and c == "\n":
            spans.append((start, (line, col)))
            mode = "code"
        elif mode == "block" and pair == "*/":
            spans.append((start, (line, col + 2)))
            mode, step = "code", 2
        for ch in source[i:i + step]:
            line, col = (line + 1, 0) if ch == "\n" else (line, col + 1)
        i += step
    if mode != "code":
        spans.append((start, (line, col)))
    return spans


def environment() -> dict[str, Any]:
    """What of the software and CPU determines the weights besides the recipe: the PyTorch
    version, the kernels it runs, MKL's and oneDNN's settings (`minigpt.PINNED_CPU_KERNELS`;
    a process whose first torch operation ran before minigpt was imported runs the CPU's
    widest kernels, and MKL the mode `mkl_reproducibility` reads from MKL itself) and how
    its matrix products are summed (`minigpt.products.mode`), and the redraw of its random
    streams (`minigpt.config.SEED_SHIFT`, 0 for the book's own draw)."""
    settings = {name: os.environ.get(name) for name in sorted(PINNED_CPU_KERNELS)
                if name != "ATEN_CPU_CAPABILITY"}
    return {"torch": torch.__version__,
            "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
            "kernel_settings": settings | {"MKL_CBWR": mkl_reproducibility()},
            "products": products.mode(), "seed_shift": SEED_SHIFT}


#: mkl_cbwr_get's answer for "no reproducibility branch", and its flag of the strict mode.
_MKL_CBWR_BRANCH_OFF, _MKL_CBWR_STRICT = 1, 0x10000


def mkl_reproducibility() -> str | None:
    """MKL's conditional-reproducibility mode as MKL runs it: the ``MKL_CBWR`` setting when
    MKL took it up, else ``"mkl 0x..."``, the mode MKL reports (None: this PyTorch runs no
    MKL). MKL reads the variable once, at its first call, so a process whose first matrix
    product ran before minigpt set it runs without. The branch MKL reports depends on the
    CPU's vendor (an AMD CPU reports its automatic branch for AVX2), so the setting, not the
    branch, is what a key records: whether a branch is set, and whether strictly. PyTorch
    exposes no query of the mode; its Linux x86-64 build links MKL's own (under its
    internal name), which is read here; where it is absent the setting is recorded."""
    setting = os.environ.get("MKL_CBWR")
    if not torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
    except (OSError, AttributeError):  # another platform's build: the mode is not readable
        return setting
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    mode = get(-1)  # MKL_CBWR_ALL: the branch and the strict flag
    branch_set = mode & 0xFFFF != _MKL_CBWR_BRANCH_OFF
    strict = bool(mode & _MKL_CBWR_STRICT)
    asked = (setting or "").upper().replace(" ", "").split(",")
    if setting and branch_set == (asked[0] != "OFF") and strict == ("STRICT" in asked):
        return setting
    return f"mkl {mode:#x}"


def cache_key(material: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of `key_material` (sorted keys, no spaces)."""
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------ loading

def _load(folder: Path, key: str, material: dict[str, Any]) -> tuple[GPT, dict[str, Any]]:
    """The verified cached model and its manifest; `CacheError` says what is wrong."""
    manifest_path, weights_path = folder / MANIFEST_NAME, folder / WEIGHTS_NAME
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CacheError(f"its manifest is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(manifest, dict):
        raise CacheError("its manifest is not a JSON object")
    if manifest.get("key") != key or manifest.get("key_material") != material:
        raise CacheError("its manifest describes a different recipe, corpus or configuration "
                         f"(key {str(manifest.get('key'))[:12]}..., expected {key[:12]}...)")
    if not weights_path.is_file():
        raise CacheError(f"{WEIGHTS_NAME} is missing")
    actual = sha256_file(weights_path)
    if actual != manifest.get("weights_sha256"):
        raise CacheError(f"{WEIGHTS_NAME} is corrupted: sha256 {actual[:12]}... differs from "
                         f"the manifest's {str(manifest.get('weights_sha256'))[:12]}...")
    try:
        state = safetensors.torch.load(weights_path.read_bytes())
    except Exception as err:  # safetensors raises its own error, or others, for a bad file
        raise CacheError(f"{WEIGHTS_NAME} is unreadable ({type(err).__name__})") from None
    model = GPT(GPTConfig(**material["model_config"]))
    try:
        model.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CacheError(f"{WEIGHTS_NAME} does not fit the configuration ({first})") from None
    return model.eval(), manifest


# ----------------------------------------------------------------------------- building

@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (the number before is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def folder_lock(folder: Path) -> FileLock:
    """An exclusive lock on a model's ``folder`` (a file beside it), so that two processes
    never make the same model at once."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder.parent / f".{folder.name}.lock"))


#: What building a model gives: the model, its metrics and its training history.
Built = tuple[GPT, dict[str, Any], dict[str, Any]]
#: Builds a model: given the function that reports progress and the cache folder.
Builder = Callable[[Callable[[str], None], Path], Built]


def _train_recipe(recipe: Recipe, text: str, progress: bool, say: Callable[[str], None],
                  folder: Path) -> Built:
    """Train the model of ``recipe`` on ``text`` with `minigpt.train.train`."""
    tokenizer = CharTokenizer.from_text(text)
    train_text, val_text = split_text(text, recipe.train_fraction)
    train_ids = np.asarray(tokenizer.encode_ordinary(train_text), dtype=np.uint16)
    val_ids = np.asarray(tokenizer.encode_ordinary(val_text), dtype=np.uint16)
    config = recipe.gpt_config(tokenizer.vocab_size)
    say(f"training a model once ({plural(config.n_layers, 'layer')}, "
        f"{plural(config.n_heads, 'head')}, D={config.d_model}, "
        f"{recipe.training.max_steps} steps); it is cached in {folder}")
    # The bar only on a terminal: in a log file (a CI runner's) its thousand redraws would
    # bury the few evaluation lines, which are printed either way.
    bar = progress and sys.stderr.isatty()
    with threads(recipe.threads):
        result = train(config, recipe.training, train_ids, val_ids, tokenizer=tokenizer,
                       progress=bar, log=say if progress else None)
    return result.model, result.metrics, asdict(result.history)


def store_model(folder: Path, key: str, material: dict[str, Any], built: Built,
           census: list[Any]) -> tuple[GPT, dict[str, Any]]:
    """Write a built model into ``folder`` (weights, then manifest, with the ``census`` of
    the matrix products building it computed, `minigpt.products.census`); return it, on the
    CPU in eval mode, and its manifest."""
    model = built[0].to("cpu").eval()
    weights = weights_bytes(model)
    manifest = {
        "key": key,
        "key_material": material,
        "weights_file": WEIGHTS_NAME,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "metrics": built[1],
        "history": built[2],
        "products": census,
    }
    if folder.exists():
        shutil.rmtree(folder)  # whatever was there was found unusable
    atomic_write(folder / WEIGHTS_NAME, weights)
    # The manifest goes last: its presence (with a matching hash) marks a complete cache.
    atomic_write(folder / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    return model, manifest


def weights_bytes(model: torch.nn.Module) -> bytes:
    """The model's state dict in the safetensors format (each tensor its own copy: tied
    weights are written twice, which the format requires)."""
    return safetensors.torch.save({name: tensor.detach().contiguous().clone()
                                   for name, tensor in model.state_dict().items()})


def plural(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: "1 layer", "4 heads"."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _stderr(message: str) -> None:
    # tqdm.write prints above an active progress bar instead of through it.
    tqdm.write(f"minigpt.recipes.pretrained: {message}", file=sys.stderr)


def load_or_build(recipe: Recipe, text: str, *, progress: bool = False,
                  cache: Path | None = None) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The model `recipe` trains on `text`: loaded from the cache if it is there and intact,
    trained (and cached) otherwise. See `book_model`."""
    if not isinstance(text, str) or len(text) < 2:
        raise ValueError("text must be a string of at least two characters")
    model, info = cached_model(key_material(recipe, text), functools.partial(
        _train_recipe, recipe, text, progress), progress=progress, cache=cache)
    return model, CharTokenizer.from_text(text), info


def cached_model(material: dict[str, Any], build: Builder, *, progress: bool = False,
                 cache: Path | None = None) -> tuple[GPT, ModelInfo]:
    """The model that ``material`` (JSON-able, everything that determines its weights, with
    its ``"model_config"``) describes: loaded from ``<cache>/models/<key>/`` if it is there
    and intact, else fetched, else made by ``build`` and stored there, under a lock."""
    start = time.perf_counter()
    key = cache_key(material)
    folder = (cache_dir() if cache is None else cache) / "models" / key[:20]
    say: Callable[[str], None] = _stderr if progress else log.info
    # Loading builds a GPT (random initial weights) and training seeds torch: fork the
    # generator so that the caller's random state is the same whichever path is taken.
    with torch.random.fork_rng(devices=[]), folder_lock(folder):
        found = kept_model(folder, key, material, progress=progress, say=say)
        if found is None:
            with products.census() as calls:
                made = build(say, folder)
            model, manifest = store_model(folder, key, material, made, calls)
        else:
            model, manifest = found.model, found.manifest
            key, folder = found.key, found.folder
    info = ModelInfo(key=key, path=folder, built=found is None,
                     fetched=found is not None and found.fetched,
                     load_seconds=time.perf_counter() - start, manifest=manifest)
    return model, info


class Kept(NamedTuple):
    """A model `kept_model` found: loaded and verified, with its manifest, whether it was
    fetched, and its cache key and folder (the book's own, where one was used)."""

    model: GPT
    manifest: dict[str, Any]
    fetched: bool
    key: str
    folder: Path


def kept_model(folder: Path, key: str, material: dict[str, Any], *, progress: bool = False,
               say: Callable[[str], None] = log.info) -> Kept | None:
    """The model of ``key`` kept in ``folder`` if it is there and intact, else fetched there
    from the book's published models (`minigpt.recipes.published`); None if it is neither
    (a damaged one is warned of). The caller holds the folder's lock (`folder_lock`).

    On a machine whose environment trains other bits than the book's (another platform,
    PyTorch build or products: `minigpt.recipes.published.book_material`), the book's own
    model comes first: kept beside this machine's, under its own key, or fetched; this
    machine's is kept or trained only where the book's cannot be had."""
    # Fetching decides none of the weights (they are checked against the stored hashes):
    # not a training module, so imported here, outside the key.
    from minigpt.recipes import published
    book = published.book_material(material)
    if book is None:
        return _kept_or_fetched(folder, key, material, progress=progress, say=say)
    book_key = cache_key(book)
    book_folder = folder.parent / book_key[:20]
    with folder_lock(book_folder):
        found = _kept_or_fetched(book_folder, book_key, book, progress=progress, say=say,
                                 fetch=False)
        if found is None:
            mine = _kept_or_fetched(folder, key, material, progress=progress, say=say,
                                    fetch=False)
            if mine is not None:  # trained here once when the book's could not be had
                return mine
            found = _kept_or_fetched(book_folder, book_key, book, progress=progress, say=say)
    if found is not None:
        published.said_once(material)
    return found


def _kept_or_fetched(folder: Path, key: str, material: dict[str, Any], *, progress: bool,
                     say: Callable[[str], None], fetch: bool = True) -> Kept | None:
    """`kept_model`'s two places for one key: the cache, then (``fetch``) the site."""
    if folder.exists() and (loaded := _load_or_warn(folder, key, material, "cached")):
        return Kept(*loaded, fetched=False, key=key, folder=folder)
    from minigpt.recipes import published
    if fetch and published.fetch(key, folder, progress=progress, say=say) and (
            loaded := _load_or_warn(folder, key, material, "fetched")):
        return Kept(*loaded, fetched=True, key=key, folder=folder)
    return None


def _load_or_warn(folder: Path, key: str, material: dict[str, Any],
                  how: str) -> tuple[GPT, dict[str, Any]] | None:
    """`_load`, or None after a warning that says why the ``how`` (cached, fetched) model
    is not used."""
    try:
        return _load(folder, key, material)
    except CacheError as why:
        message = f"the {how} model in {folder} is not used: {why}; rebuilding it"
        log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=5)
        return None


def book_model(*, progress: bool = False,
               recipe: Recipe = BOOK_RECIPE) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The book's trained character-level GPT, its tokenizer, and a `ModelInfo`.

    The first call on a machine trains it on `shakespeare_text()` with `BOOK_RECIPE` (a few
    minutes on a 2-core CPU) and caches it; later calls load and verify the cache in
    seconds. Silent unless ``progress`` (a progress bar and the evaluations on stderr), so
    that a notebook prints the same whether the model was cached or trained. The model is
    returned in eval mode on the CPU. `python -m minigpt pretrained` builds it at set-up.
    """
    start = time.perf_counter()
    model, tokenizer, info = load_or_build(recipe, corpus(), progress=progress)
    # Count reading the corpus too: it is part of what a second call costs.
    return model, tokenizer, replace(info, load_seconds=time.perf_counter() - start)


def modern_model(*, progress: bool = False) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The modern recipe's model of the same text and tokenizer (`MODERN_RECIPE`), cached
    like the book model; what the modern-GPT chapter and the landing page show."""
    return book_model(progress=progress, recipe=MODERN_RECIPE)


def draft_model(*, progress: bool = False) -> tuple[GPT, CharTokenizer, ModelInfo]:
    """The book model's small companion (`DRAFT_RECIPE`: one layer, D = 64), trained the
    same way on the same text with the same tokenizer, and cached like it."""
    return book_model(progress=progress, recipe=DRAFT_RECIPE)


#: What `MODELS` holds: a function that loads (or, once, trains) a cached model.
Loader = Callable[..., tuple[GPT, CharTokenizer, ModelInfo]]

#: The pre-trained models by name. The assistants made from the book model are
#: `minigpt.recipes.assistant`'s, and `minigpt.recipes.assistant.MODELS` lists these and
#: those together.
MODELS: dict[str, Loader] = {"book": book_model, "draft": draft_model, "modern": modern_model}
