"""The compiled hook helper and the Python hook answer alike, for every input (issue 21, item 9).

The same stdin goes to both as an agent runs them (the helper ``guard_hook.c`` compiled as
``guard run`` compiles it; ``python3 -S -E fasthook.py AGENT``), each against its own real breaker
daemon on a real Unix socket, the two daemons fed the same calls in the same order: the exit
status (the decision) and the words on stderr (what the agent shows the model) must be the same,
and the decision the one expected. Then the guard that is not there, or that breaks mid-reply,
or answers something that is not JSON (a fake server on a real socket); then random bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import FIX_TAX, breaker_daemon, reports

ROOT = Path(__file__).resolve().parents[1]

MANIFEST = FIX_TAX + """
[limits]
max_files = 50
idle_timeout_s = 3600
"""

@dataclass
class Hooks:
    """The two hooks of one agent, their two daemons, and the workspace both events name."""

    helper: Path
    ws: Path
    sockets: tuple[str, str]  # the helper's daemon, the Python hook's

    def compiled(self, stdin: bytes, agent: str = "claude", sock: str | None = None) -> tuple[int, str]:
        return _run([str(self.helper), agent], stdin, self.sockets[0] if sock is None else sock)

    def python(self, stdin: bytes, agent: str = "claude", sock: str | None = None) -> tuple[int, str]:
        return _run([sys.executable, "-S", "-E", str(ROOT / "sandbox/agents/fasthook.py"), agent], stdin,
                    self.sockets[1] if sock is None else sock)

    def both(self, stdin: bytes, agent: str = "claude", sock: str | None = None) -> tuple[int, str]:
        """The one answer of both hooks (asserted the same)."""
        c, py = self.compiled(stdin, agent, sock), self.python(stdin, agent, sock)
        assert c == py, (stdin[:200], c, py)
        return c


def _run(argv: list[str], stdin: bytes, sock: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "GUARD_SOCKET"}
    proc = subprocess.run(argv, input=stdin, capture_output=True, env={**env, "GUARD_SOCKET": sock} if sock else env,
                          timeout=60, check=False)
    err = proc.stderr.decode("utf-8", "backslashreplace")
    assert "Traceback" not in err, err
    return proc.returncode, err


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled helper, built as guard run builds it (in a cache of this test's own)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler (cc, gcc): guard run gives the agents the Python hook alone")
    cache = tmp_path_factory.mktemp("cache")
    built = subprocess.run([sys.executable, "-c", "from sandbox.agents.hooks import compiled_helper as c; "
                            "print(c() or '')"], env={**os.environ, "XDG_CACHE_HOME": str(cache)},
                           capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    assert built.stdout.strip(), f"the hook helper did not build: {built.stderr}"
    return Path(built.stdout.strip())


@pytest.fixture
def hooks(helper: Path) -> Iterator[Hooks]:
    """Two daemons of the same manifest on the same workspace (a short path: sun_path holds 108 bytes)."""
    base = Path(tempfile.mkdtemp(prefix="hp-"))
    ws = base / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    try:
        with breaker_daemon(base / "c", ws, MANIFEST) as c, breaker_daemon(base / "py", ws, MANIFEST) as py:
            yield Hooks(helper, ws, (str(c / "agent.sock"), str(py / "agent.sock")))
    finally:
        shutil.rmtree(base)


def event(ws: Path, name: str = "PreToolUse", tool: object = "Read", **tool_input: object) -> dict[str, object]:
    return {"hook_event_name": name, "tool_name": tool, "cwd": str(ws), "tool_input": tool_input}


def _b(doc: object) -> bytes:
    return json.dumps(doc).encode()


def _nested(ws: Path, depth: int) -> bytes:
    """A Read whose tool_input holds *depth* nested arrays: 2 + *depth* levels in all."""
    head = _b(event(ws, path="src/checkout/a.py"))[:-2]  # without the closing "}}"
    return head + b', "x": ' + b"[" * depth + b"]" * depth + b"}}"


def table(ws: Path) -> list[tuple[str, bytes, int]]:
    """(what, stdin, the expected exit status), in the order fed to both daemons."""
    read = event(ws, path="src/checkout/a.py")
    write = event(ws, tool="Write", file_path="src/checkout/a.py", content="x = 1\n")
    pretty = json.dumps(read, indent=2).encode()
    assert b"\n" in pretty
    return [
        ("mutating, in scope", _b(write), 0),
        ("non-mutating", _b(read), 0),
        ("after a tool", _b({**event(ws, "PostToolUse", "Bash", command="pytest"), "tool_response": {"exit_code": 1}}),
         0),
        ("newlines between tokens", pretty, 0),
        ("nested 64 levels: the bound, and one level over it once framed", _nested(ws, 62), 0),
        ("nested 65 levels", _nested(ws, 63), 2),
        ("nested over 64", _nested(ws, 70), 2),
        ("invalid UTF-8", _b(read).replace(b"a.py", b"a\xff.py"), 2),
        ("over 4 MiB", _b({**read, "pad": "x" * (4 << 20)}), 2),
        ("a raw newline inside a string", _b(read).replace(b"a.py", b"a\n.py"), 2),
        ("malformed JSON", _b(read)[:-3], 2),
        ("trailing garbage", _b(read) + b"}", 2),
        ("empty", b"", 2),
        ("white space", b" \n\t ", 2),
        ("not an object", b"[1]", 2),
        ("a string", b'"PreToolUse"', 2),
        ("tool_name of the wrong type", _b(event(ws, tool=["Read"])), 2),
        ("tool_input of the wrong type", _b({**read, "tool_input": "x"}), 2),
        ("a path of the wrong type", _b(event(ws, file_path=7)), 2),
        ("wrong types after a tool", _b(event(ws, "PostToolUse", tool=5)), 0),
        ("a lone surrogate the guard refuses", _b(event(ws, command="\ud800")), 2),
        ("an integer of 30 digits", _b(read)[:-1] + b', "n": ' + b"9" * 30 + b"}", 2),
        ("a forbidden read", _b(event(ws, path=".env")), 2),
        ("mutating, out of scope: trips", _b(event(ws, tool="Write", file_path="README.md", content="x")), 2),
        ("non-mutating, tripped", _b(event(ws, tool="Read", path="src/checkout/b.py")), 2),
        ("mutating, tripped, out of scope again", _b(event(ws, tool="Edit", file_path="setup.py")), 2),
        ("mutating after the terminal trip", _b(write), 2),
        ("non-mutating after the terminal trip", _b(read), 2),
    ]


def test_the_helper_and_the_python_hook_answer_alike(hooks: Hooks) -> None:
    seen = {}
    for what, stdin, expected in table(hooks.ws):
        code, err = hooks.both(stdin)
        assert code == expected, (what, code, err)
        seen[what] = err
    assert "writes stay blocked" not in seen["nested over 64"]  # refused as unreadable, not as unreachable
    assert "hook input of" in seen["over 4 MiB"] and "no valid JSON" in seen["invalid UTF-8"]
    assert "the guard refused the request" in seen["a lone surrogate the guard refuses"]
    assert "Invalid control character" in seen["a raw newline inside a string"]
    assert seen["mutating, in scope"] == "" and seen["non-mutating"] == ""


def test_an_unknown_agent_and_an_agent_of_the_table(hooks: Hooks) -> None:
    write = _b(event(hooks.ws, tool="Write", file_path="src/checkout/a.py", content="x"))
    assert hooks.both(write, agent="mentat")[0] == 0  # the daemon refuses the name; the Python hook judges it
    gemini = _b(event(hooks.ws, "BeforeTool", "write_file", file_path="src/checkout/a.py", content="x"))
    assert hooks.both(gemini, agent="gemini") == (0, "")
    codex = _b(event(hooks.ws, tool="apply_patch",
                     command="*** Begin Patch\n*** Update File: README.md\n@@\n-a\n+b\n*** End Patch\n"))
    code, err = hooks.both(codex, agent="codex")
    assert code == 2 and "README.md" in err


# ----- a guard that is not there, or that answers badly ---------------------------------------

#: What a fake guard sends back to each request it reads.
BROKEN: dict[str, bytes] = {
    "closes without replying": b"",
    "closes mid-reply": b'{"v":1,"ok":true,"exit":0,"std',
    "replies with what is not JSON": b"hello\n",
    "replies with JSON of another shape": b'{"v":1,"ok":true}\n',
    "refuses everything": b'{"v":1,"ok":false,"error":"no"}\n',
}


@contextmanager
def fake_guard(sock: str, answer: bytes | None) -> Iterator[None]:
    """A server on a real Unix socket that reads one request line and sends *answer*, then closes
    (None: it says nothing until the client closes)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock)
    server.listen(16)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                buf = b""
                while b"\n" not in buf and (data := conn.recv(1 << 20)):
                    buf += data
                if answer is not None:
                    conn.sendall(answer)
                else:  # silent: holds the connection until the client gives up
                    while conn.recv(1 << 20):
                        pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=10)
        assert not thread.is_alive()


def _calls(ws: Path) -> list[tuple[str, bytes]]:
    return [
        ("mutating", _b(event(ws, tool="Write", file_path="src/checkout/a.py", content="x"))),
        ("non-mutating", _b(event(ws, path="src/checkout/a.py"))),
        ("after a tool", _b(event(ws, "PostToolUse", "Write", file_path="src/checkout/a.py"))),
        ("unreadable", b'{"tool_name": "Read"'),
        ("nested over 64", _nested(ws, 70)),
    ]


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_guard_that_answers_badly_is_answered_alike(helper: Path, broken: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="hp-"))
    sock = str(base / "agent.sock")
    try:
        with fake_guard(sock, BROKEN[broken]):
            hooks = Hooks(helper, base, (sock, sock))
            answers = {what: hooks.both(stdin) for what, stdin in _calls(base)}
    finally:
        shutil.rmtree(base)
    refused = broken == "refuses everything"
    assert answers["mutating"][0] == 2 and answers["unreadable"][0] == 2 and answers["nested over 64"][0] == 2
    assert answers["non-mutating"][0] == (2 if refused else 0), answers  # read and refused: fail closed
    assert answers["after a tool"][0] == 0
    if not refused:
        assert "writes stay blocked" in answers["mutating"][1], answers


def test_a_silent_guard_is_answered_alike_once_the_hooks_give_up(helper: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="hp-"))
    sock = str(base / "agent.sock")
    try:
        with fake_guard(sock, None):
            hooks = Hooks(helper, base, (sock, sock))
            code, err = hooks.both(_calls(base)[1][1])  # non-mutating: goes ahead, with the reason
    finally:
        shutil.rmtree(base)
    assert code == 0 and err == f"guard hook: cannot reach the guard at {sock}: timed out\n"


def test_no_guard_at_all_is_answered_alike(helper: Path, tmp_path: Path) -> None:
    hooks = Hooks(helper, tmp_path, (str(tmp_path / "none.sock"), str(tmp_path / "none.sock")))
    answers = {what: hooks.both(stdin) for what, stdin in _calls(tmp_path)}
    assert [answers[w][0] for w in ("mutating", "non-mutating", "after a tool", "unreadable")] == [2, 0, 0, 2]
    assert "No such file or directory" in answers["non-mutating"][1]
    unset = hooks.both(_calls(tmp_path)[0][1], sock="")
    assert unset[0] == 2 and "GUARD_SOCKET is not set" in unset[1]


# ----- random input --------------------------------------------------------------------------

_keys = st.sampled_from(["file_path", "path", "command", "edits", "content", "x", "patch"])
_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20),
                                 st.sampled_from(["src/checkout/a.py", ".env", "README.md", "\ud800"])),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
                       max_leaves=8)
_names = st.sampled_from(["PreToolUse", "PostToolUse", "BeforeTool", "AfterTool", "Other", 3])
_tools = st.sampled_from(["Read", "Write", "Edit", "Bash", "apply_patch", "write_file", "read_file", [1], None])


@st.composite
def stdins(draw: st.DrawFn, ws: str) -> bytes:
    """Hook events as agents send them, some cut, spliced, re-indented or with bytes changed; and bare bytes."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200))
    doc = {"hook_event_name": draw(_names), "tool_name": draw(_tools), "cwd": ws,
           "tool_input": draw(st.dictionaries(_keys, _values, max_size=4))}
    text = json.dumps(doc, indent=draw(st.sampled_from([None, 1]))).encode()
    match draw(st.integers(0, 3)):
        case 0:
            return text
        case 1:
            return text[: draw(st.integers(0, len(text)))]
        case 2:
            at = draw(st.integers(0, len(text)))
            return text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at:]
        case _:
            at = draw(st.integers(0, len(text) - 1))
            return text[:at] + bytes([draw(st.integers(0, 255))]) + text[at + 1:]


@pytest.mark.slow
def test_random_input_is_answered_alike(hooks: Hooks) -> None:
    @settings(max_examples=150, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["claude", "codex", "gemini"]), stdins(str(hooks.ws)))
    def alike(agent: str, stdin: bytes) -> None:
        hooks.both(stdin, agent)

    alike()


# ----- inside a real guard run ----------------------------------------------------------------

#: An agent named claude that runs the hook command guard run gave it (the compiled helper, as root)
#: on hook events the helper settles and on ones it hands to the Python hook, inside the sandbox.
FAKE_CLAUDE = r"""#!/usr/bin/python3
import json, os, subprocess, sys
hook = json.loads(sys.argv[sys.argv.index("--settings") + 1])["hooks"]["PreToolUse"][0]["hooks"][0]["command"]
def event(tool, **tool_input):
    return {"hook_event_name": "PreToolUse", "tool_name": tool, "cwd": os.getcwd(), "tool_input": tool_input}
calls = {
    "read": json.dumps(event("Read", file_path="src/checkout/tax.py")),
    "nested read": json.dumps(event("Read", path="src/checkout/tax.py", x=[[]])).replace("[[]]", "[" * 70 + "]" * 70),
    "pretty read": json.dumps(event("Read", file_path="src/checkout/b.py"), indent=2),
    "raw newline read": json.dumps(event("Read", file_path="src/checkout/tax.py")).replace("tax.py", "tax\n.py"),
    "write in scope": json.dumps(event("Write", file_path="src/checkout/tax.py", content="x = 1\n")),
}
out = {}
for what, stdin in calls.items():
    proc = subprocess.run(hook, shell=True, input=stdin.encode(), capture_output=True)
    out[what] = [proc.returncode, proc.stderr.decode(errors="replace")]
print(json.dumps({"hook": hook, "answers": out}), flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", [None, "nobody"])
def test_the_hook_answers_inside_the_sandbox(tmp_path: Path, user: str | None, request: pytest.FixtureRequest) -> None:
    """As root: the compiled helper, handing over to the Python hook in the sandbox. As another user:
    the Python hook (the helper is in root's cache), run by an interpreter that user reaches."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "bin").mkdir()
    fake = ws / "bin/claude"
    fake.write_text(FAKE_CLAUDE)
    fake.chmod(0o755)
    (tmp_path / "m.toml").write_text(FIX_TAX)
    run_dir = tmp_path / "run"
    flags, env = [], dict(os.environ)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        flags = ["--user", user]
        env["PYTHONPATH"] = request.getfixturevalue("installation")  # a guard that user can read (CI's is in /root)
    proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest",
                           str(tmp_path / "m.toml"), "--run-dir", str(run_dir), "--", str(fake)], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = next(r for r in reports(run_dir / "stdout.log") if "answers" in r)
    assert ("guard-hook-" in seen["hook"]) == (user is None), seen["hook"]  # the compiled helper as root
    if user is not None:
        assert seen["hook"].startswith("/usr/bin/python3 -S -E ") and env["PYTHONPATH"] in seen["hook"], seen["hook"]
    answers = seen["answers"]
    assert answers["read"] == [0, ""] and answers["pretty read"] == [0, ""], answers
    assert answers["write in scope"] == [0, ""], answers
    # handed to the Python hook, which ran in the sandbox and refused them in its own words
    assert answers["nested read"][0] == 2 and "nested 72 levels deep" in answers["nested read"][1], answers
    assert answers["raw newline read"][0] == 2 and "Invalid control character" in answers["raw newline read"][1]


def test_the_helper_refuses_what_it_cannot_settle_when_python_cannot_start(helper: Path, tmp_path: Path) -> None:
    from sandbox.agents.hooks import helper_defines

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None  # the helper fixture built one
    defines = [d if not d.startswith("-DGUARD_PYTHON=") else f'-DGUARD_PYTHON="{tmp_path}/no-python"'
               for d in helper_defines()]
    lone = tmp_path / "guard-hook"
    subprocess.run([cc, "-O2", *defines, "-o", str(lone), str(ROOT / "sandbox/agents/guard_hook.c")], check=True,
                   capture_output=True, timeout=120)
    hooks = Hooks(lone, tmp_path, (str(tmp_path / "none.sock"),) * 2)
    for what, stdin in _calls(tmp_path):
        code, err = hooks.compiled(stdin)
        assert code == 2 and "cannot be started here (No such file or directory)" in err, (what, code, err)
