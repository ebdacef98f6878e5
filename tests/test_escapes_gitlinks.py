"""Issue 12, git's links and logs, as a hostile agent tries them from inside a real
``guard run --ci`` (as root and as ``--user nobody``), with the host checked afterwards.

- A gitfile (a ``.git`` that is a file), a linked worktree's ``gitdir`` and ``commondir``
  point git at another git directory: ``git worktree add`` and ``git submodule add`` work in
  scope, and the host's git afterwards uses what they made; a gitfile naming a plain
  directory (whose ``config`` no name polices), a repository outside the workspace, or a
  path through ``..`` after a name, a ``commondir`` or ``gitdir`` naming elsewhere, a bare
  repository's ``HEAD`` outside any ``.git``, a symlink inside ``.git``: each refused where
  it would land, and the host's git runs nothing.
- ``ORIG_HEAD``, ``FETCH_HEAD`` and the reflogs name commits a later ``git reset --hard
  ORIG_HEAD``, ``git merge FETCH_HEAD``, ``git stash pop`` or ``git reset --hard HEAD@{1}``
  checks out: none may name a forged commit that changes an out-of-scope path, while git's
  own ``reset``, ``fetch`` and ``stash`` work.
- A trip's feedback is delivered on the agent's next write, never on git's index update.

Each refused move is followed by an in-scope write (back in scope), so the next refusal is a
trip of its own and the --ci run recovers.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import FIX_TAX, git_env, reports, require, run_events

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]
SESSION = "def session():\n    return 'original'\n"

PRELUDE = r'''
import errno, json, os, subprocess, sys
MARK = sys.argv[1]
OUTSIDE = sys.argv[2]
ENV = dict(os.environ, HOME="/tmp", GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@x",
           GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@x", GIT_CONFIG_COUNT="2",
           GIT_CONFIG_KEY_0="safe.directory", GIT_CONFIG_VALUE_0="*",
           GIT_CONFIG_KEY_1="protocol.file.allow", GIT_CONFIG_VALUE_1="always")
BACK = [0]
def say(move, result):
    print(json.dumps({move: result}), flush=True)
def back():
    BACK[0] += 1
    with open("src/checkout/back%d.py" % BACK[0], "w") as f:
        f.write("X = 1\n")
def attempt(move, fn):
    try:
        fn()
        say(move, "SUCCEEDED")
    except OSError as err:
        say(move, errno.errorcode.get(err.errno, str(err.errno)))
    back()
def git(move, *args, cwd="."):
    proc = subprocess.run(["git", *args], cwd=cwd, env=ENV, capture_output=True, text=True)
    say(move, proc.returncode)
    if proc.returncode:
        print(move, proc.stderr, file=sys.stderr)
    return proc.stdout.strip()
def write(path, text, mode="w"):
    # One write(2): a buffered file would retry a refused write when it closes.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
'''

# The legitimate forms: a linked worktree of the workspace's repository, a submodule in a
# repository the agent made, each used for a commit.
LEGIT = r'''
git("worktree", "worktree", "add", "-q", "-b", "wt", "src/checkout/wt")
write("src/checkout/wt/src/checkout/tax.py", "# in the worktree\n", "a")
git("worktree commit", "commit", "-qam", "in the worktree", cwd="src/checkout/wt")
os.makedirs("src/checkout/lib")
os.makedirs("src/checkout/app")
for repo in ("src/checkout/lib", "src/checkout/app"):
    git("init " + repo, "init", "-q", cwd=repo)
    write(repo + "/r.txt", repo + "\n")
    git("add " + repo, "add", "r.txt", cwd=repo)
    git("commit " + repo, "commit", "-qm", "start", cwd=repo)
git("submodule", "submodule", "add", "-q", "../lib", "lib", cwd="src/checkout/app")
git("submodule commit", "commit", "-qm", "with lib", cwd="src/checkout/app")
'''

LINKS = r'''
os.makedirs("src/checkout/evil/objects")
os.makedirs("src/checkout/evil/refs")
write("src/checkout/evil/config", '[core]\n\tfsmonitor = "touch ' + MARK + '"\n')
attempt("bare head", lambda: write("src/checkout/evil/HEAD", "ref: refs/heads/master\n"))
os.makedirs("src/checkout/x")
attempt("gitfile plain", lambda: write("src/checkout/x/.git", "gitdir: ../evil\n"))
attempt("gitfile outside", lambda: write("src/checkout/x/.git", "gitdir: " + OUTSIDE + "\n"))
attempt("gitfile dotdot", lambda: write("src/checkout/x/.git", "gitdir: ../evil/../../../.git\n"))
os.makedirs("src/checkout/y")
write("src/checkout/y/prepared", "gitdir: " + OUTSIDE + "\n")
attempt("rename gitfile", lambda: os.rename("src/checkout/y/prepared", "src/checkout/y/.git"))
os.makedirs(".git/worktrees/w")
attempt("commondir", lambda: write(".git/worktrees/w/commondir", os.path.abspath("src/checkout/evil") + "\n"))
attempt("gitdir", lambda: write(".git/worktrees/w/gitdir", "/etc/.git\n"))
attempt("symlink in git", lambda: os.symlink(os.path.abspath("src/checkout/evil"), ".git/modules"))
write(".git/worktrees/w/commondir", "../..\n")  # what git writes: its own repository
say("own commondir", "SUCCEEDED")
'''

# A commit the agent forges with plumbing: HEAD with an out-of-scope file changed.
FORGE = r'''
blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], input="owned\n", env=ENV, capture_output=True,
                      text=True, check=True).stdout.strip()
other = dict(ENV, GIT_INDEX_FILE="/tmp/forge-index-%d" % os.getpid())
subprocess.run(["git", "read-tree", "HEAD"], env=other, check=True)
subprocess.run(["git", "update-index", "--cacheinfo", "100644," + blob + ",src/auth/session.py"], env=other,
               check=True)
tree = subprocess.run(["git", "write-tree"], env=other, capture_output=True, text=True, check=True).stdout.strip()
forged = subprocess.run(["git", "commit-tree", tree, "-p", "HEAD", "-m", "innocent"], env=ENV, capture_output=True,
                        text=True, check=True).stdout.strip()
'''

# The forged commit named by each file that names commits.
LOGS = FORGE + r'''
say("forged", forged)
head = git("head", "rev-parse", "HEAD")
line = "%s %s a <a@x> 1700000000 +0000\treset: moving to HEAD@{1}\n" % (head, forged)
attempt("reflog append", lambda: write(".git/logs/HEAD", line, "a"))
attempt("fetch head", lambda: write(".git/FETCH_HEAD", forged + "\t\tbranch 'main' of origin\n"))
git("orig head", "update-ref", "ORIG_HEAD", forged)
back()
git("stash store", "stash", "store", "-m", "wip", forged)
back()
# git's own use of them, in scope.
write("src/checkout/tax.py", "# rounded\n", "a")
git("commit", "commit", "-qam", "round")
git("reset soft", "reset", "-q", "--soft", "HEAD~1")
git("recommit", "commit", "-qm", "round again")
git("fetch", "fetch", "-q", ".", "main:refs/remotes/self/main")
write("src/checkout/tax.py", "# wip\n", "a")
git("stash", "stash", "-q")
git("stash pop", "stash", "pop", "-q")
'''

# A rebase left in progress: `git rebase --continue` on the host would run its exec lines and
# apply its picks, `git rebase --abort` would reset to its orig-head.
REBASE = r'''
for i in (1, 2, 3):
    write("src/checkout/tax.py", "# %d\n" % i, "a")
    git("commit %d" % i, "commit", "-qam", "c%d" % i)
git("rebase -x", "rebase", "-q", "-x", "true", "HEAD~1")  # its todo would hold an exec line
back()
git("rebase abort", "rebase", "--abort")
env = dict(ENV, GIT_SEQUENCE_EDITOR="sed -i s/^pick/edit/")
proc = subprocess.run(["git", "rebase", "-q", "-i", "HEAD~2"], env=env, capture_output=True, text=True)
say("rebase -i", proc.returncode)
''' + FORGE + r'''
todo = ".git/rebase-merge/git-rebase-todo"
attempt("exec line", lambda: write(todo, "exec touch " + MARK + "\n", "a"))
attempt("forged pick", lambda: write(todo, "pick " + forged[:9] + " innocent\n", "a"))
attempt("forged orig-head", lambda: write(".git/rebase-merge/orig-head", forged + "\n", "a"))
'''

# Git putting back a committed version is no return of the agent's; a program that only
# calls itself git, doing the same, makes the agent's own return (its second here: a trip).
RESTORE = r'''
START = open("src/checkout/tax.py").read()
def overwrite(text):
    fd = os.open("src/checkout/tax.py", os.O_RDWR | os.O_TRUNC)
    os.write(fd, text.encode())
    os.close(fd)
overwrite("def total(x):\n    return 2\n")
git("checkout", "checkout", "--", "src/checkout/tax.py")
say("restored", open("src/checkout/tax.py").read() == START)
# The agent's own return to 2: its first (allowed), since git's put-back counted none.
attempt("again", lambda: overwrite("def total(x):\n    return 2\n"))
THREE = "def total(x):\n    return 2\n\nRATE = 3\n"
overwrite(THREE)
git("commit", "commit", "-qm", "three", "--", "src/checkout/tax.py")
overwrite(THREE.replace("3", "4"))
os.makedirs("/tmp/fake", exist_ok=True)
fake = "/tmp/fake/git"
with open(sys.executable, "rb") as src, open(fake, "wb") as dst:
    dst.write(src.read())
os.chmod(fake, 0o755)
code = "import os; fd = os.open('src/checkout/tax.py', os.O_RDWR | os.O_TRUNC); os.write(fd, %r.encode())" % THREE
proc = subprocess.run([fake, "-c", code], capture_output=True, text=True)
say("fake git", proc.returncode)
'''

# A real oscillation (A -> B -> A -> B, the agent's own writes), written in place so that it
# is found when the write lands: the trip owes feedback to the next write.
FEEDBACK = r'''
def overwrite(text):
    fd = os.open("src/checkout/tax.py", os.O_RDWR)
    os.write(fd, text.encode())
    os.close(fd)
for text in ("def total(x):\n    return 2\n", "def total(x):\n    return 1\n", "def total(x):\n    return 2\n"):
    overwrite(text)
git("add", "add", "src/checkout/tax.py")
git("commit", "commit", "-qm", "two")
attempt("next write", lambda: write("src/checkout/later.py", "Y = 1\n"))
attempt("then", lambda: write("src/checkout/later2.py", "Y = 1\n"))
'''


def _workspace(tmp_path: Path, user: str | None) -> tuple[Path, Path, Path]:
    """A committed repository with src/checkout/ in scope and src/auth/ out of it; its
    manifest; a repository outside the workspace whose config would run a program."""
    require("git")
    env = git_env(tmp_path)
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/auth").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return 1\n")
    (ws / "src/auth/session.py").write_text(SESSION)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "start"]):
        subprocess.run(["git", *args], cwd=ws, env=env, check=True)
    outside = tmp_path / "outside"
    subprocess.run(["git", "init", "-q", str(outside)], env=env, check=True)
    subprocess.run(["git", "config", "core.fsmonitor", f"touch {tmp_path / 'pwned'}"], cwd=outside, env=env,
                   check=True)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(FIX_TAX + '[limits]\nmax_files = "unlimited"\n')
    return ws, manifest, outside


def _guard_run(tmp_path: Path, ws: Path, manifest: Path, user: str | None, script: str, outside: Path,
               ) -> tuple[dict[str, object], list[dict[str, object]], subprocess.CompletedProcess[str]]:
    """``guard run --ci`` the hostile script; its moves, the run's events and the process."""
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    run_dir = tmp_path / "run"
    flags = ["--user", user] if user is not None else []
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(manifest), "--run-dir",
         str(run_dir), "--", python3, "-c", textwrap.dedent(PRELUDE + script), str(tmp_path / "pwned"),
         str(outside / ".git")],
        cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    moves: dict[str, object] = {}
    for report in reports(run_dir / "stdout.log"):
        moves.update(report)
    return moves, run_events(run_dir), proc


def _host_git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """git as the human on the host runs it (any owner accepted, so nothing is skipped)."""
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, env=git_env(cwd),
                          capture_output=True, text=True, timeout=60)


def _trips(events: list[dict[str, object]]) -> list[object]:
    return [e["rule"] for e in events if e.get("op") == "trip"]


@pytest.mark.parametrize("user", USERS)
def test_worktrees_and_submodules_work_in_scope(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, LEGIT, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0 and _trips(events) == [], detail
    assert {k: v for k, v in moves.items() if v != 0} == {}, detail
    # The host's git uses what git made inside the sandbox.
    listed = _host_git(ws, "worktree", "list", "--porcelain").stdout
    assert f"worktree {ws / 'src/checkout/wt'}" in listed, listed
    assert _host_git(ws / "src/checkout/wt", "log", "--format=%s", "-1").stdout == "in the worktree\n"
    assert _host_git(ws / "src/checkout/wt", "status", "--porcelain").stdout == ""
    app = ws / "src/checkout/app"
    assert (app / "lib/.git").read_text() == "gitdir: ../.git/modules/lib\n"
    status = _host_git(app, "submodule", "status")
    assert status.returncode == 0 and " lib " in status.stdout, status
    assert _host_git(app / "lib", "status", "--porcelain").stdout == ""
    # The workspace's own history: the worktree's commit is on its branch, main untouched.
    assert _host_git(ws, "log", "--format=%s", "main").stdout == "start\n"


@pytest.mark.parametrize("user", USERS)
def test_gitfiles_and_worktree_links_that_point_away_are_refused(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    mark = tmp_path / "pwned"
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, LINKS, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    refused = ["bare head", "gitfile plain", "gitfile outside", "gitfile dotdot", "rename gitfile", "commondir",
               "gitdir", "symlink in git"]
    assert {m: moves.get(m) for m in refused} == dict.fromkeys(refused, "EROFS"), detail
    assert moves.get("own commondir") == "SUCCEEDED", detail
    assert _trips(events) == ["scope_spill"] * len(refused), detail
    reasons = " ".join(str(e.get("reason")) for e in events if e.get("decision") == "deny")
    assert "outside the workspace" in reasons and "bare repository" in reasons, reasons
    assert proc.returncode == 0, detail  # each trip recovered: the agent went back in scope
    # The host: no gitfile names anything but nothing at all, no bare repository, no symlink.
    for gitfile in (ws / "src/checkout/x/.git", ws / "src/checkout/y/.git"):
        assert not gitfile.exists() or "gitdir" not in gitfile.read_text(), gitfile.read_text()
    assert not (ws / "src/checkout/evil/HEAD").exists()
    assert not (ws / ".git/modules").is_symlink()
    assert (ws / ".git/worktrees/w/commondir").read_text() == "../..\n"
    assert not (ws / ".git/worktrees/w/gitdir").read_text().strip()
    for where in ("src/checkout/x", "src/checkout/y", "src/checkout/evil", "."):
        _host_git(ws / where, "status")
    _host_git(ws, "worktree", "prune")
    assert not mark.exists(), "a configuration the agent pointed git at ran on the host"


@pytest.mark.parametrize("user", USERS)
def test_reflogs_fetch_head_and_orig_head_name_no_forged_commit(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, LOGS, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    forged = str(moves["forged"])
    assert len(forged) == 40, detail
    assert moves["reflog append"] == "EROFS" and moves["fetch head"] == "EROFS", detail
    assert moves["orig head"] != 0 and moves["stash store"] != 0, detail
    # git's own reset, fetch and stash work in scope.
    assert [moves[m] for m in ("commit", "reset soft", "recommit", "fetch", "stash", "stash pop")] == [0] * 6, detail
    assert _trips(events) == ["scope_spill"] * 4, detail
    assert proc.returncode == 0, detail
    # The host: nothing names the forged commit, so nothing can check it out later.
    for path in [ws / ".git/FETCH_HEAD", ws / ".git/ORIG_HEAD", *(ws / ".git/logs").rglob("*")]:
        assert not path.is_file() or forged not in path.read_text(), path
    assert _host_git(ws, "stash", "list").stdout == ""
    for rev in ("ORIG_HEAD", "FETCH_HEAD", "HEAD@{1}", "HEAD@{2}"):
        shown = _host_git(ws, "show", f"{rev}:src/auth/session.py")
        assert shown.returncode != 0 or shown.stdout == SESSION, (rev, shown)
    assert _host_git(ws, "reset", "-q", "--hard", "HEAD@{1}").returncode == 0
    assert (ws / "src/auth/session.py").read_text() == SESSION


@pytest.mark.parametrize("user", USERS)
def test_a_trips_feedback_lands_on_the_next_write_not_on_gits_index(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, FEEDBACK, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    assert _trips(events) == ["oscillation"], detail
    # git's index and ref updates went through: git is never left half-done.
    assert moves["add"] == 0 and moves["commit"] == 0, detail
    assert _host_git(ws, "show", "HEAD:src/checkout/tax.py").stdout == "def total(x):\n    return 2\n"
    assert _host_git(ws, "status", "--porcelain", "--", "src/checkout/tax.py").stdout == ""
    # The feedback reached the agent on its own next write, and the one after went through.
    assert moves["next write"] == "EDQUOT" and moves["then"] == "SUCCEEDED", detail
    delivered = [e for e in events if e.get("op") == "breaker" and e.get("reason") == "delivering feedback"]
    assert [e["path"] for e in delivered] == ["create src/checkout/later.py"], delivered


@pytest.mark.parametrize("user", USERS)
def test_a_rebase_left_in_progress_runs_and_checks_out_nothing(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    mark = tmp_path / "pwned"
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, REBASE, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    # git's own interactive rebase of the agent's commits works (no trip for putting back
    # the versions it committed); what would run or land on the host later is refused.
    assert [moves[f"commit {i}"] for i in (1, 2, 3)] == [0, 0, 0] and moves["rebase -i"] == 0, detail
    assert [moves[m] for m in ("exec line", "forged pick", "forged orig-head")] == ["EROFS"] * 3, detail
    assert moves["rebase -x"] != 0 and moves["rebase abort"] == 0, detail  # never an exec line in a todo
    assert _trips(events) == ["scope_spill"] * 4, detail
    state = ws / ".git/rebase-merge"
    assert "exec" not in (state / "git-rebase-todo").read_text()
    # The human continues, then aborts: nothing runs, nothing out of scope lands.
    _host_git(ws, "rebase", "--continue")
    _host_git(ws, "rebase", "--abort")
    assert not mark.exists(), "an exec line of the agent's ran on the host"
    assert (ws / "src/auth/session.py").read_text() == SESSION
    assert _host_git(ws, "show", "HEAD:src/auth/session.py").stdout == SESSION


@pytest.mark.parametrize("user", USERS)
def test_only_git_itself_puts_a_version_back_without_a_trip(tmp_path: Path, user: str | None) -> None:
    ws, manifest, outside = _workspace(tmp_path, user)
    moves, events, proc = _guard_run(tmp_path, ws, manifest, user, RESTORE, outside)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    assert moves["checkout"] == 0 and moves["restored"] is True and moves["again"] == "SUCCEEDED", detail
    # The copy named git is not the git binary: its return to a committed version is the
    # agent's second return, a trip (git's own would have been exempt, once per version).
    assert moves["commit"] == 0 and moves["fake git"] != 0, detail
    assert _trips(events) == ["oscillation"], detail
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return 2\n\nRATE = 4\n"  # refused, kept
