"""A plain pyfuse3 passthrough with no policy: the control of bench/fs_bench.py.

It does what pyfuse3's own ``passthroughfs`` example does (inode numbers of the source
tree, paths remembered per inode, one backing fd per open file), so that the benchmark can
tell the cost of FUSE in Python apart from the cost of guardfs's policy.

    python bench/passthrough.py [--timeout SECONDS] SOURCE MOUNTPOINT

``--timeout`` sets the kernel's entry and attribute cache timeouts (the example's 0 by
default). Runs until unmounted or sent SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
from collections import defaultdict
from collections.abc import Sequence

import pyfuse3
import trio
from pyfuse3 import FUSEError


class Passthrough(pyfuse3.Operations):
    """Every operation forwarded to the source tree by path."""

    enable_writeback_cache = False

    def __init__(self, source: str, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self.lookups: defaultdict[int, int] = defaultdict(int)
        self.fds: dict[int, int] = {}

    def _path(self, ino: int) -> str:
        try:
            return self.paths[ino]
        except KeyError:
            raise FUSEError(errno.ESTALE) from None

    def _attr(self, path: str | None = None, fd: int | None = None) -> pyfuse3.EntryAttributes:
        try:
            st = os.fstat(fd) if fd is not None else os.lstat(path or "")
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        attr = pyfuse3.EntryAttributes()
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                     "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_blksize", "st_blocks"):
            setattr(attr, name, getattr(st, name))
        attr.st_ino = pyfuse3.InodeT(st.st_ino)
        attr.generation = 0
        attr.entry_timeout = attr.attr_timeout = self.timeout
        return attr

    def _remember(self, attr: pyfuse3.EntryAttributes, path: str) -> pyfuse3.EntryAttributes:
        self.paths[attr.st_ino] = path
        self.lookups[attr.st_ino] += 1
        return attr

    async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        return self._remember(self._attr(path), path)

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        for ino, n in inode_list:
            self.lookups[ino] -= n
            if self.lookups[ino] <= 0 and ino != pyfuse3.ROOT_INODE:
                del self.lookups[ino]
                self.paths.pop(ino, None)

    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._path(inode))

    async def setattr(self, inode: pyfuse3.InodeT, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: pyfuse3.FileHandleT | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = self._path(inode)
        try:
            if fields.update_size:
                os.truncate(path, attr.st_size)
            if fields.update_mode:
                os.chmod(path, stat.S_IMODE(attr.st_mode), follow_symlinks=False)
            if fields.update_uid or fields.update_gid:
                os.chown(path, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1, follow_symlinks=False)
            if fields.update_atime or fields.update_mtime:
                st = os.lstat(path)
                os.utime(path, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns),
                         follow_symlinks=False)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        return self._attr(path)

    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileNameT:
        try:
            return pyfuse3.FileNameT(os.fsencode(os.readlink(self._path(inode))))
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None

    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        return pyfuse3.FileHandleT(inode)

    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._path(fh)
        entries = sorted((os.lstat(e.path).st_ino, e.name) for e in os.scandir(path))
        for ino, name in entries:
            if ino <= start_id:
                continue
            full = os.path.join(path, name)
            attr = self._attr(full)
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(os.fsencode(name)), attr, ino):
                break
            self._remember(attr, full)

    async def _make(self, parent: pyfuse3.InodeT, name: pyfuse3.FileNameT, action: str,
                    mode: int = 0, target: bytes = b"") -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent), os.fsdecode(name))
        try:
            if action == "mkdir":
                os.mkdir(path, mode)
            elif action == "mknod":
                os.mknod(path, mode)
            else:
                os.symlink(target, path)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        return self._remember(self._attr(path), path)

    async def mkdir(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return await self._make(parent_inode, name, "mkdir", mode)

    async def mknod(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return await self._make(parent_inode, name, "mknod", mode)

    async def symlink(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, target: pyfuse3.FileNameT,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return await self._make(parent_inode, name, "symlink", target=target)

    async def link(self, inode: pyfuse3.InodeT, new_parent_inode: pyfuse3.InodeT, new_name: pyfuse3.FileNameT,
                   ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(new_parent_inode), os.fsdecode(new_name))
        try:
            os.link(self._path(inode), path, follow_symlinks=False)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        return self._remember(self._attr(path), path)

    async def _remove(self, parent: pyfuse3.InodeT, name: pyfuse3.FileNameT, directory: bool) -> None:
        try:
            (os.rmdir if directory else os.unlink)(os.path.join(self._path(parent), os.fsdecode(name)))
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None

    async def unlink(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                     ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name, False)

    async def rmdir(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                    ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name, True)

    async def rename(self, parent_inode_old: pyfuse3.InodeT, name_old: pyfuse3.FileNameT,
                     parent_inode_new: pyfuse3.InodeT, name_new: pyfuse3.FileNameT, flags: int,
                     ctx: pyfuse3.RequestContext) -> None:
        if flags:
            raise FUSEError(errno.EINVAL)
        old = os.path.join(self._path(parent_inode_old), os.fsdecode(name_old))
        new = os.path.join(self._path(parent_inode_new), os.fsdecode(name_new))
        try:
            ino = os.lstat(old).st_ino
            os.rename(old, new)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        if ino in self.paths:
            self.paths[ino] = new

    async def open(self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        try:
            fd = os.open(self._path(inode), flags & ~os.O_CREAT)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        self.fds[fd] = fd
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fd))

    async def create(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, mode)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from None
        self.fds[fd] = fd
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fd)), self._remember(self._attr(fd=fd), path)

    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        return os.pread(fh, size, off)

    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        return os.pwrite(fh, buf, off)

    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        pass

    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        os.close(self.fds.pop(fh))

    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        (os.fdatasync if datasync else os.fsync)(fh)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                     "f_favail", "f_namemax"):
            setattr(data, name, getattr(st, name))
        return data


def main() -> int:
    """Mount, serve until unmounted or signalled, unmount."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("--timeout", type=float, default=0.0, help="entry and attribute cache timeout, seconds")
    args = parser.parse_args()
    ops = Passthrough(os.path.abspath(args.source), args.timeout)
    options = set(pyfuse3.default_options)
    options |= {"fsname=passthrough", "default_permissions"}
    pyfuse3.init(ops, args.mountpoint, options)

    async def serve() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pyfuse3.main)
                async for _ in signals:
                    nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
