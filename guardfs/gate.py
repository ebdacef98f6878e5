"""The gate: the one path from a FUSE request to its verdict, its accounting and its event.

A handler asks the gate (:meth:`Gate.ask` or :meth:`Gate.check`), which judges the request
with :func:`policy_verdict` and the injected :class:`Decider`; a denial leaves an event and
raises ``FUSEError`` with the verdict's errno before anything reaches the disk. The handler
then does its syscall and tells the gate it is done (:meth:`Gate.done`), which commits the
accounting, records the event and lets the decider move its counters on. Nothing else in
guardfs calls the decider or writes an ``allow``/``deny`` event for a request.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from pyfuse3 import FUSEError

from guardfs.accounting import RewritePlan, WriteAccounting
from guardfs.decision import Decider, Request, Verdict, policy_verdict
from guardfs.events import EventLog
from guardfs.manifest import Limits
from guardfs.policy import GENERATED_KEYS, GUARD_DIR, Classification, PathPolicy

if TYPE_CHECKING:
    from guardfs.scratch import ScratchBacking

__all__ = ["Commit", "Gate", "is_guard_path"]

log = logging.getLogger(__name__)

# Operations whose new_files did not exist before.
_CREATING = frozenset({"create", "mknod", "symlink"})


def is_guard_path(path: str) -> bool:
    """Whether *path* is the guard's own ``.guard/`` or a name below it."""
    return path == GUARD_DIR or path.startswith(GUARD_DIR + "/")


@dataclass(frozen=True, slots=True)
class Commit:
    """What a performed mutation does to the accounting beyond its new files.

    A content rewrite (its plan and the content it replaced); for a rename, the scratch
    record an atomic save leaves behind, or the records that move with what was renamed;
    for the agent's unlink, the file whose content history ends.
    """

    rewrite: RewritePlan | None = None
    old: bytes | None = None
    scratch: str | None = None  # an atomic save's temporary file: its record is dropped
    move: tuple[str, str] | None = None  # (src, dst): records at or below src move to dst
    removed: str | None = None  # deleted by the agent: made again, it starts a new history


_NOTHING = Commit()


class Gate:
    """Judges requests and records what was done; see the module's docstring."""

    def __init__(
        self,
        policy: PathPolicy,
        accounting: WriteAccounting,
        decider: Decider,
        events: EventLog,
        limits: Limits,
        scratch: ScratchBacking | None = None,
    ) -> None:
        self.policy = policy
        # Generated output out of scope goes to the run's scratch layer when there is one;
        # without it, the policy's quiet refusal stands.
        self.scratch = scratch
        self.accounting = accounting
        self.decider = decider
        self.events = events
        self.limits = limits

    # ----- before the syscall ------------------------------------------------------

    def new_files(self, *candidates: tuple[str, Classification]) -> tuple[str, ...]:
        """The candidates that a mutation would add to the blast radius."""
        acct = self.accounting
        return tuple(p for p, w in candidates if w.scope.counted and acct.is_new(p))

    def check(self, request: Request) -> None:
        """Judge *request*; on denial record the event and raise its errno."""
        policy = policy_verdict(request)
        if not policy.allow and policy.rule in GENERATED_KEYS and self.scratch is not None:
            policy = self.scratch.admit(request, policy)
        verdict = self.decider.decide(request, policy)
        if not policy.allow and verdict.allow:
            verdict = policy  # a decider may tighten the policy, never loosen it
        if not verdict.allow:
            self.deny(request, verdict)

    def ask(self, op: str, path: str, where: Classification, counts: bool = True) -> Request:
        """Judge the mutation *op* of *path* (counted toward the blast radius if *counts*)."""
        new_files = self.new_files((path, where)) if counts else ()
        request = Request(op, path, where, True, new_files=new_files)
        self.check(request)
        return request

    def permits(self, request: Request) -> bool:
        """The policy's answer to a question (access(2)): nothing is recorded or counted."""
        return policy_verdict(request).allow

    def refuse_guard_names(self, op: str, *paths: str) -> None:
        """Mutations of the guard's own names are refused before the backing is touched."""
        for path in paths:
            if is_guard_path(path):
                self.check(Request(op, path, self.policy.classify(path, False), True))

    def refuse(self, request: Request, verdict: Verdict) -> NoReturn:
        """Refuse *request* for a reason found beyond the policy (what a write would land):
        the decider hears of it as of any denial, so the breaker may trip on it."""
        final = self.decider.decide(request, verdict)
        self.deny(request, verdict if final.allow else final)

    def deny(self, request: Request, verdict: Verdict) -> NoReturn:
        """Record the denial of *request* and raise its errno."""
        self.events.emit(
            request.op,
            request.path,
            "deny",
            target=request.target,
            intent=request.intent or None,
            contact=None if request.contact else False,  # no violation: dropped past a cap, counted
            rule=verdict.rule,
            pattern=verdict.pattern,
            errno=errno.errorcode.get(verdict.errno, str(verdict.errno)),
            reason=verdict.reason,
        )
        log.info("denied %s %s: %s", request.op, request.path, verdict.reason)
        raise FUSEError(verdict.errno)

    # ----- after the syscall -------------------------------------------------------

    def done(self, request: Request, commit: Commit = _NOTHING) -> None:
        """Record an allowed, performed mutation: accounting, event, the decider's commit."""
        acct = self.accounting
        plan = commit.rewrite
        if plan is not None:
            acct.commit_rewrite(plan, commit.old)
        if commit.scratch is not None:
            acct.forget_scratch(commit.scratch)
        if commit.move is not None:
            acct.move(*commit.move)
        before = acct.distinct
        created = request.op in _CREATING
        for path in request.new_files:
            acct.touch(path, created=created or path == request.target)
        if commit.removed is not None:
            acct.removed(commit.removed)
        if plan is None:
            self.events.emit(request.op, request.path, "allow", target=request.target, rule=request.where.key)
        else:
            self.events.emit(
                request.op, request.path, "allow", target=request.target, rule=request.where.key,
                units=plan.counts, returns=plan.returns,
            )
        self.decider.committed(request)
        limit = self.limits.max_files
        if limit is not None and before < limit <= acct.distinct:
            self.events.emit(
                "limit", request.path, "allow", rule="limits.max_files",
                reason=f"{acct.distinct} of max_files={limit} distinct files mutated",
            )

    def allowed(self, op: str, path: str, where: Classification) -> None:
        """Record an allowed operation that is neither judged nor counted (a write to a
        file no limit counts, once per session)."""
        self.events.emit(op, path, "allow", rule=where.key)
