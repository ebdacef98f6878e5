"""Agent output parsers against captured (Claude Code) and schema-built (Codex, Gemini) streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox.agents import Step, ToolDone, Totals, to_messages
from sandbox.agents.parsers import make_parser

HERE = Path(__file__).resolve().parent / "fixtures"
CLAUDE = HERE / "claude-code"  # a copy of shared/fixtures/claude-code (see fixtures/README.md)


def parse(fmt: str, path: Path) -> list[Step | ToolDone | Totals]:
    parser = make_parser(fmt)
    events = []
    with open(path, "rb") as f:
        for line in f:
            events += parser.feed(line)
    return events + parser.finish()


def claude_fixture(name: str) -> Path:
    return CLAUDE / name


@pytest.mark.parametrize("name", ["stream-json.demo.jsonl", "stream-json.partial-messages.jsonl"])
def test_claude_calls_counted_once_and_totals_agree(name: str) -> None:
    events = parse("claude-stream-json", claude_fixture(name))
    calls = [e for e in events if isinstance(e, Step) and e.call_id.startswith("msg_")]
    assert [c.call_id for c in calls] == [f"msg_fake_000{i}" for i in range(1, 6)]  # no double counting
    assert [c.tokens_in for c in calls] == [1500, 1800, 2100, 250000, 2600]
    assert [c.tokens_cached for c in calls] == [0, 1500, 1800, 2100, 2400]
    assert [[t.name for t in c.tools] for c in calls] == [["Write"], ["Edit"], ["Bash"], ["Write"], []]
    assert calls[0].tools[0].args["file_path"] == "/workspace/src/checkout/tax.py"
    totals = [e for e in events if isinstance(e, Totals)]
    assert totals == [Totals(258000, 64295, 7800, 5)]
    steps = [e for e in events if isinstance(e, Step)]
    assert sum(s.tokens_in for s in steps) == 258000
    assert sum(s.tokens_out for s in steps) == 64295  # the result's total, whichever stream
    if "partial" in name:  # the real per-call output counts, from message_delta
        assert [c.tokens_out for c in calls] == [120, 90, 60, 64000, 25]
        assert len(steps) == 5
    done = [e for e in events if isinstance(e, ToolDone)]
    assert [(d.name, d.exit_code) for d in done] == [("Write", 0), ("Edit", 0), ("Bash", 0), ("Write", 0)]


def test_claude_blocked_tool_is_recognised() -> None:
    events = parse("claude-stream-json", claude_fixture("stream-json.hook-blocked.jsonl"))
    done = [e for e in events if isinstance(e, ToolDone)]
    blocked = [d for d in done if d.blocked]
    assert [(d.name, d.exit_code) for d in blocked] == [("Write", 1)]
    assert "outside the allowed area" in blocked[0].summary
    assert [d.name for d in done] == ["Write", "Read", "Write", "Bash"]
    assert [e for e in events if isinstance(e, Totals)] == [Totals(9500, 275, 0, 5)]


def test_codex_turns_and_command_exit_codes() -> None:
    events = parse("codex-json", HERE / "codex-exec.jsonl")
    steps = [e for e in events if isinstance(e, Step)]
    assert [(s.tokens_in, s.tokens_cached, s.tokens_out) for s in steps] == [
        (315, 24448, 122), (4277, 22272, 1590), (610, 26400, 45)]
    assert [[t.name for t in s.tools] for s in steps] == [["shell"], ["apply_patch", "shell"], []]
    done = [e for e in events if isinstance(e, ToolDone)]
    assert [(d.name, d.exit_code) for d in done] == [("shell", 0), ("apply_patch", 0), ("shell", 1)]
    assert "pytest" in done[-1].summary
    assert events[-1] == Totals(315 + 4277 + 610, 122 + 1590 + 45, 24448 + 22272 + 26400, 3)


def test_gemini_tools_results_and_stats() -> None:
    events = parse("gemini-stream-json", HERE / "gemini-stream.jsonl")
    tools = [t.name for e in events if isinstance(e, Step) for t in e.tools]
    assert tools == ["read_file", "write_file", "run_shell_command"]
    done = [e for e in events if isinstance(e, ToolDone)]
    assert [(d.name, d.exit_code) for d in done] == [("read_file", 0), ("write_file", 1), ("run_shell_command", 0)]
    assert "outside the task's scope" in done[1].summary
    assert events[-1] == Totals(5830, 924, 12000, 3)


def test_events_become_protocol_messages() -> None:
    events = parse("codex-json", HERE / "codex-exec.jsonl")
    messages = [m for e in events for m in to_messages(e)]
    kinds = [m["type"] for m in messages]
    assert kinds.count("tool_result") == 3
    assert kinds.count("step") == 4  # three turns, one extra tool call in the second
    second = [m for m in messages if m["type"] == "step"][1]
    assert second["tool"] == "apply_patch" and second["tokens_in"] == 4277


def test_garbage_lines_are_skipped() -> None:
    parser = make_parser("claude-stream-json")
    assert parser.feed(b"not json") == []
    assert parser.feed(b"[1, 2]") == []
    assert parser.feed(b'{"type": "user", "message": {"content": "text"}}') == []
