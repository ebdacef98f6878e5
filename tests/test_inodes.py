"""The inode table keeps correct lookup counts: what the kernel forgets, guardfs drops."""

from __future__ import annotations

import os
from pathlib import Path

from .helpers import wait_for
from .mounts import guarded_mount


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


def _survivor_works(mnt: Path, name: str, content: bytes) -> None:
    """stat, open and link of *name*: each reaches the server with that inode."""
    a = mnt / name
    assert os.stat(a).st_size == len(content)
    assert a.read_bytes() == content
    with open(a, "ab") as f:  # opened for write too: the session reads it back by path
        f.write(b"+")
    assert a.read_bytes() == content + b"+"
    os.link(a, mnt / "work/c")
    assert os.stat(mnt / "work/c").st_ino == os.stat(a).st_ino
    assert os.stat(a).st_nlink == 2


def test_hard_link_survives_unlink_of_its_other_name(tmp_path: Path) -> None:
    """create a; link a b; unlink b: a still works (the table knew the inode only as b)."""
    with guarded_mount(tmp_path) as g:
        work = g.mnt / "work"
        work.mkdir()
        (work / "a").write_bytes(b"data")
        os.link(work / "a", work / "b")
        os.unlink(work / "b")
        _survivor_works(g.mnt, "work/a", b"data")
        # And the other way round: the name the table learnt last is the one that stays.
        os.unlink(work / "a")
        assert (work / "c").read_bytes() == b"data+"


def test_hard_link_survives_rename_onto_its_other_name(tmp_path: Path) -> None:
    """create a; link a d; rename s d: a still works (d now names another file)."""
    with guarded_mount(tmp_path) as g:
        work = g.mnt / "work"
        work.mkdir()
        (work / "a").write_bytes(b"data")
        os.link(work / "a", work / "d")
        (work / "s").write_bytes(b"other")
        os.rename(work / "s", work / "d")
        assert (work / "d").read_bytes() == b"other"
        _survivor_works(g.mnt, "work/a", b"data")


def test_hard_link_renames_keep_every_name(tmp_path: Path) -> None:
    """Renaming one name of a linked file, or its directory, keeps the other names working."""
    with guarded_mount(tmp_path) as g:
        work = g.mnt / "work"
        (work / "sub").mkdir(parents=True)
        (work / "a").write_bytes(b"data")
        os.link(work / "a", work / "sub/b")
        os.rename(work / "sub", work / "moved")  # the name the table knows moves along
        os.rename(work / "a", work / "a2")
        os.link(work / "moved/b", work / "e")
        os.unlink(work / "moved/b")
        os.unlink(work / "e")
        _survivor_works(g.mnt, "work/a2", b"data")
        os.rename(work / "a2", work / "c")  # a rename onto another name of the same inode:
        assert (work / "a2").exists()  # POSIX does nothing, both names stay
        os.unlink(work / "c")
        assert (work / "a2").read_bytes() == b"data+"
