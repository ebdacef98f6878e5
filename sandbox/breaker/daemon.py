"""The breaker daemon: two Unix sockets, the ledger writer and the idle ticker, on trio.

It runs in the same trio loop as the FUSE server, so the breaker is only ever touched
from one thread and needs no lock. Each connection is its own task: a malformed line, an
oversized line, a silent or slow client affects that connection alone.

What a client can make the guard hold is bounded: at most :data:`MAX_CONNECTIONS` open
connections per socket (one more closes the longest-idle one, so silent clients cannot
lock the others out), :data:`~sandbox.breaker.protocol.MAX_LINE` bytes of unfinished line per
connection and :data:`MAX_BUFFERED` across a socket's connections. The accept loop is
trio's :func:`trio.serve_listeners`; the listener it serves books each connection as it
accepts it and rides out descriptor and memory exhaustion (EMFILE, ENFILE, ENOBUFS,
ENOMEM) by pausing.

The daemon decides nothing itself: the breaker answers, and the effects its replies carry
(checkpoint, rollback, freeze, halt, resume) go to *on_effects*, the run's Session.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import trio

from guardfs.errors import GuardError, UsageError
from guardfs.events import EventLog, json_safe
from sandbox.agents.fasthook import GuardClientError, HookPayloadError, decide, refuse_malformed
from sandbox.breaker import Breaker, Effect, Effects, Reply
from sandbox.breaker.ledger import write_ledger
from sandbox.breaker.protocol import (
    MAX_LINE,
    VERSION,
    Approve,
    Check,
    Checkpoint,
    Hello,
    Hook,
    Note,
    ProtocolError,
    Rollback,
    Status,
    Step,
    Stop,
    ToolResult,
    error_reply,
    parse_agent,
    parse_control,
)

__all__ = ["AGENT_SOCKET", "CONTROL_SOCKET", "MAX_BUFFERED", "MAX_CONNECTIONS", "SOCKET_PATH_MAX", "Daemon",
           "RunDirBusy", "check_socket_room"]

log = logging.getLogger(__name__)

AGENT_SOCKET = "agent.sock"
CONTROL_SOCKET = "control.sock"
#: A connection that sends nothing for this long is closed (it holds nothing up meanwhile).
IDLE_CONNECTION_S = 600.0
#: A client that does not take its reply within this long is dropped.
SEND_TIMEOUT_S = 10.0
#: Open connections per socket; one more closes the longest-idle one. Hooks connect once per
#: tool call and leave, so a real agent holds a few at a time, parallel tool calls included.
MAX_CONNECTIONS = 64
#: Bytes of unfinished lines held across one socket's connections; beyond it the connection
#: that needs more is answered with an error and closed.
MAX_BUFFERED = 32 << 20
# Accept errors that say "not now" (out of descriptors or buffers): the ones
# trio.serve_listeners pauses on. (trio's SocketListener already retries the ones that
# concern only a client that gave up: ECONNABORTED, EPERM, EPROTO.)
_ACCEPT_PAUSE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_PAUSE_S = 0.1
LEDGER_INTERVAL_S = 0.05
#: The ledger writer rests this many times as long as its last write took.
LEDGER_COST_FACTOR = 4.0
TICK_INTERVAL_S = 1.0


class RunDirBusy(UsageError):
    """Another guard is serving this run directory."""


#: The longest path a unix socket can be bound at (sun_path holds 108 bytes with its NUL).
SOCKET_PATH_MAX = 107


def check_socket_room(run_dir: Path) -> None:
    """Raise a UsageError, before anything starts, when *run_dir* is too deep for the sockets
    the daemon binds in it (the kernel would refuse the bind with "AF_UNIX path too long")."""
    longest = max((run_dir / AGENT_SOCKET, run_dir / CONTROL_SOCKET), key=lambda p: len(os.fsencode(p)))
    if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
        raise UsageError(
            f"the run directory {run_dir} is too deep for its sockets: {longest} has "
            f"{len(os.fsencode(longest))} bytes, a unix socket's path at most {SOCKET_PATH_MAX}; give a "
            "shorter --run-dir (or a shorter XDG_STATE_HOME, where the default run directories are made)")


class _Conn:
    """One connection's bookkeeping: when it last did something, and how to end it."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()  # entered by the connection's task
        self.last_active = trio.current_time()


class _Socket:
    """One listening socket's connections and counters (reported by ``status``)."""

    def __init__(self) -> None:
        self.conns: dict[int, _Conn] = {}
        self.buffered = 0
        self.accepted = 0
        self.evicted = 0
        self.over_budget = 0
        self.accept_errors = 0

    def counters(self) -> dict[str, int]:
        return {"open": len(self.conns), "accepted": self.accepted, "evicted": self.evicted,
                "over_budget": self.over_budget, "accept_errors": self.accept_errors}


class _Listener(trio.abc.Listener[trio.SocketStream]):
    """A listening socket that books each connection as it accepts it, so a burst of
    accepts cannot overshoot :data:`MAX_CONNECTIONS` (a handler task starts later), and
    that waits out capacity errors itself: one warning for a spell of them, not trio's
    traceback every 100 ms."""

    def __init__(self, sock: trio.socket.SocketType, kind: str, book: _Socket,
                 evict: Callable[[_Socket, str], None]) -> None:
        self.socket = sock
        self._inner = trio.SocketListener(sock)  # retries what concerns only one client
        self.kind, self.book, self.evict = kind, book, evict

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def accept(self) -> trio.SocketStream:
        pauses = 0
        while True:
            try:
                stream = await self._inner.accept()
            except OSError as err:
                self.book.accept_errors += 1
                if err.errno not in _ACCEPT_PAUSE:
                    raise
                # Pending clients wait in the backlog; connections being served end and
                # free their descriptors meanwhile.
                if pauses == 0:
                    log.warning("%s socket: cannot accept (%s); pausing until it can", self.kind,
                                os.strerror(err.errno or 0))
                pauses += 1
                await trio.sleep(ACCEPT_PAUSE_S)
                continue
            if pauses:
                log.warning("%s socket: accepting again after %d pauses", self.kind, pauses)
            self.book.accepted += 1
            if len(self.book.conns) >= MAX_CONNECTIONS:
                self.evict(self.book, self.kind)
            self.book.conns[id(stream)] = _Conn()
            return stream


def _reply(reply: Reply) -> dict[str, Any]:
    out: dict[str, Any] = {"v": VERSION, "ok": True, "allow": reply.allow, "state": reply.state.value}
    if reply.feedback:
        out["feedback"] = reply.feedback
    if reply.warning:
        out["warning"] = reply.warning
    if reply.trip is not None:
        trip = asdict(reply.trip)
        out["trip"] = {k: (v.value if hasattr(v, "value") else v) for k, v in trip.items()}
    return out


class Daemon:
    """Serves *breaker* on ``agent.sock`` and ``control.sock`` in *run_dir*.

    Built by :class:`~sandbox.session.Session`. *workspace* is where the agent sees the
    workspace (hook paths are relative to it); *on_effects* carries out what the breaker's
    replies require; *on_rollback* is the operator's ``rollback`` to a restore point
    (``start``, ``last`` or a label; None: this guard keeps no pre-images); *on_stop*
    runs after the reply to ``stop`` went out.
    """

    def __init__(
        self,
        breaker: Breaker,
        run_dir: Path,
        workspace: str,
        events: EventLog,
        *,
        on_effects: Callable[[Effects], None] | None = None,
        on_rollback: Callable[[str], int] | None = None,
        on_stop: Callable[[], None] | None = None,
        agent_path: Path | None = None,
    ) -> None:
        self.breaker = breaker
        self.run_dir = run_dir
        self.workspace = os.path.abspath(workspace)
        self.events = events
        self.on_effects = on_effects or (lambda effects: None)
        self.on_stop = on_stop or (lambda: None)
        self.on_rollback = on_rollback
        self.agent_path = agent_path or run_dir / AGENT_SOCKET
        self.control_path = run_dir / CONTROL_SOCKET
        self._written: tuple[int, int] = (-1, -1)
        self._stopping = False
        self._sockets = {"agent": _Socket(), "control": _Socket()}

    # ----- set-up and teardown -------------------------------------------------------

    def prepare(self) -> None:
        """Create the run directory and claim it; raise RunDirBusy if a guard serves it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The guard's alone: its record, restore points and control socket. An agent of
        # another user reaches its socket through a staging directory (guard run --user).
        # Narrowed, never widened: a root guard keeps it at 000 (sandbox.launch.runs).
        os.chmod(self.run_dir, stat.S_IMODE(self.run_dir.stat().st_mode) & 0o700)
        for path in (self.agent_path, self.control_path):
            if path.exists():
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(path))
                except OSError:
                    path.unlink()  # stale, from a guard that died
                else:
                    raise RunDirBusy(f"{path} is served by another guard; use another --run-dir")
                finally:
                    probe.close()
        self.write_ledger()

    def cleanup(self) -> None:
        """Write the ledger one last time; remove the sockets (in this order: a control socket
        gone says the final ledger is there, for guard status --follow)."""
        self.write_ledger()
        for path in (self.agent_path, self.control_path):
            path.unlink(missing_ok=True)

    def snapshot(self) -> dict[str, Any]:
        """What the ledger holds: the breaker's snapshot, and the run's counts of denials and
        trips (:func:`guardfs.events.tally_kind`), from which the console, ``guard report``
        and the CI summary all take theirs."""
        return {**self.breaker.snapshot(), "counts": dict(self.events.tally)}

    def _version(self) -> tuple[int, int]:
        """Changes when the ledger would: the breaker's version, and the counts (a denial
        that trips nothing leaves the breaker as it was)."""
        return self.breaker.version, self.events.tally.total()

    def write_ledger(self) -> None:
        """Write ledger.json and STATE.md now, if anything changed."""
        if self._written != self._version():
            self._written = self._version()
            write_ledger(self.run_dir, self.snapshot())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve both sockets, write the ledger and tick the clock until cancelled.

        Reports started once both sockets are listening.
        """
        agent = _Listener(await self._listen(self.agent_path, 0o666), "agent", self._sockets["agent"], self._evict)
        control = _Listener(await self._listen(self.control_path, 0o600), "control", self._sockets["control"],
                            self._evict)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                # One serve_listeners per socket: each handler knows which socket it serves.
                nursery.start_soon(partial(trio.serve_listeners, partial(self._serve_conn, "agent"), [agent]))
                nursery.start_soon(partial(trio.serve_listeners, partial(self._serve_conn, "control"), [control]))
                nursery.start_soon(self._ledger_loop)
                nursery.start_soon(self._tick_loop)
        finally:  # serve_listeners closes them; not if cancelled before it started
            agent.socket.close()
            control.socket.close()

    async def _listen(self, path: Path, mode: int) -> trio.socket.SocketType:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Born with its mode: no window in which the control socket is wider than 0600.
        # (The umask is process-wide; nothing else creates files in this thread meanwhile.)
        old = os.umask(0o777 ^ mode)
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, mode)
        sock.listen(4096)
        return sock

    # ----- connections ---------------------------------------------------------------

    def _evict(self, book: _Socket, kind: str) -> None:
        """Close the longest-idle connection of *book* to make room for a new one."""
        key = min(book.conns, key=lambda k: book.conns[k].last_active)
        book.conns.pop(key).scope.cancel()
        book.evicted += 1
        if book.evicted in (1, 10, 100) or book.evicted % 1000 == 0:  # said, not once per connection
            log.warning("%s socket: %d connections open (at most %d); closed the longest-idle one (%d so far)",
                        kind, MAX_CONNECTIONS, MAX_CONNECTIONS, book.evicted)

    def _peer_allowed(self, stream: trio.SocketStream) -> str | None:
        """For the control socket: only our own user (or root), and never an agent.

        The uid alone does not tell a root agent from the operator. Every agent runs in a
        PID namespace of its own (bubblewrap's --unshare-pid), never in the guard's, so a
        peer outside the guard's PID namespace, or one whose namespace cannot be read, is
        refused: another run's agent included.
        """
        creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        if uid not in (0, os.geteuid()):
            return f"uid {uid} may not use the control socket (owner uid {os.geteuid()})"
        # pid 0: the peer lives in a PID namespace that is not below ours.
        try:
            same = pid > 0 and os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
        except OSError as err:
            return (f"cannot read the PID namespace of the peer (pid {pid}): {err.strerror}; "
                    f"run guard's control verbs as uid {os.geteuid()} on the guard's host")
        if not same:
            return ("the control socket serves the operator on the guard's host, not a process in another "
                    "PID namespace (an agent's sandbox); run guard approve/stop/status outside the sandbox")
        return None

    async def _serve_conn(self, kind: str, stream: trio.SocketStream) -> None:
        """serve_listeners' handler for one connection (booked by the listener that accepted it)."""
        book = self._sockets[kind]
        key = id(stream)
        conn = book.conns.get(key)
        if conn is None:  # evicted before its task began (serve_listeners closes the stream)
            return
        buf = bytearray()
        try:
            async with stream:  # closed however the connection ends, eviction included
                with conn.scope:
                    await self._converse(stream, kind, conn, buf, book)
        finally:
            if book.conns.get(key) is conn:
                del book.conns[key]
            book.buffered -= len(buf)

    async def _converse(self, stream: trio.SocketStream, kind: str, conn: _Conn, buf: bytearray,
                        book: _Socket) -> None:
        if kind == "control" and (refusal := self._peer_allowed(stream)) is not None:
            # Answered as a reply to its first request: closing before it arrives would make the
            # client's send fail (EPIPE) instead of showing it why.
            with trio.move_on_after(SEND_TIMEOUT_S), contextlib.suppress(trio.BrokenResourceError):
                await stream.receive_some(MAX_LINE)
            await self._send(stream, error_reply(refusal))
            return
        while True:
            with trio.move_on_after(IDLE_CONNECTION_S) as idle:
                try:
                    data = await stream.receive_some(MAX_LINE)
                except trio.BrokenResourceError:
                    return
            if idle.cancelled_caught or not data:
                return
            conn.last_active = trio.current_time()
            if book.buffered + len(data) > MAX_BUFFERED:
                book.over_budget += 1
                await self._send(stream, error_reply(
                    f"the guard holds {book.buffered} bytes of unfinished lines on the {kind} socket "
                    f"(at most {MAX_BUFFERED}); closing this connection"))
                return
            buf += data
            book.buffered += len(data)
            start = 0
            while (nl := buf.find(b"\n", start)) >= 0:
                line, start = bytes(buf[start:nl]), nl + 1
                if line.strip() and not await self._send(stream, self._handle(line, kind)):
                    return
                if self._stopping:  # after the reply went out
                    self.on_stop()
                    return
            del buf[:start]
            book.buffered -= start
            if len(buf) >= MAX_LINE:
                await self._send(stream, error_reply(f"line longer than {MAX_LINE} bytes; closing"))
                return

    async def _send(self, stream: trio.SocketStream, reply: dict[str, Any]) -> bool:
        try:  # UTF-8, which the compiled hook helper prints as it is
            data = json.dumps(reply, separators=(",", ":"), ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a surrogate-escaped name in it: escaped, still valid JSON
            data = json.dumps(reply, separators=(",", ":")).encode()
        data += b"\n"
        with trio.move_on_after(SEND_TIMEOUT_S):
            try:
                await stream.send_all(data)
                return True
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
        return False  # a client that does not read its replies is dropped

    def feed(self, message: dict[str, Any]) -> dict[str, Any]:
        """Handle one agent message from inside the guard (its output parsers)."""
        return self._handle(json.dumps({"v": VERSION, **message}).encode(), "agent")

    def _handle(self, line: bytes, kind: str) -> dict[str, Any]:
        try:
            msg = parse_agent(line) if kind == "agent" else parse_control(line)
        except ProtocolError as err:
            self.events.emit("protocol", kind, "deny", reason=str(err)[:500])
            return error_reply(str(err))
        return self._dispatch(msg, kind)

    def _answer(self, reply: Reply) -> dict[str, Any]:
        """The breaker's *reply* as sent, once its effects are carried out."""
        if reply.effects:
            self.on_effects(reply.effects)
            if Effect.HALT in reply.effects:
                self._stopping = True  # on_stop runs once the reply went out
        return _reply(reply)

    def _ask_self(self, message: dict[str, Any]) -> dict[str, Any]:
        """The hook logic's questions, answered here without a socket."""
        reply = self._handle(json.dumps({"v": VERSION, **message}).encode(), "agent")
        if not reply.get("ok"):  # refused, as fasthook's _ask says it: the hook fails closed
            raise GuardClientError(f"the guard refused the request: {reply.get('error')}")
        return reply

    def _rollback(self, to: str) -> dict[str, Any]:
        if self.on_rollback is None:
            return error_reply("this guard keeps no pre-images (rollback is for guard run)")
        try:
            restored = self.on_rollback(to)
        except GuardError as err:  # no such restore point, or a tampered store: nothing changed
            return error_reply(str(err))
        except OSError as err:  # the store's own disk failed (what the workspace refused is in the result)
            return error_reply(f"the rollback failed: {err}; see the guard's console and the ledger")
        return {"v": VERSION, "ok": True, "state": self.breaker.state.value, "restored": restored}

    def _dispatch(self, msg: Any, kind: str) -> dict[str, Any]:
        b = self.breaker
        if kind == "agent" and not isinstance(msg, Status):
            b.activity()
        match msg:
            case Hello():
                return self._answer(b.hello(msg.agent))
            case Step():
                return self._answer(b.step(msg.tokens_in, msg.tokens_out, msg.tokens_cached, msg.tool, msg.args,
                                           totals=msg.totals))
            case ToolResult():
                return self._answer(b.tool_result(msg.tool, msg.exit_code, msg.summary))
            case Check():
                paths, outside = self._relative(msg.paths)
                return self._answer(b.check(msg.tool, paths, msg.args, msg.mutating, outside=outside))
            case Note():
                return self._answer(b.note(msg.kind, msg.text))
            case Hook():
                try:
                    code, text = decide(msg.event, self._ask_self, msg.agent)
                except HookPayloadError as err:  # answered as the hook would answer it, and recorded
                    self.events.emit("protocol", kind, "deny", reason=f"invalid {msg.agent} hook event: {err}"[:500])
                    code, text = refuse_malformed(msg.event, err, msg.agent)
                return {"v": VERSION, "ok": True, "exit": code, "stderr": text}
            case Status():
                return {"v": VERSION, "ok": True, "state": b.state.value, "ledger": json_safe(self.snapshot()),
                        "connections": {k: v.counters() for k, v in self._sockets.items()}}
            case Approve():
                return self._answer(b.approve(msg.raise_to))
            case Stop():
                return self._answer(b.stop())
            case Checkpoint():
                return self._answer(b.checkpoint(msg.label))
            case Rollback():
                return self._rollback(msg.to)
        raise AssertionError(f"unhandled message {msg!r}")  # the parsers admit nothing else

    def _relative(self, paths: list[str]) -> tuple[list[str], list[str]]:
        """Workspace-relative forms of *paths*; the ones outside the workspace apart."""
        inside, outside = [], []
        for p in paths:
            full = os.path.normpath(os.path.join(self.workspace, p))
            rel = os.path.relpath(full, self.workspace)
            if rel == ".":
                inside.append("")
            elif rel.split(os.sep, 1)[0] == "..":  # a component, not a prefix: "..cache/x" is inside
                outside.append(full)
            else:
                inside.append(rel)
        return inside, outside

    # ----- background tasks ------------------------------------------------------------

    async def _ledger_loop(self) -> None:
        """Rewrite the ledger after changes, bounded in cost whatever the agent does.

        A change after a quiet spell is written within LEDGER_INTERVAL_S. After each write
        the loop rests ``record.ledger_min_interval_s``, and at least LEDGER_COST_FACTOR
        times as long as the write took (a slow disk gets fewer rewrites, not a backlog):
        changes meanwhile coalesce into the next write. The snapshot itself is bounded
        (``record.ledger_max_items``), and cleanup() writes the final state.
        """
        interval = self.breaker.manifest.record.ledger_min_interval_s
        while True:
            if self._written == self._version():
                await trio.sleep(LEDGER_INTERVAL_S)
                continue
            self._written = self._version()
            snap = self.snapshot()  # taken in the loop's thread: consistent
            started = time.monotonic()
            await trio.to_thread.run_sync(write_ledger, self.run_dir, snap)
            await trio.sleep(max(interval, LEDGER_COST_FACTOR * (time.monotonic() - started)))

    async def _tick_loop(self) -> None:
        while True:
            await trio.sleep(TICK_INTERVAL_S)
            reply = self.breaker.tick()
            if reply is not None and reply.effects:
                self.on_effects(reply.effects)
