"""Rollback over hostile leftovers, on the pre-image store directly (no FUSE): what a mount
cannot make (a socket bound in the backing, a device node, bytes written behind the guard's
back, a bind mount over a restored path) and what a rollback then does with each."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardfs.backing import Backing
from guardfs.checkpoint import PreImages, last_rollback, rollback_offline


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    """A workspace with src/a.py, src/d/x.py and a host directory (a canary) beside it."""
    root = tmp_path / "ws"
    (root / "src/d").mkdir(parents=True)
    (root / "src/a.py").write_text("a = 1\n")
    (root / "src/d/x.py").write_text("x = 1\n")
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "x.py").write_text("canary\n")
    yield root
    assert sorted(p.name for p in canary.iterdir()) == ["x.py"] and (canary / "x.py").read_text() == "canary\n"


def _store(ws: Path) -> tuple[PreImages, Path]:
    store = ws.parent / "run/checkpoint"
    return PreImages(Backing(str(ws)), store, max_bytes=64), store


def _restored(ws: Path) -> None:
    assert (ws / "src/a.py").read_text() == "a = 1\n" and stat.S_ISREG(os.lstat(ws / "src/a.py").st_mode)
    assert stat.S_ISDIR(os.lstat(ws / "src/d").st_mode) and (ws / "src/d/x.py").read_text() == "x = 1\n"


async def test_a_symlink_above_and_a_socket_at_a_restored_path(ws: Path) -> None:
    """src/d replaced by a symlink to the host, src/a.py by a bound unix socket: both taken
    away, never followed, the pre-images put back."""
    pre, store = _store(ws)
    await pre.keep("src/a.py", "src/d/x.py")
    await pre.keep_tree("src/d")
    (ws / "src/d/x.py").unlink()
    (ws / "src/d").rmdir()
    (ws / "src/d").symlink_to(ws.parent / "canary")
    (ws / "src/a.py").unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(ws / "src/a.py"))
    finally:
        sock.close()
    pre.close()
    done = rollback_offline(str(ws), store, "start")
    assert (done.failed, done.moved_aside) == ({}, {})
    _restored(ws)


@pytest.mark.root
async def test_a_device_node_where_a_file_was(ws: Path) -> None:
    pre, store = _store(ws)
    await pre.keep("src/a.py")
    (ws / "src/a.py").unlink()
    os.mknod(ws / "src/a.py", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
    pre.close()
    assert rollback_offline(str(ws), store, "start").failed == {}
    _restored(ws)


async def test_bytes_no_restore_point_keeps_are_moved_aside(ws: Path) -> None:
    """A directory made where a file was, holding a file the guard never saw made (written
    behind its back), and a file too large to keep moved into a tree the rollback takes
    away: each tree moved whole into the run directory and named, nothing deleted."""
    (ws / "src/big.bin").write_bytes(b"B" * 4096)  # past max_bytes=64: not restorable
    pre, store = _store(ws)
    await pre.keep("src/a.py")
    (ws / "src/a.py").unlink()
    (ws / "src/a.py").mkdir()
    (ws / "src/a.py/unseen.txt").write_text("written where the guard did not see it\n")
    await pre.keep("src/big.bin", "src/pkg")
    (ws / "src/pkg").mkdir()
    os.rename(ws / "src/big.bin", ws / "src/pkg/big.bin")
    pre.close()
    done = rollback_offline(str(ws), store, "start")
    aside = ws.parent / "run/rollback-aside"
    assert done.moved_aside == {"src/a.py": str(aside / "0001/src/a.py"), "src/pkg": str(aside / "0002/src/pkg")}
    assert (aside / "0001/src/a.py/unseen.txt").read_text() == "written where the guard did not see it\n"
    assert (aside / "0002/src/pkg/big.bin").read_bytes() == b"B" * 4096
    assert done.not_restorable == ["src/big.bin"] and done.failed == {}
    _restored(ws)
    assert last_rollback(store) == done


async def test_an_unrecorded_directory_above_changed_behind_the_guard_is_named(ws: Path) -> None:
    """src/d replaced by a symlink where no record saw it (a human's, after the run): the
    records below it are named as not restored, with the reason, and nothing is followed."""
    pre, store = _store(ws)
    await pre.keep("src/d/x.py")
    (ws / "src/d/x.py").write_text("changed\n")
    pre.close()
    os.rename(ws / "src/d", ws / "src/d.moved")
    (ws / "src/d").symlink_to(ws.parent / "canary")
    done = rollback_offline(str(ws), store, "start")
    assert list(done.failed) == ["src/d/x.py"]
    assert "its directory src/d is a symlink now" in done.failed["src/d/x.py"]
    assert (ws / "src/d.moved/x.py").read_text() == "changed\n"  # not touched
    # Kept: once the way is clear, the same rollback completes.
    (ws / "src/d").unlink()
    os.rename(ws / "src/d.moved", ws / "src/d")
    assert rollback_offline(str(ws), store, "start").failed == {}
    assert (ws / "src/d/x.py").read_text() == "x = 1\n"


@pytest.mark.root
async def test_a_bind_mount_over_a_restored_path_is_named(ws: Path, tmp_path: Path) -> None:
    """A mount over a directory the agent made (a real obstacle: rmdir says EBUSY, openat2
    EXDEV): named, the rest restored, the other mount untouched."""
    pre, store = _store(ws)
    await pre.keep("src/a.py", "src/new")
    (ws / "src/a.py").write_text("changed\n")
    (ws / "src/new").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "theirs.txt").write_text("another mount's\n")
    pre.close()
    subprocess.run(["mount", "--bind", str(other), str(ws / "src/new")], check=True)
    try:
        done = rollback_offline(str(ws), store, "start")
    finally:
        subprocess.run(["umount", str(ws / "src/new")], check=True)
    assert list(done.failed) == ["src/new"], done
    assert (other / "theirs.txt").read_text() == "another mount's\n"
    assert (ws / "src/a.py").read_text() == "a = 1\n"
    assert rollback_offline(str(ws), store, "start").failed == {}
    assert not (ws / "src/new").exists()


@pytest.mark.root
async def test_a_bind_mount_over_a_kept_directory_is_not_changed(ws: Path, tmp_path: Path) -> None:
    """A mount over a directory the restore point had (its mode to put back): the mounted
    tree's root is not chmodded nor chowned through it; the path is named."""
    pre, store = _store(ws)
    await pre.keep("src/d")
    os.chmod(ws / "src/d", 0o700)
    other = tmp_path / "other"
    other.mkdir()
    os.chmod(other, 0o751)  # noqa: S103 - a mode of its own, to see it unchanged
    pre.close()
    subprocess.run(["mount", "--bind", str(other), str(ws / "src/d")], check=True)
    try:
        done = rollback_offline(str(ws), store, "start")
    finally:
        subprocess.run(["umount", str(ws / "src/d")], check=True)
    assert list(done.failed) == ["src/d"] and "mount point" in done.failed["src/d"], done
    assert stat.S_IMODE(os.lstat(other).st_mode) == 0o751
    assert rollback_offline(str(ws), store, "start").failed == {}
    assert stat.S_IMODE(os.lstat(ws / "src/d").st_mode) == 0o755
