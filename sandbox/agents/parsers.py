"""The output parsers by format name, as ``guard feed --format`` and ``guard run`` use them."""

from __future__ import annotations

from typing import Protocol

from sandbox.agents.claude import ClaudeStreamParser
from sandbox.agents.codex import CodexJsonParser
from sandbox.agents.events import Event
from sandbox.agents.gemini import GeminiStreamParser

__all__ = ["FORMATS", "Parser", "make_parser"]


class Parser(Protocol):
    """Turns an agent's output lines into events."""

    lines: int

    def feed(self, line: bytes | str) -> list[Event]:
        """Events for one line."""
        ...

    def finish(self) -> list[Event]:
        """Events held back until the end of the stream."""
        ...


FORMATS: dict[str, type[ClaudeStreamParser] | type[CodexJsonParser] | type[GeminiStreamParser]] = {
    "claude-stream-json": ClaudeStreamParser,
    "codex-json": CodexJsonParser,
    "gemini-stream-json": GeminiStreamParser,
}


def make_parser(fmt: str) -> Parser:
    """A fresh parser for *fmt* (one of FORMATS)."""
    parser: Parser = FORMATS[fmt]()
    return parser
