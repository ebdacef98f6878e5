"""Gemini CLI: ``--output-format stream-json`` (headless mode).

Schema as documented for Gemini CLI's headless mode (0.11 and later): ``init``
{``session_id``, ``model``}, ``message`` {``role``, ``content``, ``delta``}, ``tool_use``
{``tool_name``, ``tool_id``, ``parameters``}, ``tool_result`` {``tool_id``, ``status``
success|error, ``output``}, ``error``, ``result`` {``status``, ``stats`` {``input_tokens``,
``output_tokens``, ``total_tokens``, ``cached``?, ``tool_calls``, ``duration_ms``}}. The
stream carries no usage per model call (checked against Gemini CLI 0.61.0): each tool call is a
step without tokens (so that repetition is seen), and the result's totals reach the breaker at
the end as totals (``Step.totals``): counted, not judged as one huge step, which would trip the
window and velocity rules after a clean run. (Per-call usage would need the AfterModel hook, which
Gemini runs for every streamed chunk with the whole request: too costly to run per chunk.)
"""

from __future__ import annotations

import json
from typing import Any

from sandbox.agents.events import Event, JsonLinesParser, Step, Tool, ToolDone, Totals, count, obj

__all__ = ["GeminiStreamParser"]


class GeminiStreamParser(JsonLinesParser):
    """Feed lines; get events."""

    def __init__(self) -> None:
        super().__init__()
        self._tools: dict[str, str] = {}

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one object of the stream."""
        kind = doc.get("type")
        if kind == "tool_use":
            tool = Tool(str(doc.get("tool_name", "")), doc.get("parameters"), str(doc.get("tool_id", "")))
            self._tools[tool.call_id] = tool.name
            return [Step(tool.call_id, 0, 0, 0, (tool,))]
        if kind == "tool_result":
            call_id = str(doc.get("tool_id", ""))
            ok = doc.get("status") == "success"
            output = doc.get("output")
            error = doc.get("error")
            if isinstance(error, dict) and error.get("message"):
                output = f"{output or ''}{error['message']}"
            if not isinstance(output, str):
                output = json.dumps(output or "")
            return [ToolDone(call_id, self._tools.get(call_id, "unknown"), 0 if ok else 1, output[:4000])]
        if kind == "result":
            return self._result(obj(doc, "stats"))
        return []

    def _result(self, stats: dict[str, Any]) -> list[Event]:
        total_in = count(stats, "input_tokens", count(stats, "input"))
        cached = min(count(stats, "cached"), total_in)  # included in the input count
        out = count(stats, "output_tokens")
        calls = count(stats, "tool_calls")
        return [Step("result", total_in - cached, out, cached, totals=True),
                Totals(total_in - cached, out, cached, calls)]
