"""What the real Codex CLI (0.169.0) sends guard: its hook payloads and its ``exec --json`` stream,
as captured from it (tests/test_real_codex.py runs the CLI itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sandbox.agents.events import Step, ToolDone, Totals
from sandbox.agents.fasthook import decide
from sandbox.agents.hooks import AGENT_STATE, agent_state
from sandbox.agents.parsers import make_parser
from sandbox.agents.registry import AGENTS, Launch

HERE = Path(__file__).resolve().parent / "fixtures"
CWD = "/work/shop"


def asked(event: dict[str, Any]) -> tuple[tuple[int, str], list[dict[str, Any]]]:
    """The hook's answer to *event*, and the messages it sent (each answered: allowed)."""
    sent: list[dict[str, Any]] = []

    def ask(message: dict[str, Any]) -> dict[str, Any]:
        sent.append(message)
        return {"ok": True, "allow": True, "state": "CLOSED"}

    return decide(event, ask, "codex"), sent


def pre(tool: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    """A PreToolUse event as Codex 0.169.0 sends it."""
    return {"session_id": "s", "turn_id": "t", "transcript_path": "/h/.codex/sessions/x.jsonl", "cwd": CWD,
            "hook_event_name": "PreToolUse", "model": "gpt-5.5", "permission_mode": "bypassPermissions",
            "tool_name": tool, "tool_input": tool_input, "tool_use_id": "call_1"}


def test_apply_patch_payload_names_every_file_it_writes() -> None:
    patch = ("*** Begin Patch\n*** Update File: src/a.py\n@@\n-x = 1\n+x = 2\n*** Add File: /elsewhere/new.py\n"
             "+y\n*** Delete File: src/old.py\n*** Update File: src/b.py\n*** Move to: src/auth/b.py\n@@\n-a\n+b\n"
             "*** End Patch\n")
    _, sent = asked(pre("apply_patch", {"command": patch}))
    assert sent[0]["type"] == "check" and sent[0]["tool"] == "apply_patch" and sent[0]["mutating"]
    assert sent[0]["paths"] == [f"{CWD}/src/a.py", "/elsewhere/new.py", f"{CWD}/src/old.py", f"{CWD}/src/b.py",
                                f"{CWD}/src/auth/b.py"]


def test_a_patch_piped_to_apply_patch_by_the_shell_is_checked_too() -> None:
    command = "apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: src/auth/jwt.py\n@@\n-a\n+b\n*** End Patch\nEOF"
    _, sent = asked(pre("Bash", {"command": command}))
    assert sent[0]["paths"] == [f"{CWD}/src/auth/jwt.py"] and sent[0]["mutating"]  # "Bash": Codex's shell


def test_a_shell_command_without_a_patch_names_no_path() -> None:
    _, sent = asked(pre("Bash", {"command": "cat '*** Update File: x'"}))
    assert sent[0]["paths"] == []


def test_post_tool_use_text_gives_its_exit_status_when_it_states_one() -> None:
    def post(response: str) -> int:
        event = {**pre("apply_patch", {"command": "x"}), "hook_event_name": "PostToolUse", "tool_response": response}
        _, sent = asked(event)
        code: int = sent[0]["exit_code"]
        return code

    assert post("Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess. Updated the following files:\nM a.py\n") == 0
    assert post("Exit code: 1\nWall time: 0 seconds\nOutput:\nFailed to find expected lines\n") == 1
    assert post("Chunk ID: 1\nWall time: 0.0 seconds\nProcess exited with code 3\nOutput:\n") == 3
    assert post("x = 1\n") == 0  # a shell's output alone says nothing: guard installs no PostToolUse for Codex


def test_real_stream_counts_tokens_once_and_leaves_hooked_calls_to_the_hook() -> None:
    parser = make_parser("codex-json")
    events = [e for line in (HERE / "codex-0.169-exec.jsonl").read_bytes().splitlines() for e in parser.feed(line)]
    events += parser.finish()
    steps = [e for e in events if isinstance(e, Step)]
    assert [(s.tokens_in, s.tokens_out, s.tools) for s in steps] == [(6000, 400, ())]
    done = [e for e in events if isinstance(e, ToolDone)]
    assert [(d.name, d.exit_code) for d in done] == [("shell", 0), ("apply_patch", 0), ("shell", 0)]
    assert events[-1] == Totals(6000, 400, 0, 1)


def test_without_guards_hooks_the_stream_reports_the_calls() -> None:
    parser = make_parser("codex-json")
    lines = [line for line in (HERE / "codex-0.169-exec.jsonl").read_bytes().splitlines()
             if b"dangerously-bypass-hook-trust" not in line]
    events = [e for line in lines for e in parser.feed(line)]
    steps = [e for e in events if isinstance(e, Step)]
    assert [t.name for t in steps[0].tools] == ["shell", "apply_patch", "shell"]


def test_a_failed_patch_without_an_exit_code_is_a_failure() -> None:
    parser = make_parser("codex-json")
    line = ('{"type":"item.completed","item":{"id":"item_3","type":"file_change","changes":[{"path":"a.py",'
            '"kind":"update"}],"status":"failed"}}')
    assert [(d.name, d.exit_code) for d in parser.feed(line) if isinstance(d, ToolDone)] == [("apply_patch", 1)]


def test_codex_gets_a_state_directory_of_the_runs_own_with_copies_of_the_users_login(tmp_path: Path) -> None:
    user = tmp_path / "home/.codex"
    (user / "sessions").mkdir(parents=True)
    (user / "auth.json").write_text('{"OPENAI_API_KEY": "sk-x"}')
    (user / "config.toml").write_text('model = "gpt-5.5"\n')
    (user / "history.jsonl").write_text("private\n")
    stage = tmp_path / "stage"
    stage.mkdir()
    setup = AGENTS["codex"].launch("hook")
    state = agent_state(setup, stage, {"HOME": str(tmp_path / "home")})
    assert state is not None and state.parent == stage / AGENT_STATE
    assert sorted(p.name for p in state.iterdir()) == ["auth.json", "config.toml"]  # the login and config only
    assert (state / "auth.json").stat().st_mode & 0o777 == 0o600
    assert (state / "config.toml").read_text() == 'model = "gpt-5.5"\n'
    # $CODEX_HOME, when the user sets it, is where the login is; a missing file is no error.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "config.toml").write_text("x = 1\n")
    again = agent_state(setup, tmp_path, {"HOME": str(tmp_path / "home"), "CODEX_HOME": str(other)})
    assert again is not None and sorted(p.name for p in again.iterdir()) == ["config.toml"]
    assert agent_state(Launch(), stage, {}) is None  # an agent that names no state gets none
