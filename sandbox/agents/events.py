"""What parsers produce, and how it becomes protocol messages."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "JsonLinesParser", "Step", "Tool", "ToolDone", "Totals", "json_object", "to_messages"]


def json_object(line: bytes | str) -> dict[str, Any] | None:
    """One line of an agent's JSON stream as an object, or None for anything else (a blank
    line, a log line, a cut-off write): parsers skip those."""
    try:
        doc = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class Tool:
    """A tool call the model made."""

    name: str
    args: Any
    call_id: str = ""


@dataclass(frozen=True)
class Step:
    """One model call: its tokens and the tool calls it made."""

    call_id: str
    tokens_in: int
    tokens_out: int
    tokens_cached: int = 0
    tools: tuple[Tool, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class ToolDone:
    """A tool call finished; *blocked* when a hook refused it before it ran."""

    call_id: str
    name: str
    exit_code: int
    summary: str = ""
    blocked: bool = False


@dataclass(frozen=True)
class Totals:
    """The agent's own totals at the end of a run."""

    tokens_in: int
    tokens_out: int
    tokens_cached: int
    turns: int = 0


Event = Step | ToolDone | Totals


def to_messages(event: Event) -> list[dict[str, Any]]:
    """The agent-socket messages for one event (Totals are informational: none)."""
    if isinstance(event, Step):
        first = event.tools[0] if event.tools else None
        out: list[dict[str, Any]] = [{
            "type": "step", "tokens_in": event.tokens_in, "tokens_out": event.tokens_out,
            "tokens_cached": event.tokens_cached,
            "tool": first.name if first else None, "args": first.args if first else None,
        }]
        # Further tool calls of the same model call: steps without tokens, so that
        # repetition is still seen.
        out += [{"type": "step", "tool": t.name, "args": t.args} for t in event.tools[1:]]
        return out
    if isinstance(event, ToolDone):
        return [{"type": "tool_result", "tool": event.name, "exit_code": event.exit_code,
                 "summary": event.summary[:4000]}]
    return []


class JsonLinesParser:
    """Base of the agents' stream parsers: counts lines, skips what is not a JSON object,
    and hands each object to :meth:`on_object`."""

    def __init__(self) -> None:
        self.lines = 0

    def feed(self, line: bytes | str) -> list[Event]:
        """Events for one line of the stream."""
        self.lines += 1
        doc = json_object(line)
        return [] if doc is None else self.on_object(doc)

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one JSON object of the stream."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The stream ended: events held back until now."""
        return []

