"""Forbidden by inode: the files forbidden by name at start, whatever other name they have;
and the one walk of the workspace at start that finds them.

The policy judges names, but a hard link made before the run (``ln .env src/env``) is the
same file under a name no forbidden pattern matches. One walk of the workspace at start
finds every forbidden non-directory with more than one link and records its inode; the
inode table then judges those inodes forbidden under any name (see
:meth:`guardfs.inodes.InodeTable.classify`). A file with one link needs no record: its only
other names can come from ``link(2)`` through the mount, which refuses a forbidden source.

The walk classifies names first and stats only the forbidden ones, so its cost is one
``getdents`` per directory and one pattern match per name.

The same walk (:func:`walk_workspace`) gives the check of git's history
(:mod:`guardfs.githistory`) what it needs of the workspace: where each ``.git`` is and which
files are secrets. Each reader keeps its own rules on the one listing of each directory:

- the links: every directory on the workspace's filesystem, ``.git`` ones too, opened from
  the root without a symlink, a piece at a time past PATH_MAX; one it cannot enter
  (another filesystem, gone, unreadable) is said and left, any other error raised;
- git's: every directory but those named ``.git``, other filesystems too, whose path is
  shorter than PATH_MAX (as ``os.scandir`` of its path reads it: git could not be handed a
  longer one either), one it cannot read left without a word.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from guardfs.backing import Backing, openat2
from guardfs.policy import Classification, PathPolicy, Scope

__all__ = ["GIT_LINK_KEY", "HARD_LINK_KEY", "StartWalk", "forbidden_links", "walk_workspace"]

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
#: A path this long or longer is refused by the kernel (ENAMETOOLONG): git's reader stops there.
_PATH_MAX = 4096


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
    return walk_workspace(backing.root, policy, history=False, root_fd=backing.root_fd).links_for(policy)



def forbidden_inodes(root: str | os.PathLike[str], policy: PathPolicy) -> set[int]:
    """The inodes of :func:`forbidden_links` under *root*, for a caller with no walk of its own
    (the planners of lanes and native trees, when no session walked the workspace at start)."""
    backing = Backing(os.fspath(root))
    try:
        return set(forbidden_links(backing, policy))
    finally:
        backing.close()

@dataclass
class StartWalk:
    """What the one walk of the workspace at start found (:func:`walk_workspace`)."""

    #: The workspace, absolute.
    root: str
    #: The policy that judged the names (None: no links looked for).
    policy: PathPolicy | None
    #: Inode → verdict of each forbidden non-directory with other names, by :attr:`policy`.
    links: dict[int, Classification] = field(default_factory=dict)
    #: Each entry named ``.git`` the links' walk met (workspace-relative; whether a directory),
    #: for a policy that hides git decided after the walk (:meth:`links_for`).
    dot_git: list[tuple[str, bool]] = field(default_factory=list)
    #: For git's reader, each ``.git`` in walk order: (the workspace-relative directory holding
    #: it, its absolute path, whether a directory; a directory's gitfile is not listed).
    gits: list[tuple[str, str, bool]] = field(default_factory=list)
    #: For git's reader, the secret non-directories (workspace-relative), ``.git`` not entered.
    secrets: list[str] = field(default_factory=list)
    #: Entries the links' walk looked at, and the workspace's device.
    walked: int = 0
    dev: int = 0

    def links_for(self, policy: PathPolicy) -> dict[int, Classification]:
        """:attr:`links` as *policy* judges them: this walk's policy, or the same rebuilt
        with other git settings once the check of git's history decided them
        (``sandbox.session``: git directories inside the workspace, "hide-git"). Hiding git
        forbids every file of each git directory: those directories are walked again (not
        the workspace); with ``hide_git``, the masked git directories outside it too."""
        if self.policy is None:
            raise ValueError("this walk looked for no links (walk_workspace without a policy)")
        old = self.policy
        if policy is old or (policy.hide_git, policy.git_dirs) == (old.hide_git, old.git_dirs) \
                or not (policy.hide_git or old.hide_git):
            found = dict(self.links)  # the same verdicts: git's settings forbid nothing without hide_git
        else:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if policy.hide_git and not old.hide_git:
                    found = dict(self.links)
                    found.update(self._git_files(fd, policy))
                else:  # never at start: judged again from the top
                    found = walk_workspace(self.root, policy, history=False, root_fd=fd).links
            finally:
                os.close(fd)
        if policy.hide_git:
            found.update(_masked_git_links(policy.masked_git_dirs, self.dev))
        return found

    def _git_files(self, root_fd: int, policy: PathPolicy) -> dict[int, Classification]:
        """What ``hide_git`` adds: each file with other names in a ``.git`` or one of
        *policy*'s git directories, walked by the links' rules; a name inside none of them
        judged as before."""
        verdict = Classification(Scope.FORBIDDEN, HARD_LINK_KEY, "hide-git")
        dev = self.dev
        found: dict[int, Classification] = {}
        tops = sorted({path for path, is_dir in self.dot_git if is_dir} | set(policy.git_dirs))
        tops = [t for t in tops if not any(t.startswith(o + "/") for o in tops)]
        for path, is_dir in self.dot_git:
            if not is_dir:
                st = _lstat(root_fd, path)
                if st is not None and st.st_nlink > 1 and st.st_dev == dev and not stat.S_ISDIR(st.st_mode):
                    found[st.st_ino] = verdict
        stack = list(tops)
        while stack:
            top = stack.pop()
            fd = _enter(root_fd, top, "hard links of files of a hidden git directory")
            if fd is None:
                continue
            try:
                with os.scandir(fd) as it:
                    for de in it:
                        if de.is_dir(follow_symlinks=False):
                            stack.append(f"{top}/{de.name}")
                            continue
                        try:
                            st = de.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if st.st_nlink > 1 and st.st_dev == dev and not stat.S_ISDIR(st.st_mode):
                            found[st.st_ino] = verdict
            finally:
                os.close(fd)
        return found


def _lstat(root_fd: int, path: str) -> os.stat_result | None:
    parent, _, name = path.rpartition("/")
    fd = _enter(root_fd, parent, "hard links of a gitfile")
    if fd is None:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def _enter(root_fd: int, path: str, what: str) -> int | None:
    """Directory *path* opened by the links' rules, or None (said) where it cannot be entered."""
    try:
        return _open_dir(root_fd, path)
    except OSError as err:
        if err.errno not in _SKIPPED:
            raise
        log.warning("not searched for %s: %s (%s)", what, path, os.strerror(err.errno))
        return None


def walk_workspace(root: str | os.PathLike[str], policy: PathPolicy | None = None,
                   is_secret: Callable[[str], bool] | None = None, *, history: bool = True,
                   root_fd: int | None = None) -> StartWalk:
    """The one walk of the workspace *root* at start (see the module's doc): with *policy*,
    the forbidden files with other names; with *history*, the ``.git`` entries and the secret
    files (judged by *is_secret*, by default by *policy*: what it forbids). *root_fd*: the
    workspace already open (O_PATH), else opened here."""
    started = time.monotonic()
    root = os.path.abspath(root)
    out = StartWalk(root, policy, {})
    own_fd = root_fd is None
    fd_root = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if root_fd is None else root_fd
    try:
        _walk(out, fd_root, is_secret, history)
    finally:
        if own_fd:
            os.close(fd_root)
    if policy is not None:
        log.info("forbidden by inode: %d hard-linked forbidden file(s) among %d names, %.2f s",
                 len(out.links), out.walked, time.monotonic() - started)
    return out


def _walk(out: StartWalk, root_fd: int, is_secret: Callable[[str], bool] | None, history: bool) -> None:
    policy, root = out.policy, out.root
    root_dev = out.dev = os.fstat(root_fd).st_dev
    # (workspace-relative directory, the links' reader wants it, git's reader wants it)
    stack: list[tuple[str, bool, bool]] = [("", policy is not None, history)]
    while stack:
        top, links, gits = stack.pop()
        where = os.path.join(root, top) if top else root
        gits = gits and len(os.fsencode(where)) < _PATH_MAX
        listing: list[tuple[str, bool]] | None = None
        forbidden: set[str] = set()
        if links and policy is not None:
            fd = _enter(root_fd, top, "hard links of forbidden files")
            if fd is None:
                links = False
            else:
                listing = []
                try:
                    with os.scandir(fd) as it:
                        for de in it:
                            out.walked += 1
                            is_dir = de.is_dir(follow_symlinks=False)
                            listing.append((de.name, is_dir))
                            path = f"{top}/{de.name}" if top else de.name
                            if de.name == ".git":
                                out.dot_git.append((path, is_dir))
                            if is_dir:
                                continue
                            verdict = policy.classify(path, False)
                            if verdict.scope is not Scope.FORBIDDEN:
                                continue
                            forbidden.add(de.name)
                            try:
                                st = de.stat(follow_symlinks=False)
                            except FileNotFoundError:
                                continue
                            if st.st_nlink > 1 and st.st_dev == root_dev and not stat.S_ISDIR(st.st_mode):
                                out.links[st.st_ino] = Classification(Scope.FORBIDDEN, HARD_LINK_KEY,
                                                                      verdict.pattern)
                finally:
                    os.close(fd)
        if gits and listing is None:  # another filesystem, or one the links do not read
            try:
                with os.scandir(where) as entries:
                    listing = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            except OSError:
                gits = False
        if listing is None:
            continue
        if gits:
            _for_git(out, top, where, listing, forbidden, links and is_secret is None, is_secret)
        children = [(f"{top}/{name}" if top else name, links, gits and name != ".git")
                    for name, is_dir in listing if is_dir]
        stack += [c for c in reversed(children) if c[1] or c[2]]


def _for_git(out: StartWalk, top: str, where: str, listing: list[tuple[str, bool]], forbidden: set[str],
             judged: bool, is_secret: Callable[[str], bool] | None) -> None:
    """What git's reader keeps of directory *top*: its ``.git``, its secret files (*forbidden*
    when the links' reader *judged* them already)."""
    names = {name: is_dir for name, is_dir in listing}
    if names.get(".git") is True:
        out.gits.append((top, os.path.join(where, ".git"), True))
    elif ".git" in names:
        out.gits.append((top, os.path.join(where, ".git"), False))
    for name, is_dir in listing:
        if is_dir:
            continue
        path = f"{top}/{name}" if top else name
        if judged:
            secret = name in forbidden
        elif is_secret is not None:
            secret = is_secret(path)
        elif out.policy is not None:
            secret = out.policy.classify(path, False).scope is Scope.FORBIDDEN
        else:
            continue
        if secret:
            out.secrets.append(path)


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
