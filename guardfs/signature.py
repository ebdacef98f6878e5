"""Oscillation signatures: which symbols (or line regions) a change touched, and a hash.

For Python sources the unit is the innermost enclosing ``def``/``class`` (``<module>`` for
top-level code), found with :mod:`ast`. Anything else, or Python that does not parse, falls
back to the changed line range. The content hash lets a file that returns to an earlier
version (A→B→A) be recognised.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["MAX_ANALYSED_BYTES", "Change", "analyse", "content_hash", "units_of"]

#: Files larger than this are hashed but not analysed for symbols.
MAX_ANALYSED_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Change:
    """What one mutation of a file changed.

    ``symbols`` are qualified names (``Class.method``) for Python; ``regions`` are
    ``(first, last)`` line ranges of the old content for other files.
    """

    symbols: frozenset[str]
    regions: tuple[tuple[int, int], ...]


def content_hash(data: bytes) -> str:
    """A short, stable hash of file content."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def analyse(path: str, old: bytes, new: bytes) -> Change:
    """Compare two versions of *path* and name what changed."""
    if path.endswith((".py", ".pyi")):
        old_units, new_units = _python_units(old), _python_units(new)
        if old_units is not None and new_units is not None:
            names = {n for n in old_units.keys() | new_units.keys() if old_units.get(n) != new_units.get(n)}
            return Change(frozenset(names), ())
    return Change(frozenset(), _changed_regions(old, new))


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Statement fields that hold nested statements: only statements can be definitions, so the
# walk never descends into expressions (most of a tree's nodes).
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


@functools.lru_cache(maxsize=16)
def _python_units(data: bytes) -> Mapping[str, tuple[str, ...]] | None:
    """Map each symbol to its own source lines (excluding nested symbols).

    Memoised by content: a write session's old content is the previous session's new one,
    so each version of a file is parsed once (parsing is most of a session's cost)."""
    try:
        text = data.decode("utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        # RecursionError and MemoryError are how the parser refuses nesting too deep for
        # it ("1+1+...+1", "-----1"): such a file falls back to line regions.
        return None
    lines = text.splitlines()
    owner: list[str] = ["<module>"] * len(lines)

    def visit(stmts: list[ast.stmt], prefix: str) -> None:
        for node in stmts:
            if isinstance(node, _DEFS):
                name = f"{prefix}{node.name}"
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                for i in range(first - 1, node.end_lineno or node.lineno):
                    owner[i] = name
                visit(node.body, name + ".")
                continue
            for field in _BLOCKS:
                block = getattr(node, field, None)
                if block:
                    for item in block:  # handlers and match cases wrap their statements
                        visit([item] if isinstance(item, ast.stmt) else item.body, prefix)

    visit(tree.body, "")
    units: dict[str, list[str]] = {}
    for line, name in zip(lines, owner, strict=True):
        if line.strip():
            units.setdefault(name, []).append(line.strip())
    return MappingProxyType({name: tuple(body) for name, body in units.items()})


def units_of(path: str, data: bytes) -> Change:
    """Every unit of *data*, as if it had all just been written (a file's creation)."""
    if path.endswith((".py", ".pyi")):
        units = _python_units(data)
        if units is not None:
            return Change(frozenset(units), ())
    n = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    return Change(frozenset(), ((1, max(n, 1)),))


def _changed_regions(old: bytes, new: bytes) -> tuple[tuple[int, int], ...]:
    a, b = old.splitlines(), new.splitlines()
    regions = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, _j1, _j2 in matcher.get_opcodes():
        if tag != "equal":
            regions.append((i1 + 1, max(i1 + 1, i2)))
    return tuple(regions)
