"""A scripted stand-in for the OpenAI Responses API (``POST /v1/responses``, streamed as SSE),
for running the real Codex CLI offline through a model provider whose ``base_url`` points here.

Each request that offers tools (the agent's main loop) gets the next scripted :class:`Call`:
a function call (``shell_command`` and the like: JSON arguments), a custom tool call
(``apply_patch``: the patch as free text), or a final message; then ``response.completed``
with its usage. Requests are kept, so tests can read what the model was shown (each tool
call's output, the hook's refusal included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .scripted_http import QuietHandler, Script, serving

__all__ = ["Call", "ResponsesModel", "scripted_responses"]


@dataclass
class Call:
    """One model response: a tool call or a final text, and its usage."""

    tool: str | None = None
    #: A function tool's arguments (an object), or a custom tool's input (a string).
    arguments: dict[str, Any] | str = field(default_factory=dict)
    text: str = "Done."
    input_tokens: int = 1500
    cached_tokens: int = 0
    output_tokens: int = 100
    #: Seconds the model "thinks" before the response starts (a quiet gap for the agent).
    delay: float = 0.0


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _item(resp_id: str, call: Call) -> dict[str, Any]:
    if call.tool is None:
        return {"type": "message", "role": "assistant", "id": f"msg_{resp_id}",
                "content": [{"type": "output_text", "text": call.text, "annotations": []}]}
    if isinstance(call.arguments, str):
        return {"type": "custom_tool_call", "id": f"ctc_{resp_id}", "call_id": f"call_{resp_id}",
                "name": call.tool, "input": call.arguments, "status": "completed"}
    return {"type": "function_call", "id": f"fc_{resp_id}", "call_id": f"call_{resp_id}", "name": call.tool,
            "arguments": json.dumps(call.arguments), "status": "completed"}


def _stream(resp_id: str, model: str, call: Call) -> bytes:
    usage = {"input_tokens": call.input_tokens, "input_tokens_details": {"cached_tokens": call.cached_tokens},
             "output_tokens": call.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": call.input_tokens + call.output_tokens}
    response = {"id": resp_id, "object": "response", "model": model, "status": "in_progress", "output": []}
    item = _item(resp_id, call)
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed",
         "response": {**response, "status": "completed", "output": [item], "usage": usage}},
    ]
    return _sse(events)


class ResponsesModel(Script[Call]):
    """The scripted model and every main-loop request it was sent."""

    def __init__(self, script: list[Call]) -> None:
        super().__init__(script, Call(), Call(text="ok", input_tokens=10, output_tokens=2))
        self.other: list[tuple[str, dict[str, Any]]] = []  # anything else: (path, body)

    def respond(self, body: dict[str, Any]) -> bytes:
        """The SSE body answering one request."""
        n, call = self.take(body)
        return _stream(f"resp_{'main' if n else 'aux'}_{n:04d}", str(body.get("model", "")), call)

    def tool_outputs(self) -> list[str]:
        """The output of every tool call the model was sent, in order (each call once)."""
        seen: dict[str, str] = {}
        for body in self.requests:
            for item in body.get("input", []):
                if isinstance(item, dict) and item.get("type") in ("function_call_output", "custom_tool_call_output"):
                    output = item.get("output")
                    seen.setdefault(str(item.get("call_id")), output if isinstance(output, str) else json.dumps(output))
        return list(seen.values())

    def tool_names(self) -> set[str]:
        """The names of the tools the first main-loop request offered."""
        tools = self.requests[0].get("tools", []) if self.requests else []
        return {str(t.get("name")) for t in tools if isinstance(t, dict)}


@contextmanager
def scripted_responses(script: list[Call]) -> Iterator[tuple[str, ResponsesModel]]:
    """Serve *script* on loopback; yields (base URL ending in /v1, the model with its requests)."""
    model = ResponsesModel(script)

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.json_body()
            if self.path.rstrip("/").endswith("/responses"):
                self.send(model.respond(body), "text/event-stream")
                return
            with model.lock:
                model.other.append((self.path, body))
            self.send(b"{}", "application/json")

        def do_GET(self) -> None:
            with model.lock:
                model.other.append((self.path, {}))
            # No model list: the CLI keeps its own.
            self.send(json.dumps({"data": [], "models": []}).encode(), "application/json")

    with serving(Handler) as url:
        yield f"{url}/v1", model
