"""codespell as `make lint` runs it (settings in pyproject.toml, [tool.codespell]).

`make lint` itself spells the repository; these tests check that its settings still catch
a typo, and that the project's word list (tools/codespell-words.txt) holds exactly the
words codespell flags in the book's corpus, Shakespeare's plays: his spellings and the
plays' names, never a typo waved through.

    .venv/bin/python tests/test_spelling.py > tools/codespell-words.txt   # rebuild the list
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from minigpt.data import shakespeare_text

ROOT = Path(__file__).resolve().parents[1]
WORDS = ROOT / "tools" / "codespell-words.txt"
CODESPELL = Path(sys.executable).parent / "codespell"
FLAGGED = re.compile(r":\d+: (?P<word>.+?) ==> ", re.MULTILINE)


def _codespell(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # codespell reads its settings from the pyproject.toml of the folder it runs in.
    return subprocess.run([str(CODESPELL), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def word_list() -> list[str]:
    lines = WORDS.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def flagged_in_corpus() -> list[str]:
    """The words codespell flags in the corpus without the project's settings, lower case."""
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus.txt"
        corpus.write_text(shakespeare_text(), encoding="utf-8")
        result = _codespell(str(corpus), cwd=Path(folder))
    assert result.returncode in (0, 65), result.stderr  # 65: it found something
    return sorted({match["word"].lower() for match in FLAGGED.finditer(result.stdout)})


def test_the_word_list_is_what_codespell_flags_in_the_corpus() -> None:
    listed = word_list()
    assert listed == sorted(set(listed)), "keep tools/codespell-words.txt sorted, no repeats"
    flagged = flagged_in_corpus()
    assert "jaques" in flagged and "wast" in flagged  # a name and one of his spellings
    assert listed == flagged, (
        f"not in the corpus (typos?): {sorted(set(listed) - set(flagged))}; "
        f"flagged in the corpus but not listed: {sorted(set(flagged) - set(listed))}. "
        "Rebuild the list: .venv/bin/python tests/test_spelling.py > tools/codespell-words.txt")


def test_the_projects_settings_catch_typos_and_pass_the_corpus_words(tmp_path: Path) -> None:
    # A check that cannot fail checks nothing: with the project's settings (run from the
    # repository), a misspelt chapter is reported, and the listed words in any case are not.
    typos = ["rec" + "ieve", "t" + "eh"]  # spelt apart, or `make lint` would flag this file
    chapter = tmp_path / "chapter.md"
    chapter.write_text(f"We {typos[0]} the text, and {typos[1]} model reads it.\n"
                       'line = "All the world\'s a stage,"  # JAQUES; Jaques; wast thou\n',
                       encoding="utf-8")
    result = _codespell(str(chapter), cwd=ROOT)
    assert result.returncode == 65, result.stdout + result.stderr
    assert sorted(match["word"] for match in FLAGGED.finditer(result.stdout)) == typos, (
        result.stdout)


if __name__ == "__main__":
    header = [line for line in WORDS.read_text(encoding="utf-8").splitlines()
              if line.startswith("#")]
    print("\n".join(header + flagged_in_corpus()))
