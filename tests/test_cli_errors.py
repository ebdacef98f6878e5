"""Errors become exit statuses in one place: the same error, the same status, in every verb."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
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
    assert proc.stderr == (f"guard mount: BACKING {tmp_path / 'nope'} does not exist; create it (mkdir) or give an "
                           "existing directory\n")
    proc = guard("exec")
    assert proc.returncode == Exit.USAGE and "put it after --" in proc.stderr
    proc = guard("report", "--run-dir", str(tmp_path / "nope"))
    assert proc.returncode == Exit.USAGE
    assert proc.stderr.startswith("guard report: ") and "the run directory guard run printed" in proc.stderr


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    proc = guard("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"guard (guardfs) {version('guardfs')}\n"


@pytest.mark.parametrize("argv", [["-v", "status"], ["status", "-v"]])
def test_verbose_is_accepted_before_and_after_the_verb(tmp_path: Path, argv: list[str]) -> None:
    """guard run -v was "unrecognized arguments" (only guard -v run was known)."""
    proc = guard(*argv, "--run-dir", str(tmp_path / "nope"))
    assert proc.returncode == Exit.UNAVAILABLE, proc.stderr  # parsed: it went on to look for the guard
    assert "unrecognized" not in proc.stderr


def _tracked_secret(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose git tracks .env, and a manifest that makes .env secret: a refused start."""
    from .test_run import workspace

    ws, manifest = workspace(tmp_path)
    subprocess.run(["git", "add", ".env"], cwd=ws, check=True)
    return ws, manifest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path (tmp_path's, plus a default run directory's name, can be
    too deep for a unix socket), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="gs-") as made:
        yield Path(made)


@pytest.mark.mount  # the refusal comes after the check that FUSE is there
def test_a_refused_start_leaves_no_run_directory(tmp_path: Path, short_tmp: Path) -> None:
    ws, manifest = _tracked_secret(tmp_path)
    given, state = tmp_path / "given-run", short_tmp  # the default run directory's sockets must fit
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    for run_dir in (["--run-dir", str(given)], []):
        proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), *run_dir,
                               "--", "true"], cwd=ws, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == Exit.DATAERR, proc.stderr
        assert "git holds secret path(s) .env" in proc.stderr, proc.stderr
    assert not given.exists()
    runs = state / "guardfs/runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
    given.mkdir()  # one the user made is theirs: kept
    proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir",
                           str(given), "--", "true"], cwd=ws, capture_output=True, text=True, timeout=120)
    assert proc.returncode == Exit.DATAERR, proc.stderr
    assert given.is_dir()


def test_a_run_directory_too_deep_for_its_sockets_is_refused_before_anything_starts(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "m.toml").write_text('[task]\nid = "t"\ngoal = "g"\n')
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    env = {**os.environ, "XDG_STATE_HOME": str(deep)}
    run = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(tmp_path / "m.toml"),
                          "--", "true"], cwd=ws, capture_output=True, text=True, timeout=120, env=env)
    mount = guard("mount", "--run-dir", str(deep / "run"), str(ws), str(tmp_path))
    for proc in (run, mount):
        assert proc.returncode == Exit.USAGE, proc.stderr
        assert "too deep for its sockets" in proc.stderr and "shorter --run-dir" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not deep.exists()  # no run directory was made for a start that could not be


def test_run_without_a_manifest_says_how_to_get_one(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--", "true"], cwd=ws, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == Exit.USAGE, proc.stderr
    assert proc.stderr == (f"guard run: no guard.toml in the workspace {ws}, and no --manifest given; write one with "
                           'guard init --allow DIR "GOAL" (DIR: where the agent may write), or pass --manifest M\n')
    assert "guard.toml" in guard("run", "--help").stdout
    for verbose in (["-v", "run"], ["run", "-v"]):  # guard run -v was "unrecognized arguments"
        proc = subprocess.run([sys.executable, "-m", "sandbox", *verbose, "--", "true"], cwd=ws, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == Exit.USAGE and proc.stderr.startswith("guard run: no guard.toml"), proc.stderr


@pytest.mark.root
@pytest.mark.mount
def test_guard_run_inside_guard_run_names_the_cause(tmp_path: Path) -> None:
    """It said "load the fuse module (modprobe fuse)"."""
    from .test_run import guard_run, workspace

    ws, manifest = workspace(tmp_path)
    inner = f"""
        import subprocess, sys
        proc = subprocess.run([{sys.executable!r}, "-m", "sandbox", "run", "--ci", "--", "true"],
                              capture_output=True, text=True)
        print("inner", proc.returncode, proc.stderr, flush=True)
    """
    result = guard_run(manifest, ws, tmp_path / "run", inner, "--ci")
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "run/stdout.log").read_text()
    assert log == ("inner 69 guard run: guard run cannot start here: this is the sandbox of a guard run (GUARD_SOCKET "
                   "is set), which has no /dev/fuse, so no guard can be started inside another. Start it outside the "
                   "sandbox, on the host; inside a run, guard exec -- CMD quarantines one tool command\n\n"), log


def test_a_default_run_directory_leaves_room_for_its_control_socket(tmp_path: Path) -> None:
    """guard init's task ids come from the goal (up to 36 characters), and homes are deep: a
    default run directory's control socket was past a unix socket's 107 bytes, so a new user's
    every run failed (70, "AF_UNIX path too long"; then refused as too deep). The id is cut."""
    from sandbox.breaker.client import control_socket_path
    from sandbox.breaker.daemon import SOCKET_PATH_MAX
    from sandbox.launch.run import default_run_dir

    base = Path("/home/a-long-user-name/.local/state/guardfs/runs")
    run_dir = default_run_dir("add-tag-count-to-taggit-utils-with-a", base)
    assert len(os.fsencode(control_socket_path(run_dir))) <= SOCKET_PATH_MAX
    kept = run_dir.name.split("-", 2)[2].removesuffix(f"-{os.getpid()}")
    assert run_dir.parent == base and len(kept) > 8 and "add-tag-count-to-taggit-utils-with-a".startswith(kept), run_dir
    assert default_run_dir("fix-tax", base).name.endswith(f"-fix-tax-{os.getpid()}")  # short ids whole



@pytest.mark.parametrize(("args", "status"), [(["schema"], 141), (["doctor", "--json"], 141), (["schema", "--help"], 0),
                                              (["--version"], 0)], ids=["schema", "doctor", "help", "version"])
def test_a_reader_gone_is_no_bug_in_guard(args: list[str], status: int) -> None:
    """``guard schema | head``: stdout is a pipe whose reader closed. Not "internal error" and
    70 with a traceback: 141 (128 + SIGPIPE, as the shell's own tools), nothing on stderr.
    argparse's own --help and --version swallow the write's error themselves and exit 0."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before guard writes its first byte
    try:
        proc = subprocess.run([sys.executable, "-m", "sandbox", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (status, ""), proc.stderr


def test_a_broken_pipe_that_is_not_stdout_is_still_a_bug() -> None:
    """The 141 is for stdout alone: a BrokenPipeError elsewhere (a socket) stays an internal error."""
    code = textwrap.dedent("""
        import socket, sys
        import sandbox.cli as cli
        def broken(args):
            a, b = socket.socketpair()
            b.close()
            a.sendall(b"x" * 100000)
            return 0
        cli._cmd_schema = broken
        sys.exit(cli.main(["schema"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 70, proc.stderr
    assert "internal error (a bug in guard" in proc.stderr and "BrokenPipeError" in proc.stderr
