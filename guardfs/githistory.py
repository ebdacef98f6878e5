"""Secrets anywhere in git: every repository of the workspace, every object of its store.

``git show HEAD~1:.env`` reads a secret that HEAD no longer tracks, and so do another
branch, a tag, the stash, a reflog entry, and an object no ref names at all (``git
cat-file --batch-all-objects`` lists them, ``git fsck --lost-found`` names them). So at
start the guard checks, in each repository of the workspace (its own, every nested one with
a ``.git`` of its own, ignored or not, every linked worktree's and submodule's git
directory, a gitfile resolved to where it points), every path git holds anywhere:

- **commits**: one ``git log`` over every ref, HEAD, every reflog (the stash's entries are a
  reflog) and every *dangling* commit (``git fsck --connectivity-only``: unreachable, and
  no other unreachable object names it), with the paths each commit adds or changes against
  its first parent (all of a root commit's): every path of every commit's tree is added by
  some commit on the way to it, so every path is seen once where it appears, at C speed.
  Each path is judged as the workspace path it would check out to (a nested repository's
  below its directory).
- **trees no commit holds** (a ``git write-tree`` left behind, a tag or ref naming a tree):
  read entry by entry. Where such a tree would land is unknown, so its paths are judged as
  if placed anywhere: every trailing part of a secret pattern matches at any depth
  (``config/secrets/*.yml`` then catches any ``*.yml`` in it: the safe side, a refusal
  with the way out). The tree's own name is unknown, so a pattern's directory part alone
  (``secrets/``) is not matched against the tree itself, only against names in it.
- **blobs no tree holds** (``git add .env`` then ``git rm --cached .env``, a tag of a
  blob): a blob has no name, so no pattern can judge it. Each secret file of the workspace
  is hashed as git would and looked for among those blobs: the secret as it is on disk now
  is found; an older version of it, lying nameless in the store, cannot be told from any
  other blob (said in SECURITY.md; ``git gc --prune=now`` removes them).
- **indexes**: the paths staged in every index of the repository (a linked worktree's too).

The result (what the commits and trees hold) is cached in the guard's state directory,
keyed by the object store's state (each pack's name, size and times, each loose-object
directory's times and inode: a change time is set by the kernel, never by a user),
the refs and reflogs, and the secret patterns, so the next run over the same store pays
a few ``stat`` calls. A store larger than :data:`MAX_OBJECTS`, or a walk longer than
:data:`MAX_SECONDS`, is not walked: the scan says so and the run fails closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pathspec
from dulwich.index import read_index_dict

from guardfs.gitguard import GITFILE_PREFIX, link_value
from guardfs.harvest import walk
from guardfs.links import StartWalk, walk_workspace

__all__ = ["MAX_OBJECTS", "MAX_SECONDS", "Found", "HistoryTooLarge", "Repository", "Scan", "common_dir_of",
           "find_repositories", "resolve_gitfile", "scan_repository", "secret_files", "tail_spec"]

log = logging.getLogger(__name__)

#: A store with more objects than this is not walked (the run fails closed, saying so).
MAX_OBJECTS = 5_000_000
#: The walk's git processes may take this long, together, at most.
MAX_SECONDS = 300.0
#: Repositories the workspace may hold and the guard checks, at most (beyond: fail closed).
MAX_REPOSITORIES = 200
#: A store with more objects than this is said aloud before its first walk (it takes a while).
_SAY_FROM = 100_000
#: Commits named per secret path in a refusal, at most.
_COMMITS_PER_PATH = 3
#: Cache files kept (the oldest go first).
_CACHE_KEEP = 64
#: A secret file larger than this is not hashed for the nameless-blob check.
_MAX_HASHED = 64 << 20
#: Version of what a cache file holds: a change of the walk invalidates every entry.
_CACHE_VERSION = 1

_Secret = Callable[[str], bool]


class HistoryTooLarge(Exception):
    """The store is too large (or the walk too slow) to check; the message says which."""


@dataclass(frozen=True, slots=True)
class Repository:
    """A repository of the workspace: where its work tree is (workspace-relative, "" for the
    root; None for a git directory no work tree of the workspace uses), its git directory
    and its common directory (where objects and refs live), absolute."""

    prefix: str | None
    git_dir: str
    common_dir: str

    @property
    def label(self) -> str:
        """How a message names it."""
        if self.prefix is None:
            return f"the git directory {self.git_dir}"
        return "the workspace's repository" if self.prefix == "" else f"the repository in {self.prefix}/"


@dataclass(frozen=True, slots=True)
class Found:
    """A secret path git holds, and where: commits (short names, with the ref that reaches
    each, when one does), "unreachable tree <hash>", "the index", or a nameless blob."""

    path: str
    where: tuple[str, ...]


@dataclass
class Scan:
    """What one repository's check found, and what it cost."""

    repository: Repository
    found: list[Found] = field(default_factory=list)
    objects: int = 0
    seconds: float = 0.0
    cached: bool = False


# ----- finding the repositories ---------------------------------------------------------


def resolve_gitfile(where: str) -> str | None:
    """The git directory a gitfile at *where* (a ``.git`` that is a file) names, absolute, or
    None when it is not one. Read as data at start (never followed later)."""
    try:
        with open(where, "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    if not data.startswith(GITFILE_PREFIX):
        return None
    value = link_value(data[len(GITFILE_PREFIX):])
    return os.path.normpath(os.path.join(os.path.dirname(where), value))


def common_dir_of(git_dir: str) -> str:
    """The common directory of *git_dir* (its ``commondir`` resolved; itself without one)."""
    try:
        with open(os.path.join(git_dir, "commondir"), "rb") as f:
            value = link_value(f.read(4096))
    except OSError:
        return git_dir
    return os.path.normpath(os.path.join(git_dir, value)) if value else git_dir


def _is_git_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "objects")) or os.path.isfile(os.path.join(path, "commondir"))


def find_repositories(root: str, walked: StartWalk | None = None) -> list[Repository]:
    """Every repository whose files the workspace *root* holds or points at: each ``.git``
    (directory or gitfile) at any depth, and each submodule git directory kept below a
    git directory (``modules/<name>``, checked out or not). *walked*: the walk of the
    workspace at start (guardfs.links), made here without. Raises HistoryTooLarge past
    :data:`MAX_REPOSITORIES`."""
    found: dict[str, Repository] = {}
    git_dirs: list[str] = []
    walked = walked if walked is not None else walk_workspace(root)
    for prefix, where, is_dir in walked.gits:  # any depth: an agent may leave a deep tree
        if is_dir:
            git_dirs.append(where)
            found.setdefault(where, Repository(prefix, where, where))  # its insides are git's, looked at below
        elif (target := resolve_gitfile(where)) is not None and _is_git_dir(target):
            found.setdefault(target, Repository(prefix, target, common_dir_of(target)))
        if len(found) > MAX_REPOSITORIES:
            raise HistoryTooLarge(f"more than {MAX_REPOSITORIES} git repositories in the workspace")
    # Submodules' git directories (below any git directory found, and below the common
    # directories of the gitfiles'), whether a work tree of the workspace uses them or not.
    stores = dict.fromkeys([*git_dirs, *(r.common_dir for r in found.values())])
    for git_dir in stores:
        for dirpath, dirnames, _files in walk(os.path.join(git_dir, "modules")):
            if _is_git_dir(dirpath) and os.path.exists(os.path.join(dirpath, "HEAD")):
                found.setdefault(os.path.normpath(dirpath), Repository(None, dirpath, common_dir_of(dirpath)))
                dirnames[:] = [d for d in dirnames if d == "modules"]
            if len(found) > MAX_REPOSITORIES:
                raise HistoryTooLarge(f"more than {MAX_REPOSITORIES} git repositories in the workspace")
    for repo in list(found.values()):
        if not os.path.isdir(os.path.join(repo.common_dir, "objects")):
            del found[repo.git_dir]
    return sorted(found.values(), key=lambda r: (r.prefix is None, r.prefix or "", r.git_dir))


# ----- the secret patterns, for trees whose place is unknown ----------------------------


def tail_spec(patterns: list[str]) -> pathspec.GitIgnoreSpec:
    """A matcher for paths whose place is unknown (inside a tree no commit holds): every
    trailing part of every (non-negated) secret pattern, matching at any depth."""
    lines: list[str] = []
    for pattern in patterns:
        body = pattern.strip()
        if not body or body.startswith(("#", "!")):
            continue
        directory = body.endswith("/")
        segments = [s for s in body.strip("/").split("/") if s]
        for i in range(len(segments)):
            tail = "/".join(segments[i:])
            if tail == "**":
                continue
            lines.append("**/" + tail + ("/" if directory else ""))
    return pathspec.GitIgnoreSpec.from_lines(lines)


# ----- the walk -------------------------------------------------------------------------


def _env(common_dir: str) -> dict[str, str]:
    """git's environment for the walk: no configuration but the store's own (the agent may
    have written it: the walk's commands run no program it names, and no transport, so a
    partial clone's missing object is never fetched), no replace objects, no locks taken."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent", "LC_ALL": "C",
            "GIT_DIR": common_dir, "GIT_NO_REPLACE_OBJECTS": "1", "GIT_OPTIONAL_LOCKS": "0",
            "GIT_NO_LAZY_FETCH": "1", "GIT_ALLOW_PROTOCOL": "none", "GIT_TERMINAL_PROMPT": "0",
            "GIT_CONFIG_PARAMETERS": "'core.fsmonitor=false' 'core.hooksPath=/dev/null' 'safe.directory=*' "
                                     "'protocol.allow=never' 'core.pager=cat'"}


def _git(common_dir: str, *args: str, stdin: bytes | None = None, deadline: float) -> bytes:
    env = _env(common_dir)
    left = deadline - time.monotonic()
    if left <= 0:
        raise HistoryTooLarge(f"the check took longer than {MAX_SECONDS:.0f} s")
    try:
        proc = subprocess.run(["git", *args], input=stdin, env=env, cwd="/", capture_output=True,
                              timeout=left, check=False)
    except subprocess.TimeoutExpired as err:
        raise HistoryTooLarge(f"the check took longer than {MAX_SECONDS:.0f} s") from err
    if proc.returncode != 0:
        raise OSError(f"git {args[0]} failed in {common_dir}: "
                      f"{proc.stderr.decode(errors='replace').strip()[-500:] or proc.returncode}")
    return proc.stdout


def _count_objects(common_dir: str, deadline: float) -> int:
    out = _git(common_dir, "count-objects", "-v", deadline=deadline).decode()
    fields = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return int(fields.get("count", "0")) + int(fields.get("in-pack", "0"))


def _log_paths(common_dir: str, commits: list[str], deadline: float) -> Iterator[tuple[str, str]]:
    """(commit, path) for every path each commit adds or changes: over every ref, HEAD and
    reflog when *commits* is None; else over *commits* (the dangling ones) and the commits
    only they reach."""
    refs = ["--all", "--reflog"]
    args = refs if not commits else ["--stdin", "--not", *refs]
    out = _git(common_dir, "log", *args, "--root", "--diff-merges=first-parent", "--no-renames",
               "--diff-filter=d", "--name-only", "-z", "--format=%x01%H", "--ignore-missing",
               stdin="".join(c + "\n" for c in commits).encode() if commits else None, deadline=deadline)
    for chunk in out.split(b"\x01"):
        if len(chunk) < 40:
            continue
        sha, rest = chunk[:40].decode(), chunk[40:]
        rest = rest[2:] if rest.startswith(b"\0\n") else rest[1:] if rest.startswith(b"\0") else rest
        for name in rest.split(b"\0"):
            if name:
                yield sha, os.fsdecode(name)


class _Dangling:
    """``git fsck --connectivity-only --dangling``, run alongside the walk of the refs: the
    dangling objects by type (commit, tree, blob, tag), unreachable from every ref, reflog,
    index and HEAD, and named by no other unreachable object."""

    def __init__(self, common_dir: str) -> None:
        self.common_dir = common_dir
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (fsck's stderr, held until it ends)
        self._proc = subprocess.Popen(["git", "fsck", "--connectivity-only", "--dangling", "--no-progress"],
                                      env=_env(common_dir), cwd="/", stdout=subprocess.PIPE, stderr=self._err,
                                      stdin=subprocess.DEVNULL)

    def wait(self, deadline: float) -> dict[str, list[str]]:
        """fsck's list, once it ends (HistoryTooLarge past *deadline*)."""
        try:
            out, _ = self._proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            # fsck exits non-zero for missing objects (a partial clone, a store pruned by
            # hand) and still lists what dangles: its list is used, its complaint logged.
            if self._proc.returncode != 0:
                self._err.seek(0)
                log.warning("git fsck in %s: %s", self.common_dir, self._err.read()[-300:].decode(errors="replace"))
        except subprocess.TimeoutExpired as err:
            raise HistoryTooLarge(f"the check took longer than {MAX_SECONDS:.0f} s") from err
        finally:
            self.close()
        found: dict[str, list[str]] = {}
        for line in out.decode(errors="replace").splitlines():
            words = line.split()
            if len(words) == 3 and words[0] == "dangling":
                found.setdefault(words[1], []).append(words[2])
        return found

    def close(self) -> None:
        """Stop fsck (if still running) and release its files."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        if not self._err.closed:
            self._err.close()


def _objects(common_dir: str, shas: list[str], deadline: float) -> dict[str, tuple[str, bytes]]:
    """sha → (type, content) for *shas*, read with one ``git cat-file --batch``."""
    if not shas:
        return {}
    out = _git(common_dir, "cat-file", "--batch", stdin="".join(s + "\n" for s in shas).encode(),
               deadline=deadline)
    got: dict[str, tuple[str, bytes]] = {}
    pos = 0
    while pos < len(out):
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        pos = end + 1
        if len(header) < 3:  # "<sha> missing"
            continue
        size = int(header[2])
        got[header[0].decode()] = (header[1].decode(), out[pos:pos + size])
        pos += size + 1
    return got


def _tree_entries(data: bytes) -> Iterator[tuple[int, str, str]]:
    """(mode, name, sha) of each entry of a raw tree object."""
    pos = 0
    while pos < len(data):
        space = data.index(b" ", pos)
        nul = data.index(b"\0", space)
        yield int(data[pos:space], 8), os.fsdecode(data[space + 1:nul]), data[nul + 1:nul + 21].hex()
        pos = nul + 21


def _walk_trees(common_dir: str, roots: list[str], is_secret: _Secret, deadline: float,
                budget: int) -> dict[str, list[str]]:
    """The secret paths (relative to each of *roots*, trees whose place is unknown), with
    the root each lies in; reads tree objects level by level, each (tree, prefix) once."""
    found: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()
    level = [(r, "", r) for r in roots]
    read = 0
    while level:
        contents = _objects(common_dir, list(dict.fromkeys(t for t, _p, _r in level)), deadline)
        following: list[tuple[str, str, str]] = []
        for tree, prefix, root in level:
            kind, data = contents.get(tree, ("missing", b""))
            if kind != "tree":
                continue
            for mode, name, sha in _tree_entries(data):
                path = f"{prefix}{name}"
                is_dir = stat.S_ISDIR(mode)
                if is_secret(path + "/" if is_dir else path):
                    found.setdefault(path, []).append(f"tree {root[:12]}, which no commit holds")
                if is_dir and (sha, path) not in seen:
                    seen.add((sha, path))
                    following.append((sha, path + "/", root))
        read += len(contents)
        if read > budget:
            raise HistoryTooLarge(f"more than {budget} trees outside every commit")
        level = following
    return found


def _peel_refs(common_dir: str, deadline: float) -> tuple[list[str], list[str]]:
    """Trees and blobs that a ref names directly or through tags (no commit holds them)."""
    out = _git(common_dir, "for-each-ref", "--format=%(objecttype) %(objectname) %(*objecttype) %(*objectname)",
               deadline=deadline).decode()
    trees, blobs = [], []
    for line in out.splitlines():
        words = line.split()
        kind, sha = (words[2], words[3]) if len(words) == 4 else (words[0], words[1])
        if kind == "tree":
            trees.append(sha)
        elif kind == "blob":
            blobs.append(sha)
    return trees, blobs


def _peel_tags(common_dir: str, tags: list[str], deadline: float) -> Iterator[tuple[str, str]]:
    """(type, object) that each of the dangling *tags* names in the end (through tag chains,
    at most 16 deep)."""
    for _ in range(16):
        if not tags:
            return
        chained = []
        for _kind, data in _objects(common_dir, tags, deadline).values():
            head = data.split(b"\n", 2)
            target = head[0].split()[-1].decode() if head and head[0].startswith(b"object ") else ""
            kind = head[1].split()[-1].decode() if len(head) > 1 and head[1].startswith(b"type ") else ""
            if kind == "tag":
                chained.append(target)
            elif target:
                yield kind, target
        tags = chained


def _walk(repo: Repository, classify_path: _Secret, tails: pathspec.GitIgnoreSpec,
          max_objects: int) -> tuple[dict[str, list[str]], list[str], int]:
    """The secret paths of *repo*'s store (with where each lives, commits as full hashes),
    the nameless blobs, and the number of objects."""
    deadline = time.monotonic() + MAX_SECONDS
    common = repo.common_dir
    # The walk reads SHA-1 names and tree entries: a SHA-256 store's would be misread, its
    # secrets missed without a word (issue 22). Said instead: the run then fails closed.
    kind = _git(common, "rev-parse", "--show-object-format", deadline=deadline).decode().strip()
    if kind != "sha1":
        raise ValueError(f"its objects are named with {kind}; the check reads sha1 stores only")
    objects = _count_objects(common, deadline)
    if objects > max_objects:
        raise HistoryTooLarge(f"{objects} objects (the guard walks at most {max_objects})")
    if objects > _SAY_FROM:
        log.warning("checking git's history for secrets in %s: %d objects, not checked before; this can take "
                    "a minute or more (at most %.0f s), and the next run over the same store pays nothing",
                    repo.label, objects, MAX_SECONDS)
    found: dict[str, list[str]] = {}
    prefix = "" if repo.prefix in ("", None) else f"{repo.prefix}/"
    judge = classify_path if repo.prefix is not None else tails.match_file
    judged: dict[str, bool] = {}

    def record(paths: Iterator[tuple[str, str]]) -> None:
        for sha, path in paths:
            full = prefix + path
            hit = judged.get(full)
            if hit is None:
                # every directory on the way is judged too (a pattern naming a directory)
                parts = full.split("/")
                hit = judged[full] = any(judge("/".join(parts[:i]) + "/") for i in range(1, len(parts))) \
                    or judge(full)
            if hit:
                commits = found.setdefault(full, [])
                if len(commits) < _COMMITS_PER_PATH and sha not in commits:
                    commits.append(sha)

    fsck = _Dangling(common)
    try:
        record(_log_paths(common, [], deadline))
        dangling = fsck.wait(deadline)
    finally:
        fsck.close()
    ref_trees, blobs = _peel_refs(common, deadline)
    commits = list(dangling.get("commit", []))
    for tag in _peel_tags(common, dangling.get("tag", []), deadline):
        {"commit": commits, "tree": ref_trees, "blob": blobs}.get(tag[0], []).append(tag[1])
    if commits:
        record(_log_paths(common, commits, deadline))
    trees = list(dict.fromkeys([*dangling.get("tree", []), *ref_trees]))
    in_trees = _walk_trees(common, trees, tails.match_file, deadline, max_objects)
    for path, where in in_trees.items():
        found.setdefault(path, []).extend(where[:_COMMITS_PER_PATH])
    return found, list(dict.fromkeys([*dangling.get("blob", []), *blobs])), objects


# ----- the cache ------------------------------------------------------------------------


def _stat_key(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _store_state(common_dir: str, depth: int = 0) -> list[object]:
    """What the cache key holds of the store: packs, loose-object directories, alternates,
    refs and reflogs (names, sizes, inodes, modification and change times)."""
    objects = os.path.join(common_dir, "objects")
    state: list[object] = [common_dir, _stat_key(objects)]
    with contextlib.suppress(OSError), os.scandir(objects) as it:
        for entry in sorted(it, key=lambda e: e.name):
            state.append([entry.name, _stat_key(entry.path)])
    with contextlib.suppress(OSError), os.scandir(os.path.join(objects, "pack")) as it:
        for entry in sorted(it, key=lambda e: e.name):
            state.append([entry.name, _stat_key(entry.path)])
    alternates = os.path.join(objects, "info", "alternates")
    with contextlib.suppress(OSError), open(alternates, "rb") as f:
        for line in f.read(1 << 16).splitlines():
            alt = os.path.normpath(os.path.join(objects, os.fsdecode(line.strip())))
            if line.strip() and not line.startswith(b"#") and depth < 5:
                state.append(_store_state(os.path.dirname(alt), depth + 1))
    for name in ("HEAD", "packed-refs", "refs", "logs"):
        top = os.path.join(common_dir, name)
        state.append([name, _stat_key(top)])
        for dirpath, _dirs, files in walk(top):
            state.append([os.path.relpath(dirpath, common_dir), _stat_key(dirpath)])
            state += [[n, _stat_key(os.path.join(dirpath, n))] for n in sorted(files)]
    with contextlib.suppress(OSError), os.scandir(os.path.join(common_dir, "worktrees")) as it:
        for entry in sorted(it, key=lambda e: e.name):  # each worktree's HEAD and reflogs
            for name in ("HEAD", "logs"):
                for dirpath, _dirs, files in walk(os.path.join(entry.path, name)):
                    state += [[os.path.join(dirpath, n), _stat_key(os.path.join(dirpath, n))] for n in sorted(files)]
                state.append([entry.name, name, _stat_key(os.path.join(entry.path, name))])
    return state


def _cache_key(repo: Repository, patterns: list[str], max_objects: int) -> str:
    body = json.dumps([_CACHE_VERSION, repo.prefix, patterns, max_objects, _store_state(repo.common_dir)])
    return hashlib.sha256(body.encode()).hexdigest()


def _cache_read(cache_dir: Path | None, key: str) -> dict[str, object] | None:
    if cache_dir is None:
        return None
    try:
        with open(cache_dir / f"{key}.json", encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("key") == key else None


def _cache_write(cache_dir: Path | None, key: str, value: dict[str, object]) -> None:
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = cache_dir / f".{key}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            json.dump({**value, "key": key}, f)
        os.replace(tmp, cache_dir / f"{key}.json")
        entries = sorted(cache_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-_CACHE_KEEP]:
            old.unlink(missing_ok=True)
    except OSError as err:  # a speed-up only: the next run walks again
        log.warning("git history: cache not written in %s (%s)", cache_dir, err)


# ----- one repository -------------------------------------------------------------------


def _index_paths(repo: Repository) -> Iterator[str]:
    """The paths staged in every index of *repo* (its own, and its linked worktrees')."""
    indexes = [os.path.join(repo.git_dir, "index"), os.path.join(repo.common_dir, "index")]
    with contextlib.suppress(OSError), os.scandir(os.path.join(repo.common_dir, "worktrees")) as it:
        indexes += [os.path.join(e.path, "index") for e in it]
    for path in dict.fromkeys(indexes):
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data[:4] != b"DIRC":
                continue
            names = read_index_dict(io.BytesIO(data))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AssertionError) as err:
            log.warning("git history: index %s unreadable (%s)", path, err)
            continue
        yield from (os.fsdecode(n) for n in names)


def _blob_id(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_HASHED:
            return None
        digest = hashlib.sha1(b"blob %d\0" % st.st_size)  # noqa: S324 (git's object id)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def secret_files(root: str, is_secret: _Secret, walked: StartWalk | None = None) -> dict[str, str]:
    """Git's blob id → workspace path, for each secret regular file of the workspace *root*
    (git directories not entered); *walked*: the walk of the workspace at start (its secrets
    judged by its policy or *is_secret*), made here without."""
    walked = walked if walked is not None else walk_workspace(root, is_secret=is_secret)
    out: dict[str, str] = {}
    for path in walked.secrets:
        if (blob := _blob_id(os.path.join(walked.root, path))) is not None:
            out[blob] = path
    return out


def scan_repository(repo: Repository, is_secret: _Secret, patterns: list[str], *,
                    cache_dir: Path | None = None, max_objects: int = MAX_OBJECTS,
                    secrets_on_disk: Callable[[], dict[str, str]] | None = None) -> Scan:
    """Every secret path *repo* holds anywhere (see the module's doc). *is_secret* judges a
    workspace path ('/'-terminated for a directory); *patterns* are the secret patterns
    (for trees whose place is unknown, and the cache key). *secrets_on_disk* gives the
    workspace's secret files by blob id (asked only when the store holds nameless blobs).
    Raises HistoryTooLarge, or OSError when git cannot read the store."""
    started = time.monotonic()
    scan = Scan(repo)
    key = _cache_key(repo, patterns, max_objects)
    cached = _cache_read(cache_dir, key)
    if cached is not None:
        found = {str(k): [str(x) for x in v] for k, v in dict(cached.get("found", {})).items()}  # type: ignore[call-overload]
        blobs = [str(b) for b in list(cached.get("blobs", []))]  # type: ignore[call-overload]
        scan.objects = int(cached.get("objects", 0))  # type: ignore[call-overload]
        scan.cached = True
    else:
        found, blobs, scan.objects = _walk(repo, is_secret, tail_spec(patterns), max_objects)
        _cache_write(cache_dir, key, {"found": found, "blobs": blobs, "objects": scan.objects})
    prefix = "" if repo.prefix in ("", None) else f"{repo.prefix}/"
    staged = sorted({prefix + p for p in _index_paths(repo) if is_secret(prefix + p)})
    for path in staged:
        found.setdefault(path, []).insert(0, "the index")
    if blobs and secrets_on_disk is not None:
        on_disk = secrets_on_disk()
        for blob in blobs:
            if blob in on_disk:
                found.setdefault(on_disk[blob], []).append(f"unreachable blob {blob[:12]} (its content as it is now)")
    names = _name_commits(repo, {c for where in found.values() for c in where if len(c) == 40})
    scan.found = [Found(path, tuple(names.get(w, w) for w in where)) for path, where in sorted(found.items())]
    scan.seconds = time.monotonic() - started
    log.info("git history: %s: %d objects, %d secret path(s), %.2f s%s", repo.label, scan.objects,
             len(scan.found), scan.seconds, " (cached)" if scan.cached else "")
    return scan


def _name_commits(repo: Repository, commits: set[str]) -> dict[str, str]:
    """A short name for each of *commits*: its hash, with the ref that reaches it (``git
    name-rev``), or saying that only a reflog or nothing does."""
    if not commits:
        return {}
    ordered = sorted(commits)
    try:
        out = _git(repo.common_dir, "name-rev", "--name-only", *ordered,
                   deadline=time.monotonic() + 60).decode().splitlines()
    except (OSError, HistoryTooLarge):
        out = ["undefined"] * len(ordered)
    names: dict[str, str] = {}
    for sha, name in zip(ordered, out, strict=False):
        if name.startswith("stash"):
            names[sha] = f"commit {sha[:12]} (stash@{{0}}{name[5:]})"
        elif name and name != "undefined":
            names[sha] = f"commit {sha[:12]} ({name})"
        else:
            names[sha] = f"commit {sha[:12]} (on no branch or tag: a reflog, an older stash entry, or unreachable)"
    return names


# ----- the workspace --------------------------------------------------------------------


@dataclass
class WorkspaceScan:
    """Every repository of a workspace and what each holds; *problem* says why the check
    could not be made (then nothing is known: the caller fails closed)."""

    scans: list[Scan] = field(default_factory=list)
    problem: str | None = None

    @property
    def found(self) -> list[tuple[Repository, Found]]:
        """Each secret path found, with its repository."""
        return [(s.repository, f) for s in self.scans for f in s.found]

    def git_dirs(self, root: str) -> tuple[list[str], list[str]]:
        """The directories holding the repositories' git data (git directories and common
        directories): workspace-relative ones not named ``.git`` (a ``--separate-git-dir``
        inside the workspace), and absolute ones outside it (a linked worktree's common
        directory, a separate git directory elsewhere)."""
        root = os.path.abspath(root)
        inside: list[str] = []
        outside: list[str] = []
        for scan in self.scans:
            for path in dict.fromkeys((scan.repository.git_dir, scan.repository.common_dir)):
                rel = os.path.relpath(path, root)
                if rel == ".." or rel.startswith(".." + os.sep):
                    outside.append(path)
                elif ".git" not in rel.split(os.sep):
                    inside.append(rel.replace(os.sep, "/"))
        return list(dict.fromkeys(inside)), list(dict.fromkeys(outside))


def check_workspace(root: str, is_secret: _Secret, patterns: list[str], *, cache_dir: Path | None = None,
                    max_objects: int | None = None, walked: StartWalk | None = None) -> WorkspaceScan:
    """:func:`scan_repository` for every repository of the workspace *root*
    (:func:`find_repositories`), each store of at most *max_objects* (default
    :data:`MAX_OBJECTS`); a problem (too large, too slow, unreadable) is said in the
    result, never raised. *walked*: the walk of the workspace at start (guardfs.links), its
    secrets judged as *is_secret* judges a file; made here (once) without."""
    max_objects = MAX_OBJECTS if max_objects is None else max_objects
    out = WorkspaceScan()
    on_disk: dict[str, str] | None = None
    walked = walked if walked is not None else walk_workspace(root, is_secret=is_secret)

    def secrets_on_disk() -> dict[str, str]:
        nonlocal on_disk
        if on_disk is None:
            on_disk = secret_files(root, is_secret, walked)
        return on_disk

    where = "the workspace"
    try:
        for repo in find_repositories(root, walked):
            where = repo.label
            out.scans.append(scan_repository(repo, is_secret, patterns, cache_dir=cache_dir,
                                             max_objects=max_objects, secrets_on_disk=secrets_on_disk))
    except HistoryTooLarge as err:
        out.problem = f"{where}: {err}, so the guard cannot check git's history there in time"
    except (OSError, ValueError) as err:
        out.problem = f"{where}: the guard cannot read git's history ({err})"
    return out
