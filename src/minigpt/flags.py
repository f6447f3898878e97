"""Command-line flags made from pydantic models: one flag per field, so a new field is a new
flag, typed, checked and explained by the model itself (used by `minigpt.cli`)."""

from __future__ import annotations

import argparse
import inspect
import re
import types
from collections.abc import Sequence
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _attribute_docs(model: type[BaseModel]) -> dict[str, str]:
    """A class docstring's "Attributes:" section: field name -> its text."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in inspect.cleandoc(model.__doc__ or "").partition("Attributes:")[2].splitlines():
        if match := re.match(r" {4}(\w[\w, ]*):\s*(.*)", line):
            names = [n.strip() for n in match[1].split(",")]
            docs |= dict.fromkeys(names, match[2])
        elif line.startswith(" " * 8):
            docs |= {n: f"{docs[n]} {line.strip()}" for n in names}
        elif line.strip():
            break
    return docs


def add_model_flags(parser: Any, model: type[BaseModel], defaults: BaseModel | None = None,
                    skip: Sequence[str] = (), exclusive: Sequence[str] = ()) -> None:
    """One flag per field of a pydantic model, `--field-name`: Literal -> choices, bool ->
    --flag/--no-flag, int/float/str/Path (and X | None as X); help from the field's
    description, else the class docstring's Attributes: line; the default shown from
    ``defaults`` or the field (none for a field marked ``derived_default``, whose default
    follows from other fields). The ``exclusive`` fields form a mutually exclusive group."""
    docs = _attribute_docs(model)
    group = parser.add_mutually_exclusive_group() if exclusive else parser
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind: Any = field.annotation
        if get_origin(kind) in (Union, types.UnionType):
            kind = next(a for a in get_args(kind) if a is not type(None))
        choices = get_args(kind) if get_origin(kind) is Literal else None
        default = getattr(defaults, name, field.default)
        text = field.description or docs.get(name) or name.replace("_", " ")
        derived = isinstance(field.json_schema_extra, dict) and bool(
            field.json_schema_extra.get("derived_default"))  # e.g. d_ff = 4 D: no one value
        if (default is not None and default is not PydanticUndefined and kind is not bool
                and not derived):
            text += f" (default: {default!r})"
        options: dict[str, Any] = {"help": text.replace("%", "%%")}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options |= {"type": type(choices[0]) if choices else kind, "choices": choices,
                        "metavar": None if choices else name.upper(),
                        "required": field.is_required() and defaults is None}
        (group if name in exclusive else parser).add_argument(flag(name), **options)
