"""The policing passthrough: one async method per FUSE request.

Every request is resolved against the backing directory through :class:`Backing` (a held
directory fd, ``openat2`` without symlinks) and checked against the inode's cached
classification. Mutations are judged by :func:`policy_verdict` and the injected
:class:`Decider` *before* anything reaches the disk; a denial raises ``FUSEError`` with the
documented errno and leaves an event. Only ``FUSEError`` leaves a handler: ``OSError`` is
mapped in :func:`_fuse_errors`; anything else is a bug and crashes the server, which
unmounts (the mount fails closed).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import resource
import stat
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from guardfs.accounting import WriteAccounting, WriteSession
from guardfs.backing import Backing
from guardfs.checkpoint import PreImages
from guardfs.decision import (
    Decider,
    LimitsDecider,
    Request,
    Verdict,
    policy_verdict,
)
from guardfs.events import EventLog, md_text
from guardfs.inodes import Entry, InodeTable
from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, Classification, PathPolicy, Scope
from guardfs.signature import MAX_ANALYSED_BYTES

__all__ = ["UNSUPPORTED", "GuardFS"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: FUSE operations guardfs does not implement, with the errno the kernel gets.
UNSUPPORTED: dict[str, int] = {
    "poll": errno.ENOSYS,  # the kernel falls back to its default poll: always ready
    "mknod (block/char device)": errno.EPERM,  # no device nodes in a workspace
}

# The virtual .guard/ directory and its STATE.md: inode numbers no backing filesystem
# hands out (ext4's are 32-bit), and file handles above every possible fd.
_VDIR_INO = (1 << 62) + 1
_VFILE_INO = (1 << 62) + 2
_STATE_NAME = "STATE.md"
_VFH_BASE = 1 << 40

_libc = ctypes.CDLL(None, use_errno=True)
#: Descriptors kept free for the guard's own work once the agent's open files fill the
#: table: the backing's directory cache (256), pre-image copies, the event log, the ledger
#: and STATE.md writes, the control socket and its connections.
FD_RESERVE = 1024
# Operations whose new_files did not exist before.
_CREATING = frozenset({"create", "mknod", "symlink"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC
# Flags the kernel handles itself or that would make our own I/O fail. O_TRUNC stays: with
# atomic_o_trunc (which libfuse enables) the kernel leaves truncation on open to us.
_STRIP_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | getattr(os, "O_DIRECT", 0)


def _fuse_errors(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Map OSError to FUSEError in one place; anything else propagates (a bug)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from err

    return wrapper


def _invalidate(ino: int) -> None:
    try:
        pyfuse3.invalidate_inode(pyfuse3.InodeT(ino))
    except OSError as err:  # the kernel forgot the inode meanwhile: nothing to refresh
        log.debug("invalidate_inode(%d): %s", ino, err)


def _command_name(pid: int) -> str:
    """The command name of *pid* (for denial events), or '' if it is gone."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _renameat2(olddir: int, old: str, newdir: int, new: str, flags: int) -> None:
    if _libc.renameat2(olddir, os.fsencode(old), newdir, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)


@dataclass(slots=True, eq=False)
class _File:
    """An open file: the backing fd (also the FUSE handle) and its write session."""

    fd: int
    entry: Entry
    writable: bool
    session: WriteSession | None = None
    dirty: bool = False
    # Truncated in this session (O_TRUNC or ftruncate) and not written since. Such a content
    # is never committed at a flush: the shell's `>` opens with O_TRUNC, dup2s and closes
    # (a flush) before it writes, and the empty file in between is not a version of its own.
    cut: bool = False
    # (atime, mtime) at open, put back with the content when a refused rewrite is undone.
    times: tuple[int, int] | None = None
    # Once a write on this handle is refused, its retries (a buffered writer flushing again
    # at close) are refused alike without asking again: one act, one judgement.
    refused: int = 0


@dataclass(slots=True, eq=False)
class _Dir:
    """An open directory and its listing, taken at the first readdir."""

    fd: int
    entry: Entry
    listing: list[tuple[str, os.stat_result | None, Classification]] | None = field(default=None)


class GuardFS(pyfuse3.Operations):
    """A passthrough filesystem that enforces a scope manifest on every operation."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(
        self,
        backing: str,
        manifest: Manifest,
        events: EventLog,
        decider: Decider | None = None,
        cache_timeout: float = 60.0,
        state_text: Callable[[], str] | None = None,
        accounting: WriteAccounting | None = None,
        checkpoint_dir: Path | None = None,
        xattrs: bool = False,
        policy: PathPolicy | None = None,
    ) -> None:
        """Serve *backing* under *manifest*; *state_text* renders ``.guard/STATE.md``;
        *policy* is the run's compiled policy (by default compiled here, looking whether
        ``.git/config`` exists now);
        with *checkpoint_dir*, pre-images are kept there for rollback. Without *xattrs*
        the mount has no extended attributes: the first call answers ENOSYS and the kernel
        never asks again (it skips the security.capability lookup it sends before every
        write), and applications get EOPNOTSUPP, as on a filesystem without them."""
        super().__init__()
        self.backing = Backing(backing)
        self.policy = policy if policy is not None else PathPolicy(
            manifest, git_config_existed=self._lstat_or_none(".git/config") is not None)
        root = os.stat(self.backing.root_fd)
        self._root_dev = root.st_dev
        self.inodes = InodeTable(self.policy, root.st_ino)
        self.accounting = accounting if accounting is not None else WriteAccounting()
        self.decider: Decider = decider or LimitsDecider(manifest.limits, self.accounting)
        self.events = events
        self.limits = manifest.limits
        self.timeout = cache_timeout
        self.xattrs = xattrs
        self._files: dict[int, _File] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        # Opens for the agent stop at this descriptor number (a quarter at most is kept).
        self._fd_ceiling = soft - min(FD_RESERVE, soft // 4)
        self._fd_short = False
        self._dirs: dict[int, _Dir] = {}
        self._next_dir = 1
        self._as_root = os.geteuid() == 0
        self.state_text = state_text or self._default_state
        self._vdir = self.inodes.add_virtual(_VDIR_INO, GUARD_DIR, True)
        self._vfile = self.inodes.add_virtual(_VFILE_INO, f"{GUARD_DIR}/{_STATE_NAME}", False)
        self._vhandles: dict[int, bytes] = {}
        self._next_vh = _VFH_BASE
        self._started_ns = time.time_ns()
        self.preimages = None if checkpoint_dir is None else PreImages(
            self.backing, checkpoint_dir, manifest.sandbox.checkpoint_max_bytes, events.emit)

    def close(self) -> None:
        """Close every fd this filesystem holds (after the mount is gone)."""
        for f in self._files.values():
            os.close(f.fd)
        for d in self._dirs.values():
            os.close(d.fd)
        self._files.clear()
        self._dirs.clear()
        if self.preimages is not None:
            self.preimages.close()
        self.backing.close()

    # ----- the virtual .guard/STATE.md ------------------------------------------------

    def _default_state(self) -> str:
        """STATE.md when no breaker renders it: the task, the scope and the counts."""
        m, lim = self.policy.manifest, self.limits
        max_files = "unlimited" if lim.max_files is None else lim.max_files
        files = "".join(f"- {md_text(p)}: {r.rewrites} rewrite(s)\n" for p, r in sorted(self.accounting.files.items()))
        return (
            f"# guard state\n\n**Task {m.task.id}**: {m.task.goal}\n\n## Scope\n"
            f"- writes allowed in: {', '.join(m.paths.allowed) or 'nowhere (read-only)'}\n"
            f"- forbidden (no read, no write): {', '.join(m.paths.forbidden) or 'nothing'}\n\n"
            f"## Budget\n- files mutated: {self.accounting.distinct} of {max_files}\n"
            f"- denials so far: {self.events.counts['deny']}\n"
            + (f"\n## Files mutated\n{files}" if files else "")
        )

    def _state_bytes(self) -> bytes:
        """STATE.md as served; a name that is not UTF-8 shows as an escape, never fails the read."""
        return self.state_text().encode("utf-8", "backslashreplace")

    def _vattr(self, entry: Entry) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.InodeT(entry.ino)
        if entry.is_dir:
            attr.st_mode = pyfuse3.ModeT(stat.S_IFDIR | 0o555)
            attr.st_nlink = 2
            attr.entry_timeout = attr.attr_timeout = self.timeout
        else:
            attr.st_mode = pyfuse3.ModeT(stat.S_IFREG | 0o444)
            attr.st_nlink = 1
            attr.st_size = len(self._state_bytes())
            attr.entry_timeout = attr.attr_timeout = 0  # its size changes with every event
        attr.st_uid, attr.st_gid = os.getuid(), os.getgid()
        attr.st_blksize = 4096
        stamp = self._started_ns if entry.is_dir else time.time_ns()
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = stamp
        return attr

    def _refuse_guard_dir(self, op: str, *paths: str) -> None:
        """Mutations of the guard's own names are refused before the backing is touched."""
        for path in paths:
            if path == GUARD_DIR or path.startswith(GUARD_DIR + "/"):
                self._check(Request(op, path, self.policy.classify(path, False), True))

    # ----- helpers -------------------------------------------------------------------

    def _entry(self, ino: int) -> Entry:
        entry = self.inodes.get(ino)
        if entry is None:
            raise FUSEError(errno.ESTALE)
        return entry

    def _attr(self, st: os.stat_result, ino: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.InodeT(ino)
        attr.generation = 0
        attr.entry_timeout = self.timeout
        attr.attr_timeout = self.timeout
        attr.st_mode = pyfuse3.ModeT(st.st_mode)
        attr.st_nlink = st.st_nlink
        attr.st_uid = st.st_uid
        attr.st_gid = st.st_gid
        attr.st_rdev = st.st_rdev
        attr.st_size = st.st_size
        attr.st_blksize = st.st_blksize
        attr.st_blocks = st.st_blocks
        attr.st_atime_ns = st.st_atime_ns
        attr.st_mtime_ns = st.st_mtime_ns
        attr.st_ctime_ns = st.st_ctime_ns
        return attr

    def _stat(self, entry: Entry) -> os.stat_result:
        """Current attributes of *entry*, refusing a path that now names another inode."""
        for fd in entry.handles:
            return os.fstat(fd)
        st = self.backing.lstat(entry.path)
        if st.st_ino != entry.backing_ino:
            raise FUSEError(errno.ENOENT)  # unlinked; the name is another file's now
        return st

    def _child(self, parent_ino: int, name: bytes) -> tuple[Entry, str]:
        parent = self._entry(parent_ino)
        n = os.fsdecode(name)
        if "/" in n or n in (".", ".."):
            raise FUSEError(errno.EINVAL)
        return parent, _join(parent.path, n)

    def _where(self, path: str, st: os.stat_result | None, is_dir: bool) -> Classification:
        """Classification of *path* (by its inode when it exists, hard links included)."""
        if st is None:
            return self.policy.classify(path, is_dir)
        return self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path)

    def _lstat_or_none(self, path: str) -> os.stat_result | None:
        try:
            return self.backing.lstat(path)
        except FileNotFoundError:
            return None

    def _reserve_fd(self) -> None:
        """Refuse a new open (ENFILE) once the guard's descriptors reach its reserve.

        The kernel hands out the lowest free number, so a probe's number is how many
        descriptors the whole process holds: the agent's open files, but also the sockets,
        logs and caches no counter here sees.
        """
        probe = os.dup(self.backing.root_fd)
        os.close(probe)
        short = probe >= self._fd_ceiling
        if short != self._fd_short:
            self._fd_short = short
            if short:
                log.warning("%d descriptors in use: new opens are refused with ENFILE until some close "
                            "(%d are kept for the guard)", probe, FD_RESERVE)
            else:
                log.warning("descriptors available again: opens are served")
        if short:
            raise FUSEError(errno.ENFILE)

    def _new_files(self, *candidates: tuple[str, Classification]) -> tuple[str, ...]:
        acct = self.accounting
        return tuple(p for p, w in candidates if w.scope.counted and acct.is_new(p))

    def _check(self, request: Request) -> None:
        """Judge *request*; on denial record the event and raise its errno."""
        policy = policy_verdict(request)
        verdict = self.decider.decide(request, policy)
        if not policy.allow and verdict.allow:
            verdict = policy  # a decider may tighten the policy, never loosen it
        if not verdict.allow:
            self._deny(request, verdict)

    def _deny(self, request: Request, verdict: Verdict) -> None:
        self.events.emit(
            request.op,
            request.path,
            "deny",
            target=request.target,
            actor=request.actor or None,
            rule=verdict.rule,
            pattern=verdict.pattern,
            errno=errno.errorcode.get(verdict.errno, str(verdict.errno)),
            reason=verdict.reason,
        )
        log.info("denied %s %s: %s", request.op, request.path, verdict.reason)
        raise FUSEError(verdict.errno)

    def _done(self, request: Request, **detail: Any) -> None:
        """Record an allowed, performed mutation."""
        before = self.accounting.distinct
        created = request.op in _CREATING
        for path in request.new_files:
            self.accounting.touch(path, created=created or path == request.target)
        self.events.emit(
            request.op, request.path, "allow", target=request.target, rule=request.where.key, **detail
        )
        self.decider.committed(request)
        limit = self.limits.max_files
        if limit is not None and before < limit <= self.accounting.distinct:
            self.events.emit(
                "limit", request.path, "allow", rule="limits.max_files",
                reason=f"{self.accounting.distinct} of max_files={limit} distinct files mutated",
            )

    def _mutation(self, op: str, path: str, where: Classification, counts: bool = True) -> Request:
        new_files = self._new_files((path, where)) if counts else ()
        request = Request(op, path, where, True, new_files=new_files)
        self._check(request)
        return request

    async def _pre(self, *paths: str) -> None:
        """Keep the pre-image of each path before its first change since the checkpoint
        (a file's bytes are copied off the loop; this request waits, others go on)."""
        if self.preimages is not None:
            await self.preimages.keep(*paths)

    async def _pre_move(self, *ends: tuple[str, os.stat_result | None]) -> None:
        """Pre-images for a rename: a directory that moves takes its whole tree along."""
        if self.preimages is None:
            return
        for path, st in ends:
            if st is not None and stat.S_ISDIR(st.st_mode):
                await self.preimages.keep_tree(path)
            else:
                await self.preimages.keep(path)

    def rollback(self) -> list[str]:
        """Restore the workspace to the last checkpoint and make the kernel forget what it
        cached of the restored paths. Call from the event loop, outside any request."""
        if self.preimages is None:
            raise FUSEError(errno.ENOTSUP)
        changed = self.preimages.rollback()
        by_path = {e.path: e for e in self.inodes if not e.virtual}
        for path in changed:
            parent = by_path.get(path.rpartition("/")[0])
            name = pyfuse3.FileNameT(os.fsencode(path.rpartition("/")[2]))
            if parent is not None:
                pyfuse3.invalidate_entry_async(pyfuse3.InodeT(parent.ino), name, ignore_enoent=True)
            entry = by_path.get(path)
            if entry is not None:
                threading.Thread(target=_invalidate, args=(entry.ino,), daemon=True).start()
        self.events.emit("rollback", "", "allow", paths=len(changed))
        return changed

    def _chown_new(self, name: str, dir_fd: int, ctx: pyfuse3.RequestContext) -> None:
        if self._as_root and (ctx.uid, ctx.gid) != (0, 0):
            os.chown(name, ctx.uid, ctx.gid, dir_fd=dir_fd, follow_symlinks=False)

    async def _created(
        self, op: str, path: str, where: Classification, ctx: pyfuse3.RequestContext,
        make: Callable[[int, str], None],
    ) -> pyfuse3.EntryAttributes:
        """Judge, create with *make(dir_fd, name)*, and hand the new entry to the kernel."""
        request = self._mutation(op, path, where, counts=op != "mkdir")
        await self._pre(path)
        dir_fd, name = self.backing.parent(path)
        make(dir_fd, name)
        self._chown_new(name, dir_fd, ctx)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        self._done(request)
        return self._attr(st, entry.ino)

    # ----- lookups and attributes ----------------------------------------------------

    @_fuse_errors
    async def lookup(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        """Resolve *name*; a forbidden one is refused with EACCES, an absent one cached."""
        parent = self._entry(parent_inode)
        n = os.fsdecode(name)
        if parent.virtual or (parent.ino == pyfuse3.ROOT_INODE and n == GUARD_DIR):
            return self._lookup_virtual(parent, n)
        if n == ".":
            path = parent.path
        elif n == "..":
            path = parent.path.rpartition("/")[0]
        else:
            path = _join(parent.path, n)
        try:
            st = self.backing.lstat(path)
        except FileNotFoundError:
            attr = pyfuse3.EntryAttributes()
            attr.st_ino = pyfuse3.InodeT(0)
            attr.entry_timeout = self.timeout
            return attr
        if st.st_dev != self._root_dev:
            raise FUSEError(errno.EXDEV)  # another filesystem mounted inside the workspace
        where = self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path)
        if where.scope is Scope.FORBIDDEN:
            self._check(Request("lookup", path, where, False, actor=_command_name(ctx.pid)))
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        return self._attr(st, entry.ino)

    def _lookup_virtual(self, parent: Entry, name: str) -> pyfuse3.EntryAttributes:
        if parent.ino == pyfuse3.ROOT_INODE or name in (".", ".."):
            return self._vattr(self._vdir if name != ".." else self._entry(pyfuse3.ROOT_INODE))
        if name == _STATE_NAME:
            return self._vattr(self._vfile)
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.InodeT(0)
        return attr

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        """Drop the kernel's references."""
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    @_fuse_errors
    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """Attributes of a known inode."""
        entry = self._entry(inode)
        if entry.virtual:
            return self._vattr(entry)
        return self._attr(self._stat(entry), inode)

    @_fuse_errors
    async def setattr(
        self,
        inode: pyfuse3.InodeT,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: pyfuse3.FileHandleT | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """chmod, chown, truncate and utimes, each a mutation judged before it lands."""
        entry = self._entry(inode)
        self._refuse_guard_dir("setattr", entry.path)
        handle = self._files.get(fh) if fh is not None else None
        st = self._stat(entry)
        path = entry.path
        if fields.update_size:
            op = "truncate"
        elif fields.update_mode:
            op = "chmod"
        elif fields.update_uid or fields.update_gid:
            op = "chown"
        else:
            op = "utimes"
        where = self._where(path, st, entry.is_dir)
        request = self._mutation(op, path, where)
        await self._pre(path)
        if fields.update_size:
            if handle is not None and handle.writable:
                os.ftruncate(handle.fd, attr.st_size)
                handle.dirty = True
                handle.cut = handle.session is not None
            else:
                fd = self.backing.open(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, attr.st_size)
                finally:
                    os.close(fd)
        if fields.update_mode:
            if stat.S_ISLNK(st.st_mode):
                raise FUSEError(errno.EOPNOTSUPP)
            fd, proc = self.backing.proc_path(path)
            try:
                os.chmod(proc, stat.S_IMODE(attr.st_mode))
            finally:
                os.close(fd)
        if path == "":
            raise FUSEError(errno.EROFS)  # unreachable: the root is never in scope
        dir_fd, name = self.backing.parent(path)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        if fields.update_atime or fields.update_mtime:
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(name, ns=(atime, mtime), dir_fd=dir_fd, follow_symlinks=False)
        self._done(request)
        return self._attr(self._stat(entry), inode)

    @_fuse_errors
    async def readlink(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileNameT:
        """The target of a symlink, as stored; the kernel resolves it inside the mount."""
        entry = self._entry(inode)
        if entry.virtual:
            raise FUSEError(errno.EINVAL)
        dir_fd, name = self.backing.parent(entry.path)
        return pyfuse3.FileNameT(os.fsencode(os.readlink(name, dir_fd=dir_fd)))

    # ----- creating and removing names ---------------------------------------------

    @_fuse_errors
    async def mknod(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: pyfuse3.ModeT,
        rdev: int, ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """FIFOs, sockets and empty regular files; never device nodes."""
        if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
            raise FUSEError(UNSUPPORTED["mknod (block/char device)"])
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, False)
        return await self._created(
            "mknod", path, where, ctx, lambda d, n: os.mknod(n, mode, 0, dir_fd=d)
        )

    @_fuse_errors
    async def mkdir(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: pyfuse3.ModeT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Create a directory (directories do not count toward the blast radius)."""
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, True)
        return await self._created("mkdir", path, where, ctx, lambda d, n: os.mkdir(n, mode, dir_fd=d))

    @_fuse_errors
    async def symlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, target: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Create a symlink; only its own name is judged, the kernel judges what it reaches."""
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, False)
        return await self._created(
            "symlink", path, where, ctx, lambda d, n: os.symlink(os.fsdecode(target), n, dir_fd=d)
        )

    @_fuse_errors
    async def link(
        self, inode: pyfuse3.InodeT, new_parent_inode: pyfuse3.InodeT,
        new_name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Hard link: both names must be writable, so no file is linked into or out of scope."""
        entry = self._entry(inode)
        _, path = self._child(new_parent_inode, new_name)
        self._refuse_guard_dir("link", entry.path, path)
        st = self._stat(entry)
        where = self._where(entry.path, st, entry.is_dir)
        target_where = self._where(path, None, False)
        request = Request(
            "link", entry.path, where, True, target=path, target_where=target_where,
            new_files=self._new_files((path, target_where)),
        )
        self._check(request)
        await self._pre(path)
        src_dir, src_name = self.backing.parent(entry.path)
        dst_dir, dst_name = self.backing.parent(path)
        os.link(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
        st = os.stat(dst_name, dir_fd=dst_dir, follow_symlinks=False)
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, target_where)
        self._done(request)
        return self._attr(st, entry.ino)

    @_fuse_errors
    async def unlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove a file name."""
        _, path = self._child(parent_inode, name)
        self._refuse_guard_dir("unlink", path)
        st = self.backing.lstat(path)
        request = self._mutation("unlink", path, self._where(path, st, False))
        await self._pre(path)
        dir_fd, n = self.backing.parent(path)
        os.unlink(n, dir_fd=dir_fd)
        self._unnamed(st, path)
        self._done(request)

    def _unnamed(self, st: os.stat_result, path: str) -> None:
        """*path*, a name of the inode *st*, is gone: its other names (hard links) stay."""
        entry = self.inodes.get(self.inodes.fuse_ino(st.st_ino))
        if entry is not None and not entry.is_dir:
            self.inodes.unlinked(entry, path)

    @_fuse_errors
    async def rmdir(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove an empty directory."""
        _, path = self._child(parent_inode, name)
        self._refuse_guard_dir("rmdir", path)
        st = self.backing.lstat(path)
        request = self._mutation("rmdir", path, self._where(path, st, True), counts=False)
        await self._pre(path)
        dir_fd, n = self.backing.parent(path)
        os.rmdir(n, dir_fd=dir_fd)
        self.backing.forget_dirs()
        self._done(request)

    @_fuse_errors
    async def rename(
        self, parent_inode_old: pyfuse3.InodeT, name_old: pyfuse3.FileNameT,
        parent_inode_new: pyfuse3.InodeT, name_new: pyfuse3.FileNameT,
        flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext,
    ) -> None:
        """Rename, judged at both ends and, for a directory, for everything it carries."""
        _, src = self._child(parent_inode_old, name_old)
        _, dst = self._child(parent_inode_new, name_new)
        self._refuse_guard_dir("rename", src, dst)
        src_st = self.backing.lstat(src)
        dst_st = self._lstat_or_none(dst)
        src_dir = stat.S_ISDIR(src_st.st_mode)
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
        src_where = self._where(src, src_st, src_dir)
        # What the destination name becomes: the moving object's kind decides dir patterns.
        dst_where = self._where(dst, dst_st, src_dir)
        acct = self.accounting
        src_rec = acct.files.get(src)
        src_is_new = src_rec is not None and src_rec.created
        counted = [] if src_dir else [(src, src_where), (dst, dst_where)]
        plan, old = None, None
        replacing = dst_st is not None and not exchange and stat.S_ISREG(dst_st.st_mode)
        if replacing and dst_where.scope.counted and stat.S_ISREG(src_st.st_mode):
            assert dst_st is not None
            # An atomic save: one rewrite of the target, judged on the content it brings.
            old = self._read_small(dst, dst_st)
            plan = acct.plan_rewrite(dst, old, self._read_small(src, src_st))
            counted = [] if src_rec is None or src_is_new else [(src, src_where)]
        elif src_is_new and not exchange:
            counted = []  # a file this run created moves on; its record moves with it
        request = Request(
            "rename", src, src_where, True, target=dst, target_where=dst_where,
            new_files=self._new_files(*counted), rewrite=plan,
        )
        self._check(request)
        if src_dir or (exchange and dst_st is not None and stat.S_ISDIR(dst_st.st_mode)):
            self._check_carried(request, src, dst)
            if exchange:
                self._check_carried(request, dst, src)
        await self._pre_move((src, src_st), (dst, dst_st))
        old_dir, old_name = self.backing.parent(src)
        new_dir, new_name = self.backing.parent(dst)
        if flags:
            _renameat2(old_dir, old_name, new_dir, new_name, flags)
        else:
            os.rename(old_name, new_name, src_dir_fd=old_dir, dst_dir_fd=new_dir)
        self._renamed(src, src_st, dst, dst_st, exchange)
        if src_dir or (dst_st is not None and stat.S_ISDIR(dst_st.st_mode)):
            self.backing.forget_dirs()
        if plan is not None:
            acct.commit_rewrite(plan, old)
            acct.forget_scratch(src)
        elif not exchange and (src_dir or src_is_new):
            acct.move(src, dst)
        self._done(request, **self._plan_detail(plan))

    def _renamed(
        self, src: str, src_st: os.stat_result, dst: str, dst_st: os.stat_result | None, exchange: bool
    ) -> None:
        """The inode table after a rename: names moved, a replaced name gone."""
        if exchange:
            self.inodes.exchanged(src, dst)
        elif dst_st is not None and dst_st.st_ino == src_st.st_ino:
            pass  # two names of one file: rename(2) does nothing, both names stay
        else:
            if dst_st is not None:
                self._unnamed(dst_st, dst)
            self.inodes.moved(self.inodes.get(self.inodes.fuse_ino(src_st.st_ino)), src, dst)

    def _check_carried(self, request: Request, src: str, dst: str) -> None:
        """Refuse moving a directory that holds a forbidden or protected path, or would
        put something of it under one."""
        for below, is_dir in self.backing.walk(src):
            for path in (below, dst + below[len(src):]):
                where = self.policy.classify(path, is_dir)
                if where.scope in (Scope.FORBIDDEN, Scope.PROTECTED, Scope.GIT_CONFIG):
                    err = errno.EACCES if where.scope is Scope.FORBIDDEN else errno.EROFS
                    self._deny(request, Verdict(
                        False, where.key, where.pattern, err,
                        f"moving {src} to {dst} would carry {path} ({where.describe()})",
                    ))

    def _read_small(self, path: str, st: os.stat_result) -> bytes | None:
        """Content of a file small enough to analyse, else None."""
        if st.st_size > MAX_ANALYSED_BYTES:
            return None
        fd = self.backing.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, MAX_ANALYSED_BYTES + 1, 0)
        finally:
            os.close(fd)

    @staticmethod
    def _plan_detail(plan: Any) -> dict[str, Any]:
        if plan is None:
            return {}
        return {"units": plan.counts, "cycle": plan.cycle or None}

    # ----- files ---------------------------------------------------------------------

    @_fuse_errors
    async def open(self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """Open a file; opening for write outside scope is refused here."""
        entry = self._entry(inode)
        writable = bool(flags & _WRITE_FLAGS)
        if entry.virtual:
            return self._open_virtual(entry, writable)
        where = entry.where
        if where.scope is Scope.GIT_CONFIG or (writable and where.scope is not Scope.ALLOWED):
            where = self._where(entry.path, self._stat(entry), entry.is_dir)
        truncating = bool(flags & os.O_TRUNC) and writable
        counted = writable and where.scope.counted
        request = None
        if where.scope is Scope.FORBIDDEN or writable:
            # O_TRUNC changes the file at once: its blast radius is judged here, before that.
            new_files = self._new_files((entry.path, where)) if truncating and counted else ()
            request = Request("open", entry.path, where, writable, new_files=new_files)
            self._check(request)
        self._reserve_fd()
        session = times = None
        if counted:  # the pre-image, before O_TRUNC takes it
            st = self._stat(entry)
            session = WriteSession(entry.path, self._read_small(entry.path, st))
            times = (st.st_atime_ns, st.st_mtime_ns)
        if writable:
            await self._pre(entry.path)
        fd = self._open_session_fd(entry.path, flags & ~_STRIP_FLAGS, session)
        st = os.fstat(fd)
        if st.st_ino != entry.backing_ino:
            os.close(fd)
            raise FUSEError(errno.ESTALE)
        self._files[fd] = _File(fd, entry, writable, session, truncating, truncating and counted, times)
        entry.handles.add(fd)
        if request is not None and request.new_files:
            self._done(request)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fd), keep_cache=True)

    def _open_virtual(self, entry: Entry, writable: bool) -> pyfuse3.FileInfo:
        if writable or entry.is_dir:
            self._check(Request("open", entry.path, entry.where, True))
        fh = self._next_vh
        self._next_vh += 1
        self._vhandles[fh] = self._state_bytes()  # one consistent snapshot per open
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=True)

    @_fuse_errors
    async def create(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: pyfuse3.ModeT,
        flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """Create and open a new file."""
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, False)
        request = self._mutation("create", path, where)
        self._reserve_fd()
        await self._pre(path)
        dir_fd, n = self.backing.parent(path)
        cflags = (flags & ~_STRIP_FLAGS) | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if where.scope.counted and cflags & os.O_ACCMODE == os.O_WRONLY:
            cflags = (cflags & ~os.O_ACCMODE) | os.O_RDWR  # read back at flush (see _current)
        fd = os.open(n, cflags, mode, dir_fd=dir_fd)
        try:
            if self._as_root and (ctx.uid, ctx.gid) != (0, 0):
                os.fchown(fd, ctx.uid, ctx.gid)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        session = WriteSession(path, b"") if where.scope.counted else None
        self._files[fd] = _File(fd, entry, True, session, dirty=True)
        entry.handles.add(fd)
        self._done(request)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fd), keep_cache=True), self._attr(st, entry.ino)

    @_fuse_errors
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        """Read from the backing file (counted, not logged)."""
        if fh >= _VFH_BASE:
            return self._vhandles[fh][off:off + size]
        self.events.counts["read"] += 1
        return os.pread(fh, size, off)

    @_fuse_errors
    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        """Write; the first write of a session, the first after a truncation and any write
        that could oscillate are judged before they land."""
        f = self._files[fh]
        if f.refused:
            raise FUSEError(f.refused)
        session = f.session
        if session is not None:
            limit = self.limits.max_rewrites
            first = not f.dirty
            # Content is judged only where a refusal can be undone: with the old content
            # in hand (files too large to analyse are judged at open and first write only).
            content = session.old is not None and (
                f.cut or (limit is not None and self.accounting.hot(session.path, limit))
            )
            if first or content:
                request = Request(
                    "write", session.path, f.entry.where, True,
                    new_files=self._new_files((session.path, f.entry.where)),
                    rewrite=self._preview(f, off, buf) if content else None,
                )
                self._check_write(f, request)
                if first:
                    self._done(request)
            f.cut = False
        elif not f.dirty:
            self.events.emit("write", f.entry.path, "allow", rule=f.entry.where.key)
        f.dirty = True
        return os.pwrite(fh, buf, off)

    def _check_write(self, f: _File, request: Request) -> None:
        """Judge a write; a refusal undoes what this session did to the file."""
        try:
            self._check(request)
        except FUSEError as err:
            f.refused = err.errno
            self._undo(f)
            raise

    def _undo(self, f: _File) -> None:
        """Put back the content (and times) the file had when this session began.

        A refused rewrite leaves the file as it was, also when the session had already
        truncated it (O_TRUNC) or written part of it. The kernel, which believes what the
        session did, is told to reload the inode's attributes and pages.
        """
        session = f.session
        if session is None or not f.dirty:
            return  # nothing of this session reached the file
        if session.old is None:
            # Unreachable: such sessions are not judged once they have changed the file.
            log.error("cannot undo the refused rewrite of %r: its old content was too large to keep",
                      session.path)
            return
        os.ftruncate(f.fd, 0)
        view = memoryview(session.old)
        done = 0
        while done < len(view):
            done += os.pwrite(f.fd, view[done:], done)
        if f.times is not None:
            os.utime(f.fd, ns=f.times)
        f.dirty = f.cut = False
        # Not from inside this request: the kernel may wait on it (deadlock).
        threading.Thread(target=_invalidate, args=(f.entry.ino,), daemon=True).start()

    def _open_session_fd(self, path: str, flags: int, session: WriteSession | None) -> int:
        """Open the backing file; a write session also needs to read it back, so a
        write-only open is widened to read-write where the file allows it."""
        if session is not None and flags & os.O_ACCMODE == os.O_WRONLY:
            try:
                return self.backing.open(path, (flags & ~os.O_ACCMODE) | os.O_RDWR)
            except PermissionError:
                session.old = None  # cannot read it back: no content analysis
        return self.backing.open(path, flags)

    def _current(self, f: _File) -> bytes | None:
        """The file's content now (read through the open fd), if small enough to analyse."""
        if f.session is None or f.session.old is None:
            return None
        size = os.fstat(f.fd).st_size
        return None if size > MAX_ANALYSED_BYTES else os.pread(f.fd, size + 1, 0)

    def _preview(self, f: _File, off: int, buf: bytes) -> Any:
        """The rewrite this write would complete, judged before it lands."""
        assert f.session is not None
        current = self._current(f)
        if current is None or off + len(buf) > MAX_ANALYSED_BYTES:
            return None
        data = bytearray(current)
        if off > len(data):
            data.extend(b"\0" * (off - len(data)))
        data[off:off + len(buf)] = buf
        return self.accounting.plan_rewrite(f.session.path, f.session.old, bytes(data))

    @_fuse_errors
    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        """close() of a descriptor: the write session ends here.

        The kernel sends flush synchronously with close(2) but release later and
        asynchronously, so accounting at flush means the next open already sees this
        session's counts.
        """
        if fh < _VFH_BASE:
            self._end_session(self._files[fh], final=False)

    def _end_session(self, f: _File, final: bool) -> None:
        """Commit the session's rewrite, from its old content to what the file holds now."""
        session = f.session
        if session is None or not f.dirty:
            return
        if f.refused:  # the session's write was refused and undone: nothing to count
            f.dirty = f.cut = False
            return
        if f.cut and not final:
            return  # truncated and not yet written: the writes to come complete this rewrite
        new = self._current(f)
        plan = self.accounting.plan_rewrite(session.path, session.old, new)
        self.accounting.commit_rewrite(plan, session.old)
        self.events.emit("rewrite", session.path, "allow", rule=f.entry.where.key, **self._plan_detail(plan))
        self.decider.committed(Request("rewrite", session.path, f.entry.where, True, rewrite=plan))
        session.old = new  # writes through a dup of this handle start a new session
        f.dirty = f.cut = False
        if f.times is not None:
            st = os.fstat(f.fd)
            f.times = (st.st_atime_ns, st.st_mtime_ns)

    @_fuse_errors
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        """Last close: end any session still open and close the backing fd."""
        if fh >= _VFH_BASE:
            del self._vhandles[fh]
            return
        f = self._files.pop(fh)
        try:
            self._end_session(f, final=True)
        except FUSEError:
            pass  # release has no caller to tell; flush already reported the refusal
        finally:
            os.close(fh)
            self.inodes.release_handle(f.entry, fh)

    @_fuse_errors
    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """fsync in a worker thread so other requests go on."""
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fh)

    # ----- directories ---------------------------------------------------------------

    @_fuse_errors
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        """Open a directory for listing."""
        entry = self._entry(inode)
        if entry.where.scope is Scope.FORBIDDEN:
            self._check(Request("opendir", entry.path, entry.where, False))
        if not entry.virtual:
            self._reserve_fd()
        fd = -1 if entry.virtual else self.backing.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        dh = self._next_dir
        self._next_dir += 1
        self._dirs[dh] = _Dir(fd, entry)
        return pyfuse3.FileHandleT(dh)

    @_fuse_errors
    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """List a directory. Forbidden names are left out: readdirplus would hand the kernel
        their attributes (size, times) without a lookup, and the name itself can be a secret.
        """
        d = self._dirs[fh]
        if d.listing is None or start_id == 0:
            d.listing = self._list(d)
        inodes = self.inodes
        for i in range(start_id, len(d.listing)):
            name, st, where = d.listing[i]
            if st is None:  # the virtual STATE.md: permanent, not counted
                attr = self._vattr(self._vfile)
                if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(os.fsencode(name)), attr, i + 1):
                    return
                continue
            entry_ino = inodes.fuse_ino(st.st_ino)
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(os.fsencode(name)), self._attr(st, entry_ino), i + 1):
                return
            inodes.remember(st.st_ino, st.st_mode, _join(d.entry.path, name), where)

    def _list(self, d: _Dir) -> list[tuple[str, os.stat_result | None, Classification]]:
        out: list[tuple[str, os.stat_result | None, Classification]] = []
        base = d.entry.path
        if d.entry.virtual:
            return [(_STATE_NAME, None, self._vfile.where)]
        # The virtual .guard/ is reachable by name but not listed, so that `git add -A`,
        # tar and rsync never pick up the guard's own state; a real .guard is shadowed.
        root = d.entry.ino == pyfuse3.ROOT_INODE
        with os.scandir(d.fd) as it:
            for de in it:
                if root and de.name == GUARD_DIR:
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_dev != self._root_dev:
                    continue
                path = _join(base, de.name)
                where = self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path)
                if where.scope is not Scope.FORBIDDEN:
                    out.append((de.name, st, where))
        return out

    @_fuse_errors
    async def releasedir(self, fh: pyfuse3.FileHandleT) -> None:
        """Close the directory."""
        fd = self._dirs.pop(fh).fd
        if fd >= 0:
            os.close(fd)

    @_fuse_errors
    async def fsyncdir(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """fsync a directory in a worker thread."""
        fd = self._dirs[fh].fd
        if fd >= 0:
            await trio.to_thread.run_sync(os.fsync, fd)

    @_fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The backing filesystem's figures."""
        sv = os.statvfs(self.backing.root_fd)
        out = pyfuse3.StatvfsData()
        for attr in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):
            setattr(out, attr, getattr(sv, attr))
        return out

    @_fuse_errors
    async def access(self, inode: pyfuse3.InodeT, mode: pyfuse3.ModeT, ctx: pyfuse3.RequestContext) -> bool:
        """Scope-aware access(2): W_OK is false wherever a write would be refused.

        With the ``default_permissions`` mount option (guardfs's default) the kernel answers
        access(2) from the mode bits and never calls this; it serves mounts without it.
        """
        entry = self._entry(inode)
        if entry.where.scope is Scope.FORBIDDEN:
            return False
        return not (mode & os.W_OK) or policy_verdict(Request("access", entry.path, entry.where, True)).allow

    # ----- extended attributes -------------------------------------------------------

    def _xattr_target(self, inode: int, mutating: bool, op: str) -> tuple[Entry, Request | None]:
        if not self.xattrs:
            raise FUSEError(errno.ENOSYS)  # the kernel then stops sending this request type
        entry = self._entry(inode)
        if entry.virtual:
            if mutating:
                self._check(Request(op, entry.path, entry.where, True))
            raise FUSEError(pyfuse3.ENOATTR if op == "getxattr" else errno.EOPNOTSUPP)
        request = None
        if mutating:
            where = self._where(entry.path, self._stat(entry), entry.is_dir)
            request = self._mutation(op, entry.path, where)
        elif entry.where.scope is Scope.FORBIDDEN:
            self._check(Request(op, entry.path, entry.where, False))
        return entry, request

    def _xattr_call(self, path: str, call: Callable[[str], R]) -> R:
        fd, proc = self.backing.proc_path(path)
        try:
            return call(proc)
        finally:
            os.close(fd)

    @_fuse_errors
    async def getxattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext) -> bytes:
        """Read an extended attribute."""
        entry, _ = self._xattr_target(inode, False, "getxattr")
        return self._xattr_call(entry.path, lambda p: os.getxattr(p, name))

    @_fuse_errors
    async def listxattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> Sequence[pyfuse3.XAttrNameT]:
        """List extended attributes."""
        if self.xattrs and self._entry(inode).virtual:
            return []
        entry, _ = self._xattr_target(inode, False, "listxattr")
        names = self._xattr_call(entry.path, os.listxattr)
        return [pyfuse3.XAttrNameT(os.fsencode(n)) for n in names]

    @_fuse_errors
    async def setxattr(
        self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        """Set an extended attribute: a mutation."""
        entry, request = self._xattr_target(inode, True, "setxattr")
        self._xattr_call(entry.path, lambda p: os.setxattr(p, name, value))
        assert request is not None
        self._done(request)

    @_fuse_errors
    async def removexattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext) -> None:
        """Remove an extended attribute: a mutation."""
        entry, request = self._xattr_target(inode, True, "removexattr")
        self._xattr_call(entry.path, lambda p: os.removexattr(p, name))
        assert request is not None
        self._done(request)
