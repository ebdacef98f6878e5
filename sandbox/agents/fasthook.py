"""The hook an agent runs before and after each tool, fast: standard library only.

Agents start it as a new process for every tool call, so it is run as
``python3 -S -E fasthook.py AGENT`` (no site packages, no environment-driven start-up):
it starts in a few milliseconds. ``guard hook AGENT`` runs the same code.

It reads the hook's JSON on stdin, asks the agent socket (``check`` before a tool,
``tool_result`` after it) and answers in the agent's blocking convention: exit 2 with the
reason on stderr blocks the tool, and that text reaches the model as the tool's error — the
breaker's corrective feedback. If the guard cannot be reached, mutating tools are refused
(fail closed) and read-only ones go ahead; input the hook cannot read, or a call the guard
refuses to judge, is refused whatever the tool. The compiled helper (``guard_hook.c``) answers
the same, by construction: what it cannot settle itself it hands to this file. What differs
between agents (event names, blocking status, which tools write) comes from the agents' table,
:mod:`sandbox.agents.registry`.

It also holds what every client of the guard's sockets shares and this file needs: the protocol
:data:`VERSION`, :class:`GuardUnreachable` (and its base :class:`GuardClientError`), and
:func:`connect_unix`.

Every JSON text the agent's side sends is read with :func:`loads_bounded` (here, so that this
file stays standard library only; the daemon's protocol uses it too): nesting depth and number
sizes are checked before the parser can recurse or convert, and a hook field of the wrong type
is a :class:`HookPayloadError` naming it, never an exception from deep inside.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import struct
import sys
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING or __package__:
    from sandbox.agents.registry import AGENTS
else:  # python3 -S -E fasthook.py: the package cannot be imported, but its folder is sys.path[0]
    from registry import AGENTS

__all__ = [
    "BLOCK", "MAX_INT_DIGITS", "MAX_JSON_CONTAINERS", "MAX_JSON_DEPTH", "MUTATING_TOOLS", "VERSION",
    "GuardClientError", "GuardUnreachable", "HookPayloadError", "JsonBoundsError", "connect_unix", "decide",
    "loads_bounded", "main", "refuse_malformed", "run_hook",
]

#: The socket protocol's version, the ``v`` of every message (sandbox.breaker.protocol checks it; the
#: compiled hook helper is built with it).
VERSION: Final = 1

#: The deepest nesting of arrays and objects accepted in one JSON text (tool arguments nest a few levels).
MAX_JSON_DEPTH = 64
#: The most arrays and objects in one JSON text (a tool call's arguments hold a few dozen).
MAX_JSON_CONTAINERS = 50_000
#: The most digits an integer may have (a 64-bit count has 20 at most).
MAX_INT_DIGITS = 20
#: The most hook JSON read from stdin, as the compiled helper reads.
MAX_HOOK_INPUT = 4 << 20

#: Tools that write, in any agent's naming (a name that writes for one agent is refused for all
#: when the guard cannot be reached: fail closed).
MUTATING_TOOLS: frozenset[str] = frozenset().union(*(agent.mutating_tools for agent in AGENTS.values()))
#: The hook event names before and after a tool, in any agent's convention.
_PRE = frozenset(agent.hook.before for agent in AGENTS.values() if agent.hook is not None)
_POST = frozenset(agent.hook.after for agent in AGENTS.values() if agent.hook is not None)
#: The exit status that blocks a tool for an agent not in the table.
BLOCK = 2
_PATH_KEYS = ("file_path", "notebook_path", "path", "absolute_path")
#: The files an apply_patch patch writes: added, updated, deleted, and the target of a move.
_PATCH_FILE = re.compile(r"^\*\*\* (?:Add File|Update File|Delete File|Move to): (.+)$", re.MULTILINE)
#: The tool output's exit status, as Codex words it in a PostToolUse ``tool_response`` string.
_EXIT_TEXT = re.compile(r"^(?:Exit code: |Process exited with code )(-?\d{1,3})$", re.MULTILINE)
#: Gemini's run_shell_command result (AfterTool's tool_response.llmContent): the command's output,
#: then "Exit Code: N" (only when not 0) and a few lines of its own at the very end. Anchored at the
#: end, so that the command's output cannot hide a real non-zero code. Gemini may wrap it all in
#: <untrusted_context> tags.
_GEMINI_WRAP = re.compile(r"\A<untrusted_context>\n(.*)\n</untrusted_context>\Z", re.DOTALL)
_GEMINI_EXIT = re.compile(r"\nExit Code: (-?\d{1,5})((?:\n(?:Signal|Background PIDs|Process Group PGID): [^\n]*)*)\Z")
_GEMINI_SIGNAL = re.compile(r"\nSignal: [^\n]*(?:\n(?:Background PIDs|Process Group PGID): [^\n]*)*\Z")


class GuardClientError(Exception):
    """The guard could not be reached, or refused a request as malformed. (Defined here, not
    under guardfs.errors.GuardError, because the hook runs as a bare script with the standard
    library only; ``exit_code`` follows the same convention, and guard's CLI maps both.)"""

    exit_code = 65  # a rejected message (EX_DATAERR); GuardUnreachable says 69


class GuardUnreachable(GuardClientError):
    """The guard gave no usable answer: nothing listens at GUARD_SOCKET, the connection broke,
    or the reply could not be read. The hook refuses a mutating tool then (fail closed) and lets
    a read-only one go ahead (the mount still judges what it reads); a request the guard read
    and refused (a plain GuardClientError) refuses any tool."""

    exit_code = 69  # EX_UNAVAILABLE


def _block(agent: str | None) -> int:
    known = AGENTS.get(agent or "")
    return known.hook.block_status if known is not None and known.hook is not None else BLOCK


class JsonBoundsError(ValueError):
    """A JSON text beyond the bounds (depth, number size) the guard reads; the text says which."""


class HookPayloadError(ValueError):
    """A hook event with a field of the wrong type; the text names the field."""


# Strings go first (their brackets are text); what is left of the structure is its brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))


def _json_depth(text: bytes) -> int:
    """How deep the arrays and objects of *text* nest, without parsing it (linear, no recursion);
    raise JsonBoundsError when it holds more than MAX_JSON_CONTAINERS of them."""
    if text.count(b"[") + text.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than that: the common case costs two counts
    brackets = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKET)
    if len(brackets) > 2 * MAX_JSON_CONTAINERS:  # also keeps the count below cheap
        raise JsonBoundsError(f"JSON with {len(brackets) // 2} arrays and objects (at most {MAX_JSON_CONTAINERS})")
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonBoundsError(f"an integer of {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS} are read)")
    return int(digits)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonBoundsError(f"the number {text[:40]!r} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise JsonBoundsError(f"{name} is not a JSON number")


def loads_bounded(data: bytes | str) -> Any:
    """Parse one JSON text from the agent's side; raise ValueError naming the problem.

    JsonBoundsError for nesting deeper than MAX_JSON_DEPTH or more than MAX_JSON_CONTAINERS
    arrays and objects (checked before parsing, so the parser never recurses on it), integers
    longer than MAX_INT_DIGITS digits, and non-finite numbers; json.JSONDecodeError or
    UnicodeDecodeError for text that is not JSON.
    """
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    if (depth := _json_depth(raw)) > MAX_JSON_DEPTH:
        raise JsonBoundsError(f"JSON nested {depth} levels deep (at most {MAX_JSON_DEPTH})")
    return json.loads(data, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A stream connection to the Unix socket *path*, waiting up to *timeout* s for room in its
    backlog (a socket with a Python timeout would fail at once with EAGAIN when it is full)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        seconds = int(timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", seconds, int((timeout - seconds) * 1e6)))
        sock.connect(path)  # blocking, bounded by SO_SNDTIMEO
        sock.settimeout(timeout)
    except BaseException:
        sock.close()
        raise
    return sock


#: The longest reply line read, and how long a reply may take (the compiled helper's REPLY_MAX
#: and TIMEOUT_S: the two give up alike).
_REPLY_MAX = 1 << 20
_TIMEOUT_S = 5.0


def _ask(message: dict[str, Any]) -> dict[str, Any]:
    """One request on GUARD_SOCKET; raise GuardUnreachable naming the problem, or
    GuardClientError with the guard's words when it refused the request."""
    path = os.environ.get("GUARD_SOCKET")
    if not path:
        raise GuardUnreachable("GUARD_SOCKET is not set")
    try:
        with connect_unix(path, _TIMEOUT_S) as sock:
            sock.sendall(json.dumps({"v": VERSION, **message}).encode() + b"\n")
            buf = b""
            while b"\n" not in buf and len(buf) < _REPLY_MAX:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except OSError as err:
        raise GuardUnreachable(f"cannot reach the guard at {path}: {err.strerror or err}") from err
    if not buf:
        raise GuardUnreachable(f"the guard at {path} closed the connection without replying")
    if b"\n" not in buf:
        raise GuardUnreachable(f"the guard at {path} " + ("closed the connection mid-reply" if len(buf) < _REPLY_MAX
                                                           else "sent a reply this hook cannot read"))
    try:
        reply = json.loads(buf.split(b"\n", 1)[0])
    except ValueError as err:
        raise GuardUnreachable(f"the guard at {path} sent a reply this hook cannot read") from err
    # A check's reply decides: without its allow, it is no answer (the compiled helper reads no other shape).
    if not isinstance(reply, dict) or (message["type"] == "check" and reply.get("ok") is True
                                       and not isinstance(reply.get("allow"), bool)):
        raise GuardUnreachable(f"the guard at {path} sent a reply this hook cannot read")
    if reply.get("ok") is not True:  # read, and refused: the guard says why
        raise GuardClientError(f"the guard refused the request: {reply.get('error')}")
    return reply


# As the protocol's ``check`` message accepts them (this file cannot import it).
_MAX_TOOL_NAME = 200
_MAX_PATHS = 256
_MAX_PATH = 4096


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _field(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    """*doc[key]* when it is a *kind* (None when absent or null); HookPayloadError otherwise."""
    value = doc.get(key)
    if value is None or isinstance(value, kind):
        return value
    raise HookPayloadError(f"{where}{key} must be {_type_name(kind())}, not {_type_name(value)}")


def _paths(tool_input: dict[str, Any], cwd: str) -> list[str]:
    out = []
    for key in _PATH_KEYS:
        value = _field(tool_input, key, str, "tool_input.")
        if value:
            out.append(os.path.normpath(os.path.join(cwd, value)))
    # Codex's apply_patch: its hook payload has the patch as "command" (the model's free-form
    # input); older payloads and MCP tools said "input"/"patch". A shell command that pipes a
    # patch into apply_patch (a heredoc) writes the same files. An MCP tool's may be an object.
    for key in ("command", "input", "patch"):
        patch = tool_input.get(key)
        if isinstance(patch, str) and "*** Begin Patch" in patch:
            out += [os.path.normpath(os.path.join(cwd, p.strip())) for p in _PATCH_FILE.findall(patch)]
    for i, edit in enumerate(_field(tool_input, "edits", list, "tool_input.") or []):
        if not isinstance(edit, dict):
            raise HookPayloadError(f"tool_input.edits[{i}] must be an object, not {_type_name(edit)}")
        if value := _field(edit, "file_path", str, f"tool_input.edits[{i}]."):
            out.append(os.path.normpath(os.path.join(cwd, value)))
    if len(out) > _MAX_PATHS:
        raise HookPayloadError(f"tool_input names {len(out)} paths (at most {_MAX_PATHS})")
    if too_long := next((p for p in out if len(p) > _MAX_PATH), None):
        raise HookPayloadError(f"a path of {len(too_long)} characters (at most {_MAX_PATH}): {too_long[:80]}...")
    return out


def _exit_code(response: Any) -> int:
    if isinstance(response, str):  # Codex: the tool's output text, which may state its status
        found = _EXIT_TEXT.search(response)
        return max(-255, min(255, int(found.group(1)))) if found else 0
    if isinstance(response, dict):
        for key in ("exit_code", "exitCode", "returncode"):
            value = response.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return max(-255, min(255, value))  # the range tool_result accepts
        if response.get("interrupted") or response.get("is_error") or response.get("error"):
            return 1
        content = response.get("llmContent")
        if isinstance(content, str) and (wrapped := _GEMINI_WRAP.match(content)):
            content = wrapped.group(1)
        if isinstance(content, str) and content.startswith("Output: "):  # Gemini's shell: no code field
            if found := _GEMINI_EXIT.search(content):
                return max(-255, min(255, int(found.group(1))))
            if _GEMINI_SIGNAL.search(content):
                return 1
    return 0


def decide(event: Any, ask: Callable[[dict[str, Any]], dict[str, Any]], agent: str | None = None) -> tuple[int, str]:
    """The hook's answer to one hook *event* of *agent* (a name in the agents' table): (exit
    status in the agent's convention, text for stderr).

    *ask* sends one agent-socket message and returns the reply, raising GuardUnreachable.
    Raises HookPayloadError, naming the field, for an event of the wrong shape
    (:func:`refuse_malformed` is the answer to give then).
    """
    if not isinstance(event, dict):
        raise HookPayloadError(f"the hook event must be a JSON object, not {_type_name(event)}")
    name = _field(event, "hook_event_name", str, "") or ""
    tool = _field(event, "tool_name", str, "") or ""
    if len(tool) > _MAX_TOOL_NAME:
        raise HookPayloadError(f"tool_name of {len(tool)} characters (at most {_MAX_TOOL_NAME})")
    tool_input: dict[str, Any] = _field(event, "tool_input", dict, "") or {}
    cwd = _field(event, "cwd", str, "") or os.getcwd()
    mutating = tool in MUTATING_TOOLS
    if name in _PRE:
        paths = _paths(tool_input, cwd)  # before asking: a malformed event asks nothing
    try:
        if name in _PRE:
            args = {"command": tool_input.get("command")} if "command" in tool_input else tool_input
            reply = ask({"type": "check", "tool": tool, "paths": paths, "args": args, "mutating": mutating})
            allow = reply.get("allow")
            if not isinstance(allow, bool):
                raise GuardUnreachable("the guard sent a reply this hook cannot read")
            if not allow:
                return _block(agent), reply.get("feedback") or f"guard: {tool} refused ({reply.get('state')})"
            return 0, reply.get("warning", "")
        if name in _POST:
            summary = str(tool_input.get("command") or tool_input.get("file_path") or "")[:4000]
            ask({"type": "tool_result", "tool": tool, "exit_code": _exit_code(event.get("tool_response")),
                 "summary": summary})
    except GuardUnreachable as err:
        if mutating and name in _PRE:
            return _block(agent), (f"guard: refusing {tool}: the guard cannot be reached ({err}); writes stay blocked "
                           "until it is back")
        return 0, f"guard hook: {err}"
    except GuardClientError as err:  # the guard read the call and refused it: fail closed, whatever the tool
        if name in _PRE:
            return _block(agent), f"guard: refusing {tool}: {err}"
        return 0, f"guard hook: {err}"
    return 0, ""


def refuse_malformed(event: Any, err: HookPayloadError, agent: str | None = None) -> tuple[int, str]:
    """The answer to a hook event :func:`decide` could not read: before a tool (or when it is not
    even clear which hook this is) the tool is refused; after one, a warning."""
    name = event.get("hook_event_name") if isinstance(event, dict) else None
    tool = event.get("tool_name") if isinstance(event, dict) else None
    tool_text = tool[:_MAX_TOOL_NAME] if isinstance(tool, str) and tool else "the tool"
    if isinstance(name, str) and name in _POST:  # a name of another type is not hashable
        return 0, f"guard hook: cannot read this hook event ({err}); nothing reported"
    return _block(agent), f"guard: refusing {tool_text}: its hook event cannot be read ({err})"


def run_hook(agent: str, stdin: str | bytes, unreachable: str | None = None) -> int:
    """Handle one hook call (*agent*: claude, codex, gemini); returns the exit status.

    *unreachable*: why the guard gave no usable answer to a message it may have counted (the
    compiled helper's hand-over): the call is decided as if it could not be reached, unasked.
    """
    if len(stdin) > MAX_HOOK_INPUT:
        print(f"guard hook {agent}: hook input of {len(stdin)} bytes (at most {MAX_HOOK_INPUT}); refusing",
              file=sys.stderr)
        return _block(agent)
    try:
        event = loads_bounded(stdin)
    except ValueError as err:  # not JSON, not UTF-8, or beyond the bounds
        print(f"guard hook {agent}: no valid JSON on stdin ({err})", file=sys.stderr)
        return _block(agent)

    def unasked(message: dict[str, Any]) -> dict[str, Any]:
        raise GuardUnreachable(str(unreachable))

    try:
        code, text = decide(event, _ask if unreachable is None else unasked, agent)
    except HookPayloadError as err:
        code, text = refuse_malformed(event, err, agent)
    if text:
        print(text, file=sys.stderr)
    return code


def main() -> int:
    """``python3 -S -E fasthook.py AGENT`` (``AGENT --guard-unreachable WHY``: the compiled helper's hand-over)."""
    agent = sys.argv[1] if len(sys.argv) > 1 else "claude"
    unreachable = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--guard-unreachable" else None
    try:  # bytes: any encoding is read; no stdin at all is no event (refused as the helper refuses it)
        stdin = sys.stdin.buffer.read(MAX_HOOK_INPUT + 1) if sys.stdin is not None else b""
    except OSError:
        stdin = b""
    return run_hook(agent, stdin, unreachable)


if __name__ == "__main__":
    sys.exit(main())
