"""``guard hook claude|gemini``: the command an agent runs before and after each tool.

It reads the hook's JSON on stdin, asks the agent socket (``check`` before a tool,
``tool_result`` after it) and answers in the agent's blocking convention: exit 2 with the
reason on stderr blocks the tool, and that text reaches the model as the tool's error — the
breaker's corrective feedback, at the point of highest attention. If the guard cannot be
reached, mutating tools are refused (fail closed) and read-only ones go ahead.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from sandbox.client import GuardClient, GuardClientError

__all__ = ["MUTATING_TOOLS", "run_hook"]

#: Tools that write (Claude Code's, Codex's and Gemini CLI's names); shells count, since they can.
MUTATING_TOOLS = frozenset({
    "Write", "Edit", "MultiEdit", "NotebookEdit", "Bash",
    "shell", "exec_command", "apply_patch",
    "write_file", "replace", "run_shell_command", "edit",
})
_PATCH_FILE = re.compile(r"^\*\*\* (?:Add|Update|Delete) File: (.+)$", re.MULTILINE)
_PATH_KEYS = ("file_path", "notebook_path", "path", "absolute_path")
BLOCK = 2


def _paths(tool_input: dict[str, Any], cwd: str) -> list[str]:
    out = []
    for key in _PATH_KEYS:
        value = tool_input.get(key)
        if isinstance(value, str) and value:
            out.append(os.path.normpath(os.path.join(cwd, value)))
    patch = tool_input.get("input") or tool_input.get("patch")  # Codex apply_patch
    if isinstance(patch, str):
        out += [os.path.normpath(os.path.join(cwd, p.strip())) for p in _PATCH_FILE.findall(patch)]
    for edit in tool_input.get("edits") or []:  # MultiEdit carries one file_path for all
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


def run_hook(agent: str, stdin: str) -> int:
    """Handle one hook call; returns the exit status the agent will read."""
    try:
        event = json.loads(stdin)
    except json.JSONDecodeError as err:
        print(f"guard hook: the agent sent no valid JSON on stdin ({err})", file=sys.stderr)
        return BLOCK
    name = str(event.get("hook_event_name", ""))
    tool = str(event.get("tool_name", ""))
    tool_input = event.get("tool_input") if isinstance(event.get("tool_input"), dict) else {}
    mutating = tool in MUTATING_TOOLS
    try:
        with GuardClient(timeout=5.0) as guard:
            if name in ("PreToolUse", "BeforeTool"):
                args = {"command": tool_input.get("command")} if "command" in tool_input else tool_input
                reply = guard.check(tool, _paths(tool_input, str(event.get("cwd") or os.getcwd())), args, mutating)
                if not reply["allow"]:
                    print(reply.get("feedback") or f"guard: {tool} refused ({reply['state']})", file=sys.stderr)
                    return BLOCK
                if reply.get("warning"):
                    print(reply["warning"], file=sys.stderr)
            elif name in ("PostToolUse", "AfterTool"):
                summary = str(tool_input.get("command") or tool_input.get("file_path") or "")
                guard.tool_result(tool, _exit_code(event.get("tool_response")), summary)
    except GuardClientError as err:
        if mutating and name in ("PreToolUse", "BeforeTool"):
            print(f"guard: refusing {tool}: the guard cannot be reached ({err}); writes stay blocked "
                  "until it is back", file=sys.stderr)
            return BLOCK
        print(f"guard hook: {err}", file=sys.stderr)
    return 0
