"""Property tests of every boundary the agent reaches, against one real guarded mount and its
daemon: the agent and control sockets (random bytes, malformed and deep JSON, huge numbers,
every field of every message with values of every type), hook stdin for each agent, and file
names (any bytes, UTF-8 or not) created, renamed and read through the mount.

Fixed seed (``derandomize``), no example database (nothing written to the repository). The
property each time: an answer (a reply, an exit status, an errno), never a dead guard; and at
the end, a normal ``step`` over the token limit still trips the breaker.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox.agents.fasthook import MUTATING_TOOLS, connect_unix, run_hook
from sandbox.breaker import State

from .helpers import state_of
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


MANIFEST = """
[task]
id = "fuzz"
goal = "Fuzz the guard's boundaries"
[paths]
allowed = ["src/checkout/"]
forbidden = [".env*"]
[limits]
max_files = "unlimited"
max_rewrites = "unlimited"
max_window_tokens = 30000
"""


def fuzz(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings for these tests: fixed seed, no database, no per-example deadline."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


# ----- values of every JSON type, the awkward ones over-represented ---------------------------

_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # lone surrogates included
_names = st.sampled_from(["", "a", "x" * 300, "src/checkout/a.py", "../../etc/passwd", "/etc/shadow", ".env",
                          "\udcff", "\ud800", "\x00", "hello", "step", "Write", "Edit"])
_ints = st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.sampled_from([100_000_001, 10**15, -1]))
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False, allow_infinity=False), _text,
                     _names)
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(_text, inner, max_size=4)), max_leaves=12)

_FIELDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "hello": {"agent": _names},
    "step": {"tokens_in": _ints, "tokens_out": _ints, "tokens_cached": _ints, "tool": _names, "args": _json},
    "tool_result": {"tool": _names, "exit_code": _ints, "summary": _text},
    "check": {"tool": _names, "paths": st.lists(_names, max_size=4), "args": _json, "mutating": st.booleans()},
    "note": {"kind": st.sampled_from(["note", "disproved", "subtask", "other"]), "text": _text},
    "status": {},
    "hook": {"agent": st.sampled_from(["claude", "codex", "gemini", "other"]), "event": _json},
    "approve": {"raise_to": _ints},
    "checkpoint": {"label": _text},
    "rollback": {},
}


@st.composite
def messages(draw: st.DrawFn, types: list[str]) -> dict[str, Any]:
    """A message of one of *types*: each field absent, plausible, or of any JSON type."""
    kind = draw(st.sampled_from(types))
    msg: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        msg["v"] = draw(st.one_of(st.just(1), _json))
    for name, plausible in _FIELDS[kind].items():
        choice = draw(st.integers(0, 2))
        if choice:
            msg[name] = draw(plausible if choice == 1 else _json)
    if draw(st.integers(0, 9)) == 0:
        msg[draw(_text)] = draw(_json)  # an unknown field
    return msg


def _encode(doc: Any) -> bytes:
    # Lone surrogates travel as \\udXXX escapes, as a JSON writer in any language would send them.
    return json.dumps(doc, allow_nan=False).encode()


def ask(path: Path, line: bytes) -> dict[str, Any]:
    """One request line on a fresh connection; the reply, which must be a JSON object with 'ok'."""
    with connect_unix(str(path), 30) as sock:
        sock.sendall(line.replace(b"\n", b" ") + b"\n")
        reply = sock.makefile("rb").readline()
    assert reply, f"no reply to {line[:200]!r}"
    doc: dict[str, Any] = json.loads(reply)
    assert isinstance(doc.get("ok"), bool), doc
    return doc


def serving(g: Guarded) -> None:
    """The guard still serves both sockets and the mount."""
    assert g.daemon is not None
    assert ask(g.daemon.agent_path, b'{"type":"status"}')["ok"]
    assert ask(g.daemon.control_path, b'{"type":"status"}')["ok"]
    assert os.path.ismount(g.mnt) and os.listdir(g.mnt / "src/checkout") is not None


def fuzz_agent_socket(g: Guarded) -> None:
    assert g.daemon is not None
    agent, control = g.daemon.agent_path, g.daemon.control_path

    @fuzz(800)
    @given(st.binary(min_size=1, max_size=300))
    def random_bytes(line: bytes) -> None:
        if line.replace(b"\n", b" ").strip():
            ask(agent, line)

    @fuzz(2500)
    @given(messages(["hello", "step", "tool_result", "check", "note", "status", "hook"]))
    def agent_messages(msg: dict[str, Any]) -> None:
        ask(agent, _encode(msg))

    # Control: everything but a valid stop, which ends the run (as it should).
    @fuzz(600)
    @given(messages(["status", "approve", "checkpoint", "rollback", "hello", "step"]))
    def control_messages(msg: dict[str, Any]) -> None:
        ask(control, _encode(msg))

    @fuzz(150)
    @given(st.integers(1, 200_000), st.sampled_from([b"[", b"{", b'{"a":', b'[{"b":']),
           st.sampled_from([agent, control]))
    def deep(depth: int, opener: bytes, path: Path) -> None:
        reply = ask(path, opener * depth)
        assert not reply["ok"]

    @fuzz(300)
    @given(st.text("0123456789", min_size=1, max_size=6000), st.sampled_from(
        ["tokens_in", "tokens_out", "tokens_cached", "v", "exit_code", "args", "raise_to"]),
        st.sampled_from([agent, control]), st.booleans())
    def huge_numbers(digits: str, field: str, path: Path, negative: bool) -> None:
        kind = "approve" if field == "raise_to" else "tool_result" if field == "exit_code" else "step"
        number = ("-" if negative else "") + digits
        reply = ask(path, f'{{"type":"{kind}","tool":"t","{field}":{number}}}'.encode())
        if len(digits) > 20:
            assert not reply["ok"] and "digits" in reply["error"], reply

    random_bytes()
    agent_messages()
    control_messages()
    deep()
    huge_numbers()
    serving(g)


_HOOK_NAMES = st.sampled_from(["PreToolUse", "PostToolUse", "BeforeTool", "AfterTool", "Notification", ""])
_TOOLS = st.sampled_from(sorted(MUTATING_TOOLS | {"Read", "Glob", "mcp__x__y"}))
_PATH_VALUES = st.one_of(_names, st.sampled_from(["src/checkout/tax.py", "README.md"]))


@st.composite
def hook_events(draw: st.DrawFn) -> Any:
    """A hook event of the agents' shape, with any field possibly of the wrong type (or not an object)."""
    if draw(st.integers(0, 19)) == 0:
        return draw(_json)

    def field(plausible: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(plausible, _json) if draw(st.integers(0, 3)) == 0 else plausible)

    tool_input: dict[str, Any] = {}
    for key in ("file_path", "path", "notebook_path", "absolute_path"):
        if draw(st.integers(0, 3)) == 0:
            tool_input[key] = field(_PATH_VALUES)
    if draw(st.booleans()):
        tool_input["command"] = field(_text)
    if draw(st.integers(0, 3)) == 0:
        tool_input["edits"] = field(st.lists(st.fixed_dictionaries({"file_path": _PATH_VALUES}), max_size=3))
    if draw(st.integers(0, 4)) == 0:
        tool_input[draw(st.sampled_from(["input", "patch"]))] = field(st.builds(
            lambda p: f"*** Begin Patch\n*** Update File: {p}\n@@\n-a\n+b\n*** End Patch\n", _PATH_VALUES))
    event: dict[str, Any] = {"hook_event_name": field(_HOOK_NAMES), "tool_name": field(_TOOLS),
                             "tool_input": field(st.just(tool_input)), "cwd": field(st.just("/ws"))}
    if draw(st.booleans()):
        event["tool_response"] = field(st.fixed_dictionaries({"exit_code": _ints}))
    return event


def fuzz_hooks(g: Guarded, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert g.daemon is not None
    agent = g.daemon.agent_path
    monkeypatch.setenv("GUARD_SOCKET", str(agent))
    ws = str(g.mnt)

    def where(event: Any) -> Any:
        if isinstance(event, dict) and event.get("cwd") == "/ws":
            event["cwd"] = ws
        return event

    # What the compiled helper forwards: the event whole, in a hook message.
    @fuzz(1500)
    @given(st.sampled_from(["claude", "codex", "gemini"]), hook_events())
    def hook_messages(agent_name: str, event: Any) -> None:
        reply = ask(agent, _encode({"type": "hook", "agent": agent_name, "event": where(event)}))
        assert not reply["ok"] or reply["exit"] in (0, 2), reply

    # guard hook AGENT: the same function `guard hook` and fasthook.py run, on the stdin bytes.
    @fuzz(1500)
    @given(st.sampled_from(["claude", "codex", "gemini"]), st.one_of(
        hook_events().map(lambda e: _encode(where(e))), st.binary(max_size=200),
        st.integers(1, 100_000).map(lambda n: b"[" * n)))
    def hook_stdin(agent_name: str, stdin: bytes) -> None:
        assert run_hook(agent_name, stdin) in (0, 2)
        assert "Traceback" not in capsys.readouterr().err

    hook_messages()
    hook_stdin()
    serving(g)


# Any byte but '/' and NUL; the names '.' and '..' are not files.
_NAME_BYTES = st.binary(min_size=1, max_size=64).map(lambda b: b.replace(b"/", b"_").replace(b"\0", b"_")).filter(
    lambda b: b not in (b".", b".."))


def fuzz_file_names(g: Guarded) -> None:
    base = os.fsencode(g.mnt / "src/checkout")
    backing = os.fsencode(g.backing / "src/checkout")

    nonce = iter(range(1_000_000))

    @fuzz(400)
    @given(_NAME_BYTES, _NAME_BYTES, st.binary(max_size=64))
    def names(first: bytes, second: bytes, content: bytes) -> None:
        # Each example its own names: a name made and removed again and again is the oscillation
        # the breaker is there to stop, not what this test is about.
        n = next(nonce)
        first, second = b"%d-%s" % (n, first), b"%d+%s" % (n, second)
        a, b = os.path.join(base, first), os.path.join(base, second)
        with open(a, "wb") as f:
            f.write(content)
        with open(a, "rb") as f:
            assert f.read() == content
        assert first in os.listdir(base)
        os.rename(a, b)
        with open(b, "rb") as f:
            assert f.read() == content
        with open(os.path.join(backing, second), "rb") as f:  # landed byte for byte, under its own name
            assert f.read() == content
        os.unlink(b)
        assert not os.path.lexists(b)

    @fuzz(100)
    @given(_NAME_BYTES)
    def out_of_scope(name: bytes) -> None:
        with pytest.raises(OSError) as refused:
            open(os.path.join(os.fsencode(g.mnt), b"%d-%s" % (next(nonce), name)), "wb").close()
        assert refused.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)

    names()
    out_of_scope()
    serving(g)


def approve_then_trip(g: Guarded) -> None:
    """An operator resumes the breaker, and a normal step over the token limit trips it."""
    assert g.daemon is not None
    for _ in range(5):  # a trip awaiting approval, then perhaps a recoverable one
        if state_of(g.daemon.breaker) is State.CLOSED:
            break
        ask(g.daemon.control_path, b'{"type":"approve"}')
    assert state_of(g.daemon.breaker) is State.CLOSED
    reply = ask(g.daemon.agent_path, b'{"type":"step","tokens_in":40000}')
    assert reply["ok"] and not reply["allow"] and reply["trip"]["rule"] == "token_surge", reply
    assert state_of(g.daemon.breaker) is not State.CLOSED
    serving(g)


def _workspace(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    (tmp_path / "backing/src/checkout/tax.py").write_text("x = 1\n")


@pytest.mark.slow
def test_fuzz_sockets_and_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=tmp_path / "run") as g:
        fuzz_hooks(g, monkeypatch, capsys)
        fuzz_agent_socket(g)
        approve_then_trip(g)


def test_fuzz_file_names_through_the_mount(tmp_path: Path) -> None:
    _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=tmp_path / "run") as g:
        fuzz_file_names(g)
        approve_then_trip(g)
