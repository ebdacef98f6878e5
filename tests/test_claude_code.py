"""The real Claude Code CLI inside guard run, driven by a scripted model on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import npm_cli
from .model_server import Turn, scripted_model

CLAUDE_VERSION = "2.1.332"
#: npm_cli's arguments for it (also fetched early by ./dev.sh test: helpers.fetch_pinned_clis).
CLAUDE_CLI = ("@anthropic-ai/claude-code", CLAUDE_VERSION, "claude", "claude-code")


@pytest.fixture(scope="session")
def claude_cli() -> Path:
    """The pinned Claude Code CLI, installed from the npm registry on first use."""
    return npm_cli(*CLAUDE_CLI)


def setup(tmp_path: Path, extra: str = "") -> tuple[Path, Path, Path]:
    ws, home = tmp_path / "shop", tmp_path / "home"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/auth").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "README.md").write_text("readme\n")
    home.mkdir()
    manifest = tmp_path / "guard.toml"
    manifest.write_text(
        '[task]\nid = "fix-tax"\ngoal = "Fix the tax rounding helper in src/checkout/"\n'
        '[paths]\nallowed = ["src/checkout/"]\nforbidden = [".env*"]\n'
        f'[sandbox]\nwritable = ["{home}"]\n' + extra
    )
    return ws, home, manifest


def run_claude(claude: Path, ws: Path, home: Path, manifest: Path, run_dir: Path, url: str,
               *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-test-fake",
           "IS_SANDBOX": "1", "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--", str(claude), "-p", "Fix the rounding helper", "--output-format", "stream-json", "--verbose",
         "--dangerously-skip-permissions", *flags],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


@pytest.mark.root
@pytest.mark.mount
def test_claude_code_in_scope_write_blocked_write_and_refused_shell(tmp_path: Path, claude_cli: Path) -> None:
    ws, home, manifest = setup(tmp_path)
    run_dir = tmp_path / "run"
    script = [
        Turn("Write", {"file_path": str(ws / "src/checkout/tax.py"),
                       "content": "def total(x):\n    return max(0, round(x, 2))\n"}),
        Turn("Write", {"file_path": str(ws / "src/auth/jwt.py"), "content": "SECRET = 'x'\n"}),
        Turn("Bash", {"command": "echo hacked >> README.md", "description": "append"}),
        Turn(text="All done."),
    ]
    with scripted_model(script) as (url, model):
        result = run_claude(claude_cli, ws, home, manifest, run_dir, url)
    # The in-scope Write landed.
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return max(0, round(x, 2))\n"
    # The out-of-scope Write was blocked by the hook before it ran, with the feedback as its error.
    assert not (ws / "src/auth/jwt.py").exists()
    errors = model.tool_errors()
    assert any("guard: refused" in e and "scope_spill" in e and "Fix the tax rounding helper" in e
               for e in errors), errors
    # The shell write was refused by the mount, and the trip recorded.
    assert (ws / "README.md").read_text() == "readme\n"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["op"] == "open" and e["path"] == "README.md" and e["decision"] == "deny" for e in events)
    trips = [e["rule"] for e in events if e["op"] == "trip"]
    assert trips[:2] == ["scope_spill", "scope_spill"], trips
    # The second violation is terminal: with --ci the run ends with 75.
    assert result.returncode == 75, result.stdout + result.stderr
    # The stream was parsed into steps: tokens reached the breaker.
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["tokens"]["total"] >= 3 * 1500


@pytest.mark.root
@pytest.mark.mount
def test_claude_code_edits_a_file_allowed_by_name(tmp_path: Path, claude_cli: Path) -> None:
    """`guard init --allow src/checkout/tax.py`: Claude Code's Edit and Write save through
    tax.py.tmp.<pid>.<random> beside the file; both land, nothing is refused, nothing trips."""
    ws, home, manifest = setup(tmp_path)
    by_name = manifest.read_text().replace('allowed = ["src/checkout/"]', 'allowed = ["src/checkout/tax.py"]')
    manifest.write_text(by_name)
    run_dir = tmp_path / "run"
    tax = str(ws / "src/checkout/tax.py")
    script = [
        Turn("Read", {"file_path": tax}),
        Turn("Edit", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n"}),
        Turn("Write", {"file_path": tax, "content": "def total(x):\n    return max(0, round(x, 2))\n"}),
        Turn(text="Fixed."),
    ]
    with scripted_model(script) as (url, model):
        result = run_claude(claude_cli, ws, home, manifest, run_dir, url)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert model.tool_errors() == []
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return max(0, round(x, 2))\n"
    assert sorted(p.name for p in (ws / "src/checkout").iterdir()) == ["tax.py"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e for e in events if e["decision"] == "deny"] == []
    assert json.loads((run_dir / "ledger.json").read_text())["files"]["distinct"] == 1


@pytest.mark.root
@pytest.mark.mount
def test_claude_code_token_surge_stops_the_run(tmp_path: Path, claude_cli: Path) -> None:
    ws, home, manifest = setup(tmp_path, '[limits]\nmax_window_tokens = 100000\n[breaker]\nrecoverable = []\n')
    run_dir = tmp_path / "run"
    script = [
        Turn("Read", {"file_path": str(ws / "src/checkout/tax.py")}, input_tokens=2000),
        Turn("Read", {"file_path": str(ws / "README.md")}, input_tokens=250000, output_tokens=64000),
        Turn("Write", {"file_path": str(ws / "src/checkout/tax.py"), "content": "# never\n"}),
        Turn(text="done"),
    ]
    with scripted_model(script) as (url, _model):
        result = run_claude(claude_cli, ws, home, manifest, run_dir, url, "--include-partial-messages")
    assert result.returncode == 75, result.stdout + result.stderr
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["state"] == "OPEN_TOKEN_SURGE"
    assert ledger["trips"][0]["rule"] == "token_surge"
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"
    assert "OPEN_TOKEN_SURGE" in result.stdout  # the --ci digest


def test_hook_fails_closed_when_the_daemon_is_down(tmp_path: Path) -> None:
    event = {"hook_event_name": "PreToolUse", "tool_name": "Write", "cwd": str(tmp_path),
             "tool_input": {"file_path": "src/checkout/tax.py", "content": "x"}}
    env = {**os.environ, "GUARD_SOCKET": str(tmp_path / "no-guard.sock")}
    proc = subprocess.run([sys.executable, "-m", "sandbox", "hook", "claude"], input=json.dumps(event),
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert "refusing Write: the guard cannot be reached" in proc.stderr
    read = {**event, "tool_name": "Read", "tool_input": {"file_path": "src/checkout/tax.py"}}
    proc = subprocess.run([sys.executable, "-m", "sandbox", "hook", "claude"], input=json.dumps(read),
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0  # reading is let through, with a warning
    assert "cannot reach the guard" in proc.stderr
