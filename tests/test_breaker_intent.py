"""Trip on intent, refuse on contact (issue 14, Build 1), through real mounts and ``guard run``.

A lookup, stat or access check of a forbidden path is refused (EACCES, an event) but is no
violation; reading its content or changing it is. The first forbidden read of a run is
refused and recoverable; the second stops it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

from guardfs.intent import Intent, classify, lookup_intent

from .helpers import FIX_TAX, wait_for
from .mounts import CHECKOUT_MANIFEST, guarded_mount


def test_classify_reads_the_system_call_and_its_open_flags() -> None:
    x86 = "x86_64"
    assert classify(b"332 0xffffff9c 0x7ffd 0x100 0x7ff 0x0 0x0 0x7ffc 0x7f".split(), x86) == Intent("statx", False)
    assert classify(b"21 0x55 0x0 0x0 0x0 0x0 0x0 0x7ffc 0x7f".split(), x86) == Intent("access", False)
    assert classify(b"257 0xffffff9c 0x55 0x0 0x0 0x0 0x0 0x7ffc 0x7f".split(), x86) == Intent("openat(read)", True)
    assert classify(b"257 0xffffff9c 0x55 0x241 0x1b6 0x0 0x0 0x1 0x2".split(), x86) == Intent("openat(write)", True)
    assert classify(b"257 0xffffff9c 0x55 0x200000 0x0 0x0 0x0 0x1 0x2".split(), x86) == Intent(
        "openat(O_PATH)", False)
    assert classify(b"257 0xffffff9c 0x55 0x90800 0x0 0x0 0x0 0x1 0x2".split(), x86) == Intent(
        "openat(directory)", True)
    assert classify(b"89 0x55 0x56 0x1000 0x0 0x0 0x0 0x1 0x2".split(), x86) == Intent("readlink", True)
    assert classify(b"56 0xffffff9c 0x55 0x4000 0x0 0x0 0x0 0x1 0x2".split(), "aarch64") == Intent(
        "openat(directory)", True)
    # What cannot be read counts as contact: the rule fails toward the breaker.
    assert classify([b"running"], x86).contact and classify([], x86).contact
    assert classify(b"9999 0x0".split(), x86) == Intent("syscall 9999", True)
    assert lookup_intent(0).contact and lookup_intent(2**22 + 7).contact  # no such caller


def test_a_caller_blocked_in_a_system_call_is_read_from_proc() -> None:
    """A real process asleep in read(2) on a pipe: its call is read from /proc (a call that
    is not a lookup's is named by number, and counts as contact)."""
    read = {"x86_64": "syscall 0", "aarch64": "syscall 63"}.get(os.uname().machine)
    if read is None:
        pytest.skip("system call numbers are known for x86_64 and aarch64 only")
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(1)"],
                          stdin=subprocess.PIPE) as proc:
        try:
            wait_for(lambda: lookup_intent(proc.pid).call == read, "the child to block in read(2)")
            assert lookup_intent(proc.pid).contact
        finally:
            proc.kill()


@pytest.mark.mount
def test_each_operation_on_a_forbidden_path_is_refused_and_names_its_intent(tmp_path: Path) -> None:
    """Through a real mount: every operation is refused with EACCES and its event names the
    system call behind the lookup; only the content-reaching ones are contact."""
    with guarded_mount(tmp_path, CHECKOUT_MANIFEST) as g:
        (g.backing / ".env").write_text("SECRET=1\n")
        (g.backing / ".github/workflows").mkdir(parents=True)
        (g.backing / ".github/workflows/ci.yml").write_text("on: push\n")
        (g.backing / ".env.link").symlink_to(".env")
        ops: dict[str, Any] = {
            "stat": lambda: os.stat(g.mnt / ".env"),
            "lstat": lambda: os.lstat(g.mnt / ".github/workflows"),
            "stat beneath": lambda: os.stat(g.mnt / ".github/workflows/ci.yml"),
            "listxattr": lambda: os.listxattr(g.mnt / ".env"),
            "read": (g.mnt / ".env").read_text,
            "list": lambda: os.listdir(g.mnt / ".github/workflows"),
            "readlink": lambda: os.readlink(g.mnt / ".env.link"),
            "getxattr": lambda: os.getxattr(g.mnt / ".env", "user.x"),
            "write": lambda: (g.mnt / ".env").write_text("x"),
            "unlink": lambda: os.unlink(g.mnt / ".env"),
        }
        for name, op in ops.items():
            with pytest.raises(OSError) as err:
                op()
            assert err.value.errno == errno.EACCES, (name, err.value)
        assert not os.access(g.mnt / ".env", os.F_OK)  # a question, answered no
        intents = [str(e.get("intent") or "") for e in g.denials() if e["op"] == "lookup"]
    assert all(intents), intents
    metadata = [i for i in intents if i in METADATA_CALLS]
    contact = [i for i in intents if i not in METADATA_CALLS]
    # stat, lstat, stat beneath, listxattr, access: five lookups that touch no content.
    assert len(metadata) == 5, intents
    assert "openat(read)" in contact and "openat(directory)" in contact and "openat(write)" in contact, contact
    assert {"readlink", "getxattr"} <= {i.removeprefix("l") for i in contact}, contact
    assert any(i in ("unlink", "unlinkat") for i in contact), contact


#: The names guardfs.intent gives the calls that touch no content (on either architecture).
METADATA_CALLS = frozenset({"stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2",
                            "listxattr", "llistxattr", "openat(O_PATH)"})


@pytest.mark.mount
def test_a_stat_storm_is_capped_and_a_read_after_it_still_recorded(tmp_path: Path) -> None:
    """A refused stat is no violation, so an agent may repeat it at will: its events are
    dropped past the caps (and counted); a read's denial and its trip are never dropped."""
    cap = 16384
    manifest = CHECKOUT_MANIFEST + f"[record]\nevents_max_bytes = {cap}\n"
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run") as g:
        (g.backing / ".env").write_text("SECRET=1\n")
        for _ in range(3000):
            with pytest.raises(PermissionError):
                os.stat(g.mnt / ".env")
        with pytest.raises(PermissionError):
            (g.mnt / ".env").read_text()
    assert g.events_path.stat().st_size < cap + 4096
    events = [json.loads(line) for line in g.events_path.read_text().splitlines()]
    stats = [e for e in events if e["op"] == "lookup" and e.get("contact") is False]
    dropped = sum(e["kinds"].get("lookup", 0) for e in events if e["op"] == "dropped")
    assert stats and len(stats) + dropped == 3000, (len(stats), dropped)
    read = [e for e in events if e["op"] == "lookup" and str(e.get("intent")).startswith("open")]
    assert len(read) == 1 and "contact" not in read[0], read
    assert [e["rule"] for e in events if e["op"] == "trip"] == ["forbidden_path"]


# ----- guard run ------------------------------------------------------------------------

def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / ".env").write_text("SECRET=s3cr3t\n")
    manifest = tmp_path / "guard.toml"
    manifest.write_text(FIX_TAX)  # the default [breaker]
    return ws, manifest


def _guard_run(tmp_path: Path, ws: Path, manifest: Path, script: str) -> tuple[subprocess.CompletedProcess[str],
                                                                                 Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--", "sh", "-c", textwrap.dedent(script)],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    return proc, run_dir


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.root
@pytest.mark.mount
def test_a_stat_of_a_forbidden_path_is_refused_without_a_trip(tmp_path: Path) -> None:
    ws, manifest = _workspace(tmp_path)
    proc, run_dir = _guard_run(tmp_path, ws, manifest, """
        stat .env 2>&1 || echo "stat refused"
        test -e .env && echo "exists" || echo "test -e false"
        ls -la | grep -c env || true
        python3 -c 'import os; print("access", os.access(".env", os.F_OK))'
        echo '# in scope' >> src/checkout/tax.py
    """)
    log = (run_dir / "stdout.log").read_text()
    assert proc.returncode == 0, (proc.stderr[-2000:], log)
    assert "Permission denied" in log and "stat refused" in log and "test -e false" in log, log
    assert "access False" in log, log
    events = _events(run_dir)
    denials = [e for e in events if e["decision"] == "deny" and e["path"] == ".env"]
    assert len(denials) >= 3 and all(e["errno"] == "EACCES" and e["op"] == "lookup" for e in denials), denials
    assert not [e for e in events if e["op"] == "trip"], events
    assert json.loads((run_dir / "ledger.json").read_text())["state"] == "CLOSED"
    assert (ws / "src/checkout/tax.py").read_text().endswith("# in scope\n")


@pytest.mark.root
@pytest.mark.mount
def test_cat_env_once_is_refused_and_recoverable(tmp_path: Path) -> None:
    ws, manifest = _workspace(tmp_path)
    proc, run_dir = _guard_run(tmp_path, ws, manifest, """
        cat .env || echo "cat refused"
        cat .guard/STATE.md | grep -m1 -o 'HALF_OPEN_REANCHOR' || true
        echo '# back in scope' >> src/checkout/tax.py
        echo done
    """)
    log = (run_dir / "stdout.log").read_text()
    assert proc.returncode == 0, (proc.stderr[-2000:], log)
    assert "s3cr3t" not in log and "cat refused" in log and "done" in log, log
    assert "HALF_OPEN_REANCHOR" in log, log  # the agent can read why
    trips = [e for e in _events(run_dir) if e["op"] == "trip"]
    assert [(t["rule"], t["state"]) for t in trips] == [("forbidden_path", "HALF_OPEN_REANCHOR")], trips
    assert "Rule: forbidden_path" in trips[0]["feedback"]
    denial = next(e for e in _events(run_dir) if e["decision"] == "deny" and e["path"] == ".env")
    assert denial["intent"].startswith("open") and denial["errno"] == "EACCES", denial
    assert json.loads((run_dir / "ledger.json").read_text())["state"] == "CLOSED"  # progress closed it


@pytest.mark.root
@pytest.mark.mount
def test_cat_env_twice_is_terminal(tmp_path: Path) -> None:
    ws, manifest = _workspace(tmp_path)
    proc, run_dir = _guard_run(tmp_path, ws, manifest, """
        cat .env || echo "first refused"
        echo '# back in scope' >> src/checkout/tax.py
        cat .env || echo "second refused"
        echo "ran on"
    """)
    log = (run_dir / "stdout.log").read_text()
    assert proc.returncode == 75, (proc.stderr[-2000:], log)
    assert "OPEN_FORBIDDEN_PATH" in proc.stderr + proc.stdout
    assert "s3cr3t" not in log and "first refused" in log and "ran on" not in log, log
    trips = [(e["rule"], e["state"]) for e in _events(run_dir) if e["op"] == "trip"]
    assert trips == [("forbidden_path", "HALF_OPEN_REANCHOR"), ("forbidden_path", "OPEN_FORBIDDEN_PATH")], trips


@pytest.mark.usefixtures("dev_fuse_mode_to_myself")  # it chmods /dev/fuse (see conftest.py)
@pytest.mark.root
@pytest.mark.mount
def test_an_unprivileged_guard_reads_the_intent_too(tmp_path: Path) -> None:
    """guard run as uid 65534 (its agent in a user namespace it owns): the guard may still read
    its agent's system calls, so a stat is no trip and a read is one."""
    from .test_run import UNPRIVILEGED, UNPRIVILEGED_PYTHON, _copy_installation, _fuse_open_to_others

    base = Path(tempfile.mkdtemp(prefix="guardfs-intent-"))  # under /tmp: reachable by the user
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the other user must reach it
        pythonpath = _copy_installation(base / "lib")
        ws, manifest = _workspace(base)
        subprocess.run(["chown", "-R", f"{UNPRIVILEGED}:{UNPRIVILEGED}", str(base)], check=True)
        user = ["setpriv", "--reuid", UNPRIVILEGED, "--regid", UNPRIVILEGED, "--clear-groups", UNPRIVILEGED_PYTHON]
        env = {**os.environ, "PYTHONPATH": pythonpath, "HOME": str(base)}
        with _fuse_open_to_others():
            result = subprocess.run(
                [*user, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(base / "run"),
                 "--", "sh", "-c", "stat .env || echo stat-refused; cat .env || echo cat-refused"],
                cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
            )
        assert result.returncode == 0, result.stderr[-2000:]
        log = (base / "run/stdout.log").read_text()
        assert "stat-refused" in log and "cat-refused" in log, log
        events = _events(base / "run")
        intents = [e.get("intent") for e in events if e["decision"] == "deny" and e["path"] == ".env"]
        assert intents and intents[0] in METADATA_CALLS and str(intents[-1]).startswith("open"), intents
        assert [e["state"] for e in events if e["op"] == "trip"] == ["HALF_OPEN_REANCHOR"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
