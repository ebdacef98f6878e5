"""A scripted stand-in for the OpenAI Chat Completions API (``POST /v1/chat/completions``), for
running aider offline: its model (``--model openai/<name>``) goes through litellm to
``OPENAI_API_BASE``, which points here.

aider offers the model no tools: it asks for text in its edit format (SEARCH/REPLACE blocks with
``--edit-format diff``) and applies the blocks itself. Each main-loop request (the user's
message, or aider's reflection of an edit that failed) gets the next scripted :class:`Reply`;
the commit message aider asks its weak model for gets :attr:`ChatModel.commit_message`.
Answered streamed (SSE chunks, usage last when asked for) or whole, as the request says.
Requests are kept, so tests can read what aider showed the model (an edit's error included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .scripted_http import QuietHandler, Script, serving

__all__ = ["ChatModel", "Reply", "scripted_chat", "search_replace"]


@dataclass
class Reply:
    """One model response: its text, and its usage."""

    text: str = "Done."
    prompt_tokens: int = 1500
    completion_tokens: int = 100
    #: Seconds the model "thinks" before the response starts (a quiet gap for the agent).
    delay: float = 0.0


def search_replace(path: str, old: str, new: str) -> str:
    """A SEARCH/REPLACE block of aider's diff edit format, changing *old* into *new* in *path*."""
    return f"{path}\n```python\n<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE\n```\n"


def _commit_request(body: dict[str, Any]) -> bool:
    """Whether *body* is aider's request for a commit message (its weak model's system prompt)."""
    messages = body.get("messages") or []
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    return "Git commit messages" in str(first.get("content", ""))


class ChatModel(Script[Reply]):
    """The scripted model and every main-loop request it was sent."""

    def __init__(self, script: list[Reply], commit_message: str = "fix: round the tax to cents") -> None:
        super().__init__(script, Reply(), Reply(commit_message, 300, 10), main=lambda b: not _commit_request(b))
        self.commits = 0  # commit-message requests answered
        self.other: list[tuple[str, dict[str, Any]]] = []  # anything else: (path, body)

    def respond(self, body: dict[str, Any]) -> tuple[bytes, str]:
        """The body answering one request, and its content type."""
        n, reply = self.take(body)
        if not n:
            with self.lock:
                self.commits += 1
        ident = f"chatcmpl-{'main' if n else 'aux'}-{n:04d}"
        model = str(body.get("model", ""))
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}
        if not body.get("stream"):
            whole = {"id": ident, "object": "chat.completion", "created": 0, "model": model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                                  "finish_reason": "stop"}], "usage": usage}
            return json.dumps(whole).encode(), "application/json"
        chunk = {"id": ident, "object": "chat.completion.chunk", "created": 0, "model": model}
        # Line by line, as a model streams: aider shows (and parses) the reply as it grows.
        pieces = reply.text.splitlines(keepends=True) or [""]
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]}]
        events += [{**chunk, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
                   for p in pieces]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": usage})
        data = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
        return data, "text/event-stream"

    def shown(self) -> list[str]:
        """The last user message of every main-loop request: what aider told the model each turn."""
        out = []
        for body in self.requests:
            users = [m for m in body.get("messages", []) if isinstance(m, dict) and m.get("role") == "user"]
            out.append(str(users[-1].get("content", "")) if users else "")
        return out


@contextmanager
def scripted_chat(script: list[Reply]) -> Iterator[tuple[str, ChatModel]]:
    """Serve *script* on loopback; yields (base URL ending in /v1, the model with its requests)."""
    model = ChatModel(script)

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.json_body()
            if self.path.rstrip("/").endswith("/chat/completions"):
                self.send(*model.respond(body))
                return
            with model.lock:
                model.other.append((self.path, body))
            self.send(b"{}", "application/json", 404)

        def do_GET(self) -> None:
            with model.lock:
                model.other.append((self.path, {}))
            self.send(json.dumps({"object": "list", "data": []}).encode(), "application/json")

    with serving(Handler) as url:
        yield f"{url}/v1", model
