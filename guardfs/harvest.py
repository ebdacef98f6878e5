"""Copy what the agent left, safely; remove what it left, safely.

Whatever the agent leaves in a directory the guard reads or removes after the run (guard
exec's stage, the scratch layer, an agent's state directory) is hostile input: a symlink
planted to make the guard copy ``/etc/shadow`` into the run directory, a FIFO that blocks
or crashes a copy, a sparse file of 2 GiB that costs nothing where it is and everything
where it is copied, a directory tree deeper than Python's stack. This module is the one
place that reads such a directory, by these rules:

- everything is resolved from a held directory fd, never a path string resolved again:
  entries are opened with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` and
  ``O_NOFOLLOW | O_NONBLOCK`` (an open never follows a link, never waits on a FIFO);
- only regular files are copied (checked on the open descriptor); anything else (symlink,
  FIFO, socket, device, directory) is named in :attr:`Harvest.skipped` and left out;
- a copy is bounded by the data actually there: only data extents are read
  (``SEEK_DATA``/``SEEK_HOLE``, holes stay holes) and never past the cap; a longer file is
  cut there, said in :attr:`Harvest.truncated`;
- a hard link is a regular file like any other: its bytes are copied within the cap,
  never the link (the copy is a new inode of the guard's own);
- no shape of tree makes these functions raise: :func:`remove_tree` walks iteratively with
  one directory open at a time, never leaves the tree's filesystem, and returns what it
  could not remove instead of raising.

guardfs itself uses it (the scratch layer); ``sandbox`` for guard exec's logs and the agents'
state directories.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from guardfs.backing import openat2
from guardfs.events import printable

__all__ = ["MAX_ENTRIES", "Harvest", "copy_extents", "harvest", "remove_tree", "strip_set_id", "walk"]

#: The most entries of one directory :func:`harvest` looks at; the rest are said, not read.
MAX_ENTRIES = 10_000
_CHUNK = 1 << 20
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW


@dataclass
class Harvest:
    """What :func:`harvest` kept, cut and left out (names escaped, for a summary)."""

    kept: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    blocks: int = 0  # 512-byte blocks the copies use

    def notes(self) -> list[str]:
        """One line per file cut and per entry left out."""
        return [*self.truncated, *self.skipped]


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link (not followed)"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return f"not a regular file (mode {mode:o})"


def harvest(source: str | os.PathLike[str], dest: str | os.PathLike[str], max_file: int,
            max_entries: int = MAX_ENTRIES) -> Harvest:
    """Copy the regular files directly in directory *source* into directory *dest* (made
    mode 0700 if missing; each copy 0600, new: an existing name is left as it is and said),
    each cut at *max_file* bytes; see the module's docstring. *source* that is no directory
    (or a symlink) is said and nothing is read; *source* itself is left as it is."""
    out = Harvest()
    try:
        src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return out
    except OSError as err:
        out.skipped.append(f"{printable(os.fspath(source))}: not read ({err.strerror})")
        return out
    try:
        os.makedirs(dest, mode=0o700, exist_ok=True)
        dst = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _harvest_fd(src, dst, max_file, max_entries, out)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return out


def _harvest_fd(src: int, dst: int, max_file: int, max_entries: int, out: Harvest) -> None:
    with os.scandir(src) as entries:
        for seen, entry in enumerate(entries):
            if seen == max_entries:
                out.skipped.append(f"more than {max_entries} entries: the rest were not looked at")
                return
            shown = printable(entry.name)
            try:
                note = _copy_entry(src, dst, entry.name, max_file, out)
            except OSError as err:
                note = f"not copied ({err.strerror or err})"
            if note is not None:
                out.skipped.append(f"{shown}: {note}")


def _copy_entry(src: int, dst: int, name: str, max_file: int, out: Harvest) -> str | None:
    """Copy regular file *name*; None when copied, else why it was left out."""
    st = os.stat(name, dir_fd=src, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        return _kind(st.st_mode)
    fd = openat2(src, name, _OPEN)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # changed since the lstat (nothing should run by now)
            return _kind(st.st_mode)
        try:
            copy = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=dst)
        except FileExistsError:
            return "not copied: the run directory already holds that name"
        try:
            end = min(st.st_size, max_file)
            copy_extents(fd, copy, end)
            os.ftruncate(copy, end)
            out.blocks += os.fstat(copy).st_blocks
        except BaseException:
            os.close(copy)
            os.unlink(name, dir_fd=dst)
            raise
        os.close(copy)
    finally:
        os.close(fd)
    out.kept.append(printable(name))
    if st.st_size > max_file:
        out.truncated.append(f"{printable(name)}: {st.st_size} bytes, cut to its first {max_file} (the cap)")
    return None


def copy_extents(src: int, dst: int, end: int) -> None:
    """Copy the data extents of *src* below offset *end* to the same offsets of *dst*: holes stay
    holes (a sparse file costs only its data), and nothing past what *src* holds is made up."""
    pos = 0
    while pos < end:
        try:
            data = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:
                return  # a hole up to the end of the file
            if err.errno != errno.EINVAL:
                raise
            data, hole = pos, end  # no SEEK_DATA on this filesystem: all of it is data
        else:
            hole = os.lseek(src, data, os.SEEK_HOLE)
        stop = min(hole, end)
        if not _copy_range(src, dst, data, stop):
            return  # shorter than it said
        pos = stop


#: copy_file_range cannot serve here (another filesystem, an old kernel...): bytes are copied.
_NO_RANGE = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM})


def _copy_range(src: int, dst: int, offset: int, end: int) -> bool:
    """Copy the bytes of *src* from *offset* to *end* to the same offsets of *dst*; False when
    *src* ended sooner."""
    try:
        while offset < end:
            done = os.copy_file_range(src, dst, min(end - offset, 1 << 30), offset, offset)
            if done == 0:
                return False
            offset += done
        return True
    except OSError as err:
        if err.errno not in _NO_RANGE:
            raise
    while offset < end:
        chunk = os.pread(src, min(end - offset, _CHUNK), offset)
        if not chunk:
            return False
        view = memoryview(chunk)
        while view:
            written = os.pwrite(dst, view, offset)
            view = view[written:]
            offset += written
    return True


def walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` (top down, *dirnames* prunable, no link followed, unreadable directories
    skipped) without its recursion: a tree an agent left deeper than Python's stack (1,000
    levels) raised RecursionError at the next run's start."""
    stack = [top]
    while stack:
        dirpath = stack.pop()
        try:
            with os.scandir(dirpath) as entries:
                listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        except OSError:
            continue  # gone, unreadable, or past PATH_MAX: bubblewrap could bind nothing there either
        dirnames = [name for name, is_dir in listed if is_dir]
        yield dirpath, dirnames, [name for name, is_dir in listed if not is_dir]
        stack += [os.path.join(dirpath, name) for name in reversed(dirnames)]


def remove_tree(path: str | os.PathLike[str]) -> list[str]:
    """Remove *path* and everything below it, never following a symlink nor leaving its
    filesystem; returns what could not be removed (escaped, with why), never raises for
    what the tree holds. A directory its owner may not list or change is made so first (an
    agent's ``chmod 000``). Iterative, one directory open at a time (plus the names on the
    way down): any depth, any fd limit."""
    def unlink(fd: int, name: str, _st: os.stat_result, _shown: str) -> None:
        os.unlink(name, dir_fd=fd)

    def rmdir(fd: int, name: str) -> None:
        os.rmdir(name, dir_fd=fd)

    try:
        top_st = os.lstat(path)
        if not stat.S_ISDIR(top_st.st_mode):
            os.unlink(path)
            return []
    except FileNotFoundError:
        return []
    except OSError as err:
        return [f"{printable(os.fspath(path))}: {err.strerror}"]
    problems: list[str] = []
    try:
        _traverse(_open_dir(None, os.fspath(path), top_st, True), os.fspath(path), problems, unlink, rmdir,
                  fix_modes=True)
        os.rmdir(path)
    except OSError as err:
        problems.append(f"{printable(os.fspath(path))}: {err.strerror or err}")
    return problems


def strip_set_id(root: str | os.PathLike[str], tree: str) -> tuple[list[str], list[str]]:
    """Clear set-user-ID and set-group-ID of every regular file below directory *tree* of
    *root* (reached without a symlink; never through one below, never leaving its filesystem;
    directories keep theirs: group inheritance); (the files changed, relative to *root*; what
    could not be looked at). Walked as :func:`remove_tree` walks: any depth, any path length."""
    changed: list[str] = []

    def strip(fd: int, name: str, st: os.stat_result, shown: str) -> None:
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            return
        file = openat2(fd, name, _OPEN)
        try:
            now = os.fstat(file)
            if stat.S_ISREG(now.st_mode):
                os.fchmod(file, stat.S_IMODE(now.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                changed.append(f"{tree}/{shown}")
        finally:
            os.close(file)

    problems: list[str] = []
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = openat2(root_fd, tree, os.O_RDONLY | os.O_DIRECTORY)
        finally:
            os.close(root_fd)
        _traverse(fd, tree, problems, strip, None, fix_modes=False, relative=True)
    except FileNotFoundError:
        pass
    except OSError as err:
        problems.append(f"{printable(tree)}: {err.strerror or err}")
    return changed, problems


def _open_dir(parent: int | None, name: str, expect: os.stat_result, fix_modes: bool) -> int:
    """An fd of directory *name* in *parent* (a path when None), never through a symlink;
    with *fix_modes*, one its owner (the guard) may list and change (an agent's ``chmod 000``
    undone); *expect* is its lstat, checked on the fd."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except PermissionError:
        if not fix_modes or expect.st_uid != os.geteuid():
            raise
        # lstat said a directory, and nothing of the agent runs any more: no link to follow here.
        os.chmod(name, 0o700, dir_fd=parent)
        fd = os.open(name, flags, dir_fd=parent)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
        os.close(fd)
        raise OSError(errno.ESTALE, "changed while it was being walked")
    if fix_modes and st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _traverse(fd: int, top: str, problems: list[str],
              on_entry: Callable[[int, str, os.stat_result, str], None],
              on_leave: Callable[[int, str], None] | None, fix_modes: bool, relative: bool = False) -> None:
    """Walk the directory open at *fd* (*top*, for messages), depth first, each name looked at
    once: *on_entry* (parent fd, name, lstat, the path shown: relative to *top* with *relative*)
    for each entry that is no directory, *on_leave* (parent fd, name) for each directory below
    *top* once its entries were seen. An OSError of either goes to *problems* and the walk goes
    on. Closes *fd*."""
    base = "" if relative else top
    # The way down: per level, the directory's name in its parent, the parent's device and
    # inode (checked on the way up) and the parent's names still to look at.
    way: list[tuple[str, int, int, list[str]]] = []
    try:
        top_st = os.fstat(fd)
        pending = os.listdir(fd)
        while True:
            if pending:
                name = pending.pop()
                child = _look(fd, name, top_st, way, base, relative, problems, on_entry, fix_modes)
                if child is None:
                    continue
                here = os.fstat(fd)
                way.append((name, here.st_dev, here.st_ino, pending))
                os.close(fd)
                fd = child
                try:
                    pending = os.listdir(fd)
                except OSError as err:
                    problems.append(f"{printable(_where(base, way, ''))}: {err.strerror or err}")
                    pending = []
                continue
            if not way:
                return
            # This directory's entries are all seen: up to its parent (checked: the same one).
            name, dev, ino, pending = way.pop()
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = up
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise OSError(errno.ESTALE, "the tree moved while it was being walked")
            if on_leave is not None:
                try:
                    on_leave(fd, name)
                except FileNotFoundError:
                    pass
                except OSError as err:
                    problems.append(f"{printable(_where(base, way, name))}: {err.strerror or err}")
    finally:
        os.close(fd)


def _look(fd: int, name: str, top_st: os.stat_result, way: list[tuple[str, int, int, list[str]]], base: str,
          relative: bool, problems: list[str], on_entry: Callable[[int, str, os.stat_result, str], None],
          fix_modes: bool) -> int | None:
    """One entry of :func:`_traverse`'s walk: *on_entry* for what is no directory, else the
    directory opened (its fd, to go down into), or None (said in *problems* if need be)."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            on_entry(fd, name, st, _where(base, way, name, relative))
            return None
        if st.st_dev != top_st.st_dev:
            problems.append(f"{printable(_where(base, way, name))}: another filesystem is mounted there")
            return None
        return _open_dir(fd, name, st, fix_modes)
    except FileNotFoundError:
        return None
    except OSError as err:
        problems.append(f"{printable(_where(base, way, name))}: {err.strerror or err}")
        return None


def _where(top: str, way: list[tuple[str, int, int, list[str]]], name: str, whole: bool = False) -> str:
    """The path of *name* below *top* (empty: relative) for a message, shortened past a few
    levels unless *whole*."""
    names = [n for n, _, _, _ in way]
    if len(names) > 4 and not whole:
        names = [*names[:2], f"... {len(names) - 4} levels ...", *names[-2:]]
    return os.path.join(top, *names, name).rstrip("/")
