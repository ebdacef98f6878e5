"""Issue 12, the record out of the agent's reach: a hostile agent inside a real ``guard run``
(as root and as ``--user nobody``) forges passing tests through its socket and through
``guard exec -- true pytest``; the run's start is still restorable, ``guard rollback --to
start|last|LABEL`` each reach their point, a reported test alone closes no HALF_OPEN
breaker, a tampered checkpoint index is refused before anything is restored, and the
modes on disk are the agent's umask for its files and the guard's alone for the record.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from guardfs.accounting import WriteAccounting
from guardfs.decision import Request, policy_verdict
from guardfs.manifest import parse_manifest
from sandbox.breaker import Breaker, State
from sandbox.breaker.client import GuardClient, GuardClientError

from .helpers import FIX_TAX, reports, state_of
from .hostile import SEND
from .mounts import guarded_mount
from .test_run import UNPRIVILEGED_PYTHON

ORIGINAL_TAX = "def total(x):\n    return x\n"

# The hostile agent. It reports on stdout, one JSON object per phase.
AGENT = r"""
import json, os, socket, subprocess, sys
guard, lib = {guard!r}, {lib!r}
env = dict(os.environ, PYTHONPATH=lib) if lib else dict(os.environ)

""" + SEND + r"""
def forge(summary):
    return send(dict(type="tool_result", tool="Bash", exit_code=0, summary=summary))["state"]

def state():
    return send(dict(type="status"))["state"]

def say(**kw):
    print(json.dumps(kw), flush=True)

try:
    open("README.md", "a").write("spill\n")
    say(phase="spill", errno=0)
except OSError as err:
    say(phase="spill", errno=err.errno)
say(phase="forged_socket", state=forge("pytest"))
r = subprocess.run([*guard, "exec", "--", "true", "pytest"], env=env, capture_output=True, text=True)
say(phase="forged_exec", status=r.returncode, stderr=r.stderr[-2000:], state=state())
umask = os.umask(0o022)
os.umask(umask)
open("src/checkout/tax.py", "w").write("v1\n")
open("src/checkout/new.py", "w").write("new\n")
os.unlink("src/checkout/tool.sh")
say(phase="change1", state=state(), umask=umask)
forge("pytest -k first")
open("src/checkout/tax.py", "w").write("v2\n")
os.mkdir("src/checkout/pkg")
open("src/checkout/pkg/new2.py", "w").write("new2\n")
forge("pytest -k second")
open("src/checkout/tax.py", "w").write("v3\n")
os.umask(0o002)
open("src/checkout/shared.txt", "w").write("group\n")
os.mkdir("src/checkout/shared")
say(phase="done", state=state())
"""


def _workspace(tmp_path: Path, user: str | None) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text(ORIGINAL_TAX)
    (ws / "src/checkout/tool.sh").write_text("#!/bin/sh\n")
    (ws / "README.md").write_text("readme\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    os.chmod(ws / "src/checkout/tool.sh", 0o4755)  # noqa: S103 - setuid: a rollback must not make it so again
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(FIX_TAX)
    return ws, manifest


def _guard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=60)


def _phases(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {report["phase"]: report for report in reports(run_dir / "stdout.log")}


def _hostile_run(tmp_path: Path, user: str | None, lib: str) -> tuple[Path, Path, dict[str, dict[str, Any]]]:
    """The hostile agent's whole run, under umask 022; returns the workspace, the run
    directory and the agent's report."""
    ws, manifest = _workspace(tmp_path, user)
    run_dir = tmp_path / "run"
    flags = ["--user", user] if user is not None else []
    # As root the agent reaches this interpreter; nobody runs the system's, on a copy of guardfs.
    guard = [sys.executable, "-m", "sandbox"] if user is None else [UNPRIVILEGED_PYTHON, "-m", "sandbox"]
    lib = "" if user is None else lib
    # With the copy on the guard's own path, the sandbox keeps it visible under its private /tmp.
    env = dict(os.environ, PYTHONPATH=lib) if lib else None
    agent = textwrap.dedent(AGENT).format(guard=guard, lib=lib)
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(manifest),
         "--run-dir", str(run_dir), "--", UNPRIVILEGED_PYTHON, "-c", agent],
        cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL, umask=0o022, env=env,
    )
    got = _phases(run_dir)
    assert result.returncode == 0, (result.stderr[-3000:], got)
    assert "done" in got, (result.stderr[-3000:], got)
    return ws, run_dir, got


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", [None, "nobody"])
def test_forged_passing_tests_cannot_move_the_record(tmp_path: Path, user: str | None, installation: str) -> None:
    """Forged passing tests (socket and guard exec) add restore points but drop none and
    close no HALF_OPEN breaker; the modes on disk; rollback --to last, LABEL, start."""
    ws, run_dir, got = _hostile_run(tmp_path, user, installation)

    # The spill tripped the breaker; neither forged test closed it; the real change did.
    assert got["spill"]["errno"] == 30
    assert got["forged_socket"]["state"] == "HALF_OPEN_REANCHOR"
    assert got["forged_exec"]["status"] == 0, got["forged_exec"]
    assert got["forged_exec"]["state"] == "HALF_OPEN_REANCHOR"
    assert got["change1"]["state"] == "CLOSED"
    ledger = json.loads((run_dir / "ledger.json").read_text())
    labels = [c["label"] for c in ledger["checkpoints"]]
    assert labels == ["passing test: pytest", "passing test: true pytest", "passing test: pytest -k first",
                      "passing test: pytest -k second"], labels

    # The agent's files carry its umask (022 as inherited, then 002), not 0666/0777.
    assert got["change1"]["umask"] == 0o022
    checkout = ws / "src/checkout"
    assert stat.S_IMODE((checkout / "new.py").stat().st_mode) == 0o644
    assert stat.S_IMODE((checkout / "pkg").stat().st_mode) == 0o755
    assert stat.S_IMODE((checkout / "pkg/new2.py").stat().st_mode) == 0o644
    assert stat.S_IMODE((checkout / "shared.txt").stat().st_mode) == 0o664
    assert stat.S_IMODE((checkout / "shared").stat().st_mode) == 0o775
    # The record is the guard's alone.
    _check_record_modes(run_dir)

    # Back one point: the last forged test's.
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "last")
    assert rolled.returncode == 0, rolled.stderr
    assert "to the last checkpoint" in rolled.stdout
    assert (checkout / "tax.py").read_text() == "v2\n"
    assert (checkout / "pkg/new2.py").read_text() == "new2\n"
    assert not (checkout / "shared.txt").exists() and not (checkout / "shared").exists()
    # Back to a labelled point.
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "passing test: pytest -k first")
    assert rolled.returncode == 0, rolled.stderr
    assert (checkout / "tax.py").read_text() == "v1\n"
    assert not (checkout / "pkg").exists() and (checkout / "new.py").exists()
    # An unknown label changes nothing and names the ones there are.
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "no-such-point")
    assert rolled.returncode == 65 and "no restore point is labelled 'no-such-point'" in rolled.stderr
    assert "passing test: pytest -k first" in rolled.stderr
    assert (checkout / "tax.py").read_text() == "v1\n"
    # Back to the start, forged tests and all: the run-start content, the setuid bit not restored.
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
    assert rolled.returncode == 0, rolled.stderr
    assert "to the run's start" in rolled.stdout
    assert (checkout / "tax.py").read_text() == ORIGINAL_TAX
    assert not (checkout / "new.py").exists()
    tool = checkout / "tool.sh"
    assert tool.read_text() == "#!/bin/sh\n"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755  # permission bits only
    assert (ws / "README.md").read_text() == "readme\n"
    _check_record_modes(run_dir, with_blobs=False)


def _check_record_modes(run_dir: Path, with_blobs: bool = True) -> None:
    """Run directory 0700 (000 as root: sandbox.launch.runs); ledger, STATE.md, logs and every checkpoint file 0600, its
    directories 0700; nothing in it writable by anyone but the guard. *with_blobs*: the
    store holds copies of files (a rollback to the start has forgotten them all)."""
    assert stat.S_IMODE(run_dir.stat().st_mode) == (0 if os.geteuid() == 0 else 0o700)
    for name in ("ledger.json", "STATE.md", "events.jsonl", "stdout.log", "stderr.log", "workspace"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
    store = run_dir / "checkpoint"
    blobs = 0
    for path in [store, *store.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
        blobs += path.name.isdigit() and len(path.name) == 8
    assert (blobs >= 1) == with_blobs
    for path in run_dir.rglob("*"):
        st = path.lstat()
        assert not stat.S_ISLNK(st.st_mode) and not st.st_mode & 0o022, (path, oct(st.st_mode))


TAMPERED = [
    ({"path": "suid_id", "mode": 2541, "blob": "evil"}, "suid_id"),
    ({"path": "leak", "kind": "file", "mode": 0o644, "blob": "/etc/shadow"}, "leak"),
    ({"path": "leak", "blob": "/etc/shadow"}, "leak"),
    ({"path": "suid_id", "kind": "file", "mode": 0o4755, "blob": "00000001"}, "suid_id"),
    ({"path": "../outside", "kind": "absent"}, "../outside"),
]


@pytest.mark.root
@pytest.mark.mount
def test_a_tampered_checkpoint_index_is_refused(tmp_path: Path, installation: str) -> None:
    """Lines a local user appends to the index (as the host would write them) are refused
    on read, naming the line; nothing is restored: no setuid file, no copy of /etc/shadow."""
    ws, run_dir, _got = _hostile_run(tmp_path, None, installation)
    index = run_dir / "checkpoint/0000/index.jsonl"
    before = index.read_bytes()
    workspace_before = (ws / "src/checkout/tax.py").read_text()
    for entry, name in TAMPERED:
        index.write_bytes(before + (json.dumps(entry) + "\n").encode())
        line = before.count(b"\n") + 1
        rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
        assert rolled.returncode == 65, (entry, rolled.stdout, rolled.stderr)
        assert f"index.jsonl:{line}: refusing the checkpoint index" in rolled.stderr, rolled.stderr
        assert name in rolled.stderr and "Nothing was restored" in rolled.stderr
        assert not (ws / "suid_id").exists() and not (ws / "leak").exists()
        assert not (tmp_path / "outside").exists()
        assert (ws / "src/checkout/tax.py").read_text() == workspace_before == "v3\n"
    # A generation another user may write is not the guard's: refused as well.
    index.write_bytes(before)
    os.chmod(index.parent, 0o777)  # noqa: S103 - the tampering under test
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
    assert rolled.returncode == 65 and "is not the guard's own" in rolled.stderr, rolled.stderr
    assert (ws / "src/checkout/tax.py").read_text() == "v3\n"
    os.chmod(index.parent, 0o700)
    rolled = _guard("rollback", "--run-dir", str(run_dir), "--to", "start")
    assert rolled.returncode == 0, rolled.stderr
    assert (ws / "src/checkout/tax.py").read_text() == ORIGINAL_TAX
    assert not any(stat.S_IMODE(p.lstat().st_mode) & 0o7000 for p in ws.rglob("*") if ".git" not in p.parts)


# ----- the breaker takes no agent's word alone ---------------------------------------------


def _breaker() -> Breaker:
    return Breaker(parse_manifest(FIX_TAX), WriteAccounting(), now=lambda: 1000.0)


def _write(b: Breaker, path: str) -> bool:
    request = Request("write", path, b.policy.classify(path, False), True)
    verdict = b.decide(request, policy_verdict(request))
    if verdict.allow:
        b.committed(request)
    return verdict.allow


def test_a_reported_passing_test_alone_does_not_close_half_open() -> None:
    """A forged passing test keeps HALF_OPEN (even after a change made before the trip), and
    resets no progress counter; a real in-scope change closes it."""
    b = _breaker()
    assert _write(b, "src/checkout/tax.py")  # a change before the trip vouches for nothing after
    b.step(tokens_in=500)
    assert not _write(b, "README.md")
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    reply = b.tool_result("Bash", 0, "pytest")
    assert reply.state is State.HALF_OPEN_REANCHOR
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    assert b.snapshot()["tokens"]["since_progress"] == 500
    assert [c["label"] for c in b.checkpoints] == ["passing test: pytest"]  # a restore point all the same
    assert _write(b, "src/checkout/tax.py")
    assert state_of(b) is State.CLOSED


def test_a_passing_test_counts_once_per_real_change() -> None:
    """Token velocity: a passing test after a real change is progress; the same report again,
    with nothing changed, is not."""
    b = _breaker()
    assert _write(b, "src/checkout/tax.py")
    b.step(tokens_in=300)
    b.tool_result("Bash", 0, "pytest")
    assert b.snapshot()["tokens"]["since_progress"] == 0
    b.step(tokens_in=300)
    b.tool_result("Bash", 0, "pytest")
    assert b.snapshot()["tokens"]["since_progress"] == 300


# ----- the same, with the guard live: the control socket's rollback --------------------------


@pytest.mark.mount
def test_live_rollback_to_a_point_and_a_tampered_index(tmp_path: Path) -> None:
    """With the guard serving: forged tests through the agent socket, then the operator's
    rollback to a label, to the last point and to the start; a tampered index is refused
    (the guard says why, restores nothing, and serves on)."""
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    tax = tmp_path / "backing/src/checkout/tax.py"
    tax.write_text(ORIGINAL_TAX)
    # Five versions of one file: more rewrites than the default allows.
    manifest = FIX_TAX + "[limits]\nmax_rewrites = 20\n"
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run", checkpoints=True) as g:
        assert g.daemon is not None
        mine = g.mnt / "src/checkout/tax.py"
        with GuardClient(g.daemon.agent_path) as agent, GuardClient(g.daemon.control_path) as operator:
            agent.tool_result("Bash", 0, "pytest")  # nothing changed yet: the start takes the label
            mine.write_text("v1\n")
            assert operator.checkpoint("green")["ok"]
            mine.write_text("v2\n")
            agent.tool_result("Bash", 0, "pytest")  # forged: a point, never a loss of the earlier ones
            mine.write_text("v3\n")
            assert operator.request({"type": "rollback", "to": "last"})["restored"] == 1
            assert tax.read_text() == "v2\n"
            assert operator.request({"type": "rollback", "to": "green"})["restored"] == 1
            assert tax.read_text() == "v1\n"
            mine.write_text("v4\n")
            index = tmp_path / "run/checkpoint/0000/index.jsonl"
            with open(index, "a") as f:  # as a local user would, had the directory let them
                f.write(json.dumps({"path": "leak", "kind": "file", "mode": 0o644, "blob": "/etc/shadow"}) + "\n")
            with pytest.raises(GuardClientError, match=r"index.jsonl:\d+: refusing the checkpoint index"):
                operator.request({"type": "rollback", "to": "start"})
            assert not (g.backing / "leak").exists() and tax.read_text() == "v4\n"
            with pytest.raises(GuardClientError, match="no restore point is labelled 'red'"):
                operator.request({"type": "rollback", "to": "red"})
            assert operator.status()["state"] == "CLOSED"
