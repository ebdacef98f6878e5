"""Issue 12, items 2 and 3, as a hostile agent tries them from inside a real ``guard run``
(as root and as ``--user nobody``), with the host checked afterwards.

Item 2: git's index and refs change a file without touching it. A blob staged with
``git update-index --cacheinfo`` for an out-of-scope path, a commit made through another
index and moved in with ``git update-ref``, a ref written in place: each is refused where it
would land (git reports a failure), HEAD on the host stays where the agent's ordinary,
in-scope commit left it, and the breaker records scope_spill.

Item 3: a forbidden path git tracks is readable through its object store. By
``paths.forbidden_in_git``: "refuse" (the default) does not start the run and names the
path; "hide-git" runs with .git/ forbidden, so ``git show HEAD:.env`` prints nothing of it;
"warn" runs, says so at start naming the path, and ``git show`` prints it (as the README
and docs/reference.md say).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox.breaker.client import GuardClient

from .helpers import FIX_TAX, git_env
from .mounts import guarded_mount

pytestmark = [pytest.mark.root, pytest.mark.mount]

SECRET = "API_TOKEN=s3cr3t-tracked\n"
SESSION = "def session():\n    return 'original'\n"

MANIFEST = FIX_TAX

# The agent: a POSIX shell script, so that nobody can run it. Each move reports NAME=STATUS
# on stderr (the run directory's stderr.log).
COMMON = """
g() { git -c user.name=agent -c user.email=agent@example.invalid -c commit.gpgsign=false "$@"; }
say() { echo "$1=$2" >&2; }
"""

PLUMBING = COMMON + """
echo '# rounded' >> src/checkout/tax.py
g add src/checkout/tax.py; say add $?
g commit -qm fix; say commit $?
b=$(echo owned | git hash-object -w --stdin); say hash $?
git update-index --cacheinfo 100644,$b,src/auth/session.py; say plumb $?
g commit -qm innocent; say innocent $?
echo 'A = 1' > src/checkout/a.py; say back $?
export GIT_INDEX_FILE=/tmp/other-index
git read-tree HEAD && git update-index --cacheinfo 100644,$b,src/auth/session.py; say other_index $?
t=$(git write-tree); c=$(g commit-tree $t -p HEAD -m innocent2); say commit_tree $?
unset GIT_INDEX_FILE
git update-ref refs/heads/main $c; say update_ref $?
echo 'B = 1' > src/checkout/b.py
(echo $c > .git/refs/heads/main); say direct_ref $?
echo 'C = 1' > src/checkout/c.py
(cat .git/index > .git/index); say direct_index $?
"""

SHOW = COMMON + """
git show HEAD:.env; say show $?
git cat-file -p "$(git rev-parse HEAD:.env)"; say cat_file $?
"""


def _workspace(tmp_path: Path, user: str | None, track_secret: bool) -> Path:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/auth").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "src/auth/session.py").write_text(SESSION)
    (ws / ".env").write_text(SECRET)
    env = git_env(tmp_path)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=ws, check=True, env=env)
    subprocess.run(["git", "add", "src"] + ([".env"] if track_secret else []), cwd=ws, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=ws, check=True, env=env)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    return ws


def _guard_run(tmp_path: Path, ws: Path, script: str, user: str | None,
               mode: str | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(MANIFEST + (f'forbidden_in_git = "{mode}"\n' if mode else ""))
    run_dir = tmp_path / "run"
    flags = ["--user", user] if user is not None else []
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(manifest),
         "--run-dir", str(run_dir), "--", "/bin/sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    return proc, run_dir


def _moves(run_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (run_dir / "stderr.log").read_text(errors="replace").splitlines():
        name, eq, status = line.partition("=")
        if eq and status.isdigit():
            out[name] = int(status)
    return out


def _events(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _git(ws: Path, *args: str) -> str:
    env = {**git_env(ws.parent), "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory",
           "GIT_CONFIG_VALUE_0": "*"}
    return subprocess.run(["git", *args], cwd=ws, check=True, capture_output=True, text=True, env=env).stdout


@pytest.mark.parametrize("user", [None, "nobody"])
def test_plumbing_commit_of_an_out_of_scope_file_is_refused(tmp_path: Path, user: str | None) -> None:
    ws = _workspace(tmp_path, user, track_secret=False)
    start = _git(ws, "rev-parse", "HEAD").strip()
    proc, run_dir = _guard_run(tmp_path, ws, PLUMBING, user)
    moves = _moves(run_dir)
    detail = f"{moves}\n{proc.stderr[-3000:]}"
    # The ordinary, in-scope git add + commit works.
    assert moves["add"] == 0 and moves["commit"] == 0, detail
    # Each way of landing the forged blob in git's state fails where git renames it in.
    assert moves["hash"] == 0, detail  # writing an object is not a change of any path
    assert moves["plumb"] != 0, detail
    assert moves["commit_tree"] == 0, detail  # the commit object exists, but no ref may name it
    assert moves["update_ref"] != 0, detail
    assert moves["direct_ref"] != 0, detail
    assert moves["direct_index"] != 0, detail
    # The host: HEAD is the agent's in-scope commit on top of the start, nothing else.
    assert _git(ws, "log", "--format=%s", "main").split() == ["fix", "init"], detail
    assert _git(ws, "rev-parse", "HEAD~1").strip() == start
    assert _git(ws, "show", "HEAD:src/auth/session.py") == SESSION
    assert _git(ws, "show", ":src/auth/session.py") == SESSION  # the index too
    assert "# rounded" in _git(ws, "show", "HEAD:src/checkout/tax.py")
    assert (ws / "src/auth/session.py").read_text() == SESSION
    assert _git(ws, "status", "--porcelain", "--", "src/auth") == ""
    # The breaker saw each refusal as a scope spill naming the path git would have changed.
    events = _events(run_dir)
    spills = [e for e in events if e.get("op") == "trip" and e.get("rule") == "scope_spill"]
    assert len(spills) == 4, spills
    denials = [e for e in events if e.get("decision") == "deny" and e.get("op") == "rename"]
    assert any("src/auth/session.py" in e.get("reason", "") for e in denials), denials
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert [t["rule"] for t in ledger["trips"]] == ["scope_spill"] * 4, ledger["trips"]
    assert proc.returncode == 0, detail  # each trip recovered: the agent went back in scope


def test_a_tracked_forbidden_path_refuses_the_run_by_default(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, None, track_secret=True)
    proc, run_dir = _guard_run(tmp_path, ws, SHOW, None)
    assert proc.returncode == 65, proc.stderr
    assert "git holds secret path(s) .env" in proc.stderr
    assert 'forbidden_in_git = "hide-git"' in proc.stderr  # and says what to do
    assert not (run_dir / "stderr.log").exists()  # no agent ran


@pytest.mark.parametrize("user", [None, "nobody"])
def test_hide_git_keeps_a_tracked_secret_out_of_git_show(tmp_path: Path, user: str | None) -> None:
    ws = _workspace(tmp_path, user, track_secret=True)
    proc, run_dir = _guard_run(tmp_path, ws, SHOW, user, mode="hide-git")
    moves = _moves(run_dir)
    assert "every git directory is forbidden to the agent" in proc.stderr and ".env" in proc.stderr, proc.stderr
    assert moves["show"] != 0 and moves["cat_file"] != 0, moves
    assert "s3cr3t" not in (run_dir / "stdout.log").read_text(errors="replace")
    assert "s3cr3t" not in (run_dir / "stderr.log").read_text(errors="replace")


@pytest.mark.parametrize("user", [None, "nobody"])
def test_warn_runs_and_says_the_tracked_secret_is_readable_through_git(tmp_path: Path, user: str | None) -> None:
    ws = _workspace(tmp_path, user, track_secret=True)
    proc, run_dir = _guard_run(tmp_path, ws, SHOW, user, mode="warn")
    moves = _moves(run_dir)
    banner = [line for line in proc.stderr.splitlines() if "WARNING: git holds secret path(s)" in line]
    assert banner and ".env" in banner[0] and "readable through git" in banner[0], proc.stderr
    # What the README and docs/reference.md say "warn" means: the contents are readable through git.
    assert moves["show"] == 0 and moves["cat_file"] == 0, moves
    assert (run_dir / "stdout.log").read_text().count(SECRET.strip()) == 2


def test_an_untracked_secret_runs_unchanged_under_the_default(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, None, track_secret=False)
    proc, run_dir = _guard_run(tmp_path, ws, SHOW, None)
    assert proc.returncode == 0, proc.stderr
    assert "git holds secret" not in proc.stderr
    assert _moves(run_dir)["show"] != 0  # not in git: nothing to show
    assert os.path.exists(ws / ".env")


@pytest.mark.mount
def test_packed_refs_baseline_and_a_lock_held_open(tmp_path: Path) -> None:
    """Through a guarded mount (no sandbox): a forged commit moved in by packed-refs is
    refused; staging an out-of-scope file as it is on disk (the host's own edit) is not a
    change; a lock file still open for writing cannot be renamed over the index."""

    backing = tmp_path / "backing"
    (backing / "src/checkout").mkdir(parents=True)
    (backing / "README.md").write_text("readme\n")
    (backing / "src/checkout/tax.py").write_text("x = 1\n")
    env = git_env(tmp_path)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=backing, check=True, env=env)
    (backing / "README.md").write_text("readme, edited by the host\n")  # dirty, out of scope
    with guarded_mount(tmp_path, FIX_TAX, run_dir=tmp_path / "run") as g:
        assert g.daemon is not None
        def git(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["git", *args], cwd=g.mnt, env=env, capture_output=True, text=True)
        assert git("add", "README.md").returncode == 0  # its on-disk content: the baseline
        assert git("reset", "-q", "README.md").returncode == 0
        forged = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=g.mnt, env=env, input="owned\n",
                                capture_output=True, text=True, check=True).stdout.strip()
        other = {**env, "GIT_INDEX_FILE": str(tmp_path / "other-index")}
        subprocess.run(["git", "read-tree", "HEAD"], cwd=g.mnt, env=other, check=True)
        subprocess.run(["git", "update-index", "--cacheinfo", f"100644,{forged},README.md"], cwd=g.mnt, env=other,
                       check=True)
        tree = subprocess.run(["git", "write-tree"], cwd=g.mnt, env=other, capture_output=True, text=True,
                              check=True).stdout.strip()
        commit = git("commit-tree", tree, "-p", "HEAD", "-m", "innocent").stdout.strip()
        assert commit
        packed = g.mnt / ".git/packed-refs"
        (g.mnt / ".git/packed-refs.lock").write_text(f"{commit} refs/heads/evil\n")
        with pytest.raises(OSError) as refused:
            os.rename(g.mnt / ".git/packed-refs.lock", packed)
        assert refused.value.errno == 30  # EROFS
        assert not packed.exists()
        assert g.session.breaker.trips[-1].rule.value == "scope_spill"
        with GuardClient(g.daemon.control_path) as operator:
            assert operator.approve()["allow"]  # judged afresh below
        # The index lock held open for writing: refused, whatever it holds now.
        (g.mnt / ".git/index").read_bytes()
        with open(g.mnt / ".git/index.lock", "wb") as f:
            f.write((g.mnt / ".git/index").read_bytes())
            f.flush()
            with pytest.raises(OSError):
                os.rename(g.mnt / ".git/index.lock", g.mnt / ".git/index")
        with GuardClient(g.daemon.control_path) as operator:
            assert operator.approve()["allow"]
        os.unlink(g.mnt / ".git/index.lock")
        assert git("status", "--porcelain").returncode == 0
    host = subprocess.run(["git", "for-each-ref", "--format=%(refname) %(subject)"], cwd=backing, env=env,
                          capture_output=True, text=True, check=True).stdout
    assert host == "refs/heads/main init\n"  # no ref names the forged commit
