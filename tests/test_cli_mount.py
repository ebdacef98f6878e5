"""``guard mount`` as a user runs it: a real process, real signals, real exit statuses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .helpers import wait_for


@contextmanager
def guard_mount(tmp_path: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[str], Path, Path]]:
    """Start ``guard mount`` on tmp_path/backing; always leave no process and no mount."""
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "mount", *extra, str(backing), str(mnt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


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
