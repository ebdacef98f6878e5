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

Standard library only; one thread per connection (a handful of humans).
"""

from __future__ import annotations

import grp
import json
import os
import socket
import struct
import sys
import threading

ALLOWED = frozenset({"status", "approve", "checkpoint"})
MAX_LINE = 64 * 1024


def _reply(conn: socket.socket, message: dict[str, object]) -> None:
    conn.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


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


def _serve(conn: socket.socket, upstream_path: str) -> None:
    with conn:
        refusal = _refusal(conn)
        if refusal is not None:
            print(f"guard-relay: refused: {refusal}", file=sys.stderr, flush=True)
            _reply(conn, {"v": 1, "ok": False, "error": refusal})
            return
        reader = conn.makefile("rb")
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with upstream:
            upstream.connect(upstream_path)
            replies = upstream.makefile("rb")
            for line in reader:
                if len(line) > MAX_LINE:
                    _reply(conn, {"v": 1, "ok": False, "error": f"line longer than {MAX_LINE} bytes"})
                    return
                if not line.strip():
                    continue
                try:
                    kind = json.loads(line).get("type")
                except (ValueError, AttributeError):
                    kind = None
                if kind not in ALLOWED:
                    _reply(conn, {"v": 1, "ok": False,
                                  "error": f"{kind!r} is for root (podman exec -u root ... guard {kind} "
                                           "--run-dir /run/guardfs); the relay passes "
                                           f"{', '.join(sorted(ALLOWED))}"})
                    continue
                upstream.sendall(line if line.endswith(b"\n") else line + b"\n")
                answer = replies.readline()
                if not answer:
                    _reply(conn, {"v": 1, "ok": False, "error": "the guard closed its control socket"})
                    return
                conn.sendall(answer)


def main(argv: list[str]) -> int:
    """Listen on LISTEN and relay to UPSTREAM until killed."""
    if len(argv) != 3:
        print("usage: guard-relay UPSTREAM LISTEN GROUP", file=sys.stderr)
        return 64
    upstream, listen, group = argv
    gid = grp.getgrnam(group).gr_gid
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
