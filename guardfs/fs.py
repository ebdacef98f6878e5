"""The policing passthrough: one async method per FUSE request, each one thin.

Every request is resolved against the backing directory through :class:`Backing` (a held
directory fd, ``openat2`` without symlinks) and checked against the inode's cached
classification. A handler asks the :class:`~guardfs.gate.Gate` about a mutation *before*
anything reaches the disk (a denial raises ``FUSEError`` with the documented errno and
leaves an event), keeps the pre-image for rollback, does its syscall and tells the gate it
is done. Write sessions live in :mod:`guardfs.sessions`, the virtual ``.guard/`` in
:mod:`guardfs.virtual`, rename planning in :mod:`guardfs.rename`. Only ``FUSEError`` leaves
a handler: ``OSError`` is mapped in :func:`_fuse_errors`; anything else is a bug and crashes
the server, which unmounts (the mount fails closed).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import resource
import stat
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from guardfs import fusereply
from guardfs.accounting import WriteAccounting, WriteSession
from guardfs.backing import Backing
from guardfs.checkpoint import PreImages
from guardfs.decision import Decider, LimitsDecider, Request, Verdict
from guardfs.events import EventLog
from guardfs.gate import Commit, Gate
from guardfs.gitguard import git_binary_ids, is_git_process
from guardfs.inodes import Entry, InodeTable
from guardfs.intent import lookup_intent
from guardfs.links import forbidden_links
from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, Classification, PathPolicy, Scope, is_git_state, read_gitignore
from guardfs.rename import (
    check_carried,
    check_config_landing,
    check_git_landing,
    check_git_update,
    check_git_write,
    plan_rename,
)
from guardfs.scratch import ScratchBacking
from guardfs.sessions import OpenFile, WriteSessions, forget_names_again, invalidate_later, read_small
from guardfs.virtual import GuardNode, default_state

if TYPE_CHECKING:  # dulwich is imported only where a run judges git state
    from guardfs.gitscope import GitScope

__all__ = ["FD_RESERVE", "UNSUPPORTED", "GuardFS"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: FUSE operations guardfs does not implement, with the errno the kernel gets.
UNSUPPORTED: dict[str, int] = {
    "poll": errno.ENOSYS,  # the kernel falls back to its default poll: always ready
    "mknod (block/char device)": errno.EPERM,  # no device nodes in a workspace
}

_libc = ctypes.CDLL(None, use_errno=True)
#: Descriptors kept free for the guard's own work once the agent's open files fill the
#: table: the backing's directory cache (256), pre-image copies, the event log, the ledger
#: and STATE.md writes, the control socket and its connections.
FD_RESERVE = 1024
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC
# Flags the kernel handles itself or that would make our own I/O fail. O_TRUNC stays: with
# atomic_o_trunc (which libfuse enables) the kernel leaves truncation on open to us.
_STRIP_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | getattr(os, "O_DIRECT", 0)


# What an async handler returns; the loop (trio's traps) decides what it yields and is sent.
_Handler = Callable[P, Coroutine[object, object, R]]


def _fuse_errors(fn: _Handler[P, R]) -> _Handler[P, R]:
    """Map OSError to FUSEError in one place; anything else propagates (a bug)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except OSError as err:
            raise FUSEError(err.errno or errno.EIO) from err

    return wrapper


#: The set-ID bits: never given to a non-directory through the mount (docs/how-it-works.md, SECURITY.md).
_SET_ID = stat.S_ISUID | stat.S_ISGID


def _kept_high_bits(mode: int, is_dir: bool) -> int:
    """The bits beyond the permission bits a node the guard makes may keep: set-group-ID on
    a directory only (the group its new entries inherit, no privilege), sticky always, never
    set-user-ID. POSIX leaves the effect of such bits in a creating call's mode unspecified."""
    return mode & (stat.S_ISVTX | stat.S_ISGID) if is_dir else mode & stat.S_ISVTX


def _creation_mode(mode: int, is_dir: bool) -> int:
    """The mode the guard passes to the call that makes a node: no set-ID bit on a file (the
    guard has CAP_FSETID: the backing filesystem would keep what a root agent asked for)."""
    return stat.S_IFMT(mode) | (mode & 0o777) | _kept_high_bits(mode, is_dir)


def _apply_mode(created: int, wanted: int, chmod: Callable[[int], None]) -> None:
    """Give a node the guard just made the permission bits the kernel passed (the caller's
    umask already applied), which the guard's own umask may have narrowed; of the bits
    beyond them, only those :func:`_kept_high_bits` allows (a directory's inherited
    set-group-ID stays)."""
    have = stat.S_IMODE(created)
    mode = _kept_high_bits(have, stat.S_ISDIR(created)) | (wanted & 0o777)
    if mode != have:
        chmod(mode)


def _added_set_id(wanted: int, st: os.stat_result) -> int:
    """The set-ID bits a chmod to *wanted* would add to the node *st* (none of them may be
    added: never set-user-ID, set-group-ID on a directory only). A bit the node has already
    (a human's file) may stay, so that ``chmod u+x`` of it works."""
    refused = _SET_ID if not stat.S_ISDIR(st.st_mode) else stat.S_ISUID
    return wanted & refused & ~st.st_mode


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _setattr_op(fields: pyfuse3.SetattrFields) -> str:
    """The operation a setattr request performs, as events and rules name it."""
    if fields.update_size:
        return "truncate"
    if fields.update_mode:
        return "chmod"
    if fields.update_uid or fields.update_gid:
        return "chown"
    return "utimes"


def _renameat2(olddir: int, old: str, newdir: int, new: str, flags: int) -> None:
    if _libc.renameat2(olddir, os.fsencode(old), newdir, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), old)


#: A directory's listing: name, attributes (None: the virtual STATE.md) and classification.
_Listing = list[tuple[str, os.stat_result | None, Classification]]
#: Listings kept between the requests of one directory read without OPENDIR (the kernel reads
#: a large directory in several; readers of other directories may come in between).
_LISTINGS_KEPT = 64
#: Listings start with "." and ".." (offsets 1 and 2); the directory's names follow.
_DOTS = 2


@dataclass(slots=True, eq=False)
class _Dir:
    """An open directory and its listing, taken at the first readdir."""

    fd: int
    entry: Entry
    listing: _Listing | None = field(default=None)


class GuardFS(pyfuse3.Operations):
    """A passthrough filesystem that enforces a scope manifest on every operation."""

    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(
        self,
        backing: str,
        manifest: Manifest,
        events: EventLog,
        *,
        decider: Decider | None = None,
        cache_timeout: float = 60.0,
        state_text: Callable[[], str] | None = None,
        accounting: WriteAccounting | None = None,
        checkpoint_dir: Path | None = None,
        xattrs: bool = False,
        policy: PathPolicy | None = None,
        gitscope: GitScope | None = None,
        scratch_dir: Path | None = None,
        links: Mapping[int, Classification] | None = None,
    ) -> None:
        """Serve *backing* under *manifest*; *state_text* renders ``.guard/STATE.md``;
        with *gitscope*, renames onto git's index and refs are judged for what they change;
        *policy* is the run's compiled policy (by default compiled here, looking whether
        ``.git/config`` exists now);
        with *checkpoint_dir*, pre-images are kept there for rollback. Without *xattrs*
        the mount has no extended attributes: the first call answers ENOSYS and the kernel
        never asks again (it skips the security.capability lookup it sends before every
        write), and applications get EOPNOTSUPP, as on a filesystem without them. With
        *scratch_dir*, generated output out of scope lands there (guardfs.scratch); without
        it, it is refused quietly. *links*: the other names of forbidden files
        (guardfs.links.forbidden_links, found by the caller's walk at start), else walked here."""
        super().__init__()
        self._scratch = None if scratch_dir is None else ScratchBacking(backing, scratch_dir)
        self.backing: Backing = self._scratch if self._scratch is not None else Backing(backing)
        self.policy = policy if policy is not None else PathPolicy(
            manifest, git_config_existed=self._lstat_or_none(".git/config") is not None,
            gitignore=read_gitignore(backing) if manifest.paths.generated_from_gitignore else ())
        root = os.stat(self.backing.root_fd)
        self._root_dev = root.st_dev
        # One walk of the workspace, before the mount serves anything: the other names of
        # forbidden files are forbidden too (guardfs.links; the Session's walk, shared).
        self.inodes = InodeTable(self.policy, root.st_ino,
                                 links if links is not None else forbidden_links(self.backing, self.policy))
        self.accounting = accounting if accounting is not None else WriteAccounting()
        self.decider: Decider = decider or LimitsDecider(manifest.limits, self.accounting)
        self.events = events
        self.limits = manifest.limits
        self.timeout = cache_timeout
        self.xattrs = xattrs
        self.gate = Gate(self.policy, self.accounting, self.decider, events, manifest.limits, self._scratch)
        self.sessions = WriteSessions(self.gate, self.backing, manifest.limits)
        self.gitscope = gitscope
        # Which writers are git itself: its restores are not the agent's oscillation.
        self._git_ids = git_binary_ids()
        self._files: dict[int, OpenFile] = {}
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        # Opens for the agent stop at this descriptor number (a quarter at most is kept).
        self._fd_ceiling = soft - min(FD_RESERVE, soft // 4)
        self._fd_short = False
        self._dirs: dict[int, _Dir] = {}
        self._listings: dict[int, _Listing] = {}  # directories read without OPENDIR, by inode
        self._next_dir = 1
        self._as_root = os.geteuid() == 0
        self.state_text = state_text or functools.partial(default_state, manifest, self.accounting, events)
        self.guard = GuardNode(self.inodes, self.state_text, cache_timeout)
        #: Told of each directory made in scope and generated, and of each new scratch root
        #: (path, the mount's inode); it must not wait.
        self.on_generated_dir: Callable[[str, int], None] | None = None
        #: Asked of each rename and link (src, dst): a refusal when it crosses a natively bound tree.
        self.native_crossing: Callable[[str, str], Verdict | None] | None = None
        #: Told of each directory the mount removed (its path); it must not wait.
        self.on_removed_dir: Callable[[str], None] | None = None
        self.preimages = None if checkpoint_dir is None else PreImages(
            self.backing, checkpoint_dir, manifest.sandbox.checkpoint_max_bytes, events.emit,
            generated=self.policy.generated)

    def close(self) -> None:
        """Close every fd this filesystem holds (after the mount is gone)."""
        for f in self._files.values():
            os.close(f.fd)
        for d in self._dirs.values():
            if d.fd >= 0:
                os.close(d.fd)
        self._files.clear()
        for entry in self.inodes:
            self._unpin(entry)
        self._dirs.clear()
        self._listings.clear()
        if self.preimages is not None:
            self.preimages.close()
        self.backing.close()

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
            return self._fstat(fd, entry.path)
        if entry.nameless and entry.pin is not None:
            return self._fstat(entry.pin, entry.path)
        st = self.backing.lstat(entry.path)
        if st.st_ino != entry.backing_ino:
            # The name is another file's now, replaced behind the kernel's cached dentry (as a
            # rollback does): ESTALE makes the kernel look the name up again and retry the call.
            # A symlink planted there behind the mount's back is refused, not re-resolved.
            raise FUSEError(errno.ENOENT if stat.S_ISLNK(st.st_mode) else errno.ESTALE)
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
        return self.policy.settled(self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path),
                                   st.st_ctime_ns)

    def _fstat(self, fd: int, path: str) -> os.stat_result:
        """fstat of *fd*, open on *path*, as the mount shows it (a scratch inode offset)."""
        return os.fstat(fd) if self._scratch is None else self._scratch.fstat(fd, path)

    def _stat_at(self, dir_fd: int, name: str, path: str) -> os.stat_result:
        """lstat of *name* in *dir_fd*, the parent of *path*, as the mount shows it."""
        if self._scratch is None:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return self._scratch.stat_at(dir_fd, name, path)

    @staticmethod
    def _held(entry: Entry) -> int | None:
        """A descriptor the guard holds on *entry*'s inode once the mount took its last name
        (its pin, or a file handle open on it): requests for it are served from that, not
        from the path, which names another file now or none."""
        if not entry.nameless:
            return None
        if entry.pin is not None:
            return entry.pin
        return next(iter(entry.handles), None)

    def _keep_alive(self, st: os.stat_result, path: str) -> None:
        """Pin the regular file *st* at *path* before the mount takes its last name (unlink,
        rename over it) if the kernel still holds it: a path walk that found it before may
        still send requests for it, which a local filesystem would serve from the unlinked
        inode. Without a pin (descriptors short) such a request is answered ESTALE."""
        if not stat.S_ISREG(st.st_mode) or self._fd_short:
            return
        entry = self.inodes.get(self.inodes.fuse_ino(st.st_ino))
        if entry is None or entry.virtual or entry.pin is not None or entry.lookups <= 0:
            return
        if entry.path != path or entry.aliases:
            return  # another name of it stays
        try:
            fd = self.backing.open(path, os.O_PATH)
        except OSError:
            return  # not there to pin (another layer's, gone): the request goes on without one
        # The agent decides how many such inodes the kernel holds (an O_PATH descriptor of its
        # own costs the guard none): pins stop at the reserve, as opens for the agent do.
        if fd >= self._fd_ceiling or self._fstat(fd, path).st_ino != entry.backing_ino:
            os.close(fd)  # (or changed behind the mount meanwhile: nothing of ours to keep)
            return
        entry.pin = fd

    @staticmethod
    def _unpin(entry: Entry | None) -> None:
        """Close the pin of an entry the table dropped."""
        if entry is not None and entry.pin is not None:
            os.close(entry.pin)
            entry.pin = None

    def _held_for_writing(self, st: os.stat_result) -> bool:
        """Whether the inode *st* is open for writing through the mount."""
        entry = self.inodes.get(self.inodes.fuse_ino(st.st_ino))
        return entry is not None and any(self._files[fd].writable for fd in entry.handles)

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
        self._fd_limit(probe)

    def _reserve_opened(self, fd: int) -> None:
        """:meth:`_reserve_fd` after the fact, for an open that changed nothing (no O_TRUNC,
        no O_CREAT): the number *fd* got is the one a probe would have got, so the probe's
        two system calls are saved; past the ceiling *fd* is closed and ENFILE raised."""
        try:
            self._fd_limit(fd)
        except FUSEError:
            os.close(fd)
            raise

    def _fd_limit(self, probe: int) -> None:
        """Note whether the descriptor number *probe* reaches the reserve; raise ENFILE if so."""
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

    def rollback(self, to: str = "last") -> list[str]:
        """Restore the workspace to restore point *to* (``start``, ``last`` or a label) and
        make the kernel forget what it cached of the restored paths. Call from the event
        loop, outside any request."""
        if self.preimages is None:
            raise FUSEError(errno.ENOTSUP)
        changed = self.preimages.rollback(to=to)
        by_path = {e.path: e for e in self.inodes if not e.virtual}
        # Only a directory the kernel knows and still there: not the inode of a symlink or a
        # removed directory the rollback replaced (its number may be a file's by now).
        dirs = {e.path: e for e in self.inodes if not e.virtual and e.is_dir and not e.nameless}
        names: list[tuple[int, bytes]] = []
        for path in changed:
            self._rolled_back(path)
            parent = self._still_there(dirs.get(path.rpartition("/")[0]))
            name = pyfuse3.FileNameT(os.fsencode(path.rpartition("/")[2]))
            if parent is not None:
                pyfuse3.invalidate_entry_async(pyfuse3.InodeT(parent.ino), name, ignore_enoent=True)
                names.append((parent.ino, name))
            entry = by_path.get(path)
            if entry is not None:
                invalidate_later(entry.ino)
        self.backing.forget_dirs()  # directory fds cached by path may name what the rollback moved
        if names:
            # Once more, a moment later: a lookup answered while the agent raced the rollback
            # could leave the old entry cached for the whole entry timeout (seen: 1 run in 8).
            forget_names_again(names)
        self.events.emit("rollback", "", "allow", paths=len(changed))
        return changed

    def _still_there(self, entry: Entry | None) -> Entry | None:
        """*entry*, if its path still names the same directory in the backing (after a rollback)."""
        if entry is None:
            return None
        try:
            st = self.backing.lstat(entry.path)
        except OSError:
            return None
        return entry if stat.S_ISDIR(st.st_mode) and st.st_ino == entry.backing_ino else None

    def _rolled_back(self, path: str) -> None:
        """Tell the accounting what a rollback left at *path*, so that the content history
        ends with what the file holds (a version put back, or its end if it is gone)."""
        if path not in self.accounting.files:
            return
        try:
            st = self.backing.lstat(path)
        except OSError:  # gone, or beneath what is no directory now (a symlink the rollback put back)
            self.accounting.removed(path)
            return
        if stat.S_ISREG(st.st_mode):
            self.accounting.put_back(path, read_small(self.backing, path, st))

    def _chown_new(self, name: str, dir_fd: int, ctx: pyfuse3.RequestContext) -> None:
        if self._as_root and (ctx.uid, ctx.gid) != (0, 0):
            os.chown(name, ctx.uid, ctx.gid, dir_fd=dir_fd, follow_symlinks=False)

    async def _created(
        self, op: str, path: str, where: Classification, ctx: pyfuse3.RequestContext,
        make: Callable[[int, str], None], mode: int | None = None,
    ) -> pyfuse3.EntryAttributes:
        """Judge, create with *make(dir_fd, name)*, and hand the new entry to the kernel."""
        request = self.gate.ask(op, path, where, counts=op != "mkdir")
        await self._pre(path)
        dir_fd, name = self.backing.parent(path)
        make(dir_fd, name)
        if mode is not None:
            _apply_mode(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode, mode,
                        lambda m: os.chmod(name, m, dir_fd=dir_fd))
        self._chown_new(name, dir_fd, ctx)
        st = self._stat_at(dir_fd, name, path)
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        self.gate.done(request)
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
            return self.guard.lookup(parent, n, self._entry(pyfuse3.ROOT_INODE))
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
            # Refused whatever the caller meant; a stat or access check is no violation.
            intent = lookup_intent(ctx.pid)
            self.gate.check(Request("lookup", path, where, False, contact=intent.contact, intent=intent.call))
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        return self._attr(st, entry.ino)

    async def forget(self, inode_list: Sequence[tuple[pyfuse3.InodeT, int]]) -> None:
        """Drop the kernel's references."""
        for ino, n in inode_list:
            self._unpin(self.inodes.forget(ino, n))

    @_fuse_errors
    async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """Attributes of a known inode."""
        return self._entry_attr(self._entry(inode))

    def _entry_attr(self, entry: Entry) -> pyfuse3.EntryAttributes:
        return self.guard.attr(entry) if entry.virtual else self._attr(self._stat(entry), entry.ino)

    def _refuse_set_id(self, request: Request, added: int) -> NoReturn:
        """Refuse a chmod that would add set-ID bits (EPERM, an event, no trip): a root
        agent could otherwise leave a set-user-ID root program in the workspace for the next
        local user to run, and a silent drop would tell the caller it had one."""
        bits = " and ".join(name for bit, name in ((stat.S_ISUID, "set-user-ID"), (stat.S_ISGID, "set-group-ID"))
                            if added & bit)
        self.gate.deny(request, Verdict(
            False, "set-id", None, errno.EPERM,
            f"{bits} cannot be set through the guard (set-group-ID only on a directory); "
            "chmod without it, or set it outside the run"))

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
        self.gate.refuse_guard_names("setattr", entry.path)
        handle = self._files.get(fh) if fh is not None else None
        st = self._stat(entry)
        request = self.gate.ask(_setattr_op(fields), entry.path, self._where(entry.path, st, entry.is_dir))
        if fields.update_mode and (added := _added_set_id(attr.st_mode, st)):
            self._refuse_set_id(request, added)
        held = self._held(entry)
        if held is None:
            await self._pre(entry.path)
        self._do_setattr(entry.path, st, attr, fields, handle, held)
        self.gate.done(request)
        return self._attr(self._stat(entry), inode)

    def _do_setattr(
        self, path: str, st: os.stat_result, attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields, handle: OpenFile | None, held: int | None,
    ) -> None:
        """Apply what setattr asks, field by field, to *path* (through *handle* if open;
        to the inode *held* holds, a regular file, once the mount took its last name)."""
        if fields.update_size:
            if handle is not None and handle.writable:
                os.ftruncate(handle.fd, attr.st_size)
                self.sessions.truncated(handle)
            else:
                fd = self.backing.open(path, os.O_WRONLY) if held is None else self.backing.reopen(held, os.O_WRONLY)
                try:
                    os.ftruncate(fd, attr.st_size)
                finally:
                    os.close(fd)
        if held is not None:  # never a symlink: chown and utime through the link reach the file
            proc = f"/proc/self/fd/{held}"
            if fields.update_mode:
                os.chmod(proc, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(proc, attr.st_uid if fields.update_uid else -1, attr.st_gid if fields.update_gid else -1)
            if fields.update_atime or fields.update_mtime:
                os.utime(proc, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                   attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
            return
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
            "mknod", path, where, ctx, lambda d, n: os.mknod(n, _creation_mode(mode, False), 0, dir_fd=d), mode
        )

    @_fuse_errors
    async def mkdir(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: pyfuse3.ModeT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Create a directory (directories do not count toward the blast radius)."""
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, True)
        attr = await self._created(
            "mkdir", path, where, ctx, lambda d, n: os.mkdir(n, _creation_mode(mode, True), dir_fd=d), mode)
        scratch = self._scratch
        if self.on_generated_dir is not None and (
                path in scratch.roots if scratch is not None and scratch.in_scratch(path)
                else where.scope is Scope.GENERATED):
            # Generated in the workspace, or a new root of the scratch layer (its inode offset):
            # the launcher may bind it natively (sandbox.launch.inject).
            self.on_generated_dir(path, attr.st_ino)
        return attr

    @_fuse_errors
    async def symlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, target: pyfuse3.FileNameT,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        """Create a symlink; only its own name is judged, the kernel judges what it reaches."""
        _, path = self._child(parent_inode, name)
        where = self.policy.symlink_where(path, self._where(path, None, False), os.fsdecode(target))
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
        if entry.nameless:
            raise FUSEError(errno.ENOENT)  # as link(2) of an unlinked file: no name to link it by
        self.gate.refuse_guard_names("link", entry.path, path)
        where = self._where(entry.path, self._stat(entry), entry.is_dir)
        target_where = self._where(path, None, False)
        request = Request(
            "link", entry.path, where, True, target=path, target_where=target_where,
            new_files=self.gate.new_files((path, target_where)),
        )
        self.gate.check(request)
        if self.native_crossing is not None and (crossing := self.native_crossing(entry.path, path)) is not None:
            self.gate.refuse(request, crossing)
        await self._pre(path)
        src_dir, src_name = self.backing.parent(entry.path)
        dst_dir, dst_name = self.backing.parent(path)
        os.link(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
        st = self._stat_at(dst_dir, dst_name, path)
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, target_where)
        self.gate.done(request)
        return self._attr(st, entry.ino)

    @_fuse_errors
    async def unlink(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, ctx: pyfuse3.RequestContext
    ) -> None:
        """Remove a file name."""
        _, path = self._child(parent_inode, name)
        self.gate.refuse_guard_names("unlink", path)
        st = self.backing.lstat(path)
        # git deletes refs (git branch -d, pack-refs): a ref no longer there changes no path.
        where = self._where(path, st, False)
        if self.gitscope is not None and is_git_state(path):
            where = self.policy.git_state_update(path)
        request = self.gate.ask("unlink", path, where)
        await self._pre(path)
        self._keep_alive(st, path)
        dir_fd, n = self.backing.parent(path)
        os.unlink(n, dir_fd=dir_fd)
        if self._scratch is not None:
            self._scratch.removed(path)
        self._unnamed(st, path)
        # The agent's deletion ends the file's content history; git's (a checkout unlinks a
        # file before it writes a version back) does not, so git cannot flip it freely.
        ended = where.scope.counted and not is_git_process(ctx.pid, self._git_ids)
        self.gate.done(request, Commit(removed=path if ended else None))

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
        self.gate.refuse_guard_names("rmdir", path)
        st = self.backing.lstat(path)
        request = self.gate.ask("rmdir", path, self._where(path, st, True), counts=False)
        await self._pre(path)
        dir_fd, n = self.backing.parent(path)
        os.rmdir(n, dir_fd=dir_fd)
        if self._scratch is not None:
            self._scratch.removed(path)
        self.backing.forget_dirs()
        self.gate.done(request)
        if self.on_removed_dir is not None:
            self.on_removed_dir(path)

    @_fuse_errors
    async def rename(
        self, parent_inode_old: pyfuse3.InodeT, name_old: pyfuse3.FileNameT,
        parent_inode_new: pyfuse3.InodeT, name_new: pyfuse3.FileNameT,
        flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext,
    ) -> None:
        """Rename, judged at both ends and, for a directory, for everything it carries."""
        _, src = self._child(parent_inode_old, name_old)
        _, dst = self._child(parent_inode_new, name_new)
        self.gate.refuse_guard_names("rename", src, dst)
        src_st = self.backing.lstat(src)
        dst_st = self._lstat_or_none(dst)
        src_dir = stat.S_ISDIR(src_st.st_mode)
        dst_dir = dst_st is not None and stat.S_ISDIR(dst_st.st_mode)
        exchange = bool(flags & pyfuse3.RENAME_EXCHANGE)
        # What the destination name becomes: the moving object's kind decides dir patterns.
        dst_where = self._where(dst, dst_st, src_dir)
        if self.gitscope is not None and not src_dir and is_git_state(dst):
            dst_where = self.policy.git_state_update(dst)  # judged below for what it changes
        request, commit = plan_rename(
            self.gate, self.backing,
            (src, src_st, self._where(src, src_st, src_dir)),
            (dst, dst_st, dst_where),
            exchange,
        )
        self.gate.check(request)
        if self.native_crossing is not None and (crossing := self.native_crossing(src, dst)) is not None:
            self.gate.refuse(request, crossing)
        if src_dir or (exchange and dst_dir):
            check_carried(self.gate, self.backing, request, src, dst)
            if exchange:
                check_carried(self.gate, self.backing, request, dst, src)
        if dst_where.scope is Scope.GIT_GUARDED or (exchange and request.where.scope is Scope.GIT_GUARDED):
            entry = self.inodes.get(self.inodes.fuse_ino(src_st.st_ino))
            writers = entry is not None and any(self._files[fd].writable for fd in entry.handles)
            await check_config_landing(self.gate, self.backing, request, (src, src_st), exchange, writers)
        ends = [((src, src_st), (dst, dst_where))] + ([((dst, dst_st), (src, request.where))] if exchange else [])
        for (other, other_st), (name, where) in ends:
            if where.scope is Scope.GIT_CHECKED and other_st is not None:
                check_git_landing(self.gate, self.backing, self.gitscope, request, (other, other_st), (name, where),
                                  self._held_for_writing(other_st))
        if self.gitscope is not None:
            def held() -> bool:
                return any(f.writable and f.entry.path in (src, dst) for f in self._files.values())
            check_git_update(self.gate, self.gitscope, request, (src, src_dir), (dst, dst_dir), exchange, held)
        await self._pre_move((src, src_st), (dst, dst_st))
        if dst_st is not None and not exchange and dst_st.st_ino != src_st.st_ino:
            self._keep_alive(dst_st, dst)
        old_dir, old_name = self.backing.parent(src)
        new_dir, new_name = self.backing.parent(dst)
        if flags:
            _renameat2(old_dir, old_name, new_dir, new_name, flags)
        else:
            os.rename(old_name, new_name, src_dir_fd=old_dir, dst_dir_fd=new_dir)
        if self._scratch is not None:
            self._scratch.renamed(src, dst, exchange)
        self._renamed(src, src_st, dst, dst_st, exchange)
        if src_dir or dst_dir:
            self.backing.forget_dirs()
        self.gate.done(request, commit)

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

    # ----- files ---------------------------------------------------------------------

    @_fuse_errors
    async def open(self, inode: pyfuse3.InodeT, flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """Open a file; opening for write outside scope is refused here."""
        entry = self._entry(inode)
        writable = bool(flags & _WRITE_FLAGS)
        if entry.virtual:
            if writable or entry.is_dir:
                self.gate.check(Request("open", entry.path, entry.where, True))
            return self.guard.open()
        where = entry.where
        if where.scope is Scope.GIT_CONFIG or (writable and where.scope is not Scope.ALLOWED):
            where = self._where(entry.path, self._stat(entry), entry.is_dir)
        truncating = bool(flags & os.O_TRUNC) and writable
        # A file whose last name the mount took (a rename over it) is judged by the name it
        # had; what is written to it reaches no name of the workspace: nothing to count.
        counted = writable and where.scope.counted and not entry.nameless
        request = None
        if where.scope is Scope.FORBIDDEN or writable:
            # O_TRUNC changes the file at once: its blast radius is judged here, before that.
            new_files = self.gate.new_files((entry.path, where)) if truncating and counted else ()
            request = Request("open", entry.path, where, writable, new_files=new_files)
            self.gate.check(request)
        if writable:
            self._reserve_fd()  # before the pre-image and O_TRUNC: refused, nothing was done
        session = times = None
        if counted:  # the pre-image, before O_TRUNC takes it
            session, times = self.sessions.start(entry.path, self._stat(entry))
            session.by_git = is_git_process(ctx.pid, self._git_ids)
        if writable and not entry.nameless:
            await self._pre(entry.path)
        fd = self._open_inode(entry, flags & ~_STRIP_FLAGS, session)
        if not writable:
            self._reserve_opened(fd)
        self._files[fd] = OpenFile(fd, entry, writable, session, truncating, truncating and counted, times)
        entry.handles.add(fd)
        if request is not None and request.new_files:
            self.gate.done(request)
        # A descriptor open for reading has nothing to flush: its close(2) need not wait for us.
        fh = fd if writable else fusereply.handle(fd, fusereply.NOFLUSH)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), keep_cache=True)

    def _open_inode(self, entry: Entry, flags: int, session: WriteSession | None) -> int:
        """Open the inode *entry* is, never another file its path names now: from the
        descriptor the guard holds once the mount took its last name, else by its path,
        checked (ESTALE when the path names another inode: changed behind the mount, the
        kernel looks it up again). O_TRUNC is applied once the descriptor is known to be
        that inode, and opening for writing takes set-ID bits off, as a write does."""
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        trunc = flags & os.O_TRUNC if writing else 0
        held = self._held(entry)
        if held is None:
            fd = self.sessions.open_fd(entry.path, flags & ~trunc, session)
        else:
            if session is not None and flags & os.O_ACCMODE == os.O_WRONLY:
                session.old = None  # it became nameless while the open waited: no read-back
            fd = self.backing.reopen(held, flags & ~trunc)
        try:
            st = self._fstat(fd, entry.path)
            if st.st_ino != entry.backing_ino:
                raise FUSEError(errno.ESTALE)
            if trunc:
                os.ftruncate(fd, 0)
            if writing and self._as_root and st.st_mode & _SET_ID:  # (the kernel does it for others)
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_SET_ID)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @_fuse_errors
    async def create(
        self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT, mode: pyfuse3.ModeT,
        flags: pyfuse3.FlagT, ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        """Create and open a new file."""
        _, path = self._child(parent_inode, name)
        where = self._where(path, None, False)
        request = self.gate.ask("create", path, where)
        self._reserve_fd()
        await self._pre(path)
        fd = self._create_fd(path, flags, mode, where.scope.counted, ctx)
        try:
            st = self._fstat(fd, path)
        except OSError:
            os.close(fd)
            raise
        entry = self.inodes.remember(st.st_ino, st.st_mode, path, where)
        session = WriteSession(path, b"", is_git_process(ctx.pid, self._git_ids)) if where.scope.counted else None
        self._files[fd] = OpenFile(fd, entry, True, session, dirty=True)
        entry.handles.add(fd)
        self.gate.done(request)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fd), keep_cache=True), self._attr(st, entry.ino)

    def _create_fd(self, path: str, flags: int, mode: int, counted: bool, ctx: pyfuse3.RequestContext) -> int:
        """Create *path* in the backing, owned by the caller when the guard runs as root."""
        dir_fd, n = self.backing.parent(path)
        cflags = (flags & ~_STRIP_FLAGS) | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if counted and cflags & os.O_ACCMODE == os.O_WRONLY:
            cflags = (cflags & ~os.O_ACCMODE) | os.O_RDWR  # a write session reads it back at flush
        fd = os.open(n, cflags, _creation_mode(mode, False), dir_fd=dir_fd)
        try:
            _apply_mode(os.fstat(fd).st_mode, mode, lambda m: os.fchmod(fd, m))
            if self._as_root and (ctx.uid, ctx.gid) != (0, 0):
                os.fchown(fd, ctx.uid, ctx.gid)
        except OSError:
            os.close(fd)
            raise
        return fd

    @_fuse_errors
    async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
        """Read from the backing file (counted, not logged)."""
        if self.guard.owns(fh):
            return self.guard.read(fh, off, size)
        self.events.counts["read"] += 1
        return os.pread(fh, size, off)

    @_fuse_errors
    async def write(self, fh: pyfuse3.FileHandleT, off: int, buf: bytes) -> int:
        """Write; the first write of a session, the first after a truncation and any write
        that could oscillate are judged before they land."""
        f = self._files[fh]
        if f.entry.where.scope is Scope.GIT_CHECKED:
            check_git_write(self.gate, self.backing, self.gitscope, f.entry.where, f.entry.path, off, buf)
        self.sessions.before_write(f, off, buf)
        return os.pwrite(fh, buf, off)

    @_fuse_errors
    async def flush(self, fh: pyfuse3.FileHandleT) -> None:
        """close() of a descriptor: the write session ends here.

        The kernel sends flush synchronously with close(2) but release later and
        asynchronously, so accounting at flush means the next open already sees this
        session's counts.
        """
        if not self.guard.owns(fh):
            self.sessions.end(self._files[fh], final=False)

    @_fuse_errors
    async def release(self, fh: pyfuse3.FileHandleT) -> None:
        """Last close: end any session still open and close the backing fd."""
        if self.guard.owns(fh):
            self.guard.release(fh)
            return
        f = self._files.pop(fh)
        try:
            self.sessions.end(f, final=True)
        except FUSEError:
            pass  # release has no caller to tell; flush already reported the refusal
        finally:
            os.close(fh)
            self._unpin(self.inodes.release_handle(f.entry, fh))

    @_fuse_errors
    async def fsync(self, fh: pyfuse3.FileHandleT, datasync: bool) -> None:
        """fsync in a worker thread so other requests go on."""
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fh)

    # ----- directories ---------------------------------------------------------------

    @_fuse_errors
    async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        """Open a directory for listing.

        Where guardfs._fusereply names a directory's inode in requests without a handle, the
        first OPENDIR answers ENOSYS: the kernel sends none again for this mount (nor
        RELEASEDIR), caches every listing, and readdir judges the directory instead."""
        if fusereply.dirs_by_inode():
            raise FUSEError(errno.ENOSYS)
        entry = self._entry(inode)
        self._judge_listing(entry)
        fd = -1 if entry.virtual else self.backing.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        if fd >= 0:
            self._reserve_opened(fd)
        dh = self._next_dir
        self._next_dir += 1
        self._dirs[dh] = _Dir(fd, entry)
        if entry.virtual:
            return pyfuse3.FileHandleT(dh)
        # The kernel keeps the listing until the directory changes: through the mount (the
        # kernel drops it itself) or behind it (seen by the mtime getattr reports, once the
        # attribute timeout has passed, as for every other cached attribute).
        return pyfuse3.FileHandleT(fusereply.handle(dh, fusereply.CACHE_DIR))

    def _judge_listing(self, entry: Entry) -> None:
        """Listing a forbidden directory is refused (and judged as an opendir)."""
        if entry.where.scope is Scope.FORBIDDEN:
            self.gate.check(Request("opendir", entry.path, entry.where, False))

    @_fuse_errors
    async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """List a directory. Forbidden names are left out: readdirplus would hand the kernel
        their attributes (size, times) without a lookup, and the name itself can be a secret.
        """
        if fusereply.dirs_by_inode():  # no OPENDIR: the handle is the directory's inode
            directory = self._entry(pyfuse3.InodeT(fh))
            base, listing = directory.path, self._listing_by_inode(directory, start_id)
        else:
            d = self._dirs[fh]
            if d.listing is None or start_id == 0:
                d.listing = self.guard.listing() if d.entry.virtual else self._list(d.fd, d.entry)
            directory, base, listing = d.entry, d.entry.path, d.listing
        # '.' and '..' first (offsets 1 and 2), as a local directory lists them. The kernel
        # takes no reference for either from readdirplus: neither is remembered.
        for i, (dot, attr) in enumerate(self._dots(directory) if start_id < _DOTS else ()):
            if i >= start_id and not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(dot), attr, i + 1):
                return
        inodes = self.inodes
        for i in range(max(start_id, _DOTS) - _DOTS, len(listing)):
            name, st, where = listing[i]
            if st is None:  # the virtual STATE.md: permanent, not counted
                attr = self.guard.attr(self.guard.file)
                if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(os.fsencode(name)), attr, i + _DOTS + 1):
                    return
                continue
            entry_ino = inodes.fuse_ino(st.st_ino)
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(os.fsencode(name)), self._attr(st, entry_ino),
                                         i + _DOTS + 1):
                return
            inodes.remember(st.st_ino, st.st_mode, _join(base, name), where)

    def _dots(self, directory: Entry) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        """'.' and '..' of *directory*, with their attributes (the root is its own parent)."""
        here = self._entry_attr(directory)
        if directory.ino == pyfuse3.ROOT_INODE:
            return [(b".", here), (b"..", here)]
        parent = "" if directory.virtual else directory.path.rpartition("/")[0]
        if parent == "":
            above = self._entry_attr(self._entry(pyfuse3.ROOT_INODE))
        else:
            st = self.backing.lstat(parent)
            above = self._attr(st, self.inodes.fuse_ino(st.st_ino))
        return [(b".", here), (b"..", above)]

    def _listing_by_inode(self, entry: Entry, start_id: int) -> _Listing:
        """The listing of directory *entry*, opened without OPENDIR: judged and taken afresh
        when the kernel starts from the top, kept (a few, the latest) for its next requests."""
        listing = self._listings.pop(entry.ino, None)
        if listing is None or start_id == 0:
            self._judge_listing(entry)
            if entry.virtual:
                listing = self.guard.listing()
            else:
                fd = self.backing.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    listing = self._list(fd, entry)
                finally:
                    os.close(fd)
        self._listings[entry.ino] = listing  # the most recent last
        if len(self._listings) > _LISTINGS_KEPT:
            del self._listings[next(iter(self._listings))]
        return listing

    def _list(self, fd: int, entry: Entry) -> _Listing:
        out: _Listing = []
        base = entry.path
        # The virtual .guard/ is reachable by name but not listed, so that `git add -A`,
        # tar and rsync never pick up the guard's own state; a real .guard is shadowed.
        root = entry.ino == pyfuse3.ROOT_INODE
        scratch = self._scratch
        in_scratch = scratch is not None and scratch.in_scratch(base)
        # Scratch roots in a workspace directory hide its names and are listed in their place.
        shadow = set(scratch.roots_in(base)) if scratch is not None and not in_scratch else set()
        with os.scandir(fd) as it:
            for de in it:
                if (root and de.name == GUARD_DIR) or de.name in shadow:
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if in_scratch:
                    assert scratch is not None
                    st = scratch.fixed(st)
                if st.st_dev != self._root_dev:
                    continue
                path = _join(base, de.name)
                where = self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path)
                if where.scope is not Scope.FORBIDDEN:
                    out.append((de.name, st, where))
        for name in sorted(shadow):
            path = _join(base, name)
            try:
                st = self.backing.lstat(path)
            except FileNotFoundError:
                continue
            out.append((name, st, self.inodes.classify(st.st_ino, stat.S_ISDIR(st.st_mode), path)))
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
        if not fusereply.dirs_by_inode():
            fd = self._dirs[fh].fd
            if fd >= 0:
                await trio.to_thread.run_sync(os.fsync, fd)
            return
        entry = self._entry(pyfuse3.InodeT(fh))
        if entry.virtual:
            return
        fd = self.backing.open(entry.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            await trio.to_thread.run_sync(os.fsync, fd)
        finally:
            os.close(fd)

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
        return not (mode & os.W_OK) or self.gate.permits(Request("access", entry.path, entry.where, True))

    # ----- extended attributes -------------------------------------------------------

    def _xattr_target(self, inode: int, mutating: bool, op: str) -> tuple[Entry, Request | None]:
        if not self.xattrs:
            raise FUSEError(errno.ENOSYS)  # the kernel then stops sending this request type
        entry = self._entry(inode)
        if entry.virtual:
            if mutating:
                self.gate.check(Request(op, entry.path, entry.where, True))
            raise FUSEError(pyfuse3.ENOATTR if op == "getxattr" else errno.EOPNOTSUPP)
        request = None
        if mutating:
            where = self._where(entry.path, self._stat(entry), entry.is_dir)
            request = self.gate.ask(op, entry.path, where)
        elif entry.where.scope is Scope.FORBIDDEN:  # an attribute's value is content; its name is not
            self.gate.check(Request(op, entry.path, entry.where, False, contact=op != "listxattr"))
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
        self.gate.done(request)

    @_fuse_errors
    async def removexattr(self, inode: pyfuse3.InodeT, name: pyfuse3.XAttrNameT, ctx: pyfuse3.RequestContext) -> None:
        """Remove an extended attribute: a mutation."""
        entry, request = self._xattr_target(inode, True, "removexattr")
        self._xattr_call(entry.path, lambda p: os.removexattr(p, name))
        assert request is not None
        self.gate.done(request)
