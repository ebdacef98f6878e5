"""``guard mount`` as a user runs it: a real process, real signals, real exit statuses."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox.doctor import POINTER

from .helpers import git_env, wait_for


@contextmanager
def guard_mount(tmp_path: Path, *extra: str, env: dict[str, str] | None = None
                ) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    """Start ``guard mount`` on tmp_path/backing (in *env*); always leave no process and no mount."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "mount", *extra, str(backing), str(mnt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, "guard mount to mount")
        yield proc, backing, mnt
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
        while listed(mnt):  # a dead mount too, which os.path.ismount cannot stat
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=True)


def _unlisted_or_ended(mnt: Path, proc: subprocess.Popen[str]) -> bool:
    return not listed(mnt) or proc.poll() is not None


def _listed_or_ended(mnt: Path, proc: subprocess.Popen[str]) -> bool:
    return listed(mnt) > 0 or proc.poll() is not None


def listed(mnt: Path) -> int:
    """How many mounts /proc/self/mountinfo lists at *mnt* (no stat: a dead mount counts too)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        return sum(line.split(" ")[4] == str(mnt) for line in table)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.mount
def test_signal_unmounts_and_exits_0(tmp_path: Path, signum: int) -> None:
    manifest = Path(__file__).parent.parent / "manifests/checkout-bugfix.toml"
    events = tmp_path / "events.jsonl"
    with guard_mount(tmp_path, "--manifest", str(manifest), "--events", str(events)) as (proc, backing, mnt):
        assert os.path.ismount(mnt)
        (backing / "src/checkout").mkdir(parents=True)
        (mnt / "src/checkout/tax.py").write_text("x = 1\n")
        with pytest.raises(PermissionError):
            (mnt / ".env").write_text("nope")
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 0
        assert not os.path.ismount(mnt)
    assert (backing / "src/checkout/tax.py").read_text() == "x = 1\n"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert {"create", "rewrite"} <= {e["op"] for e in lines}
    assert any(e["decision"] == "deny" and e["pattern"] == ".env*" for e in lines)


@pytest.mark.mount
def test_external_unmount_ends_the_server(tmp_path: Path) -> None:
    with guard_mount(tmp_path) as (proc, _backing, mnt):
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
        assert proc.wait(timeout=20) == 0


@pytest.mark.mount
def test_without_manifest_the_mount_is_read_only(tmp_path: Path) -> None:
    (tmp_path / "backing").mkdir()
    (tmp_path / "backing/file").write_text("data")
    with guard_mount(tmp_path) as (proc, _backing, mnt):
        assert (mnt / "file").read_text() == "data"
        with pytest.raises(OSError, match="Read-only file system"):
            (mnt / "file").write_text("changed")
        proc.terminate()
        assert proc.wait(timeout=20) == 0


@pytest.mark.mount
def test_guard_killed_fails_closed(tmp_path: Path) -> None:
    """SIGKILL leaves no server: the mount refuses everything (ENOTCONN), writes included."""
    (tmp_path / "backing").mkdir()
    (tmp_path / "backing/file").write_text("data")
    with guard_mount(tmp_path) as (proc, backing, mnt):
        proc.kill()
        proc.wait(timeout=20)
        with pytest.raises(OSError) as info:
            (mnt / "new").write_text("after death")
        assert info.value.errno in (107, 103)  # ENOTCONN or ECONNABORTED
        assert not (backing / "new").exists()


def test_invalid_manifest_exits_65_without_mounting(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[task]\nid = "t"\ngoal = "g"\n[paths]\nforbidden = ["**"]\n')
    with guard_mount(tmp_path, "--manifest", str(bad)) as (proc, _backing, mnt):
        assert proc.wait(timeout=20) == 65
        assert not os.path.ismount(mnt)
        assert proc.stderr is not None
        assert "paths.forbidden[0]" in proc.stderr.read()


def test_bad_usage_exits_64(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "sandbox", "mount"]
    assert subprocess.run([*run, str(tmp_path / "nope"), str(tmp_path)], capture_output=True).returncode == 64
    assert subprocess.run([*run, str(tmp_path), str(tmp_path)], capture_output=True).returncode == 64
    assert subprocess.run([*run, str(tmp_path)], capture_output=True).returncode == 64


@pytest.mark.root
def test_missing_dev_fuse_exits_69(tmp_path: Path) -> None:
    """In a private mount namespace whose /dev has no fuse device."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to hide /dev/fuse in a private mount namespace")
    (tmp_path / "backing").mkdir()
    (tmp_path / "mnt").mkdir()
    script = (
        f"mount -t tmpfs none /dev && exec {sys.executable} -m sandbox mount "
        f"{tmp_path / 'backing'} {tmp_path / 'mnt'}"
    )
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 69, proc.stderr
    assert "/dev/fuse does not exist" in proc.stderr


@pytest.mark.mount
def test_sigterm_at_any_moment_unmounts(tmp_path: Path) -> None:
    """SIGTERM as `timeout` sends it (to the guard, then to its process group) the moment the
    mount exists, before the serve loop listens: never a dead mount, always exit 0. Before,
    the default action killed the guard between the mount and its handler (8 times in 10), and a
    second signal after the unmount killed its clean-up (exit -15)."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    (backing / "file").write_text("data")
    for attempt in range(20):
        proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", str(backing), str(mnt)],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            wait_for(functools.partial(_listed_or_ended, mnt, proc), "the mount to be listed")
            os.kill(proc.pid, signal.SIGTERM)
            if attempt % 2:  # the group's signal late, after the unmount (a loaded machine's order)
                wait_for(functools.partial(_unlisted_or_ended, mnt, proc), "the unmount")
            with contextlib.suppress(ProcessLookupError):  # it may have exited already
                os.killpg(proc.pid, signal.SIGTERM)
            _out, err = proc.communicate(timeout=20)
            assert proc.returncode == 0, (attempt, proc.returncode, err)
            assert not listed(mnt), attempt
            assert os.listdir(mnt) == [], attempt  # no ENOTCONN: the directory itself again
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=20)
            while listed(mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=True)


@pytest.mark.mount
def test_mount_over_a_dead_mount_names_it_and_the_fix(tmp_path: Path) -> None:
    """A guard mount killed with SIGKILL (as root: no auto_unmount) leaves a dead mount; the next
    guard mount there says so, and how to remove it (it said "is not a directory")."""
    with guard_mount(tmp_path) as (proc, backing, mnt):
        proc.kill()
        proc.wait(timeout=20)
        with pytest.raises(OSError) as dead:
            os.statvfs(mnt)  # (a stat may still be answered from the kernel's cache)
        assert dead.value.errno == 107  # ENOTCONN: a real dead mount
        again = subprocess.run([sys.executable, "-m", "sandbox", "mount", str(backing), str(mnt)],
                               capture_output=True, text=True, timeout=60)
        assert again.returncode == 64, again.stderr
        assert again.stderr == (
            f"guard mount: mountpoint {mnt} is a dead FUSE mount: the guard that served it is gone (Transport "
            f"endpoint is not connected); unmount it with fusermount3 -u {mnt} (as root: umount -l), then try again\n")
        assert listed(mnt) == 1  # nothing stacked on it
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)  # the fix it names works
        with guard_mount(tmp_path) as (again_proc, _backing, _mnt):
            assert again_proc.poll() is None and os.path.ismount(mnt)


@pytest.mark.mount
def test_a_second_mount_on_a_live_mount_is_refused(tmp_path: Path) -> None:
    """It stacked silently before, hiding the first."""
    (tmp_path / "backing").mkdir()
    (tmp_path / "backing/file").write_text("first")
    with guard_mount(tmp_path) as (proc, _backing, mnt):
        other = tmp_path / "other"
        other.mkdir()
        second = subprocess.run([sys.executable, "-m", "sandbox", "mount", str(other), str(mnt)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 64, second.stderr
        assert second.stderr.startswith(
            f"guard mount: mountpoint {mnt} is already a mount (fuse.guardfs guardfs); a second mount would hide "
            "it. Unmount it first (fusermount3 -u "), second.stderr
        assert listed(mnt) == 1
        assert (mnt / "file").read_text() == "first"  # the first still serves
        assert proc.poll() is None


@pytest.mark.mount
@pytest.mark.parametrize("position", [["-v", "mount"], ["mount", "-v"]])
def test_verbose_before_or_after_the_verb(tmp_path: Path, position: list[str]) -> None:
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", *position, str(backing), str(mnt)],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, "guard mount to mount")
        proc.terminate()
        _out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)
    assert proc.returncode == 0, err
    assert f"guard: serving {backing} at {mnt}\n" in err, err


# Runs as root in a private mount namespace: /dev/fuse there is a device node of the mode
# given, and guard mount runs as uid 65534, as a user on a host whose /dev/fuse is so.
_USER_FUSE = """
import json, os, signal, stat, subprocess, sys
sys.path.insert(0, {repo!r})
from tests.helpers import wait_for
base = {base!r}
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "none", base + "/dev"], check=True)
os.mknod(base + "/dev/fuse", stat.S_IFCHR | {mode}, os.makedev(10, 229))
os.chmod(base + "/dev/fuse", {mode})  # not narrowed by the umask
subprocess.run(["mount", "--bind", base + "/dev/fuse", "/dev/fuse"], check=True)
user = ["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
probe = subprocess.run([*user, "sh", "-c", "exec 3<>/dev/fuse"], capture_output=True, text=True)
env = {{**os.environ, "PYTHONPATH": {pythonpath!r}, "PATH": {path!r}}}
proc = subprocess.Popen([*user, "/usr/bin/python3", "-m", "sandbox", "mount", "--run-dir", base + "/run",
                         base + "/backing", base + "/mnt"],
                        stderr=subprocess.PIPE, text=True, env=env, cwd=base)
read = None
def served():  # read as the user: without allow_other, FUSE refuses everyone else, root too
    global read
    cat = subprocess.run([*user, "cat", base + "/mnt/file"], capture_output=True, text=True)
    read = cat.stdout if cat.returncode == 0 else None
    return read is not None or proc.poll() is not None
try:
    wait_for(served, "the mount to serve, or guard mount to end")
finally:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=20)
print(json.dumps({{"opens": probe.returncode == 0, "status": proc.returncode, "stderr": err, "read": read,
                  "mounted": os.path.ismount(base + "/mnt"), "run_dir": os.path.exists(base + "/run")}}))
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize(("mode", "helper"), [(0o600, "setuid"), (0o666, "plain"), (0o666, "setuid")])
def test_guard_mount_as_a_user(installation: str, mode: int, helper: str) -> None:
    """guard mount as uid 65534. /dev/fuse 0600 (root's): the message names the device's mode
    and the fix (libfuse's own mount failed before, and the message blamed the mountpoint;
    fusermount3 opens the device as the user, so it is no way around). A fusermount3 that is
    not setuid: said so. /dev/fuse 0666 and the setuid fusermount3: it mounts through it, serves,
    and unmounts on SIGTERM."""
    base = Path(tempfile.mkdtemp(prefix="guardfs-user-fuse-"))  # under /tmp: reachable by the user
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the other user must reach it
        for name in ("dev", "backing", "mnt", "bin"):
            (base / name).mkdir()
        (base / "backing/file").write_text("served")
        path = "/usr/bin:/bin"
        if helper == "plain":  # a fusermount3 first on PATH that is not setuid
            shutil.copy(shutil.which("fusermount3") or "/usr/bin/fusermount3", base / "bin/fusermount3")
            path = f"{base}/bin:{path}"
        subprocess.run(["chown", "-R", "65534:65534", str(base)], check=True)
        script = _USER_FUSE.format(repo=str(Path(__file__).resolve().parent.parent), base=str(base), mode=oct(mode),
                                   pythonpath=installation, path=path)
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                               textwrap.dedent(script)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        found = json.loads(proc.stdout)
        assert found["opens"] == (mode == 0o666)  # the user really can or cannot open the device
        if mode == 0o600:
            assert found["stderr"] == (
                "guard mount: /dev/fuse is mode 0600 (owner uid 0, group gid 0): uid 65534 may not open it, nor may "
                "fusermount3, which opens it as the same user; as root, chmod 0666 /dev/fuse (the mode fuse3 gives "
                f"it), or run guard as root. {POINTER}\n"), found
        elif helper == "plain":
            assert found["stderr"] == (
                f"guard mount: uid 65534 may not mount, and {base}/bin/fusermount3 is not setuid root to mount for "
                "it; install fuse3 (apt-get install fuse3: its fusermount3 is setuid root), or run guard as root. "
                f"{POINTER}\n"), found
        if helper == "setuid" and mode == 0o666:
            assert (found["status"], found["read"], found["mounted"], found["run_dir"]) == (0, "served", False, True)
        else:  # a refused start leaves no run directory behind
            assert (found["status"], found["read"], found["run_dir"]) == (69, None, False), found
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.mount  # the refusal comes after the check that FUSE is there
def test_a_refused_mount_leaves_no_run_directory(tmp_path: Path) -> None:
    """git tracks a secret: refused (65) before the mount, and the run directory it made is gone."""
    backing, mnt, run_dir = tmp_path / "backing", tmp_path / "mnt", tmp_path / "runs/run"
    backing.mkdir()
    mnt.mkdir()
    (backing / ".env").write_text("SECRET=1\n")
    subprocess.run(["git", "init", "-q"], cwd=backing, check=True)
    subprocess.run(["git", "add", ".env"], cwd=backing, check=True)
    manifest = tmp_path / "m.toml"
    manifest.write_text('[task]\nid = "t"\ngoal = "g"\n[paths]\nsecret = [".env*"]\n')
    proc = subprocess.run([sys.executable, "-m", "sandbox", "mount", "--manifest", str(manifest), "--run-dir",
                           str(run_dir), str(backing), str(mnt)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 65, proc.stderr
    assert "git holds secret path(s) .env" in proc.stderr, proc.stderr
    assert not run_dir.exists() and not listed(mnt)


@pytest.mark.mount
def test_guard_mount_says_what_git_holds_and_shares_the_runs_cache(tmp_path: Path) -> None:
    """guard mount checks git's stores as guard run does, says so (under "warn": that the secret
    is readable through git), and keeps the check in the same cache: the second mount pays nothing."""
    backing = tmp_path / "backing"
    backing.mkdir()
    env = {**git_env(backing), "XDG_STATE_HOME": str(tmp_path / "state")}
    (backing / ".env").write_text("SECRET=1\n")
    for args in (["init", "-q"], ["add", ".env"], ["commit", "-qm", "oops"], ["rm", "-q", "--cached", ".env"],
                 ["commit", "-qm", "untracked since"]):
        subprocess.run(["git", *args], cwd=backing, check=True, env=env)
    manifest = tmp_path / "m.toml"
    manifest.write_text('[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/"]\nsecret = [".env*"]\n'
                        'forbidden_in_git = "warn"\n')
    said = []
    for _ in range(2):
        with guard_mount(tmp_path, "--manifest", str(manifest), env=env) as (proc, _backing, mnt):
            assert os.path.ismount(mnt), proc.stderr.read() if proc.stderr else ""
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        said.append(err)
    assert "guard mount: WARNING: git holds secret path(s) .env" in said[0], said[0]
    assert "git history checked for secrets: 1 repository" in said[0] and "from the cache" not in said[0], said[0]
    assert f"(1 from the cache of {tmp_path / 'state/guardfs/git-history'})" in said[1], said[1]
