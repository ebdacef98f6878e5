"""Hostile agents against other runs and the host (issue 12, items 5, 6 and 8).

Each attack runs from inside a real ``guard run``, as root and as ``--user nobody``: another
live run's control socket, root's secrets, another run's logs, the guard's environment, the
host's loopback and abstract sockets, the lanes' staging directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guardfs.manifest import parse_manifest
from sandbox.launch.lanes import plan_lanes
from sandbox.launch.run import BASE_ENV

from .helpers import wait_for
from .test_lanes import LANES, tree
from .test_run import workspace

USERS = [None, "nobody"]
#: The agent's interpreter: the system's, which an agent of another user can run.
PYTHON = "/usr/bin/python3"

PROBE = r"""
import errno, json, os, socket, sys
args = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except OSError as err:
        out[name] = [errno.errorcode.get(err.errno, str(err.errno)), None]
def read(path):
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")
def ask(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    s.sendall(b'{"v":1,"type":"stop"}\n')
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()
def tcp(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.close()
def abstract(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name)
    s.close()
for path in args.get("sockets", []):
    attempt("sock:" + path, lambda: ask(path))
for path in args.get("reads", []):
    attempt("read:" + path, lambda: read(path))
for path in args.get("lists", []):
    attempt("list:" + path, lambda: os.listdir(path))
if "port" in args:
    attempt("tcp", lambda: tcp(args["port"]))
    attempt("abstract", lambda: abstract(args["abstract"]))
if args.get("mountinfo"):
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    staged = [p for p in points if "guardfs-stage" in p or p.startswith(args["mountinfo"])]
    out["staged"] = staged
    for p in staged:
        attempt("list:" + p, lambda: os.listdir(p))
out["env"] = sorted(os.environ)
print(json.dumps(out), flush=True)
"""


def _run(manifest: Path, ws: Path, run_dir: Path, args: dict[str, Any], user: str | None,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """guard run the probe as the agent; its findings, read from the run's stdout.log."""
    flags = ["--user", user] if user else []
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         *flags, "--", PYTHON, "-c", PROBE, json.dumps(args)],
        cwd=ws, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL,
    )
    lines = (run_dir / "stdout.log").read_text().splitlines()
    assert lines, (result.returncode, result.stderr)
    return result, json.loads(lines[-1])


def _workspace(base: Path, user: str | None, extra: str = "") -> tuple[Path, Path]:
    ws, manifest = workspace(base)
    manifest.write_text(manifest.read_text() + extra)
    if user:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    return ws, manifest


@contextlib.contextmanager
def _run_b(tmp_path: Path, shared: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """Run B, live: an agent that has written to its log and waits; its run directory under
    /var/tmp (not one of the places every sandbox hides anyway)."""
    ws, manifest = workspace(tmp_path / "b")
    run_b = shared / "run-b"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_b),
         "--", PYTHON, "-c", "import signal; print('B-LOG-SECRET', flush=True); signal.pause()"],
        cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        wait_for(lambda: proc.poll() is not None or (
            (run_b / "control.sock").exists() and (run_b / "stdout.log").exists()
            and "B-LOG-SECRET" in (run_b / "stdout.log").read_text()), "run B's agent", timeout=60)
        assert proc.poll() is None
        yield proc, run_b
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_another_run_and_the_hosts_secrets_are_out_of_reach(tmp_path: Path, user: str | None) -> None:
    """From run A: B's control socket (hidden; and, through a hard link A may reach, refused
    for being in another PID namespace), B's logs, /etc/shadow, /root: none of it. B goes on,
    and the host's operator still steers it. With --user the agent's environment holds only
    the allowlist."""
    shared = Path(tempfile.mkdtemp(prefix="guardfs-escape-", dir="/var/tmp"))
    canary = Path(tempfile.mkstemp(prefix=".guardfs-canary-", dir="/root")[1])
    try:
        canary.write_text("ROOT-ONLY\n")
        shared.chmod(0o711)  # an agent of another user's bubblewrap binds exposed/ from here
        exposed = shared / "exposed"
        exposed.mkdir()
        if user:
            os.chown(exposed, 65534, 65534)
        with _run_b(tmp_path, shared) as (proc_b, run_b):
            os.link(run_b / "control.sock", exposed / "b-control.sock")  # A reaches this path
            ws, manifest = _workspace(tmp_path / "a", user, f'[sandbox]\nwritable = ["{exposed}"]\n')
            args = {"sockets": [str(run_b / "control.sock"), str(exposed / "b-control.sock")],
                    "reads": [str(run_b / "stdout.log"), str(run_b / "ledger.json"), "/etc/shadow", str(canary)],
                    "lists": ["/root", str(run_b)]}
            env = {**os.environ, "GUARD_TEST_SECRET": "x", "ANTHROPIC_API_KEY": "sk-allowed"}
            if user:  # named by the manifest: it passes; the canary does not
                manifest.write_text(manifest.read_text() + 'env = ["ANTHROPIC_*"]\n')
            result, found = _run(manifest, ws, tmp_path / "run-a", args, user, env)
            assert result.returncode == 0, result.stderr
            assert found[f"sock:{run_b}/control.sock"][0] == "ENOENT", found
            # A socket of the host, refused by the guard's connect judge (issue 21), before B's own
            # peer check (another PID namespace) could refuse it.
            assert found[f"sock:{exposed}/b-control.sock"][0] == "EACCES", found
            assert found[f"read:{run_b}/stdout.log"][0] == "ENOENT", found
            assert found[f"read:{run_b}/ledger.json"][0] == "ENOENT", found
            assert found["read:/etc/shadow"][0] == "EACCES", found
            assert found[f"read:{canary}"][0] == "ENOENT", found
            assert found[f"list:{run_b}"] in (["ok", []], ["ENOENT", None]), found  # an empty stand-in
            listed = found["list:/root"]
            assert listed[0] != "ok" or canary.name not in listed[1], found
            if user:
                _only_allowed(set(found["env"]))
            # B is unaffected: still running, steered from the host, and stops when told.
            assert proc_b.poll() is None
            status = subprocess.run([sys.executable, "-m", "sandbox", "status", "--run-dir", str(run_b)],
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            stop = subprocess.run([sys.executable, "-m", "sandbox", "stop", "--run-dir", str(run_b)],
                                  capture_output=True, text=True, timeout=60)
            assert stop.returncode == 0, stop.stderr
            assert proc_b.wait(timeout=60) == 75
    finally:
        canary.unlink(missing_ok=True)
        shutil.rmtree(shared, ignore_errors=True)
    assert not _stages_left_by_ended_guards()


def _only_allowed(names: set[str]) -> None:
    """The agent's environment: the allowlist, the manifest's names and the guard's own."""
    assert "GUARD_TEST_SECRET" not in names
    assert "ANTHROPIC_API_KEY" in names  # [sandbox] env = ["ANTHROPIC_*"]
    allowed = {n for n in BASE_ENV if not n.endswith("*")} | {"PWD", "SHLVL", "_", "ANTHROPIC_API_KEY"}
    strays = {n for n in names if n not in allowed and not n.startswith(("LC_", "GUARD_"))}
    assert not strays, strays


@contextlib.contextmanager
def _host_listeners() -> Iterator[tuple[int, str]]:
    """A TCP listener on the host's 127.0.0.1 and an abstract unix socket of the host."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"guardfs-test-{os.getpid()}"
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        unix.bind("\0" + name)
        unix.listen(8)
        yield tcp.getsockname()[1], name
    finally:
        tcp.close()
        unix.close()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("network", ["host", "none"])
def test_network_none_leaves_the_host_unreachable(tmp_path: Path, user: str | None, network: str) -> None:
    """network = "none": the host's loopback listener and abstract socket are unreachable;
    "host" (the default, left unsaid): the listener is reachable, the abstract socket refused
    (issue 21: the host's unix sockets are out of reach in every mode)."""
    extra = '[sandbox]\nnetwork = "none"\n' if network == "none" else ""
    ws, manifest = _workspace(tmp_path, user, extra)
    with _host_listeners() as (port, name):
        result, found = _run(manifest, ws, tmp_path / "run", {"port": port, "abstract": name}, user)
    assert result.returncode == 0, result.stderr
    if network == "none":
        assert found["tcp"][0] == "ECONNREFUSED", found
        assert found["abstract"][0] == "ECONNREFUSED", found
    else:
        assert found["tcp"][0] == "ok" and found["abstract"][0] == "EACCES", found


def test_network_none_needs_the_sandbox(tmp_path: Path) -> None:
    ws, manifest = _workspace(tmp_path, None, '[sandbox]\nnetwork = "none"\n')
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--no-isolation", "--manifest", str(manifest),
         "--run-dir", str(tmp_path / "run"), "--", "true"], cwd=ws, capture_output=True, text=True, timeout=60)
    assert result.returncode == 64 and 'network = "none" needs the sandbox' in result.stderr


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_lanes_staging_is_out_of_sight_whatever_tmpdir_says(tmp_path: Path, user: str | None) -> None:
    """TMPDIR elsewhere: no mount inside the sandbox lies in it or is reachable under a
    staging path, and the lanes' forbidden files stay unreadable."""
    tmpdir = Path(tempfile.mkdtemp(prefix="guardfs-tmpdir-", dir="/var/tmp"))
    try:
        ws = tree(tmp_path / "ws")
        if user:
            subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        manifest = tmp_path / "lanes.toml"
        manifest.write_text(LANES.replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]'))
        # One forbidden read: a second would stop the run (forbidden_path is recoverable once).
        args = {"mountinfo": str(tmpdir), "reads": ["node_modules/pkg/secrets/key.pem"],
                "lists": ["docs", "node_modules/pkg"]}
        env = {**os.environ, "TMPDIR": str(tmpdir)}
        result, found = _run(manifest, ws, tmp_path / "run", args, user, env)
        assert "fast lanes (read natively" in result.stderr
        assert not any(str(p).startswith(str(tmpdir)) for p in found["staged"]), found
        for p in found["staged"]:
            assert found[f"list:{p}"][0] == "ENOENT", found  # named in mountinfo, reachable nowhere
        assert found["read:node_modules/pkg/secrets/key.pem"][0] in ("EACCES", "ENOENT"), found
        assert found["list:docs"] == ["ok", ["api"]], found  # .env.docs: not even named
        assert sorted(found["list:node_modules/pkg"][1]) == ["index.js", "lib"], found
        assert list(tmpdir.iterdir()) == []
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert not _stages_left_by_ended_guards()


def test_lane_planning_leaves_out_symlinked_and_in_scope_lanes(tmp_path: Path) -> None:
    """A lane below a symlinked directory and a lane inside paths.allowed are left out, each
    with a message saying why and what to do; the rest of the plan stands."""
    ws = tree(tmp_path / "ws")
    (ws / "third_party").symlink_to("vendor")
    manifest = parse_manifest(LANES.replace('fast_lanes = ["node_modules"]',
                                            'fast_lanes = ["node_modules", "third_party/lib", "src/checkout", "src"]'))
    lanes = plan_lanes(manifest, ws)
    text = "\n".join(lanes.skipped)
    assert "third_party/lib: third_party is a symlink" in text and "name the real directory" in text
    assert "src/checkout: inside paths.allowed" in text
    assert "src: inside paths.allowed" in text  # an allowed directory lies beneath it
    assert "node_modules/pkg/lib" in lanes.trees
    assert not any(t.startswith(("src", "third_party")) and t != "src/auth" for t in lanes.trees)


WAITER = r"""
import errno, json, os, sys, time
go = sys.argv[1]
print("A-READY", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)  # the host writes go.json once run B is up
out = {}
for path in json.loads(open(go).read()):
    try:
        out["list:" + path] = ["ok", os.listdir(path)]
    except OSError as err:
        out["list:" + path] = [errno.errorcode[err.errno], None]
    for name in ("stdout.log", "events.jsonl", "ledger.json"):
        try:
            out["read:" + name] = ["ok", open(os.path.join(path, name)).read()]
        except OSError as err:
            out["read:" + name] = [errno.errorcode[err.errno], None]
print(json.dumps(out), flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", USERS)
def test_a_run_directory_made_after_a_sandbox_started_is_closed_to_it(tmp_path: Path, user: str | None) -> None:
    """Run A's sandbox is built first; then run B starts with --run-dir under /var/tmp (no
    place every sandbox hides, and not live when A's masks were computed). A's agent, root
    or not, can neither list B's run directory nor read B's log, events or ledger."""
    shared = Path(tempfile.mkdtemp(prefix="guardfs-escape-", dir="/var/tmp"))
    try:
        shared.chmod(0o711)
        exposed = shared / "exposed"
        exposed.mkdir()
        if user:
            os.chown(exposed, 65534, 65534)
        ws, manifest = _workspace(tmp_path / "a", user, f'[sandbox]\nwritable = ["{exposed}"]\n')
        run_a = tmp_path / "run-a"
        flags = ["--user", user] if user else []
        proc_a = subprocess.Popen(
            [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_a),
             *flags, "--", PYTHON, "-c", WAITER, str(exposed / "go.json")],
            cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        try:
            wait_for(lambda: proc_a.poll() is not None or (
                (run_a / "stdout.log").exists() and "A-READY" in (run_a / "stdout.log").read_text()),
                "run A's agent", timeout=60)
            assert proc_a.poll() is None
            with _run_b(tmp_path, shared) as (proc_b, run_b):
                go = exposed / "go.json"
                go.with_suffix(".tmp").write_text(json.dumps([str(run_b)]))
                go.with_suffix(".tmp").rename(go)
                _, err = proc_a.communicate(timeout=120)
                assert proc_a.returncode == 0, err
                assert proc_b.poll() is None  # B runs on
                mode = os.stat(run_b).st_mode & 0o7777
                _stop(proc_b, run_b)
        finally:
            if proc_a.poll() is None:
                proc_a.kill()
                proc_a.wait()
        found = json.loads((run_a / "stdout.log").read_text().splitlines()[-1])
        assert found[f"list:{run_b}"][0] == "EACCES", found
        for name in ("stdout.log", "events.jsonl", "ledger.json"):
            assert found[f"read:{name}"][0] == "EACCES", found
        assert mode == 0  # the guard's alone, by its capabilities
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.root
@pytest.mark.mount
def test_a_live_run_another_user_cannot_reach_does_not_stop_that_users_run(tmp_path: Path) -> None:
    """Every sandbox covers the other live runs' directories; one under a directory the agent's
    user may not enter (0700) needs no cover from it, and its bubblewrap could not place one
    there: `guard run --user nobody` must start while such a run lives (it failed with
    "bwrap: Can't mkdir ...: Permission denied")."""
    closed = Path(tempfile.mkdtemp(prefix="guardfs-closed-", dir="/var/tmp"))
    try:
        closed.chmod(0o700)
        with _run_b(tmp_path, closed) as (live, run_b):
            ws, manifest = _workspace(tmp_path / "n", "nobody")
            result, found = _run(manifest, ws, tmp_path / "run-n", {"lists": [str(run_b)]}, "nobody")
            assert result.returncode == 0, result.stderr
            assert found[f"list:{run_b}"][0] == "EACCES", found  # out of reach all the same
            assert live.poll() is None
            _stop(live, run_b)
    finally:
        shutil.rmtree(closed, ignore_errors=True)


@pytest.mark.root
@pytest.mark.mount
def test_a_guard_killed_with_sigkill_leaves_no_stage_behind_the_next_start(tmp_path: Path) -> None:
    """A guard killed with SIGKILL cannot remove its (empty) staging directory; the next
    guard that starts removes it, since its guard is gone, and keeps a live guard's."""
    ws, manifest = workspace(tmp_path / "k")
    marker = f"guardfs-stale-stage-{os.getpid()}"
    killed = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir",
         str(tmp_path / "run-k"), "--", PYTHON, "-c", f"import signal; print({marker!r}, flush=True); signal.pause()"],
        cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: killed.poll() is not None or (
            (tmp_path / "run-k/stdout.log").exists() and marker in (tmp_path / "run-k/stdout.log").read_text()),
            "the agent to be killed", timeout=60)
        assert killed.poll() is None
        stages = list(Path("/tmp").glob(f"guardfs-stage-*.{killed.pid}-*"))
        assert len(stages) == 1, stages
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    wait_for(lambda: not os.path.exists(f"/proc/{killed.pid}"), "the killed guard to be reaped")
    assert stages[0].is_dir() and list(stages[0].iterdir()) == []  # left behind, empty on the host
    shared = Path(tempfile.mkdtemp(prefix="guardfs-escape-", dir="/var/tmp"))
    # Traversable, as in the tests above: while B lives, every other run's sandbox covers its run
    # directory, and an agent user's bubblewrap (another pytest-xdist worker's run) must reach it.
    shared.chmod(0o711)
    with _run_b(tmp_path, shared) as (live, run_b):
        live_stage = list(Path("/tmp").glob(f"guardfs-stage-*.{live.pid}-*"))
        assert not stages[0].exists()  # removed by this guard as it started
        ws2, manifest2 = workspace(tmp_path / "n")
        result = subprocess.run(
            [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest2), "--run-dir",
             str(tmp_path / "run-n"), "--", "true"], cwd=ws2, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert list(Path("/tmp").glob(f"guardfs-stage-*.{live.pid}-*")) == live_stage != []  # a live guard's stays
        assert live.poll() is None
        _stop(live, run_b)
    shutil.rmtree(run_b.parent, ignore_errors=True)


def _stages_left_by_ended_guards() -> list[Path]:
    """What is left in the staging directories of guards that have ended (named
    guardfs-stage-<pidns>.<pid>-*): a live guard's, another test's under pytest-xdist, is its
    own, and may vanish while we look."""
    left = []
    for stage in Path("/tmp").glob("guardfs-stage-*"):
        pid = stage.name.removeprefix("guardfs-stage-").split(".", 1)[-1].split("-", 1)[0]
        if pid.isdigit() and os.path.exists(f"/proc/{pid}"):
            continue
        with contextlib.suppress(FileNotFoundError):
            left += list(stage.iterdir())
    return left


def _stop(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """Stop a live run from the host, as its operator would (no stale staging left)."""
    stop = subprocess.run([sys.executable, "-m", "sandbox", "stop", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert proc.wait(timeout=60) == 75
