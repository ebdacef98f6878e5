"""Issue 21, items 4, 5, 6 and 8 (git), as a hostile agent tries them from inside a real
``guard run --ci`` (as root and as ``--user nobody``), the host checked afterwards.

4. A secret anywhere in git's store: an earlier commit, another branch, the stash, a commit
   no ref reaches, a tree no commit holds, a blob no tree holds. 5. A nested repository
   (ignored by the root one) tracking a secret. 6. A workspace whose ``.git`` is a file: a
   linked worktree, ``git init --separate-git-dir`` (the git directory outside the
   workspace, and inside it under another name). 8. A loose object hard-linked into a fast
   lane under ``hide-git``.

Each case is run three ways: ``refuse`` (the default) does not start and names where the
secret lives; ``hide-git`` runs and the agent's git reads fail; ``warn`` runs and the same
reads print the secret (the control: the case is real, so the first two can fail).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .helpers import FIX_TAX, git_env

pytestmark = [pytest.mark.root, pytest.mark.mount]

SECRET = "API_TOKEN=h1st0ry-s3cret\n"
MANIFEST = FIX_TAX

# Every way the agent tries to read the secret through git: each prints what it got.
READS = r"""
git show HEAD~1:.env
git show side:.env
git show 'stash@{0}^3:.env'
git -C lib/vendor show HEAD:.env
git cat-file --batch-all-objects --batch
for o in $(git cat-file --batch-all-objects --batch-check='%(objectname)'); do git cat-file -p $o; done
echo reads-done
"""


def _git(cwd: Path, *args: str) -> str:
    env = {**git_env(cwd), "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout


def _base(ws: Path) -> None:
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    _git(ws, "init", "-q", "-b", "main")
    _git(ws, "add", "src")
    _git(ws, "commit", "-qm", "init")
    (ws / ".env").write_text(SECRET)


def _earlier_commit(ws: Path) -> str:
    _base(ws)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "with the secret")
    _git(ws, "rm", "-q", "--cached", ".env")
    _git(ws, "commit", "-qm", "without it")
    return "(main~1)"


def _branch(ws: Path) -> str:
    _base(ws)
    _git(ws, "checkout", "-q", "-b", "side")
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "on a branch")
    _git(ws, "checkout", "-q", "main")
    (ws / ".env").write_text(SECRET)  # the checkout took it away
    return "(side)"


def _stash(ws: Path) -> str:
    _base(ws)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return round(x)\n")
    _git(ws, "stash", "-q", "-u")  # the untracked .env goes into the stash's third parent
    (ws / ".env").write_text(SECRET)
    return "stash@{0}^3"


def _dangling_commit(ws: Path) -> str:
    _base(ws)
    _git(ws, "checkout", "-q", "-b", "gone")
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "soon unreachable")
    _git(ws, "checkout", "-q", "main")
    _git(ws, "branch", "-q", "-D", "gone")
    _git(ws, "reflog", "expire", "--expire=now", "--all")
    (ws / ".env").write_text(SECRET)
    return "on no branch or tag"


def _dangling_tree(ws: Path) -> str:
    _base(ws)
    _git(ws, "add", ".env")
    tree = _git(ws, "write-tree").strip()
    _git(ws, "rm", "-q", "--cached", ".env")
    return f"tree {tree[:12]}, which no commit holds"


def _dangling_blob(ws: Path) -> str:
    _base(ws)
    blob = _git(ws, "hash-object", "-w", ".env").strip()
    return f"unreachable blob {blob[:12]}"


def _nested(ws: Path) -> str:
    _base(ws)
    (ws / ".gitignore").write_text("lib/\n")
    _git(ws, "add", ".gitignore")
    _git(ws, "commit", "-qm", "ignore lib")
    vendor = ws / "lib/vendor"
    vendor.mkdir(parents=True)
    (vendor / ".env").write_text(SECRET)
    (vendor / "code.py").write_text("X = 1\n")
    _git(vendor, "init", "-q", "-b", "main")
    _git(vendor, "add", ".")
    _git(vendor, "commit", "-qm", "vendored")
    return "in the repository in lib/vendor/"


CASES: dict[str, Callable[[Path], str]] = {
    "earlier_commit": _earlier_commit, "branch": _branch, "stash": _stash, "dangling_commit": _dangling_commit,
    "dangling_tree": _dangling_tree, "dangling_blob": _dangling_blob, "nested": _nested,
}


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory that every user may traverse, outside /tmp (the sandbox has a /tmp of its
    own, so a git directory there is out of the agent's sight anyway): a git directory outside
    the workspace the agent could read, for its mask to matter (the "warn" runs show it can).
    Removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="guardfs-issue21-git-", dir="/var/tmp"))
    os.chmod(path, 0o755)  # noqa: S103 - the agent's user must reach it
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _guard_run(tmp_path: Path, ws: Path, script: str, user: str | None, mode: str | None = None,
               manifest: str = MANIFEST, chown: tuple[Path, ...] = ()) -> tuple[subprocess.CompletedProcess[str], Path]:
    if user is not None:
        for tree in (ws, *chown):
            subprocess.run(["chown", "-R", "65534:65534", str(tree)], check=True)
    path = tmp_path / "manifest.toml"
    path.write_text(manifest + (f'forbidden_in_git = "{mode}"\n' if mode else ""))
    run_dir = tmp_path / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    flags = ["--user", user] if user is not None else []
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(path),
         "--run-dir", str(run_dir), "--workspace", str(ws), "--", "/bin/sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL, env=env,
    )
    return proc, run_dir


def _printed(run_dir: Path) -> str:
    return "".join((run_dir / name).read_text(errors="replace") for name in ("stdout.log", "stderr.log")
                   if (run_dir / name).exists())


def _check_three_ways(tmp_path: Path, ws: Path, user: str | None, where: str, script: str = READS,
                      chown: tuple[Path, ...] = ()) -> None:
    secret = SECRET.strip()
    # refuse (the default): no start, naming the path and where it lives, and the way out
    proc, run_dir = _guard_run(tmp_path, ws, script, user, chown=chown)
    assert proc.returncode == 65, proc.stderr[-3000:]
    assert "git holds secret path(s)" in proc.stderr and ".env" in proc.stderr, proc.stderr
    assert where in proc.stderr, proc.stderr
    assert "git gc --prune=now" in proc.stderr and 'forbidden_in_git = "hide-git"' in proc.stderr
    assert not (run_dir / "stdout.log").exists()  # no agent ran
    # hide-git: the run starts, every read through git fails
    proc, run_dir = _guard_run(tmp_path, ws, script, user, mode="hide-git", chown=chown)
    assert "git does not work here" in proc.stderr, proc.stderr[-3000:]
    assert "reads-done" in _printed(run_dir), proc.stderr[-3000:]
    assert secret not in _printed(run_dir), _printed(run_dir)[-3000:]
    assert secret not in proc.stderr
    # warn (the control): the same reads print the secret
    proc, run_dir = _guard_run(tmp_path, ws, script, user, mode="warn", chown=chown)
    assert "their contents ARE readable" in proc.stderr, proc.stderr[-3000:]
    assert secret in _printed(run_dir), _printed(run_dir)[-3000:]


@pytest.mark.parametrize("user", [None, "nobody"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_secret_anywhere_in_a_repository_is_found_at_start(tmp_path: Path, case: str, user: str | None) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    where = CASES[case](ws)
    _check_three_ways(tmp_path, ws, user, where)
    assert (ws / ".env").read_text() == SECRET  # the host's files as they were


def _linked_worktree(top: Path) -> Path:
    main = top / "main"
    main.mkdir()
    _base(main)
    _git(main, "add", ".env")
    _git(main, "commit", "-qm", "tracks the secret")
    _git(main, "worktree", "add", "-q", str(top / "wt1"))
    return top / "wt1"


def _separate_outside(top: Path) -> Path:
    ws = top / "ws"
    ws.mkdir()
    _git(ws, "init", "-q", "-b", "main", f"--separate-git-dir={top / 'store'}")
    (ws / ".env").write_text(SECRET)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "tracks the secret")
    return ws


def _separate_inside(top: Path) -> Path:
    ws = top / "ws"
    ws.mkdir()
    _git(ws, "init", "-q", "-b", "main", f"--separate-git-dir={ws / 'gitdata'}")
    (ws / ".env").write_text(SECRET)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "tracks the secret")
    return ws


SHAPES: dict[str, Callable[[Path], Path]] = {
    "linked_worktree": _linked_worktree, "separate_git_dir_outside": _separate_outside,
    "separate_git_dir_inside": _separate_inside,
}

# What the agent tries where the git directory is: git itself, and the store's files read
# directly (wherever the gitfile says they are).
SHAPE_READS = r"""
git show HEAD:.env
git cat-file --batch-all-objects --batch
d=$(sed -n 's/^gitdir: //p' .git); c=$d; [ -f "$d/commondir" ] && c="$d/$(cat "$d/commondir")"
python3 -c "
import os, sys, zlib
for dirpath, _d, files in os.walk(sys.argv[1] + '/objects'):
    for n in files:
        try: print(zlib.decompress(open(os.path.join(dirpath, n), 'rb').read()))
        except Exception as err: print('unread', n, err)
" "$c"
(echo 'touch /tmp/owned' > "$d/hooks/pre-commit") 2>/dev/null; echo hook=$?
echo reads-done
"""


@pytest.mark.parametrize("user", [None, "nobody"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_workspace_whose_git_is_a_file_is_checked_and_hidden(
        tmp_path: Path, open_dir: Path, shape: str, user: str | None) -> None:
    ws = SHAPES[shape](open_dir)
    assert (ws / ".git").is_file()
    git_dir = Path(_git(ws, "rev-parse", "--absolute-git-dir").strip())
    _check_three_ways(tmp_path, ws, user, "the index", script=SHAPE_READS, chown=(open_dir,))
    # Wherever the git directory is, the agent wrote no hook there (a separate one inside the
    # workspace is read-only: the mount judges git's updates by the name .git).
    assert not (git_dir / "hooks/pre-commit").exists()


LANE_MANIFEST = """
[task]
id = "fix-tax"
goal = "Fix the tax rounding helper in src/checkout/"
[paths]
allowed = ["src/checkout/"]
forbidden = ["/.env"]
forbidden_in_git = "hide-git"
[sandbox]
fast_lanes = ["vendor"]
"""

LANE_READ = r"""
python3 -c "
import zlib
for name in ('vendor/lib/data.bin', 'vendor/other/ok.txt'):
    try: print(name, zlib.decompress(open(name, 'rb').read()) if name.endswith('.bin') else open(name).read())
    except OSError as err: print(name, 'refused', err.errno)
"
grep -c vendor/lib /proc/self/mountinfo; grep -c vendor/other /proc/self/mountinfo
echo reads-done
"""


@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_git_object_hard_linked_into_a_fast_lane_stays_behind_the_mount(tmp_path: Path, user: str | None) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    _base(ws)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "tracks the secret")
    blob = _git(ws, "rev-parse", "HEAD:.env").strip()
    (ws / "vendor/lib").mkdir(parents=True)
    (ws / "vendor/other").mkdir(parents=True)
    (ws / "vendor/other/ok.txt").write_text("fine\n")
    os.link(ws / ".git/objects" / blob[:2] / blob[2:], ws / "vendor/lib/data.bin")  # cp -al, git clone --local
    proc, run_dir = _guard_run(tmp_path, ws, LANE_READ, user, manifest=LANE_MANIFEST)
    out = _printed(run_dir)
    assert "reads-done" in out, proc.stderr[-3000:]
    assert SECRET.strip() not in out, out
    assert "vendor/lib/data.bin refused 13" in out, out  # EACCES: the mount refuses the object's other name
    assert "vendor/other/ok.txt fine" in out, out
    # vendor/lib was left out of the lanes (the mount serves it), vendor/other is one
    assert "fast lane left out: vendor: it holds another name (a hard link) of a forbidden file" in proc.stderr, \
        proc.stderr
    assert "fast lanes (read natively" in proc.stderr and "vendor/other" in proc.stderr, proc.stderr


NATIVE_MANIFEST = """
[task]
id = "fix-tax"
goal = "Fix the tax rounding helper in src/checkout/"
[paths]
allowed = ["src/checkout/", "node_modules/"]
generated = ["node_modules/"]
forbidden = ["/.env"]
forbidden_in_git = "hide-git"
"""

NATIVE_READ = r"""
python3 -c "
import zlib
for name in ('node_modules/pkg/data.bin', 'node_modules/dep/.git/HEAD', 'node_modules/dep/index.js'):
    try: print(name, zlib.decompress(open(name, 'rb').read()) if name.endswith('.bin') else open(name).read())
    except OSError as err: print(name, 'refused', err.errno)
"
grep -c node_modules /proc/self/mountinfo
echo reads-done
"""


@pytest.mark.parametrize("user", [None, "nobody"])
def test_hide_git_holds_in_a_native_generated_tree(tmp_path: Path, user: str | None) -> None:
    """A generated tree bound natively is planned with the mount's policy too: under hide-git, a
    hard link of a git object in it and a git directory inside it are masked, as the mount hides them."""
    ws = tmp_path / "ws"
    ws.mkdir()
    _base(ws)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "tracks the secret")
    blob = _git(ws, "rev-parse", "HEAD:.env").strip()
    (ws / "node_modules/pkg").mkdir(parents=True)
    (ws / "node_modules/dep/.git").mkdir(parents=True)
    (ws / "node_modules/dep/.git/HEAD").write_text("ref: refs/heads/main\n")
    (ws / "node_modules/dep/index.js").write_text("module.exports = 1\n")
    os.link(ws / ".git/objects" / blob[:2] / blob[2:], ws / "node_modules/pkg/data.bin")
    proc, run_dir = _guard_run(tmp_path, ws, NATIVE_READ, user, manifest=NATIVE_MANIFEST)
    out = _printed(run_dir)
    assert "reads-done" in out, proc.stderr[-3000:]
    assert "generated trees (written natively, not seen by the breaker): node_modules; 2 forbidden path(s) " \
        "masked inside" in proc.stderr, proc.stderr
    assert SECRET.strip() not in out, out
    assert "node_modules/pkg/data.bin refused 13" in out, out
    assert "node_modules/dep/.git/HEAD refused" in out, out
    assert "node_modules/dep/index.js module.exports = 1" in out, out


def test_the_second_run_over_the_same_store_is_answered_from_the_cache(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    _base(ws)
    (ws / ".env").unlink()
    proc, _run = _guard_run(tmp_path, ws, "git log --oneline", None)
    first = [line for line in proc.stderr.splitlines() if "git history checked for secrets" in line]
    assert proc.returncode == 0 and first and "from the cache" not in first[0], proc.stderr
    cache = tmp_path / "state/guardfs/git-history"
    assert len(list(cache.glob("*.json"))) == 1
    proc, _run = _guard_run(tmp_path, ws, "git log --oneline", None)
    second = [line for line in proc.stderr.splitlines() if "git history checked for secrets" in line]
    assert proc.returncode == 0 and second and f"1 from the cache of {cache}" in second[0], proc.stderr
    # A new object (here: a commit of the secret, made on the host) changes the store's state: walked again.
    (ws / ".env").write_text(SECRET)
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "oops")
    _git(ws, "rm", "-q", "--cached", ".env")
    _git(ws, "commit", "-qm", "undo")
    proc, _run = _guard_run(tmp_path, ws, "git log --oneline", None)
    assert proc.returncode == 65 and "(main~1)" in proc.stderr, proc.stderr
    assert "from the cache" not in proc.stderr


@pytest.mark.parametrize("user", [None, "nobody"])
def test_an_object_of_a_worktrees_outside_store_hard_linked_into_the_workspace_is_refused(
        tmp_path: Path, open_dir: Path, user: str | None) -> None:
    ws = _linked_worktree(open_dir)  # the store: open_dir/main/.git, outside the workspace, masked
    blob = _git(ws, "rev-parse", "HEAD:.env").strip()
    (ws / "vendor/lib").mkdir(parents=True)
    (ws / "vendor/other").mkdir(parents=True)
    (ws / "vendor/other/ok.txt").write_text("fine\n")
    os.link(open_dir / "main/.git/objects" / blob[:2] / blob[2:], ws / "vendor/lib/data.bin")
    proc, run_dir = _guard_run(tmp_path, ws, LANE_READ, user, manifest=LANE_MANIFEST, chown=(open_dir,))
    out = _printed(run_dir)
    assert "git directories outside the workspace masked" in proc.stderr, proc.stderr[-3000:]
    assert "reads-done" in out, proc.stderr[-3000:]
    assert SECRET.strip() not in out, out
    assert "vendor/lib/data.bin refused 13" in out, out  # neither a lane nor the mount shows it
    assert "vendor/other/ok.txt fine" in out, out
