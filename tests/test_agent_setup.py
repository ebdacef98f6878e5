"""How guard run sets up each agent, and the hooks in each agent's convention, against a
live daemon. (Only Claude Code runs for real here: see test_claude_code.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.agents.hooks import compiled_helper, hook_command

from .helpers import FIX_TAX as MANIFEST
from .mounts import guarded_mount


def hook(agent: str, event: dict[str, object], socket: Path, how: str = "python") -> subprocess.CompletedProcess[str]:
    """Run our hook as an agent would: the Python one (guard hook) or the compiled helper."""
    if how == "compiled":
        helper = compiled_helper()
        if helper is None:
            pytest.skip("no C compiler: agents get the Python hook")
        argv = [str(helper), agent]
    else:
        argv = [sys.executable, "-m", "sandbox", "hook", agent]
    return subprocess.run(argv, input=json.dumps(event), capture_output=True, text=True,
                          env={**os.environ, "GUARD_SOCKET": str(socket)}, timeout=60)


@pytest.mark.parametrize("how", ["python", "compiled"])
@pytest.mark.parametrize(("agent", "before", "after", "tool", "tool_input"), [
    ("claude", "PreToolUse", "PostToolUse", "Edit", {"file_path": "src/auth/jwt.py", "old_string": "a",
                                                      "new_string": "b"}),
    ("codex", "PreToolUse", "PostToolUse", "apply_patch",
     {"command": "*** Begin Patch\n*** Update File: src/auth/jwt.py\n@@\n-a\n+b\n*** End Patch\n"}),
    ("gemini", "BeforeTool", "AfterTool", "write_file", {"file_path": "src/auth/jwt.py", "content": "x"}),
])
@pytest.mark.mount
def test_hook_blocks_out_of_scope_and_reports_results(
    tmp_path: Path, agent: str, before: str, after: str, tool: str, tool_input: dict[str, object], how: str
) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    with guarded_mount(tmp_path, MANIFEST, run_dir=tmp_path / "run") as g:
        assert g.daemon is not None
        sock = g.daemon.agent_path
        cwd = str(g.mnt)
        ok = hook(agent, {"hook_event_name": before, "tool_name": "Read", "cwd": cwd,
                          "tool_input": {"file_path": "src/checkout/tax.py"}}, sock, how)
        assert ok.returncode == 0, ok.stderr
        blocked = hook(agent, {"hook_event_name": before, "tool_name": tool, "cwd": cwd, "tool_input": tool_input},
                       sock, how)
        assert blocked.returncode == 2
        assert "guard: refused" in blocked.stderr and "src/auth/jwt.py" in blocked.stderr
        assert "Fix the tax rounding helper" in blocked.stderr  # the re-anchoring text
        done = hook(agent, {"hook_event_name": after, "tool_name": "run_shell_command", "cwd": cwd,
                            "tool_input": {"command": "pytest -q"}, "tool_response": {"exit_code": 1}}, sock, how)
        assert done.returncode == 0, done.stderr
        snap = g.daemon.breaker.snapshot()
        assert snap["trips"][0]["rule"] == "scope_spill"
        assert snap["consecutive_failures"] == 1


FAKE_AGENT = """\
    #!/usr/bin/env python3
    import json, os, sys
    settings = os.environ.get("GEMINI_CLI_SYSTEM_SETTINGS_PATH")
    print(json.dumps({"argv": sys.argv[1:], "settings": open(settings).read() if settings else None,
                      "mode": os.stat(settings).st_mode & 0o777 if settings else None}))
"""


@pytest.mark.root
@pytest.mark.parametrize("agent", ["claude", "codex", "gemini", "aider", "mentat"])
@pytest.mark.mount
def test_guard_run_sets_up_each_agent_without_touching_its_config(tmp_path: Path, agent: str) -> None:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    bindir = tmp_path / "ws/bin"  # inside the workspace: visible in the sandbox
    bindir.mkdir()
    fake = bindir / agent
    fake.write_text(textwrap.dedent(FAKE_AGENT))
    fake.chmod(0o755)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         str(fake), "-p", "task"], cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads((run_dir / "stdout.log").read_text().splitlines()[0])
    argv, settings = seen["argv"], seen["settings"]
    if agent == "claude":
        assert argv[0] == "--settings" and argv[2:] == ["-p", "task"]
        hooks = json.loads(argv[1])["hooks"]
        assert hooks["PreToolUse"][0]["hooks"][0]["command"] == hook_command("claude")
    elif agent == "codex":
        assert argv[:3] == ["--dangerously-bypass-hook-trust", "-c", argv[2]] and argv[3:] == ["-p", "task"]
        assert argv[2].startswith("hooks.PreToolUse=") and hook_command("codex") in argv[2]
    elif agent == "gemini":
        assert argv == ["--skip-trust", "-p", "task"]  # headless: trusted for this run, not in the user's files
        assert settings is not None
        assert seen["mode"] & 0o022 == 0, oct(seen["mode"])  # else Gemini skips it
        assert json.loads(settings)["hooks"]["BeforeTool"][0]["hooks"][0]["command"] == hook_command("gemini")
    elif agent == "aider":  # no hooks: its analytics on the stdout the guard parses, its own files kept apart
        assert argv == ["--no-gitignore", "--no-check-update", "--no-show-release-notes", "--analytics-log",
                        "/dev/stdout", "-p", "task"], argv
        assert settings is None
    else:  # an agent guard does not know: run as given
        assert argv == ["-p", "task"] and settings is None


@pytest.mark.parametrize("how", ["python", "compiled"])
def test_hook_fails_closed_for_writes_when_the_guard_is_down(tmp_path: Path, how: str) -> None:
    sock = tmp_path / "no-guard.sock"
    write: dict[str, object] = {"hook_event_name": "PreToolUse", "tool_name": "Write", "cwd": str(tmp_path),
             "tool_input": {"file_path": "src/checkout/tax.py", "content": "x"}}
    proc = hook("claude", write, sock, how)
    assert proc.returncode == 2
    assert "refusing Write: the guard cannot be reached" in proc.stderr
    read = {**write, "tool_name": "Read", "tool_input": {"file_path": "src/checkout/tax.py"}}
    proc = hook("claude", read, sock, how)
    assert proc.returncode == 0
    assert "cannot reach the guard" in proc.stderr


@pytest.mark.parametrize("how", ["python", "compiled"])
@pytest.mark.mount
def test_hook_feedback_keeps_non_ascii_text(tmp_path: Path, how: str) -> None:
    goal = "Réparer l'arrondi — les coupons restent ≥ 0 🙂"
    manifest = MANIFEST.replace("Fix the tax rounding helper in src/checkout/", goal)
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run") as g:
        assert g.daemon is not None
        blocked = hook("claude", {"hook_event_name": "PreToolUse", "tool_name": "Write", "cwd": str(g.mnt),
                                  "tool_input": {"file_path": "README.md", "content": "x"}}, g.daemon.agent_path, how)
    assert blocked.returncode == 2
    assert goal in blocked.stderr
