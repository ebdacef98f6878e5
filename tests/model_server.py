"""A scripted stand-in for the Anthropic Messages API, for running the real Claude Code CLI
offline: each main-loop request (one that offers tools) gets the next scripted turn, as a
stream of message_start / content_block_* / message_delta / message_stop events. Requests
are kept, so tests can read what the model was shown (tool errors included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .scripted_http import QuietHandler, Script, serving

__all__ = ["Turn", "scripted_model"]


@dataclass
class Turn:
    """One assistant turn: a tool call (name and input) or a final text, and its usage."""

    tool: str | None = None
    tool_input: dict[str, Any] = field(default_factory=dict)
    text: str = "Done."
    input_tokens: int = 1500
    output_tokens: int = 100
    #: Seconds the model "thinks" before the response starts (a quiet gap for the agent).
    delay: float = 0.0


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _stream(msg_id: str, model: str, turn: Turn) -> bytes:
    usage = {"input_tokens": turn.input_tokens, "output_tokens": 1, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0}
    message: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}]
    if turn.tool is None:
        events += [
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": turn.text}},
            {"type": "content_block_stop", "index": 0},
        ]
        stop = "end_turn"
    else:
        events += [
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "tool_use", "id": f"toolu_{msg_id}", "name": turn.tool, "input": {}}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": json.dumps(turn.tool_input)}},
            {"type": "content_block_stop", "index": 0},
        ]
        stop = "tool_use"
    events += [
        {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
         "usage": {"output_tokens": turn.output_tokens}},
        {"type": "message_stop"},
    ]
    return _sse(events)


class _Model(Script[Turn]):
    def __init__(self, script: list[Turn]) -> None:
        super().__init__(script, Turn(), Turn(text="ok", input_tokens=10, output_tokens=2))

    def respond(self, body: dict[str, Any]) -> bytes:
        n, turn = self.take(body)
        return _stream(f"msg_{'main' if n else 'aux'}_{n:04d}", str(body.get("model", "")), turn)

    def tool_errors(self) -> list[str]:
        """The text of every tool result marked as an error that the model was sent."""
        out = []
        for body in self.requests:
            for message in body.get("messages", []):
                content = message.get("content")
                if not isinstance(content, list):
                    continue
                for block in content:
                    if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("is_error"):
                        text = block.get("content")
                        out.append(text if isinstance(text, str) else json.dumps(text))
        return out


@contextmanager
def scripted_model(script: list[Turn]) -> Iterator[tuple[str, _Model]]:
    """Serve *script* on loopback; yields (base URL, the model with its requests)."""
    model = _Model(script)

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = self.json_body()
            if "count_tokens" in self.path:
                self.send(json.dumps({"input_tokens": 100}).encode(), "application/json")
            else:
                self.send(model.respond(body), "text/event-stream")

    with serving(Handler) as url:
        yield url, model
