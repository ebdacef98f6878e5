"""A scripted stand-in for the Gemini API (``generateContent`` / ``streamGenerateContent``), for
running the real Gemini CLI offline (it is pointed here with ``GOOGLE_GEMINI_BASE_URL``).

Each main-loop request (one that offers tools) gets the next scripted turn: a function call or a
final text, with its ``usageMetadata``. Other requests (the CLI's own helpers: next-speaker and
routing classifiers, titles) get a small JSON text that ends the turn. Requests are kept, so tests
can read what the model was shown (the tools' responses included)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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


class GeminiModel:
    """The scripted model and the requests it was sent."""

    def __init__(self, script: list[Turn]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []  # main-loop request bodies
        self.other: list[str] = []  # paths of the other requests
        self.lock = threading.Lock()

    def respond(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The response document for one request to *path*."""
        with self.lock:
            if body.get("tools"):
                self.requests.append(body)
                n = len(self.requests)
                turn = self.script[n - 1] if n <= len(self.script) else Turn()
            else:
                self.other.append(path)
                turn = _AUX
        if turn.delay:
            time.sleep(turn.delay)  # outside the lock: helper requests are answered meanwhile
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

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, data: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            if ":countTokens" in self.path:
                self._send(json.dumps({"totalTokens": 100}).encode(), "application/json")
            elif ":streamGenerateContent" in self.path:
                doc = model.respond(self.path, body)
                self._send(f"data: {json.dumps(doc)}\r\n\r\n".encode(), "text/event-stream")
            elif ":generateContent" in self.path:
                self._send(json.dumps(model.respond(self.path, body)).encode(), "application/json")
            else:
                self.send_response(404)
                self.end_headers()

        def do_GET(self) -> None:
            self.send_response(404)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", model
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
