"""Oscillation signatures: which symbols (or line regions) a change touched, and a hash.

For Python sources the unit is the innermost enclosing ``def``/``class`` (``<module>`` for
top-level code), found with :mod:`ast`. Anything else, or Python that does not parse, falls
back to the changed line range. The content hash lets a file that returns to an earlier
version (A→B→A) be recognised.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from dataclasses import dataclass

__all__ = ["MAX_ANALYSED_BYTES", "Change", "analyse", "content_hash"]

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


def _python_units(data: bytes) -> dict[str, tuple[str, ...]] | None:
    """Map each symbol to its own source lines (excluding nested symbols)."""
    try:
        text = data.decode("utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    lines = text.splitlines()
    owner: list[str] = ["<module>"] * len(lines)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                last = child.end_lineno or child.lineno
                for i in range(first - 1, last):
                    owner[i] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    units: dict[str, list[str]] = {}
    for line, name in zip(lines, owner, strict=True):
        if line.strip():
            units.setdefault(name, []).append(line.strip())
    return {name: tuple(body) for name, body in units.items()}


def _changed_regions(old: bytes, new: bytes) -> tuple[tuple[int, int], ...]:
    a, b = old.splitlines(), new.splitlines()
    regions = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, _j1, _j2 in matcher.get_opcodes():
        if tag != "equal":
            regions.append((i1 + 1, max(i1 + 1, i2)))
    return tuple(regions)
