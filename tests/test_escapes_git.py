"""Issue 12, item 1: a hostile agent inside a real ``guard run`` tries to make git run its
code on the host, as root and as ``--user nobody``; the host's git afterwards runs nothing.

Each attack is its own run (a refusal is a scope violation, and a second one ends a --ci
run): the agent is a stdlib-only script run by the system's python3 (so ``nobody`` can
run it), reporting one JSON line per move on stdout. After the run the host runs git in
the workspace, as a human would, and a marker file that any hook, fsmonitor, alias or
filter would create must be absent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guardfs.gitguard import config_problems

from .helpers import FIX_TAX, git_env, reports, require, run_events

USERS = [None, "nobody"]

PRELUDE = r'''
import errno, json, os, subprocess, sys
MARK = sys.argv[1]
EVIL = "#!/bin/sh\ntouch " + MARK + "\n"
ENV = dict(os.environ, HOME="/tmp", GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@x",
           GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@x")
def say(move, result):
    print(json.dumps({move: result}), flush=True)
def attempt(move, fn):
    try:
        fn()
        say(move, "SUCCEEDED")
    except OSError as err:
        say(move, errno.errorcode.get(err.errno, str(err.errno)))
def git(move, *args, cwd="."):
    proc = subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, env=ENV, capture_output=True, text=True)
    say(move, proc.returncode)
    return proc.returncode
def write(path, text, mode=0o644):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
'''

HOOKS = r'''
os.mkdir(".git/h2")
write(".git/h2/post-checkout", EVIL, 0o755)
write(".git/h2/pre-commit", EVIL, 0o755)
attempt("rename hooks", lambda: os.rename(".git/hooks", ".git/hooks.old"))
for name in os.listdir(".git/hooks"):
    os.unlink(".git/hooks/" + name)
os.rmdir(".git/hooks")  # an empty hooks directory may go: what replaces it is policed
attempt("symlink hooks", lambda: os.symlink("h2", ".git/hooks"))
attempt("rename onto hooks", lambda: os.rename(".git/h2", ".git/hooks"))
'''

COMMONDIR = r'''
os.makedirs("src/checkout/evil/objects")
os.makedirs("src/checkout/evil/refs")
write("src/checkout/evil/config", '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch ' + MARK + '"\n')
attempt("bare head", lambda: write("src/checkout/evil/HEAD", "ref: refs/heads/master\n"))
write("src/checkout/back.py", "X = 1\n")  # back in scope: the next refusal is a trip of its own
attempt("write commondir", lambda: write(".git/commondir", os.path.abspath("src/checkout/evil") + "\n"))
'''

NESTED = r'''
git("nested git config", "config", "core.fsmonitor", "touch " + MARK, cwd="src/checkout/sub")
attempt("nested append", lambda: open("src/checkout/sub/.git/config", "a").write("[core]\n\tfsmonitor = touch x\n"))
'''

# An agent-created repository: configuring itself works, one setting that runs a program does not.
CREATED = r'''
os.makedirs("src/checkout/new")
assert git("init", "init", "-q", cwd="src/checkout/new") == 0
assert git("user.name", "config", "user.name", "Agent", cwd="src/checkout/new") == 0
assert git("remote", "remote", "add", "origin", "https://example.invalid/x.git", cwd="src/checkout/new") == 0
os.makedirs("src/checkout/hk")
write("src/checkout/hk/pre-commit", EVIL, 0o755)
write("src/checkout/new/.gitattributes", "* filter=x\n")
write("src/checkout/new/a.txt", "a\n")
key, value = sys.argv[2], sys.argv[3]
git("evil", "config", key, value.replace("MARK", MARK), cwd="src/checkout/new")
attempt("direct write", lambda: open("src/checkout/new/.git/config", "a").write("[core]\n\tfsmonitor = touch x\n"))
'''

CREATED_KEYS = [
    ("core.fsmonitor", "touch MARK"),
    ("core.hooksPath", "../hk"),
    ("alias.st", "!touch MARK"),
    ("filter.x.clean", "touch MARK"),
    ("include.path", "MARK.cfg"),
]


def _workspace(tmp_path: Path, user: str | None) -> tuple[Path, Path, Path]:
    """A workspace with a committed repository (and a nested one), its manifest, the marker."""
    require("git")
    env = git_env(tmp_path)
    ws = tmp_path / "ws"
    (ws / "src/checkout/sub").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    for repo in (ws, ws / "src/checkout/sub"):
        subprocess.run(["git", "init", "-q"], cwd=repo, env=env, check=True)
    subprocess.run(["git", "add", "src/checkout/tax.py"], cwd=ws, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "start"], cwd=ws, env=env, check=True)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    manifest = tmp_path / "manifest.toml"
    # The hostile scripts write many files in scope; a nested repository's git internals
    # are not counted (git's bookkeeping), its work tree files are.
    manifest.write_text(FIX_TAX + '[limits]\nmax_files = "unlimited"\n')
    return ws, manifest, tmp_path / "pwned"


def _guard_run(tmp_path: Path, ws: Path, manifest: Path, user: str | None, script: str,
               *args: str) -> tuple[dict[str, object], list[dict[str, object]]]:
    """``guard run --ci`` the hostile script; its moves and the run's denial events."""
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    run_dir = tmp_path / "run"
    flags = ["--user", user] if user is not None else []
    subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(manifest), "--run-dir",
         str(run_dir), "--", python3, "-c", textwrap.dedent(PRELUDE + script), str(tmp_path / "pwned"), *args],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    moves: dict[str, object] = {}
    for report in reports(run_dir / "stdout.log"):
        moves.update(report)
    return moves, [e for e in run_events(run_dir) if e.get("decision") == "deny"]


def _host_git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """git as the human on the host runs it (any owner accepted, so nothing is skipped)."""
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, env=git_env(cwd.parent),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_hooks_directory_replacement_is_refused(tmp_path: Path, user: str | None) -> None:
    ws, manifest, mark = _workspace(tmp_path, user)
    moves, denials = _guard_run(tmp_path, ws, manifest, user, HOOKS)
    assert moves.get("rename hooks") == "EROFS", moves
    refused = {(e["op"], e["path"]) for e in denials}
    assert ("rename", ".git/hooks") in refused
    assert ("symlink", ".git/hooks") in refused or moves.get("symlink hooks") == "EROFS"
    assert not (ws / ".git/hooks").is_symlink()
    assert (ws / ".git/h2/post-checkout").exists()  # the agent's script is there, just not a hook
    _host_git(ws, "checkout", "-q", "-b", "after")
    _host_git(ws, "status")
    _host_git(ws, "commit", "-q", "--allow-empty", "-m", "after")
    assert not mark.exists(), "a hook the agent planted ran on the host"


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_commondir_is_refused(tmp_path: Path, user: str | None) -> None:
    ws, manifest, mark = _workspace(tmp_path, user)
    moves, denials = _guard_run(tmp_path, ws, manifest, user, COMMONDIR)
    assert moves.get("bare head") == "EROFS", moves  # no bare repository outside a .git directory
    assert moves.get("write commondir") == "EROFS", moves
    assert any(e["path"] == ".git/commondir" for e in denials)
    assert not (ws / ".git/commondir").exists()
    assert _host_git(ws, "status").returncode == 0
    assert not mark.exists()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_a_nested_repositorys_config_is_read_only(tmp_path: Path, user: str | None) -> None:
    ws, manifest, mark = _workspace(tmp_path, user)
    before = (ws / "src/checkout/sub/.git/config").read_bytes()
    moves, denials = _guard_run(tmp_path, ws, manifest, user, NESTED)
    assert moves.get("nested git config") not in (None, 0), moves
    assert any(str(e["path"]).startswith("src/checkout/sub/.git/config") for e in denials)
    assert (ws / "src/checkout/sub/.git/config").read_bytes() == before
    _host_git(ws / "src/checkout/sub", "status")
    assert not mark.exists()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize(("key", "value"), CREATED_KEYS)
def test_an_agent_created_repository_configures_itself_but_runs_nothing(
    tmp_path: Path, user: str | None, key: str, value: str,
) -> None:
    ws, manifest, mark = _workspace(tmp_path, user)
    (tmp_path / "pwned.cfg").write_text(f'[core]\n\tfsmonitor = "touch {mark}"\n')
    moves, denials = _guard_run(tmp_path, ws, manifest, user, CREATED, key, value)
    # Configuring itself as git does works; the setting that runs a program is refused.
    assert (moves.get("init"), moves.get("user.name"), moves.get("remote")) == (0, 0, 0), moves
    assert moves.get("evil") not in (None, 0), moves
    assert any(e["rule"] == "built-in: a git config that runs programs" for e in denials), denials
    repo = ws / "src/checkout/new"
    config = (repo / ".git/config").read_text()
    assert key.lower().split(".")[-1] not in config.lower(), config
    assert "Agent" in config and "example.invalid" in config
    for args in (["status"], ["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "x"], ["st"]):
        _host_git(repo, *args)
    assert not mark.exists(), f"{key} ran on the host"


# ----- the config check itself, against git's own parser --------------------------------

@pytest.mark.parametrize(("text", "bad"), [
    ('[core]\n\tfsmonitor = "touch x"\n', ["core.fsmonitor"]),
    ("[core]\n\thooksPath = /tmp\n", ["core.hookspath"]),
    ('[alias]\n\tst = "!sh -c x"\n', ["alias.st"]),
    ("[alias]\n\tst = status\n", []),
    ('[filter "x"]\n\tclean = cat\n', ["filter.x.clean"]),
    ('[diff "x"]\n\ttextconv = cat\n', ["diff.x.textconv"]),
    ("[include]\n\tpath = /etc/x\n", ["include.path"]),
    ('[includeIf "gitdir:/"]\n\tpath = /etc/x\n', ["includeif.gitdir:/.path"]),
    ("[core]\n\tpager = less\n\teditor = vi\n\tsshCommand = ssh\n",
     ["core.editor", "core.pager", "core.sshcommand"]),
    ("[credential]\n\thelper = store\n", ["credential.helper"]),
    ('[remote "o"]\n\turl = ext::sh -c x\n', ["remote.o.url"]),
    ('[remote "o"]\n\turl = https://x\n\tfetch = +refs/heads/*:refs/remotes/o/*\n[user]\n\tname = A\n', []),
    ('[submodule "s"]\n\tpath = s\n\turl = ../s\n', []),
    ("[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n", []),
])
def test_config_problems_by_gits_own_parser(text: str, bad: list[str]) -> None:
    require("git")
    assert config_problems(text.encode()) == bad


def test_an_unparsable_config_is_a_problem() -> None:
    require("git")
    (problem,) = config_problems(b"[core\n")
    assert "unparsable" in problem and "bad config" in problem
