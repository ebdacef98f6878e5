"""The hook an agent runs before and after each tool, fast: standard library only.

Agents start it as a new process for every tool call, so it is run as
``python3 -S -E fasthook.py AGENT`` (no site packages, no environment-driven start-up):
it starts in a few milliseconds. ``guard hook AGENT`` runs the same code.

It reads the hook's JSON on stdin, asks the agent socket (``check`` before a tool,
``tool_result`` after it) and answers in the agent's blocking convention: exit 2 with the
reason on stderr blocks the tool, and that text reaches the model as the tool's error — the
breaker's corrective feedback. If the guard cannot be reached, mutating tools are refused
(fail closed) and read-only ones go ahead.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["MUTATING_TOOLS", "GuardUnreachable", "decide", "main", "run_hook"]

#: Tools that write (Claude Code's, Codex's and Gemini CLI's names); shells count, since they can.
MUTATING_TOOLS = frozenset({
    "Write", "Edit", "MultiEdit", "NotebookEdit", "Bash",
    "shell", "exec_command", "apply_patch",
    "write_file", "replace", "run_shell_command", "edit",
})
_PATH_KEYS = ("file_path", "notebook_path", "path", "absolute_path")
_PATCH_FILE = re.compile(r"^\*\*\* (?:Add|Update|Delete) File: (.+)$", re.MULTILINE)
BLOCK = 2


class GuardUnreachable(Exception):
    """The guard's socket does not answer (or refused the request)."""


def _ask(message: dict[str, Any]) -> dict[str, Any]:
    """One request on GUARD_SOCKET; raise _Unreachable naming the problem."""
    path = os.environ.get("GUARD_SOCKET")
    if not path:
        raise GuardUnreachable("GUARD_SOCKET is not set")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(path)
            sock.sendall(json.dumps({"v": 1, **message}).encode() + b"\n")
            buf = b""
            while b"\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except OSError as err:
        raise GuardUnreachable(f"cannot reach the guard at {path}: {err.strerror or err}") from err
    if not buf:
        raise GuardUnreachable(f"the guard at {path} closed the connection without replying")
    reply: dict[str, Any] = json.loads(buf.split(b"\n", 1)[0])
    if not reply.get("ok"):
        raise GuardUnreachable(f"the guard refused the request: {reply.get('error')}")
    return reply


def _paths(tool_input: dict[str, Any], cwd: str) -> list[str]:
    out = []
    for key in _PATH_KEYS:
        value = tool_input.get(key)
        if isinstance(value, str) and value:
            out.append(os.path.normpath(os.path.join(cwd, value)))
    patch = tool_input.get("input") or tool_input.get("patch")  # Codex apply_patch
    if isinstance(patch, str):
        out += [os.path.normpath(os.path.join(cwd, p.strip())) for p in _PATCH_FILE.findall(patch)]
    for edit in tool_input.get("edits") or []:
        if isinstance(edit, dict) and isinstance(edit.get("file_path"), str):
            out.append(os.path.normpath(os.path.join(cwd, edit["file_path"])))
    return out


def _exit_code(response: Any) -> int:
    if isinstance(response, dict):
        for key in ("exit_code", "exitCode", "returncode"):
            if isinstance(response.get(key), int):
                return int(response[key])
        if response.get("interrupted") or response.get("is_error") or response.get("error"):
            return 1
    return 0


def decide(event: dict[str, Any], ask: Callable[[dict[str, Any]], dict[str, Any]]) -> tuple[int, str]:
    """The hook's answer to one agent hook *event*: (exit status, text for stderr).

    *ask* sends one agent-socket message and returns the reply, raising GuardUnreachable.
    """
    name = str(event.get("hook_event_name", ""))
    tool = str(event.get("tool_name", ""))
    raw = event.get("tool_input")
    tool_input: dict[str, Any] = raw if isinstance(raw, dict) else {}
    mutating = tool in MUTATING_TOOLS
    try:
        if name in ("PreToolUse", "BeforeTool"):
            args = {"command": tool_input.get("command")} if "command" in tool_input else tool_input
            paths = _paths(tool_input, str(event.get("cwd") or os.getcwd()))
            reply = ask({"type": "check", "tool": tool, "paths": paths, "args": args, "mutating": mutating})
            if not reply["allow"]:
                return BLOCK, reply.get("feedback") or f"guard: {tool} refused ({reply['state']})"
            return 0, reply.get("warning", "")
        if name in ("PostToolUse", "AfterTool"):
            summary = str(tool_input.get("command") or tool_input.get("file_path") or "")[:4000]
            ask({"type": "tool_result", "tool": tool, "exit_code": _exit_code(event.get("tool_response")),
                 "summary": summary})
    except GuardUnreachable as err:
        if mutating and name in ("PreToolUse", "BeforeTool"):
            return BLOCK, (f"guard: refusing {tool}: the guard cannot be reached ({err}); writes stay blocked "
                           "until it is back")
        return 0, f"guard hook: {err}"
    return 0, ""


def run_hook(agent: str, stdin: str) -> int:
    """Handle one hook call (*agent*: claude, codex, gemini); returns the exit status."""
    try:
        event = json.loads(stdin)
    except json.JSONDecodeError as err:
        print(f"guard hook {agent}: no valid JSON on stdin ({err})", file=sys.stderr)
        return BLOCK
    code, text = decide(event if isinstance(event, dict) else {}, _ask)
    if text:
        print(text, file=sys.stderr)
    return code


def main() -> int:
    """``python3 -S -E fasthook.py AGENT``."""
    agent = sys.argv[1] if len(sys.argv) > 1 else "claude"
    return run_hook(agent, sys.stdin.read())


if __name__ == "__main__":
    sys.exit(main())
