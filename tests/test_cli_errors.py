"""Errors become exit statuses in one place: the same error, the same status, in every verb."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardfs.errors import CantCreateError, Exit, GuardError, ManifestError, MountError, UnavailableError, UsageError
from sandbox.breaker.client import GuardClientError, GuardUnreachable
from sandbox.breaker.daemon import RunDirBusy
from sandbox.launch.isolation import IsolationUnavailable
from sandbox.report import ReportError

CONTROL_VERBS = ["status", "approve", "stop", "checkpoint", "rollback"]


def guard(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True,
                          timeout=60, input=stdin)


def test_every_error_carries_the_status_guard_exits_with() -> None:
    expected = {
        GuardError: Exit.SOFTWARE, UsageError: Exit.USAGE, ManifestError: Exit.DATAERR,
        UnavailableError: Exit.UNAVAILABLE, MountError: Exit.UNAVAILABLE, CantCreateError: Exit.CANTCREAT,
        GuardClientError: Exit.DATAERR, GuardUnreachable: Exit.UNAVAILABLE, RunDirBusy: Exit.USAGE,
        IsolationUnavailable: Exit.UNAVAILABLE, ReportError: Exit.USAGE,
    }
    for cls, status in expected.items():
        # The hook's two (fasthook: standard library only, run as a bare script) cannot derive
        # from GuardError; they carry the same exit_code, and guard's main maps both roots.
        assert issubclass(cls, GuardError) or cls.__module__ == "sandbox.agents.fasthook", cls
        assert getattr(cls, "exit_code", None) == status, cls


def _stale_socket(run_dir: Path) -> None:
    """A control.sock nobody listens on: what a guard killed with SIGKILL leaves."""
    run_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(run_dir / "control.sock"))


@pytest.mark.parametrize("verb", CONTROL_VERBS)
@pytest.mark.parametrize("where", ["missing", "empty", "stale-socket"])
def test_no_guard_at_the_run_dir_is_the_same_error_in_every_control_verb(
    tmp_path: Path, where: str, verb: str,
) -> None:
    run_dir = tmp_path / "run"
    if where == "empty":
        run_dir.mkdir()
    elif where == "stale-socket":
        _stale_socket(run_dir)
    proc = guard(verb, "--run-dir", str(run_dir))
    assert proc.returncode == Exit.UNAVAILABLE, proc.stderr
    assert proc.stderr.startswith(f"guard {verb}: no guard answers in run directory {run_dir} "), proc.stderr
    assert "give the run directory guard run or guard mount printed" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not proc.stdout


@pytest.fixture
def refusing_guard(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose control socket answers every request with ``ok: false``
    (what a guard of another protocol version says)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(run_dir / "control.sock"))
    server.listen()
    server.settimeout(30)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed by the fixture, or nobody came
            with conn:
                conn.makefile("rb").readline()
                conn.sendall(json.dumps({"v": 1, "ok": False, "error": "unsupported protocol version"}).encode()
                             + b"\n")

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield run_dir
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=30)
        assert not thread.is_alive()


@pytest.mark.parametrize("verb", CONTROL_VERBS)
def test_a_refused_request_is_the_same_error_in_every_control_verb(refusing_guard: Path, verb: str) -> None:
    proc = guard(verb, "--run-dir", str(refusing_guard))
    assert proc.returncode == Exit.DATAERR, proc.stderr
    assert proc.stderr == (f"guard {verb}: the guard in run directory {refusing_guard} refused {verb}: "
                           "unsupported protocol version\n")


def test_feed_maps_an_absent_guard_like_the_control_verbs(tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    for fmt in ("protocol", "claude-stream-json"):
        proc = guard("feed", "--socket", str(sock), "--format", fmt, stdin='{"type":"hello"}\n')
        assert proc.returncode == Exit.UNAVAILABLE, (fmt, proc.stderr)
        assert proc.stderr.startswith(f"guard feed: cannot reach the guard at {sock}: "), proc.stderr


def test_usage_errors_name_the_problem_and_what_to_do(tmp_path: Path) -> None:
    proc = guard("mount", str(tmp_path / "nope"), str(tmp_path))
    assert proc.returncode == Exit.USAGE
    assert proc.stderr == f"guard mount: BACKING {tmp_path / 'nope'} is not a directory; give an existing directory\n"
    proc = guard("exec")
    assert proc.returncode == Exit.USAGE and "put it after --" in proc.stderr
    proc = guard("report", "--run-dir", str(tmp_path / "nope"))
    assert proc.returncode == Exit.USAGE
    assert proc.stderr.startswith("guard report: ") and "the run directory guard run printed" in proc.stderr
