"""Issue 21, item 7: rollback over what a hostile agent left, from inside a real ``guard run``
(as root and as ``--user nobody``), the host checked afterwards.

The agent swaps a restored directory for a symlink to a host directory (a canary in it), a
file for a FIFO, a file for a directory and a directory for a file, then reports two failed
tool calls (``max_consecutive_failures = 2`` with ``rollback_on_consecutive_failures``): the
breaker's rollback puts everything back without following anything, and the guard exits
with the agent's status. The same workspace rolled back afterwards by ``guard rollback --to
start``; and a restore that cannot be done (an immutable file, ``chattr +i``, made for real
from the host) is named by ``guard rollback`` with status 73 and by the breaker's rollback in
the ledger and on the console, never an internal error.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guardfs.errors import Exit

from .helpers import FIX_TAX, reports, wait_for
from .hostile import ATTEMPT, SEND, hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]
AGENT_STATUS = 3
ROLLBACK_ON_FAILURES = (FIX_TAX + "[limits]\nmax_consecutive_failures = 2\n"
                        "[breaker]\nrollback_on_consecutive_failures = true\n")

#: ``fail_twice()``: two failed tool calls reported on the agent socket, as a harness would.
FAIL_TWICE = ATTEMPT + r'''
import socket
''' + SEND + r'''def fail_twice():
    return [send(dict(type="tool_result", tool="Bash", exit_code=1, summary=f"make {i}"))["state"] for i in (1, 2)]
def read(path):
    with open(path) as f:
        return f.read()
def settled(check):
    # The kernel forgets the names a rollback replaced once the guard's invalidations (sent
    # asynchronously, after the reply) arrive: wait for that, with a bound.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass
        time.sleep(0.01)
    return False
'''


def _guard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=120)


def _no_internal_error(proc: subprocess.CompletedProcess[str]) -> None:
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _rollbacks(run_dir: Path) -> list[dict[str, Any]]:
    ledger: dict[str, Any] = json.loads((run_dir / "ledger.json").read_text())
    rollbacks: list[dict[str, Any]] = ledger["rollbacks"]
    return rollbacks


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    """A host directory the agent points its symlinks at: a rollback that followed one would
    write sub/f.py's pre-image into it, or remove what it holds."""
    where = tmp_path / "host-target"
    where.mkdir()
    (where / "f.py").write_text("canary\n")
    (where / "keep.txt").write_text("canary\n")
    yield where
    assert sorted(p.name for p in where.iterdir()) == ["f.py", "keep.txt"]
    assert (where / "f.py").read_text() == "canary\n" and (where / "keep.txt").read_text() == "canary\n"


SYMLINK_OVER_A_DIRECTORY = r'''
CANARY = {canary!r}
with open("src/checkout/sub/f.py", "w") as f:
    f.write("changed\n")
os.rename("src/checkout/sub", "src/checkout/sub2")
os.symlink(CANARY, "src/checkout/sub")
attempt("planted", lambda: os.readlink("src/checkout/sub"))
if {fail!r}:
    attempt("states", fail_twice)
    attempt("settled", lambda: settled(lambda: os.path.isdir("src/checkout/sub")
                                       and not os.path.islink("src/checkout/sub")
                                       and read("src/checkout/sub/f.py") == "orig\n"))
    attempt("after", lambda: [sorted(os.listdir("src/checkout")), os.path.islink("src/checkout/sub"),
                              read("src/checkout/sub/f.py")])
sys.exit({status})
'''


def _symlink_workspace(tmp_path: Path) -> Path:
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/sub").mkdir()
    (ws / "src/checkout/sub/f.py").write_text("orig\n")
    return ws


def _owner(user: str | None) -> int:
    return 0 if user is None else 65534


def _restored_sub(ws: Path, user: str | None) -> None:
    sub = ws / "src/checkout/sub"
    assert stat.S_ISDIR(os.lstat(sub).st_mode), "the symlink is still there"
    assert sorted(p.name for p in sub.iterdir()) == ["f.py"]
    assert (sub / "f.py").read_text() == "orig\n"
    assert not os.path.lexists(ws / "src/checkout/sub2")
    # Their owner back too (the agent, as --user, can go on editing them).
    assert {os.lstat(p).st_uid for p in (sub, sub / "f.py")} == {_owner(user)}


@pytest.mark.parametrize("user", USERS)
def test_a_symlink_over_a_restored_directory_by_the_breakers_rollback(
        tmp_path: Path, user: str | None, canary: Path) -> None:
    """The issue's case: the automatic rollback of consecutive_failures replaces the symlink
    (never following it) and puts the directory back; the guard exits with the agent's status."""
    ws = _symlink_workspace(tmp_path)
    script = SYMLINK_OVER_A_DIRECTORY.format(canary=str(canary), fail=True, status=AGENT_STATUS)
    seen, events, proc = hostile_run(tmp_path, ws, user, script, manifest=ROLLBACK_ON_FAILURES, prelude=FAIL_TWICE)
    assert proc.returncode == AGENT_STATUS, (proc.stderr[-3000:], seen)
    _no_internal_error(proc)
    assert seen["planted"] == str(canary)
    assert seen["states"] == ["CLOSED", "HALF_OPEN_REANCHOR"]
    # Inside the mount too: the directory is back, with the file as it was.
    assert seen["settled"] is True, seen
    assert seen["after"] == [["sub", "tax.py"], False, "orig\n"], seen
    _restored_sub(ws, user)
    [rollback] = _rollbacks(tmp_path / "run")
    assert (rollback["by"], rollback["failed_count"], rollback["moved_aside_count"]) == ("breaker", 0, 0)
    assert not (tmp_path / "run/rollback-aside").exists()  # the moved file's bytes went back: nothing to keep
    assert not [e for e in events if e.get("op") == "rollback" and e.get("restored") is False]


@pytest.mark.parametrize("user", USERS)
def test_a_symlink_over_a_restored_directory_by_guard_rollback(tmp_path: Path, user: str | None, canary: Path) -> None:
    """The same workspace, left so by the agent: guard rollback --to start afterwards."""
    ws = _symlink_workspace(tmp_path)
    script = SYMLINK_OVER_A_DIRECTORY.format(canary=str(canary), fail=False, status=AGENT_STATUS)
    seen, _, proc = hostile_run(tmp_path, ws, user, script, manifest=ROLLBACK_ON_FAILURES, prelude=FAIL_TWICE)
    assert proc.returncode == AGENT_STATUS, (proc.stderr[-3000:], seen)
    assert os.path.islink(ws / "src/checkout/sub")
    points = _guard("rollback", "--run-dir", str(tmp_path / "run"), "--to", "start")
    assert points.returncode == 0, points.stderr
    _no_internal_error(points)
    assert "restored 3 path(s) to the run's start" in points.stdout, points.stdout
    _restored_sub(ws, user)


SWAPPED_KINDS = r'''
os.unlink("src/checkout/a.py")
os.mkfifo("src/checkout/a.py")
os.unlink("src/checkout/d/x.py")
os.rmdir("src/checkout/d")
with open("src/checkout/d", "w") as f:
    f.write("a file where a directory was\n")
os.unlink("src/checkout/b.py")
os.mkdir("src/checkout/b.py")
with open("src/checkout/b.py/inner.txt", "w") as f:
    f.write("an agent's file in a directory where a file was\n")
with open("src/checkout/tool.sh", "w") as f:
    f.write("#!/bin/sh\necho agent\n")
attempt("kinds", lambda: [stat.filemode(os.lstat("src/checkout/" + n).st_mode)[0] for n in ("a.py", "d", "b.py")])
if {fail!r}:
    attempt("states", fail_twice)
    attempt("settled", lambda: settled(lambda: [stat.filemode(os.lstat("src/checkout/" + n).st_mode)[0]
                                                for n in ("a.py", "d", "b.py")] == ["-", "d", "-"]))
    attempt("after", lambda: [read("src/checkout/a.py"), read("src/checkout/b.py"), read("src/checkout/d/x.py")])
sys.exit({status})
'''


def _swapped_workspace(tmp_path: Path) -> Path:
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/a.py").write_text("a = 1\n")
    (ws / "src/checkout/b.py").write_text("b = 2\n")
    (ws / "src/checkout/d").mkdir()
    (ws / "src/checkout/d/x.py").write_text("x = 3\n")
    (ws / "src/checkout/tool.sh").write_text("#!/bin/sh\n")
    return ws


def _restored_kinds(ws: Path, user: str | None) -> None:
    checkout = ws / "src/checkout"
    assert {os.lstat(checkout / n).st_uid for n in ("a.py", "b.py", "d", "d/x.py", "tool.sh")} == {_owner(user)}
    assert (checkout / "a.py").read_text() == "a = 1\n" and stat.S_ISREG(os.lstat(checkout / "a.py").st_mode)
    assert (checkout / "b.py").read_text() == "b = 2\n" and stat.S_ISREG(os.lstat(checkout / "b.py").st_mode)
    assert stat.S_ISDIR(os.lstat(checkout / "d").st_mode)
    assert [p.name for p in (checkout / "d").iterdir()] == ["x.py"]
    assert (checkout / "d/x.py").read_text() == "x = 3\n"
    # setuid at the checkpoint, put back without it: the guard restores as root, owner unknown.
    assert (checkout / "tool.sh").read_text() == "#!/bin/sh\n"
    assert stat.S_IMODE(os.lstat(checkout / "tool.sh").st_mode) == 0o755


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("by", ["breaker", "guard rollback"])
def test_a_fifo_and_swapped_kinds_are_replaced(tmp_path: Path, user: str | None, by: str) -> None:
    """A FIFO where a file was, a file where a directory was and a directory (holding an agent's
    file) where a file was: all taken away and the checkpoint's entries put back, by the
    breaker's rollback and by guard rollback; a setuid file comes back without the bit."""
    ws = _swapped_workspace(tmp_path)
    script = SWAPPED_KINDS.format(fail=by == "breaker", status=AGENT_STATUS)
    # setuid: a rollback must not make it so again (for --user, hostile_run's chown drops the bit first).
    os.chmod(ws / "src/checkout/tool.sh", 0o4755)  # noqa: S103
    seen, _, proc = hostile_run(tmp_path, ws, user, "import stat\n" + script, manifest=ROLLBACK_ON_FAILURES,
                                prelude=FAIL_TWICE)
    assert proc.returncode == AGENT_STATUS, (proc.stderr[-3000:], seen)
    _no_internal_error(proc)
    assert seen["kinds"] == ["p", "-", "d"], seen
    if by == "breaker":
        assert seen["states"] == ["CLOSED", "HALF_OPEN_REANCHOR"]
        assert seen["settled"] is True, seen
        assert seen["after"] == ["a = 1\n", "b = 2\n", "x = 3\n"], seen
        [rollback] = _rollbacks(tmp_path / "run")
        assert rollback["failed_count"] == 0, rollback
    else:
        rolled = _guard("rollback", "--run-dir", str(tmp_path / "run"), "--to", "start")
        assert rolled.returncode == 0, rolled.stderr
        _no_internal_error(rolled)
    _restored_kinds(ws, user)
    assert not (tmp_path / "run/rollback-aside").exists()  # every byte taken away was the agent's, seen made


IMMUTABLE = r'''
with open("src/checkout/tax.py", "w") as f:
    f.write("def total(x):\n    return -x\n")
with open("src/checkout/new.py", "w") as f:
    f.write("made by the agent\n")
if {wait!r}:
    os.mkdir("src/checkout/ready")  # the operator's rollback takes it away: the agent's signal to go on
    deadline = time.monotonic() + 60
    while os.path.exists("src/checkout/ready") and time.monotonic() < deadline:
        time.sleep(0.02)
    attempt("after_operator", lambda: [read("src/checkout/tax.py"), read("src/checkout/new.py")])
    attempt("states", fail_twice)
    attempt("after", lambda: [read("src/checkout/tax.py"), read("src/checkout/new.py")])
sys.exit({status})
'''


def _chattr(flag: str, path: Path) -> None:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr {flag} {path} failed here ({done.stderr.strip()}): no immutable files on this filesystem")


@pytest.mark.parametrize("user", USERS)
def test_a_restore_that_cannot_be_done_is_named_by_guard_rollback(tmp_path: Path, user: str | None) -> None:
    """An agent's file made immutable on the host (a real obstacle the rollback cannot take
    away): guard rollback restores the rest, names it with the reason, exits 73 and keeps the
    restore points; once the obstacle is gone, the same command completes."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) is not installed")
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, IMMUTABLE.format(wait=False, status=AGENT_STATUS))
    assert proc.returncode == AGENT_STATUS, (proc.stderr[-3000:], seen)
    _chattr("+i", ws / "src/checkout/new.py")
    try:
        rolled = _guard("rollback", "--run-dir", str(tmp_path / "run"), "--to", "start")
    finally:
        _chattr("-i", ws / "src/checkout/new.py")
    assert rolled.returncode == Exit.CANTCREAT, (rolled.stdout, rolled.stderr)
    _no_internal_error(rolled)
    assert "NOT restored: src/checkout/new.py:" in rolled.stderr and "Operation not permitted" in rolled.stderr
    assert "every restore point is kept" in rolled.stderr, rolled.stderr
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"  # the rest was restored
    again = _guard("rollback", "--run-dir", str(tmp_path / "run"), "--to", "start")
    assert again.returncode == 0, again.stderr
    assert not (ws / "src/checkout/new.py").exists()
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"


@pytest.mark.parametrize("user", USERS)
def test_a_restore_that_cannot_be_done_during_the_run(tmp_path: Path, user: str | None) -> None:
    """The same obstacle (made immutable from the host while the agent waits) met by the
    operator's live guard rollback (exit 73, the path named) and then by the breaker's: each
    restores the rest; the ledger, STATE.md and the console name the path; the run goes on
    and the guard exits with the agent's status."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr (e2fsprogs) is not installed")
    ws = hostile_workspace(tmp_path)
    script = IMMUTABLE.format(wait=True, status=AGENT_STATUS)
    flags = ["--user", user] if user is not None else []
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    (tmp_path / "manifest.toml").write_text(ROLLBACK_ON_FAILURES)
    run_dir = tmp_path / "run"
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    guard = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(tmp_path / "manifest.toml"),
         "--run-dir", str(run_dir), "--", python3, "-c", FAIL_TWICE + textwrap.dedent(script)],
        cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: (ws / "src/checkout/ready").is_dir() or guard.poll() is not None, "the agent's changes")
        _chattr("+i", ws / "src/checkout/new.py")
        try:
            live = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
            out, err = guard.communicate(timeout=120)
        finally:
            _chattr("-i", ws / "src/checkout/new.py")
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.communicate()
    seen: dict[str, Any] = {}
    for report in reports(run_dir / "stdout.log"):
        seen.update(report)
    assert guard.returncode == AGENT_STATUS, (err[-3000:], seen)
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    assert live.returncode == Exit.CANTCREAT, (live.stdout, live.stderr)
    _no_internal_error(live)
    assert "NOT restored: src/checkout/new.py:" in live.stderr, live.stderr
    restored = ["def total(x):\n    return x\n", "made by the agent\n"]  # the rest, restored; new.py stays
    assert seen["after_operator"] == restored, seen
    assert seen["states"] == ["CLOSED", "HALF_OPEN_REANCHOR"]
    assert seen["after"] == restored, seen
    for by in ("operator", "breaker"):
        assert f"rollback (asked by the {by}) did NOT restore src/checkout/new.py" in err, err[-3000:]
    rollbacks = _rollbacks(run_dir)
    assert [r["by"] for r in rollbacks] == ["operator", "breaker"], rollbacks
    for rollback in rollbacks:
        assert rollback["failed_count"] == 1 and rollback["failed"][0]["path"] == "src/checkout/new.py", rollback
        assert "Operation not permitted" in rollback["failed"][0]["reason"]
    assert "NOT restored: src/checkout/new.py" in (run_dir / "STATE.md").read_text()
    # The restore points were kept: the operator's rollback completes once the way is clear.
    again = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
    assert again.returncode == 0, again.stderr
    assert not (ws / "src/checkout/new.py").exists() and not (ws / "src/checkout/ready").exists()
    assert out is not None


MOVED_INTO_A_NEW_DIRECTORY = r'''
os.mkdir("src/checkout/pkg")
os.rename("src/checkout/data/big.bin", "src/checkout/pkg/big.bin")
attempt("states", fail_twice)
attempt("after", lambda: [sorted(os.listdir("src/checkout")), os.listdir("src/checkout/data")])
sys.exit({status})
'''


@pytest.mark.parametrize("user", USERS)
def test_bytes_no_restore_point_keeps_are_moved_aside(tmp_path: Path, user: str | None) -> None:
    """A file too large to keep (past checkpoint_max_bytes) moved into a directory the agent
    made: the breaker's rollback takes that directory away whole into the run directory
    (nothing lost), names it on the console and in the ledger, and names the file as not
    restored."""
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/data").mkdir()
    big = os.urandom(64 << 10)
    (ws / "src/checkout/data/big.bin").write_bytes(big)
    manifest = ROLLBACK_ON_FAILURES + "[sandbox]\ncheckpoint_max_bytes = 1024\n"
    seen, events, proc = hostile_run(tmp_path, ws, user, MOVED_INTO_A_NEW_DIRECTORY.format(status=AGENT_STATUS),
                                     manifest=manifest, prelude=FAIL_TWICE)
    assert proc.returncode == AGENT_STATUS, (proc.stderr[-3000:], seen)
    _no_internal_error(proc)
    assert seen["after"] == [["data", "tax.py"], []], seen
    aside = tmp_path / "run/rollback-aside/0001/src/checkout/pkg"
    assert (aside / "big.bin").read_bytes() == big
    assert f"rollback moved src/checkout/pkg aside to {aside}" in proc.stderr, proc.stderr[-3000:]
    [rollback] = _rollbacks(tmp_path / "run")
    assert rollback["moved_aside"] == [{"path": "src/checkout/pkg", "to": str(aside)}], rollback
    assert any(e.get("op") == "rollback" and e.get("path") == "src/checkout/data/big.bin"
               and e.get("restored") is False for e in events), events
    assert not (ws / "src/checkout/pkg").exists() and list((ws / "src/checkout/data").iterdir()) == []
