"""The decision protocol: guardfs asks, an injected decider answers.

guardfs computes the policy's own verdict for every checked operation and hands it, with
the request, to a :class:`Decider`. The decider may only tighten that verdict: a policy
denial stands whatever it answers. Without a breaker attached, :class:`LimitsDecider`
enforces ``limits.max_files``, ``limits.max_returns`` and ``limits.max_rewrites`` from the manifest.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Protocol

from guardfs.accounting import RewritePlan, WriteAccounting
from guardfs.manifest import Limits
from guardfs.policy import Classification, Scope

__all__ = [
    "ALLOW",
    "ERRNO_FORBIDDEN",
    "ERRNO_LIMIT",
    "ERRNO_READ_ONLY",
    "Decider",
    "LimitsDecider",
    "Request",
    "Verdict",
    "policy_verdict",
]

#: A forbidden path, read or written.
ERRNO_FORBIDDEN = errno.EACCES
#: A mutation outside ``paths.allowed`` or of a protected path.
ERRNO_READ_ONLY = errno.EROFS
#: A mutation refused by a limit (blast radius, rewrites) or a tripped breaker.
ERRNO_LIMIT = errno.EDQUOT


# Not frozen: a frozen dataclass's __init__ costs several times more, and a request is built
# on every judged operation. Treat requests as immutable all the same.
@dataclass(slots=True)
class Request:
    """One operation to judge: what, on which path(s), and what it would count."""

    op: str
    path: str
    where: Classification
    mutating: bool
    target: str | None = None  # rename/link destination
    target_where: Classification | None = None
    new_files: tuple[str, ...] = ()  # paths this would add to the blast radius
    rewrite: RewritePlan | None = None
    # Whether the operation reads or changes what the path holds, rather than only asking
    # about its name (a stat); *intent* names the system call when a lookup was refused.
    contact: bool = True
    intent: str = ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """allow, or deny with the errno and the rule (manifest key and pattern) that decided."""

    allow: bool
    rule: str = ""
    pattern: str | None = None
    errno: int = 0
    reason: str = ""
    #: The path the verdict is about when it is not the request's own (a rename's or a link's
    #: destination, the new file a limit counted): a trip is recorded on it. Empty: the request's.
    path: str = ""


ALLOW = Verdict(True)


class Decider(Protocol):
    """What guardfs asks about every checked operation. Implementations must be fast."""

    def decide(self, request: Request, policy: Verdict) -> Verdict:
        """Return the final verdict; a policy denial must stay a denial."""
        ...

    def committed(self, request: Request) -> None:
        """An allowed mutation was performed (counters may move on)."""
        ...


def _deny(where: Classification, err: int, reason: str, path: str = "") -> Verdict:
    return Verdict(False, where.key, where.pattern, err, reason, path)


_WRITABLE = frozenset({Scope.ALLOWED, Scope.GIT_INTERNAL, Scope.GENERATED})
# A repository's .git and hooks directories may be made (git init) and removed when empty:
# what git would run can then only come from names that are policed themselves.
_ANCHOR_OPS = frozenset({"mkdir", "rmdir", "chmod", "chown", "utimes"})
# A config made during the run is written by git's lock-file rename, whose content the
# filesystem checks (guardfs.gitguard), or removed; never written in place. Its mode may
# change: git init tests whether the filesystem keeps the x bit on it.
_GUARDED_OPS = frozenset({"rename", "unlink", "chmod", "chown", "utimes"})
# A gitfile, a worktree's gitdir/commondir, FETCH_HEAD or a reflog is written in place by
# git; the filesystem judges every write and every rename onto it by the content it leaves.
_CHECKED_OPS = frozenset({"create", "open", "rename", "unlink", "chmod", "chown", "utimes"})


def _other(path: str, request: Request) -> str:
    """*path* when a verdict on *request* is about another path than its own (its target)."""
    return "" if path == request.path else path


def policy_verdict(request: Request) -> Verdict:
    """The manifest's and the built-ins' verdict on *request*, before any limit."""
    if request.target is None:  # the common case, decided in one or two comparisons
        scope = request.where.scope
        if scope is not Scope.FORBIDDEN and (not request.mutating or scope in _WRITABLE):
            return ALLOW
    checks = [(request.path, request.where)]
    if request.target is not None and request.target_where is not None:
        checks.append((request.target, request.target_where))
    for path, where in checks:
        if where.scope is Scope.FORBIDDEN:
            return _deny(where, ERRNO_FORBIDDEN, f"{path} is forbidden by {where.describe()}", _other(path, request))
    if not request.mutating:
        return ALLOW
    for path, where in checks:
        if (reason := _read_only_reason(request.op, path, where)) is not None:
            return _deny(where, ERRNO_READ_ONLY, reason, _other(path, request))
    # Last: a refusal that trips nothing must never hide one that does at the other end.
    for path, where in checks:
        if where.scope is Scope.GENERATED_OUTSIDE:
            return _deny(
                where, ERRNO_READ_ONLY,
                f"{path} is generated output ({where.describe()}) outside the task's scope (or Python "
                "bytecode, in scope too): it is not "
                "written to the workspace (no trip); point the tool's cache or output inside paths.allowed",
                _other(path, request),
            )
    return ALLOW


def _read_only_reason(op: str, path: str, where: Classification) -> str | None:
    """Why *op* may not change *path* (None: it may, as far as these rules go)."""
    if where.scope is Scope.GIT_ANCHOR and op not in _ANCHOR_OPS:
        return (f"{path} is a repository's {where.pattern} directory: {op} refused "
                f"({where.describe()}); git would run what it then held")
    if where.scope is Scope.GIT_GUARDED and op not in _GUARDED_OPS:
        return (f"{path} is written only by git (a lock file renamed over it, checked for "
                f"settings that run programs): {op} refused; use git config")
    if where.scope is Scope.GIT_CHECKED and op not in _CHECKED_OPS:
        return (f"{path} ({where.pattern}) is written only in place by git, each write judged "
                f"for what it names: {op} refused")
    if where.scope is Scope.PROTECTED or where.scope is Scope.GIT_CONFIG:
        return f"{path} is read-only: {where.describe()}"
    if where.scope is Scope.OUT_OF_SCOPE:
        return f"{path} is outside the task's scope ({where.describe()})"
    return None


class LimitsDecider:
    """The default decider: the manifest's blast-radius, return and rewrite limits, nothing more."""

    def __init__(self, limits: Limits, accounting: WriteAccounting) -> None:
        self.limits = limits
        self.accounting = accounting

    def decide(self, request: Request, policy: Verdict) -> Verdict:
        """Apply ``max_files``, ``max_returns`` and ``max_rewrites`` to an allowed mutation."""
        if not policy.allow or not request.mutating:
            return policy
        max_files = self.limits.max_files
        if max_files is not None and request.new_files:
            after = self.accounting.distinct + len(request.new_files)
            if after > max_files:
                return Verdict(
                    False, "limits.max_files", None, ERRNO_LIMIT,
                    f"{request.new_files[0]} would be distinct file {after} of max_files={max_files}",
                    _other(request.new_files[0], request),
                )
        plan = request.rewrite
        if plan is not None and plan.over_returns(self.limits.max_returns):
            return Verdict(
                False, "limits.max_returns", None, ERRNO_LIMIT,
                f"{plan.path} would return to an earlier version of itself, return {plan.returns} "
                f"(max_returns={self.limits.max_returns}): flipping between versions looks like "
                "oscillation; keep the version that works best and change it forward",
            )
        max_rewrites = self.limits.max_rewrites
        if max_rewrites is not None and plan is not None and (peak := plan.peak) is not None:
            unit, count = peak
            if count > max_rewrites:
                return Verdict(
                    False, "limits.max_rewrites", None, ERRNO_LIMIT,
                    f"{plan.path}: {unit} would be mutated {count} times "
                    f"(max_rewrites={max_rewrites}); this looks like oscillation",
                )
        return policy

    def committed(self, request: Request) -> None:
        """Nothing to do: the accounting is committed by the filesystem."""
