"""The virtual ``.guard/`` directory and its ``STATE.md``, served by guardfs itself.

The agent reads the guard's state at ``.guard/STATE.md``; nothing under ``.guard/`` exists
in the backing directory (a real ``.guard`` there is shadowed) and nothing under it can be
written. It is reachable by name but not listed at the root, so that ``git add -A``, tar
and rsync never pick up the guard's own state.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

import pyfuse3

from guardfs.accounting import WriteAccounting
from guardfs.events import EventLog, md_text
from guardfs.inodes import Entry, InodeTable
from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, Classification

__all__ = ["STATE_NAME", "GuardNode", "default_state"]

#: The one file in ``.guard/``.
STATE_NAME = "STATE.md"

# Inode numbers no backing filesystem hands out (ext4's are 32-bit), and file handles
# above every possible fd.
_VDIR_INO = (1 << 62) + 1
_VFILE_INO = (1 << 62) + 2
_VFH_BASE = 1 << 40


def default_state(manifest: Manifest, accounting: WriteAccounting, events: EventLog) -> str:
    """STATE.md when no breaker renders it: the task, the scope and the counts."""
    m, lim = manifest, manifest.limits
    max_files = "unlimited" if lim.max_files is None else lim.max_files
    files = "".join(f"- {md_text(p)}: {r.rewrites} rewrite(s)\n" for p, r in sorted(accounting.files.items()))
    return (
        f"# guard state\n\n**Task {m.task.id}**: {m.task.goal}\n\n## Scope\n"
        f"- writes allowed in: {', '.join(m.paths.allowed) or 'nowhere (read-only)'}\n"
        f"- secret (no read, no write): {', '.join(m.paths.workspace_secrets) or 'nothing'}\n"
        f"- protected (read-only): {', '.join(m.paths.protected) or 'nothing'}\n\n"
        f"## Budget\n- files mutated: {accounting.distinct} of {max_files}\n"
        f"- denials so far: {events.counts['deny']}\n"
        + (f"\n## Files mutated\n{files}" if files else "")
    )


def _absent() -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = pyfuse3.InodeT(0)
    return attr


class GuardNode:
    """``.guard/`` and ``.guard/STATE.md``: their inodes, attributes, lookups and handles.

    Judging what the agent asks of them (every mutation is refused) is the gate's job;
    this class only serves what may be read.
    """

    def __init__(self, inodes: InodeTable, state_text: Callable[[], str], timeout: float) -> None:
        self.state_text = state_text
        self.timeout = timeout
        self.dir = inodes.add_virtual(_VDIR_INO, GUARD_DIR, True)
        self.file = inodes.add_virtual(_VFILE_INO, f"{GUARD_DIR}/{STATE_NAME}", False)
        self._handles: dict[int, bytes] = {}
        self._next_fh = _VFH_BASE
        self._started_ns = time.time_ns()

    @staticmethod
    def owns(fh: int) -> bool:
        """Whether the file handle *fh* is one of STATE.md's (never a backing fd)."""
        return fh >= _VFH_BASE

    def state_bytes(self) -> bytes:
        """STATE.md as served; a name that is not UTF-8 shows as an escape, never fails the read."""
        return self.state_text().encode("utf-8", "backslashreplace")

    def attr(self, entry: Entry) -> pyfuse3.EntryAttributes:
        """Attributes of ``.guard/`` or of STATE.md (read-only, owned by the guard's user)."""
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.InodeT(entry.ino)
        if entry.is_dir:
            attr.st_mode = pyfuse3.ModeT(stat.S_IFDIR | 0o555)
            attr.st_nlink = 2
            attr.entry_timeout = attr.attr_timeout = self.timeout
        else:
            attr.st_mode = pyfuse3.ModeT(stat.S_IFREG | 0o444)
            attr.st_nlink = 1
            attr.st_size = len(self.state_bytes())
            attr.entry_timeout = attr.attr_timeout = 0  # its size changes with every event
        attr.st_uid, attr.st_gid = os.getuid(), os.getgid()
        attr.st_blksize = 4096
        stamp = self._started_ns if entry.is_dir else time.time_ns()
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = stamp
        return attr

    def lookup(self, parent: Entry, name: str, root: Entry) -> pyfuse3.EntryAttributes:
        """*name* in *parent*, which is ``.guard/`` itself or the root (for ``.guard``)."""
        if parent.ino == pyfuse3.ROOT_INODE or name in (".", ".."):
            return self.attr(self.dir if name != ".." else root)
        if name == STATE_NAME:
            return self.attr(self.file)
        return _absent()

    def open(self) -> pyfuse3.FileInfo:
        """A read handle on STATE.md: one consistent snapshot per open."""
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = self.state_bytes()
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=True)

    def read(self, fh: int, off: int, size: int) -> bytes:
        """Read from an open snapshot."""
        return self._handles[fh][off:off + size]

    def release(self, fh: int) -> None:
        """Drop an open snapshot."""
        del self._handles[fh]

    def listing(self) -> list[tuple[str, os.stat_result | None, Classification]]:
        """What readdir of ``.guard/`` lists: STATE.md, with no backing attributes."""
        return [(STATE_NAME, None, self.file.where)]
