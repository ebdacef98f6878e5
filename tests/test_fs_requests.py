"""How requests are served and cached: one FUSE worker at a time, and what the kernel may cache.

The loop serves one request at a time (guardfs.mount.FUSE_WORKERS): a request that waits on
a worker thread (fsync, a large pre-image copy) holds the others until it is done, and none
of them waits on the mount, so nothing deadlocks. An absent name is cached by the kernel as
a negative entry for the mount's cache timeout: a file the host adds behind the mount shows
within that bound, one the agent creates at once; a forbidden name is never cached, so every
access is refused and recorded.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from guardfs.mount import FUSE_WORKERS

from .helpers import wait_for
from .mounts import guarded_mount

pytestmark = pytest.mark.mount

# fsyncs one file in a loop (each fsync waits on a worker thread in the guard) until told to stop.
FSYNCER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):
    os.write(fd, b"x")
    os.fsync(fd)
"""


def _in_flight(fs: object, names: tuple[str, ...], peak: list[int]) -> None:
    """Wrap the handlers *names* of *fs* to record in *peak* how many ran at once at most."""
    running = [0]

    def wrap(fn: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            try:
                return await fn(*args, **kwargs)
            finally:
                running[0] -= 1

        return wrapped

    for name in names:
        setattr(fs, name, wrap(getattr(fs, name)))


def test_one_request_at_a_time_while_another_process_fsyncs(tmp_path: Path) -> None:
    work = tmp_path / "backing/work"
    work.mkdir(parents=True)
    for i in range(50):
        (work / f"f{i}").write_text(f"{i}\n")
    (work / "synced").write_text("")
    with guarded_mount(tmp_path) as g:
        peak = [0]
        _in_flight(g.fs, ("fsync", "getattr", "lookup", "open", "read", "flush", "release", "write"), peak)
        stop = tmp_path / "stop"
        with subprocess.Popen([sys.executable, "-c", FSYNCER, str(g.mnt / "work/synced"), str(stop)],
                              stdout=subprocess.PIPE, text=True) as syncer:
            try:
                assert syncer.stdout is not None and syncer.stdout.readline() == "ready\n"
                # This process reads every file, again and again, while the fsyncs go on.
                for _ in range(20):
                    for i in range(50):
                        assert (g.mnt / f"work/f{i}").read_text() == f"{i}\n"
                        os.stat(g.mnt / f"work/f{i}")
            finally:
                stop.touch()
                syncer.wait(timeout=20)
        assert syncer.returncode == 0
        assert (g.backing / "work/synced").stat().st_size > 0
        assert peak[0] == FUSE_WORKERS == 1


def test_a_file_the_host_adds_behind_the_mount_shows_within_the_cache_timeout(tmp_path: Path) -> None:
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path, cache_timeout=1.0) as g:
        seen = g.mnt / "work/later.txt"
        assert not seen.exists()  # cached by the kernel as absent, for the cache timeout
        (g.backing / "work/later.txt").write_text("from the host\n")
        start = time.monotonic()
        wait_for(seen.exists, "the host's file through the mount", timeout=10)
        assert time.monotonic() - start < 1.0 + 5  # the timeout, and slack for a loaded machine
        assert seen.read_text() == "from the host\n"


def test_a_file_the_agent_creates_shows_at_once_after_an_absent_lookup(tmp_path: Path) -> None:
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path) as g:  # 60 s: the kernel keeps the absent name that long
        for name in ("made.txt", "sub"):
            assert not (g.mnt / "work" / name).exists()
        (g.mnt / "work/made.txt").write_text("mine\n")
        (g.mnt / "work/sub").mkdir()
        assert (g.mnt / "work/made.txt").read_text() == "mine\n"
        assert (g.mnt / "work/sub").is_dir()
        assert sorted(os.listdir(g.mnt / "work")) == ["made.txt", "sub"]
        # And through a rename onto a name looked up as absent.
        assert not (g.mnt / "work/renamed.txt").exists()
        os.rename(g.mnt / "work/made.txt", g.mnt / "work/renamed.txt")
        assert (g.mnt / "work/renamed.txt").read_text() == "mine\n"
        assert not (g.mnt / "work/made.txt").exists()


def test_generated_output_in_scratch_shows_at_once_after_an_absent_lookup(tmp_path: Path) -> None:
    (tmp_path / "backing/lib").mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    with guarded_mount(tmp_path, run_dir=run) as g:
        cache = g.mnt / "lib/__pycache__"
        assert not cache.exists()
        cache.mkdir()  # out of scope, generated: lands in the run's scratch layer
        (cache / "m.cpython-311.pyc").write_bytes(b"bytecode")
        assert (cache / "m.cpython-311.pyc").read_bytes() == b"bytecode"
        assert not (g.backing / "lib/__pycache__").exists()


def test_a_forbidden_name_is_refused_and_recorded_on_every_access(tmp_path: Path) -> None:
    (tmp_path / "backing").mkdir()
    (tmp_path / "backing/.env").write_text("SECRET=1\n")
    with guarded_mount(tmp_path) as g:
        for _ in range(3):
            with pytest.raises(PermissionError):
                os.stat(g.mnt / ".env")
        with pytest.raises(OSError) as info:
            (g.mnt / ".env").read_text()
        assert info.value.errno == errno.EACCES
        assert [e["op"] for e in g.denials() if e["path"] == ".env"] == ["lookup"] * 4
