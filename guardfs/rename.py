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
from guardfs.gitguard import MAX_CONFIG_BYTES, config_problems
from guardfs.policy import GIT_GUARDED_RULE, Classification, Scope
from guardfs.sessions import read_small

if TYPE_CHECKING:  # dulwich is imported only where git state is judged
    from guardfs.gitscope import GitScope

__all__ = ["check_carried", "check_config_landing", "check_git_update", "plan_rename"]

# What a moving directory may not hold, nor bring a name of its own under.
# A repository's anchors and configs stay where they are: no prepared tree is moved into
# their place, and no repository is moved out from under its checks.
_NOT_CARRIED = (Scope.FORBIDDEN, Scope.PROTECTED, Scope.GIT_CONFIG, Scope.GIT_ANCHOR, Scope.GIT_GUARDED)


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
    problems = await trio.to_thread.run_sync(config_problems, data)
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
