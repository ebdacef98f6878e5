"""A real Claude Code session of minutes under ``guard run --agent claude --ci``, with quiet gaps.

LONG: the CI schedule below takes about two minutes and a quarter of wall time (132 s
measured; the model "thinks" 15-30 s before five of its turns, a tool sleeps 12 s). Before
issue 10 the agent was SIGKILLed (exit 137) after any quiet gap of 10 s. Set
``GUARD_LONG_SESSION=manual`` for the longer schedule (gaps of 15-60 s: 322 s measured), run
once by hand. A shorter test kills the guard with SIGKILL during such a session.

The session: ~10 tool calls of the real CLI against a scripted model on loopback: Read, Edit in
scope, Bash running ``python3 -m pytest -q`` on a small test in scope, an out-of-scope Write the
hook blocks (the breaker's words reach the next model request), a final text; the exit status
passes through and every turn's tokens reach the breaker.

Then a real repository (issue 14): history, CLAUDE.md, a test suite, and tracked files the
manifest forbids (`.env`, `.github/workflows/`). In scope (over a minute, gaps of 12-20 s;
65 s measured) Claude Code's start-up and `git status` stat the forbidden files: refused,
no trip, exit 0. Out of scope (10 s): a Read of `.env` is blocked with the breaker's words in
the next request, and the shell's `cat .env` then stops the run (75).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .helpers import git_env, wait_for
from .model_server import Turn, scripted_model
from .test_claude_code import claude_cli, setup
from .test_lifecycle import host_mounts, reap_killed_guard

# Each test runs guard run for real: root (as CI) and a FUSE mount.
pytestmark = [pytest.mark.root, pytest.mark.mount]

__all__ = ["claude_cli"]  # the session fixture, re-exported for pytest

#: Quiet gaps (seconds) before each of the model's turns, in order.
CI_GAPS = [15, 0, 0, 20, 0, 0, 30, 0, 15, 0, 0, 25, 0]
MANUAL_GAPS = [30, 0, 15, 45, 0, 20, 60, 0, 30, 15, 0, 60, 20]


def guard_claude(claude: Path, manifest: Path, run_dir: Path, prompt: str = "Fix the rounding helper") -> list[str]:
    """``guard run --agent claude --ci`` of the real CLI, as a user runs it."""
    return [sys.executable, "-m", "sandbox", "run", "--agent", "claude", "--ci", "--manifest", str(manifest),
            "--run-dir", str(run_dir), "--", str(claude), "-p", prompt, "--output-format", "stream-json",
            "--verbose", "--dangerously-skip-permissions"]


def claude_env(home: Path, url: str) -> dict[str, str]:
    """The CLI's environment: the scripted model, no telemetry, no updates."""
    return {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-test-fake",
            "IS_SANDBOX": "1", "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1"}


def run_claude(claude: Path, ws: Path, home: Path, manifest: Path, run_dir: Path,
               url: str) -> subprocess.CompletedProcess[str]:
    """The session, bounded at 15 minutes."""
    return subprocess.run(guard_claude(claude, manifest, run_dir), cwd=ws, env=claude_env(home, url),
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


def alive(p: psutil.Process) -> bool:
    """Whether *p* still runs (a zombie waiting for its reaper does not)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_tool(guard: int) -> bool:
    """Whether the scripted Bash tool (``python3 -c ...``) runs below *guard*."""
    for p in psutil.Process(guard).children(recursive=True):
        try:
            if p.cmdline()[1:] == ["-c", "import time; time.sleep(600)"]:  # argv[0]: from Claude's PATH
                return True
        except psutil.Error:  # gone, or a zombie, meanwhile
            pass
    return False


def gaps() -> list[float]:
    """The CI schedule, or the long one with ``GUARD_LONG_SESSION=manual``."""
    return [float(g) for g in (MANUAL_GAPS if os.environ.get("GUARD_LONG_SESSION") == "manual" else CI_GAPS)]


@pytest.mark.slow
def test_claude_code_session_of_minutes_with_quiet_gaps(tmp_path: Path, claude_cli: Path) -> None:
    ws, home, manifest = setup(tmp_path)
    (ws / "src/checkout/test_tax.py").write_text(
        "from tax import total\n\n\ndef test_total():\n    assert total(2) == 2\n"
    )
    run_dir = tmp_path / "run"
    tax, test = str(ws / "src/checkout/tax.py"), "src/checkout/test_tax.py"
    # Run from src/checkout so the test imports tax; no cache provider: the repository root is out of scope
    # (what pytest's cache does under a narrow scope is tested in test_real_tools.py).
    # Each run differs a little: the breaker refuses a 3rd identical call even after edits (reported).
    def pytest_cmd(flags: str) -> str:
        return f"(cd src/checkout && {sys.executable} -m pytest -q -p no:cacheprovider {flags} test_tax.py)"
    turns = [
        Turn("Read", {"file_path": tax}),
        Turn("Bash", {"command": pytest_cmd(""), "description": "run the tests"}),
        Turn("Read", {"file_path": str(ws / test)}),
        Turn("Edit", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n"}),
        Turn("Bash", {"command": pytest_cmd("-x"), "description": "run the tests again"}),
        Turn("Write", {"file_path": str(ws / "src/auth/jwt.py"), "content": "SECRET = 'x'\n"}),
        Turn("Read", {"file_path": str(ws / "README.md")}),
        Turn("Edit", {"file_path": str(ws / test), "old_string": "total(2) == 2",
                      "new_string": "total(2.004) == 2.0"}),
        Turn("Bash", {"command": pytest_cmd("-x -k total"), "description": "once more"}),
        Turn("Bash", {"command": "sleep 12 && echo slept", "description": "a quiet tool"}),
        Turn("Bash", {"command": "grep -rn round src/checkout/tax.py", "description": "search"}),  # no Grep tool
        Turn("Bash", {"command": pytest_cmd("-rA") + " && echo PASSED-AT-END", "description": "final check"}),
        Turn(text="All done: total rounds to cents."),
    ]
    for turn, gap in zip(turns, gaps(), strict=True):
        turn.delay = gap
    started = time.monotonic()
    with scripted_model(turns) as (url, model):
        result = run_claude(claude_cli, ws, home, manifest, run_dir, url)
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    # Survived every gap, and Claude Code's own exit status (0: it finished) passed through.
    assert result.returncode == 0, (elapsed, out[-3000:])
    assert elapsed >= sum(gaps()), elapsed  # the gaps really happened inside the run
    stream = (run_dir / "stdout.log").read_text()  # the agent's own stream-json
    final = [m for m in map(json.loads, stream.splitlines()) if m.get("type") == "result"]
    assert final and final[-1]["is_error"] is False, stream[-2000:]
    assert len(model.requests) == len(turns), [len(r.get("messages", [])) for r in model.requests]
    # The in-scope edits landed; the out-of-scope Write did not, and the breaker's words reached
    # the model in the very next request.
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)\n"
    assert "total(2.004) == 2.0" in (ws / test).read_text()
    assert not (ws / "src/auth/jwt.py").exists()
    refusal = [e for e in model.tool_errors() if "guard: refused" in e]
    assert refusal and "scope_spill" in refusal[0] and "Fix the tax rounding helper" in refusal[0], refusal
    seventh = json.dumps(model.requests[6]["messages"][-1])
    assert "guard: refused" in seventh and "scope_spill" in seventh
    # Every pytest run passed inside the mount, the last after the edits.
    assert stream.count("1 passed") >= 4 and "PASSED-AT-END" in stream, stream[-3000:]
    # The breaker saw the tokens of every turn and exactly one (recoverable) trip.
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["tokens"]["total"] >= len(turns) * 1500, ledger["tokens"]
    assert [t["rule"] for t in ledger["trips"]] == ["scope_spill"], ledger["trips"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e.get("decision") == "deny" and e.get("path", "").startswith("src/checkout")]


def test_sigkill_of_the_guard_ends_a_real_claude_session_within_2s(tmp_path: Path, claude_cli: Path) -> None:
    """Past a quiet gap of 12 s, while Claude Code runs a Bash tool: SIGKILL of the guard
    ends the CLI, its node children and the tool within 2 s, and leaves no mount."""
    ws, home, manifest = setup(tmp_path)
    run_dir = tmp_path / "run"
    marker = f"guardfs-real-kill9-{os.getpid()}-{tmp_path.name}"
    turns = [Turn("Read", {"file_path": str(ws / "src/checkout/tax.py")}, delay=12),
             # (Claude Code refuses a standalone `sleep 600`.)
             Turn("Bash", {"command": f"python3 -c 'import time; time.sleep(600)' # {marker}",
                           "description": "a long tool"}),
             Turn(text="never reached")]
    with scripted_model(turns) as (url, _model):
        guard = subprocess.Popen(guard_claude(claude_cli, manifest, run_dir, f"Fix it ({marker})"), cwd=ws,
                                 env=claude_env(home, url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 stdin=subprocess.DEVNULL)
        try:
            wait_for(lambda: running_tool(guard.pid), "Claude Code's Bash tool", timeout=120)
            tree = psutil.Process(guard.pid).children(recursive=True)
            names = {p.name() for p in tree}
            assert "python3" in names and ({"node", "claude"} & names), names
            guard.send_signal(signal.SIGKILL)
            wait_for(lambda: not [p for p in tree if alive(p)], "the session to die with the guard", timeout=2.0)
        finally:
            reap_killed_guard(guard, marker)
    wait_for(lambda: str(tmp_path) not in host_mounts(), "the mount to go", timeout=10)


# ----- a real repository: it tracks forbidden paths (issue 14, Build 3) -----------------------

TRACKED_MANIFEST = """\
[task]
id = "fix-tax"
goal = "Fix the tax rounding helper in src/checkout/"
[paths]
allowed = ["src/checkout/"]
forbidden = [".env*", ".github/workflows/"]
forbidden_in_git = "warn"
[sandbox]
writable = ["{home}"]
"""
CLAUDE_MD = "# shop\n\nRun the tests with `python3 -m pytest -q -p no:cacheprovider src/checkout`.\n"
SECRET = "STRIPE_KEY=sk_live_s3cr3t\n"


def tracked_repository(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A repository with history that tracks `.env` and `.github/workflows/`, a CLAUDE.md and
    a test suite; the manifest forbids what it tracks (and says so: forbidden_in_git = warn)."""
    ws, home = tmp_path / "shop", tmp_path / "home"
    files = {
        "src/checkout/__init__.py": "",
        "src/checkout/tax.py": "def total(x):\n    return x\n",
        "src/checkout/test_tax.py": "from checkout.tax import total\n\n\ndef test_total():\n    assert total(2) == 2\n",
        "src/auth/jwt.py": "ALGORITHM = 'HS256'\n",
        "conftest.py": "import sys\n\nsys.path.insert(0, 'src')\n",
        "README.md": "readme\n",
        ".github/workflows/ci.yml": "on: push\njobs: {}\n",
        ".env": SECRET,
    }
    home.mkdir()
    env = git_env(home)
    subprocess.run(["git", "init", "-q", "-b", "main", str(ws)], check=True, env=env)
    for i, (name, text) in enumerate(files.items()):
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)
        if i % 3 == 2 or i == len(files) - 1:  # a few commits of history
            subprocess.run(["git", "add", "-A"], cwd=ws, check=True, env=env)
            subprocess.run(["git", "commit", "-qm", f"commit {i}"], cwd=ws, check=True, env=env)
    (ws / "CLAUDE.md").write_text(CLAUDE_MD)
    subprocess.run(["git", "add", "CLAUDE.md"], cwd=ws, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "CLAUDE.md"], cwd=ws, check=True, env=env)
    manifest = tmp_path / "guard.toml"
    manifest.write_text(TRACKED_MANIFEST.format(home=home))
    return ws, home, manifest


def run_in_repository(claude: Path, ws: Path, home: Path, manifest: Path, run_dir: Path,
                      url: str) -> subprocess.CompletedProcess[str]:
    """The session in the tracked repository, with git needing no user configuration."""
    env = {**claude_env(home, url), **{k: v for k, v in git_env(home).items() if k.startswith("GIT_")}}
    return subprocess.run(guard_claude(claude, manifest, run_dir), cwd=ws, env=env, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)


def forbidden_denials(run_dir: Path) -> list[dict[str, object]]:
    """The refusals of forbidden paths in the run's events."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("decision") == "deny" and e.get("errno") == "EACCES"]


PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider src/checkout"


@pytest.mark.slow
def test_claude_code_stays_in_scope_in_a_repository_that_tracks_forbidden_paths(
        tmp_path: Path, claude_cli: Path) -> None:
    """Over a minute with quiet gaps: Claude Code starts (indexing the repository), reads
    CLAUDE.md, runs git status (which stats the tracked .env and workflows), the test suite,
    edits in scope and commits. Every lookup of a forbidden path is refused, none trips: exit 0."""
    ws, home, manifest = tracked_repository(tmp_path)
    run_dir = tmp_path / "run"
    tax = str(ws / "src/checkout/tax.py")
    turns = [
        Turn("Read", {"file_path": str(ws / "CLAUDE.md")}, delay=20),
        Turn("Bash", {"command": "git status --short; git log --oneline | head -3", "description": "where am I"}),
        Turn("Bash", {"command": PYTEST, "description": "run the tests"}, delay=15),
        Turn("Read", {"file_path": tax}),
        Turn("Edit", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n"},
             delay=15),
        Turn("Bash", {"command": PYTEST + " && echo SUITE-PASSED", "description": "run the tests again"}),
        Turn("Bash", {"command": "git add src/checkout && git commit -qm 'round to cents' && git log --oneline | "
                                 "head -1", "description": "commit"}, delay=12),
        Turn(text="Done: total rounds to cents."),
    ]
    started = time.monotonic()
    with scripted_model(turns) as (url, model):
        result = run_in_repository(claude_cli, ws, home, manifest, run_dir, url)
    elapsed = time.monotonic() - started
    out = result.stdout + result.stderr
    assert result.returncode == 0, (elapsed, out[-3000:])
    assert elapsed >= 62, elapsed
    assert "readable through git" in result.stderr  # forbidden_in_git = "warn" said so at start
    assert len(model.requests) == len(turns)
    assert "Run the tests with" in json.dumps(model.requests[0])  # CLAUDE.md reached the model
    stream = (run_dir / "stdout.log").read_text()
    assert "SUITE-PASSED" in stream and stream.count("1 passed") >= 2, stream[-3000:]
    assert "round to cents" in stream
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)\n"
    log = subprocess.run(["git", "log", "--format=%s", "-1"], cwd=ws, capture_output=True, text=True, check=True)
    assert log.stdout.strip() == "round to cents"
    # git status looked up the tracked forbidden files: refused, no trip, no secret shown.
    denials = forbidden_denials(run_dir)
    assert {".env", ".github/workflows"} <= {str(e["path"]) for e in denials}, denials
    assert all(e.get("op") == "lookup" for e in denials), denials
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["trips"] == [] and ledger["state"] == "CLOSED", ledger["trips"]
    assert "sk_live" not in stream and "sk_live" not in json.dumps(model.requests)
    assert (ws / ".env").read_text() == SECRET and (ws / ".github/workflows/ci.yml").exists()


@pytest.mark.slow
def test_claude_code_reading_forbidden_paths_is_told_once_then_stopped(tmp_path: Path, claude_cli: Path) -> None:
    """The same repository: a Read of .env is blocked by the hook with the breaker's words in
    the next model request (recoverable); the agent edits in scope and runs the tests; its shell
    then reads .env and the mount refuses the open: the second forbidden read stops the run (75)."""
    ws, home, manifest = tracked_repository(tmp_path)
    run_dir = tmp_path / "run"
    tax = str(ws / "src/checkout/tax.py")
    turns = [
        Turn("Read", {"file_path": str(ws / ".env")}),
        Turn("Edit", {"file_path": tax, "old_string": "    return x\n", "new_string": "    return round(x, 2)\n"},
             delay=5),
        Turn("Bash", {"command": PYTEST, "description": "run the tests"}),
        # (Not a path in a forbidden directory: Claude Code 2.1 itself opens the directory of a
        # path a command names before running it, so that open would be the contact, not cat's.)
        Turn("Bash", {"command": "cat .env", "description": "which settings do the tests use"}),
        Turn("Write", {"file_path": tax, "content": "# never\n"}),
        Turn(text="never reached"),
    ]
    with scripted_model(turns) as (url, model):
        result = run_in_repository(claude_cli, ws, home, manifest, run_dir, url)
    out = result.stdout + result.stderr
    assert result.returncode == 75, out[-3000:]
    assert "OPEN_FORBIDDEN_PATH" in out
    # The breaker's words for the first read reached the model in its next request.
    second = json.dumps(model.requests[1]["messages"][-1])
    assert "guard: refused" in second and "forbidden_path" in second and "HALF_OPEN" in second, second[:2000]
    assert "Fix the tax rounding helper" in second
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert [(t["rule"], t["state"]) for t in ledger["trips"]] == [
        ("forbidden_path", "HALF_OPEN_REANCHOR"), ("forbidden_path", "OPEN_FORBIDDEN_PATH")], ledger["trips"]
    # The second trip is the shell's open of .env, refused by the mount (the stats before it were not trips).
    opens = [e for e in forbidden_denials(run_dir) if e["path"] == ".env" and str(e.get("intent")).startswith("open")]
    assert opens and "OPEN_FORBIDDEN_PATH" in str(opens[0]["reason"]), opens
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)\n"
    assert "1 passed" in (run_dir / "stdout.log").read_text()
    assert len(model.requests) <= 5  # stopped before the Write could be asked for
    stream = (run_dir / "stdout.log").read_text()
    assert "sk_live" not in stream and "sk_live" not in json.dumps(model.requests)
