"""aider: the JSON lines of its analytics log, which guard has it write to its stdout.

aider has no machine-readable output of its own (what it prints rounds the tokens: "Tokens: 2.5k
sent, 59 received."). Its analytics log is JSON, one event a line, written whether or not
analytics go anywhere (``--no-analytics`` keeps them local); guard names ``/dev/stdout`` as the
log (``--analytics-log``), so the lines come in the stream the guard already reads. A
``message_send`` event carries one model call's usage, ``properties.prompt_tokens`` and
``properties.completion_tokens`` (checked against aider 0.86.2): the API's for a whole response,
aider's own count of a streamed one. That is all: the model calls no
tools (aider applies its edit blocks itself), and its edits, shell commands and commits are
judged by the mount.
"""

from __future__ import annotations

from typing import Any

from sandbox.agents.events import Event, JsonLinesParser, Step, count, obj

__all__ = ["AiderAnalyticsParser"]


class AiderAnalyticsParser(JsonLinesParser):
    """Feed lines; get a step per model call."""

    def __init__(self) -> None:
        super().__init__()
        self._calls = 0

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one object of the stream."""
        if doc.get("event") != "message_send":
            return []
        usage = obj(doc, "properties")
        self._calls += 1
        return [Step(f"message-{self._calls}", count(usage, "prompt_tokens"), count(usage, "completion_tokens"))]
