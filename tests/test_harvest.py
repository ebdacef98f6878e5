"""guardfs.harvest: what the guard copies, removes and sweeps of what the agent left, on real
files of every shape an agent can make (no mount, no root needed)."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardfs.harvest import harvest, remove_tree, strip_set_id

from .helpers import dir_chain

SECRET = b"SECRET=hunter2\n"


@pytest.fixture
def left(tmp_path: Path) -> Iterator[Path]:
    """A stage holding one of each shape, and a secret beside it that links point at."""
    (tmp_path / "secret").write_bytes(SECRET)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "a.out.log").write_bytes(b"a log\n")
    os.symlink(tmp_path / "secret", stage / "link.out.log")
    os.symlink("/etc", stage / "dirlink.log")
    os.mkfifo(stage / "p.out.log")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stage / "s.out.log"))
    (stage / "d.log").mkdir()
    (stage / "d.log/inner.log").write_bytes(b"inner\n")
    os.link(tmp_path / "secret", stage / "hard.out.log")  # a hard link is a regular file: its bytes, bounded
    with open(stage / "big.out.log", "wb") as f:
        f.write(b"head\n")
        f.truncate(2 << 30)
    yield stage
    listener.close()


def test_only_regular_files_are_copied_by_their_data_and_cut_at_the_cap(left: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    got = harvest(left, dest, 1 << 16)
    assert sorted(got.kept) == ["a.out.log", "big.out.log", "hard.out.log"]
    assert sorted(got.skipped) == ["d.log: a directory", "dirlink.log: a symbolic link (not followed)",
                                   "link.out.log: a symbolic link (not followed)", "p.out.log: a FIFO",
                                   "s.out.log: a socket"]
    assert got.truncated == [f"big.out.log: {2 << 30} bytes, cut to its first {1 << 16} (the cap)"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(got.kept)
    big = (dest / "big.out.log").stat()
    assert big.st_size == 1 << 16 and big.st_blocks * 512 <= 16 << 10, big  # the hole stays a hole
    assert (dest / "big.out.log").read_bytes().startswith(b"head\n")
    hard = (dest / "hard.out.log").lstat()
    assert hard.st_nlink == 1 and hard.st_ino != (tmp_path / "secret").stat().st_ino  # a copy, never the link
    assert stat.S_IMODE(hard.st_mode) == 0o600 and stat.S_IMODE(dest.stat().st_mode) == 0o700
    assert (tmp_path / "secret").read_bytes() == SECRET  # the link's target untouched
    assert got.notes() == [*got.truncated, *got.skipped]


def test_a_file_is_cut_at_the_cap_whatever_its_data(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s/full.log").write_bytes(b"x" * 100_000)
    got = harvest(tmp_path / "s", tmp_path / "d", 4096)
    assert (tmp_path / "d/full.log").read_bytes() == b"x" * 4096 and got.truncated


def test_names_are_escaped_and_existing_copies_are_kept(tmp_path: Path) -> None:
    src, dest = tmp_path / "s", tmp_path / "d"
    src.mkdir()
    dest.mkdir()
    odd = os.fsdecode(b"odd\xff\n\x1b[2J.log")
    os.symlink("/etc/shadow", src / odd)
    (src / "same.log").write_bytes(b"agent's\n")
    (dest / "same.log").write_bytes(b"guard's\n")
    got = harvest(src, dest, 1 << 20)
    assert sorted(got.skipped) == ["odd\\xff\\n\\x1b[2J.log: a symbolic link (not followed)",
                                   "same.log: not copied: the run directory already holds that name"], got
    assert (dest / "same.log").read_bytes() == b"guard's\n"


def test_a_source_that_is_a_link_or_missing_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real/a.log").write_bytes(b"a\n")
    os.symlink(tmp_path / "real", tmp_path / "link")
    got = harvest(tmp_path / "link", tmp_path / "d", 1 << 20)
    assert got.kept == [] and len(got.skipped) == 1 and "not read" in got.skipped[0], got
    assert harvest(tmp_path / "missing", tmp_path / "d", 1 << 20).notes() == []


def test_entries_past_the_bound_are_said_not_read(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    for i in range(5):
        (tmp_path / f"s/{i}.log").write_bytes(b"x\n")
    got = harvest(tmp_path / "s", tmp_path / "d", 1 << 20, max_entries=3)
    assert len(got.kept) == 3 and got.skipped == ["more than 3 entries: the rest were not looked at"]


def _deep(top: Path, depth: int) -> None:
    """A chain of *depth* directories below *top*, made by relative steps (its path is past PATH_MAX)."""
    fd = dir_chain(top, depth, "a")
    try:
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o6755, dir_fd=fd))
        os.chmod("f", 0o6755, dir_fd=fd)  # noqa: S103 - the program an agent leaves
    finally:
        os.close(fd)


def test_remove_tree_removes_any_shape_and_follows_nothing(left: Path, tmp_path: Path) -> None:
    """Deeper than Python's stack and PATH_MAX (shutil.rmtree raised RecursionError), unlistable
    directories, links out of the tree (their targets untouched), FIFOs and sockets."""
    _deep(left / "d.log", 3000)
    (left / "d.log/closed").mkdir()
    (left / "d.log/closed/f").write_bytes(b"x")
    (left / "d.log/closed").chmod(0)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep\n")
    os.symlink(outside, left / "out")
    assert remove_tree(left) == []
    assert not left.exists()
    assert (outside / "keep").read_bytes() == b"keep\n" and (tmp_path / "secret").read_bytes() == SECRET


def test_remove_tree_of_a_link_removes_the_link_only(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real/f").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert remove_tree(tmp_path / "link") == [] and not os.path.lexists(tmp_path / "link")
    assert (tmp_path / "real/f").exists()
    assert remove_tree(tmp_path / "missing") == []


def test_strip_set_id_reaches_any_depth_and_follows_no_link(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    tree = ws / "tree"
    tree.mkdir(parents=True)
    _deep(tree, 2500)
    (tree / "shared").mkdir()
    (tree / "shared").chmod(0o2755)
    target = tmp_path / "setuid-outside"
    target.write_bytes(b"x")
    target.chmod(0o4755)
    os.symlink(target, tree / "link")
    changed, problems = strip_set_id(ws, "tree")
    assert problems == [] and len(changed) == 1 and changed[0].startswith("tree/a/a/") and changed[0].endswith("/f")
    assert stat.S_IMODE(target.stat().st_mode) == 0o4755  # through no link
    assert stat.S_IMODE((tree / "shared").stat().st_mode) == 0o2755  # directories keep group inheritance
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(2500):
        down = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = down
    assert stat.S_IMODE(os.stat("f", dir_fd=fd).st_mode) == 0o755
    os.close(fd)
    # A tree reached through a link is not walked at all: said, nothing changed.
    os.symlink(tmp_path, ws / "via")
    changed, problems = strip_set_id(ws, "via")
    assert changed == [] and len(problems) == 1, problems
    assert stat.S_IMODE(target.stat().st_mode) == 0o4755
    assert remove_tree(ws) == []
