"""The inode table keeps correct lookup counts: what the kernel forgets, guardfs drops."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import pyfuse3
import pytest

from guardfs.inodes import InodeTable

from .helpers import wait_for
from .mounts import guarded_mount

pytestmark = pytest.mark.mount


def kernel_forgets(inodes: InodeTable) -> None:
    """Make the kernel drop its names for this mount's inodes (it then sends FORGET).

    Each name the table knows is invalidated through this mount's own FUSE session, deepest
    first, from the test's thread (not from a request handler, where pyfuse3 says it may
    deadlock): the unused dentry dies, the inode with it, and the kernel sends FORGET for its
    lookups. Scoped to this mount, unlike /proc/sys/vm/drop_caches, which evicts the whole
    host's caches and, run by another test at the same time, forgets this test's names too.
    """
    by_path = {e.path: e.ino for e in inodes}
    for entry in sorted(inodes, key=lambda e: e.path.count("/"), reverse=True):
        if entry.virtual or entry.path == "":
            continue
        parent, _, name = entry.path.rpartition("/")
        if parent not in by_path:
            continue  # the kernel already forgot the directory, and with it this name
        # ENOENT: the kernel holds no such name (already dropped, or the file is unlinked).
        with contextlib.suppress(FileNotFoundError):
            pyfuse3.invalidate_entry(pyfuse3.InodeT(by_path[parent]), pyfuse3.FileNameT(os.fsencode(name)))


@pytest.mark.slow
def test_100k_lookups_and_forgets_leave_the_table_as_it_started(tmp_path: Path) -> None:
    files = 2000
    rounds = 50  # 100,000 lookups
    (tmp_path / "backing/work").mkdir(parents=True)
    for i in range(files):
        (tmp_path / f"backing/work/f{i:04d}").write_bytes(b"x")
    # entry_timeout 0: every stat revalidates, i.e. sends one more LOOKUP.
    with guarded_mount(tmp_path, cache_timeout=0) as g:
        permanent = sum(1 for e in g.fs.inodes if e.virtual or e.path == "")  # root, .guard/
        kernel_forgets(g.fs.inodes)
        wait_for(lambda: len(g.fs.inodes) == permanent, "the table to hold only its permanent entries")
        start = len(g.fs.inodes)
        # What the kernel sent, per inode: the table must hold exactly the difference. The
        # kernel may forget a name at any moment (memory pressure, another test's cache
        # drop), so the table's count is what is still held, not every lookup ever made.
        sent: collections.Counter[int] = collections.Counter()
        forgot: collections.Counter[int] = collections.Counter()
        lookup, forget = g.fs.lookup, g.fs.forget

        async def counted_lookup(parent: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                                 ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
            attr = await lookup(parent, name, ctx)
            if attr.st_ino:
                sent[attr.st_ino] += 1
            return attr

        async def counted_forget(inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
            for ino, n in inode_list:
                forgot[ino] += n
            await forget(inode_list)

        g.fs.lookup, g.fs.forget = counted_lookup, counted_forget  # type: ignore[method-assign, assignment]

        def held() -> dict[int, int]:
            return {e.ino: e.lookups for e in g.fs.inodes if not (e.virtual or e.path == "")}

        def agrees() -> bool:  # read from this thread while the server runs: retried until settled
            return held() == {ino: n - forgot[ino] for ino, n in sent.items() if n > forgot[ino]}

        for _ in range(rounds):
            for i in range(files):
                os.stat(g.mnt / f"work/f{i:04d}")
        # The inode numbers from the backing tree, not the table: the kernel may have forgotten some.
        work = tmp_path / "backing/work"
        file_inos = {g.fs.inodes.fuse_ino(os.stat(work / f"f{i:04d}").st_ino) for i in range(files)}
        assert set(sent) == file_inos | {g.fs.inodes.fuse_ino(os.stat(work).st_ino)}  # work/ and each file
        assert sum(sent[ino] for ino in file_inos) >= files * rounds  # each revalidation reached the table
        wait_for(agrees, "the table's lookup counts to be what the kernel sent less what it forgot")
        kernel_forgets(g.fs.inodes)
        wait_for(lambda: len(g.fs.inodes) == start, "every forget to arrive")
        assert len(g.fs.inodes) == start
        assert agrees()


def test_open_files_outlive_their_lookups(tmp_path: Path) -> None:
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path) as g:
        path = g.mnt / "work/held"
        with open(path, "w") as f:
            f.write("still here")
            f.flush()
            os.unlink(path)
            kernel_forgets(g.fs.inodes)
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
