"""The real Codex CLI under ``guard run --agent codex --ci``, driven by a scripted Responses API.

Codex (pinned, installed from npm into the repository's ``.cache/`` on first use: its Rust
binary ships inside the npm package) runs ``codex exec --json`` against
:mod:`tests.openai_server` through a model provider of the test's own (``-c model_provider=…``
with a loopback ``base_url``: the user's side of the command line). What guard adds is checked
to be enough: its PreToolUse hook really runs under ``exec`` (``--dangerously-bypass-hook-trust``),
reads ``apply_patch``'s real payload and blocks the out-of-scope patch with the breaker's words,
which arrive in the model's next request.

The repository tracks files the manifest forbids (``.github/workflows/`` and ``secrets/``, whose
start-up lookups by Codex and git do not matter to the rule under test), has a git history and
a test suite the agent runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import npm_cli
from .openai_server import Call, ResponsesModel, scripted_responses

# Each test runs guard run for real (root, as CI runs it; a FUSE mount): ~5 s each alone.
pytestmark = [pytest.mark.root, pytest.mark.mount, pytest.mark.slow]

CODEX_VERSION = "0.169.0"
#: npm_cli's arguments for it (also fetched early by ./dev.sh test: helpers.fetch_pinned_clis).
CODEX_CLI = ("@openai/codex", CODEX_VERSION, "codex", "codex")
#: A slug the CLI knows: an unknown one gets fallback metadata, and no apply_patch tool.
MODEL = "gpt-5.5"
GOAL = "Fix the tax rounding helper in src/checkout/"
TAX = "def total(x):\n    return x\n"
FIXED = "def total(x):\n    return round(x, 2)\n"


@pytest.fixture(scope="session")
def codex_cli() -> Path:
    """The pinned Codex CLI, installed from the npm registry on first use."""
    return npm_cli(*CODEX_CLI)


def repository(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A git repository tracking forbidden files, its manifest, and a HOME for Codex."""
    ws, home = tmp_path / "shop", tmp_path / "home"
    for d in ("src/checkout", "src/auth", ".github/workflows", "secrets"):
        (ws / d).mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text(TAX)
    (ws / "src/checkout/test_tax.py").write_text("from tax import total\n\n\ndef test_total():\n"
                                                 "    assert total(2) == 2\n")
    (ws / "src/auth/jwt.py").write_text("KEY = 'k'\n")
    (ws / ".github/workflows/ci.yml").write_text("on: push\n")
    (ws / "secrets/prod.key").write_text("do not read\n")
    (ws / "README.md").write_text("readme\n")
    (ws / "AGENTS.md").write_text("Run the tests in src/checkout with pytest.\n")
    git = ["git", "-C", str(ws), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "shop"], check=True)
    # The user's own Codex home: a login and a config (the model) that must reach Codex, in a HOME
    # the agent cannot write (as a home outside [sandbox] writable is): guard's copy of it must do.
    (home / ".codex").mkdir(parents=True)
    (home / ".codex/auth.json").write_text('{"OPENAI_API_KEY": "sk-test-fake"}\n')
    (home / ".codex/config.toml").write_text(f'model = "{MODEL}"\n')
    home.chmod(0o555)
    (home / ".codex").chmod(0o555)
    manifest = tmp_path / "guard.toml"
    manifest.write_text(
        f'[task]\nid = "fix-tax"\ngoal = "{GOAL}"\n'
        '[paths]\nallowed = ["src/checkout/"]\nforbidden = [".github/workflows/**", "secrets/**"]\n'
        'forbidden_in_git = "warn"\n'  # a repository that tracks them: readable through git, as said
    )
    return ws, home, manifest


def run_codex(codex: Path, ws: Path, home: Path, manifest: Path, run_dir: Path,
              url: str) -> subprocess.CompletedProcess[str]:
    """``guard run --agent codex --ci -- codex exec --json …`` as a user runs it, bounded."""
    provider = (f'model_providers.scripted={{name="scripted",base_url="{url}",wire_api="responses",'
                'request_max_retries=0,stream_max_retries=0}')
    command = [str(codex), "exec", "--json", "--dangerously-bypass-approvals-and-sandbox",
               "-c", 'model_provider="scripted"', "-c", provider, "Fix the rounding helper"]
    env = {**os.environ, "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--agent", "codex", "--ci", "--manifest", str(manifest),
         "--run-dir", str(run_dir), "--", *command],
        cwd=ws, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


def pytest_cmd() -> str:
    # From src/checkout so the test imports tax; no cache provider: the repository root is out of scope.
    return f"cd src/checkout && {sys.executable} -m pytest -q -p no:cacheprovider test_tax.py"


def patch(path: str, old: str, new: str) -> str:
    """An apply_patch patch updating one line of *path*."""
    return f"*** Begin Patch\n*** Update File: {path}\n@@\n-{old}\n+{new}\n*** End Patch\n"


IN_SCOPE = [
    Call("exec_command", {"cmd": "cat src/checkout/tax.py && git log --oneline && echo $CODEX_HOME && ls $CODEX_HOME"}),
    Call("apply_patch", patch("src/checkout/tax.py", "    return x", "    return round(x, 2)")),
    # Codex hands back a command still running after yield_time_ms (10 s by default) as "Process
    # running": on a loaded machine pytest can take longer, so wait the most Codex allows.
    Call("exec_command", {"cmd": pytest_cmd(), "yield_time_ms": 30000}),
]


def ledger(run_dir: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((run_dir / "ledger.json").read_text())
    return data


def outputs(model: ResponsesModel) -> str:
    return "\n".join(model.tool_outputs())


def test_codex_in_scope_session_exits_0(tmp_path: Path, codex_cli: Path) -> None:
    ws, home, manifest = repository(tmp_path)
    run_dir = tmp_path / "run"
    with scripted_responses([*IN_SCOPE, Call(text="Fixed: total rounds to cents.")]) as (url, model):
        result = run_codex(codex_cli, ws, home, manifest, run_dir, url)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    # Codex ran on the user's config (its model: a slug Codex knows, so it offers apply_patch),
    # copied into a CODEX_HOME of the run's own; the user's own home was not written.
    assert model.requests[0]["model"] == MODEL and "apply_patch" in model.tool_names()
    assert sorted(p.name for p in (home / ".codex").iterdir()) == ["auth.json", "config.toml"]
    assert len(model.requests) == 4, outputs(model)
    # The read saw the file and the history; the patch landed; the tests ran inside and passed.
    seen = model.tool_outputs()
    assert "return x" in seen[0] and "shop" in seen[0], seen
    # Codex's home was the run's own (in the guard's staging directory, gone with the run),
    # holding the copies and what Codex wrote.
    lines = seen[0].split("Output:\n", 1)[-1].splitlines()
    codex_home = next(line for line in lines if line.endswith("/codex_home"))
    assert codex_home.startswith("/tmp/guardfs-stage-") and not Path(codex_home).exists(), lines
    assert {"auth.json", "config.toml", "sessions"} <= set(lines), lines
    assert (ws / "src/checkout/tax.py").read_text() == FIXED
    assert "1 passed" in seen[2], seen
    # Nothing tripped; the hooks ran without persisted trust (the flag guard passes, which Codex
    # announces on the stream; the other test shows the hook blocking).
    assert "--dangerously-bypass-hook-trust" in (run_dir / "stdout.log").read_text()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    data = ledger(run_dir)
    assert data["trips"] == [], data["trips"]
    # The tokens of the run reached the breaker (Codex reports them once per exec, at its end)
    # and each call was counted once: by the hook, not again by the stream.
    tokens = data["tokens"]
    assert isinstance(tokens, dict) and tokens["total"] >= 4 * 1500, tokens
    steps = [e for e in events if e["op"] == "step"]
    assert len(steps) == 1 and steps[0].get("tool") is None, steps
    results = [e for e in events if e["op"] == "tool_result"]
    assert [r["exit_code"] for r in results] == [0, 0, 0], results
    assert not [e for e in events if e.get("decision") == "deny" and e.get("path", "").startswith("src/checkout")]


def test_codex_out_of_scope_patch_blocked_then_shell_spill_stops_the_run(tmp_path: Path, codex_cli: Path) -> None:
    ws, home, manifest = repository(tmp_path)
    run_dir = tmp_path / "run"
    script = [
        *IN_SCOPE,
        Call("apply_patch", patch("src/auth/jwt.py", "KEY = 'k'", "KEY = 'stolen'")),
        Call("exec_command", {"cmd": "echo hacked >> README.md"}),
        Call(text="never reached"),
    ]
    with scripted_responses(script) as (url, model):
        result = run_codex(codex_cli, ws, home, manifest, run_dir, url)
    out = result.stdout + result.stderr
    # The in-scope patch landed; the out-of-scope one was blocked by the hook before it ran, and
    # the breaker's words (rule, task, scope) were the tool's output in the very next request.
    assert (ws / "src/checkout/tax.py").read_text() == FIXED
    assert (ws / "src/auth/jwt.py").read_text() == "KEY = 'k'\n"
    assert len(model.requests) >= 5, outputs(model)
    fifth = json.dumps(model.requests[4]["input"][-1])
    assert "PreToolUse hook" in fifth and "guard: refused" in fifth and "scope_spill" in fifth, fifth
    assert GOAL in fifth, fifth
    # The shell spill was refused by the mount, and the second violation stopped the run: 75.
    assert (ws / "README.md").read_text() == "readme\n"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["path"] == "README.md" and e["decision"] == "deny" for e in events)
    assert [t["rule"] for t in events if t["op"] == "trip"][:2] == ["scope_spill", "scope_spill"]
    assert result.returncode == 75, out[-3000:]
    assert "OPEN_" in result.stdout  # the --ci digest
    # The forbidden files tracked by the repository were never read.
    assert not [e for e in events if e["op"] == "trip" and e["rule"] == "forbidden_path"], events
