"""The scratch layer: generated output out of scope lands in a directory of the run, not the workspace.

A tool's cache or build output outside ``paths.allowed`` (``.pytest_cache/`` at the root,
``__pycache__/`` beside an out-of-scope module, ``.mypy_cache/``) must never reach the real
workspace: a ``.pyc`` planted there would run later on the host. Refusing it breaks tools
that cannot run without their cache (mypy, ruff). So such a name, when the agent creates it,
becomes a *scratch root*: it and everything below it live in the run's scratch directory,
which the agent sees through the mount and the host never sees in its workspace.

The layer is deliberately narrow, so that it stays sound:

- Only names the agent *creates* become roots (create, mkdir, mknod, symlink, the
  destination of a rename or link from scratch). A root hides a workspace name of the same
  path (the rename of a fresh ``.pyc`` over a stale one); everything below a root is in
  scratch. Nothing else is: there is no copy-up and no merging below a root.
- Generated output that already exists in the workspace shows through, read-only: writing
  it in place, removing or renaming it is refused quietly (EROFS, an event, no trip).
- Moving between the layers (rename, link) is refused with EXDEV, so tools copy instead.
- Scratch inode numbers are offset by :data:`SCRATCH_INO` and carry the workspace's device
  number, so that the inode table keeps one number space for both layers.

:class:`ScratchBacking` is a :class:`~guardfs.backing.Backing` of the workspace that sends
each path below a root to the scratch directory; every other module keeps calling a backing.
The gate asks :meth:`ScratchBacking.admit` about a mutation the policy refuses as generated
output out of scope (``paths.generated``), before anything reaches the disk.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from guardfs.backing import Backing
from guardfs.decision import ALLOW, Request, Verdict
from guardfs.harvest import remove_tree
from guardfs.policy import Scope

__all__ = ["SCRATCH_INO", "ScratchBacking"]

log = logging.getLogger(__name__)

#: Added to a scratch file's inode number (inode numbers of the backing filesystems stay below).
SCRATCH_INO = 1 << 62
# Operations that make a new name at the request's path.
_CREATING = frozenset({"create", "mknod", "mkdir", "symlink"})


class ScratchBacking(Backing):
    """The workspace's backing, with a per-run scratch directory for generated output out of
    scope; see the module's docstring."""

    def __init__(self, root: str, scratch_dir: Path) -> None:
        # A previous run's, left by a guard killed before its close: nothing of it is shown.
        # mkdir then fails on anything still there (a symlink is removed, never followed).
        _remove(scratch_dir)
        scratch_dir.mkdir(mode=0o700, parents=True)
        super().__init__(root)
        self.scratch_dir = scratch_dir
        self.scratch = Backing(os.fspath(scratch_dir))
        self._dev = os.stat(self.root_fd).st_dev
        self.roots: set[str] = set()
        self._children: dict[str, set[str]] = {}  # a directory's path -> names of the roots in it
        self._names: Counter[str] = Counter()  # the roots' last names, with how many roots have each

    # ----- which layer -------------------------------------------------------------

    def in_scratch(self, path: str) -> bool:
        """Whether *path* is a scratch root or below one."""
        if not self.roots or path == "":
            return False
        # Below a root, a path holds that root's last name: most paths hold none, and a few
        # substring searches cost less than slicing every ancestor of the path.
        if not any(name in path for name in self._names):
            return False
        end = path.find("/")
        while end != -1:
            if path[:end] in self.roots:
                return True
            end = path.find("/", end + 1)
        return path in self.roots

    def roots_in(self, directory: str) -> set[str]:
        """Names of the scratch roots directly in workspace directory *directory*."""
        return self._children.get(directory, set())

    def fixed(self, st: os.stat_result) -> os.stat_result:
        """A scratch file's attributes as the mount shows them: its inode number offset, the
        workspace's device."""
        if st.st_ino >= SCRATCH_INO:
            raise OSError(errno.EOVERFLOW, "a scratch inode number beyond the guard's range")
        fields = list(st[:10])
        fields[1] += SCRATCH_INO
        fields[2] = self._dev
        extra = {k: getattr(st, k) for k in ("st_atime", "st_mtime", "st_ctime", "st_atime_ns", "st_mtime_ns",
                                             "st_ctime_ns", "st_blksize", "st_blocks", "st_rdev")}
        return os.stat_result(fields, extra)

    def fstat(self, fd: int, path: str) -> os.stat_result:
        """fstat of *fd*, open on *path*, as the mount shows it."""
        st = os.fstat(fd)
        return self.fixed(st) if self.in_scratch(path) else st

    def stat_at(self, dir_fd: int, name: str, path: str) -> os.stat_result:
        """lstat of *name* in *dir_fd* (the parent of *path*), as the mount shows it."""
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return self.fixed(st) if self.in_scratch(path) else st

    # ----- Backing, path by path ----------------------------------------------------

    def dir_fd(self, path: str) -> int:
        """An O_PATH fd of directory *path* in its layer."""
        return self.scratch.dir_fd(path) if self.in_scratch(path) else super().dir_fd(path)

    def parent(self, path: str) -> tuple[int, str]:
        """(fd of the parent directory in *path*'s layer, final name)."""
        return self.scratch.parent(path) if self.in_scratch(path) else super().parent(path)

    def lstat(self, path: str) -> os.stat_result:
        """lstat of *path* in its layer, as the mount shows it."""
        if self.in_scratch(path):
            return self.fixed(self.scratch.lstat(path))
        return super().lstat(path)

    def walk(self, path: str) -> Iterator[tuple[str, bool]]:
        """Every path below directory *path*, in its layer."""
        return self.scratch.walk(path) if self.in_scratch(path) else super().walk(path)

    def forget_dirs(self) -> None:
        """Drop the cached directory fds of both layers."""
        super().forget_dirs()
        self.scratch.forget_dirs()

    def close(self) -> None:
        """Release every fd, and remove the scratch directory: its output was the run's alone."""
        super().close()
        self.scratch.close()
        _remove(self.scratch_dir)

    # ----- admission ------------------------------------------------------------------

    def admit(self, request: Request, refused: Verdict) -> Verdict:
        """Whether the mutation *request*, which the policy *refused* as generated output out
        of scope, can be done in scratch: ALLOW (a new name made a root first), or *refused*
        (EROFS, quiet) or the same with EXDEV for a move between the layers."""
        src, dst = request.path, request.target
        if dst is None:
            if self.in_scratch(src):
                return ALLOW
            if request.op in _CREATING and self._generated(request.where.scope):
                self._adopt(src)
                return ALLOW
            return refused
        assert request.target_where is not None
        src_scratch, dst_generated = self.in_scratch(src), self._generated(request.target_where.scope)
        if src_scratch and (self.in_scratch(dst) or dst_generated):
            if not self.in_scratch(dst):
                self._adopt(dst)
            return ALLOW
        if not src_scratch and self._generated(request.where.scope):
            return refused  # generated output already in the workspace: read-only
        return Verdict(False, refused.rule, refused.pattern, errno.EXDEV,
                       f"{src} -> {dst}: generated output out of scope lives in the run's scratch layer; "
                       "moving between it and the workspace is refused (EXDEV): copy instead")

    @staticmethod
    def _generated(scope: Scope) -> bool:
        return scope is Scope.GENERATED_OUTSIDE

    def _adopt(self, path: str) -> None:
        """Make *path* a scratch root: its parent directories made in scratch, plainly."""
        head, _, name = path.rpartition("/")
        if head:
            os.makedirs(os.path.join(self.scratch_dir, head), mode=0o755, exist_ok=True)
        if path not in self.roots:
            self.roots.add(path)
            self._names[name] += 1
        self._children.setdefault(head, set()).add(name)
        log.debug("scratch root %s", path)

    def removed(self, path: str) -> None:
        """*path* is gone (unlink, rmdir): a root no more."""
        if path in self.roots:
            self.roots.discard(path)
            head, _, name = path.rpartition("/")
            self._names[name] -= 1
            if not self._names[name]:
                del self._names[name]
            names = self._children.get(head)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._children[head]

    def renamed(self, src: str, dst: str, exchange: bool) -> None:
        """*src* moved to *dst* inside scratch (*dst* became a root when it was admitted)."""
        if not exchange:
            self.removed(src)


def _remove(scratch_dir: Path) -> None:
    """Remove the scratch directory: the agent made all of it (a tree deeper than Python's stack,
    directories of mode 000, symlinks), so guardfs.harvest does, which never raises for what a
    tree holds; what it cannot remove is logged."""
    for problem in remove_tree(scratch_dir):
        log.warning("scratch layer: not removed: %s", problem)
