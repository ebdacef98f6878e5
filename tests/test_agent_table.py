"""The agents' table (sandbox/agents/registry.py) drives everything agent-specific: detection,
launch settings, output parsers, the CLI's choices, the hook's conventions and the compiled
helper; adding an agent is one entry in that one file (shown for real: a copy of the source
with a fourth agent added to the table only, run as ``guard run``, ``guard hook`` and the helper)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest

from sandbox import cli
from sandbox.agents import fasthook, hooks
from sandbox.agents.events import JsonLinesParser
from sandbox.agents.parsers import FORMATS, make_parser
from sandbox.agents.registry import AGENTS, HOOKED, Launch, detect
from sandbox.breaker import protocol

from .helpers import FIX_TAX as MANIFEST

ROOT = Path(__file__).resolve().parent.parent


def _choices(argv: list[str], dest: str) -> list[str]:
    """The choices of option *dest* in the subcommand argv[0] of guard's parser."""
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[argv[0]]._actions if a.dest == dest)
    return list(action.choices or [])


def test_the_cli_choices_are_the_table() -> None:
    assert _choices(["run"], "agent") == [*AGENTS, "generic"]
    assert _choices(["hook"], "agent") == [a.name for a in AGENTS.values() if a.hook is not None] == list(HOOKED)
    assert _choices(["feed"], "format") == ["protocol", *(a.stream_format for a in AGENTS.values() if a.stream_format)]


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_each_agent_is_detected_parsed_and_launched_from_its_entry(name: str) -> None:
    agent = AGENTS[name]
    for command in agent.commands:
        assert detect([f"/usr/local/bin/{command}", "-p", "x"]) is agent
    parser = agent.parser_class()
    # An agent has both a format and its parser, or neither (aider: the mount alone judges it).
    assert (parser is None) is (agent.stream_format is None) is (agent.parser is None)
    if parser is not None and agent.stream_format is not None:
        assert issubclass(parser, JsonLinesParser)
        assert FORMATS[agent.stream_format] is parser
        assert type(make_parser(agent.stream_format)) is parser
    argv, setup = hooks.launch(name, ["/bin/" + name, "-p", "task"])
    assert argv == ["/bin/" + name, *setup.args, "-p", "task"]
    hook = hooks.hook_command(name)
    named = any(hook in text for text in [*setup.args, *(content for _, _, content in setup.files)])
    assert named is (agent.hook is not None)
    assert agent.mutating_tools <= fasthook.MUTATING_TOOLS
    assert not detect(["/bin/not-an-agent"]) and hooks.launch("generic", ["x", "y"]) == (["x", "y"], Launch())


def test_one_protocol_version_and_one_guard_unreachable() -> None:
    from sandbox.breaker import client

    assert protocol.VERSION == fasthook.VERSION
    assert get_args(protocol.Hello.model_fields["v"].annotation) == (fasthook.VERSION,)
    assert client.GuardUnreachable is fasthook.GuardUnreachable
    assert client.GuardClientError is fasthook.GuardClientError
    assert f"-DGUARD_PROTOCOL_VERSION={fasthook.VERSION}" in hooks.helper_defines()
    defined = [p for p in (ROOT / "sandbox").rglob("*.py")
               if any(isinstance(n, ast.ClassDef) and n.name == "GuardUnreachable"
                      for n in ast.walk(ast.parse(p.read_text())))]
    assert defined == [ROOT / "sandbox/agents/fasthook.py"]


def test_run_and_cli_name_no_agent() -> None:
    """Every agent-specific string lives in the table: none in guard run or the CLI."""
    words: set[str] = set()  # never named, even in a help text
    exact: set[str] = set()  # never a string of their own ("edit" may be a word of a help text)
    for agent in AGENTS.values():
        words |= {agent.name, *agent.commands, *([agent.stream_format] if agent.stream_format else [])}
        words |= {var for var, _, _ in agent.launch("HOOK").files}
        exact |= {*agent.mutating_tools, *([agent.hook.before, agent.hook.after] if agent.hook else [])}
    for module in ("launch/run.py", "cli.py"):
        tree = ast.parse((ROOT / "sandbox" / module).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        found = {s for s in strings for w in words if re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", s)}
        assert not found | (strings & exact), module


# A fourth agent, in the table only: a copy of the source with this entry added to registry.py.
_FOURTH = '''
_TABLE += (Agent(
    name="mentat", commands=frozenset({"mentat"}), stream_format="mentat-json",
    parser="sandbox.agents.claude:ClaudeStreamParser", mutating_tools=frozenset({"mentat_write"}),
    hook=HookConvention("BeforeEdit", "AfterEdit", block_status=3),
    launch=lambda hook: Launch(args=("--guard-hook", hook), files=(("MENTAT_GUARD", "mentat-guard.json", hook),)),
),)
'''

FAKE_MENTAT = """\
    #!/usr/bin/env python3
    import json, os, sys
    settings = os.environ.get("MENTAT_GUARD")
    print(json.dumps({"argv": sys.argv[1:], "settings": open(settings).read() if settings else None}))
    message = {"id": "m1", "usage": {"input_tokens": 1000, "output_tokens": 234}, "content": []}
    print(json.dumps({"type": "assistant", "message": message}))
    print(json.dumps({"type": "result", "usage": {"input_tokens": 1000, "output_tokens": 234}, "num_turns": 1}))
"""


@pytest.fixture
def fourth(tmp_path: Path) -> dict[str, str]:
    """The environment of a copy of guardfs whose table (one file) has a fourth agent."""
    src = tmp_path / "src"
    for package in ("guardfs", "sandbox"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "_build"))
    registry = src / "sandbox/agents/registry.py"
    text = registry.read_text()
    anchor = "\n#: The agents by name."
    assert anchor in text
    registry.write_text(text.replace(anchor, _FOURTH + anchor, 1))
    return {**os.environ, "PYTHONPATH": str(src), "XDG_CACHE_HOME": str(tmp_path / "cache"), "SRC": str(src)}


def _guard(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``guard ARGS`` from the copy (never from this checkout: the working directory is outside it)."""
    return subprocess.run([sys.executable, "-m", "sandbox", *args], input="", capture_output=True, text=True,
                          env=env, cwd=cwd or Path(env["SRC"]).parent, timeout=120)


def test_a_fourth_agent_is_one_table_entry_for_the_cli_and_the_hooks(fourth: dict[str, str], tmp_path: Path) -> None:
    where = _guard(fourth, "hook", "--help")
    assert "mentat" in where.stdout, where.stderr  # the copy, not this checkout, is what runs
    event = json.dumps({"hook_event_name": "BeforeEdit", "tool_name": "mentat_write", "cwd": str(tmp_path),
                        "tool_input": {"path": "a.py"}})
    env = {**fourth, "GUARD_SOCKET": str(tmp_path / "no-guard.sock")}
    helper = subprocess.run([sys.executable, "-c", "from sandbox.agents.hooks import compiled_helper as c; "
                             "print(c() or '')"], env=env, capture_output=True, text=True, timeout=300, check=True,
                            cwd=tmp_path)
    ways = {
        "guard hook": [sys.executable, "-m", "sandbox", "hook", "mentat"],
        "fasthook": [sys.executable, "-S", "-E", str(Path(fourth["SRC"]) / "sandbox/agents/fasthook.py"), "mentat"],
    }
    if helper.stdout.strip():
        ways["compiled"] = [helper.stdout.strip(), "mentat"]
    for way, argv in ways.items():
        proc = subprocess.run(argv, input=event, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
        # the new agent's own mutating tool, event name and blocking status, failing closed
        assert proc.returncode == 3, (way, proc.stderr)
        assert "refusing mentat_write: the guard cannot be reached" in proc.stderr, way
    feed = _guard(fourth, "feed", "--format", "mentat-json", "--socket", str(tmp_path / "no.sock"))
    assert feed.returncode == 69 and "cannot reach the guard" in feed.stderr, feed.stderr


@pytest.mark.root
@pytest.mark.mount
def test_a_fourth_agent_is_detected_launched_and_parsed_by_guard_run(fourth: dict[str, str], tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "bin").mkdir()
    fake = ws / "bin/mentat"
    fake.write_text(textwrap.dedent(FAKE_MENTAT))
    fake.chmod(0o755)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    run_dir = tmp_path / "run"
    result = _guard(fourth, "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
                    str(fake), "-p", "task", cwd=ws)
    assert result.returncode == 0, result.stderr
    seen = json.loads((run_dir / "stdout.log").read_text().splitlines()[0])
    assert seen["argv"][0] == "--guard-hook" and seen["argv"][2:] == ["-p", "task"]
    assert seen["argv"][1].endswith(" mentat") and seen["settings"] == seen["argv"][1]
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["tokens"]["total"] == 1234  # its output went through the parser its entry names


def test_a_malformed_event_name_of_any_type_is_refused_not_raised() -> None:
    # hypothesis found it: the event names are a set now, and a list is not hashable
    err = fasthook.HookPayloadError("hook_event_name must be a string")
    for name in ([1], {"a": 1}, 3, None):
        assert fasthook.refuse_malformed({"hook_event_name": name, "tool_name": "Write"}, err)[0] == fasthook.BLOCK
    assert fasthook.refuse_malformed({"hook_event_name": "AfterTool"}, err, "gemini")[0] == 0
