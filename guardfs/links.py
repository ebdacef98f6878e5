"""Forbidden by inode: the files forbidden by name at start, whatever other name they have.

The policy judges names, but a hard link made before the run (``ln .env src/env``) is the
same file under a name no forbidden pattern matches. One walk of the workspace at start
finds every forbidden non-directory with more than one link and records its inode; the
inode table then judges those inodes forbidden under any name (see
:meth:`guardfs.inodes.InodeTable.classify`). A file with one link needs no record: its only
other names can come from ``link(2)`` through the mount, which refuses a forbidden source.

The walk classifies names first and stats only the forbidden ones, so its cost is one
``getdents`` per directory and one pattern match per name.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time

from guardfs.backing import Backing, openat2
from guardfs.policy import Classification, PathPolicy, Scope

__all__ = ["GIT_LINK_KEY", "HARD_LINK_KEY", "forbidden_links"]

log = logging.getLogger(__name__)

#: The rule named when a file is forbidden through another name of it.
HARD_LINK_KEY = "paths.forbidden (a hard link of a forbidden file)"
#: The rule named when a file is another name of a file of a git directory outside the
#: workspace that "hide-git" masks (PathPolicy.masked_git_dirs).
GIT_LINK_KEY = "paths.forbidden_in_git (a hard link of a hidden git directory's file)"

# A directory the walk cannot enter: another filesystem mounted inside the workspace (the
# mount refuses it, EXDEV), or one that vanished or is unreadable (the host changes the
# tree as the guard starts). Nothing of it is served by its name through this walk either.
_SKIPPED = frozenset({errno.EXDEV, errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP})
#: Longest piece of a path opened in one openat2 (PATH_MAX is 4096): a deeper tree, which an
#: agent can leave in a native generated tree, is opened a piece at a time, never refused.
_PIECE = 3072


def _open_dir(root_fd: int, path: str) -> int:
    """Directory *path* beneath *root_fd* ('' is the root itself), opened in pieces shorter than
    PATH_MAX, each beneath the last and never following a symlink."""
    names = path.split("/") if path else ["."]
    fd = root_fd
    while names:
        piece: list[str] = []
        size = 0
        while names and (not piece or size + len(os.fsencode(names[0])) + 1 < _PIECE):
            size += len(os.fsencode(names[0])) + 1
            piece.append(names.pop(0))
        try:
            opened = openat2(fd, "/".join(piece), os.O_RDONLY | os.O_DIRECTORY)
        finally:
            if fd != root_fd:
                os.close(fd)
        fd = opened
    return fd


def forbidden_links(backing: Backing, policy: PathPolicy) -> dict[int, Classification]:
    """Backing inode → verdict, for every forbidden non-directory that has other names.

    The verdict keeps the pattern that forbade the file; its key says it is a hard link.
    Names are not kept: a forbidden name may itself be the secret.
    """
    started = time.monotonic()
    root_dev = os.fstat(backing.root_fd).st_dev
    found: dict[int, Classification] = {}
    walked = 0
    stack = [""]
    while stack:
        top = stack.pop()
        try:
            fd = _open_dir(backing.root_fd, top)
        except OSError as err:
            if err.errno not in _SKIPPED:
                raise
            log.warning("not searched for hard links of forbidden files: %s (%s)",
                        top, os.strerror(err.errno))
            continue
        try:
            with os.scandir(fd) as it:
                for de in it:
                    walked += 1
                    path = f"{top}/{de.name}" if top else de.name
                    is_dir = de.is_dir(follow_symlinks=False)
                    if is_dir:
                        stack.append(path)
                        continue
                    where = policy.classify(path, False)
                    if where.scope is not Scope.FORBIDDEN:
                        continue
                    try:
                        st = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if st.st_nlink > 1 and st.st_dev == root_dev and not stat.S_ISDIR(st.st_mode):
                        found[st.st_ino] = Classification(Scope.FORBIDDEN, HARD_LINK_KEY, where.pattern)
        finally:
            os.close(fd)
    if policy.hide_git:
        found.update(_masked_git_links(policy.masked_git_dirs, root_dev))
    log.info("forbidden by inode: %d hard-linked forbidden file(s) among %d names, %.2f s",
             len(found), walked, time.monotonic() - started)
    return found


def _masked_git_links(git_dirs: tuple[str, ...], dev: int) -> dict[int, Classification]:
    """Inode → verdict for each file with other names, on the workspace's filesystem *dev*,
    of the masked git directories *git_dirs* (a loose object or pack that ``git clone
    --local`` or ``cp -al`` linked into the workspace)."""
    found: dict[int, Classification] = {}
    for top in git_dirs:
        for dirpath, _dirs, filenames in os.walk(top):
            for name in filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if st.st_nlink > 1 and st.st_dev == dev and stat.S_ISREG(st.st_mode):
                    found[st.st_ino] = Classification(Scope.FORBIDDEN, GIT_LINK_KEY, "hide-git")
    return found
