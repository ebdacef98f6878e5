"""Clients of the guard's sockets, for harnesses written in Python and for the CLI.

The agent socket's path is in ``GUARD_SOCKET`` inside a guarded run; the control socket is
``control.sock`` in the run directory. Every call sends one JSON line and returns the reply
as a dict; a reply with ``"ok": false`` (a request the guard could not accept) raises
:class:`GuardClientError` naming the problem. A denial is *not* an error: it is a reply with
``"allow": false`` and the breaker's feedback.

    with GuardClient() as guard:
        guard.hello("my-harness")
        reply = guard.step(tokens_in=1200, tokens_out=300, tool="Write", args={"path": "a.py"})
        if not reply["allow"]:
            print(reply["feedback"])
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

# The hook shares these (it must stay standard library only): one definition of each.
from sandbox.agents.fasthook import VERSION, GuardClientError, GuardUnreachable, connect_unix

if TYPE_CHECKING:  # trio is imported by the async client only: a hook starts faster without it
    import trio

__all__ = [
    "AsyncGuardClient", "GuardClient", "GuardClientError", "GuardUnreachable", "agent_socket_path",
    "control_socket_path",
]


def agent_socket_path(path: str | os.PathLike[str] | None = None) -> str:
    """*path*, or ``GUARD_SOCKET``; raise GuardClientError when neither is set."""
    found = path or os.environ.get("GUARD_SOCKET")
    if not found:
        raise GuardUnreachable("no guard socket: set GUARD_SOCKET or pass the socket's path")
    return os.fspath(found)


def control_socket_path(run_dir: str | os.PathLike[str]) -> str:
    """The control socket of a run directory."""
    return str(Path(run_dir) / "control.sock")


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **message}, separators=(",", ":")).encode() + b"\n"


def _decode(line: bytes) -> dict[str, Any]:
    if not line:
        raise GuardUnreachable("the guard closed the connection without replying")
    reply: dict[str, Any] = json.loads(line)
    if not reply.get("ok", False):
        raise GuardClientError(reply.get("error", f"request refused: {reply}"))
    return reply


class _Messages:
    """The protocol's messages, built on one ``request`` primitive."""

    def _send(self, message: dict[str, Any]) -> Any:
        raise NotImplementedError

    def hello(self, agent: str = "python-client") -> Any:
        """Introduce the agent."""
        return self._send({"type": "hello", "agent": agent})

    def step(self, tokens_in: int = 0, tokens_out: int = 0, tokens_cached: int = 0,
             tool: str | None = None, args: Any = None) -> Any:
        """Report one model call."""
        return self._send({"type": "step", "tokens_in": tokens_in, "tokens_out": tokens_out,
                           "tokens_cached": tokens_cached, "tool": tool, "args": args})

    def tool_result(self, tool: str, exit_code: int, summary: str = "") -> Any:
        """Report a finished tool call."""
        return self._send({"type": "tool_result", "tool": tool, "exit_code": exit_code, "summary": summary})

    def check(self, tool: str, paths: list[str], args: Any = None, mutating: bool = True) -> Any:
        """Ask whether a tool call may run."""
        return self._send({"type": "check", "tool": tool, "paths": paths, "args": args, "mutating": mutating})

    def note(self, text: str, kind: str = "note") -> Any:
        """Leave a note in the ledger (kind: note, disproved, subtask)."""
        return self._send({"type": "note", "kind": kind, "text": text})

    def status(self) -> Any:
        """The breaker's state and the ledger."""
        return self._send({"type": "status"})


class GuardClient(_Messages):
    """A blocking client of one guard socket (the agent socket unless *path* says otherwise)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> None:
        self.path = agent_socket_path(path)
        try:
            self._sock = connect_unix(self.path, timeout)
        except OSError as err:
            raise GuardUnreachable(f"cannot reach the guard at {self.path}: {err.strerror or err}") from err
        self._file = self._sock.makefile("rb")

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message (a dict with a 'type'); return the reply."""
        try:
            self._sock.sendall(_encode(message))
            line = self._file.readline()
        except OSError as err:
            raise GuardUnreachable(f"lost the guard at {self.path}: {err}") from err
        return _decode(line)

    def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.request(message)

    def approve(self, raise_to: int | None = None) -> dict[str, Any]:
        """Control socket: resume after a trip."""
        return self.request({"type": "approve", "raise_to": raise_to})

    def stop(self) -> dict[str, Any]:
        """Control socket: stop the run."""
        return self.request({"type": "stop"})

    def checkpoint(self, label: str = "") -> dict[str, Any]:
        """Control socket: mark a checkpoint."""
        return self.request({"type": "checkpoint", "label": label})

    def close(self) -> None:
        """Close the connection."""
        self._file.close()
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncGuardClient(_Messages):
    """The same on trio: ``async with await AsyncGuardClient.connect() as guard: ...``."""

    def __init__(self, stream: trio.SocketStream, path: str) -> None:
        self.path = path
        self._stream = stream
        self._buf = b""

    @classmethod
    async def connect(cls, path: str | os.PathLike[str] | None = None) -> AsyncGuardClient:
        """Connect to *path* or ``GUARD_SOCKET``."""
        import trio

        where = agent_socket_path(path)
        try:
            stream = await trio.open_unix_socket(where)
        except OSError as err:
            raise GuardUnreachable(f"cannot reach the guard at {where}: {err.strerror or err}") from err
        return cls(stream, where)

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message; return the reply."""
        import trio

        try:
            await self._stream.send_all(_encode(message))
            while b"\n" not in self._buf:
                data = await self._stream.receive_some(65536)
                if not data:
                    break
                self._buf += data
        except (trio.BrokenResourceError, trio.ClosedResourceError) as err:
            raise GuardUnreachable(f"lost the guard at {self.path}: {err}") from err
        line, _, self._buf = self._buf.partition(b"\n")
        return _decode(line)

    async def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        return await self.request(message)

    async def aclose(self) -> None:
        """Close the connection."""
        await self._stream.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
