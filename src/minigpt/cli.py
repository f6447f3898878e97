"""Command line: `python -m minigpt {assets,train,sample,pretrained} ...`.

Each sub-command lives in the module it drives and owns its own argument
parser; this file only dispatches, so `python -m minigpt train --help` shows
the train module's flags.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "assets": ("minigpt.assets", "fetch and verify the corpus and GPT-2's BPE ranks"),
    "train": ("minigpt.train", "train a GPT on a text file"),
    "sample": ("minigpt.sample", "sample text from a trained checkpoint"),
    "pretrained": ("minigpt.pretrained", "train (once) and verify the models the chapters share"),
}


def _usage() -> str:
    lines = ["usage: python -m minigpt COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`python -m minigpt COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"minigpt: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    result: int = module.main(rest)
    return result
