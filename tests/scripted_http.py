"""What the scripted model servers share (tests/model_server.py for Claude Code,
tests/openai_server.py for Codex, tests/gemini_server.py for Gemini, tests/chat_server.py for
aider): a script handed out
one turn per main-loop request, a quiet request handler, and a loopback server on a thread."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["QuietHandler", "Script", "serving"]


class _Turn(Protocol):
    @property
    def delay(self) -> float: ...


T = TypeVar("T", bound=_Turn)


def _offers_tools(body: dict[str, Any]) -> bool:
    return bool(body.get("tools"))


class Script(Generic[T]):
    """Scripted turns, the next one for each main-loop request (by default one that offers tools;
    *idle* once the script is spent), *aux* for any other (the CLI's own helper requests)."""

    def __init__(self, script: list[T], idle: T, aux: T,
                 main: Callable[[dict[str, Any]], bool] = _offers_tools) -> None:
        self.script = script
        self.idle, self.aux = idle, aux
        self.main = main
        self.requests: list[dict[str, Any]] = []  # main-loop request bodies
        self.lock = threading.Lock()

    def take(self, body: dict[str, Any]) -> tuple[int, T]:
        """(the main-loop request's number from 1, or 0 for another request; its turn), after
        the turn's delay, slept outside the lock so that other requests are answered meanwhile."""
        with self.lock:
            if self.main(body):
                self.requests.append(body)
                n = len(self.requests)
                turn = self.script[n - 1] if n <= len(self.script) else self.idle
            else:
                n, turn = 0, self.aux
        if turn.delay:
            time.sleep(turn.delay)
        return n, turn


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing, reads JSON bodies and sends whole bodies."""

    def log_message(self, *args: Any) -> None:
        pass

    def json_body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length", 0))
        body: dict[str, Any] = json.loads(self.rfile.read(length) or b"{}")
        return body

    def send(self, data: bytes, kind: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.send_response(404)
        self.end_headers()


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve *handler* on a loopback port from a thread; yields ``http://127.0.0.1:PORT``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
