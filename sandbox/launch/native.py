"""Native generated trees: in-scope build and install directories the agent writes natively.

A literal directory of ``[paths] generated`` (``.venv/``, ``node_modules/``, ``target/``,
``build/``) that lies inside ``paths.allowed`` and exists when ``guard run`` starts is bound
from the real workspace, *writable*, over its place in the mounted workspace, inside the
sandbox only; every forbidden path inside it is masked with an empty, unreadable stand-in
(as in a fast lane, :mod:`sandbox.launch.lanes`). Landlock already allows writes beneath the
workspace's path, and the bind lies beneath it. Writing there through FUSE would buy no
guarantee these trees need: generated writes never count, are not checkpointed and never
trip; what the mount would still judge there is only the forbidden patterns.

What a native tree keeps: it is the real directory inside the allowed paths, so whatever
lands there is what would have landed through the mount; forbidden paths that exist at the
start are masked (neither readable nor replaceable: a mount point cannot be renamed over or
removed). What it gives up: the guard never hears of these operations (no events, no
accounting, no rollback, which generated paths do not get anyway), and a forbidden name
*created* there during the run (by the agent, or by the host) is not judged. A mount point
cannot be removed, so ``rm -rf .venv`` empties the tree and then fails on the directory
itself (EBUSY); ``python -m venv --clear .venv`` empties it in place and works (but for a
masked path, which stays). The mount refuses what the kernel would refuse natively: moving or
linking anything across a tree's edge (EXDEV: ``mv`` copies), moving the tree or a directory
above it (EBUSY) (:meth:`MidRunRules.crossing`). Set-user-ID and set-group-ID, which the mount
never lets a chmod set, are taken off the trees' files when the agent has ended
(:func:`strip_set_id`).

A generated directory that does not exist at the start is created through the mount; a root
guard then binds it into the running sandbox, by the same rules (:class:`MidRunRules`,
:mod:`sandbox.launch.inject`). An unprivileged one leaves it to the mount (written through
FUSE, uncounted) and binds it from the next run on. A generated directory made *out of*
scope during the run is a root of the run's scratch layer (:mod:`guardfs.scratch`): a root
guard binds that scratch directory (never the workspace's path) the same way, so that the
agent writes its caches natively and the host still never sees them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from guardfs import harvest
from guardfs.decision import Verdict
from guardfs.harvest import walk
from guardfs.links import forbidden_inodes
from guardfs.manifest import Manifest
from guardfs.policy import GENERATED_RULE, GUARD_DIR, PathPolicy, Scope
from sandbox.launch.lanes import StagedTrees

log = logging.getLogger(__name__)

__all__ = ["MAX_MASKS", "MAX_SCAN", "MAX_TREES", "SCRATCH_LEFT", "MidRunRules", "NativeStage", "NativeTrees",
           "bind_writable", "plan_native", "strip_set_id"]

#: More forbidden paths than this inside one tree and it stays behind the mount (each mask is a mount).
MAX_MASKS = 500
#: Trees bound at most (each is a mount; a default list naming '__pycache__/' may find many).
MAX_TREES = 64
#: In-scope directories looked at, at most, to find where an unanchored name ('.venv/') lies.
MAX_SCAN = 2000
#: How deep below the root an unanchored name is looked for.
MAX_DEPTH = 4
#: Generated names left to the mount when made in the scratch layer: Python writes one
#: __pycache__/ per package it imports (hundreds in a test run), each holding a few .pyc written
#: once; a bind per package is a mount each, counted against MAX_TREES, and would cost more
#: (a helper process per bind) than the few writes it saves.
SCRATCH_LEFT = frozenset({"__pycache__"})
_GLOB = "*?[\\"
_MS_BIND = 4096
# A probe deep inside a candidate: the whole tree must be in scope, not only its top.
_DEEP = "zq7x9/yk3w2.k3w"


@dataclass
class NativeTrees:
    """Which generated directories go native (writable), what is masked inside, what was left out."""

    trees: list[str] = field(default_factory=list)
    masked_files: list[str] = field(default_factory=list)
    masked_dirs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # anchored names not there at the start


def _literal(patterns: list[str]) -> tuple[set[str], set[str]]:
    """The literal directory patterns of *patterns*: (anchored paths, names matched at any depth)."""
    anchored, names = set(), set()
    for pattern in patterns:
        if pattern.startswith("!") or any(c in pattern for c in _GLOB):
            continue  # a negation narrows; a glob names no one directory
        body = pattern.strip("/")
        if pattern.startswith("/") or "/" in body:
            anchored.add(body)
        else:
            names.add(body)
    return anchored, names


class _Planner:
    def __init__(self, manifest: Manifest, root: Path, policy: PathPolicy | None = None) -> None:
        self.root = root
        self.dev = root.stat().st_dev
        self.policy = policy if policy is not None else PathPolicy(manifest)
        self.allowed = pathspec.GitIgnoreSpec.from_lines(manifest.paths.allowed)
        self.out = NativeTrees()

    def in_scope(self, path: str) -> bool:
        """Whether the directory *path* and everything below it is inside paths.allowed."""
        return self.allowed.match_file(path + "/") and self.allowed.match_file(f"{path}/{_DEEP}")

    def judge(self, path: str) -> bool:
        """Whether the existing directory *path* can be bound; says why not in ``skipped``."""
        parts = path.split("/")
        if ".git" in parts or parts[0] == GUARD_DIR:
            self.out.skipped.append(f"{path}: inside a repository's .git/ or the guard's own files")
        elif (link := _symlinked_parent(self.root, path)) is not None:
            self.out.skipped.append(f"{path}: {link} is a symlink; it stays behind the mount")
        elif (self.root / path).lstat().st_dev != self.dev:
            self.out.skipped.append(f"{path}: another filesystem is mounted there")
        elif (scope := self.policy.classify(path, True).scope) is Scope.FORBIDDEN:
            self.out.skipped.append(f"{path}: forbidden as a whole; it stays behind the mount")
        elif scope is Scope.GENERATED_OUTSIDE:
            pass  # Python bytecode: in the run's scratch layer even in scope (guardfs.policy)
        else:
            return self.in_scope(path)  # out of scope: the generated rules (and fast lanes) apply, not this
        return False

    def find(self, names: set[str]) -> list[str]:
        """In-scope directories named one of *names*, looked for breadth-first through
        directories that are in scope or lead to one, at most MAX_DEPTH deep and MAX_SCAN in all."""
        found: list[str] = []
        queue, seen = [""], 0
        while queue and seen < MAX_SCAN:
            rel = queue.pop(0)
            seen += 1
            try:
                with os.scandir(self.root / rel if rel else self.root) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                path = f"{rel}/{entry.name}" if rel else entry.name
                if entry.name in (".git", GUARD_DIR) or not entry.is_dir(follow_symlinks=False):
                    continue
                if entry.name in names and self.in_scope(path):
                    found.append(path)  # not descended: the bind covers it
                elif path.count("/") + 1 < MAX_DEPTH and self._leads_in(path):
                    queue.append(path)
        if queue:
            self.out.skipped.append(f"looked at {MAX_SCAN} directories for {', '.join(sorted(names))}; "
                                    "deeper ones stay behind the mount")
        return found

    def _leads_in(self, path: str) -> bool:
        """Whether anything below directory *path* may be in scope (it is, or an allowed
        pattern could match beneath it)."""
        if self.in_scope(path) or self.allowed.match_file(path + "/"):
            return True
        return any(not p.startswith("!") and _could_be_under(p, path) for p in self.allowed_patterns)

    @property
    def allowed_patterns(self) -> list[str]:
        return list(self.policy.manifest.paths.allowed)


def _could_be_under(pattern: str, path: str) -> bool:
    """Whether gitignore *pattern* may match something below directory *path*."""
    body = pattern.strip("/")
    if not pattern.startswith("/") and "/" not in body:
        return True  # matches at any depth
    head = body.split("/")
    for i, part in enumerate(path.split("/")):
        if i >= len(head):
            return True
        if head[i] == "**":
            return True
        if any(c in head[i] for c in _GLOB):
            continue  # a glob component may match this one
        if head[i] != part:
            return False
    return True


def plan_native(manifest: Manifest, workspace: Path, max_masks: int = MAX_MASKS,
                policy: PathPolicy | None = None, links: Collection[int] | None = None) -> NativeTrees:
    """The native generated trees of *workspace* under *manifest*, with their masks; *policy* is
    the mount's (``hide-git`` included: a git directory inside a tree, and a hard link of one of
    its files, are masked as the mount hides them). *links*: the inodes of the forbidden files
    with other names the session's walk at start found under that policy (default: walk here)."""
    root = workspace.resolve()
    planner = _Planner(manifest, root, policy)
    out = planner.out
    anchored, names = _literal(list(getattr(manifest.paths, "generated", [])))
    candidates: list[str] = []
    for path in sorted(anchored):
        try:
            st = (root / path).lstat()
        except (FileNotFoundError, NotADirectoryError):
            if planner.in_scope(path):
                out.absent.append(path)
            continue
        if stat.S_ISDIR(st.st_mode) and planner.judge(path):
            candidates.append(path)
    if names:
        candidates += [p for p in planner.find(names) if planner.judge(p)]
    # Another name of a file forbidden by name (a hard link made before the run) is forbidden
    # too (guardfs.links): the mount judges it by inode, a bind would show it.
    inodes = (set(links) if links is not None else forbidden_inodes(root, planner.policy)) if candidates else set()
    for tree in sorted(set(candidates)):
        if any(tree.startswith(c + "/") for c in candidates):
            continue  # inside another native tree
        files, dirs = _masks(root, tree, manifest, max_masks, inodes, hide_git=planner.policy.hide_git)
        if files is None or dirs is None:
            out.skipped.append(f"{tree}: more than {max_masks} forbidden paths inside; it stays behind the mount")
            continue
        if len(out.trees) == MAX_TREES:
            out.skipped.append(f"{tree}: more than {MAX_TREES} generated trees; it and the rest stay behind the mount")
            break
        out.trees.append(tree)
        out.masked_files += files
        out.masked_dirs += dirs
    return out


class MidRunRules:
    """plan_native's judgement for a directory made during the run (sandbox.launch.inject):
    a literal generated name (an unanchored one at most MAX_DEPTH deep), the whole tree in
    scope, not in .git or the guard's files, not forbidden, no symlinked parent, no other
    filesystem, MAX_TREES in all with the start's (*planned*), none inside another.

    No forbidden path can be inside a directory the mount has just made (the mount refuses
    to create one, and refuses a hard link of a forbidden file by inode); one the host put
    there before the bind keeps the tree behind the mount. As at the start, a forbidden name
    *created* in the tree once it is bound is not judged (see the module's docstring).

    Nothing reaches a tree through the mount but what is made in it: from the moment it is
    a candidate (:meth:`pin`), a rename or hard link through the mount across its edge, or of
    it or a directory above it, is refused (:meth:`crossing`). Otherwise a directory holding
    another name of a forbidden file (judged by path when it moves) would be read natively,
    and a counted file linked in, or a directory moved out under a process standing in it,
    written natively: uncounted, unseen, not rolled back. The mount is still reachable by a
    descriptor of the tree opened before the bind; natively, the kernel refuses these moves
    itself (EXDEV, EBUSY). At most MAX_TREES candidates are judged during a run (each may
    cost a helper process): the agent cannot make the guard fork without end.

    A new root of the scratch layer (*scratch*, the run's RUN_DIR/scratch) is judged by
    :meth:`scratch_refusal` instead: everything below a root lives in scratch, so there is
    no scope to check, and the bind's source is the scratch directory."""

    def __init__(self, manifest: Manifest, workspace: Path, planned: list[str], scratch: Path | None = None) -> None:
        self.root = workspace.resolve()
        self.scratch = scratch
        self.manifest = manifest
        self.anchored, self.names = _literal(list(getattr(manifest.paths, "generated", [])))
        self.trees = list(planned)  # bound, at the start or since
        self.scratch_trees: list[str] = []  # those of them bound from the scratch layer, ever
        self.released: set[str] = set()  # unbound when emptied, not yet removed by the mount (release)
        self._seen = set(planned)  # every candidate queued: judged once; none looked for below one
        self._judged = 0  # candidates judged during the run: MAX_TREES at most
        self.pinned = set(planned)  # bound or about to be: nothing moves across their edges
        self._planner: _Planner | None = None  # built on the first candidate, off the FUSE loop's way

    @property
    def full(self) -> bool:
        """Whether no more candidates are judged in this run (MAX_TREES were)."""
        return self._judged >= MAX_TREES

    def candidate(self, path: str, scratch: bool = False) -> bool:
        """Whether *path* (a new root of the scratch layer with *scratch*) names a native tree
        not seen before (cheap: called in the FUSE loop)."""
        name = path.rpartition("/")[2]
        if path not in self.anchored and (name not in self.names or path.count("/") >= MAX_DEPTH):
            return False
        if scratch and (self.scratch is None or name in SCRATCH_LEFT):
            return False
        if path in self._seen or any(path.startswith(seen + "/") for seen in self._seen) or self.full:
            return False
        self._seen.add(path)
        self._judged += 1
        return True

    def pin(self, path: str) -> None:
        """*path* may be bound from now on: refuse moves across its edge (:meth:`crossing`)."""
        self.pinned.add(path)

    def unpin(self, path: str) -> None:
        """*path* will not be bound (judged not a native tree, or gone, before any bind)."""
        self.pinned.discard(path)

    def forget(self, path: str) -> None:
        """The candidate *path* was removed before its bind: a directory made there again is a
        new candidate."""
        self.unpin(path)
        self._seen.discard(path)

    def release(self, path: str) -> None:
        """The bound tree *path* was emptied and unbound (the agent removes it, or seems to:
        the removal's path is only a hint): behind the mount again. Until the mount removes
        the directory (:meth:`removed`) it stays pinned and is swept for set-ID at the end: a
        descriptor opened through the bind still reaches it natively, and a file written
        natively just before the unbind may be in it."""
        self.trees.remove(path)
        self.released.add(path)

    def removed(self, path: str) -> None:
        """The mount removed directory *path*: a released tree is gone for good, and a
        directory made there again is a new candidate. Cheap: called in the FUSE loop."""
        if path in self.released:
            self.released.discard(path)
            self.forget(path)

    def native_trees(self) -> list[str]:
        """Every tree written natively in this run that may still be there: bound, or released
        and not removed."""
        return [*self.trees, *sorted(self.released)]  # disjoint: a tree is bound again only once removed

    def crossing(self, src: str, dst: str) -> Verdict | None:
        """The refusal of a rename or hard link through the mount from *src* to *dst* that
        would move something across a pinned tree's edge (EXDEV, as natively), or move the
        tree or a directory above it (EBUSY: a mount point and the path to it stay put);
        None when it touches no pinned tree. Cheap: called in the FUSE loop."""
        for tree in self.pinned:
            for end in (src, dst):
                if end == tree or tree.startswith(end + "/"):
                    return Verdict(False, GENERATED_RULE, tree, errno.EBUSY,
                                   f"{src} -> {dst}: {end} is or holds {tree}, a generated tree bound natively "
                                   "in the sandbox; it stays where it is")
            inside = tree + "/"
            if src.startswith(inside) != dst.startswith(inside):
                return Verdict(False, GENERATED_RULE, tree, errno.EXDEV,
                               f"{src} -> {dst}: {tree} is a generated tree bound natively in the sandbox; "
                               "moving or linking across its edge is refused (EXDEV): copy instead")
        return None

    def refusal(self, path: str) -> str | None:
        """Why the directory *path*, now in the real workspace, may not be bound ('' when it
        is simply not a native tree), or None when it may. Reads the real disk (a thread)."""
        if len(self.trees) >= MAX_TREES:
            return f"{path}: more than {MAX_TREES} generated trees; it stays behind the mount"
        if self._planner is None:
            self._planner = _Planner(self.manifest, self.root)
        said = len(self._planner.out.skipped)
        try:
            if not self._planner.judge(path):
                return "; ".join(self._planner.out.skipped[said:])
        except OSError as err:  # removed since
            return f"{path}: {err.strerror}"
        if _masks(self.root, path, self.manifest, 0) == (None, None):
            return f"{path}: forbidden paths are already inside; it stays behind the mount"
        return None

    def scratch_refusal(self, path: str) -> str | None:
        """Why the scratch root *path* (RUN_DIR/scratch/*path*) may not be bound, or None when
        it may. Reads the disk (a thread)."""
        assert self.scratch is not None  # candidate() admits no scratch root without it
        if len(self.trees) >= MAX_TREES:
            return f"{path}: more than {MAX_TREES} generated trees; it stays behind the mount"
        parts = path.split("/")
        if ".git" in parts or parts[0] == GUARD_DIR:
            return f"{path}: inside a repository's .git/ or the guard's own files"
        try:
            # The workspace's parents are what the agent walks to the tree; the scratch copies
            # of them (plain directories the layer made) are what the bind's source lies beneath.
            head = path.rpartition("/")[0]
            for base, within in ((self.root, head), (self.scratch, path)):
                if within and (link := _symlinked_parent(base, within)) is not None:
                    return f"{path}: {link} is a symlink; it stays behind the mount"
            if (self.scratch / path).lstat().st_dev != self.scratch.stat().st_dev:
                return f"{path}: another filesystem is mounted there"
        except OSError as err:  # removed since
            return f"{path}: {err.strerror}"
        if _masks(self.scratch, path, self.manifest, 0) == (None, None):
            return f"{path}: forbidden paths are already inside; it stays behind the mount"
        return None


def _symlinked_parent(root: Path, path: str) -> str | None:
    """The first component of *path* (itself included) that is a symlink, if any."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        if (root / "/".join(parts[:i])).is_symlink():
            return "/".join(parts[:i])
    return None


def _masks(root: Path, tree: str, manifest: Manifest, limit: int,
           inodes: set[int] | frozenset[int] = frozenset(), hide_git: bool = False
           ) -> tuple[list[str] | None, list[str] | None]:
    """Forbidden files and directories under *tree*, and other names of the files forbidden
    by name (*inodes*); (None, None) past *limit*. Symlinks are left: they resolve through the
    sandbox's own view, where their targets are judged.

    Judged by the secret patterns alone (PathPolicy.secret), which is all that makes a path
    forbidden outside ``.git`` (PathPolicy.classify, ten times slower here, says the same):
    an install tree can hold tens of thousands of files, walked at every start. A pattern
    that only reaches into the tree through a wildcard ('**/*.pem') is no secret there, for
    the mount as for the bind, so it masks nothing."""
    policy = PathPolicy(manifest)
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, dirnames, filenames in walk(str(root / tree)):
        rel = os.path.relpath(dirpath, root)
        keep = []
        for name in dirnames:
            path = f"{rel}/{name}"
            if os.path.islink(os.path.join(dirpath, name)):
                continue
            if policy.secret(path, True) is not None or (hide_git and name == ".git"):
                dirs.append(path)
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            path = f"{rel}/{name}"
            if os.path.islink(os.path.join(dirpath, name)):
                continue
            if policy.secret(path, False) is not None or (hide_git and name == ".git") or (
                    inodes and _linked(os.path.join(dirpath, name), inodes)):
                files.append(path)
        if len(files) + len(dirs) > limit:
            return None, None
    return files, dirs


def _linked(path: str, inodes: set[int] | frozenset[int]) -> bool:
    """Whether *path* is another name of a file in *inodes*."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_nlink > 1 and st.st_ino in inodes


def strip_set_id(root: Path, trees: list[str]) -> list[str]:
    """Remove set-user-ID and set-group-ID from the regular files of the native *trees* of
    the workspace *root*, once the agent has ended; the paths changed.

    The mount never lets a chmod set them (guardfs.fs), but natively a root agent owns what
    it writes and may set them with no capability: a root program left for the next local
    user to run. Directories keep set-group-ID (group inheritance), as through the mount.
    Nothing of the agent runs any more, so nothing races this walk; it is
    :func:`guardfs.harvest.strip_set_id`'s: from a held directory fd, never through a symlink,
    at any depth (``os.walk`` recursed: a tree 1,000 levels deep raised RecursionError after the
    run, and one past PATH_MAX kept its set-user-ID files)."""
    stripped: list[str] = []
    for tree in trees:
        changed, problems = harvest.strip_set_id(root, tree)
        stripped += changed
        for problem in problems:
            log.warning("native tree %s: not swept for set-user/group-ID files (look there by hand): %s", tree, problem)
    return stripped


def bind_writable(source: str, target: str) -> None:
    """Bind *source* at *target*, writable, in this process's (private) mount namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"binding {source} at {target}: {os.strerror(err)}")


class NativeStage(StagedTrees):
    """What bubblewrap binds from: the masks (an empty file and directory, mode 000, of their
    own so that fast lanes and native trees clean up independently) and, for an agent of
    another user who may not traverse the path to the real workspace, each tree bound into
    the staging directory first (in the guard's private mount namespace)."""

    kind, bind_option = "native", "--bind"

    def __init__(self, stage: Path) -> None:
        super().__init__(stage)
        self.mask_file, self.mask_dir = stage / "native-mask-file", stage / "native-mask-dir"

    def _bind(self, source: str, target: str) -> None:
        bind_writable(source, target)

    def bwrap_args(self, native: NativeTrees, real: Path, seen_as: str, staged: bool) -> list[str]:
        """bubblewrap arguments: each tree of the real workspace *real* bound writable at its
        place under *seen_as*, then the masks over the forbidden paths inside it."""
        if not native.trees:
            return []
        argv = self.tree_args(native.trees, real, seen_as, staged)
        if native.masked_dirs or native.masked_files:
            self.mask_file.touch()
            self.mask_dir.mkdir(exist_ok=True)
            self.mask_file.chmod(0)
            self.mask_dir.chmod(0)
        for path in native.masked_dirs:
            argv += ["--ro-bind", str(self.mask_dir), f"{seen_as}/{path}"]
        for path in native.masked_files:
            argv += ["--ro-bind", str(self.mask_file), f"{seen_as}/{path}"]
        return argv

    def cleanup(self) -> None:
        """Remove the masks and the staged trees (unmounted first)."""
        super().cleanup()
        self.mask_file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.mask_dir.rmdir()
