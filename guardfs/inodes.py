"""The inode table: FUSE inode numbers, their paths, lookup counts and cached verdicts.

FUSE inode numbers are the backing filesystem's own, with the root swapped to
``pyfuse3.ROOT_INODE``, so hard links share one entry and tools that compare ``st_ino``
(git, find) see stable numbers. A file's entry keeps every name it is known by (its hard
links), so that removing or replacing one name leaves the others working. An entry lives
while the kernel holds a lookup on it (or a file handle is open) and is dropped when both
reach zero.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import pyfuse3

from guardfs.policy import Classification, PathPolicy, Scope

__all__ = ["Entry", "InodeTable"]

# Most restrictive first: when one inode is reached by several names (hard links), the
# strictest verdict sticks to it.
_STRICTNESS = {
    Scope.FORBIDDEN: 0,
    Scope.PROTECTED: 1,
    Scope.GIT_CONFIG: 2,
    Scope.GIT_ANCHOR: 3,
    Scope.GIT_GUARDED: 4,
    Scope.OUT_OF_SCOPE: 5,
    Scope.GENERATED_OUTSIDE: 6,
    Scope.GIT_INTERNAL: 7,
    # Counted before uncounted: a file linked into generated output still counts as source.
    Scope.ALLOWED: 8,
    Scope.GENERATED: 9,
}


@dataclass(slots=True, eq=False)
class Entry:
    """One inode the kernel knows about."""

    ino: int
    backing_ino: int
    path: str
    is_dir: bool
    where: Classification
    lookups: int = 0
    handles: set[int] = field(default_factory=set)  # open file fds on this inode
    virtual: bool = False  # served by guardfs itself (.guard/), never forgotten
    # The file's other known names (hard links); `path` is the one most recently learnt.
    aliases: set[str] = field(default_factory=set)
    # Its last name is gone (unlinked or replaced). The backing filesystem may then give its
    # inode number to a new file, which must not inherit this file's verdict.
    nameless: bool = False
    # An O_PATH fd the guard holds on the backing inode from just before the mount took its
    # last name while the kernel still held it (a regular file), so that the requests the
    # kernel still sends for it (a path walk that found it before a rename over it) are
    # served from it, as a local filesystem keeps an unlinked inode alive. None otherwise;
    # closed by whoever drops the entry (the table does no I/O).
    pin: int | None = None

    def rebase(self, old: str, new: str) -> None:
        """Names at or below *old* now live below *new* (a directory moved)."""
        self.path = _rebased(self.path, old, new)
        if self.aliases:
            self.aliases = {_rebased(a, old, new) for a in self.aliases}


def _rebased(path: str, old: str, new: str) -> str:
    if path == old or path.startswith(old + "/"):
        return new + path[len(old):]
    return path


class InodeTable:
    """Maps FUSE inodes to entries; pure bookkeeping, no I/O.

    *linked* holds the backing inodes forbidden whatever their name (the hard links of
    forbidden files found at start, see :mod:`guardfs.links`): every verdict this table
    gives or caches for one of them is that, never the name's.
    """

    def __init__(
        self, policy: PathPolicy, root_backing_ino: int, linked: Mapping[int, Classification] | None = None
    ) -> None:
        self.policy = policy
        self._root_bino = root_backing_ino
        self._linked: Mapping[int, Classification] = linked or {}
        root = Entry(pyfuse3.ROOT_INODE, root_backing_ino, "", True, policy.classify("", True), 1)
        self._entries: dict[int, Entry] = {root.ino: root}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def fuse_ino(self, backing_ino: int) -> int:
        """The FUSE inode number for a backing inode number (root swapped with 1)."""
        if backing_ino == self._root_bino:
            return pyfuse3.ROOT_INODE
        if backing_ino == pyfuse3.ROOT_INODE:
            return self._root_bino
        return backing_ino

    def get(self, ino: int) -> Entry | None:
        """The entry for *ino*, if the kernel still holds it."""
        return self._entries.get(ino)

    def classify(self, st_ino: int, is_dir: bool, path: str) -> Classification:
        """The verdict for *path*: the cached one when the inode is known under that path."""
        entry = self._entries.get(self.fuse_ino(st_ino))
        if entry is not None and entry.path == path and not entry.nameless:
            return entry.where
        return self._judge(st_ino, path, is_dir)

    def _judge(self, st_ino: int, path: str, is_dir: bool) -> Classification:
        """The policy's verdict on *path*, unless the inode is forbidden under any name."""
        if not is_dir:
            by_inode = self._linked.get(st_ino)
            if by_inode is not None:
                return by_inode
        return self.policy.classify(path, is_dir)

    def remember(
        self, st_ino: int, st_mode: int, path: str, where: Classification | None = None
    ) -> Entry:
        """Record that the kernel now holds one more reference to the inode at *path*."""
        ino = self.fuse_ino(st_ino)
        entry = self._entries.get(ino)
        is_dir = stat.S_ISDIR(st_mode)
        if not is_dir and st_ino in self._linked:
            where = self._linked[st_ino]  # whatever verdict the caller's name got
        if entry is None:
            entry = Entry(ino, st_ino, path, is_dir, where or self._judge(st_ino, path, is_dir))
            self._entries[ino] = entry
        elif entry.nameless and not entry.handles and entry.pin is None:
            # A new file under a reused inode number: a fresh entry, the kernel's count kept.
            # (A pinned inode is alive: its number cannot have been given to another file.)
            entry.path, entry.is_dir, entry.nameless = path, is_dir, False
            entry.where = where or self.policy.classify(path, is_dir)
            entry.aliases.clear()
        elif entry.path != path:
            where = where or self._judge(st_ino, path, is_dir)
            if entry.nameless:
                # Alive (pinned or open) and found again under a name the mount had not seen (a
                # hard link made on the host): named again; the name it lost stays lost.
                entry.where, entry.nameless = where, False
            else:
                if is_dir or _STRICTNESS[where.scope] <= _STRICTNESS[entry.where.scope]:
                    entry.where = where
                if not is_dir:  # another hard link: the old name stays valid
                    entry.aliases.add(entry.path)
            entry.aliases.discard(path)
            entry.path = path
        entry.lookups += 1
        return entry

    def add_virtual(self, ino: int, path: str, is_dir: bool) -> Entry:
        """A permanent entry that guardfs serves itself."""
        entry = Entry(ino, 0, path, is_dir, self.policy.classify(path, is_dir), 1, virtual=True)
        self._entries[ino] = entry
        return entry

    def forget(self, ino: int, n: int) -> Entry | None:
        """The kernel dropped *n* references to *ino*; the entry if that dropped it (its pin
        is the caller's to close)."""
        entry = self._entries.get(ino)
        if entry is None or ino == pyfuse3.ROOT_INODE or entry.virtual:
            return None
        entry.lookups -= n
        return self._drop_if_unused(entry)

    def _drop_if_unused(self, entry: Entry) -> Entry | None:
        if entry.lookups <= 0 and not entry.handles:
            del self._entries[entry.ino]
            return entry
        return None

    def release_handle(self, entry: Entry, fd: int) -> Entry | None:
        """A file handle on *entry* was closed; the entry if that dropped it."""
        entry.handles.discard(fd)
        if entry.ino in self._entries:
            return self._drop_if_unused(entry)
        return None

    def unlinked(self, entry: Entry, path: str) -> None:
        """The name *path* of *entry* is gone (unlinked, or replaced by a rename)."""
        if entry.path == path:
            if not entry.aliases:
                entry.nameless = True  # the entry lives on only through open handles
                return
            entry.path = min(entry.aliases)
        entry.aliases.discard(path)

    def moved(self, entry: Entry | None, old: str, new: str) -> None:
        """The object at *old* (entry, if known) now lives at *new*; reclassify what moved.

        A directory drags every known path below it along.
        """
        if entry is not None and not entry.is_dir:
            entry.aliases.discard(old)
            if entry.path != old:
                entry.aliases.add(entry.path)
            entry.aliases.discard(new)
            entry.path, entry.nameless = new, False
            entry.where = self._judge(entry.backing_ino, new, False)
            return
        prefix = old + "/"
        for e in self._entries.values():
            if e.virtual:
                continue
            if e.path == old or e.path.startswith(prefix) or any(
                a.startswith(prefix) for a in e.aliases
            ):
                e.rebase(old, new)
                e.where = self._judge(e.backing_ino, e.path, e.is_dir)

    def exchanged(self, a: str, b: str) -> None:
        """RENAME_EXCHANGE swapped whatever lived at *a* and *b*."""
        swap = "\0"  # no name holds NUL: a parking place while the two trade places
        for old, new in ((a, swap), (b, a), (swap, b)):
            for e in self._entries.values():
                if not e.virtual and (e.path == old or e.path.startswith(old + "/") or any(
                    x == old or x.startswith(old + "/") for x in e.aliases
                )):
                    e.rebase(old, new)
        for e in self._entries.values():
            if not e.virtual and (e.path in (a, b) or e.path.startswith((a + "/", b + "/"))):
                e.where = self._judge(e.backing_ino, e.path, e.is_dir)
