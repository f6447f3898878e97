"""What `make book` and `make test` keep in the cache between runs, and the key each is kept
under: a chapter's execution (`tools/execute_chapters.py`), the playground's export
(`tools/playground.py`) and an emulated CPU's run of the same-bits proof
(`tests/test_same_bits.py`). Each is made again whenever something that made it has changed,
as the cached models are retrained whenever the code that trains them has; otherwise the
kept one is used. An empty cache (`make reproduce`) keeps nothing.

A key is the sha256 of the parts its maker names, always with `setting_parts`: the files the
package's runs read (`files_digest`: the package's Python and C++, for a chapter or the
emulated proof only the modules its code imports (`imported_files`), by their code alone, as
`minigpt.recipes.pretrained.code_text` reads them for the models' keys, so a comment or a docstring
changes no key; every other file byte for byte), the installed distributions, Python, the
machine, and the environment variables that steer what the kernels compute.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from minigpt.files import atomic_write, cache_dir
from minigpt.recipes.pretrained import code_text

ROOT = Path(__file__).resolve().parents[1]
#: The prefixes of the environment variables that steer what a process computes: the
#: package's own, the CPU kernels' and threads' (which importing minigpt pins), the hash seed.
STEERING = ("MINIGPT_", "MKL_", "OMP_", "KMP_", "ATEN_", "TORCH_", "PYTHONHASHSEED")
#: Where a record of the products computed is journalled changes nothing computed.
NOT_STEERING = frozenset({"MINIGPT_CENSUS"})
#: The files besides the package that the book's runs read: how the package is installed,
#: the stored models' hashes (what set-up's models are), and the tools that run them.
FIXED_INPUTS = ("pyproject.toml", "requirements.txt", "tests/notebooks/models.json",
                "tools/kept.py", "tools/baseline.py")


def inputs(root: Path = ROOT, cells: Sequence[str] | None = None) -> list[Path]:
    """The files `files_digest` reads: the package (with ``cells``, the code a chapter
    executes, only the modules it imports: `imported_files`), the book's data (every file
    under book/ but its pages) and `FIXED_INPUTS`."""
    package = imported_files(cells, root / "src" / "minigpt") if cells is not None else None
    if package is None:
        package = [p for p in (root / "src").rglob("*") if p.is_file()
                   and "__pycache__" not in p.parts and not p.parent.name.endswith(".egg-info")
                   and p.suffix not in {".pyc", ".so"}]
    data = [p for p in (root / "book").rglob("*") if p.is_file() and p.suffix != ".md"]
    fixed = [root / name for name in FIXED_INPUTS]
    return sorted(package + data + [p for p in fixed if p.exists()])


def imported_files(cells: Sequence[str], package: Path) -> list[Path] | None:
    """The files of the package (its folder ``package``) that running the code ``cells``
    can load: each module the code imports, the packages above it, and what each of those
    imports in turn, wherever in its file the import stands (in a function too); a module's
    C++ (as ``products.cpp``) with its Python. None if a cell is not Python that `ast` reads
    (once its IPython magics, lines that begin with ``%`` or ``!``, are set aside): then
    every file counts. A cell that runs ``python -m minigpt`` only when minigpt is not
    installed (the chapters' first) runs nothing of it where the key is taken."""
    def files(name: str) -> list[Path]:
        module = package.joinpath(*name.split(".")) if name else package
        python = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
        cpp = module.with_suffix(".cpp")
        if not cpp.is_file():
            return [python] if python.is_file() else []
        headers = re.findall(r'^#include "([^"]+)"', cpp.read_text(encoding="utf-8"), re.M)
        return [p for p in (python, cpp, *(cpp.parent / h for h in headers)) if p.is_file()]

    def imports(source: str) -> set[str]:
        names: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "minigpt" or node.module.startswith("minigpt.")):
                base = node.module.removeprefix("minigpt").removeprefix(".")
                names.add(base)  # and each name that is a module of it
                names.update(f"{base}.{a.name}".lstrip(".") for a in node.names
                             if files(f"{base}.{a.name}".lstrip(".")))
            elif isinstance(node, ast.Import):
                names.update(a.name.removeprefix("minigpt").removeprefix(".")
                             for a in node.names if a.name.split(".")[0] == "minigpt")
        return {".".join(n.split(".")[:i]) for n in names for i in range(n.count(".") + 2)
                if n or i == 0} | {""}  # a module's packages run first, minigpt's too

    seen: set[str] = set()
    todo: set[str] = set()
    for cell in cells:
        python = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                           for line in cell.splitlines())
        try:
            todo |= imports(python)
        except SyntaxError:
            return None
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for path in files(name):
            if path.suffix == ".py":
                todo |= imports(path.read_text(encoding="utf-8")) - seen
    return sorted({path for name in seen for path in files(name)})


def files_digest(root: Path = ROOT, paths: Sequence[Path] | None = None) -> str:
    """The sha256 of ``paths`` under ``root`` (default: `inputs`), each file by its name
    under ``root`` and its content: the package's Python and C++ (under src/) by their code
    alone, every other file byte for byte."""
    digest = hashlib.sha256()
    for path in inputs(root) if paths is None else paths:
        name = path.relative_to(root).as_posix()
        code = path.suffix in {".py", ".cpp"} and name.startswith("src/")
        data = code_text(path).encode("utf-8") if code else path.read_bytes()
        digest.update(f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return digest.hexdigest()


def steering(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The variables of ``environ`` that steer what a process computes, sorted."""
    return sorted((k, v) for k, v in environ.items()
                  if k.startswith(STEERING) and k not in NOT_STEERING)


def setting_parts(environ: Mapping[str, str]) -> dict[str, str]:
    """What every key reads besides its maker's own parts: the installed distributions,
    Python, the machine and the steering variables of ``environ``."""
    return {"distributions": "\n".join(sorted(
                f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())),
            "python": sys.version,
            "machine": f"{platform.machine()} {_cpu_model()}",
            "environment": json.dumps(steering(environ))}


def key(parts: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """The sha256 of ``parts`` (name -> text) and `setting_parts` of ``environ`` (by default
    this process's environment)."""
    digest = hashlib.sha256()
    everything = {**parts, **setting_parts(os.environ if environ is None else environ)}
    for name, text in everything.items():
        data = text.encode("utf-8")
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _cpu_model() -> str:
    """The CPU's model name (Linux), or nothing where /proc/cpuinfo does not say it."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines
                 if line.startswith("model name")), "")


def record_path(kind: str, name: str) -> Path:
    """Where the newest record of ``name`` of ``kind`` is kept (one a name)."""
    return cache_dir() / "kept" / kind / f"{name}.json"


def recall(kind: str, name: str, key_: str) -> dict[str, Any] | None:
    """The record kept for ``name`` under ``key_``, or None when none is kept or the one kept
    was made from other inputs."""
    path = record_path(kind, name)
    if not path.is_file():
        return None
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:  # written whole or not at all: this one is not ours
        return None
    if not (isinstance(kept, dict) and kept.get("key") == key_):
        return None
    record: dict[str, Any] = kept["record"]
    return record


def keep(kind: str, name: str, key_: str, record: Any) -> None:
    """Keep ``record`` (JSON) for ``name`` under ``key_``, in place of any older one."""
    data = json.dumps({"key": key_, "record": record}).encode("utf-8")
    atomic_write(record_path(kind, name), data)


def recall_folder(kind: str, key_: str, out: Path) -> bool:
    """Copy the folder kept under ``key_`` to ``out`` (which must not exist); False if none
    is kept."""
    kept = cache_dir() / "kept" / kind / key_
    if not kept.is_dir():
        return False
    shutil.copytree(kept, out)
    return True


def keep_folder(kind: str, key_: str, folder: Path) -> None:
    """Keep a copy of ``folder`` under ``key_``, in place of the older ones of ``kind``: it
    appears whole (copied aside, then renamed) or not at all."""
    home = cache_dir() / "kept" / kind
    home.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(dir=home, prefix=".new-"))
    shutil.copytree(folder, aside / "copy")
    for old in home.iterdir():
        if old != aside:
            shutil.rmtree(old, ignore_errors=True)
    os.replace(aside / "copy", home / key_)
    shutil.rmtree(aside)
