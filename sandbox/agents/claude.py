"""Claude Code: ``--output-format stream-json`` (with or without partial messages).

Every content block of one API message arrives as its own ``assistant`` line repeating the
same ``message.id`` and usage: a model call is counted once, when its message is complete.
In ``assistant`` lines ``output_tokens`` is only the start value; with
``--include-partial-messages`` the ``message_delta`` stream event carries the real count.
Without it, the real output tokens are only known from the final ``result`` line, and the
difference is reported then. Tool results are matched to their calls by ``tool_use_id``; a
result that is a PreToolUse hook's refusal is marked ``blocked``.
"""

from __future__ import annotations

from typing import Any

from sandbox.agents.events import Event, JsonLinesParser, Step, Tool, ToolDone, Totals, count, obj

__all__ = ["ClaudeStreamParser"]


class ClaudeStreamParser(JsonLinesParser):
    """Feed lines; get events. Tolerates blank and non-JSON lines (they are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self._current: dict[str, Any] | None = None  # the message being assembled
        self._tools: dict[str, str] = {}  # tool_use_id -> tool name
        self._counted_out = 0  # output tokens reported per call so far

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one object of the stream."""
        kind = doc.get("type")
        if kind == "assistant":
            return self._assistant(obj(doc, "message"))
        if kind == "stream_event":
            return self._stream_event(obj(doc, "event"))
        out = self._close()
        if kind == "user":
            out += self._tool_results(obj(doc, "message"))
        elif kind == "result":
            out += self._result(doc)
        return out

    def finish(self) -> list[Event]:
        """The stream ended: flush a message still open."""
        return self._close()

    def _assistant(self, message: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        msg_id = str(message.get("id", ""))[:200]
        usage = obj(message, "usage")
        content = message.get("content") or []
        if not isinstance(content, list):
            content = []  # text-only content may come as a string: no tool calls in it
        if self._current is not None and self._current["id"] != msg_id:
            out = self._close()
        if self._current is None:
            self._current = {
                "id": msg_id,
                "in": count(usage, "input_tokens"),
                "out": count(usage, "output_tokens"),
                "cached": count(usage, "cache_read_input_tokens") + count(usage, "cache_creation_input_tokens"),
                "tools": [],
            }
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                tool = Tool(str(block.get("name", ""))[:200], block.get("input"), str(block.get("id", ""))[:200])
                self._current["tools"].append(tool)
                self._tools[tool.call_id] = tool.name
        return out

    def _stream_event(self, event: dict[str, Any]) -> list[Event]:
        if event.get("type") == "message_delta" and self._current is not None:
            self._current["out"] = count(obj(event, "usage"), "output_tokens", self._current["out"])
            return self._close()
        return []

    def _close(self) -> list[Event]:
        cur = self._current
        if cur is None:
            return []
        self._current = None
        self._counted_out += cur["out"]
        return [Step(cur["id"], cur["in"], cur["out"], cur["cached"], tuple(cur["tools"]))]

    def _tool_results(self, message: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        content = message.get("content")
        if not isinstance(content, list):
            return out
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "tool_result":
                continue
            call_id = str(block.get("tool_use_id", ""))[:200]
            text = _text(block.get("content"))
            error = bool(block.get("is_error"))
            out.append(ToolDone(call_id, self._tools.get(call_id, "unknown"), 1 if error else 0, text[:4000],
                                blocked=error and "hook error" in text[:200]))
        return out

    def _result(self, doc: dict[str, Any]) -> list[Event]:
        usage = obj(doc, "usage")
        total_in = count(usage, "input_tokens")
        total_out = count(usage, "output_tokens")
        total_cached = count(usage, "cache_read_input_tokens") + count(usage, "cache_creation_input_tokens")
        turns = count(doc, "num_turns")
        out: list[Event] = []
        missing_out = total_out - self._counted_out
        if missing_out > 0:  # output tokens the plain stream never showed per call
            out.append(Step("result", 0, missing_out))
            self._counted_out = total_out
        out.append(Totals(total_in, total_out, total_cached, turns))
        return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return ""
