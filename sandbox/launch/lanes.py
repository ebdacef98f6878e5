"""Fast lanes: subtrees of the workspace the agent reads natively, never through FUSE.

A fast lane is a directory that the manifest makes read-only anyway (declared in
``[sandbox] fast_lanes``, or, with ``out_of_scope_fast_lanes``, lying wholly outside
``paths.allowed``). ``guard run`` binds the real directory read-only over its place in the
mounted workspace, inside the sandbox only. Reads there cost what they cost natively.

A lane must show what the mount would, for the whole run, and a bind shows the live
directory: whatever the host creates in it during the run appears in it. A mask (a bind
over a forbidden name) cannot be placed over a name that does not exist yet, and one
mounted after the fact (a watch on the lane) loses the race to an agent that opens the file
as it appears. So a directory is a lane only where *no* forbidden pattern could match
anything beneath it, now or later (:func:`forbidden_reach`):

- a pattern that matches at any depth (``.env*``, ``**/secrets/``, ``*.pem``) could match
  in any directory: with one, there are no lanes at all (said, with the way out: anchor it);
- an anchored pattern (``docs/.env*``, ``/config/secrets/``) re-plans the lane: the
  directories on its way go through the mount (which hides and refuses forbidden names,
  also those created during the run), and their other subdirectories become lanes;
- a hard link, made before the run, of a file forbidden by name (which the mount refuses
  under any name, :mod:`guardfs.links`) keeps the directories above it under the mount too.
  Lanes are planned with the mount's own policy, so under ``forbidden_in_git = "hide-git"``
  git's objects are such files: a loose object hard-linked into a lane (``git clone
  --local``, ``cp -al``) keeps its directory behind the mount, which refuses it, as does
  one of a masked git directory outside the workspace (a linked worktree's store).

So nothing forbidden is ever listed or readable in a lane, and nothing needs masking.
Nothing in a lane can be written (a read-only bind; the kernel answers EROFS, the errno
guardfs gives out-of-scope writes). What a lane gives up: the guard never hears of
operations there. A refused write there is not an event and does not feed the breaker (no
scope_spill). A hard link the host makes during the run is seen by neither the mount nor
a lane (the mount's walk is at start).
"""

from __future__ import annotations

import contextlib
import enum
import fnmatch
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from guardfs.links import forbidden_inodes
from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, PathPolicy, Scope
from sandbox.launch.isolation import bind_read_only, unbind

__all__ = ["MAX_LANES", "LaneStage", "Lanes", "Reach", "StagedTrees", "forbidden_reach", "plan_lanes"]

#: More lanes than this from one declared or out-of-scope tree (once re-planned around the
#: forbidden paths) and it is served through FUSE instead (each lane is a mount in the sandbox).
MAX_LANES = 500
_NEVER = (".git", GUARD_DIR)


@dataclass
class Lanes:
    """Which directories go native, and what was left out (and why)."""

    trees: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


class Reach(enum.Enum):
    """How far a forbidden pattern reaches beneath a directory."""

    NONE = "nothing beneath it can match"
    SOME = "some paths beneath it could match; its subdirectories may not"
    ALL = "anything beneath it could match"


def _anywhere(pattern: str) -> bool:
    """Whether the (non-negated) gitignore-style *pattern* matches at any depth."""
    body = pattern.strip().rstrip("/")
    return bool(body) and not body.startswith(("#", "!")) and ("/" not in body or body.startswith("**/"))


def forbidden_reach(pattern: str, directory: str, tree: str | None = None) -> Reach:
    """Whether the gitignore-style *pattern* could match *directory* (workspace-relative)
    or anything beneath it, whatever is created there later; *tree* is the root of the
    generated tree *directory* is or lies in (PathPolicy.generated_tree), if any. Errs
    towards reaching: a negation is ignored (it only narrows), a segment with a class or an
    escape matches all."""
    body = pattern.rstrip()
    if not body or body.startswith(("#", "!")):
        return Reach.NONE
    if tree is not None and not _reaches_tree(body, tree):
        return Reach.NONE
    if _anywhere(body):
        return Reach.ALL
    segments = body.rstrip("/").lstrip("/").split("/")
    parts = directory.split("/")
    for i, part in enumerate(parts):
        if i == len(segments):
            return Reach.ALL  # the pattern matched an ancestor: everything beneath is forbidden
        seg = segments[i]
        if seg == "**":
            return Reach.ALL
        if not any(c in seg for c in "[\\") and not fnmatch.fnmatchcase(part, seg):
            return Reach.NONE
    return Reach.ALL if len(segments) == len(parts) else Reach.SOME


def _reaches_tree(pattern: str, tree: str) -> bool:
    """Whether *pattern* can apply inside the generated tree rooted at *tree*: the policy
    lets it only if it matches the tree as a whole or names the tree (guardfs.policy); here,
    a segment that could match the tree's name, other than one of '*' alone, counts as naming it."""
    if pathspec.GitIgnoreSpec.from_lines([pattern]).match_file(tree + "/"):
        return True
    name = tree.rpartition("/")[2]
    return any(seg.strip("*") and (any(c in seg for c in "[\\") or fnmatch.fnmatchcase(name, seg))
               for seg in pattern.strip("/").split("/"))


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


def plan_lanes(manifest: Manifest, workspace: Path, max_lanes: int = MAX_LANES, *,
               policy: PathPolicy | None = None, links: Collection[int] | None = None) -> Lanes:
    """The fast lanes of *workspace* under *manifest*: directories no forbidden pattern can reach.

    *policy* is the mount's (``hide-git`` included: a lane must hide what the mount hides;
    default: the manifest's alone). *links*: the inodes of the forbidden files with other names
    the session's walk at start found under that policy (default: walk for them here)."""
    lanes = Lanes()
    policy = policy if policy is not None else PathPolicy(manifest)
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
    if not candidates:
        return lanes
    keyed = manifest.paths.secret_patterns
    patterns = [p for _key, p in keyed]
    candidates = _unreached(candidates, keyed, policy, lanes)
    if not candidates:
        return lanes
    tainted = _hard_link_dirs(root, policy, candidates, links)
    for tree in sorted(candidates):
        trees = _split(root, tree, patterns, tainted, dev, max_lanes, policy)
        if trees is None:
            lanes.skipped.append(f"{tree}: more than {max_lanes} lanes once split around the forbidden paths "
                                 "inside; it stays behind the mount")
            continue
        if trees != [tree]:
            why = next((f"{k} {p!r} could match inside" for k, p in keyed
                        if forbidden_reach(p, tree, policy.generated_tree(tree)) is not Reach.NONE),
                       "it holds another name (a hard link) of a forbidden file")
            lanes.skipped.append(f"{tree}: {why}; "
                                 + (f"only {', '.join(trees)} {'is a lane' if len(trees) == 1 else 'are lanes'}, "
                                    "the rest stays behind the mount" if trees else "it stays behind the mount"))
        lanes.trees += trees
    return lanes


def _unreached(candidates: list[str], keyed: list[tuple[str, str]], policy: PathPolicy, lanes: Lanes) -> list[str]:
    """The *candidates* that no secret pattern matching at any depth reaches (one reaches
    every directory, but for generated trees it does not name); the others are said in
    *lanes*' skipped."""
    blocked: dict[tuple[str, str], list[str]] = {}
    for tree in candidates:
        within = policy.generated_tree(tree)
        anywhere = [(k, p) for k, p in keyed if _anywhere(p) and (within is None or _reaches_tree(p, within))]
        if anywhere:
            blocked.setdefault(anywhere[0], []).append(tree)
    for (key, pattern), trees in blocked.items():
        lanes.skipped.append(
            f"{', '.join(sorted(trees))}: {key} {pattern!r} matches at any depth, so a "
            "forbidden file created in a lane during the run would be read there natively (a lane shows the "
            "live directory and cannot hide a name that appears later); it stays behind the mount. "
            "Anchor the pattern where the secrets live (e.g. '/" + pattern.lstrip("*/") + "') to allow lanes")
    return [c for c in candidates if not any(c in trees for trees in blocked.values())]


def _split(root: Path, tree: str, patterns: list[str], tainted: set[str], dev: int, limit: int,
           policy: PathPolicy) -> list[str] | None:
    """The directories at and below *tree* that no forbidden pattern can reach, highest
    first: a directory on the way to a possible match goes through the mount, its other
    subdirectories are tried in turn. None past *limit* lanes."""
    out: list[str] = []
    stack = [tree]
    while stack:
        path = stack.pop()
        within = policy.generated_tree(path)
        reach = {forbidden_reach(p, path, within) for p in patterns}
        if Reach.ALL in reach:
            continue
        if Reach.SOME not in reach and path not in tainted:
            out.append(path)
            if len(out) > limit:
                return None
            continue
        try:
            with os.scandir(root / path) as it:
                stack += [f"{path}/{e.name}" for e in it if e.is_dir(follow_symlinks=False)
                          and e.stat(follow_symlinks=False).st_dev == dev]
        except OSError:
            continue  # vanished or unreadable: it stays behind the mount
    return sorted(out)


def _hard_link_dirs(root: Path, policy: PathPolicy, trees: list[str],
                    links: Collection[int] | None = None) -> set[str]:
    """The directories (and their ancestors) under *trees* that hold another name of a file
    forbidden by name (with ``hide-git``, git's objects among them, also those of a masked
    git directory outside the workspace): the mount refuses it under any name, a lane would not."""
    inodes = set(links) if links is not None else forbidden_inodes(root, policy)
    out: set[str] = set()
    if not inodes:
        return out
    for tree in trees:
        for dirpath, _, filenames in os.walk(root / tree):
            rel = os.path.relpath(dirpath, root)
            for name in filenames:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(dirpath, name))
                    if st.st_nlink > 1 and st.st_ino in inodes:
                        parts = rel.split("/")
                        out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


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


class StagedTrees:
    """Trees of the workspace bound into the sandbox: from the real directories, or, for an
    agent of another user who may not traverse the path to the real workspace, each tree
    bound into the staging directory first (in the guard's private mount namespace)."""

    #: The staging subdirectory and bubblewrap's bind option.
    kind, bind_option = "lanes", "--ro-bind"

    def __init__(self, stage: Path) -> None:
        self.stage = stage
        self.staged: list[Path] = []

    def _bind(self, source: str, target: str) -> None:
        bind_read_only(source, target)

    def tree_args(self, trees: list[str], real: Path, seen_as: str, staged: bool) -> list[str]:
        """bubblewrap arguments: each of *trees* of the real workspace *real* bound at its
        place under *seen_as*."""
        argv: list[str] = []
        for i, tree in enumerate(trees):
            source = real / tree
            if staged:
                target = self.stage / self.kind / str(i)
                target.mkdir(parents=True)
                self.staged.append(target)
                self._bind(str(source), str(target))
                source = target
            argv += [self.bind_option, str(source), f"{seen_as}/{tree}"]
        return argv

    def cleanup(self) -> None:
        """Remove the staged trees (unmounted first)."""
        for target in self.staged:
            unbind(str(target))
            with contextlib.suppress(OSError):
                target.rmdir()
        self.staged.clear()
        with contextlib.suppress(OSError):
            (self.stage / self.kind).rmdir()


class LaneStage(StagedTrees):
    """The fast lanes, bound read-only."""

    def bwrap_args(self, lanes: Lanes, real: Path, seen_as: str, staged: bool) -> list[str]:
        """bubblewrap arguments: each lane of the real workspace *real* bound read-only at
        its place under *seen_as*."""
        return self.tree_args(lanes.trees, real, seen_as, staged)
