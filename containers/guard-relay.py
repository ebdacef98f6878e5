#!/usr/bin/env python3
"""guard-relay: the developer's door to the root guard's control socket in the devcontainer.

    guard-relay UPSTREAM LISTEN GROUP

The guard's own control socket answers root only. This relay (run as root by the entrypoint)
listens on LISTEN, mode 0660, group GROUP, and passes a client's request lines to UPSTREAM
and the replies back, with two limits:

* only ``status``, ``approve`` and ``checkpoint`` pass: a human may look and loosen a trip;
  ``stop`` and ``rollback`` stay with root (``podman exec -u root``);
* a caller in a PID namespace below the container's is refused: every agent
  runs under ``guard run``, inside bubblewrap's namespaces, so an agent cannot approve its
  own trip even though it runs as the developer's user. The developer's shell and
  ``devcontainer exec`` share the container's namespaces.

Every request is hostile input: a line is read to at most MAX_LINE bytes (never more into
memory), parsed, judged and written again before it goes to the guard; anything malformed
(not UTF-8, not JSON, not an object, no string ``type``, an unknown one) gets an error reply
naming the problem and the connection goes on, as it does after the guard's own error replies
to fields it refuses. Standard library only; one thread per connection (a handful of humans).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator

ALLOWED = frozenset({"status", "approve", "checkpoint"})
ROOT_ONLY = frozenset({"stop", "rollback"})
#: The longest request line, newline included; no more than one byte past it is ever read into memory.
MAX_LINE = 64 * 1024
#: How long a connection may stay silent before the relay closes it (a thread per connection).
IDLE_S = 600.0


class Refused(ValueError):
    """A request the relay answers itself, with the reason (the connection goes on)."""


def _reply(conn: socket.socket, message: dict[str, object]) -> None:
    conn.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def _error(conn: socket.socket, why: str) -> None:
    _reply(conn, {"v": 1, "ok": False, "error": why})


def _refusal(conn: socket.socket) -> str | None:
    """Why this peer may not use the relay, or None."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    # NSpid lists the caller's pid in each PID namespace from ours down: one entry for a
    # process of the container, two or more inside a `guard run` sandbox (bubblewrap's own
    # PID namespace). /proc/PID/status needs no ptrace right, unlike /proc/PID/ns/*.
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    except OSError as err:
        return f"cannot read the caller's status (pid {pid}: {err}); refusing"
    if len(nspid) != 1:
        return (f"uid {uid} calls from inside a sandbox (PID namespaces {nspid}); an agent may not "
                "steer its guard: ask the human in the developer's shell")
    return None


def _lines(conn: socket.socket) -> Iterator[bytes]:
    """The request lines of *conn*, without their newline, until it closes or stays silent IDLE_S;
    raise Refused for a line over MAX_LINE, having read at most one byte past it."""
    buf = b""
    while True:
        while (nl := buf.find(b"\n")) < 0:
            if len(buf) > MAX_LINE - 1:  # MAX_LINE bytes and no newline yet: over, whatever follows
                raise Refused(f"a request line longer than {MAX_LINE} bytes; closing this connection")
            try:
                data = conn.recv(MAX_LINE + 1 - len(buf))
            except TimeoutError:
                return
            if not data:
                return
            buf += data
        line, buf = buf[:nl], buf[nl + 1:]
        yield line


def _request(line: bytes) -> bytes:
    """The request *line* as passed to the guard (parsed and written again: the guard reads what the
    relay judged, duplicate keys and all resolved); raise Refused naming what is wrong with it."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Refused(f"a request must be UTF-8 text (byte {err.start} is not)") from err
    try:
        doc = json.loads(text)
    except RecursionError as err:
        raise Refused("a request nested too deep to read") from err
    except ValueError as err:
        raise Refused(f"a request must be one JSON object per line: {err}") from err
    if not isinstance(doc, dict):
        raise Refused(f"a request must be a JSON object with a 'type', not {type(doc).__name__}")
    passes = ", ".join(sorted(ALLOWED))
    kind = doc.get("type")
    if kind is None:
        raise Refused(f"a request needs a 'type' (the relay passes {passes})")
    if not isinstance(kind, str):
        raise Refused(f"'type' must be a string (the relay passes {passes}), not {type(kind).__name__}")
    if kind in ROOT_ONLY:
        raise Refused(f"{kind!r} is for root (podman exec -u root ... guard {kind} --run-dir /run/guardfs); "
                      f"the relay passes {passes}")
    if kind not in ALLOWED:
        raise Refused(f"unknown request type {kind[:100]!r}; the relay passes {passes}")
    # The guard judges the other fields (missing, of the wrong type) and says what is wrong with them.
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _refuse(conn: socket.socket, why: str) -> None:
    """Answer *why* to the client's first request, then close: closing before it arrives would make
    the client's send fail (EPIPE) instead of showing it why."""
    with contextlib.suppress(Refused, OSError):
        next(_lines(conn), None)
    _error(conn, why)


def _relay(conn: socket.socket, upstream_path: str) -> None:
    conn.settimeout(IDLE_S)
    refusal = _refusal(conn)
    if refusal is not None:
        print(f"guard-relay: refused: {refusal}", file=sys.stderr, flush=True)
        _refuse(conn, refusal)
        return
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with upstream:
        try:
            upstream.connect(upstream_path)
        except OSError as err:
            _refuse(conn, f"cannot reach the guard's control socket {upstream_path}: {err.strerror or err}; "
                          "is the guard running? (podman exec -u root ... cat /run/guardfs/guard.log)")
            return
        replies = upstream.makefile("rb")
        try:
            for line in _lines(conn):
                if not line.strip():
                    continue
                try:
                    request = _request(line)
                except Refused as err:
                    _error(conn, str(err))
                    continue
                try:
                    upstream.sendall(request)
                    answer = replies.readline()
                except OSError as err:
                    answer = b""
                    print(f"guard-relay: lost the guard's control socket: {err}", file=sys.stderr, flush=True)
                if not answer:
                    _error(conn, "the guard closed its control socket; is the guard still running?")
                    return
                conn.sendall(answer)
        except Refused as err:  # a line too long: the rest of it cannot be told from a next request
            _error(conn, str(err))


def _serve(conn: socket.socket, upstream_path: str) -> None:
    with conn:
        try:
            _relay(conn, upstream_path)
        except OSError as err:  # the client or the guard went away: this connection ends, the relay goes on
            print(f"guard-relay: a connection ended: {err}", file=sys.stderr, flush=True)
        except Exception as err:  # a defect: said, answered, and the relay goes on serving
            print(f"guard-relay: internal error serving a client: {err!r}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                _error(conn, f"internal error in guard-relay ({type(err).__name__}); see its log")


def main(argv: list[str]) -> int:
    """Listen on LISTEN and relay to UPSTREAM until killed."""
    if len(argv) != 3:
        print("usage: guard-relay UPSTREAM LISTEN GROUP", file=sys.stderr)
        return 64
    upstream, listen, group = argv
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        print(f"guard-relay: no group named {group!r}: create it (the developers' group) or name another",
              file=sys.stderr)
        return 67  # EX_NOUSER
    if os.path.exists(listen):
        os.unlink(listen)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # born 0660: never wider
    try:
        server.bind(listen)
    finally:
        os.umask(old)
    os.chown(listen, 0, gid)
    server.listen(64)
    print(f"guard-relay: {listen} (group {group}) -> {upstream}", file=sys.stderr, flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn, upstream), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
