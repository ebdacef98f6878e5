"""Codex CLI: ``codex exec --json`` (thread/turn/item events).

Schema as documented for codex-cli's ``exec --json`` since 0.44: ``thread.started``,
``turn.started``, ``item.started|updated|completed`` (items ``agent_message``,
``reasoning``, ``command_execution`` with ``command``, ``exit_code``, ``status``;
``file_change`` with ``changes``; ``mcp_tool_call``; ``web_search``; ``todo_list``),
``turn.completed`` with ``usage`` {``input_tokens`` (cached included),
``cached_input_tokens``, ``output_tokens``}, ``turn.failed``, ``error``. A turn is one step.

Seen from the real CLI (0.169.0): ``codex exec`` prints one ``turn.completed`` per ``exec``, at
the very end, with the whole run's usage, so the stream's tokens reach the breaker once, when the
run is over (per-call usage needs a model proxy). Tool completions come as they happen, with
their exit codes (a failed ``file_change`` has ``status: failed``); a call a hook blocked has no
item at all. Under ``guard run`` the PreToolUse hook has already counted each call, before it ran:
the stream then leaves its calls out of the steps, so that no call is counted twice (a late
repeat of every call would otherwise trip ``repeated_action`` at the end of a clean run). The
stream says so itself: the flag guard passes, ``--dangerously-bypass-hook-trust``, is announced as
an ``error`` item before the first turn.
"""

from __future__ import annotations

import json
from typing import Any

from sandbox.agents.events import Event, JsonLinesParser, Step, Tool, ToolDone, Totals, count, number, obj

__all__ = ["CodexJsonParser"]

_TOOL_ITEMS = {"command_execution": "shell", "file_change": "apply_patch", "mcp_tool_call": "mcp",
               "web_search": "web_search"}

#: How ``codex exec --json`` announces that hooks run without persisted trust (guard's flag).
_HOOKS_NOTICE = "--dangerously-bypass-hook-trust"


class CodexJsonParser(JsonLinesParser):
    """Feed lines; get events."""

    def __init__(self) -> None:
        super().__init__()
        self._tools: list[Tool] = []
        self._turns = 0
        self._totals = [0, 0, 0]
        #: Whether the steps carry the tool calls: not when hooks report them (see above).
        self.calls = True

    def on_object(self, doc: dict[str, Any]) -> list[Event]:
        """Events for one object of the stream."""
        kind = doc.get("type")
        item = obj(doc, "item")
        if kind == "item.completed" and item.get("type") == "error" and _HOOKS_NOTICE in str(item.get("message")):
            self.calls = False
        elif kind == "item.started" and item.get("type") in _TOOL_ITEMS:
            self._tools.append(Tool(_TOOL_ITEMS[item["type"]], _args(item), str(item.get("id", ""))))
        elif kind == "item.completed" and item.get("type") in _TOOL_ITEMS:
            return [self._done(item)]
        elif kind == "turn.completed":
            return [self._turn(obj(doc, "usage"))]
        elif kind == "turn.failed":
            return [self._turn({})]
        return []

    def finish(self) -> list[Event]:
        """End of the stream: the totals."""
        return [Totals(self._totals[0], self._totals[1], self._totals[2], self._turns)]

    def _done(self, item: dict[str, Any]) -> ToolDone:
        name = _TOOL_ITEMS[item["type"]]
        if not any(t.call_id == str(item.get("id", "")) for t in self._tools):
            self._tools.append(Tool(name, _args(item), str(item.get("id", ""))))
        failed = 0 if item.get("status") in ("completed", None) else 1
        code = number(item, "exit_code", failed)
        summary = str(item.get("command") or json.dumps(item.get("changes", ""))[:400])[:4000]
        return ToolDone(str(item.get("id", "")), name, max(-255, min(255, code)), summary)

    def _turn(self, usage: dict[str, Any]) -> Step:
        total_in = count(usage, "input_tokens")
        cached = min(count(usage, "cached_input_tokens"), total_in)  # included in input_tokens
        out = count(usage, "output_tokens")
        self._turns += 1
        self._totals[0] += total_in - cached
        self._totals[1] += out
        self._totals[2] += cached
        tools, self._tools = tuple(self._tools) if self.calls else (), []
        return Step(f"turn-{self._turns}", total_in - cached, out, cached, tools)


def _args(item: dict[str, Any]) -> Any:
    if item.get("type") == "command_execution":
        return {"command": item.get("command")}
    if item.get("type") == "file_change":
        return {"changes": item.get("changes")}
    return {k: v for k, v in item.items() if k not in ("id", "type", "status", "aggregated_output")}
