"""Functions short enough to read on one screen: none in the package runs past 60 lines,
except objects a chapter prints whole (a chapter shows the code that runs, not a shortened
copy beside it)."""

import ast
from pathlib import Path

from helpers import ROOT

import minigpt

MAX_LINES = 60
PACKAGE = Path(minigpt.__file__).parent

# "module.py::qualified name" -> the chapter (book/<chapter>.md) that prints it whole.
ALLOWED = {
    "tokenizer.py::train_bpe": "tokenisation",
}


def _function_lengths() -> dict[str, int]:
    """Lines from `def` to the function's last line, for every function and method
    (nested ones too), keyed as in ALLOWED."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[f"{module}::{name}"] = child.end_lineno - child.lineno + 1
                walk(child, module, name + ".")

    for path in sorted(PACKAGE.rglob("*.py")):
        walk(ast.parse(path.read_text(encoding="utf-8")), path.name, "")
    return lengths


def test_no_function_runs_past_sixty_lines_unless_a_chapter_prints_it():
    lengths = _function_lengths()
    assert len(lengths) > 100, "the scan found too few functions: is PACKAGE right?"
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in ALLOWED}
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into helpers, or, "
                          f"if a chapter prints one whole, add it to ALLOWED): {too_long}")


def test_each_allowed_long_function_is_long_and_printed_by_its_chapter():
    lengths = _function_lengths()
    for name, chapter in ALLOWED.items():
        module, qualified = name.split("::")
        assert lengths.get(name, 0) > MAX_LINES, f"{name} is short now: drop it from ALLOWED"
        text = (ROOT / "book" / f"{chapter}.md").read_text(encoding="utf-8")
        assert f"../src/minigpt/{module}" in text and f":pyobject: {qualified}\n" in text, (
            f"book/{chapter}.md does not print {name}")


def test_the_command_line_module_stays_a_dispatcher():
    # cli.py parses and dispatches; each command's work lives in its own module.
    lines = (PACKAGE / "cli.py").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"cli.py has {lines} lines (at most 250): move a command's work out"
