"""The output parsers by format name, as ``guard feed --format`` and ``guard run`` use them
(from the agents' table, :mod:`sandbox.agents.registry`)."""

from __future__ import annotations

from sandbox.agents.events import JsonLinesParser
from sandbox.agents.registry import AGENTS

__all__ = ["FORMATS", "make_parser"]

FORMATS: dict[str, type[JsonLinesParser]] = {
    agent.stream_format: cls for agent in AGENTS.values()
    if agent.stream_format is not None and (cls := agent.parser_class()) is not None
}


def make_parser(fmt: str) -> JsonLinesParser:
    """A fresh parser for *fmt* (one of FORMATS)."""
    return FORMATS[fmt]()
