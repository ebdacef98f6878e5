"""The real aider (PyPI) under ``guard run --ci``, driven by a scripted Chat Completions API.

aider (pinned, installed from PyPI into a venv of its own under the repository's ``.cache/`` on
first use) runs one ``--message`` against :mod:`tests.chat_server` (``--model openai/scripted``,
``OPENAI_API_BASE`` on loopback) in a git repository with the manifest ``guard init --allow
src/checkout/`` writes (``guard.toml``, which ``guard run`` reads by default): writes in
``src/checkout/`` only, the untracked ``.env`` it finds a secret. The user has no git identity
and aider's defaults (auto-commits, a ``.gitignore`` it would edit, its histories and tags cache
at the repository's top level): what the agents' table gives aider is checked to be enough for a
run that exits 0 with no trip from aider's own files. aider has no hooks: the mount alone judges
its edits (aider prints a refused edit's error for the human; it does not tell the model); its
analytics log, on its stdout, gives the breaker each model call's tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .chat_server import Reply, scripted_chat, search_replace
from .helpers import pip_cli, run_events

# Each test runs guard run for real (root, as CI runs it; a FUSE mount) with aider, whose start
# (litellm's import) takes seconds.
pytestmark = [pytest.mark.root, pytest.mark.mount, pytest.mark.slow]

AIDER_VERSION = "0.86.2"
#: pip_cli's arguments for it (also fetched early by ./dev.sh test: helpers.fetch_pinned_clis).
AIDER_CLI = ("aider-chat", AIDER_VERSION, "aider", "aider")
GOAL = "Fix the tax rounding helper in src/checkout/"
TAX = "def total(x):\n    return x\n"
FIXED = "def total(x):\n    return round(x, 2)\n"
JWT = "KEY = 'k'\n"
#: What the model knows of its model (read from the user's home: no fetch of litellm's price list).
METADATA = {"openai/scripted": {"max_input_tokens": 128000, "max_output_tokens": 4096, "input_cost_per_token": 0,
                                "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}}


@pytest.fixture(scope="session")
def aider_cli() -> Path:
    """The pinned aider, installed from PyPI on first use."""
    return pip_cli(*AIDER_CLI)


def repository(tmp_path: Path, gitconfig: str | None = None, aider: Path | None = None) -> tuple[Path, Path]:
    """A git repository with an untracked .env and the manifest ``guard init`` writes for the task,
    and a read-only HOME holding aider's model metadata (and *gitconfig* as the user's ~/.gitconfig;
    *aider* linked as ``~/.local/bin/aider``, where pipx puts it)."""
    ws, home = tmp_path / "shop", tmp_path / "home"
    for d in ("src/checkout", "src/auth"):
        (ws / d).mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text(TAX)
    (ws / "src/auth/jwt.py").write_text(JWT)
    (ws / "README.md").write_text("readme\n")
    (ws / ".gitignore").write_text(".env\n")
    (ws / ".env").write_text("STRIPE_KEY=sk_live_never_read\n")
    git = ["git", "-C", str(ws), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "shop"], check=True)
    home.mkdir()
    (home / ".aider.model.metadata.json").write_text(json.dumps(METADATA))
    if gitconfig is not None:
        (home / ".gitconfig").write_text(gitconfig)
    if aider is not None:
        (home / ".local/bin").mkdir(parents=True)
        (home / ".local/bin/aider").symlink_to(aider)
    home.chmod(0o555)  # the user's home is never written: aider's HOME is the run's own
    init = subprocess.run([sys.executable, "-m", "sandbox", "init", "--allow", "src/checkout/", GOAL], cwd=ws,
                          capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    assert '".env*"' in (ws / "guard.toml").read_text()  # found, and made a secret
    return ws, home


def run_aider(aider: Path | str, ws: Path, home: Path, run_dir: Path, url: str, *args: str,
              agent: str | None = "aider", cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``guard run [--agent aider] --ci -- aider --yes-always … ARGS`` as a user runs it (the manifest:
    the workspace's guard.toml; *aider* a path, or a name found in ``~/.local/bin``), bounded."""
    command = [str(aider), "--model", "openai/scripted", "--edit-format", "diff", "--yes-always", "--no-analytics",
               "--no-pretty", *args]
    # No git identity of the test's own: aider's commits get the user's, or the guard's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(home), OPENAI_API_BASE=url, OPENAI_API_KEY="sk-test-fake", NO_COLOR="1",
               PYTHONDONTWRITEBYTECODE="1", PATH=f"{home}/.local/bin:{os.environ['PATH']}")
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", *(["--agent", agent] if agent else []), "--ci",
         "--run-dir", str(run_dir), "--", *command],
        cwd=cwd or ws, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )


def git_log(ws: Path) -> list[str]:
    """Each commit as "author <email>: subject [files]", newest first."""
    out = subprocess.run(["git", "-C", str(ws), "log", "--format=%x00%an <%ae>: %s", "--name-only"],
                         capture_output=True, text=True, check=True).stdout
    commits = [c.strip().splitlines() for c in out.split("\0") if c.strip()]
    return [f"{c[0]} {sorted(n for n in c[1:] if n)}" for c in commits]


def trips(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each trip's rule and reason (which names the path)."""
    return [(e["rule"], e.get("reason", "")) for e in events if e["op"] == "trip"]


def tokens(run_dir: Path) -> int:
    """The run's tokens in its ledger."""
    total: int = json.loads((run_dir / "ledger.json").read_text())["tokens"]["total"]
    return total


def own_file_refusals(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Refusals of aider's own files, its git config or the repository's .gitignore: none expected."""
    own = (".aider", ".git/config", ".gitignore")
    return [e for e in events if e.get("decision") == "deny" and str(e.get("path", "")).startswith(own)]


def test_aider_in_scope_edit_lands_out_of_scope_refused_own_files_kept(tmp_path: Path, aider_cli: Path) -> None:
    ws, home = repository(tmp_path)
    run_dir = tmp_path / "run"
    both = (search_replace("src/checkout/tax.py", "    return x\n", "    return round(x, 2)\n") + "\n"
            + search_replace("src/auth/jwt.py", JWT, "KEY = 'stolen'\n"))
    with scripted_chat([Reply(both)]) as (url, model):
        result = run_aider(aider_cli, ws, home, run_dir, url,
                           "--message", "Fix the rounding in total", "src/checkout/tax.py", "src/auth/jwt.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    # The in-scope edit landed; the out-of-scope one was refused by the mount (EROFS). aider says
    # so to the human only: it takes an OSError for a git error, and reflects nothing to the model.
    assert (ws / "src/checkout/tax.py").read_text() == FIXED
    assert (ws / "src/auth/jwt.py").read_text() == JWT
    assert len(model.requests) == 1, model.shown()
    assert "Read-only file system" in (run_dir / "stdout.log").read_text()
    events = run_events(run_dir)
    assert any(e.get("path") == "src/auth/jwt.py" and e.get("decision") == "deny" for e in events), events
    # One trip: the out-of-scope edit. None from aider's own files, its git identity or .gitignore.
    assert [(rule, "src/auth/jwt.py" in why) for rule, why in trips(events)] == [("scope_spill", True)], events
    assert own_file_refusals(events) == [], own_file_refusals(events)
    # Its histories stay in the workspace after the run; its tags cache (a pickle store) did not.
    assert "Fix the rounding in total" in (ws / ".aider.chat.history.md").read_text()
    assert "Fix the rounding in total" in (ws / ".aider.input.history").read_text()
    assert not list(ws.glob(".aider.tags.cache.v*")), sorted(p.name for p in ws.iterdir())
    # aider committed its edit with the guard's identity (the user has none), writing no .git/config
    # of its own and leaving .gitignore as it was (--no-gitignore).
    assert model.commits == 1
    # (aider credits itself in a Co-authored-by trailer, not in the author's name.)
    assert git_log(ws)[0] == "guard <guard@guardfs.invalid>: fix: round the tax to cents ['src/checkout/tax.py']", \
        git_log(ws)
    assert "[user]" not in (ws / ".git/config").read_text()
    assert (ws / ".gitignore").read_text() == ".env\n"
    # aider's HOME was the run's own: the user's home holds what it held, and the guard's own state
    # (its check of git's stores, cached where guard run keeps its runs: ~/.local/state/guardfs).
    assert sorted(p.name for p in home.iterdir()) == [".aider.model.metadata.json", ".local"]
    assert [p.name for p in (home / ".local/state/guardfs").iterdir()] == ["git-history"]
    # Its model call reached the breaker (its analytics log, on stdout): streamed, with aider's own
    # count of the tokens (its prompt is ~2.5k; the other test sees the model's usage, exactly).
    steps = [e for e in events if e["op"] == "step"]
    assert len(steps) == 1 and 2000 < tokens(run_dir) < 4000, steps
    # Its .env read (aider loads the repository's .env at start) was refused without a trip.
    assert "sk_live" not in out and not [t for t in trips(events) if t[0] == "forbidden_path"]


def test_aider_from_local_bin_in_a_subdirectory_commits_as_the_user_and_keeps_its_history(
        tmp_path: Path, aider_cli: Path) -> None:
    ws, home = repository(tmp_path, gitconfig="[user]\n\tname = Dana Dev\n\temail = dana@example.com\n",
                          aider=aider_cli)
    edit = search_replace("src/checkout/tax.py", "    return x\n", "    return round(x, 2)\n")
    again = search_replace("src/checkout/tax.py", "    return round(x, 2)\n", "    return round(x, 2)  # cents\n")
    for n, (message, reply) in enumerate([("Round to cents", edit), ("Say why", again)]):
        with scripted_chat([Reply(reply)]) as (url, model):
            # Found on the user's PATH in ~/.local/bin and detected by its name (no --agent), started
            # from a subdirectory (the workspace is the repository's top level, where aider keeps
            # its history); whole responses rather than a stream.
            result = run_aider("aider", ws, home, tmp_path / f"run{n}", url, "--no-stream",
                               "--message", message, "tax.py", agent=None, cwd=ws / "src/checkout")
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        assert trips(run_events(tmp_path / f"run{n}")) == []
        assert own_file_refusals(run_events(tmp_path / f"run{n}")) == []
        assert len(model.requests) == 1 and model.commits == 1
        # Whole responses: the model's usage, exactly, reached the breaker (aider's analytics log).
        assert tokens(tmp_path / f"run{n}") == 1500 + 100
    # The second run found the first one's history where aider keeps it, and added to it.
    history = (ws / ".aider.chat.history.md").read_text()
    assert history.index("Round to cents") < history.index("Say why"), history
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return round(x, 2)  # cents\n"
    # Both commits carry the user's own identity (their ~/.gitconfig, copied into aider's HOME).
    assert [c.split(":")[0] for c in git_log(ws)[:2]] == ["Dana Dev <dana@example.com>"] * 2, git_log(ws)
    assert "[user]" not in (ws / ".git/config").read_text()



def test_aider_as_a_generic_agent_trips_on_its_own_files(tmp_path: Path, aider_cli: Path) -> None:
    """What the table's entry spares aider (issue 20, finding 9): run as any other command, its
    history at the top level is a scope_spill and its placeholder identity in .git/config a
    second, before the model is ever asked."""
    ws, home = repository(tmp_path)
    run_dir = tmp_path / "run"
    with scripted_chat([Reply("never asked")]) as (url, model):
        result = run_aider(aider_cli, ws, home, run_dir, url, "--message", "Fix the rounding in total",
                           "src/checkout/tax.py", agent="generic")
    assert result.returncode == 75, (result.stdout + result.stderr)[-4000:]
    assert model.requests == []
    reasons = " ".join(why for rule, why in trips(run_events(run_dir)) if rule == "scope_spill")
    # (the second: its identity at start, as here; the issue also saw its tags cache come first)
    assert ".aider.chat.history.md" in reasons and (".git/config" in reasons or ".aider.tags" in reasons), reasons
