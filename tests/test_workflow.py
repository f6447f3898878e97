"""The GitHub Actions workflow that tests the book and publishes it (.github/workflows/).

It cannot run here, so what can be checked is: actionlint finds nothing wrong with it,
the only command it runs is the README's test command (`make test`, which builds the site
and the PDF and runs every test), its caches are keyed on what they depend on, and it
publishes the built site (which holds the PDF) to GitHub Pages from main only.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW = WORKFLOWS / "book.yml"


def _workflow() -> dict[str, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    if True in loaded:  # YAML 1.1 reads the key `on` as a boolean
        loaded["on"] = loaded.pop(True)
    return loaded


def _steps(job: str) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = _workflow()["jobs"][job]["steps"]
    return steps


def _run_commands() -> list[str]:
    """Every shell command the workflow runs itself, one per line of each `run:`."""
    return [line.strip()
            for job in _workflow()["jobs"].values()
            for step in job.get("steps", [])
            for line in str(step.get("run", "")).splitlines()
            if line.strip() and not line.strip().startswith("#")]


def readme_commands() -> dict[str, str]:
    """The README's two commands: {command: what it does}, from its first code block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## The two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "README: no code block under 'The two commands'"
    commands = {}
    for line in block.group(1).splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            commands[command.strip()] = comment.strip()
    return commands


def _actionlint() -> str:
    beside = Path(sys.executable).parent / "actionlint"
    found = str(beside) if beside.exists() else shutil.which("actionlint")
    if not found:
        pytest.fail("actionlint is missing: it is pinned in requirements.txt (make setup)")
    return found


def test_actionlint_finds_nothing() -> None:
    files = sorted(WORKFLOWS.glob("*.y*ml"))
    assert WORKFLOW in files
    result = subprocess.run([_actionlint(), "-no-color", *map(str, files)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_would_catch_a_mistake(tmp_path: Path) -> None:
    # A check that cannot fail checks nothing: a misspelt event and an unknown
    # expression must be reported.
    broken = tmp_path / "broken.yml"
    broken.write_text("on: pushh\njobs:\n  t:\n    runs-on: ubuntu-latest\n    steps:\n"
                      "      - run: echo ${{ github.nope }}\n", encoding="utf-8")
    result = subprocess.run([_actionlint(), "-no-color", str(broken)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pushh" in result.stdout and "nope" in result.stdout


def test_readme_names_the_two_commands() -> None:
    commands = readme_commands()
    assert list(commands) == ["make book", "make test"], commands
    assert "test" in commands["make test"]


def test_the_workflow_runs_exactly_the_readmes_test_command() -> None:
    assert _run_commands() == ["make test"], (
        "the workflow must run the README's test command and nothing else; it runs "
        f"{_run_commands()}"
    )
    assert "make test" in readme_commands()
    # CI here runs the same command (.ci/run).
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert "make test" in ci


def test_the_workflow_runs_on_every_push_and_pull_request() -> None:
    on = _workflow()["on"]
    assert "push" in on and "pull_request" in on
    for event in ("push", "pull_request"):
        assert not (on[event] or {}), f"{event} is filtered: {on[event]}"
    test = _workflow()["jobs"]["test"]
    assert test["runs-on"] == "ubuntu-latest"
    # Debian, as here: `make test` installs Debian's chromium and chromium-driver as root.
    assert str(test["container"]).startswith("python:3.11-bookworm")


def _recipe_version() -> int:
    tree = ast.parse((ROOT / "src" / "minigpt" / "pretrained.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "RECIPE_VERSION"):
            value = ast.literal_eval(node.value)
            assert isinstance(value, int)
            return value
    raise AssertionError("src/minigpt/pretrained.py defines no RECIPE_VERSION")


def test_caches_are_keyed_on_requirements_and_recipe() -> None:
    assert _workflow()["env"]["MINIGPT_RECIPE_VERSION"] == str(_recipe_version()), (
        "the workflow's MINIGPT_RECIPE_VERSION must follow minigpt.pretrained.RECIPE_VERSION"
    )
    caches = {step["with"]["path"]: step["with"]["key"] for step in _steps("test")
              if str(step.get("uses", "")).startswith("actions/cache@")}
    assert set(caches) == {"~/.cache/pip", "~/.cache/minigpt"}, caches
    assert "hashFiles('requirements.txt')" in caches["~/.cache/pip"]
    assert "hashFiles('requirements.txt')" in caches["~/.cache/minigpt"]
    assert "env.MINIGPT_RECIPE_VERSION" in caches["~/.cache/minigpt"]
    # The caches are restored before the command that fills them.
    uses = [str(step.get("uses", step.get("run"))) for step in _steps("test")]
    assert max(i for i, u in enumerate(uses) if u.startswith("actions/cache@")) < uses.index(
        "make test")


def test_main_publishes_the_site_and_pdf_to_pages() -> None:
    on_main = "github.event_name == 'push' && github.ref == 'refs/heads/main'"
    upload = [s for s in _steps("test")
              if str(s.get("uses", "")).startswith("actions/upload-pages-artifact@")]
    assert len(upload) == 1 and upload[0]["with"]["path"] == "_build/html"
    assert upload[0]["if"] == on_main
    publish = _workflow()["jobs"]["publish"]
    assert publish["if"] == on_main and publish["needs"] == "test"
    assert publish["permissions"] == {"pages": "write", "id-token": "write"}
    assert publish["environment"]["name"] == "github-pages"
    assert [str(s["uses"]).split("@")[0] for s in publish["steps"]] == ["actions/deploy-pages"]
    assert _workflow()["permissions"] == {"contents": "read"}
    # _build/html holds the PDF because `make test` makes it (make pdf copies it there).
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    test_rule = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    assert test_rule and "pdf" in test_rule.group(1).split()
