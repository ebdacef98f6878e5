"""The Session, one shape for every guarded run: each rollback recorded once, the hook and
the mount agreeing on every built-in protection, and no other place wiring a run by hand.
Real mounts, real sockets."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from guardfs.events import EventLog
from guardfs.gitscope import ForbiddenInGitError, GitStateError
from guardfs.manifest import parse_manifest
from sandbox.breaker.client import GuardClient
from sandbox.session import Session

from .helpers import FIX_TAX, git_env
from .mounts import Guarded, guarded_mount

ROOT = Path(__file__).resolve().parent.parent


def rollbacks(g: Guarded) -> list[dict[str, object]]:
    """The run-level rollback events (per-path ones name their path)."""
    return [e for e in g.events() if e["op"] == "rollback" and e["path"] == ""]


@pytest.mark.mount
def test_one_rollback_one_event(tmp_path: Path) -> None:
    """A rollback the breaker asks for, and one the operator asks for, each write exactly
    one ``rollback`` event, with the number of paths it restored."""
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    manifest = FIX_TAX + "[limits]\nmax_consecutive_failures = 3\n[breaker]\nrollback_on_consecutive_failures = true\n"
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run", checkpoints=True) as g:
        assert g.daemon is not None
        for name in ("a.py", "b.py", "c.py"):
            (g.mnt / "src/checkout" / name).write_text("x = 1\n")
        with GuardClient(g.daemon.agent_path) as agent:
            for i in range(3):
                reply = agent.tool_result("Bash", 1, f"make step{i}")
        assert reply["trip"]["rule"] == "consecutive_failures"
        assert sorted(p.name for p in (g.backing / "src/checkout").iterdir()) == []
        assert [e["paths"] for e in rollbacks(g)] == [3]

        with GuardClient(g.daemon.control_path) as operator:
            assert operator.approve()["allow"]
            (g.mnt / "src/checkout/d.py").write_text("y = 2\n")
            assert operator.request({"type": "rollback"})["restored"] == 1
        assert not (g.backing / "src/checkout/d.py").exists()
        assert [e["paths"] for e in rollbacks(g)] == [3, 1]


def _both_answers(g: Guarded, path: str) -> tuple[bool, bool]:
    """(may the hook write *path*, did a write through the mount succeed); the breaker is
    approved back to CLOSED after each, so every path is judged from the same state."""
    assert g.daemon is not None
    with GuardClient(g.daemon.agent_path) as agent, GuardClient(g.daemon.control_path) as operator:
        hook = agent.check("Write", [path])["allow"]
        operator.approve()
        refused = 0
        try:
            with open(g.mnt / path, "a") as f:
                f.write("x\n")
        except OSError as err:
            refused = err.errno or -1
        assert refused in (0, errno.EROFS, errno.EACCES), (path, refused)  # a refusal, not a missing file
        operator.approve()
        mount = refused == 0
    return hook, mount


#: Every built-in protection, and paths on either side of it, with the expected answer.
BUILT_INS = {
    ".git/config": False,  # existed at the start: read-only
    ".git/hooks/pre-commit": False,  # hooks are read-only
    ".git/hooks/pre-commit.sample": True,  # git init's templates
    ".git/HEAD": False,  # git state: only git's lock-file rename, judged for what it changes
    ".git/refs/heads/main": False,
    ".git/refs/heads/main.lock": True,  # the rest of git's internals are writable
    ".git/COMMIT_EDITMSG": True,
    ".guard/notes": False,  # the guard's own directory
    ".guard/STATE.md": False,
    ".env": False,  # paths.forbidden
    "README.md": False,  # out of scope
    "src/checkout/tax.py": True,  # in scope
}


@pytest.mark.mount
def test_hook_check_and_mount_agree_on_every_built_in_protection(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    for d in ("src/checkout", ".git/hooks", ".git/refs/heads"):
        (backing / d).mkdir(parents=True)
    (backing / ".git/config").write_text("[core]\n")
    with guarded_mount(tmp_path, FIX_TAX, run_dir=tmp_path / "run") as g:
        answers = {path: _both_answers(g, path) for path in BUILT_INS}
    assert answers == {path: (want, want) for path, want in BUILT_INS.items()}


@pytest.mark.mount
def test_hook_check_and_mount_agree_on_a_git_config_the_agent_creates(tmp_path: Path) -> None:
    """A repository the agent creates during the run may configure itself, through git
    (issue 12: a lock file renamed over the config, checked); a direct write is refused by both."""
    (tmp_path / "backing/.git/hooks").mkdir(parents=True)
    with guarded_mount(tmp_path, FIX_TAX, run_dir=tmp_path / "run") as g:
        assert _both_answers(g, ".git/config") == (False, False)
        assert not (g.backing / ".git/config").exists()
        assert _both_answers(g, ".git/hooks/post-checkout") == (False, False)


def test_only_the_session_builds_guardfs_and_the_daemon() -> None:
    """Outside tests of GuardFS itself (test_gate, test_bounds_disk), every guarded run is built by
    sandbox.session."""
    builders = re.compile(r"\b(GuardFS|Daemon)\(")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("sandbox", "bench", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.name not in ("session.py", "test_bounds_disk.py", "test_gate.py", "test_session.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if builders.search(line) and not line.lstrip().startswith(("class ", "#", '"'))
    ]
    assert found == []


def _git(ws: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=ws, env=git_env(ws.parent), check=True, capture_output=True)


def _head_and_index_cases(ws: Path, case: str) -> None:
    """A workspace whose .env git holds only where GitScope's HEAD and index looked (before
    issue 22, besides the walk of the stores)."""
    ws.mkdir()
    (ws / ".env").write_text("TOKEN=s3cr3t\n")
    (ws / "README").write_text("x\n")
    _git(ws, "init", "-q", "-b", "main", *(["--object-format=sha256"] if case == "sha256" else []))
    if case == "staged on an unborn branch":  # no commit at all: the index alone
        _git(ws, "add", ".env")
        return
    _git(ws, "add", ".")
    _git(ws, "commit", "-qm", "with .env")
    _git(ws, "rm", "-q", "--cached", ".env")  # HEAD's tree alone holds it
    if case == "detached, no ref, no reflog":  # and only HEAD reaches that commit
        _git(ws, "checkout", "-q", "--detach")
        _git(ws, "branch", "-qD", "main")
        shutil.rmtree(ws / ".git/logs")


@pytest.mark.parametrize("case", ["committed in HEAD", "detached, no ref, no reflog", "staged on an unborn branch",
                                  "sha256"])
def test_the_walk_of_the_stores_finds_what_head_and_the_index_hold(tmp_path: Path, case: str) -> None:
    """Session._git_scope judges git's start by the walk of every store alone (what guard check
    judges by): a secret in HEAD's tree or in the index only is found and refuses the run, naming
    where; a store the walk cannot read (SHA-256 names) refuses it, saying so."""
    ws = tmp_path / "ws"
    _head_and_index_cases(ws, case)
    with pytest.raises(ForbiddenInGitError) as caught:
        Session(parse_manifest(FIX_TAX), ws, EventLog(None))
    said = str(caught.value)
    if case == "sha256":
        assert "sha256" in said and "the guard cannot read git's history" in said, said
        # "warn" runs with what git holds readable, but git's state must be read to judge it
        warn = parse_manifest(FIX_TAX.replace("[paths]", '[paths]\nforbidden_in_git = "warn"'))
        with pytest.raises(GitStateError) as state:
            Session(warn, ws, EventLog(None))
        assert "cannot be read" in str(state.value) and "sha1 clone" in str(state.value), state.value
        return
    assert "git holds secret path(s) .env" in said, said
    where = said.partition("where: .env: ")[2]
    assert where.startswith({"committed in HEAD": "commit ", "detached, no ref, no reflog": "commit ",
                             "staged on an unborn branch": "the index"}[case]), said
    assert ("(main)" in where) is (case == "committed in HEAD"), said
    assert ("the index" in where) is (case == "staged on an unborn branch"), said


def _opens_of(directory: Path, action: Callable[[], None]) -> int:
    """How many times *action* opened *directory* itself to read it (inotify's IN_OPEN with
    IN_ISDIR and no name: the kernel's count, whoever opened it; O_PATH opens are not reads)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(fd, os.fsencode(directory), 0x20) >= 0  # IN_OPEN
        action()
        data = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(fd, 1 << 16):
                data += chunk
    finally:
        os.close(fd)
    opens, pos = 0, 0
    while pos < len(data):
        _wd, mask, _cookie, size = struct.unpack_from("iIII", data, pos)
        opens += bool(mask & 0x40000000) and not data[pos + 16:pos + 16 + size].strip(b"\0")  # IN_ISDIR, itself
        pos += 16 + size
    return opens


def test_the_session_walks_the_workspace_once(tmp_path: Path) -> None:
    """At start the workspace is listed once (guardfs.links.walk_workspace) for the other names
    of forbidden files, the repositories and the secret files git's nameless blobs are matched
    against; before issue 22, three times. The nameless blob of .env is still found."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / ".env").write_text("TOKEN=s3cr3t\n")
    (ws / "src/checkout/a.py").write_text("a = 1\n")
    _git(ws, "init", "-q", "-b", "main")
    _git(ws, "add", ".env")
    _git(ws, "rm", "-q", "--cached", ".env")  # its blob stays, named by nothing
    _git(ws, "add", "src")
    _git(ws, "commit", "-qm", "a")
    manifest = parse_manifest(FIX_TAX.replace("[paths]", '[paths]\nforbidden_in_git = "warn"'))
    sessions: list[Session] = []
    assert _opens_of(ws, lambda: sessions.append(Session(manifest, ws, EventLog(None)))) == 1
    sessions[0].close()
    assert any("git holds secret path(s) .env" in n for n in sessions[0].notices), sessions[0].notices
    assert [f.where for _r, f in sessions[0].git_history.found] == [("unreachable blob " + _blob(ws) + " (its "
                                                                      "content as it is now)",)]


def _blob(ws: Path) -> str:
    out = subprocess.run(["git", "hash-object", ".env"], cwd=ws, env=git_env(ws.parent), check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()[:12]
