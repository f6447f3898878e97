"""The GitHub Actions workflows (.github/workflows/): book.yml tests the book and publishes
it, links.yml checks its external links weekly.

They cannot run here, so what can be checked is: actionlint finds nothing wrong with them;
the test job runs the README's test command (`make test`, which lints, builds the site and
the PDF and runs every test) and nothing else; beside it, and not before it, one job runs
`make nbval` and one `make unit` on Linux, macOS and Windows and on the oldest PyTorch
pyproject.toml accepts; the link check runs on a schedule and on demand, never on a push,
and keeps its report when it fails; caches are keyed on what they depend on; and the built
site (which holds the PDF) is published to GitHub Pages from main only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW = WORKFLOWS / "book.yml"
LINKS = WORKFLOWS / "links.yml"
REPRODUCE = WORKFLOWS / "reproduce.yml"


def _workflow(path: Path = WORKFLOW) -> dict[str, Any]:
    loaded: dict[Any, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    if True in loaded:  # YAML 1.1 reads the key `on` as a boolean
        loaded["on"] = loaded.pop(True)
    return loaded


def _steps(job: str, path: Path = WORKFLOW) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = _workflow(path)["jobs"][job]["steps"]
    return steps


def _run_commands(job: str, path: Path = WORKFLOW) -> list[str]:
    """Every shell command a job runs itself, one per line of each `run:`."""
    return [line.strip()
            for step in _steps(job, path)
            for line in str(step.get("run", "")).splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _make_rule(target: str) -> list[str]:
    """The prerequisites of a rule of the Makefile."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    rule = re.search(rf"^{target}:(.*)$", makefile, re.MULTILINE)
    assert rule, f"the Makefile has no rule {target}"
    return rule.group(1).split()


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
    assert WORKFLOW in files and LINKS in files and REPRODUCE in files
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


def test_the_test_job_runs_exactly_the_readmes_test_command() -> None:
    assert _run_commands("test") == ["make test"], (
        "the test job must run the README's test command and nothing else; it runs "
        f"{_run_commands('test')}"
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


@pytest.mark.parametrize(("job", "command"), [("test", "make test"), ("nbval", "make nbval")])
def test_caches_are_keyed_on_requirements_and_source(job: str, command: str) -> None:
    caches = {step["with"]["path"]: step["with"]["key"] for step in _steps(job)
              if str(step.get("uses", "")).startswith("actions/cache@")}
    assert set(caches) == {"~/.cache/pip", "~/.cache/minigpt"}, caches
    assert "hashFiles('requirements.txt')" in caches["~/.cache/pip"]
    assert "hashFiles('requirements.txt')" in caches["~/.cache/minigpt"]
    # The models' own keys hash the source that trains them (minigpt.recipes.pretrained.
    # source_sha256); keying the saved cache on it too keeps stale models out of it.
    assert "hashFiles('src/minigpt/**/*.py')" in caches["~/.cache/minigpt"]
    # The caches are restored before the command that fills them.
    uses = [str(step.get("uses", step.get("run"))) for step in _steps(job)]
    assert max(i for i, u in enumerate(uses) if u.startswith("actions/cache@")) < uses.index(
        command)


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
    # _build/html holds the PDF because `make test` prints it (tools/make_pdf.py copies it
    # there) beside the tests that do not read it, and then runs those that do.
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "tools/make_pdf.py" in recipe and '-m "not pdf"' in recipe and "-m pdf" in recipe


def test_make_test_lints_first_so_a_lint_failure_fails_ci() -> None:
    # make stops at the first prerequisite that fails, before anything is built.
    assert _make_rule("test")[0] == "lint"
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    for tool in ("ruff check src tests", "mypy", "codespell $(SPELL_PATHS)"):
        assert f"$(BIN)/{tool}" in recipe, f"make lint does not run {tool}"
    spelled = re.search(r"^SPELL_PATHS := (.*)$", makefile, re.MULTILINE)
    spelled_paths = set(spelled.group(1).split()) if spelled else set()
    assert {"book/*.md", "src", "tests", "README.md", "docs"} <= spelled_paths
    # The link check needs the network: never part of `make test`.
    assert "linkcheck" not in _make_rule("test") + _make_rule("setup")


def test_nbval_runs_beside_the_test_job_in_the_same_image() -> None:
    jobs = _workflow()["jobs"]
    assert _run_commands("nbval") == ["make nbval"]
    assert "needs" not in jobs["nbval"] and "needs" not in jobs["test"]  # in parallel
    assert jobs["nbval"]["container"] == jobs["test"]["container"]
    assert jobs["nbval"]["runs-on"] == "ubuntu-latest"


def _oldest_torch() -> str:
    with (ROOT / "pyproject.toml").open("rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    floors = [re.fullmatch(r"torch>=([\d.]+)", d.replace(" ", "")) for d in dependencies]
    found = [m.group(1) for m in floors if m]
    assert len(found) == 1, f"pyproject.toml should require torch>=X: {dependencies}"
    return found[0]


def test_unit_tests_run_on_three_systems_and_on_the_oldest_torch() -> None:
    unit = _workflow()["jobs"]["unit"]
    assert "needs" not in unit
    # On Linux, qemu-user first: tests/test_same_bits.py runs the venv as Intel and AMD CPUs.
    assert _run_commands("unit") == [
        "sudo apt-get update -qq && sudo apt-get install -y -qq qemu-user",
        "make unit TORCH=${{ matrix.torch }} SLOW=1"]
    (qemu,) = [s for s in _steps("unit") if "qemu-user" in str(s.get("run", ""))]
    assert qemu["if"] == "runner.os == 'Linux'"
    assert unit["defaults"]["run"]["shell"] == "bash"
    matrix = unit["strategy"]["matrix"]
    assert unit["strategy"]["fail-fast"] is False
    pinned = [(os, "") for os in matrix["os"] for torch in matrix["torch"] if torch == ""]
    assert sorted(pinned) == [("macos-latest", ""), ("ubuntu-latest", ""),
                              ("windows-latest", "")]
    extra = [(entry["os"], entry["torch"]) for entry in matrix["include"]]
    assert len(extra) == 1 and extra[0][0] == "ubuntu-latest", extra
    # The oldest torch tested is a release of the oldest series pyproject.toml accepts.
    oldest = _oldest_torch()
    assert extra[0][1].split(".")[:2] == oldest.split(".")[:2], (extra, oldest)
    # Each torch trains its own cached models.
    cache = [s for s in _steps("unit") if str(s.get("uses", "")).startswith("actions/cache@")]
    assert len(cache) == 1 and "matrix.torch" in cache[0]["with"]["key"]
    assert cache[0]["with"]["path"] == "~/.cache/minigpt"


def test_the_chapters_run_elsewhere_with_the_models_the_test_job_used() -> None:
    # macOS, Windows and Linux on arm64 train other bits than the book's: they fetch the
    # models the test job published (as an artifact, served on a local port) and execute
    # every chapter with them.
    job = _workflow()["jobs"]["chapters"]
    assert job["needs"] == "test" and job["strategy"]["fail-fast"] is False
    assert sorted(job["strategy"]["matrix"]["os"]) == [
        "macos-latest", "ubuntu-24.04-arm", "windows-latest"]
    (upload,) = [s for s in _steps("test") if s.get("with", {}).get("name") == "models"]
    assert upload["with"]["path"] == "_build/html/models" and "if" not in upload
    (download,) = [s for s in _steps("chapters")
                   if str(s.get("uses", "")).startswith("actions/download-artifact@")]
    folder = download["with"]["path"]
    assert download["with"]["name"] == "models"
    serve, run = _run_commands("chapters")
    assert serve.startswith("python -m http.server 8765") and f"--directory {folder}" in serve
    assert serve.endswith("&") and run == "MINIGPT_MODELS_URL=http://127.0.0.1:8765 make chapters"


def test_the_link_check_runs_weekly_and_on_demand_and_keeps_its_report() -> None:
    links = _workflow(LINKS)
    assert set(links["on"]) == {"schedule", "workflow_dispatch"}  # never on a push
    (cron,) = [entry["cron"] for entry in links["on"]["schedule"]]
    minute, hour, day, month, weekday = cron.split()
    assert day == month == "*" and weekday.isdigit(), f"not weekly: {cron}"
    assert _run_commands("linkcheck", LINKS) == ["make linkcheck"]
    assert links["permissions"] == {"contents": "read"}
    upload = [s for s in _steps("linkcheck", LINKS)
              if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(upload) == 1 and upload[0]["if"] == "failure()"
    assert upload[0]["with"]["path"].startswith("_build/linkcheck/")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^linkcheck:.*\n\t\$\(PY\) tools/linkcheck\.py$", makefile, re.MULTILINE)


def test_every_model_is_trained_afresh_weekly_and_checked() -> None:
    # `make reproduce`: `make test` in an empty cache with fetching off, so that set-up
    # trains every model and test_reproducible compares each with models.json.
    reproduce = _workflow(REPRODUCE)
    assert set(reproduce["on"]) == {"schedule", "workflow_dispatch"}
    (cron,) = [entry["cron"] for entry in reproduce["on"]["schedule"]]
    minute, hour, day, month, weekday = cron.split()
    assert day == month == "*" and weekday.isdigit(), f"not weekly: {cron}"
    assert _run_commands("reproduce", REPRODUCE) == ["make reproduce"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^reproduce:\n\tMINIGPT_CACHE=\$\$\(mktemp -d\) MINIGPT_MODELS_URL=off "
                     r"\$\(MAKE\) test$", makefile, re.MULTILINE)
    # and the site the test job builds carries the models (make book publishes them).
    assert re.search(r"^\t\$\(PY\) tools/publish\.py --unless-stale _build/html/models$",
                     makefile, re.MULTILINE)


def _dry_run_environment() -> dict[str, str]:
    """This process's environment for a `make -n`: under `make` itself (`make unit`, `make
    test`), the variables given to that make (TORCH=, VENV=, SLOW=, NPROC=) would reach the
    dry run through MAKEFLAGS and the environment, so they are left out."""
    return {k: v for k, v in os.environ.items() if k not in (
        "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VENV", "TORCH", "SLOW", "NPROC")}

def test_make_unit_torch_puts_that_torch_in_a_venv_of_its_own() -> None:
    # What CI's oldest-torch job runs, as a dry run: the venv, its requirements and the tests.
    env = _dry_run_environment()
    result = subprocess.run(["make", "--no-print-directory", "-n", "-B", "unit", "TORCH=9.9",
                             "SLOW=1"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                            env=env)
    assert result.returncode == 0, result.stderr
    bin_dir = "Scripts" if sys.platform == "win32" else "bin"
    lines = result.stdout.splitlines()
    assert any(line.endswith("-m venv .venv-torch9.9") for line in lines), lines
    sed = [line for line in lines if line.startswith("sed ")]
    assert sed == ["sed 's/^torch==.*/torch==9.9/' requirements.txt > "
                   ".venv-torch9.9/requirements.txt"], sed
    assert f'.venv-torch9.9/{bin_dir}/python -m pytest -m "not book"' in lines  # slow ones too
    quick = subprocess.run(["make", "--no-print-directory", "-n", "-B", "unit"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert f'.venv/{bin_dir}/python -m pytest -m "not book and not slow"' in (
        quick.stdout.splitlines()), quick.stdout
    # The substitution meets exactly one line of requirements.txt: the pinned torch.
    pinned = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
              if re.match(r"torch==", line)]
    assert len(pinned) == 1 and re.fullmatch(r"torch==[\d.]+", pinned[0]), pinned



@pytest.mark.parametrize("cores", [2, 4])
def test_set_ups_lanes_train_every_model_once(cores: int) -> None:
    # The lanes `make book-model` trains side by side (one a core, up to four): every model of
    # the catalogue in exactly one of them, so that none is left to a chapter's execution.
    from minigpt.recipes import catalogue

    env = _dry_run_environment()
    result = subprocess.run(["make", "--no-print-directory", "-n", "-B", "book-model",
                             f"NPROC={cores}"], capture_output=True, text=True, cwd=ROOT,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    (loop,) = re.findall(r"for lane in (.*?); do", result.stdout)
    lanes = [lane.split() for lane in re.findall(r'"([^"]*)"', loop)]
    assert len(lanes) == min(cores, 4)
    named = [name for lane in lanes for name in lane]
    assert sorted(named) == sorted(catalogue.MODELS), "each model in one lane, once"

def test_the_book_is_redrawn_weekly_and_its_report_kept_whatever_failed() -> None:
    # `make redraw`: both draws, each from an empty cache; the report and the executed
    # chapters are uploaded even when a chapter's cell failed (the run then exits 1).
    assert _run_commands("redraw", REPRODUCE) == ["make redraw"]
    (upload,) = [s for s in _steps("redraw", REPRODUCE)
                 if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()"
    assert "docs/redraw.md" in upload["with"]["path"].split()
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^DRAWS \?= seed native$", makefile, re.MULTILINE)
    assert re.search(r"^\t\$\(PY\) tools/redraw\.py \$\(DRAWS\) --shift \$\(SHIFT\)$",
                     makefile, re.MULTILINE)
