"""A scripted stand-in for the Gemini API (``generateContent`` / ``streamGenerateContent``), for
running the real Gemini CLI offline (it is pointed here with ``GOOGLE_GEMINI_BASE_URL``).

Each main-loop request (one that offers tools) gets the next scripted turn: a function call or a
final text, with its ``usageMetadata``. Other requests (the CLI's own helpers: next-speaker and
routing classifiers, titles) get a small JSON text that ends the turn. Requests are kept, so tests
can read what the model was shown (the tools' responses included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .scripted_http import QuietHandler, Script, serving

__all__ = ["GeminiModel", "Turn", "scripted_gemini"]


@dataclass
class Turn:
    """One model turn: a function call (name and args) or a final text, and its usage."""

    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    text: str = "Done."
    input_tokens: int = 1500
    output_tokens: int = 100
    #: Seconds the model "thinks" before answering.
    delay: float = 0.0


def _response(turn: Turn) -> dict[str, Any]:
    part: dict[str, Any] = ({"functionCall": {"name": turn.tool, "args": turn.args}} if turn.tool is not None
                            else {"text": turn.text})
    return {
        "candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": turn.input_tokens, "candidatesTokenCount": turn.output_tokens,
                          "totalTokenCount": turn.input_tokens + turn.output_tokens},
        "modelVersion": "gemini-2.5-pro",
    }


#: The answer to the CLI's helper requests: JSON its classifiers accept, a model that speaks no further.
_AUX = Turn(text=json.dumps({"reasoning": "scripted", "next_speaker": "user", "model_choice": "pro"}),
            input_tokens=10, output_tokens=2)


class GeminiModel(Script[Turn]):
    """The scripted model and the requests it was sent."""

    def __init__(self, script: list[Turn]) -> None:
        super().__init__(script, Turn(), _AUX)
        self.other: list[str] = []  # paths of the other requests

    def respond(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The response document for one request to *path*."""
        n, turn = self.take(body)
        if n == 0:
            with self.lock:
                self.other.append(path)
        return _response(turn)

    def function_responses(self) -> list[dict[str, Any]]:
        """Every functionResponse the model was sent, in order (each once, from the last request)."""
        if not self.requests:
            return []
        return [part["functionResponse"] for content in self.requests[-1].get("contents", [])
                for part in content.get("parts", []) if isinstance(part, dict) and "functionResponse" in part]


@contextmanager
def scripted_gemini(script: list[Turn]) -> Iterator[tuple[str, GeminiModel]]:
    """Serve *script* on loopback; yields (base URL, the model with its requests)."""
    model = GeminiModel(script)

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            body = self.json_body()
            if ":countTokens" in self.path:
                self.send(json.dumps({"totalTokens": 100}).encode(), "application/json")
            elif ":streamGenerateContent" in self.path:
                doc = model.respond(self.path, body)
                self.send(f"data: {json.dumps(doc)}\r\n\r\n".encode(), "text/event-stream")
            elif ":generateContent" in self.path:
                self.send(json.dumps(model.respond(self.path, body)).encode(), "application/json")
            else:
                self.send_response(404)
                self.end_headers()

    with serving(Handler) as url:
        yield url, model
