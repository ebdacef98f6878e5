"""Fast lanes: subtrees of the workspace the agent reads natively, never through FUSE.

A fast lane is a directory that the manifest makes read-only anyway (declared in
``[sandbox] fast_lanes``, or, with ``out_of_scope_fast_lanes``, lying wholly outside
``paths.allowed``). ``guard run`` binds the real directory read-only over its place in the
mounted workspace, inside the sandbox only, and masks every forbidden path inside it with an
empty, unreadable stand-in. Reads there cost what they cost natively.

What a lane keeps: forbidden paths stay unreadable (masked before the agent starts), and
nothing in a lane can be written (a read-only bind; the kernel answers EROFS, the errno
guardfs gives out-of-scope writes). What it gives up: the guard never hears of those
operations. A refused write there is not an event and does not feed the breaker (no
scope_spill), a read of a masked path is not a forbidden-read trip, and a forbidden file
created in a lane during the run is impossible only because nothing can be created there.
A hard link inside a lane to a forbidden file elsewhere is read natively (through FUSE it
would be judged by the name it is reached under, which is the same rule).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, PathPolicy, Scope
from sandbox.launch.isolation import bind_read_only, unbind

__all__ = ["MAX_MASKS", "LaneStage", "Lanes", "plan_lanes"]

#: More forbidden paths than this inside one lane and it is served through FUSE instead
#: (each mask is a mount in the sandbox).
MAX_MASKS = 500
_NEVER = (".git", GUARD_DIR)


@dataclass
class Lanes:
    """Which directories go native, what is masked inside them, and what was left out."""

    trees: list[str] = field(default_factory=list)
    masked_files: list[str] = field(default_factory=list)
    masked_dirs: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _anchors(allowed: list[str]) -> list[str] | None:
    """The literal directory part of every allowed pattern, or None when one is not anchored
    (a pattern without an inner '/' matches at any depth, so no subtree is surely out of scope)."""
    out = []
    for pattern in allowed:
        if pattern.startswith("!"):
            continue  # an exclusion only narrows the scope
        body = pattern.rstrip("/")
        if "/" not in body or body.startswith("**"):
            return None
        literal = []
        for part in body.lstrip("/").split("/"):
            if any(c in part for c in "*?[\\"):
                break
            literal.append(part)
        out.append("/".join(literal))
    return out


def _out_of_scope(root: Path, anchors: list[str], policy: PathPolicy, dev: int) -> list[str]:
    """Directories that no allowed pattern reaches: not an anchor, under one, or above one."""
    found: list[str] = []

    def visit(rel: str) -> None:
        with os.scandir(root / rel if rel else root) as it:
            for entry in sorted(it, key=lambda e: e.name):
                path = f"{rel}/{entry.name}" if rel else entry.name
                if entry.name in _NEVER or not entry.is_dir(follow_symlinks=False):
                    continue
                if any(a in ("", path) or path.startswith(a + "/") for a in anchors):
                    continue  # in scope
                if any(a.startswith(path + "/") for a in anchors):
                    visit(path)  # an allowed directory lies below
                elif entry.stat(follow_symlinks=False).st_dev == dev and (
                        policy.classify(path, True).scope is Scope.OUT_OF_SCOPE):
                    found.append(path)

    visit("")
    return found


def plan_lanes(manifest: Manifest, workspace: Path, max_masks: int = MAX_MASKS) -> Lanes:
    """The fast lanes of *workspace* under *manifest*, with their masks."""
    lanes = Lanes()
    policy = PathPolicy(manifest)
    root = workspace.resolve()
    dev = root.stat().st_dev
    candidates: list[str] = []
    for declared in manifest.sandbox.fast_lanes:
        try:
            st = (root / declared).lstat()
        except FileNotFoundError:
            lanes.skipped.append(f"{declared}: does not exist")
            continue
        if (link := _symlinked_parent(root, declared)) is not None:
            lanes.skipped.append(f"{declared}: {link} is a symlink; a lane is bound at its own path, so name "
                                 "the real directory (it stays behind the mount)")
        elif not stat.S_ISDIR(st.st_mode):
            lanes.skipped.append(f"{declared}: not a directory (a symlink is followed through the mount)")
        elif st.st_dev != dev:
            lanes.skipped.append(f"{declared}: another filesystem is mounted there")
        elif policy.classify(declared, True).scope is Scope.FORBIDDEN:
            lanes.skipped.append(f"{declared}: forbidden as a whole; it stays behind the mount")
        elif _in_scope(policy, manifest.paths.allowed, declared):
            lanes.skipped.append(f"{declared}: inside paths.allowed (the task writes there, a lane is read-only); "
                                 "remove it from [sandbox] fast_lanes (it stays behind the mount)")
        elif any(Path(p) in Path(declared).parents for p in manifest.sandbox.fast_lanes):
            continue  # inside another declared lane
        else:
            candidates.append(declared)
    if manifest.sandbox.out_of_scope_fast_lanes:
        anchors = _anchors(manifest.paths.allowed)
        if anchors is None:
            lanes.skipped.append("out_of_scope_fast_lanes: a paths.allowed pattern matches at any depth "
                                 "(no '/' inside it), so no directory is surely out of scope")
        else:
            candidates += [p for p in _out_of_scope(root, anchors, policy, dev)
                           if not any(p == c or p.startswith(c + "/") for c in candidates)]
    for tree in sorted(candidates):
        files, dirs = _masks(root, tree, policy, max_masks)
        if files is None or dirs is None:
            lanes.skipped.append(f"{tree}: more than {max_masks} forbidden paths inside; it stays behind the mount")
            continue
        lanes.trees.append(tree)
        lanes.masked_files += files
        lanes.masked_dirs += dirs
    return lanes


def _symlinked_parent(root: Path, declared: str) -> str | None:
    """The first directory above *declared* (relative to *root*) that is a symlink, if any."""
    parts = declared.split("/")
    for i in range(1, len(parts)):
        if (root / "/".join(parts[:i])).is_symlink():
            return "/".join(parts[:i])
    return None


def _in_scope(policy: PathPolicy, allowed: list[str], declared: str) -> bool:
    """Whether *declared* is in scope, or an allowed directory lies beneath it."""
    if policy.classify(declared, True).scope is Scope.ALLOWED:
        return True
    anchors = _anchors(allowed) or []
    return any(a.startswith(declared + "/") for a in anchors)


def _masks(root: Path, tree: str, policy: PathPolicy, limit: int) -> tuple[list[str] | None, list[str] | None]:
    """Forbidden files and directories under *tree* (symlinks are left: they resolve
    through the sandbox's own view, where their targets are judged by their own names)."""
    files: list[str] = []
    dirs: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root / tree):
        rel = os.path.relpath(dirpath, root)
        keep = []
        for name in dirnames:
            path = f"{rel}/{name}"
            if os.path.islink(os.path.join(dirpath, name)):
                continue
            if policy.classify(path, True).scope is Scope.FORBIDDEN:
                dirs.append(path)
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            path = f"{rel}/{name}"
            if not os.path.islink(os.path.join(dirpath, name)) and (
                    policy.classify(path, False).scope is Scope.FORBIDDEN):
                files.append(path)
        if len(files) + len(dirs) > limit:
            return None, None
    return files, dirs


class LaneStage:
    """What bubblewrap binds from: the masks (an empty file and an empty directory, both
    mode 000) and, for an agent of another user who may not traverse the path to the real
    workspace, each lane bound read-only into the staging directory first (in the guard's
    private mount namespace)."""

    def __init__(self, stage: Path) -> None:
        self.stage = stage
        self.mask_file, self.mask_dir = stage / "mask-file", stage / "mask-dir"
        self.staged: list[Path] = []

    def bwrap_args(self, lanes: Lanes, real: Path, seen_as: str, staged: bool) -> list[str]:
        """bubblewrap arguments: each lane of the real workspace *real* bound read-only at
        its place under *seen_as*, then the masks over the forbidden paths inside it."""
        self.mask_file.touch()
        self.mask_dir.mkdir(exist_ok=True)
        self.mask_file.chmod(0)
        self.mask_dir.chmod(0)
        argv: list[str] = []
        for i, tree in enumerate(lanes.trees):
            source = real / tree
            if staged:
                target = self.stage / "lanes" / str(i)
                target.mkdir(parents=True)
                self.staged.append(target)
                bind_read_only(str(source), str(target))
                source = target
            argv += ["--ro-bind", str(source), f"{seen_as}/{tree}"]
        for path in lanes.masked_dirs:
            argv += ["--ro-bind", str(self.mask_dir), f"{seen_as}/{path}"]
        for path in lanes.masked_files:
            argv += ["--ro-bind", str(self.mask_file), f"{seen_as}/{path}"]
        return argv

    def cleanup(self) -> None:
        """Remove the masks and the staged lanes (unmounted first)."""
        for target in self.staged:
            unbind(str(target))
            with contextlib.suppress(OSError):
                target.rmdir()
        with contextlib.suppress(OSError):
            (self.stage / "lanes").rmdir()
        self.mask_file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.mask_dir.rmdir()
