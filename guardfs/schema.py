"""The manifest's keys as text, generated from its pydantic models so that it cannot drift:
every section, and in each every key with its type, default and description
(``guard schema``)."""

from __future__ import annotations

import enum
import json
import textwrap
import types
from typing import Annotated, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from guardfs.manifest import Manifest

__all__ = ["schema_text", "sections"]


def sections() -> dict[str, type[BaseModel]]:
    """The manifest's sections by name, in order: ``{"task": Task, "paths": Paths, ...}``."""
    out: dict[str, type[BaseModel]] = {}
    for name, field in Manifest.model_fields.items():
        model = field.annotation
        assert isinstance(model, type), name  # every section is a model
        assert issubclass(model, BaseModel), name
        out[name] = model
    return out


def schema_text(only: str | None = None) -> str:
    """The schema of every section (or of the section *only*) as text."""
    lines = [
        "guard manifest schema: TOML, every key optional unless marked required; an unknown key is an error.",
        "Patterns are gitignore-style, relative to the workspace root.",
    ]
    for name, model in sections().items():
        if only is not None and name != only:
            continue
        required = " (required)" if Manifest.model_fields[name].is_required() else ""
        lines += ["", f"[{name}]{required}: {_first_line(model.__doc__)}"]
        for key, field in model.model_fields.items():
            lines.append(f"  {key} = {_default(field)}    # {_type(field.annotation, field.metadata)}")
            lines += textwrap.wrap(field.description or "", width=96, initial_indent="      ",
                                   subsequent_indent="      ")
    return "\n".join(lines)


def _first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True)
    return _toml(value, field.metadata)


def _toml(value: object, metadata: list[object]) -> str:
    if value is None:
        return '"unlimited"' if _unlimited(metadata) else "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return json.dumps(value.value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v, []) for v in value) + "]"
    return json.dumps(value)


def _unlimited(metadata: list[object]) -> bool:
    return any(isinstance(m, BeforeValidator) and m.func.__name__ == "_unlimited" for m in metadata)


def _type(annotation: object, metadata: list[object]) -> str:
    """Words for a field's type, with its bounds."""
    if _unlimited(metadata):
        return 'positive integer, or "unlimited"'
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        base, *more = args
        inner = [m for info in more if isinstance(info, FieldInfo) for m in info.metadata]
        return _type(base, [*more, *inner, *metadata])
    if origin is list:
        return f"list of {_plural(_type(args[0], []))}"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, metadata) for a in args if a is not type(None))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(json.dumps(m.value) for m in annotation)
    names: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(annotation, str(annotation)) + _bounds(metadata)


def _bounds(metadata: list[object]) -> str:
    words = []
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            words.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Gt):
            words.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Le):
            words.append(f"<= {m.le}")
        elif isinstance(m, annotated_types.Lt):
            words.append(f"< {m.lt}")
    return f" ({', '.join(words)})" if words else ""


def _plural(word: str) -> str:
    if word.startswith("one of "):
        return "values from " + word.removeprefix("one of ")
    return {"string": "strings", "integer": "integers"}.get(word, word)
