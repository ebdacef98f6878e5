"""Hostile input on the guard's sockets and hooks: each input that once crashed the guard gets
an error reply naming the problem, the daemon serves on, and the breaker still trips on the
next real violation. Real daemons on real Unix sockets; one real ``guard run`` does it all
from inside the sandbox."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio

from sandbox.agents.parsers import FORMATS, make_parser
from sandbox.breaker import State
from sandbox.breaker import daemon as daemon_module
from sandbox.breaker.daemon import MAX_BUFFERED, MAX_CONNECTIONS, Daemon
from sandbox.breaker.protocol import MAX_LINE

from .helpers import state_of
from .test_daemon import good_client_works, raw, running_daemon
from .test_run import workspace

#: The exact inputs from issue 10 that each ended a run with a traceback, and what the reply names;
#: these are refused before the message type is known, so on either socket.
CRASHES = [
    pytest.param(b"[" * 50_000 + b"\n", "nested 50000 levels deep", id="50000-brackets"),
    pytest.param(b'{"type":"step","tokens_in":' + b"9" * 5000 + b"}\n", "5000 digits", id="5000-digit-tokens"),
    pytest.param(b'{"type":"status","v":' + b"1" * 5000 + b"}\n", "5000 digits", id="5000-digit-version"),
    pytest.param(b'{"type":"step","tokens_in":1e999}\n', "out of range", id="infinite-number"),
    pytest.param(b'{"type":"step","tokens_in":NaN}\n', "NaN", id="nan"),
    pytest.param(b'{"type":"note","text":"a\\ud800b"}\n', "lone surrogate U+D800", id="lone-surrogate"),
    pytest.param(b'{"type":"step","args":' + b"[" * 30 + b"{}," * 60_000 + b"{}" + b"]" * 30 + b"}\n",
                 "arrays and objects", id="60000-objects"),
]
#: Fields of the wrong type in agent-socket messages.
WRONG_TYPES = [
    pytest.param(b'{"type":"step","tokens_in":true}\n', "tokens_in", id="bool-for-count"),
    pytest.param(b'{"type":"step","tokens_in":"12"}\n', "tokens_in", id="string-for-count"),
    pytest.param(b'{"type":"tool_result","tool":"t","exit_code":1.5}\n', "exit_code", id="float-exit-code"),
    pytest.param(b'{"type":"check","tool":"t","mutating":"yes"}\n', "mutating", id="string-for-bool"),
    pytest.param(b'{"type":"check","tool":"t","paths":"a"}\n', "paths", id="string-for-paths"),
    pytest.param(b'{"type":"check","tool":"t","paths":["a\\udcff"]}\n', "paths", id="escaped-byte-in-path"),
    pytest.param(b'{"type":"check","tool":{"x":1},"paths":["a"]}\n', "tool", id="object-for-tool"),
    pytest.param(b'{"type":"hook","agent":"claude","event":[1]}\n', "event", id="array-for-hook-event"),
]


async def trips_on_a_real_violation(d: Daemon) -> None:
    """A step over max_window_tokens (30000 in the test manifest) still trips the breaker."""
    reply = json.loads(await raw(d.agent_path, b'{"type":"step","tokens_in":40000}\n'))
    assert reply["ok"] and not reply["allow"] and reply["trip"]["rule"] == "token_surge", reply
    assert state_of(d.breaker) is not State.CLOSED


@pytest.mark.parametrize(("line", "expected", "sockets"), [
    *(pytest.param(*p.values, ("agent", "control"), id=p.id) for p in CRASHES),
    *(pytest.param(*p.values, ("agent",), id=p.id) for p in WRONG_TYPES),
])
async def test_each_crash_input_gets_an_error_reply_and_the_breaker_still_trips(
    tmp_path: Path, line: bytes, expected: str, sockets: tuple[str, ...]
) -> None:
    async with running_daemon(tmp_path) as d:
        paths = [d.agent_path if kind == "agent" else d.control_path for kind in sockets]
        for path in paths:
            reply = json.loads(await raw(path, line))
            assert reply["ok"] is False and expected in reply["error"], reply
        # The same connection carries on after the error.
        replies = (await raw_lines(d.agent_path, line + b'{"type":"status"}\n', 2))
        assert [r["ok"] for r in replies] == [False, True]
        await good_client_works(d)
        await trips_on_a_real_violation(d)
        reasons = [e.get("reason", "") for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                   if e["op"] == "protocol"]
        assert sum(expected in r for r in reasons) >= len(paths)  # recorded, once per socket at least


async def raw_lines(path: Path, payload: bytes, n: int) -> list[dict[str, Any]]:
    """Send *payload* on a fresh connection; return its first *n* replies."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(payload)
        buf = b""
        while buf.count(b"\n") < n:
            data = await stream.receive_some(65536)
            if not data:
                break
            buf += data
    return [json.loads(x) for x in buf.splitlines()[:n]]


def hook_line(event: Any, agent: str = "claude") -> bytes:
    return json.dumps({"type": "hook", "agent": agent, "event": event}).encode() + b"\n"


PRE = {"hook_event_name": "PreToolUse", "tool_name": "Edit", "cwd": "/ws"}
BAD_HOOKS = [
    pytest.param({**PRE, "tool_input": {"edits": 5}}, "tool_input.edits must be an array, not a number", id="edits-5"),
    pytest.param({**PRE, "tool_input": {"edits": [5]}}, "tool_input.edits[0] must be an object", id="edits-[5]"),
    pytest.param({**PRE, "tool_input": {"edits": [{"file_path": 3}]}}, "tool_input.edits[0].file_path",
                 id="edit-path-number"),
    pytest.param({**PRE, "tool_input": {"file_path": ["a"]}}, "tool_input.file_path must be a string",
                 id="path-array"),
    pytest.param({**PRE, "tool_input": [1]}, "tool_input must be an object, not an array", id="input-array"),
    pytest.param({**PRE, "tool_name": {"a": 1}}, "tool_name must be a string", id="tool-object"),
    pytest.param({**PRE, "tool_name": "x" * 300}, "tool_name of 300 characters", id="tool-long"),
    pytest.param({**PRE, "cwd": 7}, "cwd must be a string", id="cwd-number"),
    pytest.param({**PRE, "hook_event_name": 1}, "hook_event_name must be a string", id="event-name-number"),
    pytest.param({**PRE, "tool_input": {"edits": [{"file_path": f"src/checkout/{i}"} for i in range(300)]}},
                 "names 300 paths", id="300-paths"),
]


@pytest.mark.parametrize(("event", "expected"), BAD_HOOKS)
async def test_malformed_hook_events_are_refused_naming_the_field(tmp_path: Path, event: Any, expected: str) -> None:
    async with running_daemon(tmp_path) as d:
        reply = json.loads(await raw(d.agent_path, hook_line(event)))
        # A hook before a tool answers in the agents' convention: exit 2 blocks, stderr says why.
        assert reply["ok"] and reply["exit"] == 2 and expected in reply["stderr"], reply
        assert "cannot be read" in reply["stderr"]
        after = json.loads(await raw(d.agent_path, hook_line({**event, "hook_event_name": "PostToolUse"})))
        assert after["ok"] and after["exit"] == 0, after  # after a tool, never a block: at most a warning
        # The next real violation through the same path: a hook check of an out-of-scope write.
        spill = json.loads(await raw(d.agent_path, hook_line({
            **PRE, "cwd": str(tmp_path / "ws"), "tool_input": {"file_path": "README.md", "content": "x"}})))
        assert spill["exit"] == 2 and "guard: refused" in spill["stderr"], spill
        assert state_of(d.breaker) is not State.CLOSED
        events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert any(e["op"] == "protocol" and expected in e.get("reason", "") for e in events)


async def test_a_hook_event_larger_than_64_kib_is_read(tmp_path: Path) -> None:
    """A Write's hook event carries the file's content: the line cap fits the helper's 4 MiB."""
    (tmp_path / "ws/src/checkout").mkdir(parents=True)
    async with running_daemon(tmp_path) as d:
        event = {**PRE, "tool_name": "Write", "cwd": str(tmp_path / "ws"),
                 "tool_input": {"file_path": "src/checkout/big.py", "content": "x = '[{'\n" * 200_000}}
        line = hook_line(event)
        assert 1 << 20 < len(line) < MAX_LINE
        reply = json.loads(await raw(d.agent_path, line))
        assert reply == {"v": 1, "ok": True, "exit": 0, "stderr": ""}


async def test_silent_connections_beyond_the_cap_close_the_longest_idle(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        silent = [await trio.open_unix_socket(str(d.agent_path)) for _ in range(MAX_CONNECTIONS + 20)]
        try:
            await good_client_works(d)  # never locked out
            with trio.fail_after(10):
                for stream in silent[:20]:  # the oldest ones made room
                    assert await stream.receive_some(10) == b""
            reply = json.loads(await raw(d.agent_path, b'{"type":"status"}\n'))
            counters = reply["connections"]["agent"]
            assert counters["open"] <= MAX_CONNECTIONS and counters["evicted"] >= 21, counters
        finally:
            for stream in silent:
                await stream.aclose()
        await trips_on_a_real_violation(d)


async def test_unfinished_lines_are_bounded_across_connections(tmp_path: Path) -> None:
    async with running_daemon(tmp_path) as d:
        chunk = b'{"type":"note","text":"' + b"x" * (MAX_LINE - 100)  # no newline: held by the daemon
        streams = []
        try:
            refused = None
            for _ in range(MAX_BUFFERED // len(chunk) + 2):
                stream = await trio.open_unix_socket(str(d.agent_path))
                streams.append(stream)
                with contextlib.suppress(trio.BrokenResourceError):  # refused mid-send: the reply is there
                    await stream.send_all(chunk)
                with trio.move_on_after(0.5):  # real time: an accepted one never answers
                    if data := await stream.receive_some(4096):
                        refused = json.loads(data)
                        break
            assert refused is not None and "unfinished lines" in refused["error"], refused
        finally:
            for stream in streams:
                await stream.aclose()
        await good_client_works(d)
        await trips_on_a_real_violation(d)


async def test_accept_survives_descriptor_exhaustion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors (EMFILE, for real: this process's table is filled), the accept loop
    pauses, a connection already served lives on, and once descriptors are back the client
    that waited in the backlog is served."""
    monkeypatch.setattr(daemon_module, "ACCEPT_PAUSE_S", 0.02)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with running_daemon(tmp_path) as d:
        served = await trio.open_unix_socket(str(d.agent_path))
        await served.send_all(b'{"type":"status"}\n')
        assert b'"ok":true' in await served.receive_some(1 << 20)
        book = d._sockets["agent"]
        filler: list[int] = []
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
        try:
            while (fd := _open_or_errno("/dev/null")) >= 0:
                filler.append(fd)
            assert -fd == errno.EMFILE
            os.close(filler.pop())  # one descriptor for the client; none left for the guard's accept
            waiting = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await waiting.connect(str(d.agent_path))  # queued in the backlog: needs nothing of the guard
            with trio.fail_after(10):
                while book.accept_errors == 0:
                    await trio.sleep(0.01)
            await served.send_all(b'{"type":"status"}\n')
            assert b'"ok":true' in await served.receive_some(1 << 20)
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with trio.fail_after(10):
            await waiting.send(b'{"type":"status"}\n')
            assert b'"ok":true' in await waiting.recv(1 << 20)
        waiting.close()
        await served.aclose()
        await good_client_works(d)
        await trips_on_a_real_violation(d)


def _open_or_errno(path: str) -> int:
    """A new descriptor, or minus the errno that refused it."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as err:
        return -(err.errno or 1)


WRONG_STREAM_LINES = {
    "claude-stream-json": [
        '{"type":"assistant","message":[1]}',
        '{"type":"assistant","message":{"id":"m","usage":{"input_tokens":"12"}}}',
        '{"type":"assistant","message":{"id":"m","usage":{"input_tokens":-5}}}',
        '{"type":"assistant","message":{"id":{"a":1},"usage":[],"content":"text"}}',
        '{"type":"stream_event","event":{"type":"message_delta","usage":{"output_tokens":{}}}}',
        '{"type":"result","usage":{"input_tokens":' + "9" * 5000 + "}}",
        '{"type":"result","num_turns":"x"}',
        '{"type":"user","message":{"content":[{"type":"tool_result","content":5}]}}',
        "[" * 50_000,
    ],
    "codex-json": [
        '{"type":"turn.completed","usage":{"input_tokens":"x"}}',
        '{"type":"turn.completed","usage":[1]}',
        '{"type":"item.completed","item":{"type":"command_execution","exit_code":"1"}}',
        '{"type":"item.completed","item":{"type":"command_execution","exit_code":1e300}}',
        '{"type":"item.started","item":5}',
    ],
    "gemini-stream-json": [
        '{"type":"result","stats":{"input_tokens":"x"}}',
        '{"type":"result","stats":[]}',
        '{"type":"tool_result","tool_id":{"a":1},"output":{"b":2},"error":"x"}',
        '{"type":"tool_use","tool_name":["a"],"parameters":5}',
    ],
    "aider-analytics": [
        '{"event":"message_send","properties":[1]}',
        '{"event":"message_send","properties":{"prompt_tokens":"12","completion_tokens":-5}}',
        '{"event":"message_send","properties":{"prompt_tokens":' + "9" * 5000 + "}}",
        '{"event":["message_send"]}',
        "[" * 50_000,
    ],
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_output_parsers_skip_fields_of_the_wrong_type(tmp_path: Path, fmt: str) -> None:
    """The agent's stdout is agent input too: guard run feeds it to the daemon in process."""
    async with running_daemon(tmp_path) as d:
        parser = make_parser(fmt)
        for line in WRONG_STREAM_LINES[fmt]:
            for event in parser.feed(line):
                from sandbox.agents import to_messages

                for message in to_messages(event):
                    d.feed(message)  # an error reply at worst
        parser.finish()
        await good_client_works(d)
        await trips_on_a_real_violation(d)


@pytest.mark.parametrize(("stdin", "expected"), [
    pytest.param(b"\xff\xfe{", "no valid JSON", id="not-utf8"),
    pytest.param(b"[" * 50_000, "nested 50000 levels deep", id="50000-brackets"),
    pytest.param(b'{"tool_input":{"x":' + b"9" * 5000 + b"}}", "5000 digits", id="5000-digits"),
    pytest.param(json.dumps({**PRE, "tool_input": {"edits": 5}}).encode(), "tool_input.edits", id="edits-5"),
    pytest.param(b"[1]", "must be a JSON object", id="array"),
])
@pytest.mark.parametrize("agent", ["claude", "codex", "gemini"])
def test_guard_hook_refuses_malformed_stdin_without_a_traceback(agent: str, stdin: bytes, expected: str) -> None:
    """``guard hook`` (no guard needed: the input is refused before anything is asked)."""
    proc = subprocess.run([sys.executable, "-m", "sandbox", "hook", agent], input=stdin, capture_output=True,
                          env={**os.environ, "GUARD_SOCKET": "/nonexistent/agent.sock"}, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and expected in err and "Traceback" not in err, err


CRASHES_FROM_INSIDE = """
    import json, os, resource, socket, sys
    path = os.environ["GUARD_SOCKET"]
    from sandbox.agents.fasthook import connect_unix
    def ask(payload):
        with connect_unix(path, 30) as s:  # waits for room in a full backlog
            s.sendall(payload)
            return json.loads(s.makefile("rb").readline())
    out = {}
    out["brackets"] = ask(b"[" * 50000 + b"\\n")
    out["digits"] = ask(b'{"type":"step","tokens_in":' + b"9" * 5000 + b"}\\n")
    out["hook"] = ask(json.dumps({"type": "hook", "agent": "claude", "event": {
        "hook_event_name": "PreToolUse", "tool_name": "Edit", "cwd": os.getcwd(),
        "tool_input": {"edits": 5}}}).encode() + b"\\n")
    # ~20,000 connections held open at once: as many as the agent's own limit allows, which is
    # the guard's limit too (the two are the same here), so they would exhaust the guard uncapped.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = min(hard, 20100) - 100
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, hard))
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        held.append(s)
    out["status"] = ask(b'{"type":"status"}\\n')
    for s in held:
        s.close()
    out["held"] = {"ok": True, "exit": n}
    print(json.dumps({k: {"ok": v["ok"], "error": v.get("error"), "exit": v.get("exit"),
                          "stderr": v.get("stderr"), "connections": v.get("connections")}
                      for k, v in out.items()}), flush=True)
    print("trip:", json.dumps(ask(b'{"type":"step","tokens_in":40000}\\n')), flush=True)  # recoverable
    ask(b'{"type":"step","tokens_in":40000}\\n')  # terminal: the guard stops the agent here (--ci)
    print("ran on after the trip", flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
def test_crash_inputs_from_inside_a_real_guard_run(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    manifest.write_text(manifest.read_text() + "\n[limits]\nmax_window_tokens = 30000\n")
    run_dir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--", sys.executable, "-c", textwrap.dedent(CRASHES_FROM_INSIDE)],
        cwd=ws, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    log = (run_dir / "stdout.log").read_text()
    assert run.returncode == 75, (run.stderr, log[-2000:])  # tripped, not 70 (internal error)
    results = json.loads(log.splitlines()[0])
    assert not results["brackets"]["ok"] and "nested 50000 levels deep" in results["brackets"]["error"]
    assert not results["digits"]["ok"] and "5000 digits" in results["digits"]["error"]
    assert results["hook"]["exit"] == 2 and "tool_input.edits" in results["hook"]["stderr"]
    counters = results["status"]["connections"]["agent"]
    held = results["held"]["exit"]
    assert held >= min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 20_100) - 100
    assert results["status"]["ok"] and counters["evicted"] >= held - MAX_CONNECTIONS, counters
    assert '"rule": "token_surge"' in log and "ran on" not in log
    assert "OPEN_TOKEN_SURGE" in run.stderr and "Traceback" not in run.stderr
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["state"] == "OPEN_TOKEN_SURGE"  # the ledger write never ran out of descriptors
