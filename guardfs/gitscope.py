"""Scope through git: what a new index or a moved ref would change, judged against the run's start.

The mount judges files by name, but git can change a file without touching it: a blob
written with ``git hash-object -w`` and staged with ``git update-index --cacheinfo`` lands in
the index and then in a commit, and a later ``git reset --hard`` on the host writes it to
disk. Git updates its state only through a lock file renamed over the real one
(``index.lock`` → ``index``, ``refs/heads/main.lock`` → ``refs/heads/main``,
``packed-refs.lock`` → ``packed-refs``), so that rename is where the guard looks: it reads
the new index or the new ref's tree with dulwich and refuses the rename if a path the task
may not write would differ from what it was when the run started (git then reports a
failure, and the denial reaches the breaker as any out-of-scope write does). A direct write
of those files, which git never does, is refused outright so the rename stays the one door.

What a path not in scope may hold in a new index or tree is its *baseline*: its entry in
the index or in HEAD's tree at the start, or the file as it is on disk now (which the agent
cannot change). Only the workspace's own ``.git`` directory is judged; the paths it tracks
are the workspace's paths. The policy (``git_state_locked``) makes those files read-only to
every other mutation, so the hook and the mount give one answer.

Which secrets git already holds at the start (in HEAD, the index, or anywhere else in its
stores) is not this module's: :mod:`guardfs.githistory` checks every store whole, and
``paths.forbidden_in_git`` says what to do about what it finds (see the manifest).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dulwich.diff_tree import tree_changes
from dulwich.errors import NotTreeError
from dulwich.index import ConflictedIndexEntry, IndexEntry, cleanup_mode, read_index_dict
from dulwich.object_store import DiskObjectStore, tree_lookup_path
from dulwich.objects import Commit, ObjectID, ShaFile, Tag, Tree
from dulwich.refs import read_packed_refs_with_peeled

from guardfs.backing import openat2
from guardfs.decision import ERRNO_FORBIDDEN, ERRNO_READ_ONLY, Verdict
from guardfs.errors import Exit, GuardError
from guardfs.policy import Classification, PathPolicy, Scope, is_git_state

__all__ = ["ForbiddenInGitError", "GitScope", "GitStateError"]

log = logging.getLogger(__name__)

GIT = ".git"
INDEX = ".git/index"
HEAD = ".git/HEAD"
PACKED_REFS = ".git/packed-refs"
REFS = ".git/refs"
_GIT_STATE = Classification(Scope.PROTECTED, "built-in: git's index and refs change only through their lock files")
#: Objects a check follows at most (tag chains, nested trees): a bound on the guard's work.
_MAX_PEEL = 16
#: Reflog bytes read at the start for the commits they already name.
_MAX_LOG_BYTES = 64 << 20
_SHA = re.compile(rb"\b[0-9a-f]{40}\b")
#: Objects an abbreviated name in a rebase's todo may stand for, at most (git wants one).
_MAX_PREFIX = 256
_HEX = re.compile(rb"[0-9a-f]{4,40}")
# Sequencer files git reads commands from, and those holding one commit (--abort goes back to it).
_TODO_FILES = frozenset({"git-rebase-todo", "git-rebase-todo.lock", "done", "todo", "todo.lock"})
_REF_FILES = frozenset({"onto", "orig-head", "stopped-sha", "amend", "head", "abort-safety", "original-commit",
                        "onto.lock", "orig-head.lock", "stopped-sha.lock", "amend.lock", "head.lock",
                        "abort-safety.lock"})

# What a path holds in an index or a tree: () when absent, one (mode, sha) when staged,
# several when a merge left it conflicted.
_Value = tuple[tuple[int, bytes], ...]


class GitStateError(GuardError):
    """The workspace's git state at the start cannot be read: the run does not start."""

    exit_code = Exit.DATAERR


class ForbiddenInGitError(GuardError):
    """Git tracks forbidden paths and ``paths.forbidden_in_git = "refuse"``: the run does not start."""

    exit_code = Exit.DATAERR


@dataclass(frozen=True, slots=True)
class _Change:
    """A path a new index or tree would change, and its classification."""

    path: str
    where: Classification


class GitScope:
    """The workspace's git state at the start of a run, and the judge of every later update.

    *root* is the workspace directory, opened here before the mount covers it; the guard
    reads it through that descriptor afterwards (never through its own mount).
    """

    def __init__(self, root: str | os.PathLike[str], policy: PathPolicy) -> None:
        self.policy = policy
        self._root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._git = f"/proc/self/fd/{self._root_fd}/{GIT}"
        self._start_index: dict[str, _Value] = {}
        self._head_tree: ObjectID | None = None
        self._start_refs: set[bytes] = set()
        # Commits a new reflog line or FETCH_HEAD may name without a check: those the
        # reflogs and FETCH_HEAD named at the start, and those already judged in scope.
        self._named: set[bytes] = set()
        if os.path.isdir(self._git):
            self._snapshot()

    def close(self) -> None:
        """Release the workspace's descriptor."""
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    # ----- the start ---------------------------------------------------------------

    def _snapshot(self) -> None:
        try:
            data = self._read(INDEX)
        except FileNotFoundError:
            data = None
        refs = self._loose_refs() | dict(self._packed_refs(PACKED_REFS))
        self._start_refs = set(refs.values())
        head = self._resolve_head(refs)
        try:
            if data is not None:
                self._start_index = dict(_index_values(data))
            if head is not None:
                self._head_tree = _tree_of(self._store(), head)
        except (AssertionError, ValueError) as err:  # dulwich's word for a format it does not read
            raise GitStateError(
                f"the workspace's git state (.git/index, HEAD) cannot be read ({err}); the guard judges every "
                "update of git's index and refs against it, so the run does not start. A repository whose "
                "objects are named with sha256 is not supported: run in a sha1 clone of it") from err
        self._named = set(self._start_refs)
        budget = _MAX_LOG_BYTES
        logs = [os.path.join(self._git, "FETCH_HEAD")] + [
            os.path.join(d, n) for d, _dirs, names in os.walk(os.path.join(self._git, "logs")) for n in names]
        for path in logs:
            try:
                with open(path, "rb") as f:
                    data = f.read(budget)
            except OSError:
                continue
            budget -= len(data)
            self._named.update(_SHA.findall(data))
            if budget <= 0:
                log.warning("git scope: reflogs larger than %d bytes; lines naming older commits are judged "
                            "like new ones", _MAX_LOG_BYTES)
                break

    def _loose_refs(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for dirpath, _dirs, files in os.walk(os.path.join(self._git, "refs")):
            for name in files:
                full = os.path.join(dirpath, name)
                with open(full, "rb") as f:
                    value = f.read(256).strip()
                if not value.startswith(b"ref:"):
                    out[os.path.relpath(full, self._git)] = value
        return out

    def _resolve_head(self, refs: dict[str, bytes]) -> bytes | None:
        try:
            head = self._read(HEAD).strip()
        except FileNotFoundError:
            return None
        if head.startswith(b"ref:"):
            return refs.get(os.fsdecode(head[4:].strip()))
        return head

    # ----- reading the workspace ---------------------------------------------------

    def _read(self, path: str) -> bytes:
        fd = openat2(self._root_fd, path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def _store(self) -> DiskObjectStore:
        # A fresh store each time: git adds packs and loose objects as the run goes on.
        return DiskObjectStore(os.path.join(self._git, "objects"))

    def _packed_refs(self, path: str) -> Iterator[tuple[str, bytes]]:
        try:
            data = self._read(path)
        except FileNotFoundError:
            return
        body = b"".join(line for line in io.BytesIO(data) if not line.startswith(b"#"))
        for sha, name, _peeled in read_packed_refs_with_peeled(io.BytesIO(body)):
            yield os.fsdecode(name), sha

    def _on_disk(self, path: str) -> _Value:
        """The blob git would stage for *path* as it is on disk now, or () if there is none."""
        parent, _, name = path.rpartition("/")
        try:
            dir_fd = openat2(self._root_fd, parent or ".", os.O_PATH | os.O_DIRECTORY)
        except OSError:
            return ()
        try:
            st = os.lstat(name, dir_fd=dir_fd)
            if stat.S_ISLNK(st.st_mode):
                return ((stat.S_IFLNK, _blob_id(os.fsencode(os.readlink(name, dir_fd=dir_fd)))),)
            if not stat.S_ISREG(st.st_mode):
                return ()
            digest = hashlib.sha1(b"blob %d\0" % st.st_size)  # noqa: S324 (git's object id)
            fd = openat2(dir_fd, name, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            return ((cleanup_mode(st.st_mode), digest.hexdigest().encode()),)
        except OSError:
            return ()
        finally:
            os.close(dir_fd)

    def committed_version(self, path: str, data: bytes) -> bool:
        """Whether git holds *data* as a blob: what git itself writes back to *path* in a
        ``git stash (pop)``, ``git checkout``, ``git rebase`` or ``git reset --hard``
        (asked only for a write by the git binary that returns a file to an earlier version)."""
        del path  # any blob git holds: what it checks out comes from its object store
        try:
            return ObjectID(_blob_id(data)) in self._store()
        except (OSError, ValueError):
            return False

    def log_problem(self, kind: str, data: bytes, name: str = "") -> str | None:
        """What is wrong with the lines *data* of a reflog or FETCH_HEAD (*kind*), or None:
        every commit they name (a reflog line's old and new value, FETCH_HEAD's first field)
        is judged as a ref moved to it would be, since ``git reset --hard HEAD@{1}``, ``git
        stash pop`` or ``git merge FETCH_HEAD`` on the host would check it out. A "sequencer"
        file (*name*, in a rebase/am/cherry-pick state directory) has no exec line, names
        (in full or abbreviated) only such commits, and patches only paths in scope."""
        store: DiskObjectStore | None = None
        for line in data.splitlines():
            if kind == "sequencer":
                why, names = self._sequencer_line(name, line)
                if why is not None:
                    return why
            else:
                fields = line.split(b"\t", 1)[0].split(b" ")
                names = fields[:2] if kind == "reflog" else fields[:1]
            for sha in names:
                if sha in self._named or sha.strip(b"0") == b"":
                    continue
                store = store or self._store()
                try:
                    shas = [sha] if len(sha) == 40 else list(itertools.islice(store.iter_prefix(sha), _MAX_PREFIX))
                    if len(shas) >= _MAX_PREFIX:
                        return f"it names {sha.decode()}, a prefix of more objects than the guard judges"
                    change = next((c for s in shas if (c := self._judge_commit(store, s)) is not None), None)
                except (OSError, ValueError, KeyError, NotTreeError, AssertionError) as err:
                    return f"it names {sha.decode()}, which the guard cannot read ({err})"
                if change is not None:
                    return (f"it names commit {sha.decode()}, which changes {change.path} ({_what(change.where)}: "
                            f"{change.where.describe()})")
                self._named.add(sha)
        return None

    def _sequencer_line(self, name: str, line: bytes) -> tuple[str | None, list[bytes]]:
        """A line of a rebase/am/cherry-pick state file: what is wrong with it, or the
        object names it gives (a todo line's commit, a ref-like file's value)."""
        words = line.split()
        if not words:
            return None, []
        if name in _TODO_FILES:
            if words[0] in (b"exec", b"x"):
                return ("it holds an exec line, which would run on the host when someone continues the "
                        "rebase; run commands yourself instead"), []
            return None, [w for w in words[1:3] if _HEX.fullmatch(w)][:1]
        if name in _REF_FILES:
            return None, [words[0]] if _HEX.fullmatch(words[0]) else []
        if line.startswith(b"diff --git "):
            for path in re.findall(rb"(?:^| )[ab]/(\S+)", line[len(b"diff --git "):]):
                where = self.policy.classify(os.fsdecode(path), False)
                if where.scope is not Scope.ALLOWED:
                    return (f"it holds a patch to {os.fsdecode(path)}, which a later `git am --continue` would "
                            f"apply ({where.describe()})"), []
        return None, []

    # ----- judging an update -------------------------------------------------------

    def judge_rename(
        self, src: str, dst: str, src_is_dir: bool, held_open: Callable[[], bool] = lambda: False,
    ) -> Verdict | None:
        """The denial of renaming *src* over git state *dst*, or None if it changes nothing
        the task may not change. Renames onto other names are not git's state: None.
        *held_open*: *src* is open for writing, so what is judged now could change after."""
        if src_is_dir and (dst in (GIT, REFS) or dst.startswith(REFS + "/")):
            return _deny(REFS, Classification(Scope.PROTECTED, "built-in: git's refs"), ERRNO_READ_ONLY,
                         f"moving the directory {src} to {dst} would replace git's refs wholesale")
        if not is_git_state(dst):
            return None
        if held_open():
            return _deny(dst, _GIT_STATE, ERRNO_READ_ONLY, (
                f"{src} is still open for writing: renaming it to {dst} would let it change after "
                "the guard read it; close it first (git does)"))
        try:
            change = self._judge(src, dst)
        except (OSError, ValueError, KeyError, NotTreeError, AssertionError) as err:
            # Fail closed: what the guard cannot read, it cannot let land.
            return _deny(dst, Classification(Scope.PROTECTED, "built-in: git state the guard can read"),
                         ERRNO_READ_ONLY, f"guardfs could not read the new {dst} in {src} ({err}); "
                         "git state the guard cannot check is refused")
        if change is None:
            return None
        where = change.where
        code = ERRNO_FORBIDDEN if where.scope is Scope.FORBIDDEN else ERRNO_READ_ONLY
        return _deny(change.path, where, code, (
            f"git: renaming {src} to {dst} would change {change.path}, which is {_what(where)} "
            f"({where.describe()}); commit and stage only paths the task may write"))

    def _judge(self, src: str, dst: str) -> _Change | None:
        if dst == INDEX:
            return self._judge_index(self._read(src))
        store = self._store()
        if dst == PACKED_REFS:
            for _name, sha in self._packed_refs(src):
                if (change := self._judge_commit(store, sha)) is not None:
                    return change
            return None
        value = self._read(src).strip()
        if value.startswith(b"ref:"):
            return None  # a symbolic ref names a ref; every ref's own value is judged when it moves
        return self._judge_commit(store, value)

    def _judge_index(self, data: bytes) -> _Change | None:
        new = dict(_index_values(data))
        start = self._start_index
        changed = [p for p, v in new.items() if start.get(p) != v]
        changed += [p for p in start if p not in new]
        store = self._store() if changed else None
        for path in changed:
            if store is not None and (change := self._check(store, path, new.get(path, ()))) is not None:
                return change
        return None

    def _judge_commit(self, store: DiskObjectStore, sha: bytes) -> _Change | None:
        if sha in self._start_refs:
            return None  # a commit a ref named at the start: the host's own history
        tree = _tree_of(store, sha)
        if tree is None:
            return None  # a ref to a blob: nothing git would check out
        return self._judge_tree(store, tree)

    def _judge_tree(self, store: DiskObjectStore, tree: ObjectID) -> _Change | None:
        for change in tree_changes(store, self._head_tree, tree):
            new = change.new if change.new is not None and change.new.path is not None else None
            named = new or change.old
            if named is None or named.path is None:
                continue
            value: _Value = () if new is None else ((cleanup_mode(new.mode or 0), bytes(new.sha or b"")),)
            if (found := self._check(store, os.fsdecode(named.path), value)) is not None:
                return found
        return None

    def _check(self, store: DiskObjectStore, path: str, value: _Value) -> _Change | None:
        """A change of *path* to *value*, unless the task may write it or it is the baseline."""
        where = self.policy.classify(path, False)
        if where.scope is Scope.ALLOWED:
            return None
        if value == self._start_index.get(path, ()) or value == self._head_value(store, path):
            return None
        if value == self._on_disk(path):
            return None
        return _Change(path, where)

    def _head_value(self, store: DiskObjectStore, path: str) -> _Value:
        if self._head_tree is None:
            return ()
        try:
            mode, sha = tree_lookup_path(store.__getitem__, self._head_tree, os.fsencode(path))
        except (KeyError, NotTreeError):
            return ()
        return ((cleanup_mode(mode), sha),)


def _what(where: Classification) -> str:
    """What a path git may not record is, in a refusal's words."""
    if where.scope is Scope.FORBIDDEN:
        return "forbidden"
    if where.scope in (Scope.GENERATED, Scope.GENERATED_OUTSIDE):
        return "generated output, kept apart from the workspace (ignore it in .gitignore)"
    return "outside the task's scope"


def _deny(path: str, where: Classification, err: int, reason: str) -> Verdict:
    log.info("git scope: %s (%s)", reason, path)
    return Verdict(False, where.key, where.pattern, err, reason)


def _blob_id(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest().encode()  # noqa: S324


def _index_values(data: bytes) -> Iterator[tuple[str, _Value]]:
    """Each path of an index file and what it holds (the checksum trailer is not checked:
    git wrote it, and a torn index fails to parse)."""
    if len(data) < 12 or data[:4] != b"DIRC":
        raise ValueError("not a git index (no DIRC header)")
    for name, entry in read_index_dict(io.BytesIO(data)).items():
        if isinstance(entry, IndexEntry):
            yield os.fsdecode(name), ((cleanup_mode(entry.mode), entry.sha),)
        elif isinstance(entry, ConflictedIndexEntry):
            stages = (entry.ancestor, entry.this, entry.other)
            yield os.fsdecode(name), tuple((cleanup_mode(e.mode), e.sha) for e in stages if e is not None)


def _tree_of(store: DiskObjectStore, sha: bytes) -> ObjectID | None:
    """The tree a commit (or a tag of one) names; None for a blob."""
    obj: ShaFile = store[ObjectID(sha)]
    for _ in range(_MAX_PEEL):
        if isinstance(obj, Tag):
            obj = store[obj.object[1]]
        elif isinstance(obj, Commit):
            tree: ObjectID = obj.tree
            return tree
        elif isinstance(obj, Tree):
            return ObjectID(obj.id)
        else:
            return None
    raise ValueError(f"{sha.decode(errors='replace')}: a tag chain longer than {_MAX_PEEL}")

