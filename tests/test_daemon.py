"""The breaker daemon on real Unix sockets: good clients, hostile clients, fake time."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.breaker import State
from sandbox.breaker import daemon as daemon_module
from sandbox.breaker.client import AsyncGuardClient, GuardClientError
from sandbox.breaker.daemon import Daemon, RunDirBusy
from sandbox.breaker.protocol import MAX_LINE
from sandbox.session import Session

from .helpers import FIX_TAX, state_of

MANIFEST = FIX_TAX + """
[limits]
max_window_tokens = 30000
max_tokens_without_progress = 20000
idle_timeout_s = 60
"""


@asynccontextmanager
async def running_daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    """The daemon of a session (no mount) serving its breaker on trio's clock."""
    events = EventLog(tmp_path / "events.jsonl")
    (tmp_path / "ws").mkdir(exist_ok=True)
    with Session(parse_manifest(MANIFEST), tmp_path / "ws", events, run_dir=tmp_path / "run",
                 now=trio.current_time) as session:
        async with trio.open_nursery() as nursery:
            await nursery.start(session.daemon.run)
            try:
                yield session.daemon
            finally:
                nursery.cancel_scope.cancel()
    events.close()


async def raw(path: Path, payload: bytes) -> bytes:
    """Send raw bytes on a fresh connection; return the first reply line (b'' if closed)."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(payload)
        buf = b""
        while b"\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                break
            buf += data
    return buf.split(b"\n", 1)[0]


async def file_when(path: Path, condition: Callable[[str], bool]) -> str:
    """The text of *path* once it satisfies *condition* (written by a worker thread), waiting <= 5 s."""
    for _ in range(500):
        text = path.read_text()
        if condition(text):
            return text
        await trio.to_thread.run_sync(time.sleep, 0.01)  # real time: the writer is a thread
    raise AssertionError(f"{path} never satisfied the condition; last: {text}")


async def ledger_when(d: Daemon, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """ledger.json once it satisfies *condition*."""
    doc: dict[str, Any] = json.loads(await file_when(d.run_dir / "ledger.json", lambda t: condition(json.loads(t))))
    return doc


async def good_client_works(d: Daemon) -> None:
    async with await AsyncGuardClient.connect(d.agent_path) as guard:
        reply = await guard.status()
        assert reply["ok"] and reply["state"] in {s.value for s in State}


BAD_LINES = [
    (b"not json\n", "not valid JSON"),
    (b"[1, 2]\n", "JSON object"),
    (b'{"type": "dance"}\n', "unknown message type 'dance'"),
    (b'{"type": "status", "v": 7}\n', "unsupported protocol version 7"),
    (b'\xff\xfe\n', "not valid JSON"),
]
WRONG_FIELDS = {
    "agent": [(b'{"type": "step", "tokens_in": -5}\n', "tokens_in"), (b'{"type": "step", "tokenz": 5}\n', "tokenz"),
              (b'{"type": "check", "paths": ["a"]}\n', "tool: Field required")],
    "control": [(b'{"type": "approve", "raise_to": 0}\n', "raise_to"), (b'{"type": "stop", "now": 1}\n', "now")],
}


@pytest.mark.parametrize("sock", ["agent", "control"])
async def test_bad_lines_get_error_replies_and_the_daemon_lives_on(tmp_path: Path, sock: str) -> None:
    async with running_daemon(tmp_path) as d:
        path = d.agent_path if sock == "agent" else d.control_path
        for line, expected in BAD_LINES + WRONG_FIELDS[sock]:
            reply = json.loads(await raw(path, line))
            assert reply["ok"] is False
            assert expected in reply["error"], (line, reply)
        # The same connection carries on after an error.
        reply_lines = (await raw(path, b"garbage\n" + b'{"type":"status"}\n'))
        assert b"not valid JSON" in reply_lines
        await good_client_works(d)
        protocol_events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert sum(e["op"] == "protocol" for e in protocol_events) >= len(BAD_LINES) + len(WRONG_FIELDS[sock])


async def test_agent_socket_refuses_to_loosen_anything(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        d.breaker.stop()
        for kind in ("approve", "stop", "checkpoint"):
            reply = json.loads(await raw(d.agent_path, json.dumps({"type": kind}).encode() + b"\n"))
            assert not reply["ok"] and "never approve" in reply["error"]
        assert state_of(d.breaker) is State.OPEN_STOPPED


async def test_oversized_line_closes_only_that_connection(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        reply = json.loads(await raw(d.agent_path, b"x" * (MAX_LINE + 10)))
        assert "longer than" in reply["error"]
        await good_client_works(d)


async def test_silent_and_slow_clients_hold_up_no_one(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with running_daemon(tmp_path) as d:
        silent = await trio.open_unix_socket(str(d.agent_path))
        slow = await trio.open_unix_socket(str(d.agent_path))
        # The slow one never reads its replies: its socket buffer fills and the daemon drops it.
        with trio.move_on_after(5):
            for _ in range(20000):
                await slow.send_all(b'{"type":"status"}\n')
        await good_client_works(d)
        await trio.sleep(daemon_module.IDLE_CONNECTION_S + 1)
        assert await silent.receive_some(10) == b""  # closed by the daemon
        await silent.aclose()
        await slow.aclose()
        await good_client_works(d)


async def test_a_thousand_clients_at_once(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        replies: list[dict[str, object]] = []

        async def one(i: int) -> None:
            async with await AsyncGuardClient.connect(d.agent_path) as guard:
                replies.append(await guard.step(tokens_in=1, tool="Read", args={"i": i}))

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
        assert len(replies) == 1000
        assert d.breaker.snapshot()["steps"] == 1000  # nothing lost


async def test_idle_transport_trips_on_fake_time(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with running_daemon(tmp_path) as d:
        await trio.sleep(600)  # no agent yet: idle detection is not armed
        assert state_of(d.breaker) is State.CLOSED
        async with await AsyncGuardClient.connect(d.agent_path) as guard:
            await guard.hello("test")
            await trio.sleep(59)
            await guard.step(tokens_in=1)  # traffic resets the idle clock
            await trio.sleep(59)
            assert state_of(d.breaker) is State.CLOSED
            await trio.sleep(3)
            assert state_of(d.breaker) is State.OPEN_IDLE_TRANSPORT
            status = await guard.status()
            assert status["ledger"]["trips"][0]["rule"] == "idle_transport"


async def test_velocity_and_approve_over_the_control_socket(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with running_daemon(tmp_path) as d:
        async with await AsyncGuardClient.connect(d.agent_path) as agent:
            for _ in range(3):
                reply = await agent.step(tokens_in=7000)
                await trio.sleep(30)
            assert reply["allow"] is False and reply["trip"]["rule"] == "token_velocity"
            assert "token_velocity" in reply["feedback"]
            second = await agent.check("Write", ["src/checkout/tax.py"])  # refused once: delivers the feedback
            assert second["allow"] is False and "token_velocity" in second["feedback"]
            third = await agent.check("Write", ["../outside.txt"])  # a violation in HALF_OPEN: terminal
            assert third["state"] == "OPEN_SCOPE_SPILL"
        async with await AsyncGuardClient.connect(d.control_path) as control:
            assert (await control.request({"type": "approve"}))["state"] == "CLOSED"
        ledger = await ledger_when(d, lambda doc: len(doc["trips"]) >= 2)
        assert [t["rule"] for t in ledger["trips"]][:2] == ["token_velocity", "scope_spill"]
        assert "outside the workspace" in ledger["trips"][1]["reason"]
        await file_when(d.run_dir / "STATE.md", lambda text: "## Trips" in text and "token_velocity" in text)


@pytest.mark.root
async def test_control_socket_checks_peer_credentials() -> None:
    python = "/usr/bin/python3"
    if not os.path.exists(python):
        pytest.skip("needs /usr/bin/python3 to connect as another user")
    # A directory the other user can traverse (pytest's tmp_path is 0700).
    base = Path(tempfile.mkdtemp(prefix="guardfs-peercred-"))
    os.chmod(base, 0o755)  # noqa: S103 - the other user must reach the socket
    async with running_daemon(base) as d:
        os.chmod(d.run_dir, 0o755)  # noqa: S103 - the guard made it 0700 (issue 12); reopened for the test
        os.chmod(d.control_path, 0o666)  # noqa: S103 - so that only the credential check stands
        code = (
            "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
            "s.sendall(b'{\"type\":\"stop\"}\\n'); print(s.makefile().readline())"
        )
        proc = await trio.run_process(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", code,
             str(d.control_path)], capture_stdout=True, check=False,
        )
        reply = json.loads(proc.stdout)
        assert not reply["ok"] and "uid 65534 may not use the control socket" in reply["error"]
        assert state_of(d.breaker) is State.CLOSED
    shutil.rmtree(base)


async def test_a_second_guard_on_the_same_run_dir_is_refused(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        other = Session(d.breaker.manifest, tmp_path / "ws", d.events, run_dir=d.run_dir)
        with pytest.raises(RunDirBusy):
            await trio.to_thread.run_sync(other.prepare)
        other.close()  # leaves the serving guard's sockets alone
        assert d.agent_path.exists() and d.control_path.exists()
        await good_client_works(d)


async def test_client_reports_unreachable_guard(tmp_path: Path) -> None:
    with pytest.raises(GuardClientError, match="cannot reach the guard"):
        await AsyncGuardClient.connect(tmp_path / "nothing.sock")


async def test_a_name_that_starts_with_two_dots_is_inside_the_workspace(tmp_path: Path) -> None:
    """``..cache/x.py`` is a path in the workspace (a component equal to ``..`` leaves it,
    a name starting with two dots does not): in scope it is allowed, no scope_spill."""
    events = EventLog(tmp_path / "events.jsonl")
    (tmp_path / "ws").mkdir()
    manifest = parse_manifest(FIX_TAX.replace('allowed = ["src/checkout/"]', 'allowed = ["src/checkout/", "..cache/"]'))
    with Session(manifest, tmp_path / "ws", events, run_dir=tmp_path / "run", now=trio.current_time) as session:
        d = session.daemon
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            async with await AsyncGuardClient.connect(d.agent_path) as agent:
                inside = await agent.request({"type": "check", "tool": "Write", "paths": ["..cache/x.py"]})
                assert inside["allow"] and "trip" not in inside, inside
                absolute = await agent.request({"type": "check", "tool": "Write",
                                                "paths": [str(tmp_path / "ws/..cache/y.py")]})
                assert absolute["allow"], absolute
                outside = await agent.request({"type": "check", "tool": "Write", "paths": ["../x.py"]})
                assert not outside["allow"] and outside["trip"]["rule"] == "scope_spill", outside
            nursery.cancel_scope.cancel()
    events.close()
