"""The output parsers by format name, as ``guard feed --format`` and ``guard run`` use them."""

from __future__ import annotations

from sandbox.agents.claude import ClaudeStreamParser
from sandbox.agents.codex import CodexJsonParser
from sandbox.agents.events import JsonLinesParser
from sandbox.agents.gemini import GeminiStreamParser

__all__ = ["FORMATS", "make_parser"]

FORMATS: dict[str, type[JsonLinesParser]] = {
    "claude-stream-json": ClaudeStreamParser,
    "codex-json": CodexJsonParser,
    "gemini-stream-json": GeminiStreamParser,
}


def make_parser(fmt: str) -> JsonLinesParser:
    """A fresh parser for *fmt* (one of FORMATS)."""
    return FORMATS[fmt]()
