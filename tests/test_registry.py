"""The operation registry: every FUSE operation is implemented and exercised here through
a real mount, or listed in ``guardfs.fs.UNSUPPORTED`` with the errno the kernel gets."""

from __future__ import annotations

import ctypes
import errno
import inspect
import os
import select
import stat
from pathlib import Path

import pyfuse3
import pytest

from guardfs import fusereply
from guardfs.fs import UNSUPPORTED, GuardFS

from .mounts import guarded_mount

# Hooks of pyfuse3.Operations that are not FUSE requests.
_NOT_REQUESTS = {"init", "stacktrace"}


def fuse_operations() -> set[str]:
    """Every request handler pyfuse3 can call."""
    return {
        name for name, member in vars(pyfuse3.Operations).items()
        if inspect.iscoroutinefunction(member) and name not in _NOT_REQUESTS
    }


def test_every_operation_is_implemented_or_listed_unsupported() -> None:
    implemented = {n for n in fuse_operations() if getattr(GuardFS, n) is not getattr(pyfuse3.Operations, n)}
    unsupported = {k.split()[0] for k in UNSUPPORTED}
    assert implemented | unsupported == fuse_operations()
    assert "poll" in unsupported and "poll" not in implemented
    assert all(isinstance(e, int) and e in errno.errorcode for e in UNSUPPORTED.values())


@pytest.mark.mount
def test_every_implemented_operation_runs_through_the_mount(tmp_path: Path) -> None:
    """One workload that makes the kernel send every implemented request at least once.

    Mounted without default_permissions so that access(2) reaches guardfs as well.
    """
    (tmp_path / "backing/work").mkdir(parents=True)
    options = {"fsname=guardfs", "subtype=guardfs"}
    with guarded_mount(tmp_path, options=options, count_calls=True) as g:
        w = g.mnt / "work"
        (w / "a.txt").write_text("hello")                    # lookup, create, write, flush, release
        assert (w / "a.txt").read_text() == "hello"            # open, read
        st = os.stat(w / "a.txt")                               # getattr (fresh attrs)
        os.chmod(w / "a.txt", 0o640)                            # setattr
        assert stat.S_IMODE(os.stat(w / "a.txt").st_mode) == 0o640
        os.symlink("a.txt", w / "link")                         # symlink
        assert os.readlink(w / "link") == "a.txt"               # readlink
        os.link(w / "a.txt", w / "hard")                        # link
        os.mkdir(w / "d")                                       # mkdir
        os.mkfifo(w / "fifo")                                   # mknod
        os.rename(w / "hard", w / "d/hard")                     # rename
        os.unlink(w / "d/hard")                                 # unlink
        os.rmdir(w / "d")                                       # rmdir
        assert sorted(os.listdir(w)) == ["a.txt", "fifo", "link"]  # opendir, readdir (releasedir)
        fd = os.open(w, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)                                            # fsyncdir
        os.close(fd)
        with open(w / "a.txt", "r+") as f:
            os.fsync(f.fileno())                                # fsync
        assert os.statvfs(g.mnt).f_bsize > 0                    # statfs
        assert os.access(w / "a.txt", os.R_OK)                  # access
        assert not os.access(g.mnt, os.W_OK)                    # access: the root is out of scope
        os.setxattr(w / "a.txt", "user.k", b"v")                 # setxattr
        assert os.getxattr(w / "a.txt", "user.k") == b"v"        # getxattr
        assert "user.k" in os.listxattr(w / "a.txt")             # listxattr
        os.removexattr(w / "a.txt", "user.k")                    # removexattr
        with open(w / "a.txt") as f:                             # poll: kernel default, ready
            assert select.select([f], [], [], 0)[0]
        assert st.st_size == 5
        drop = ctypes.CDLL(None).sync
        drop()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")                                      # forget
    implemented = {n for n in fuse_operations() if getattr(GuardFS, n) is not getattr(pyfuse3.Operations, n)}
    if fusereply.dirs_by_inode():
        # Directories are read by inode: the one OPENDIR answers ENOSYS and the kernel sends
        # no RELEASEDIR at all (guardfs.fusereply); releasedir serves the fallback.
        assert g.calls["opendir"] == 1
        implemented.discard("releasedir")
    missing = sorted(n for n in implemented if not g.calls.get(n))
    assert not missing, f"implemented but never exercised through the mount: {missing}"


@pytest.mark.mount
def test_without_xattrs_the_kernel_stops_asking(tmp_path: Path) -> None:
    """The default of guard mount and guard run: one ENOSYS answer per xattr request type,
    then the kernel answers EOPNOTSUPP itself (also its security.capability lookup before
    each write, a round trip saved per write)."""
    (tmp_path / "backing/work").mkdir(parents=True)
    with guarded_mount(tmp_path, count_calls=True, xattrs=False) as g:
        f = g.mnt / "work/a.py"
        for i in range(50):
            with open(f, "a") as out:
                out.write(f"x{i} = {i}\n")
        for _ in range(3):
            for call in (lambda: os.getxattr(f, "user.k"), lambda: os.setxattr(f, "user.k", b"v"),
                         lambda: os.listxattr(f), lambda: os.removexattr(f, "user.k")):
                with pytest.raises(OSError) as caught:
                    call()
                assert caught.value.errno == errno.EOPNOTSUPP
        assert f.read_text().count("\n") == 50
        for op in ("getxattr", "setxattr", "listxattr", "removexattr"):
            assert g.calls.get(op, 0) <= 1, (op, g.calls)
    assert os.listxattr(tmp_path / "backing/work/a.py") == []
