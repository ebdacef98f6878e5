"""No ESTALE for a rename race (issue 21, item 10).

A path walk that found ``f`` before a rename over it (or an unlink) sends OPEN, GETATTR or
SETATTR for the inode it found. The guard reopened the path, found another inode there and
answered ESTALE; the kernel retries once, and under two writers renaming over ``f`` the
retry raced again and ``cat f`` failed with "Stale file handle" (74 of 4,000 through
``guard mount``). A local filesystem serves the old inode, unlinked, until it is let go; the
guard now does the same from a descriptor it holds (an O_PATH pin) while the kernel holds it.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import wait_for
from .hostile import hostile_run, hostile_workspace
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount

#: The loop of the issue, for each operation on the path that is renamed over; prints
#: ``OP ERRORS`` and the first errors. Iteration counts stay modest: tens of seconds in all.
LOOP = r'''
set -u
N=$1; shift
for op in "$@"; do
  echo x > f
  for w in 1 2; do (for i in $(seq $N); do echo y > t$w.$i; mv -f t$w.$i f; done) & done
  err=0
  for i in $(seq $N); do
    case $op in
      cat) cat f > /dev/null ;;
      chmod) chmod 644 f ;;
      touch) touch f ;;
      truncate) truncate -s 1 f ;;
      append) echo z >> f ;;
    esac 2>> errors || err=$((err+1))
  done
  wait
  echo "$op $err"
done
head -3 errors
rm -f errors
'''
OPS = ("cat", "chmod", "touch", "truncate", "append")

#: Renames over one file for the race, with no limit in the way (``y`` over ``y`` is a return).
RACE_MANIFEST = """
[task]
id = "race"
goal = "Rename over one file from several processes"
[paths]
allowed = ["work/"]
[limits]
max_files = "unlimited"
max_rewrites = "unlimited"
max_returns = "unlimited"
"""


def errors_of(out: str) -> dict[str, int]:
    """``{op: errors}`` from what LOOP printed."""
    counts = {}
    for line in out.splitlines():
        op, _, n = line.partition(" ")
        if op in OPS and n.isdigit():
            counts[op] = int(n)
    return counts


@pytest.fixture(params=[60.0, 0.0], ids=["cached", "cache-timeout-0"])
def mount(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Guarded]:
    """A guarded mount with ``work/`` in scope, the kernel caching entries or not."""
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path, RACE_MANIFEST, cache_timeout=request.param) as g:
        yield g


@pytest.mark.slow
def test_renames_over_a_file_never_make_its_readers_see_estale(mount: Guarded) -> None:
    """The issue's loop through the mount: 0 errors for cat, chmod, touch, truncate and ``>>``."""
    out = subprocess.run(["bash", "-c", LOOP, "loop", "300", *OPS], cwd=mount.mnt / "work",
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert errors_of(out) == dict.fromkeys(OPS, 0), out
    # What the kernel let go, the guard let go: no descriptor is kept for a forgotten inode.
    wait_for(lambda: not [e for e in mount.fs.inodes if e.pin is not None], "the pins closed")


def test_an_inode_renamed_over_is_served_until_it_is_let_go(tmp_path: Path) -> None:
    """The race made deterministic: an O_PATH descriptor holds the inode the kernel found (as a
    path walk does for an instant) while ``f`` is renamed over; opening, stat, chmod, utime and
    truncate through it then reach that inode, unlinked, as on a local filesystem (ESTALE before).
    Its writes reach no name."""
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path, RACE_MANIFEST) as g:
        work = g.mnt / "work"
        (work / "f").write_text("old\n")
        held = os.open(work / "f", os.O_PATH)
        try:
            (work / "new").write_text("new\n")
            os.rename(work / "new", work / "f")
            proc = f"/proc/self/fd/{held}"
            with open(proc) as f:
                assert f.read() == "old\n"
            assert os.stat(held).st_nlink == 0
            os.chmod(proc, 0o600)
            os.utime(proc, ns=(1, 2))
            assert (os.stat(held).st_mode & 0o777, os.stat(held).st_mtime_ns) == (0o600, 2)
            with open(proc, "a") as f:
                f.write("more\n")
            os.truncate(proc, 2)
            assert os.stat(held).st_size == 2
            assert (work / "f").read_text() == "new\n"
            assert sorted(os.listdir(g.backing / "work")) == ["f"]
            assert [e for e in g.fs.inodes if e.pin is not None], "the renamed-over inode is pinned"
        finally:
            os.close(held)
        wait_for(lambda: not [e for e in g.fs.inodes if e.pin is not None], "the pin closed")


def test_a_pinned_inode_found_again_under_another_name_is_a_named_file(tmp_path: Path) -> None:
    """A hard link the mount had not seen (made on the host before the run): the guard pins the
    inode when its only known name goes, then the agent finds it under the other name. Writes
    there reach a name: they are counted, with a pre-image, and it may be linked again."""
    (tmp_path / "backing/work").mkdir(parents=True)
    (tmp_path / "backing/work/a").write_text("one\n")
    os.link(tmp_path / "backing/work/a", tmp_path / "backing/work/b")
    with guarded_mount(tmp_path, RACE_MANIFEST) as g:
        work = g.mnt / "work"
        held = os.open(work / "a", os.O_PATH)  # the kernel holds the inode, known as "a" only
        try:
            os.unlink(work / "a")
            assert [e for e in g.fs.inodes if e.pin is not None], "its last known name went: pinned"
            (work / "b").write_text("two\n")
            entry = next(e for e in g.fs.inodes if e.path == "work/b")
            assert not entry.nameless and entry.aliases == set()
            os.link(work / "b", work / "c")
            assert (g.backing / "work/c").read_text() == "two\n"
        finally:
            os.close(held)
        written = [e for e in g.events() if e["op"] in ("write", "open") and e.get("path") == "work/b"]
        assert written, g.events()


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.parametrize("user", [None, "nobody"])
def test_renames_over_a_file_inside_guard_run(tmp_path: Path, user: str | None) -> None:
    """The same loop from inside a real ``guard run`` (checkpoints kept, the breaker listening):
    56 of 3,000 reads failed with ESTALE there."""
    ws = hostile_workspace(tmp_path)
    manifest = RACE_MANIFEST.replace('"work/"', '"src/checkout/"')
    seen, _, proc = hostile_run(tmp_path, ws, user, f'''
        import subprocess
        out = subprocess.run(["bash", "-c", {LOOP!r}, "loop", "250", *{OPS!r}], cwd="src/checkout",
                             capture_output=True, text=True).stdout
        attempt("loop", lambda: out)
    ''', manifest=textwrap.dedent(manifest))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert errors_of(seen["loop"]) == dict.fromkeys(OPS, 0), seen
