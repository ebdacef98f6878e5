"""The inode table keeps correct lookup counts: what the kernel forgets, guardfs drops."""

from __future__ import annotations

import os
from pathlib import Path

from .conftest import guarded_mount
from .helpers import wait_for


def drop_kernel_caches() -> None:
    """Ask the kernel to evict unused dentries and inodes (it then sends FORGET)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def test_100k_lookups_and_forgets_leave_the_table_as_it_started(tmp_path: Path) -> None:
    files = 2000
    rounds = 50  # 100,000 lookups
    (tmp_path / "backing/work").mkdir(parents=True)
    for i in range(files):
        (tmp_path / f"backing/work/f{i:04d}").write_bytes(b"x")
    # entry_timeout 0: every stat revalidates, i.e. sends one more LOOKUP.
    with guarded_mount(tmp_path, cache_timeout=0) as g:
        permanent = sum(1 for e in g.fs.inodes if e.virtual or e.path == "")  # root, .guard/
        drop_kernel_caches()
        wait_for(lambda: len(g.fs.inodes) == permanent, "the table to hold only its permanent entries")
        start = len(g.fs.inodes)
        calls = {"lookup": 0, "forget": 0}
        g.calls.update(calls)
        for _ in range(rounds):
            for i in range(files):
                os.stat(g.mnt / f"work/f{i:04d}")
        assert len(g.fs.inodes) == start + files + 1  # work/ and the files
        looked_up = sum(e.lookups for e in g.fs.inodes if e.path.startswith("work/"))
        assert looked_up >= files * rounds  # each revalidation counted
        drop_kernel_caches()
        wait_for(lambda: len(g.fs.inodes) == start, "every forget to arrive")
        assert len(g.fs.inodes) == start


def test_open_files_outlive_their_lookups(tmp_path: Path) -> None:
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path) as g:
        path = g.mnt / "work/held"
        with open(path, "w") as f:
            f.write("still here")
            f.flush()
            os.unlink(path)
            drop_kernel_caches()
            # Unlinked but open: attributes come from the open descriptor.
            assert os.fstat(f.fileno()).st_size == len("still here")
        wait_for(lambda: all(e.path != "work/held" for e in g.fs.inodes), "the unlinked file's entry to go")
