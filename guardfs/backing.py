"""The backing directory, reached only through a held directory fd.

Every path guardfs resolves is relative to that fd and goes through ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``: the kernel itself refuses to
follow a symlink (planted by the agent, anywhere in the path) or to leave the tree, so no
swapped parent can redirect the server. Directory fds are kept in a small LRU keyed by
path; a directory rename or removal clears it, since only those change which directory a
path names.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections import OrderedDict
from collections.abc import Iterator

__all__ = ["Backing", "openat2"]

_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH

# openat2 has the same number on every architecture that has it (it came after the
# syscall tables were unified).
_SYS_OPENAT2 = 437

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    """Open *path* beneath *dirfd*, never following a symlink; raise OSError on failure."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    fd = _syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)


class Backing:
    """Resolves workspace-relative paths to (directory fd, name) pairs safely."""

    def __init__(self, root: str, max_dirs: int = 256) -> None:
        if platform.system() != "Linux":
            raise OSError(errno.ENOSYS, "guardfs needs Linux (openat2)")
        self.root = root
        self.root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs: OrderedDict[str, int] = OrderedDict()
        self._max_dirs = max_dirs

    def dir_fd(self, path: str) -> int:
        """An O_PATH fd of directory *path* ('' is the root); owned by the cache."""
        if path == "":
            return self.root_fd
        dirs = self._dirs
        fd = dirs.get(path)
        if fd is not None:
            dirs.move_to_end(path)
            return fd
        fd = openat2(self.root_fd, path, os.O_PATH | os.O_DIRECTORY)
        dirs[path] = fd
        if len(dirs) > self._max_dirs:
            _, old = dirs.popitem(last=False)
            os.close(old)
        return fd

    def parent(self, path: str) -> tuple[int, str]:
        """(fd of the parent directory, final name) for a non-root *path*."""
        head, _, name = path.rpartition("/")
        return self.dir_fd(head), name

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        """Open *path* (never a symlink, never outside the root); the caller owns the fd."""
        if path == "":
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=self.root_fd)
        parent, name = self.parent(path)
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)

    def lstat(self, path: str) -> os.stat_result:
        """lstat of *path*."""
        if path == "":
            return os.stat(self.root_fd)
        parent, name = self.parent(path)
        return os.stat(name, dir_fd=parent, follow_symlinks=False)

    def walk(self, path: str) -> Iterator[tuple[str, bool]]:
        """Every path below directory *path*, parents before children, with whether it is a
        directory; symlinks are not followed.

        Iterative, with one directory open at a time: the agent decides how deep a tree is,
        so neither the Python stack nor the descriptor table may grow with its depth. A tree
        whose paths outgrow PATH_MAX raises OSError (ENAMETOOLONG), an errno for the caller.
        """
        stack = [path]
        while stack:
            top = stack.pop()
            fd = openat2(self.root_fd, top or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                with os.scandir(fd) as it:
                    listing = [(de.name, de.is_dir(follow_symlinks=False)) for de in it]
            finally:
                os.close(fd)
            for name, is_dir in listing:
                sub = f"{top}/{name}" if top else name
                yield sub, is_dir
                if is_dir:
                    stack.append(sub)

    def proc_path(self, path: str) -> tuple[int, str]:
        """An O_PATH fd of *path* itself and its /proc/self/fd name, for calls with no *at form.

        The caller closes the fd.
        """
        fd = self.open(path, os.O_PATH)
        return fd, f"/proc/self/fd/{fd}"

    @staticmethod
    def reopen(fd: int, flags: int) -> int:
        """A new open file of the inode *fd* holds (an O_PATH fd), through its /proc/self/fd
        link: it reaches that inode, named or not, and resolves no path of the workspace."""
        return os.open(f"/proc/self/fd/{fd}", (flags & ~os.O_NOFOLLOW) | os.O_CLOEXEC)

    def forget_dirs(self) -> None:
        """Drop every cached directory fd (after a directory was renamed or removed)."""
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()

    def close(self) -> None:
        """Release every fd."""
        self.forget_dirs()
        os.close(self.root_fd)
