"""The real Gemini CLI inside ``guard run --agent gemini --ci``, driven by a scripted Gemini API
(tests/gemini_server.py) on loopback, in a git repository that tracks files its manifest forbids.

What guard passes to Gemini (docs/how-it-works.md, "Real agents"): a system settings file of its own with the
BeforeTool/AfterTool hooks (``GEMINI_CLI_SYSTEM_SETTINGS_PATH``, mode 0644: Gemini skips one that
group or others may write) and ``--skip-trust`` (headless Gemini exits 55 in an untrusted folder).
The user's ``~/.gemini`` is left as it was. Each run costs a few seconds; the CLI is installed
from npm once into ``.cache/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from guardfs.accounting import WriteAccounting
from guardfs.manifest import parse_manifest
from sandbox.agents import fasthook
from sandbox.breaker import Breaker

from .gemini_server import Turn, scripted_gemini
from .helpers import FIX_TAX, npm_cli

GEMINI_VERSION = "0.61.0"
#: npm_cli's arguments for it (also fetched early by ./dev.sh test: helpers.fetch_pinned_clis).
GEMINI_CLI = ("@google/gemini-cli", GEMINI_VERSION, "gemini", "gemini-cli")


@pytest.fixture(scope="session")
def gemini_cli() -> Path:
    """The pinned Gemini CLI, installed from the npm registry on first use."""
    return npm_cli(*GEMINI_CLI)


def git(ws: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(ws), *args], check=True, capture_output=True, timeout=60)


def repository(tmp_path: Path, forbidden: list[str]) -> tuple[Path, Path, Path]:
    """A git repository that tracks forbidden files (CI workflows, secrets, .env), a test suite
    in scope, and a HOME whose Gemini settings pick API-key auth (the user's own file)."""
    ws, home = tmp_path / "shop", tmp_path / "home"
    for folder in ("src/checkout", "src/auth", ".github/workflows", "secrets"):
        (ws / folder).mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "src/checkout/test_tax.py").write_text(
        "from tax import total\n\n\ndef test_total():\n    assert total(2.004) == 2.0\n")
    (ws / "src/auth/jwt.py").write_text("KEY = 1\n")
    (ws / "README.md").write_text("readme\n")
    (ws / "GEMINI.md").write_text("Run the tests with pytest from src/checkout.\n")
    (ws / ".github/workflows/ci.yml").write_text("on: push\n")
    (ws / "secrets/key.txt").write_text("hunter2\n")
    (ws / ".env").write_text("DB_PASSWORD=hunter2\n")
    git(ws, "init", "-q")
    git(ws, "add", "-A")
    git(ws, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "start")
    (home / ".gemini").mkdir(parents=True)
    user_settings = home / ".gemini/settings.json"
    user_settings.write_text(json.dumps({"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    manifest = tmp_path / "guard.toml"
    manifest.write_text(
        '[task]\nid = "fix-tax"\ngoal = "Fix the tax rounding helper in src/checkout/"\n'
        f'[paths]\nallowed = ["src/checkout/"]\nforbidden = {json.dumps(forbidden)}\n'
        # Tracked, so readable through git whatever the mount refuses: this repository accepts that.
        'forbidden_in_git = "warn"\n'
        f'[sandbox]\nwritable = ["{home}"]\n'
    )
    return ws, home, manifest


def run_gemini(gemini: Path, ws: Path, home: Path, manifest: Path, run_dir: Path,
               url: str) -> subprocess.CompletedProcess[str]:
    """``guard run --agent gemini --ci`` of the real CLI, as a user runs it headless."""
    env = {**os.environ, "HOME": str(home), "GOOGLE_GEMINI_BASE_URL": url, "GEMINI_API_KEY": "fake-key"}
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--agent", "gemini", "--ci", "--manifest", str(manifest),
         "--run-dir", str(run_dir), "--", str(gemini), "-m", "gemini-2.5-pro", "-p", "Fix the rounding helper",
         "--output-format", "stream-json", "--yolo"],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


PYTEST = f"cd src/checkout && {sys.executable} -m pytest -q -p no:cacheprovider test_tax.py"

#: The first run: no .env rule (Gemini looks up <cwd>/.env at start-up; see the test below).
FORBIDDEN = [".github/workflows/", "secrets/"]


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("forbidden", [
    FORBIDDEN,
    [*FORBIDDEN, ".env*"],  # Gemini stats <cwd>/.env at start-up: refused, no violation
], ids=["no-env-rule", "env-forbidden"])
def test_gemini_stays_in_scope_exit_0(tmp_path: Path, gemini_cli: Path, forbidden: list[str]) -> None:
    ws, home, manifest = repository(tmp_path, forbidden)
    user_settings = (home / ".gemini/settings.json").read_bytes()
    run_dir = tmp_path / "run"
    tax = str(ws / "src/checkout/tax.py")
    turns = [
        Turn("read_file", {"file_path": tax}, input_tokens=3000),
        # The same read again: one call, reported by the hook and by the stream, counts once (the
        # 2nd of 3 allowed), so it is no repeated_action.
        Turn("read_file", {"file_path": tax}, input_tokens=3100),
        Turn("run_shell_command", {"command": PYTEST, "description": "run the tests"}, input_tokens=3150),  # fails
        Turn("replace", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n",
                         "instruction": "round to cents"}, input_tokens=3200),
        Turn("run_shell_command", {"command": PYTEST, "description": "run the tests"}, input_tokens=3300),
        Turn(text="Fixed: total rounds to cents.", input_tokens=3400),
    ]
    with scripted_gemini(turns) as (url, model):
        result = run_gemini(gemini_cli, ws, home, manifest, run_dir, url)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert len(model.requests) == len(turns), out[-3000:]
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)\n"
    stream = (run_dir / "stdout.log").read_text()  # the agent's own stream-json
    assert "1 failed" in stream and "1 passed" in stream, stream[-2000:]
    # Each tool's result counted once (the hook's: the stream's report of it is recorded, not counted),
    # with the shell's real exit status: the failing test run failed, the one after the fix passed.
    results = [(e["tool"], e["exit_code"]) for e in events(run_dir)
               if e["op"] == "tool_result" and e.get("counted", True)]
    assert results == [("read_file", 0), ("read_file", 0), ("run_shell_command", 1), ("replace", 0),
                       ("run_shell_command", 0)], results
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["trips"] == [], ledger["trips"]
    assert [c["label"] for c in ledger["checkpoints"]][-1].startswith("passing test"), ledger["checkpoints"]
    # Gemini's stream reports usage once, at the end: every call's tokens reach the breaker then.
    assert ledger["tokens"]["total"] == sum(t.input_tokens + t.output_tokens for t in turns), ledger["tokens"]
    # The hooks ran (the system settings file was read): each result came from both channels.
    assert len([e for e in events(run_dir) if e["op"] == "tool_result" and e.get("counted") is False]) == 5
    # The user's own settings untouched, and no folder trusted on their behalf.
    assert (home / ".gemini/settings.json").read_bytes() == user_settings
    assert not (home / ".gemini/trustedFolders.json").exists()


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.mount
def test_gemini_out_of_scope_replace_blocked_then_shell_spill_stops_it_75(tmp_path: Path, gemini_cli: Path) -> None:
    ws, home, manifest = repository(tmp_path, FORBIDDEN)
    run_dir = tmp_path / "run"
    tax, jwt = str(ws / "src/checkout/tax.py"), str(ws / "src/auth/jwt.py")
    turns = [
        Turn("read_file", {"file_path": tax}),
        Turn("replace", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n",
                         "instruction": "round to cents"}),
        Turn("replace", {"file_path": jwt, "old_string": "KEY = 1", "new_string": "KEY = 2",
                         "instruction": "rotate the key"}),
        Turn("run_shell_command", {"command": "echo hacked >> README.md", "description": "append"}),
        Turn(text="never reached"),
    ]
    with scripted_gemini(turns) as (url, model):
        result = run_gemini(gemini_cli, ws, home, manifest, run_dir, url)
    out = result.stdout + result.stderr
    assert result.returncode == 75, out[-3000:]
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)\n"
    # The out-of-scope replace was blocked by the hook before it ran; the breaker's words were the
    # tool's error in the very next model request.
    assert (ws / "src/auth/jwt.py").read_text() == "KEY = 1\n"
    assert len(model.requests) == 4, out[-3000:]
    fourth = [part["functionResponse"] for part in model.requests[3]["contents"][-1]["parts"]]
    error = json.dumps(fourth)
    assert "guard: refused" in error and "scope_spill" in error and "Fix the tax rounding helper" in error, error
    # The shell spill was refused by the mount; that second violation stopped the run.
    assert (ws / "README.md").read_text() == "readme\n"
    record = events(run_dir)
    assert any(e["op"] == "open" and e["path"] == "README.md" and e["decision"] == "deny" for e in record)
    assert [e["rule"] for e in record if e["op"] == "trip"] == ["scope_spill", "scope_spill"]
    assert "OPEN_SCOPE_SPILL" in result.stdout  # the --ci digest


def test_a_call_reported_by_hook_and_stream_counts_once() -> None:
    """Gemini's BeforeTool hook (check) and its stream's tool_use (step) report every call; neither
    carries a shared call id. Three reads are three calls, whatever the order of the reports."""
    b = Breaker(parse_manifest(FIX_TAX + "[limits]\nmax_identical_calls = 3\n"), WriteAccounting(),
                now=lambda: 1000.0)
    read = {"file_path": "src/checkout/tax.py"}
    assert b.check("read_file", ["src/checkout/tax.py"], read, mutating=False).allow
    assert b.step(tool="read_file", args=read).warning == ""  # the same call, from the stream
    assert b.step(tool="read_file", args=read).warning  # the 2nd call, stream first this time
    second = b.check("read_file", ["src/checkout/tax.py"], read, mutating=False)
    assert second.allow and "already made 1 time" in second.warning and not b.trips
    # A shell call: the hook sends the command alone, the stream all the parameters.
    shell = {"command": "pytest -q", "description": "run the tests", "dir_path": "src"}
    assert b.step(tool="run_shell_command", args=shell).allow
    assert b.check("run_shell_command", [], {"command": "pytest -q"}, mutating=True).warning == ""
    third = b.check("read_file", ["src/checkout/tax.py"], read, mutating=False)
    assert not third.allow and [t.rule.value for t in b.trips] == ["repeated_action"]
    # The stream's report of that refused 3rd call is no 4th call, and no second trip.
    b.step(tool="read_file", args=read)
    assert len(b.trips) == 1


@pytest.mark.parametrize(("content", "code"), [
    ("Output: hi\nExit Code: 3\nProcess Group PGID: 7", 3),
    ("<untrusted_context>\nOutput: hi\nExit Code: 3\nProcess Group PGID: 7\n</untrusted_context>", 3),
    ("Output: ok\nProcess Group PGID: 7", 0),
    ("Output: (empty)\nSignal: 9\nProcess Group PGID: 7", 1),
    # The command's own output cannot pass a failure off as a success ...
    ("Output: Exit Code: 0\nExit Code: 1\nProcess Group PGID: 7", 1),
    # ... and a line of it mid-output is not the status.
    ("Output: a\nExit Code: 2\nmore output\nProcess Group PGID: 7", 0),
])
def test_gemini_shell_exit_status_from_after_tool(content: str, code: int) -> None:
    """Gemini's AfterTool tool_response carries the shell's status only in its text."""
    event = {"hook_event_name": "AfterTool", "tool_name": "run_shell_command", "cwd": "/w",
             "tool_input": {"command": "pytest -q"},
             "tool_response": {"llmContent": content, "returnDisplay": "", "error": None}}
    sent: list[dict[str, Any]] = []

    def ask(message: dict[str, Any]) -> dict[str, Any]:
        sent.append(message)
        return {"ok": True}
    assert fasthook.decide(event, ask, "gemini") == (0, "")
    assert sent == [{"type": "tool_result", "tool": "run_shell_command", "exit_code": code, "summary": "pytest -q"}]


def test_a_result_reported_by_hook_and_stream_counts_once() -> None:
    """AfterTool and the stream's tool_result report the same result: two failed calls are two
    failures in a row, not four (max_consecutive_failures = 3 is not reached)."""
    b = Breaker(parse_manifest(FIX_TAX + "[limits]\nmax_consecutive_failures = 3\n"), WriteAccounting(),
                now=lambda: 1000.0)
    for i in range(2):
        args = {"command": f"make step{i}"}
        b.check("run_shell_command", [], args, mutating=True)
        b.step(tool="run_shell_command", args=args)
        assert b.tool_result("run_shell_command", 2).allow  # the hook's report
        assert b.tool_result("run_shell_command", 0).allow  # the stream's: already answered
    assert b.snapshot()["consecutive_failures"] == 2 and not b.trips
    b.step(tool="run_shell_command", args={"command": "make step2"})
    third = b.tool_result("run_shell_command", 1)
    assert not third.allow and [t.rule.value for t in b.trips] == ["consecutive_failures"]


def test_end_of_run_totals_are_counted_not_judged() -> None:
    """Gemini's stream reports a run's tokens once, at its end: far above the window and velocity
    limits as one lump, they are counted in the ledger and trip nothing."""
    b = Breaker(parse_manifest(FIX_TAX + "[limits]\nmax_window_tokens = 1000\nmax_tokens_without_progress = 1500\n"),
                WriteAccounting(), now=lambda: 1000.0)
    b.step(tool="read_file", args={"file_path": "a"})
    reply = b.step(200_000, 3000, 50_000, totals=True)
    assert reply.allow and not b.trips
    snap = b.snapshot()
    assert snap["tokens"]["total"] == 203_000 and snap["tokens"]["cached"] == 50_000, snap["tokens"]
    assert snap["steps"] == 1  # no step of its own
    # The same tokens as one call's would trip.
    assert not b.step(200_000, 3000).allow and b.trips[0].rule.value == "token_surge"
