"""The compiled path policy: a manifest turned into one decision per path.

Matching globs is slow (microseconds per pattern set), so the filesystem classifies each
path once, when it first meets the inode, and keeps the :class:`Classification` on the
inode entry (``Entry.where``); the hot path then only reads ``entry.where.scope``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import pathspec

from guardfs.manifest import Manifest

__all__ = ["GUARD_DIR", "Classification", "PathPolicy", "Scope", "is_git_state"]

#: The guard's own directory at the workspace root; never writable by the agent.
GUARD_DIR = ".guard"

# Names git writes under .git/hooks/ itself (templates copied by git init). A *.sample
# hook is never run by git, so letting git create it keeps `git init` working.
_SAMPLE_HOOK = re.compile(r"^\.git/hooks/[^/]+\.sample$")
_GIT_CONFIG_RULE = "built-in: .git/config is read-only if it existed when the guard started"
_GIT_STATE_RULE = "built-in: git's index and refs change only by renaming their lock files over them"


def is_git_state(path: str) -> bool:
    """Whether *path* is a file git only ever replaces by renaming a lock file over it: the
    index, HEAD, packed-refs or a ref under refs/ (see guardfs.gitscope)."""
    return path in (".git/index", ".git/HEAD", ".git/packed-refs") or (
        path.startswith(".git/refs/") and not path.endswith(".lock"))


class Scope(enum.Enum):
    """What the agent may do with a path, in order of precedence."""

    FORBIDDEN = "forbidden"  # neither read nor write
    PROTECTED = "protected"  # read-only whatever the manifest says
    GIT_CONFIG = "git-config"  # .git/config that existed when the guard started: read-only
    GIT_INTERNAL = "git-internal"  # writable, never counted toward limits
    ALLOWED = "allowed"  # writable, counted
    OUT_OF_SCOPE = "out-of-scope"  # readable, not writable

    @property
    def counted(self) -> bool:
        """Whether mutations count toward the blast radius and rewrite limits."""
        return self is Scope.ALLOWED


@dataclass(frozen=True, slots=True)
class Classification:
    """A path's scope and the rule that decided it: manifest key and pattern."""

    scope: Scope
    key: str
    pattern: str | None = None

    def describe(self) -> str:
        """Human words for the rule, e.g. ``paths.forbidden '.env*'``."""
        return f"{self.key} {self.pattern!r}" if self.pattern is not None else self.key


class PathPolicy:
    """Decides the scope of workspace-relative paths; pure and side-effect free.

    Every built-in protection is decided here, so the mount, the daemon and the hooks give
    one answer per path. *git_config_existed* is the one fact about the workspace that
    needs: whether ``.git/config`` existed when the guard started (a repository the agent
    creates may configure itself, one that was there may not). It defaults to the safe
    answer, read-only; whoever builds a guarded run looks and says (see sandbox.session).
    """

    def __init__(
        self, manifest: Manifest, *, git_config_existed: bool = True, hide_git: bool = False,
        git_state_locked: bool = False,
    ) -> None:
        self.manifest = manifest
        self.git_config_existed = git_config_existed
        # paths.forbidden_in_git = "hide-git" and git tracks a forbidden path: .git/ is forbidden.
        self.hide_git = hide_git
        # A run that judges git's updates (guardfs.gitscope): its index and refs are read-only
        # but for the lock-file rename (and the unlink) that the mount judges itself.
        self.git_state_locked = git_state_locked
        paths = manifest.paths
        self._forbidden = pathspec.GitIgnoreSpec.from_lines(paths.forbidden)
        self._allowed = pathspec.GitIgnoreSpec.from_lines(paths.allowed)
        self._git_writable = paths.git_internals == "writable"
        self._mkdir_ancestors = _literal_ancestors(paths.allowed)

    def classify(self, path: str, is_dir: bool) -> Classification:
        """Classify *path* (relative to the root, '/'-separated, '' for the root itself)."""
        if path == "":
            return Classification(Scope.OUT_OF_SCOPE, "workspace root")
        probe = path + "/" if is_dir else path
        if path == GUARD_DIR or path.startswith(GUARD_DIR + "/"):
            return Classification(Scope.PROTECTED, "built-in: the guard's own files")
        if self.hide_git and (path == ".git" or path.startswith(".git/")):
            return Classification(Scope.FORBIDDEN, "paths.forbidden_in_git", "hide-git")
        hit = self._forbidden.check_file(probe)
        if hit.include and hit.index is not None:
            return Classification(
                Scope.FORBIDDEN, "paths.forbidden", self.manifest.paths.forbidden[hit.index]
            )
        if path == ".git/hooks" or path.startswith(".git/hooks/"):
            if path == ".git/hooks" or _SAMPLE_HOOK.match(path):
                return self._git_internal()
            return Classification(Scope.PROTECTED, "built-in: .git/hooks/ is read-only")
        if path == ".git/config":
            if self.git_config_existed:
                return Classification(Scope.GIT_CONFIG, _GIT_CONFIG_RULE)
            return self._git_internal()
        if path == ".git" or path.startswith(".git/"):
            if self.git_state_locked and self._git_writable and not is_dir and is_git_state(path):
                return Classification(Scope.PROTECTED, _GIT_STATE_RULE)
            return self._git_internal()
        hit = self._allowed.check_file(probe)
        if hit.include and hit.index is not None:
            return Classification(Scope.ALLOWED, "paths.allowed", self.manifest.paths.allowed[hit.index])
        if hit.index is not None:  # excluded by a negated allowed pattern
            return Classification(
                Scope.OUT_OF_SCOPE, "paths.allowed", self.manifest.paths.allowed[hit.index]
            )
        if is_dir and path in self._mkdir_ancestors:
            # A parent of a literal allowed directory: creating it is how the allowed one
            # comes to exist. It counts as a directory, so not toward the blast radius.
            return Classification(Scope.ALLOWED, "paths.allowed (parent directory)")
        return Classification(Scope.OUT_OF_SCOPE, "not in paths.allowed")

    def git_state_update(self, path: str) -> Classification:
        """What renaming git's lock file over *path* (or unlinking it) is judged as: writable
        git internals when the mount judges what it changes (a locked git state path), else
        the path's own classification."""
        where = self.classify(path, False)
        if where.key == _GIT_STATE_RULE:
            return self._git_internal()
        return where

    def _git_internal(self) -> Classification:
        if self._git_writable:
            return Classification(Scope.GIT_INTERNAL, "built-in: git internals")
        return Classification(Scope.PROTECTED, "paths.git_internals", "read-only")

    def describe(self) -> str:
        """The compiled policy as text, for ``guard check``."""
        m = self.manifest
        lim = m.limits
        lines = [
            f"task {m.task.id}: {m.task.goal}",
            "",
            "precedence: built-in protections > paths.forbidden > paths.allowed > out of scope",
            "built-in protections:",
            f"  {GUARD_DIR}/              read-only (the guard's own files)",
            "  .git/hooks/          read-only (git may create *.sample templates)",
            "  .git/config          read-only if it existed when the mount started",
            "  .git/index, refs     changed only by git's lock-file rename, judged for what it changes",
            f"  .git/ (the rest)     {m.paths.git_internals}, not counted toward limits",
            "forbidden (no read, no write; EACCES):",
            *(f"  {p}" for p in m.paths.forbidden or ["(none)"]),
            "allowed (writes land here; elsewhere EROFS):",
            *(f"  {p}" for p in m.paths.allowed or ["(none: read-only workspace)"]),
            "limits:",
        ]
        for name in type(lim).model_fields:
            value = getattr(lim, name)
            lines.append(f"  {name:<28} {'unlimited' if value is None else value}")
        lines += [
            "breaker:",
            f"  recoverable                  {', '.join(m.breaker.recoverable) or '(none)'}",
            f"  on_terminal                  {m.breaker.on_terminal}",
        ]
        return "\n".join(lines)


def _literal_ancestors(patterns: list[str]) -> frozenset[str]:
    """Parent directories of allowed patterns that name a literal path."""
    out: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("!") or any(c in pattern for c in "*?[\\"):
            continue
        parts = [p for p in pattern.split("/") if p]
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]))
    return frozenset(out)
