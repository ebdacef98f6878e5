"""What the kernel may cache of lookups through the mount, and what it never may.

An absent name is cached by the kernel as a negative entry for the mount's cache timeout
(``guard run --cache-timeout``, 60 s by default): a file the host adds behind the mount
shows within that bound, one the agent creates (in the workspace or in the scratch layer)
at once. A forbidden name is refused with EACCES, which the kernel does not cache: every
access reaches the guard, is refused and recorded.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from .helpers import wait_for
from .mounts import guarded_mount

pytestmark = pytest.mark.mount


def test_an_absent_name_stays_absent_through_the_mount_for_the_cache_timeout(tmp_path: Path) -> None:
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path) as g:  # 60 s
        assert not (g.mnt / "work/later.txt").exists()
        (g.backing / "work/later.txt").write_text("from the host\n")
        # The kernel answers from its negative entry: no lookup reaches the guard.
        assert not (g.mnt / "work/later.txt").exists()
        assert "later.txt" in os.listdir(g.mnt / "work")  # a listing is never cached


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
