"""The package's layout: the core at the top level imports no subpackage, each subpackage
imports the core and itself only (the recipes may import every other subpackage), and only
the command line sits above them all; imports inside functions count too."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import minigpt

PACKAGE = Path(minigpt.__file__).parent
SUBPACKAGES = ("posttrain", "interp", "recipes", "figures")
#: What each part of the package may import besides itself: the core is "".
ALLOWED = {"": {""}, "posttrain": {""}, "interp": {""}, "figures": {""},
           "recipes": {"", "posttrain", "interp", "figures"}}
#: The entry points above the layout: the command line imports from every part.
ENTRY_POINTS = {"cli", "__main__"}


def part(module: str) -> str:
    """The part of the package a dotted module name under ``minigpt`` lies in."""
    first = module.split(".")[0]
    return first if first in SUBPACKAGES else ""


def imported(path: Path) -> set[str]:
    """The package's modules a file imports, as dotted names under ``minigpt``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "minigpt":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("minigpt."):
                names.add(node.module.removeprefix("minigpt."))
        elif isinstance(node, ast.Import):
            names.update(alias.name.removeprefix("minigpt.") for alias in node.names
                         if alias.name.startswith("minigpt."))
    return names


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        found.append((dotted.removesuffix(".__init__"), path))
    return found


def test_the_layout_has_the_core_and_four_subpackages() -> None:
    parts = {part(name) for name, _ in modules()}
    assert parts == {"", *SUBPACKAGES}
    for sub in SUBPACKAGES:
        assert (PACKAGE / sub / "__init__.py").read_text(encoding="utf-8").startswith('"""')


@pytest.mark.parametrize(("name", "path"), modules(), ids=[name for name, _ in modules()])
def test_imports_run_down_the_layout(name: str, path: Path) -> None:
    if name in ENTRY_POINTS:
        return
    allowed = ALLOWED[part(name)] | {part(name)}
    wrong = sorted(m for m in imported(path) if m not in ENTRY_POINTS and part(m) not in allowed)
    assert not wrong, f"minigpt.{name} imports {wrong}, which lie above it"
    assert not imported(path) & ENTRY_POINTS, f"minigpt.{name} imports the command line"


def test_the_check_finds_an_import_that_runs_up(tmp_path: Path) -> None:
    upward = tmp_path / "upward.py"
    upward.write_text("def f():\n    from minigpt.recipes.pretrained import book_model\n")
    assert imported(upward) == {"recipes.pretrained"}
    assert part("recipes.pretrained") not in ALLOWED["posttrain"]


def test_the_package_finds_the_repository_it_lies_in() -> None:
    # A module that reads a file of the repository counts its folders up from itself; a
    # module moved into a subpackage must count one more.
    from minigpt.recipes import published

    assert published.INDEX.is_file() and published.CONFIG.is_file()



def test_the_check_reads_every_kind_of_import(tmp_path: Path) -> None:
    # Both kinds of import statement, at the top and inside a function (the walk over the
    # tree is read once per kind: a generator read by the first would leave the second none).
    module = tmp_path / "both.py"
    module.write_text("import numpy\n\n\ndef f():\n    from pydantic import BaseModel\n")
    assert distributions(module) == {"numpy", "pydantic"}
    assert distributions(module, loaded_only=True) == {"numpy"}

@functools.cache
def top_level_distributions() -> dict[str, list[str]]:
    """The installed distributions that provide each top-level module (read once: it scans
    every installed distribution's file list, a quarter of a second a call)."""
    return packages_distributions()


def distributions(path: Path, *, loaded_only: bool = False) -> set[str]:
    """The registry packages a module imports (all its imports, or with ``loaded_only`` those
    that run when it is loaded, not inside a function), by their normalised names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(tree.body if loaded_only else ast.walk(tree))  # read twice below
    tops = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    tops |= {node.module for node in nodes if isinstance(node, ast.ImportFrom) and node.module
             and node.level == 0}
    found = top_level_distributions()
    return {normalised(dist) for top in tops for dist in found.get(top.split(".")[0], [])
            if top.split(".")[0] not in sys.stdlib_module_names | {"minigpt"}}


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_package_the_code_imports_is_declared() -> None:
    """requirements.txt pins every package a module imports; pyproject.toml declares each
    that `python -m minigpt` imports as it starts (its console script's)."""
    root = PACKAGE.parent.parent
    pinned = {normalised(line.split("==")[0]) for line in (root / "requirements.txt").read_text(
        encoding="utf-8").splitlines() if "==" in line and not line.startswith("#")}
    for name, path in modules():
        assert distributions(path) <= pinned, (name, distributions(path) - pinned)
    with (root / "pyproject.toml").open("rb") as file:
        declared = {normalised(re.split(r"[<>=!~ ;\[]", d)[0]) for d in tomllib.load(file)[
            "project"]["dependencies"]}
    started = subprocess.run([sys.executable, "-c", "import sys, minigpt.cli; print(*sorted("
                              "m for m in sys.modules if m.split('.')[0] == 'minigpt'))"],
                             capture_output=True, text=True, check=True).stdout.split()
    paths = dict(modules())
    for name in started:
        found = distributions(paths[name.partition(".")[2] or "__init__"],
                              loaded_only=True) - {"minigpt"}
        assert found <= declared, (name, found - declared)


def test_the_readme_says_what_an_edit_to_each_module_retrains() -> None:
    # The column "an edit retrains" of the README's module tables, against the modules each
    # cached model's key hashes: a module moved into or out of a key must be said.
    from minigpt.recipes import assistant, copiers, pretrained, rewards, runs

    groups = [("the assistants and rewards runs", assistant.ASSISTANT_MODULES),
              ("the rewards runs", rewards.REWARDS_MODULES),
              ("the copiers", copiers.COPIER_MODULES), ("the kept runs", runs.RUN_MODULES)]

    def retrains(modules: list[str]) -> str:
        if any(m in pretrained.TRAINING_MODULES for m in modules):
            return "every model and kept run"
        return next((what for what, key in groups if any(m in key for m in modules)),
                    "no model")

    readme = (PACKAGE.parents[1] / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| ((?:`minigpt\.[\w.]+`(?:, )?)+) \| .* \| ([^|]+) \|$", readme,
                      flags=re.M)
    said = {names: column for names, column in rows}
    assert len(said) >= 40, "every module of the package has a row"
    for names, column in said.items():
        modules = [n.strip("`").removeprefix("minigpt.") for n in names.split(", ")]
        assert column == retrains(modules), names
    # Fetching the corpus and beam search train nothing: out of the base models' key.
    assert said["`minigpt.assets`"] == "no model"
    assert said["`minigpt.decoding`"] == "the assistants and rewards runs"
