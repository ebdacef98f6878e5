"""What parsers produce, and how it becomes protocol messages.

The agent writes its output stream, so parsers read it as they read the socket: each line
through :func:`~sandbox.agents.fasthook.loads_bounded`, and each field through
:func:`obj`, :func:`count` or :func:`number`, which raise :class:`StreamFieldError` for a
field of the wrong type; the line is then skipped (and counted), never a crash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sandbox.agents.fasthook import loads_bounded

__all__ = [
    "Event", "JsonLinesParser", "Step", "StreamFieldError", "Tool", "ToolDone", "Totals", "count", "json_object",
    "number", "obj", "to_messages",
]

log = logging.getLogger(__name__)


class StreamFieldError(ValueError):
    """A field of an agent's output stream with the wrong type; the text names it."""


def json_object(line: bytes | str) -> dict[str, Any] | None:
    """One line of an agent's JSON stream as an object, or None for anything else (a blank
    line, a log line, a cut-off write, JSON beyond the bounds): parsers skip those."""
    try:
        doc = loads_bounded(line)
    except ValueError:  # not JSON, not UTF-8, too deep or too large
        return None
    return doc if isinstance(doc, dict) else None


def obj(doc: dict[str, Any], key: str) -> dict[str, Any]:
    """*doc[key]* as an object ({} when absent or null)."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StreamFieldError(f"{key} is {type(value).__name__}, not an object")
    return value


def number(doc: dict[str, Any], key: str, default: int = 0) -> int:
    """*doc[key]* as an integer (*default* when absent or null); a float is truncated."""
    value = doc.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise StreamFieldError(f"{key} is {type(value).__name__}, not a number")
    return int(value)  # finite: loads_bounded admits no infinity


def count(doc: dict[str, Any], key: str, default: int = 0) -> int:
    """*doc[key]* as a token or turn count: a number, not negative."""
    value = number(doc, key, default)
    if value < 0:
        raise StreamFieldError(f"{key} is {value}, a negative count")
    return value


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
    #: The agent's end-of-run totals over all its calls (not one call): counted, not judged.
    totals: bool = False


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
            **({"totals": True} if event.totals else {}),
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
        self.skipped = 0  # JSON objects with a field of the wrong type

    def feed(self, line: bytes | str) -> list[Event]:
        """Events for one line of the stream."""
        self.lines += 1
        doc = json_object(line)
        if doc is None:
            return []
        try:
            return self.on_object(doc)
        except StreamFieldError as err:
            self.skipped += 1
            log.warning("%s: line %d skipped: %s", type(self).__name__, self.lines, err)
            return []

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one JSON object of the stream."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The stream ended: events held back until now."""
        return []

