"""Write sessions: what an open file did, from open (or the last flush) to close.

A session of a counted file keeps the file's content at its start (its pre-image, if small
enough to analyse) and is committed as one rewrite when the descriptor is closed (flush).
The first write of a session, the first after a truncation and any write that could
oscillate are judged before they land, on a preview of the rewrite they would complete; a
refused write undoes what the session did, so the file is left as it was.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import pyfuse3
from pyfuse3 import FUSEError

from guardfs.accounting import RewritePlan, WriteSession
from guardfs.backing import Backing
from guardfs.decision import Request
from guardfs.gate import Commit, Gate
from guardfs.inodes import Entry
from guardfs.manifest import Limits
from guardfs.signature import MAX_ANALYSED_BYTES

__all__ = ["OpenFile", "WriteSessions", "invalidate_later", "read_small"]

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class OpenFile:
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
    # A write landed in this session. A session that only truncated (truncate, ftruncate,
    # O_TRUNC) or created the file made no content of the agent's: no version of the file.
    wrote: bool = False


def _invalidate(ino: int) -> None:
    try:
        pyfuse3.invalidate_inode(pyfuse3.InodeT(ino))
    except OSError as err:  # the kernel forgot the inode meanwhile: nothing to refresh
        log.debug("invalidate_inode(%d): %s", ino, err)


def invalidate_later(ino: int) -> None:
    """Make the kernel reload *ino*'s attributes and pages, from a thread of its own: not
    from inside a request, where the kernel may wait on it (deadlock)."""
    threading.Thread(target=_invalidate, args=(ino,), daemon=True).start()


def _forget_names(names: list[tuple[int, bytes]]) -> None:
    for parent, name in names:
        try:
            pyfuse3.invalidate_entry(pyfuse3.InodeT(parent), pyfuse3.FileNameT(name))
        except OSError as err:  # not cached (any more): nothing to forget
            log.debug("invalidate_entry(%d, %r): %s", parent, name, err)


def forget_names_again(names: list[tuple[int, bytes]], after: float = 0.5) -> None:
    """Make the kernel forget the (parent inode, name) entries *names* once more, *after*
    seconds, from a thread of its own: a name the kernel looked up while the workspace changed
    behind the mount (a rollback) and cached from the old answer is dropped then too."""
    timer = threading.Timer(after, _forget_names, args=(names,))
    timer.daemon = True
    timer.start()


def read_small(backing: Backing, path: str, st: os.stat_result) -> bytes | None:
    """Content of a file small enough to analyse, else None."""
    if st.st_size > MAX_ANALYSED_BYTES:
        return None
    fd = backing.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, MAX_ANALYSED_BYTES + 1, 0)
    finally:
        os.close(fd)


class WriteSessions:
    """Starts, judges, commits and undoes the write sessions of open files."""

    def __init__(self, gate: Gate, backing: Backing, limits: Limits) -> None:
        self.gate = gate
        self.backing = backing
        self.limits = limits

    def start(self, path: str, st: os.stat_result) -> tuple[WriteSession, tuple[int, int]]:
        """A session of the counted file *path* (with *st*) and its times, taken before
        O_TRUNC takes the pre-image."""
        return WriteSession(path, read_small(self.backing, path, st)), (st.st_atime_ns, st.st_mtime_ns)

    def open_fd(self, path: str, flags: int, session: WriteSession | None) -> int:
        """Open the backing file; a write session also needs to read it back, so a
        write-only open is widened to read-write where the file allows it."""
        if session is not None and flags & os.O_ACCMODE == os.O_WRONLY:
            try:
                return self.backing.open(path, (flags & ~os.O_ACCMODE) | os.O_RDWR)
            except PermissionError:
                session.old = None  # cannot read it back: no content analysis
        return self.backing.open(path, flags)

    def before_write(self, f: OpenFile, off: int, buf: bytes) -> None:
        """Judge a write of *buf* at *off* where it must be, before it lands."""
        if f.refused:
            raise FUSEError(f.refused)
        session = f.session
        if session is not None:
            limit = self.limits.max_rewrites
            first = not f.dirty
            # Content is judged only where a refusal can be undone: with the old content
            # in hand (files too large to analyse are judged at open and first write only).
            content = session.old is not None and (
                f.cut or (limit is not None and self.gate.accounting.hot(session.path, limit))
            )
            if first or content:
                request = Request(
                    "write", session.path, f.entry.where, True,
                    new_files=self.gate.new_files((session.path, f.entry.where)),
                    rewrite=self._preview(f, off, buf) if content else None,
                )
                self._check(f, request)
                if first:
                    self.gate.done(request)
            f.cut = False
        elif not f.dirty:
            self.gate.allowed("write", f.entry.path, f.entry.where)
        f.dirty = f.wrote = True

    def truncated(self, f: OpenFile) -> None:
        """*f* was truncated through its handle (ftruncate): the writes to come complete
        the rewrite."""
        f.dirty = True
        f.cut = f.session is not None

    def end(self, f: OpenFile, final: bool) -> None:
        """Commit the session's rewrite, from its old content to what the file holds now."""
        session = f.session
        if session is None or not f.dirty:
            return
        if f.refused:  # the session's write was refused and undone: nothing to count
            f.dirty = f.cut = f.wrote = False
            return
        if (f.cut or not f.wrote) and not final:
            # Truncated (or created) and not yet written: the writes to come complete this
            # rewrite; the shell's `>` closes a dup before it writes.
            return
        new = self._current(f)
        plan = self.gate.accounting.plan_rewrite(session.path, session.old, new, session.by_git, resized=not f.wrote)
        self.gate.done(Request("rewrite", session.path, f.entry.where, True, rewrite=plan),
                       Commit(rewrite=plan, old=session.old))
        session.old = new  # writes through a dup of this handle start a new session
        f.dirty = f.cut = f.wrote = False
        if f.times is not None:
            st = os.fstat(f.fd)
            f.times = (st.st_atime_ns, st.st_mtime_ns)

    def _check(self, f: OpenFile, request: Request) -> None:
        """Judge a write; a refusal undoes what this session did to the file."""
        try:
            self.gate.check(request)
        except FUSEError as err:
            f.refused = err.errno
            self._undo(f)
            raise

    def _undo(self, f: OpenFile) -> None:
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
        f.dirty = f.cut = f.wrote = False
        invalidate_later(f.entry.ino)

    def _current(self, f: OpenFile) -> bytes | None:
        """The file's content now (read through the open fd), if small enough to analyse."""
        if f.session is None or f.session.old is None:
            return None
        size = os.fstat(f.fd).st_size
        return None if size > MAX_ANALYSED_BYTES else os.pread(f.fd, size + 1, 0)

    def _preview(self, f: OpenFile, off: int, buf: bytes) -> RewritePlan | None:
        """The rewrite this write would complete, judged before it lands."""
        assert f.session is not None
        current = self._current(f)
        if current is None or off + len(buf) > MAX_ANALYSED_BYTES:
            return None
        data = bytearray(current)
        if off > len(data):
            data.extend(b"\0" * (off - len(data)))
        data[off:off + len(buf)] = buf
        return self.gate.accounting.plan_rewrite(f.session.path, f.session.old, bytes(data), f.session.by_git)
