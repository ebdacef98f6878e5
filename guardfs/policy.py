"""The compiled path policy: a manifest turned into one decision per path.

Matching globs is slow (microseconds per pattern set), so the filesystem classifies each
path once, when it first meets the inode, and keeps the :class:`Classification` on the
inode entry (``Entry.where``); the hot path then only reads ``entry.where.scope``.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pathspec

from guardfs.gitguard import GitRole, git_role
from guardfs.manifest import DEFAULT_MANIFEST, Manifest, is_outside_secret

__all__ = [
    "AGENT_FILES_RULE", "GENERATED_KEYS", "GENERATED_RULE", "GIT_CHECKED_RULE", "GIT_GUARDED_RULE", "GUARD_DIR",
    "PROTECTED_RULE", "Classification", "PathPolicy", "Scope", "git_log_kind", "is_git_state", "pattern_applies",
    "read_gitignore",
]

log = logging.getLogger(__name__)

#: The guard's own directory at the workspace root; never writable by the agent.
GUARD_DIR = ".guard"

_GIT_CONFIG_RULE = "built-in: .git/config is read-only if it existed when the guard started"
_NESTED_CONFIG_RULE = "built-in: a repository's config is read-only if it existed when the guard started"
_HOOKS_RULE = "built-in: .git/hooks/ is read-only"
_ANCHOR_RULE = "built-in: a repository's .git and hooks directories are never renamed, replaced or linked"
_REDIRECT_RULE = "built-in: git files that point git elsewhere are read-only"
#: The rule of a repository's config made during the run: git may write it, checked.
GIT_GUARDED_RULE = "built-in: a git config that runs programs"
_GIT_STATE_RULE = "built-in: git's index and refs change only by renaming their lock files over them"
#: The manifest key of generated output; a refusal under it never trips the breaker.
GENERATED_RULE = "paths.generated"
_GITIGNORE_RULE = "paths.generated_from_gitignore"
#: The rule of the agent's own files and caches (sandbox.agents.registry: own_files, own_caches).
AGENT_FILES_RULE = "built-in: the agent's own files"
#: The keys that make a path generated output: a refusal under one never trips.
GENERATED_KEYS = frozenset({GENERATED_RULE, _GITIGNORE_RULE, AGENT_FILES_RULE})
#: The manifest key of paths readable but never writable.
PROTECTED_RULE = "paths.protected"
_MANIFEST_RULE = f"built-in: a manifest ({DEFAULT_MANIFEST}, in any directory) is read-only"
# A name standing in for a generated tree's own, to tell a pattern that names the tree from
# one that only reaches into it through a wildcard: no pattern names it (patterns hold no
# control characters in practice; one that did would only reach less).
_STAND_IN = "\x01guard-generated-tree\x01"
# Paths whose verdicts PathPolicy keeps at most (about 200 bytes each).
_MEMO_MAX = 1 << 16
#: The name an atomic save gives its temporary beside the file it replaces: ``NAME.tmp.SUFFIX``
#: (Claude Code's Write and Edit use ``NAME.tmp.<pid>.<random>``; write-file-atomic and others alike).
_SAVE_TEMPORARY = re.compile(r"(?P<target>[^/]+)\.tmp\.[A-Za-z0-9_.-]+")
#: GNU sed -i's temporary, made by mkstemp("sedXXXXXX") in the edited file's directory.
_SED_TEMPORARY = re.compile(r"sed[A-Za-z0-9]{6}")
_SAVE_RULE = "paths.allowed (an atomic save's temporary)"
_SEPARATE_GIT_DIR_RULE = ("built-in: a git directory a gitfile names under another name than .git (git's "
                          "updates there are not judged, so it is read-only)")


def read_gitignore(workspace: str | os.PathLike[str]) -> list[str]:
    """The patterns of *workspace*'s root ``.gitignore`` (none when there is none, or when it
    is a symlink: it could name a forbidden file); lines pathspec cannot compile are left
    out, as git leaves them out, with a warning that gives their number, not their text."""
    try:
        fd = os.open(os.path.join(workspace, ".gitignore"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        if err.errno == errno.ELOOP:
            log.warning(".gitignore is a symlink: not read for paths.generated_from_gitignore")
            return []
        raise
    with open(fd, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            pathspec.GitIgnoreSpec.from_lines([line])
        except Exception as err:  # pathspec raises several types for a bad pattern
            log.warning(".gitignore line %d is not a pattern pathspec reads (%s): not treated as generated",
                        number, type(err).__name__)
            continue
        out.append(line)
    return out
#: The rule of a gitfile, a worktree's gitdir/commondir, FETCH_HEAD and reflogs: written in
#: place by git, each write judged on the content it leaves.
GIT_CHECKED_RULE = "built-in: git files that name other git directories or commits"
_BARE_RULE = ("built-in: a HEAD outside a .git directory would make a bare repository, whose config "
              "and hooks the guard cannot tell by name; make repositories with git init (a .git directory)")
_GIT_LINK_RULE = "built-in: a symlink inside a git directory names a sibling only (git's own probe does)"
_NESTED_INTERNAL_RULE = "built-in: a nested repository's git internals (writable, not counted)"
_GIT_DATA_DIRS = frozenset({"refs", "logs", "objects", "hooks", "info"})


def is_git_state(path: str) -> bool:
    """Whether *path* is a file git only ever replaces by renaming a lock file over it: the
    index, HEAD, packed-refs or a ref under refs/ (see guardfs.gitscope)."""
    return path in (".git/index", ".git/HEAD", ".git/packed-refs", ".git/ORIG_HEAD") or (
        path.startswith(".git/refs/") and not path.endswith(".lock"))


def git_log_kind(path: str) -> str | None:
    """"FETCH_HEAD", "reflog" or "sequencer" for the workspace repository's files that name
    commits a later ``git merge FETCH_HEAD``, ``git reset --hard HEAD@{1}``, ``git stash
    pop`` or ``git rebase --continue/--abort`` would check out (or commands it would run),
    judged on every write (git writes some in place, some by a lock file's rename)."""
    if path == ".git/FETCH_HEAD":
        return "FETCH_HEAD"
    if path.startswith(".git/logs/"):
        return "reflog"
    if path.startswith(_SEQUENCER_DIRS) and path.count("/") == 2:
        # A rebase, am, cherry-pick or revert in progress: a human's `--continue` runs its
        # exec lines and applies its picks and patches, `--abort` resets to its orig-head.
        return "sequencer"
    return None


_SEQUENCER_DIRS = (".git/rebase-merge/", ".git/rebase-apply/", ".git/sequencer/")


def _bytecode(path: str) -> bool:
    """Whether *path* is Python bytecode: in a ``__pycache__`` directory, or a .pyc/.pyo."""
    return path.endswith((".pyc", ".pyo")) or "__pycache__" in path.split("/")


class Scope(enum.Enum):
    """What the agent may do with a path, in order of precedence."""

    FORBIDDEN = "forbidden"  # neither read nor write
    PROTECTED = "protected"  # read-only: paths.protected, or a built-in protection whatever the manifest says
    GIT_CONFIG = "git-config"  # a repository's config that existed when the guard started: read-only
    GIT_ANCHOR = "git-anchor"  # a .git or hooks directory: mkdir/rmdir only, never moved or linked
    GIT_GUARDED = "git-guarded"  # a config made during the run: replaced only by a checked rename
    GIT_CHECKED = "git-checked"  # a gitfile, gitdir, commondir, FETCH_HEAD, reflog: every write judged
    GIT_INTERNAL = "git-internal"  # writable, never counted toward limits
    ALLOWED = "allowed"  # writable, counted
    GENERATED = "generated"  # caches and build output in scope: writable, never counted nor kept
    OUT_OF_SCOPE = "out-of-scope"  # readable, not writable
    GENERATED_OUTSIDE = "generated-outside"  # generated output out of scope: readable, a write refused quietly

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


def _stand_in(probe: str, tree: str) -> str:
    """*probe* with the name of the generated *tree* (an ancestor of it) replaced by _STAND_IN."""
    return probe[:tree.rfind("/") + 1] + _STAND_IN + probe[len(tree):]


def pattern_applies(spec: pathspec.GitIgnoreSpec, probe: str, tree: str | None) -> bool | None:
    """Whether the one-pattern *spec* applies to *probe* (a trailing '/' for a directory)
    lying inside the generated *tree* (None: in none): None when it does not match at all,
    False when it matches only by reaching into the tree through a wildcard (it then does
    not apply), True when it applies: it matches the tree as a whole, or names it."""
    if not spec.match_file(probe):
        return None
    if tree is None or spec.match_file(tree + "/"):
        return True
    return not spec.match_file(_stand_in(probe, tree))


class _Rules:
    """The patterns of one class (secret, protected, allowed) compiled once, each with the
    manifest key it came from, matched with the generated-tree rule (:meth:`check`)."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self.entries = list(entries)
        self._spec = pathspec.GitIgnoreSpec.from_lines([p for _k, p in self.entries])
        self._each = [pathspec.GitIgnoreSpec.from_lines([p]) for _k, p in self.entries]
        # The sub-specs of the patterns that apply inside some tree, by their indices: few
        # distinct sets ever occur, and compiling one costs more than matching a path.
        self._subsets: dict[tuple[int, ...], pathspec.GitIgnoreSpec] = {}

    def check(self, probe: str, tree: str | None) -> tuple[bool | None, int | None]:
        """(include, index of the deciding pattern) for *probe* (a trailing '/' for a
        directory), gitignore semantics: the last matching pattern decides, a negation
        excludes. Inside the generated *tree* (the workspace path of its root directory,
        an ancestor of *probe*), a pattern applies only if it matches the tree's root as a
        whole ('**', 'src/', '.venv/') or names the tree ('.venv/**/x'); one that reaches in
        through a wildcard only ('**/migrations/', '*.pem') does not."""
        hit = self._spec.check_file(probe)
        if tree is None or hit.index is None:
            return hit.include, hit.index
        applying = tuple(i for i, one in enumerate(self._each) if pattern_applies(one, probe, tree))
        if len(applying) == len(self.entries):
            return hit.include, hit.index
        if not applying:
            return None, None
        spec = self._subsets.get(applying)
        if spec is None:
            spec = self._subsets[applying] = pathspec.GitIgnoreSpec.from_lines(
                [self.entries[i][1] for i in applying])
        sub = spec.check_file(probe)
        return sub.include, None if sub.index is None else applying[sub.index]

    def reaches(self, probe: str, tree: str) -> list[int]:
        """Indices of the patterns that match *probe* but do not apply there because it lies
        inside the generated *tree* (for ``guard check``)."""
        return [i for i, one in enumerate(self._each) if pattern_applies(one, probe, tree) is False]


class PathPolicy:
    """Decides the scope of workspace-relative paths; pure and side-effect free.

    Every built-in protection is decided here, so the mount, the daemon and the hooks give
    one answer per path. *git_config_existed* is the one fact about the workspace that
    needs: whether ``.git/config`` existed when the guard started (a repository the agent
    creates may configure itself, one that was there may not). It defaults to the safe
    answer, read-only; whoever builds a guarded run looks and says (see sandbox.session).
    *gitignore* holds the repository's .gitignore patterns (:func:`read_gitignore`), read
    when ``paths.generated_from_gitignore`` is on. *agent_files* and *agent_caches* are the
    agent's own (patterns): generated output wherever they are, below the secrets and
    ``paths.protected``; its files are kept in the workspace, its caches go to the scratch layer.
    """

    def __init__(
        self, manifest: Manifest, *, git_config_existed: bool = True, started_ns: int | None = None,
        hide_git: bool = False, git_state_locked: bool = False, gitignore: Sequence[str] = (),
        agent_files: Sequence[str] = (), agent_caches: Sequence[str] = (), git_dirs: Sequence[str] = (),
        masked_git_dirs: Sequence[str] = (),
    ) -> None:
        self.manifest = manifest
        self.git_config_existed = git_config_existed
        #: When the guard started: a repository's config changed no later than this was
        #: there before the run (file times lag the clock by a tick at most, in that
        #: direction: a file from before the start never looks newer).
        self.started_ns = time.time_ns() if started_ns is None else started_ns
        # paths.forbidden_in_git = "hide-git" and git holds a secret: every git directory is
        # forbidden (each `.git`, at any depth, and *git_dirs*). *git_dirs*: the
        # workspace-relative git directories a gitfile names under another name than `.git`
        # (`git init --separate-git-dir`): read-only otherwise, since the mount judges git's
        # updates by the name `.git` (git cannot commit there; nothing lands unjudged).
        self.hide_git = hide_git
        self.git_dirs = tuple(git_dirs)
        #: Under "hide-git", the git directories outside the workspace the sandbox masks (a
        #: linked worktree's common directory): their files' other names in the workspace
        #: (hard links) are forbidden too (guardfs.links).
        self.masked_git_dirs = tuple(masked_git_dirs)
        # A run that judges git's updates (guardfs.gitscope): its index and refs are read-only
        # but for the lock-file rename (and the unlink) that the mount judges itself.
        self.git_state_locked = git_state_locked
        paths = manifest.paths
        # Secrets are the union of two keys' patterns (a negation in one narrows only its own).
        self._secrets = [_Rules([(key, p) for key, p in paths.secret_patterns if key == name])
                         for name in ("paths.secret", "paths.forbidden")]
        self._protected = _Rules([(PROTECTED_RULE, p) for p in paths.protected])
        self._allowed = _Rules([("paths.allowed", p) for p in paths.allowed])
        self._git_writable = paths.git_internals == "writable"
        self._mkdir_ancestors = _literal_ancestors(paths.allowed)
        self._file_dirs = _literal_file_dirs(paths.allowed)
        self._generated = pathspec.GitIgnoreSpec.from_lines(paths.generated)
        #: The .gitignore patterns treated as generated (paths.generated_from_gitignore).
        self.gitignore = list(gitignore) if paths.generated_from_gitignore else []
        self._gitignored = pathspec.GitIgnoreSpec.from_lines(self.gitignore)
        self.agent_files, self.agent_caches = tuple(agent_files), tuple(agent_caches)  # kept to rebuild it
        own = ((agent_files, Scope.GENERATED), (agent_caches, Scope.GENERATED_OUTSIDE))
        self._agent_own = [(pathspec.GitIgnoreSpec.from_lines(p), list(p), scope) for p, scope in own if p]
        # Memo of classify: a verdict depends only on the path, whether it is a directory and
        # what is fixed above, and matching every pattern set costs ~10 µs a path, paid again
        # each time the kernel forgets an inode and meets its name anew.
        self._memo: dict[tuple[str, bool], Classification] = {}
        # Memo of generated_tree for directories: the root of the generated tree each lies in.
        self._trees: dict[str, str | None] = {}

    def classify(self, path: str, is_dir: bool) -> Classification:
        """Classify *path* (relative to the root, '/'-separated, '' for the root itself)."""
        key = (path, is_dir)
        where = self._memo.get(key)
        if where is None:
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()  # bounded; refilled from what is in use
            where = self._memo[key] = self._classify(path, is_dir)
        return where

    def _classify(self, path: str, is_dir: bool) -> Classification:
        if path == "":
            return Classification(Scope.OUT_OF_SCOPE, "workspace root")
        probe = path + "/" if is_dir else path
        if path == GUARD_DIR or path.startswith(GUARD_DIR + "/"):
            return Classification(Scope.PROTECTED, "built-in: the guard's own files")
        in_git_dir = any(path == d or path.startswith(d + "/") for d in self.git_dirs)
        if self.hide_git and (in_git_dir or ".git" in path.split("/")):
            return Classification(Scope.FORBIDDEN, "paths.forbidden_in_git", "hide-git")
        tree = self._tree_above(path)
        secret = self._secret(probe, tree)
        if secret is not None:
            return secret
        if in_git_dir:
            return Classification(Scope.PROTECTED, _SEPARATE_GIT_DIR_RULE)
        if path.rpartition("/")[2] == DEFAULT_MANIFEST and tree is None:
            # Not only the root's: any directory can be a later run's workspace (one outside every
            # repository, a repository the agent makes there with git init), whose guard run then
            # reads the guard.toml there as its manifest. Generated trees are tools', not workspaces.
            return Classification(Scope.PROTECTED, _MANIFEST_RULE)
        role = git_role(path) if ".git" in path or path.endswith("HEAD") else None
        if path == ".git" or path.startswith(".git/"):
            if self.git_state_locked and self._git_writable and not is_dir:
                if is_git_state(path):
                    return Classification(Scope.PROTECTED, _GIT_STATE_RULE)
                if (kind := git_log_kind(path)) is not None:
                    return Classification(Scope.GIT_CHECKED, GIT_CHECKED_RULE, kind)
            base = self._git_internal()
        else:
            base = self._by_allowed(path, probe, is_dir, tree)
            if base.scope is Scope.ALLOWED and ".git" in path and ".git" in path.split("/")[:-1]:
                # Inside a nested repository's git directory: git's own bookkeeping (its
                # index, objects, refs), never the agent's rewrites; names with a role below.
                base = Classification(Scope.GIT_INTERNAL, _NESTED_INTERNAL_RULE)
            elif (own := self._agent_own_rule(probe)) is not None:
                base = own  # the agent's bookkeeping, wherever the task's scope is
            elif (generated := self._generated_rule(probe)) is not None:
                key, pattern = generated
                # Python bytecode goes to scratch even in scope: Python runs a .pyc instead of
                # its source (an unchecked-hash one whatever the source says), so one left in
                # the workspace would run later on the host, uncounted and never rolled back.
                in_scope = base.scope is Scope.ALLOWED and not _bytecode(path)
                scope = Scope.GENERATED if in_scope else Scope.GENERATED_OUTSIDE
                base = Classification(scope, key, pattern)
            # Protected wins over allowed and generated; output the run's scratch layer takes
            # (generated outside allowed, Python bytecode) never reaches the workspace, so it
            # stays there: a test run importing a protected migrations/ package writes its
            # __pycache__ and trips nothing. A nested repository's git internals are git's.
            if base.scope is not Scope.GENERATED_OUTSIDE and not (".git" in path and ".git" in path.split("/")[:-1]):
                include, index = self._protected.check(probe, tree)
                if include and index is not None:
                    return Classification(Scope.PROTECTED, PROTECTED_RULE, self._protected.entries[index][1])
        if role is None or base.scope not in (Scope.ALLOWED, Scope.GIT_INTERNAL, Scope.GENERATED):
            return base  # a repository inside a read-only tree is as read-only as the tree
        return self._git(path, is_dir, role, base)

    def _secret(self, probe: str, tree: str | None) -> Classification | None:
        for rules in self._secrets:
            include, index = rules.check(probe, tree)
            if include and index is not None:
                key, pattern = rules.entries[index]
                return Classification(Scope.FORBIDDEN, key, pattern)
        return None

    def secret(self, path: str, is_dir: bool) -> Classification | None:
        """The secret rule (``paths.secret`` or ``paths.forbidden``) that makes *path* a secret,
        if any, by name alone: what native trees mask. Not memoised (a walk of an install
        tree would flood the memo), but as cheap as one match of the secret patterns."""
        return self._secret(path + "/" if is_dir else path, self._tree_above(path))

    def generated_tree(self, directory: str) -> str | None:
        """The root of the generated tree that *directory* is, or lies in: the highest
        directory at or above it that ``paths.generated`` matches (``.venv``,
        ``src/node_modules``), None outside every one. Patterns that match at any depth stop
        at such a root (see :meth:`_Rules.check`)."""
        if directory in self._trees:
            return self._trees[directory]
        parent = directory.rpartition("/")[0]
        root = self.generated_tree(parent) if parent else None
        if root is None and self._generated.match_file(directory + "/"):
            root = directory
        if len(self._trees) >= _MEMO_MAX:
            self._trees.clear()  # bounded; refilled from what is in use
        self._trees[directory] = root
        return root

    def _tree_above(self, path: str) -> str | None:
        """The root of the generated tree that *path* lies strictly inside, if any."""
        parent = path.rpartition("/")[0]
        return self.generated_tree(parent) if parent else None

    def reaching(self, path: str, is_dir: bool) -> list[tuple[str, str, str]]:
        """(manifest key, pattern, tree) of every secret, protected or allowed pattern that
        matches *path* but does not apply there because it only reaches into a generated
        tree through a wildcard (for ``guard check``)."""
        tree = self._tree_above(path)
        if tree is None:
            return []
        probe = path + "/" if is_dir else path
        return [(*rules.entries[i], tree) for rules in (*self._secrets, self._protected, self._allowed)
                for i in rules.reaches(probe, tree)]

    def _agent_own_rule(self, probe: str) -> Classification | None:
        """The agent's own file or cache that *probe* is, if any."""
        for spec, patterns, scope in self._agent_own:
            if (hit := spec.check_file(probe)).include and hit.index is not None:
                return Classification(scope, AGENT_FILES_RULE, patterns[hit.index])
        return None

    def _generated_rule(self, probe: str) -> tuple[str, str] | None:
        """The manifest key and pattern that make *probe* generated output, if any."""
        hit = self._generated.check_file(probe)
        if hit.include and hit.index is not None:
            return GENERATED_RULE, self.manifest.paths.generated[hit.index]
        if self.gitignore:
            hit = self._gitignored.check_file(probe)
            if hit.include and hit.index is not None:
                return _GITIGNORE_RULE, self.gitignore[hit.index]
        return None

    def generated(self, path: str, is_dir: bool) -> bool:
        """Whether *path* is generated output (``paths.generated``): never kept for rollback."""
        return self.classify(path, is_dir).scope in (Scope.GENERATED, Scope.GENERATED_OUTSIDE)

    def _git(self, path: str, is_dir: bool, role: tuple[GitRole, str], base: Classification) -> Classification:
        """A name with a role in a repository: narrowed from its writable *base*."""
        kind, name = role
        if kind is GitRole.ANCHOR and name == ".git" and not is_dir:
            return Classification(Scope.GIT_CHECKED, GIT_CHECKED_RULE, "gitfile")
        if kind is GitRole.ANCHOR:
            return Classification(Scope.GIT_ANCHOR, _ANCHOR_RULE, name)
        if kind is GitRole.LINK:
            return Classification(Scope.GIT_CHECKED, GIT_CHECKED_RULE, name)
        if kind is GitRole.BARE:
            return base if is_dir else Classification(Scope.PROTECTED, _BARE_RULE)
        if kind is GitRole.HOOK:
            return Classification(Scope.PROTECTED, _HOOKS_RULE)
        if kind is GitRole.REDIRECT:
            return Classification(Scope.PROTECTED, _REDIRECT_RULE, name)
        if is_dir:
            return base  # a directory named config (a submodule's name) is no config
        if path == ".git/config" and self.git_config_existed:
            return Classification(Scope.GIT_CONFIG, _GIT_CONFIG_RULE)
        return Classification(Scope.GIT_GUARDED, GIT_GUARDED_RULE, name)

    def settled(self, where: Classification, ctime_ns: int) -> Classification:
        """*where* for an existing file changed last at *ctime_ns*: a repository's config
        that was there when the guard started is read-only (nobody can set a file's ctime;
        any change moves it on)."""
        if where.scope is Scope.GIT_GUARDED and ctime_ns <= self.started_ns:
            return Classification(Scope.GIT_CONFIG, _NESTED_CONFIG_RULE)
        if where.scope is Scope.GIT_CHECKED and where.pattern in _LINK_KINDS and ctime_ns <= self.started_ns:
            return Classification(Scope.PROTECTED, _REDIRECT_RULE, where.pattern)
        return where

    def symlink_where(self, path: str, where: Classification, target: str) -> Classification:
        """*where* for a symlink to *target* made at *path*: inside a git directory only one
        naming a sibling that is no git data (git init probes symlinks with one to
        "testing"); any other could later redirect what a gitfile names."""
        if where.scope is Scope.FORBIDDEN or ".git" not in path.split("/")[:-1]:
            return where
        if "/" in target or target in ("", ".", "..") or target in _GIT_DATA_DIRS:
            return Classification(Scope.PROTECTED, _GIT_LINK_RULE)
        return where

    def _by_allowed(self, path: str, probe: str, is_dir: bool, tree: str | None) -> Classification:
        include, index = self._allowed.check(probe, tree)
        if include and index is not None:
            return Classification(Scope.ALLOWED, "paths.allowed", self.manifest.paths.allowed[index])
        if index is not None:  # excluded by a negated allowed pattern
            return Classification(Scope.OUT_OF_SCOPE, "paths.allowed", self.manifest.paths.allowed[index])
        if is_dir and path in self._mkdir_ancestors:
            # A parent of a literal allowed directory: creating it is how the allowed one
            # comes to exist. It counts as a directory, so not toward the blast radius.
            return Classification(Scope.ALLOWED, "paths.allowed (parent directory)")
        head, _, name = path.rpartition("/")
        if not is_dir and (save := _SAVE_TEMPORARY.fullmatch(name)) is not None:
            # The temporary of an atomic save of an allowed file, beside it: with a file allowed
            # by name (`--allow src/tax.py`), the agent's editor could not save it otherwise.
            # It is a file of the task like its target (counted, rolled back) until the rename
            # over the target makes it that file's rewrite (guardfs.rename).
            target = f"{head}/{save['target']}" if head else save["target"]
            where = self.classify(target, False)
            if where.scope is Scope.ALLOWED and where.key == "paths.allowed":
                return Classification(Scope.ALLOWED, _SAVE_RULE, where.pattern)
        if not is_dir and head in self._file_dirs and _SED_TEMPORARY.fullmatch(name):
            # sed -i's temporary names no file: it is allowed only beside a file allowed by its
            # literal path, where sed -i of that file makes it (one name, renamed over the file).
            return Classification(Scope.ALLOWED, _SAVE_RULE, self._file_dirs[head])
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
        secrets = [f"  {p:<28} {key}" for key, p in m.paths.secret_patterns]
        outside = [p for p in m.paths.secret if is_outside_secret(p)]
        lines = [
            f"task {m.task.id}: {m.task.goal}",
            "",
            "precedence: built-in protections > paths.secret (and paths.forbidden) > paths.protected",
            "  > paths.generated > paths.allowed > out of scope (readable, a write refused: EROFS, scope_spill)",
            "  generated inside allowed: writable, never counted nor kept for rollback;",
            "  generated outside allowed (and Python bytecode anywhere): written to the run's scratch",
            "  layer, which the agent sees and the workspace never does (no trip); not refused as",
            "  protected either, since it never reaches the workspace",
            "  a pattern matching at any depth ('**/migrations/', '*.pem') stops at a generated tree",
            "  ('.venv/', 'node_modules/') unless it matches the tree as a whole or names it ('.venv/**/x')",
            "built-in protections:",
            f"  {GUARD_DIR}/              read-only (the guard's own files)",
            f"  {DEFAULT_MANIFEST:<20} read-only, in any directory (a later run started there reads it)",
            "  .git/hooks/          read-only (git may create *.sample templates)",
            "  .git/config          read-only if it existed when the mount started",
            "  every repository (.git at any depth): .git/ and hooks/ never renamed, replaced",
            "                       or linked; hooks, commondir, info/attributes and",
            "                       objects/info/alternates read-only; config and",
            "                       config.worktree read-only if they existed, else written",
            "                       only by git and refused if they would run a program",
            "  .git/index, refs     changed only by git's lock-file rename, judged for what it changes",
            "  ORIG_HEAD, FETCH_HEAD, reflogs, rebase/am state: every write judged for the commits",
            "                       it names (and no exec line in a rebase todo)",
            "  gitfiles, worktree gitdir/commondir: every write judged for the git directory named",
            "  HEAD outside .git/   refused (a bare repository); symlinks in .git/ name siblings only",
            f"  .git/ (the rest)     {m.paths.git_internals}, not counted toward limits",
            "secret (no read, no write; EACCES, forbidden_path; git may not track them: "
            f"forbidden_in_git = {m.paths.forbidden_in_git}):",
            *(secrets or ["  (none)"]),
            "secret outside the workspace (hidden in the sandbox, with the usual credential stores):",
            *(f"  {p}" for p in outside or ["(none beyond the defaults)"]),
            "protected (readable, never written; EROFS, scope_spill; git may track them):",
            *(f"  {p}" for p in m.paths.protected or ["(none)"]),
            "generated (never counted nor kept for rollback; outside allowed: the run's scratch layer):",
            *(f"  {p}" for p in m.paths.generated or ["(none)"]),
            *([f"  and the {len(self.gitignore)} pattern(s) of .gitignore"]
              if m.paths.generated_from_gitignore else []),
            "allowed (writes land here, counted; elsewhere EROFS; beside a file allowed by name, the temporary",
            "  of an atomic save of it too: NAME.tmp.*, and sed -i's sedXXXXXX beside a file allowed by its path):",
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


#: GIT_CHECKED kinds that point at a git directory (the others name commits).
_LINK_KINDS = frozenset({"gitfile", "gitdir", "commondir"})


def _literal_file_dirs(patterns: list[str]) -> dict[str, str]:
    """The directory of each allowed pattern that is one file's literal path from the root
    (``src/tax.py``, ``/setup.cfg``: not ``setup.cfg``, which matches at any depth), with the
    first such pattern there."""
    out: dict[str, str] = {}
    for pattern in patterns:
        body = pattern.lstrip("/")
        if pattern.startswith("!") or pattern.endswith("/") or any(c in pattern for c in "*?[\\"):
            continue
        if "/" not in pattern or not body:
            continue  # no slash: it matches at any depth, in directories that cannot be listed
        out.setdefault(body.rpartition("/")[0], pattern)
    return out


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
