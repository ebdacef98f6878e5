"""containers/guard-relay.py under hostile requests (issue 21, item 9): every malformed request gets
an error reply naming the problem, a line is judged without reading past its bound, and the relay
goes on serving that client and the next.

The relay runs as the container's entrypoint starts it (``guard-relay UPSTREAM LISTEN GROUP``, as
root: it hands its socket to the group), in front of a real breaker daemon's control socket.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .helpers import FIX_TAX, breaker_daemon, require, wait_for

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parents[1]
RELAY = ROOT / "containers/guard-relay.py"
MAX_LINE = 64 * 1024  # the relay's


def _start_relay(upstream: Path, listen: Path) -> subprocess.Popen[bytes]:
    group = grp.getgrgid(os.getgid()).gr_name
    proc = subprocess.Popen([sys.executable, str(RELAY), str(upstream), str(listen), group],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: listen.is_socket() or proc.poll() is not None, "the relay's socket")
    assert proc.poll() is None, "the relay exited at start"
    return proc


def _stop_relay(proc: subprocess.Popen[bytes]) -> str:
    """Stop the relay (ours, by its handle); its log, which must hold no traceback."""
    proc.terminate()
    _, err = proc.communicate(timeout=30)
    log = err.decode(errors="replace")
    assert "Traceback" not in log, log
    return log


@contextmanager
def relay() -> Iterator[Path]:
    """A relay in front of a real guard's control socket; yields the relay's socket."""
    base = Path(tempfile.mkdtemp(prefix="rl-"))
    (base / "ws").mkdir()
    try:
        with breaker_daemon(base / "run", base / "ws", FIX_TAX) as run:
            proc = _start_relay(run / "control.sock", base / "relay.sock")
            try:
                yield base / "relay.sock"
            finally:
                _stop_relay(proc)
    finally:
        shutil.rmtree(base)


def ask(conn: socket.socket, payload: bytes) -> dict[str, Any]:
    """Send *payload*; the next reply line."""
    conn.sendall(payload)
    reply: dict[str, Any] = json.loads(conn.makefile("rb").readline())
    return reply


def client(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(60)
    conn.connect(str(path))
    return conn


#: (request line, words the error reply must hold)
MALFORMED = [
    (b'{"type":["status"]}', "'type' must be a string"),
    (b'{"type":{"status":1}}', "'type' must be a string"),
    (b'{"type":7}', "'type' must be a string"),
    (b"{}", "needs a 'type'"),
    (b'{"type":null}', "needs a 'type'"),
    (b"[1]", "must be a JSON object"),
    (b'"status"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{"type":"nope"}', "unknown request type 'nope'"),
    (b'{"type":"\\ud800"}', "unknown request type"),
    (b'{"type":"stop"}', "'stop' is for root"),
    (b'{"type":"rollback","to":"start"}', "'rollback' is for root"),
    (b'{"type":"status","type":"stop"}', "'stop' is for root"),  # the guard would read the last one too
    (b"\xff\xfe{}", "must be UTF-8"),
    (b'{"type":"status"', "one JSON object per line"),
    (b"{'type': 'status'}", "one JSON object per line"),
    (b"[" * 60_000, "nested too deep"),
    (b'{"type":"status","v":2}', "unsupported protocol version"),  # the guard's own words, passed back
    (b'{"type":"approve","raise_to":"x"}', "raise_to"),
    (b'{"type":"approve","raise_to":0}', "raise_to"),
    (b'{"type":"checkpoint","label":5}', "label"),
    (b'{"type":"checkpoint","label":"' + b"x" * 300 + b'"}', "label"),
    (b'{"type":"status","extra":[1,2]}', "extra"),
]


def test_every_malformed_request_gets_an_error_reply_and_the_connection_goes_on() -> None:
    with relay() as path:
        conn = client(path)
        with conn:
            for line, words in MALFORMED:
                reply = ask(conn, line + b"\n")
                assert reply["ok"] is False and words in reply["error"], (line[:80], reply)
                assert ask(conn, b'{"type":"status"}\n')["ok"] is True, line[:80]  # the same connection
            conn.sendall(b"\n   \n")  # blank lines: no request, no reply
            assert ask(conn, b'{"v":1,"type":"checkpoint","label":"fine"}\n')["ok"] is True
        with client(path) as other:  # and the next client
            assert ask(other, b'{"type":"status"}\n')["state"] == "CLOSED"


def test_a_line_is_judged_at_its_bound_not_at_its_end() -> None:
    pad = b'{"type":"status","pad":"'
    with relay() as path:
        at_bound = pad + b"x" * (MAX_LINE - len(pad) - 3) + b'"}\n'
        assert len(at_bound) == MAX_LINE
        with client(path) as conn:  # passed to the guard, which refuses the field it does not know
            reply = ask(conn, at_bound)
            assert "longer than" not in reply["error"] and "pad" in reply["error"], reply
        with client(path) as conn:
            # One byte over, and the line not ended: the reply comes before any newline is sent,
            # so the relay never waits for (or holds) the rest of the line.
            reply = ask(conn, b"x" * MAX_LINE)
            assert reply["ok"] is False and f"longer than {MAX_LINE} bytes" in reply["error"], reply
            assert conn.recv(1) == b""  # and it closed that connection: what follows is no request
        with client(path) as conn, pytest.raises(OSError):  # 64 MiB thrown at it: it stops reading, closes
            conn.sendall(b"y" * (64 << 20))
        with client(path) as conn:
            assert ask(conn, b'{"type":"status"}\n')["ok"] is True


def test_a_guard_that_is_not_there_is_said_and_the_relay_serves_on(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="rl-"))
    try:
        proc = _start_relay(base / "no-guard.sock", base / "relay.sock")
        try:
            for _ in range(2):
                with client(base / "relay.sock") as conn:
                    reply = ask(conn, b'{"type":"status"}\n')
                    assert reply["ok"] is False and "cannot reach the guard's control socket" in reply["error"]
        finally:
            _stop_relay(proc)
    finally:
        shutil.rmtree(base)


def test_a_caller_in_a_sandbox_is_refused() -> None:
    unshare = require("unshare")
    code = ("import json, socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "s.sendall(b'{\"type\":\"approve\"}\\n'); print(s.makefile().readline(), end='')")
    with relay() as path:
        proc = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", code, str(path)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        reply = json.loads(proc.stdout)
        assert reply["ok"] is False and "from inside a sandbox" in reply["error"], reply
        with client(path) as conn:
            assert ask(conn, b'{"type":"approve"}\n')["ok"] is True  # a human's, from the container's namespace
