"""Planning a rename: what it counts, what it rewrites, and what it carries along.

A rename of a regular file onto a counted regular file is an atomic save (an editor's or a
tool's write to a temporary name, then rename over the target): one rewrite of the target,
judged on the content it brings, and the temporary file is not a file of its own. A file
this run created moves on with its record; a directory carries its records, and is refused
if it holds a forbidden or protected path or would put something of it under one.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import trio

from guardfs.backing import Backing
from guardfs.decision import ERRNO_READ_ONLY, Request, Verdict
from guardfs.gate import Commit, Gate
from guardfs.gitguard import GITFILE_PREFIX, MAX_CONFIG_BYTES, config_problems, gitdir_target_ok, link_value
from guardfs.policy import GIT_CHECKED_RULE, GIT_GUARDED_RULE, Classification, Scope
from guardfs.sessions import read_small

if TYPE_CHECKING:  # dulwich is imported only where git state is judged
    from guardfs.gitscope import GitScope

__all__ = ["check_carried", "check_config_landing", "check_git_landing", "check_git_update", "check_git_write",
           "plan_rename"]

# What a moving directory may not hold, nor bring a name of its own under.
# A repository's anchors and configs stay where they are: no prepared tree is moved into
# their place, and no repository is moved out from under its checks.
# A gitfile stays too: a relative one would name another directory from elsewhere.
_NOT_CARRIED = (Scope.FORBIDDEN, Scope.PROTECTED, Scope.GIT_CONFIG, Scope.GIT_ANCHOR, Scope.GIT_GUARDED,
                Scope.GIT_CHECKED)
#: A gitfile, gitdir or commondir larger than this is no git's (a path and a newline).
MAX_LINK_BYTES = 4096
#: Bytes read around a write to a reflog or FETCH_HEAD to find the whole lines it touches.
_LINE_REACH = 4096


def plan_rename(
    gate: Gate,
    backing: Backing,
    src: tuple[str, os.stat_result, Classification],
    dst: tuple[str, os.stat_result | None, Classification],
    exchange: bool,
) -> tuple[Request, Commit]:
    """The request to judge for renaming *src* to *dst* (each path, its attributes before
    the rename and its classification) and what the accounting commits once it is done."""
    src_path, src_st, src_where = src
    dst_path, dst_st, dst_where = dst
    acct = gate.accounting
    src_dir = stat.S_ISDIR(src_st.st_mode)
    src_rec = acct.files.get(src_path)
    src_is_new = src_rec is not None and src_rec.created
    counted = [] if src_dir else [(src_path, src_where), (dst_path, dst_where)]
    commit = Commit()
    replacing = dst_st is not None and not exchange and stat.S_ISREG(dst_st.st_mode)
    if replacing and dst_where.scope.counted and stat.S_ISREG(src_st.st_mode):
        assert dst_st is not None
        # An atomic save: one rewrite of the target, judged on the content it brings.
        old = read_small(backing, dst_path, dst_st)
        plan = acct.plan_rewrite(dst_path, old, read_small(backing, src_path, src_st))
        commit = Commit(rewrite=plan, old=old, scratch=src_path)
        counted = [] if src_rec is None or src_is_new else [(src_path, src_where)]
    elif src_is_new and not exchange:
        counted = []  # a file this run created moves on; its record moves with it
    if commit.rewrite is None and not exchange and (src_dir or src_is_new):
        commit = Commit(move=(src_path, dst_path))
    request = Request(
        "rename", src_path, src_where, True, target=dst_path, target_where=dst_where,
        new_files=gate.new_files(*counted), rewrite=commit.rewrite,
    )
    return request, commit


def check_carried(gate: Gate, backing: Backing, request: Request, src: str, dst: str) -> None:
    """Refuse moving a directory that holds a forbidden or protected path, or would
    put something of it under one."""
    for below, is_dir in backing.walk(src):
        for path in (below, dst + below[len(src):]):
            where = gate.policy.classify(path, is_dir)
            if where.scope in _NOT_CARRIED:
                err = errno.EACCES if where.scope is Scope.FORBIDDEN else errno.EROFS
                gate.deny(request, Verdict(
                    False, where.key, where.pattern, err,
                    f"moving {src} to {dst} would carry {path} ({where.describe()})",
                ))


async def check_config_landing(
    gate: Gate, backing: Backing, request: Request, src: tuple[str, os.stat_result], exchange: bool,
    writers: bool,
) -> None:
    """Refuse the rename that would land a repository's config (made during the run) which
    sets anything that runs a program; the new content is parsed by git itself, off the loop.

    What lands must be what was checked: a regular file no descriptor can still write, put
    in place by a plain rename (an exchange would hand the checked name to the old file).
    """
    path, st = src
    dst = request.target if request.path == path else request.path

    def refuse(why: str) -> NoReturn:
        gate.refuse(request, Verdict(False, GIT_GUARDED_RULE, None, ERRNO_READ_ONLY, f"{dst}: {why}"))

    if exchange:
        refuse("a repository's config is replaced by a plain rename only, not exchanged")
    if not stat.S_ISREG(st.st_mode):
        refuse(f"{path} is not a regular file")
    if writers:
        refuse(f"{path} is still open for writing: close it before renaming it over the config")
    if st.st_size > MAX_CONFIG_BYTES:
        refuse(f"{path} is {st.st_size} bytes, more than any git config ({MAX_CONFIG_BYTES})")
    fd = backing.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        data = os.pread(fd, MAX_CONFIG_BYTES + 1, 0)
    finally:
        os.close(fd)
    policy = gate.policy
    gitdir = (dst or "").rpartition("/")[0]

    def worktree_ok(value: str) -> bool:
        # A submodule's work tree: inside the workspace, where the agent may write anyway
        # (what git later checks out there, the agent could have written itself).
        rel = _beneath(backing.root, gitdir, value)
        return rel is not None and policy.classify(rel, True).scope is Scope.ALLOWED

    problems = await trio.to_thread.run_sync(config_problems, data, worktree_ok)
    if problems:
        refuse(f"the new config sets {', '.join(problems)}, which would make git run a program (or read "
               "configuration from elsewhere) on the host when someone next uses this repository; "
               "refused by the guard, set only what git needs (user, remote, branch)")


def check_git_update(
    gate: Gate, scope: GitScope, request: Request, src: tuple[str, bool], dst: tuple[str, bool],
    exchange: bool, held_open: Callable[[], bool],
) -> None:
    """Refuse a rename that would update git's index or a ref so that a path the task may not
    write changes (see :mod:`guardfs.gitscope`); the denial reaches the decider (the breaker)
    as any refused write does. *src* and *dst* are (path, is a directory); *held_open* says
    whether either is open for writing."""
    verdict = scope.judge_rename(src[0], dst[0], src[1], held_open)
    if verdict is None and exchange:
        verdict = scope.judge_rename(dst[0], src[0], dst[1], held_open)
    if verdict is None:
        return
    final = gate.decider.decide(request, verdict)
    gate.deny(request, verdict if final.allow else final)  # a decider never loosens a denial


def link_problem(backing: Backing, path: str, kind: str, data: bytes) -> str | None:
    """What is wrong with *data* as the content of the gitfile, worktree ``gitdir`` or
    ``commondir`` *path* (its *kind*), or None.

    Each may name only a git directory the guard polices, inside the workspace, along a path
    nothing can later turn into a symlink: ``..`` only leading (so the lexical path is the
    real one), a gitfile's repository an ancestor of the gitfile (a directory that cannot go
    while the gitfile is in it), and below ``.git`` no symlinks (PathPolicy.symlink_where).
    The directory need not exist yet (``git clone --separate-git-dir`` writes the gitfile first).
    """
    if len(data) > MAX_LINK_BYTES:
        return f"{len(data)} bytes, more than any git {kind} ({MAX_LINK_BYTES})"
    if kind == "gitfile":
        if not data.startswith(GITFILE_PREFIX):
            return None  # git reads no git directory from it (it says "invalid gitfile format")
        data = data[len(GITFILE_PREFIX):]
    value = link_value(data)
    if not value:
        return None
    base = path.rpartition("/")[0]
    rel = _beneath(backing.root, base, value)
    if rel is None:
        return f"it names {value!r}, outside the workspace (or through '..' after a name)"
    if kind == "gitdir":
        # The work tree's .git file (git writes its absolute path before creating it).
        if rel.rpartition("/")[2] != ".git":
            return f"it names {value!r}, not the .git file of a work tree inside the workspace"
        return None
    if kind == "commondir":
        own = base.rpartition("/")[0].rpartition("/")[0]  # <gitdir>/worktrees/<id> -> <gitdir>
        return None if rel == own else f"it names {value!r}, not its own repository {own}"
    if not gitdir_target_ok(rel):
        return (f"it names {rel or '.'}, which is not a repository's .git directory, nor a linked worktree's "
                "or submodule's git directory below one (.git/worktrees/<id>, .git/modules/<name>)")
    parts = rel.split("/")
    repo = "/".join(parts[:len(parts) - 1 - parts[::-1].index(".git")])
    if repo and base != repo and not base.startswith(repo + "/"):
        return (f"it names {rel}, the git directory of {repo}, which does not contain {base}: a worktree or "
                "submodule of a nested repository lives inside that repository's own directory")
    return None


def _beneath(root: str, base: str, value: str) -> str | None:
    """*value* (relative to *base*, or absolute) as a workspace-relative path; None if it
    leaves the workspace *root*, or has a '..' after a name or a '.' (where the lexical
    path and the real one could differ)."""
    parts = value.split("/")
    if value.startswith("/"):
        for top in {os.path.abspath(root), os.path.realpath(root)}:
            if value == top or value.startswith(top.rstrip("/") + "/"):
                parts = value[len(top):].split("/")
                base = ""
                break
        else:
            return None
    names = [p for p in parts if p]
    lead = next((i for i, p in enumerate(names) if p != ".."), len(names))
    if any(p in (".", "..") for p in names[lead:]):
        return None
    here = [p for p in base.split("/") if p]
    if lead > len(here):
        return None
    return "/".join(here[:len(here) - lead] + names[lead:])


def _dir_id(backing: Backing, rel: str) -> tuple[int, int]:
    st = backing.lstat(rel)
    return st.st_dev, st.st_ino


def _touched(backing: Backing, path: str, off: int, buf: bytes, kind: str) -> bytes:
    """The content a write of *buf* at *off* would leave in the git-checked file *path*: all
    of it for a gitfile, gitdir or commondir; the whole lines it touches for a reflog or
    FETCH_HEAD. Read through a descriptor of its own (git's may be write-only)."""
    fd = backing.open(path, os.O_RDONLY)
    try:
        return _touched_fd(fd, off, buf, kind)
    finally:
        os.close(fd)


def _touched_fd(fd: int, off: int, buf: bytes, kind: str) -> bytes:
    size = os.fstat(fd).st_size
    if kind in ("gitfile", "gitdir", "commondir"):
        if max(size, off + len(buf)) > MAX_LINK_BYTES:
            return b"\0" * (MAX_LINK_BYTES + 1)
        data = bytearray(os.pread(fd, MAX_LINK_BYTES, 0))
    else:
        lo = max(0, off - _LINE_REACH)
        data = bytearray(os.pread(fd, off + len(buf) + _LINE_REACH - lo, lo))
        off -= lo
    if off > len(data):
        data.extend(b"\0" * (off - len(data)))
    data[off:off + len(buf)] = buf
    if kind in ("gitfile", "gitdir", "commondir"):
        return bytes(data)
    start = data.rfind(b"\n", 0, off) + 1
    end = data.find(b"\n", off + len(buf))
    return bytes(data[start:] if end < 0 else data[start:end + 1])


def _problem(backing: Backing, scope: GitScope | None, path: str, kind: str, data: bytes) -> str | None:
    if kind in ("gitfile", "gitdir", "commondir"):
        return link_problem(backing, path, kind, data)
    if scope is None:
        return "no judge of git's state in this mount"
    return scope.log_problem(kind, data, path.rpartition("/")[2])


def _refuse_git(gate: Gate, request: Request, where: Classification, path: str, why: str) -> NoReturn:
    gate.refuse(request, Verdict(False, GIT_CHECKED_RULE, where.pattern, ERRNO_READ_ONLY, (
        f"{path} ({where.pattern}): {why}; refused by the guard, as git on the host would follow it later")))


def check_git_write(
    gate: Gate, backing: Backing, scope: GitScope | None, where: Classification, path: str, off: int,
    buf: bytes,
) -> None:
    """Judge a write of *buf* at *off* to a git-checked file on the content it would leave
    (see :func:`link_problem`, GitScope.log_problem)."""
    kind = where.pattern or ""
    why = _problem(backing, scope, path, kind, _touched(backing, path, off, buf, kind))
    if why is not None:
        _refuse_git(gate, Request("write", path, where, True), where, path, why)


def check_git_landing(
    gate: Gate, backing: Backing, scope: GitScope | None, request: Request, src: tuple[str, os.stat_result],
    dst: tuple[str, Classification], writers: bool,
) -> None:
    """Judge renaming *src* over (or to) a git-checked name *dst* on what *src* holds: all of
    it (a reflog rewritten by git's lock file too)."""
    path, st = src
    name, where = dst
    if not stat.S_ISREG(st.st_mode):
        _refuse_git(gate, request, where, name, f"{path} is not a regular file")
    if writers:
        _refuse_git(gate, request, where, name, f"{path} is still open for writing: close it first")
    fd = backing.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        kind = where.pattern or ""
        limit = MAX_LINK_BYTES + 1 if kind in ("gitfile", "gitdir", "commondir") else st.st_size
        data = os.pread(fd, limit, 0)
    finally:
        os.close(fd)
    why = _problem(backing, scope, name, kind, data)
    if why is not None:
        _refuse_git(gate, request, where, name, why)
