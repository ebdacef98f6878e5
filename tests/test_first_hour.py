"""A new user's first hour (issue 20): their own repository, their own agent, nothing prepared by hand.

The repository is a real third-party one: django-taggit's sdist from PyPI (cached under
``.cache/``), ``git init`` and a commit, with a CI workflow and the app's migrations tracked, a
``.venv`` with Django and what taggit's tests need, an untracked ``.env``; it lives in the user's
home (a fresh directory under /home, with an SSH key in ``~/.ssh``). The user writes no
manifest: the README's quick start does, read out of the README (``tests/readme.py``) so that it cannot
drift: its ``guard init`` line at the repository's top level, then its ``guard run`` line (headless, so
with ``--ci``) from a subdirectory (``docs/``), the agent in place of the README's, where users install
agents: a script in ``~/.local/bin``, a node launcher under an npm prefix in ``$HOME``, the real
Claude Code CLI under npm's user prefix (scripted model on loopback).

The scripted agent runs the project's test suite (the migrations must import: ``**/migrations/``
never reaches into ``.venv``), edits in scope (they land), edits the CI workflow and a migration
(refused as protected, and no refusal to start), reads ``.env`` and ``~/.ssh/id_rsa`` (refused).
After each refusal the guard sees, the agent waits until the guard's console has said so (a
loopback socket: the test answers once the line is there), so each line is shown while the run
goes on; console, ``guard report`` and ``ledger.json`` must agree on the counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from .helpers import TAGGIT_TEST_REQUIREMENTS, git_env, npm_tarballs, reports, run_events, taggit_sources, wait_for
from .hostile import ATTEMPT, SECRET
from .model_server import Turn, scripted_model
from .readme import agent_block, quick_start
from .test_claude_code import CLAUDE_VERSION

# Each test runs guard run for real (root, as CI; a FUSE mount), with a real test suite inside: minutes.
pytestmark = [pytest.mark.root, pytest.mark.mount, pytest.mark.slow]

#: The README's quick start: the clone's directory, ``guard init``'s and ``guard run``'s argv.
QUICK_START = quick_start()
GOAL = QUICK_START.init[-1]
#: The guard, as a user runs it: the console script installed with guardfs.
GUARD = str(Path(sys.executable).parent / "guard")
#: The key the test puts in the user's home: it must appear nowhere the agent's output goes.
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nfirst-hour-test-key-do-not-print\n-----END OPENSSH PRIVATE KEY-----\n"
CI_YML = ("name: CI\non: [push]\njobs:\n  test:\n    runs-on: ubuntu-latest\n    steps:\n"
          "      - uses: actions/checkout@v4\n")
MIGRATION = "taggit/migrations/0001_initial.py"

#: The agent: what a coding agent's tools do (edit files, run shell commands), in a plain
#: script. It starts in docs/ and works from the repository's top level. ``tell(name)`` waits
#: until the test has seen the guard's console line for the refusal the agent just met.
AGENT = ATTEMPT + r'''
import socket, subprocess
def tell(name):
    with socket.create_connection(("127.0.0.1", int(os.environ["FIRST_HOUR_PORT"])), timeout=120) as s:
        s.sendall(name.encode() + b"\n")
        s.recv(1)
def shell(name, command):
    p = subprocess.run(command, shell=True, capture_output=True, text=True)
    print(json.dumps({name: {"status": p.returncode, "stdout": p.stdout[-3000:], "stderr": p.stderr[-3000:]}}),
          flush=True)
def append(path, text):
    with open(path, "a") as f:
        return f.write(text)
print(json.dumps({"cwd": os.getcwd()}), flush=True)
os.chdir("..")
shell("suite", ".venv/bin/python -m django test --settings=tests.settings")
attempt("edit_utils", lambda: append("taggit/utils.py",
    "\n\ndef tag_count(tags):\n    return len({t.lower() for t in tags})\n"))
attempt("edit_ci", lambda: append(".github/workflows/ci.yml", "# only on main\n"))
tell("edit_ci")
attempt("edit_test", lambda: append("tests/test_utils.py",
    "\n\nclass TagCountTests(TestCase):\n    def test_case_insensitive(self):\n"
    "        from taggit.utils import tag_count\n\n        self.assertEqual(tag_count(['a', 'A', 'b']), 2)\n"))
attempt("edit_migration", lambda: append("taggit/migrations/0001_initial.py", "# squashed\n"))
tell("edit_migration")
attempt("edit_utils_again", lambda: append("taggit/utils.py", "# tag_count: tested in tests/test_utils.py\n"))
shell("cat_env", "cat .env")
tell("cat_env")
attempt("edit_test_again", lambda: append("tests/test_utils.py", "# TagCountTests: see taggit/utils.py\n"))
shell("cat_key", "cat ~/.ssh/id_rsa")
shell("suite_again", ".venv/bin/python -m django test --settings=tests.settings tests.test_utils")
'''

#: Each refusal the agent waits on, and the path its console line must name.
TOLD = {"edit_ci": ".github/workflows/ci.yml", "edit_migration": MIGRATION, "cat_env": ".env"}

#: The same agent behind a node launcher, as npm installs a package's ``bin``: the launcher
#: runs the script it ships in its own package tree.
NODE_LAUNCHER = """#!/usr/bin/env node
const { spawnSync } = require("child_process");
const path = require("path");
const run = spawnSync("python3", [path.join(__dirname, "..", "agent.py")], { stdio: "inherit" });
process.exit(run.status === null ? 1 : run.status);
"""


@dataclass
class Repository:
    """The user's clone: its top level, the user's home, and what it held before the run."""

    top: Path
    home: Path
    before: dict[str, bytes] = field(default_factory=dict)


@pytest.fixture
def home() -> Iterator[Path]:
    """A new user's home: a fresh directory under /home, removed afterwards."""
    made = Path(tempfile.mkdtemp(prefix="guardfs-first-hour-", dir="/home"))
    try:
        yield made
    finally:
        shutil.rmtree(made)


@pytest.fixture
def taggit(home: Path) -> Repository:
    """django-taggit 5.0.1 as a repository in ``~/src``: committed, with a CI workflow and its
    migrations tracked, a ``.venv`` with its test requirements, an untracked ``.env``; and an
    SSH key in the home."""
    sdist, wheelhouse = taggit_sources()
    top = home / "src" / QUICK_START.clone_dir
    top.parent.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(top.parent, filter="data")
    (top.parent / sdist.name.removesuffix(".tar.gz")).rename(top)
    (top / ".github/workflows").mkdir(parents=True)
    (top / ".github/workflows/ci.yml").write_text(CI_YML)
    (top / ".gitignore").write_text(".venv/\n.env\n__pycache__/\n*.egg-info/\n")
    env = git_env(home)
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "django-taggit 5.0.1"]):
        subprocess.run(argv, cwd=top, env=env, check=True, capture_output=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", ".venv"], cwd=top, check=True)
    subprocess.run([".venv/bin/pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse),
                    *TAGGIT_TEST_REQUIREMENTS], cwd=top, check=True, capture_output=True)
    (top / ".env").write_text(SECRET)
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh/id_rsa").write_text(KEY)
    (home / ".ssh/id_rsa").chmod(0o600)
    tracked = [".github/workflows/ci.yml", MIGRATION, "taggit/utils.py", "tests/test_utils.py"]
    return Repository(top, home, {p: (top / p).read_bytes() for p in tracked})


def user_env(home: Path, *path: Path, **extra: str) -> dict[str, str]:
    """The user's environment: their home, their PATH (their own bin directories first); no
    setting of this test suite's (PYTHONDONTWRITEBYTECODE, XDG_*, a virtualenv)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XDG_", "GIT_", "PYTHON", "VIRTUAL_ENV", "CI", "GUARD"))}
    env.update(HOME=str(home), PATH=":".join([*map(str, path), "/usr/local/bin", "/usr/bin", "/bin"]), **extra)
    return env


def guard_init(repo: Repository) -> subprocess.CompletedProcess[str]:
    """The README's ``guard init`` line (``--allow taggit/ --allow tests/ GOAL``) at the top level."""
    proc = subprocess.run([GUARD, *QUICK_START.init[1:]], cwd=repo.top,
                          env=user_env(repo.home), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (repo.top / "guard.toml").is_file(), proc.stdout + proc.stderr
    return proc


class Console:
    """The guard's stderr (the human's console) and stdout, read line by line as they come."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None and proc.stdout is not None
        self.lines: list[str] = []
        self.out: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(proc.stderr, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(proc.stdout, self.out), daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def join(self) -> None:
        for reader in self._readers:
            reader.join(timeout=60)

    def refusals(self) -> list[str]:
        """The lines saying an operation was refused (one per refusal, as they happen)."""
        return [line for line in list(self.lines) if REFUSAL_LINE.search(line)]

    def text(self) -> str:
        return "\n".join(["--- stderr", *self.lines, "--- stdout", *self.out])


#: A console line for one refusal (sandbox.launch.console): what was refused, on which path, by which rule.
REFUSAL_LINE = re.compile(r"^guard: denied ")


class Pacer:
    """The agent's partner on loopback: after each refusal the agent names it and waits; the
    answer comes once the console shows a refusal line naming its path (or after a bound)."""

    def __init__(self, console: list[Console]) -> None:
        self.console = console  # filled in once the guard is started
        self.seen: dict[str, str | None] = {}
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        with conn.makefile() as lines:
            name = lines.readline().strip()
        with contextlib.suppress(TimeoutError):  # the agent goes on; the test fails on what it saw
            wait_for(lambda: self._line(name) is not None, f"the console's line for {name}", timeout=30)
        self.seen[name] = self._line(name)
        conn.sendall(b"k")

    def _line(self, name: str) -> str | None:
        """The first refusal line naming *name*'s path that no earlier refusal was answered with."""
        path = TOLD.get(name, name)
        return next((x for x in self.console[0].refusals() if path in x and x not in self.seen.values()), None)

    def close(self) -> None:
        self._server.close()
        self._thread.join(timeout=10)


def guard_run(repo: Repository, path: list[Path], argv: list[str], env: dict[str, str] | None = None,
              ) -> tuple[int, Console, Pacer]:
    """The README's ``guard run`` line from ``docs/``, headless (``--ci``), with ARGV for its agent,
    found on the user's *path*."""
    holder: list[Console] = []
    pacer = Pacer(holder)
    options = QUICK_START.run[1:QUICK_START.run.index("--")]
    proc = subprocess.Popen([GUARD, *options, "--ci", "--", *argv], cwd=repo.top / "docs", text=True,
                            env=env or user_env(repo.home, *path, FIRST_HOUR_PORT=str(pacer.port)),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    holder.append(Console(proc))
    try:
        status = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        holder[0].join()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        pacer.close()
    return status, holder[0], pacer


def run_dir_of(console: Console) -> Path:
    """The run directory the guard printed at start."""
    for line in console.lines:
        if m := re.match(r"guard: run directory (/\S+)", line):
            return Path(m.group(1))
    raise AssertionError("the guard printed no run directory:\n" + console.text())


def install_local_bin(home: Path) -> list[Path]:
    """The agent as ``~/.local/bin/agent``: the user's PATH directory."""
    bin_dir = home / ".local/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "agent").write_text("#!/usr/bin/python3\n" + AGENT)
    (bin_dir / "agent").chmod(0o755)
    return [bin_dir]


def install_npm_prefix(home: Path, tmp_path: Path) -> list[Path]:
    """The agent as a node package, ``npm install -g --prefix ~/.npm-global`` of its tarball (offline)."""
    package = tmp_path / "first-hour-agent"
    (package / "bin").mkdir(parents=True)
    (package / "package.json").write_text(json.dumps(
        {"name": "first-hour-agent", "version": "1.0.0", "bin": {"agent": "bin/agent.js"}}))
    (package / "bin/agent.js").write_text(NODE_LAUNCHER)
    (package / "agent.py").write_text(AGENT)
    env = user_env(home)
    packed = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(tmp_path), str(package)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stderr
    tarball = tmp_path / json.loads(packed.stdout)[0]["filename"]
    npm_install_global(home, [tarball])
    return [home / ".npm-global/bin"]


def npm_install_global(home: Path, tarballs: list[Path]) -> None:
    """``npm install -g --prefix ~/.npm-global TARBALL…`` as the user, offline."""
    proc = subprocess.run(["npm", "install", "-g", "--prefix", str(home / ".npm-global"), "--offline", "--no-audit",
                           "--no-fund", "--no-update-notifier", *map(str, tarballs)],
                          env=user_env(home), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def refusal_events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events that refused the agent something (the definition every count shares)."""
    from guardfs.events import tally_kind

    return [e for e in run_events(run_dir) if tally_kind(e["op"], e["decision"]) == "denials"]


def report_counts(run_dir: Path, home: Path) -> dict[str, int]:
    """The counts ``guard report`` shows."""
    proc = subprocess.run([GUARD, "report", "--run-dir", str(run_dir), "--html", "-"], env=user_env(home),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {kind: int(n) for kind, n in re.findall(r"\b(denials|trips): (\d+)", proc.stdout)}


@pytest.mark.parametrize("install", ["local-bin", "npm-prefix"])
def test_first_hour_with_an_agent_installed_in_the_home(taggit: Repository, tmp_path: Path, install: str) -> None:
    repo = taggit
    guard_init(repo)
    path = install_local_bin(repo.home) if install == "local-bin" else install_npm_prefix(repo.home, tmp_path)
    status, console, pacer = guard_run(repo, path, ["agent"])
    run_dir = run_dir_of(console)
    log = run_dir / "stdout.log"
    said = {k: v for r in (reports(log) if log.exists() else []) for k, v in r.items()}
    why = console.text() + "\n--- agent\n" + json.dumps(said, indent=1)
    # It started (no refusal to start: the manifest protects, not hides, what git tracks) and ended well.
    assert status == 0, why
    # The agent started where the user was, in the repository's own paths.
    assert said["cwd"] == str(repo.top / "docs"), why
    # The project's test suite ran, migrations and all (Django's own django.db.migrations included).
    assert said["suite"]["status"] == 0, why
    assert said["suite_again"]["status"] == 0 and "Ran " in said["suite_again"]["stderr"], why
    # In-scope edits landed, on the real repository.
    for edit in ("edit_utils", "edit_test", "edit_utils_again", "edit_test_again"):
        assert isinstance(said[edit], int), (edit, why)
    assert "def tag_count(tags):" in (repo.top / "taggit/utils.py").read_text()
    assert "class TagCountTests(TestCase):" in (repo.top / "tests/test_utils.py").read_text()
    # The CI workflow and the migration are protected: readable, never written.
    assert said["edit_ci"] == "EROFS" and said["edit_migration"] == "EROFS", why
    for kept in (".github/workflows/ci.yml", MIGRATION):
        assert (repo.top / kept).read_bytes() == repo.before[kept], kept
    # The secrets stayed secret: .env in the workspace, the SSH key in the home.
    assert said["cat_env"]["status"] != 0 and SECRET.strip() not in said["cat_env"]["stdout"], why
    assert said["cat_key"]["status"] != 0 and "first-hour-test-key" not in said["cat_key"]["stdout"], why
    assert not any("first-hour-test-key" in p.read_text(errors="replace") for p in run_dir.iterdir() if p.is_file())
    # The refusals were the guard's, each for its class.
    refused = refusal_events(run_dir)
    rules = {e["path"]: e.get("rule") for e in refused}
    assert rules.get(".github/workflows/ci.yml") == "paths.protected", refused
    assert rules.get(MIGRATION) == "paths.protected", refused
    assert rules.get(".env") in {"paths.secret", "paths.forbidden"}, refused
    assert not any(e["path"].startswith(".venv/") for e in refused), refused  # **/ never reached into .venv
    trips = sum(1 for e in run_events(run_dir) if e["op"] == "trip")
    # The console said each refusal while the run went on (the agent waited for it), one line each.
    assert pacer.seen == {name: pacer.seen.get(name) for name in TOLD} and all(pacer.seen.values()), (
        pacer.seen, why)
    assert all("[paths.protected]" in str(pacer.seen[n]) and "EROFS" in str(pacer.seen[n])
               for n in ("edit_ci", "edit_migration")), pacer.seen
    assert len(console.refusals()) == len(refused), why
    assert sum(line.startswith("guard: TRIP ") for line in console.lines) == trips, why
    # Console, report and ledger agree on the counts.
    ledger = json.loads((run_dir / "ledger.json").read_text())
    summary = dict(re.findall(r"\b(denials|trips): (\d+)", "\n".join(console.lines)))
    assert {k: int(v) for k, v in summary.items()} == {"denials": len(refused), "trips": trips}, why
    assert ledger["counts"] == {"denials": len(refused), "trips": trips}, ledger.get("counts")
    assert report_counts(run_dir, repo.home) == {"denials": len(refused), "trips": trips}


def claude_tarballs() -> list[Path]:
    """The pinned Claude Code package and its native build for this machine, as npm tarballs."""
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    return npm_tarballs([f"@anthropic-ai/claude-code@{CLAUDE_VERSION}",
                         f"@anthropic-ai/claude-code-linux-{arch}@{CLAUDE_VERSION}"],
                        f"claude-code-{CLAUDE_VERSION}-npm")


def test_first_hour_with_claude_code_installed_under_npms_user_prefix(taggit: Repository) -> None:
    repo = taggit
    guard_init(repo)
    npm_install_global(repo.home, claude_tarballs())
    utils = str(repo.top / "taggit/utils.py")
    turns = [
        Turn("Read", {"file_path": utils}),
        Turn("Edit", {"file_path": utils, "old_string": "def edit_string_for_tags(tags):\n",
                      "new_string": "def tag_count(tags):\n    return len({t.lower() for t in tags})\n\n\n"
                                    "def edit_string_for_tags(tags):\n"}),
        Turn("Bash", {"command": "cd .. && .venv/bin/python -m django test --settings=tests.settings tests.test_utils",
                      "description": "run the utils tests"}),
        Turn(text="Added tag_count()."),
    ]
    with scripted_model(turns) as (url, model):
        env = user_env(repo.home, repo.home / ".npm-global/bin", ANTHROPIC_BASE_URL=url,
                       ANTHROPIC_API_KEY="sk-test-fake", IS_SANDBOX="1", DISABLE_TELEMETRY="1",
                       CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
        # The README's headless line for Claude Code, with the quick start's goal as its prompt.
        argv = agent_block("claude")
        argv[argv.index("-p") + 1] = GOAL
        proc = subprocess.run(
            [GUARD, *argv[1:]],
            cwd=repo.top / "docs", env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    why = proc.stdout[-4000:] + proc.stderr[-4000:] + "\n--- tool errors\n" + "\n".join(model.tool_errors())
    assert proc.returncode == 0, why
    assert "def tag_count(tags):" in (repo.top / "taggit/utils.py").read_text(), why
    assert not model.tool_errors(), why
    # Its test run saw the edit: the tool result the model got last (Django's "OK").
    assert "OK" in json.dumps(model.requests[-1]["messages"][-1]), why
