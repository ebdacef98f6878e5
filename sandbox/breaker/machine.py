"""The circuit breaker: a pure, synchronous state machine.

Inputs are filesystem requests (through guardfs's :class:`~guardfs.decision.Decider`
protocol) and what the agent reports over the socket (steps with tokens, tool calls, tool
results). Time is passed in, never read, so every rule tests in microseconds. No I/O: events
go to an injected sink.

States follow the classic breaker. CLOSED → (first recoverable trip) → HALF_OPEN_REANCHOR:
the offending operation is refused with corrective feedback. A trip that had no operation
of its own to refuse (a token surge, a repeated call) refuses the agent's next mutation or
check instead, so the feedback reaches it. In HALF_OPEN, the next in-scope mutation closes
the breaker; another violation makes it OPEN_<RULE>, terminal until an operator approves.

A test result is the agent's word (its exit code and command text are whatever it
reports): a passing one adds a restore point, and counts as progress only once per real
in-scope change since the last (it never closes HALF_OPEN on its own, and never drops a
restore point).

What must happen in the world because of a decision (freeze the agent, mark a checkpoint,
roll back) is not done here: each reply carries it as :class:`Effect` values, and the
run's :class:`~sandbox.session.Session` carries them out.
"""

from __future__ import annotations

import collections
import difflib
import enum
import hashlib
import heapq
import itertools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from guardfs.accounting import WriteAccounting
from guardfs.decision import ALLOW, ERRNO_FORBIDDEN, ERRNO_LIMIT, LimitsDecider, Request, Verdict, policy_verdict
from guardfs.events import printable
from guardfs.manifest import Limits, Manifest
from guardfs.policy import GENERATED_KEYS, Classification, PathPolicy, Scope
from guardfs.rules import RULES, Rule

__all__ = ["NO_EFFECTS", "Breaker", "Effect", "Effects", "Reply", "Rule", "State", "Trip"]

# A tool result counts as a passing test when the tool or its command names a test runner.
_TEST_COMMAND = re.compile(r"\b(pytest|py\.test|unittest|tox|nox|jest|vitest|mocha|go test|cargo test|"
                           r"npm (run )?test|yarn test|pnpm test|make (test|check)|ctest|rspec|phpunit)\b")
# One encoder for every call's canonical form (json.dumps with options builds a new one).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str)
# The ledger shows the last feedback whole up to this length (it quotes the goal and the scope).
_MAX_FEEDBACK_CHARS = 16_000


class State(enum.StrEnum):
    """Breaker states; every OPEN_* state is terminal until approved.

    A rule's trip that is not recovered from leads to ``OPEN_<RULE>`` (``RULES[rule].open_state``);
    OPEN_STOPPED is an operator's stop.
    """

    CLOSED = "CLOSED"
    HALF_OPEN_REANCHOR = "HALF_OPEN_REANCHOR"
    OPEN_FORBIDDEN_PATH = "OPEN_FORBIDDEN_PATH"
    OPEN_SCOPE_SPILL = "OPEN_SCOPE_SPILL"
    OPEN_BLAST_RADIUS = "OPEN_BLAST_RADIUS"
    OPEN_OSCILLATION = "OPEN_OSCILLATION"
    OPEN_TOKEN_SURGE = "OPEN_TOKEN_SURGE"
    OPEN_TOKEN_VELOCITY = "OPEN_TOKEN_VELOCITY"
    OPEN_REPEATED_ACTION = "OPEN_REPEATED_ACTION"
    OPEN_STAGNATION = "OPEN_STAGNATION"
    OPEN_CONSECUTIVE_FAILURES = "OPEN_CONSECUTIVE_FAILURES"
    OPEN_IDLE_TRANSPORT = "OPEN_IDLE_TRANSPORT"
    OPEN_STEP_BUDGET = "OPEN_STEP_BUDGET"
    OPEN_STOPPED = "OPEN_STOPPED"

    @property
    def terminal(self) -> bool:
        """Whether the agent is halted until an operator acts."""
        return self.value.startswith("OPEN_")


# Each rule's OPEN state, checked against the table at import (a missing state fails here).
_OPEN_STATE = {rule: State(spec.open_state) for rule, spec in RULES.items()}


class Effect(enum.Enum):
    """What a decision requires of the guard beyond its answer; the Session carries it out."""

    CHECKPOINT = "checkpoint"  # a known-good point: pre-images start afresh from here
    ROLLBACK = "rollback"  # restore the workspace to the last checkpoint
    FREEZE = "freeze"  # a terminal trip: hold the agent still, at once, until an operator acts
    HALT = "halt"  # the operator stopped the run: end the agent
    RESUME = "resume"  # approved after a terminal trip: the agent may go on


Effects = frozenset[Effect]
NO_EFFECTS: Effects = frozenset()


@dataclass(frozen=True, slots=True)
class Trip:
    """One trip: which rule, the state it led to, at which step, why, and on which path
    (workspace-relative; empty for a trip on no path: tokens, failures, idleness)."""

    rule: Rule
    state: State
    step: int
    time: float
    reason: str
    path: str = ""
    # The [limits] key that tripped (oscillation has two: max_rewrites, max_returns); None
    # for a rule without one.
    limit: str | None = None


#: Distinct tool calls remembered for repetition (least recently made forgotten first).
_IDENTICAL_KEPT = 4096
#: Characters of a call's text that stagnation compares (difflib is quadratic).
_SIMILARITY_CHARS = 2000


def _nth(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 21st ..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


@dataclass(slots=True)
class _Call:
    """One tool call, for repetition and stagnation."""

    text: str
    failed: bool | None = None


@dataclass(slots=True)  # not frozen: built on every step, see guardfs.decision.Request
class Reply:
    """What a socket message gets back: the state, words for the agent when any, and the
    effects the guard must carry out."""

    allow: bool
    state: State
    feedback: str = ""
    warning: str = ""
    trip: Trip | None = None
    effects: Effects = NO_EFFECTS


_FIRST_CALL = Reply(True, State.CLOSED)  # only .warning and .trip of it are read


@dataclass
class _Counters:
    steps: int = 0
    tokens_total: int = 0
    tokens_cached: int = 0
    since_progress: int = 0
    consecutive_failures: int = 0
    window: collections.deque[int] = field(default_factory=collections.deque)  # maxlen set by Breaker
    # Times each distinct call was made since the last progress, keyed by a digest of its
    # text (a call's arguments can be megabytes: a Write's content), oldest first, bounded.
    # Per distinct call, how many times each channel (the pre-tool hook, the agent's output
    # stream) reported it: one call is seen by both, so it is counted once (the most any
    # channel reported), never once per channel.
    identical: dict[bytes, dict[str, int]] = field(default_factory=dict)
    calls: list[_Call] = field(default_factory=list)


class Breaker:
    """The breaker for one run. Implements guardfs's Decider protocol.

    *now* is the run's clock (the daemon passes trio's); *emit* receives events as
    ``emit(op, path, decision, **fields)`` (an :class:`~guardfs.events.EventLog`'s ``emit``);
    *policy* is the run's compiled policy, shared with the mount so both answer alike
    (default: compiled from *manifest*, with ``.git/config`` read-only).
    """

    def __init__(
        self,
        manifest: Manifest,
        accounting: WriteAccounting,
        now: Callable[[], float],
        emit: Callable[..., Any] | None = None,
        *,
        policy: PathPolicy | None = None,
    ) -> None:
        self.manifest = manifest
        self.limits: Limits = manifest.limits
        self.accounting = accounting
        self.policy = policy if policy is not None else PathPolicy(manifest)
        self.now = now
        self._emit = emit or (lambda *a, **k: None)
        self._limits_decider = LimitsDecider(self.limits, accounting)
        self._recoverable = frozenset(Rule(r) for r in manifest.breaker.recoverable)
        self.state = State.CLOSED
        self.trips: list[Trip] = []
        self.record = manifest.record
        # The most recent notes (the agent decides how many it sends), and how many older
        # ones were dropped to keep the ledger bounded.
        self.notes: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.record.max_notes)
        self.notes_dropped = 0
        self.checkpoints: list[dict[str, Any]] = []
        #: The run's rollbacks (the breaker's and the operator's), as :meth:`rolled_back` heard of them.
        self.rollbacks: list[dict[str, Any]] = []
        self.last_feedback = ""
        self.version = 0  # bumped on every change, for the ledger writer
        # Effects decided during the current call; the reply it returns takes them along.
        self._effects: set[Effect] = set()
        self._refuse_next = False
        # A real in-scope change landed since the last passing test the agent reported.
        self._changed_since_test = False
        self._c = _Counters(window=collections.deque(maxlen=self.limits.window_steps))
        self._last_activity: float | None = None  # armed by the first agent message

    # ----- guardfs's Decider protocol -----------------------------------------------

    def decide(self, request: Request, policy: Verdict) -> Verdict:
        """Judge a filesystem request (guardfs's Decider protocol). Its effects are dropped:
        a guarded run asks :meth:`judge` instead, through its Session."""
        return self.judge(request, policy)[0]

    def judge(self, request: Request, policy: Verdict) -> tuple[Verdict, Effects]:
        """Judge a filesystem request; a policy denial stays a denial and may trip.
        Returns the verdict and the effects the trip (if any) requires."""
        if (policy.allow and self.state is State.CLOSED and request.rewrite is None
                and not request.new_files):
            return policy, NO_EFFECTS  # the hot path: nothing to count, nothing to gate
        verdict = self._decide(request, policy)
        return verdict, self._take_effects()

    def _decide(self, request: Request, policy: Verdict) -> Verdict:
        if (policy.allow and self.state is State.CLOSED and request.rewrite is None
                and not request.new_files):
            return policy
        if not policy.allow:
            rule = self._rule_for_denial(request, policy)
            if rule is None:
                return policy
            return self._trip(rule, policy.reason, policy, policy.path or request.path)
        verdict = self._limits_decider.decide(request, policy)
        if not verdict.allow:
            rule = Rule.BLAST_RADIUS if verdict.rule == "limits.max_files" else Rule.OSCILLATION
            return self._trip(rule, verdict.reason, verdict, verdict.path or request.path)
        if request.mutating:
            # The feedback a trip owes lands on the agent's own next write, never on git's
            # index or ref update (not counted): that would leave git half-done.
            return self._gate(f"{request.op} {request.path}", deliver=request.where.scope.counted)
        return ALLOW

    def committed(self, request: Request) -> None:
        """An allowed mutation landed (guardfs's Decider protocol); effects are dropped, as
        in :meth:`decide`."""
        self.commit(request)

    def commit(self, request: Request) -> Effects:
        """An allowed mutation landed: progress, unless it was a return to an earlier version
        past ``max_returns`` that no write judged before it landed (a trip, whose effects are
        returned)."""
        plan = request.rewrite
        if plan is not None and plan.over_returns(self.limits.max_returns):
            self._trip(Rule.OSCILLATION, f"{plan.path} returned to an earlier version of itself, return "
                       f"{plan.returns} (max_returns={self.limits.max_returns}): it flips between versions", None,
                       plan.path, limit="max_returns")
        elif request.where.scope.counted and not (plan is not None and plan.unchanged):
            self._changed_since_test = True
            self._progress()  # a write that leaves the content as it was is no progress
        return self._take_effects()

    def _rule_for_denial(self, request: Request, policy: Verdict) -> Rule | None:
        if policy.rule in GENERATED_KEYS:
            return None  # a tool's cache or build output out of scope: refused quietly (paths.generated)
        if policy.errno == ERRNO_FORBIDDEN:
            # Trip on intent, refuse on contact: a stat or access check of a forbidden name
            # (git status, an indexer, a dotenv probe) is refused but is no violation.
            return Rule.FORBIDDEN_PATH if request.contact else None
        return Rule.SCOPE_SPILL if request.mutating else None

    # ----- what the agent reports -----------------------------------------------------

    def hello(self, agent: str) -> Reply:
        """An agent connected; arms the idle-transport breaker."""
        self._touch()
        self._emit("hello", "", "allow", agent=agent)
        return Reply(not self.state.terminal, self.state)

    def step(
        self,
        tokens_in: int = 0,
        tokens_out: int = 0,
        tokens_cached: int = 0,
        tool: str | None = None,
        args: Any = None,
        *,
        totals: bool = False,
    ) -> Reply:
        """One agent step (a model call), with its token usage and the tool it calls.

        With *totals*, the tokens are an agent's end-of-run totals over all its calls (Gemini's
        stream reports no more): counted, but no step, and not judged by the window or velocity
        rules, which one lump of a whole run would trip after the agent is done.
        """
        self._last_activity = self.now()
        c = self._c
        tokens = tokens_in + tokens_out
        if totals:
            c.tokens_total += tokens
            c.tokens_cached += tokens_cached
            self.version += 1
            self._emit("step", "", "allow", step=c.steps, tokens=tokens, tokens_cached=tokens_cached, totals=True)
            return Reply(not self.state.terminal, self.state, self._feedback_if_halted())
        c.steps += 1
        c.tokens_total += tokens
        c.tokens_cached += tokens_cached
        c.since_progress += tokens
        c.window.append(tokens)  # a deque with maxlen=window_steps
        self.version += 1
        self._emit("step", "", "allow", step=c.steps, tokens=tokens, tokens_cached=tokens_cached, tool=tool)
        warning = ""
        if tool is not None:
            reply = self._call(tool, args, "stream")
            if reply.trip is not None:
                return self._out(reply)
            warning = reply.warning
        lim = self.limits
        if lim.max_window_tokens is not None and (window := sum(c.window)) > lim.max_window_tokens:
            return self._reply_trip(Rule.TOKEN_SURGE, (
                f"{window} tokens in the last {len(c.window)} steps (max_window_tokens={lim.max_window_tokens})"))
        if lim.max_tokens_without_progress is not None and c.since_progress > lim.max_tokens_without_progress:
            return self._reply_trip(Rule.TOKEN_VELOCITY, (
                f"{c.since_progress} tokens without a file change or a passing test "
                f"(max_tokens_without_progress={lim.max_tokens_without_progress})"))
        if lim.max_steps is not None and c.steps > lim.max_steps:
            return self._reply_trip(Rule.STEP_BUDGET, f"step {c.steps} of max_steps={lim.max_steps}")
        state = self.state
        if state is State.CLOSED:
            return Reply(True, state, "", warning)
        return Reply(not state.terminal, state, self.last_feedback, warning)

    def tool_result(self, tool: str, exit_code: int, summary: str = "") -> Reply:
        """A tool finished: failures in a row, stagnation, and passing tests as restore points
        (progress only after a real in-scope change: the agent's report alone proves nothing).

        A result answers the oldest call still unanswered; when every call is answered, it is
        another channel's report of a result already counted (Gemini's AfterTool hook and its
        stream's tool_result report each result): recorded, not counted again.
        """
        self._touch()
        c = self._c
        call = next((call for call in c.calls if call.failed is None), None)
        if call is None and c.calls:
            self._emit("tool_result", "", "allow", tool=tool, exit_code=exit_code, counted=False)
            return Reply(not self.state.terminal, self.state, self._feedback_if_halted())
        if call is not None:
            call.failed = exit_code != 0
        self._emit("tool_result", "", "allow", tool=tool, exit_code=exit_code)
        if exit_code == 0:
            c.consecutive_failures = 0
            if _TEST_COMMAND.search(f"{tool} {summary} {call.text if call is not None else ''}"):
                self._checkpoint(f"passing test: {summary or tool}"[:120], progress=self._changed_since_test)
                self._changed_since_test = False
            self._changed()
            return self._out(Reply(not self.state.terminal, self.state, self._feedback_if_halted()))
        c.consecutive_failures += 1
        self._changed()
        limit = self.limits.max_consecutive_failures
        if limit is not None and c.consecutive_failures >= limit:
            if self.manifest.breaker.rollback_on_consecutive_failures:
                self._effects.add(Effect.ROLLBACK)
            return self._reply_trip(Rule.CONSECUTIVE_FAILURES, (
                f"{c.consecutive_failures} failed tool calls in a row (max_consecutive_failures={limit})"))
        if self._stagnating():
            return self._reply_trip(Rule.STAGNATION, (
                f"the last 3 tool inputs are over {self.limits.stagnation_similarity:.0%} alike and all failed"))
        return Reply(not self.state.terminal, self.state, self._feedback_if_halted())

    def check(
        self, tool: str, paths: Sequence[str], args: Any = None, mutating: bool = True,
        outside: Sequence[str] = (),
    ) -> Reply:
        """A pre-tool hook asks: may this call, on these workspace-relative paths, run?

        *outside* are absolute paths outside the workspace: writing them is a scope spill.
        A refusal is an event (``check``, on the path refused), as a refused operation is.
        """
        self._touch()
        halted = self.state.terminal
        reply, path = self._check(tool, paths, args, mutating, outside)
        if not reply.allow:
            told = (f"breaker {self.state.value}: refused until guard approve or guard stop" if halted
                    else reply.feedback.split("\n", 1)[0])
            self._emit("check", path or (paths[0] if paths else ""), "deny", tool=tool, state=reply.state.value,
                       reason=told[:500])
        return reply

    def _check(self, tool: str, paths: Sequence[str], args: Any, mutating: bool,
               outside: Sequence[str]) -> tuple[Reply, str]:
        """:meth:`check`'s answer, and the path it refused the call for (empty: the call itself)."""
        if self.state.terminal:
            return Reply(False, self.state, self.last_feedback), ""
        trips = len(self.trips)
        targets = [(p, self.policy.classify(p, False)) for p in paths]
        if mutating:
            targets += [(p, Classification(Scope.OUT_OF_SCOPE, "outside the workspace")) for p in outside]
        for path, where in targets:
            request = Request("check", path, where, mutating)
            verdict = self._decide(request, policy_verdict(request))
            if not verdict.allow:
                trip = self.trips[-1] if len(self.trips) > trips else None
                return self._out(Reply(False, self.state, verdict.reason, trip=trip)), path
        if args is not None:
            reply = self._call(tool, args, "hook")
            if not reply.allow:
                return self._out(reply), ""
            if reply.warning:
                return reply, ""
        verdict = self._gate(f"{tool} call") if mutating else ALLOW
        return Reply(verdict.allow, self.state, verdict.reason), ""

    def note(self, kind: str, text: str) -> Reply:
        """A hypothesis disproved or an active subtask, for the ledger."""
        self._touch()
        text = _clip(text, self.record.max_note_chars, "record.max_note_chars")
        if len(self.notes) == self.notes.maxlen:
            self.notes_dropped += 1
        self.notes.append({"kind": kind, "text": text, "step": self._c.steps, "time": self.now()})
        self._emit("note", "", "allow", kind=kind)
        self._changed()
        return Reply(True, self.state)

    def activity(self) -> None:
        """Output from the agent or any other sign of life (resets idle transport)."""
        self._touch()

    def tick(self) -> Reply | None:
        """Time passed: the idle-transport breaker. Returns a reply when it tripped."""
        if self._last_activity is None or self.state.terminal:
            return None
        idle = self.now() - self._last_activity
        if idle > self.limits.idle_timeout_s:
            self._last_activity = self.now()
            return self._reply_trip(Rule.IDLE_TRANSPORT, (
                f"no socket traffic and no output for {idle:.0f}s (idle_timeout_s={self.limits.idle_timeout_s:g})"))
        return None

    # ----- what an operator does --------------------------------------------------------

    def approve(self, raise_to: int | None = None) -> Reply:
        """Resume after a trip; optionally raise the limit that tripped to *raise_to*."""
        last = self.trips[-1] if self.trips else None
        if raise_to is not None:
            key = last.limit if last is not None else None
            if key is None:
                return Reply(False, self.state, "approve --raise: the last trip has no numeric limit to raise")
            current = getattr(self.limits, key)
            if current is not None and raise_to <= current:
                return Reply(False, self.state, f"approve --raise: {key} is {current}; raise it above that")
            self.limits = self.limits.model_copy(update={key: raise_to})
            self._limits_decider.limits = self.limits
        before = self.state
        self.state = State.CLOSED
        self._refuse_next = False
        c = self._c
        c.window.clear()
        c.since_progress = 0
        c.consecutive_failures = 0
        c.identical.clear()
        c.calls.clear()
        self.last_feedback = ""
        self._emit("approve", "", "allow", state=before.value, raise_to=raise_to)
        self._changed()
        return Reply(True, self.state, effects=frozenset({Effect.RESUME}) if before.terminal else NO_EFFECTS)

    def stop(self) -> Reply:
        """An operator stops the run: terminal, whatever the state."""
        self.state = State.OPEN_STOPPED
        self.last_feedback = "guard: the operator stopped this run."
        self._emit("stop", "", "deny", state=self.state.value)
        self._changed()
        return Reply(False, self.state, self.last_feedback, effects=frozenset({Effect.HALT}))

    def checkpoint(self, label: str = "") -> Reply:
        """An operator marks a checkpoint (a known-good point): counts as progress."""
        self._checkpoint(label)
        return self._out(Reply(True, self.state))

    def _checkpoint(self, label: str, progress: bool = True) -> None:
        """A restore point (the Session adds it; none is ever dropped); *progress* too."""
        entry = {"id": len(self.checkpoints) + 1, "label": label, "step": self._c.steps, "time": self.now()}
        self.checkpoints.append(entry)
        if progress:
            self._progress()
        self._emit("checkpoint", "", "allow", id=entry["id"], label=label or None)
        self._effects.add(Effect.CHECKPOINT)
        self._changed()

    def rolled_back(self, by: str, to: str, restored: int, failed: dict[str, str],
                    moved_aside: dict[str, str]) -> None:
        """The Session carried out a rollback asked *by* ``breaker`` or ``operator`` (to restore
        point *to*): the ledger keeps how many paths it restored, each path it could not put
        back with the reason, and what it moved aside (at most ``record.ledger_max_items`` of
        each, with their counts). No state changes: a rollback is no progress and no trip."""
        n = self.record.ledger_max_items
        self.rollbacks.append({
            "by": by, "to": to, "step": self._c.steps, "time": self.now(), "restored": restored,
            "failed": [{"path": p, "reason": r} for p, r in itertools.islice(failed.items(), n)],
            "failed_count": len(failed),
            "moved_aside": [{"path": p, "to": d} for p, d in itertools.islice(moved_aside.items(), n)],
            "moved_aside_count": len(moved_aside),
        })
        self._changed()

    # ----- internals ------------------------------------------------------------------

    def _touch(self) -> None:
        self._last_activity = self.now()

    def _changed(self) -> None:
        self.version += 1

    def _progress(self) -> None:
        self._c.since_progress = 0
        self._c.identical.clear()  # the same test command after a real change is a new question
        if self.state is State.HALF_OPEN_REANCHOR and not self._refuse_next:
            self.state = State.CLOSED
            self.last_feedback = ""
            self._emit("breaker", "", "allow", state=State.CLOSED.value, reason="back in scope, progress made")
        self._changed()

    def _gate(self, what: str, deliver: bool = True) -> Verdict:
        """Mutations and tool calls while the breaker is not closed; *deliver*: this act
        may be the one refused to deliver a trip's feedback."""
        if self.state.terminal:
            return Verdict(False, f"breaker {self.state.value}", None, ERRNO_LIMIT, self.last_feedback)
        if self._refuse_next and deliver:
            self._refuse_next = False
            self._changed()
            self._emit("breaker", what, "deny", state=self.state.value, reason="delivering feedback")
            return Verdict(False, f"breaker {self.state.value}", None, ERRNO_LIMIT, self.last_feedback)
        return ALLOW

    def _feedback_if_halted(self) -> str:
        return self.last_feedback if self.state is not State.CLOSED else ""

    def _call(self, tool: str, args: Any, channel: str) -> Reply:
        """Repetition and stagnation bookkeeping for one tool call, as *channel* reported it.

        An agent whose hook and output stream both report its calls (Gemini's BeforeTool hook and
        its stream's tool_use; neither carries the other's call id) reports each call twice: a
        call counts once, so the n-th report of a channel is a new call only when no channel
        reported it n times already. (A shell call is known by its command alone: hooks send
        just that.)
        """
        c = self._c
        if isinstance(args, dict) and "command" in args:
            args = {"command": args["command"]}
        text = tool + " " + _CANONICAL.encode(args)
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        seen = c.identical.pop(key, {})
        before = max(seen.values(), default=0)
        seen[channel] = seen.get(channel, 0) + 1
        n = max(before, seen[channel])
        c.identical[key] = seen  # re-inserted: the dict's order is least recently made first
        if len(c.identical) > _IDENTICAL_KEPT:
            del c.identical[next(iter(c.identical))]
        limit = self.limits.max_identical_calls
        if n == before:  # another channel's report of this same call: not counted again
            if limit is not None and n >= limit:  # refused (once) if the first report's trip still stands
                verdict = self._gate(f"{tool} call")
                return Reply(verdict.allow, self.state, verdict.reason)
            return self._repeat_warning(tool, n, limit)
        c.calls.append(_Call(text[:_SIMILARITY_CHARS]))  # stagnation compares beginnings: bounded work
        if len(c.calls) > 8:
            del c.calls[0]
        if limit is not None and n >= limit:
            return self._reply_trip(Rule.REPEATED_ACTION, (
                f"the same {tool} call, with the same arguments, for the {_nth(n)} time since the last change "
                f"(max_identical_calls={limit})"))
        return self._repeat_warning(tool, n, limit)

    def _repeat_warning(self, tool: str, n: int, limit: int | None) -> Reply:
        if n == 1:
            return _FIRST_CALL
        return Reply(True, self.state, warning=(
                f"guard: warning: this exact {tool} call was already made {n - 1} time(s) since the last change; "
                f"the {_nth(limit) if limit is not None else 'next'} is refused"))

    def _stagnating(self) -> bool:
        calls = self._c.calls[-3:]
        if len(calls) < 3 or not all(call.failed for call in calls):
            return False
        threshold = self.limits.stagnation_similarity
        return all(
            difflib.SequenceMatcher(None, a.text, b.text).ratio() > threshold
            for a, b in itertools.pairwise(calls)
        )

    def _reply_trip(self, rule: Rule, reason: str) -> Reply:
        verdict = self._trip(rule, reason, None)
        return self._out(Reply(False, self.state, verdict.reason, trip=self.trips[-1]))

    def _out(self, reply: Reply) -> Reply:
        """*reply* carrying the effects decided during this call (copied: some replies are shared)."""
        if not self._effects:
            return reply
        return replace(reply, effects=self._take_effects())

    def _take_effects(self) -> Effects:
        if not self._effects:
            return NO_EFFECTS
        effects = frozenset(self._effects)
        self._effects.clear()
        return effects

    def _trip(self, rule: Rule, reason: str, refused: Verdict | None, path: str = "", *,
              limit: str | None = None) -> Verdict:
        """Record a trip and move the state; returns the denial carrying the feedback.

        *refused* is the operation being refused for it, if the trip has one; *path*, the
        path it tripped on, if any; *limit*, the [limits] key that tripped (default: the
        refusal's, else the rule's own).
        """
        if limit is None:
            limit = (refused.rule.removeprefix("limits.") if refused is not None and refused.rule.startswith("limits.")
                     else RULES[rule].limit_key)
        err = refused.errno if refused is not None else ERRNO_LIMIT
        if self.state.terminal:
            return Verdict(False, f"breaker {self.state.value}", None, err, self.last_feedback or reason)
        if self.state is State.CLOSED and rule in self._recoverable and not (
                RULES[rule].once and any(t.rule is rule for t in self.trips)):
            self.state = State.HALF_OPEN_REANCHOR
            self._refuse_next = refused is None  # nothing refused yet: refuse the next act
        else:
            self.state = _OPEN_STATE[rule]
            self._refuse_next = False
            self._effects.add(Effect.FREEZE)
        trip = Trip(rule, self.state, self._c.steps, self.now(), reason, path, limit)
        self.trips.append(trip)
        self._changed_since_test = False  # a change before the trip vouches for no test after it
        self.last_feedback = self.feedback(trip)
        # The path it tripped on is "on" (the event's own path stays "": a trip is no operation).
        self._emit("trip", "", "deny", rule=rule.value, state=self.state.value, step=trip.step, reason=reason,
                   feedback=self.last_feedback, on=path or None)
        self._changed()
        rule_key = refused.rule if refused is not None else _limit_rule(rule)
        pattern = refused.pattern if refused is not None else None
        return Verdict(False, rule_key, pattern, err, self.last_feedback)

    def feedback(self, trip: Trip) -> str:
        """The corrective words: what was refused and why, the goal, the scope, the budget."""
        m = self.manifest
        lim = self.limits
        files = f"{self.accounting.distinct} of {lim.max_files if lim.max_files is not None else 'unlimited'}"
        window = sum(self._c.window)
        if self.state.terminal:
            status = (f"The breaker is now {self.state.value}: further changes are refused until a human "
                      "approves (guard approve) or stops (guard stop) the run.")
        else:
            status = ("The breaker is HALF_OPEN: the next step must be back in scope and make progress; "
                      "another violation halts the run.")
        return "\n".join([
            f"guard: refused: {printable(trip.reason)}",  # a name in it cannot break or forge lines
            f"Rule: {trip.rule.value}" + (f" (limits.{trip.limit})" if trip.limit else ""),
            f"Task {m.task.id}: {m.task.goal}",
            f"Scope: writes only in {', '.join(m.paths.allowed) or 'nowhere (read-only)'}; "
            + (f"never touch {', '.join(m.paths.workspace_secrets)}." if m.paths.workspace_secrets
               else "no path is forbidden beyond the guard's own protections.")
            + (f" Never write {', '.join(m.paths.protected)}." if m.paths.protected else ""),
            f"Used: {files} files, {self._c.tokens_total} tokens ({window} in the last {len(self._c.window)} "
            f"steps), step {self._c.steps}.",
            f"The way back: {RULES[trip.rule].way_back}",
            status,
            "Read .guard/STATE.md for the full state.",
        ])

    # ----- the ledger's view ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the ledger shows, as JSON-ready data, bounded in size.

        Each list keeps at most ``record.ledger_max_items`` entries (the first and the most
        recent; for files, the most rewritten); ``omitted`` says how many each left out.
        """
        m, lim, c = self.manifest, self.limits, self._c
        n = self.record.ledger_max_items
        omitted: dict[str, int] = {}
        trips = _bounded(self.trips, n, "trips", omitted)
        notes = _bounded(list(self.notes), n, "notes", omitted)
        omitted["notes"] += self.notes_dropped
        checkpoints = _bounded(self.checkpoints, n, "checkpoints", omitted)
        rollbacks = _bounded(self.rollbacks, n, "rollbacks", omitted)
        if not omitted["rollbacks"]:
            del omitted["rollbacks"]  # said only when some are left out: the other counts stay as they were
        files = self._files_snapshot(n, omitted)
        feedback = _clip(self.last_feedback, _MAX_FEEDBACK_CHARS, "")
        return {
            "task": {"id": m.task.id, "goal": m.task.goal},
            "scope": {
                "allowed": list(m.paths.allowed),
                "forbidden": list(m.paths.workspace_secrets),
                "protected": list(m.paths.protected),
                "invariants": [".guard/ is read-only", ".git/hooks/ is read-only",
                               ".git/config is read-only if it existed at the start",
                               f"git internals are {m.paths.git_internals}"],
            },
            "state": self.state.value,
            "files": {"distinct": self.accounting.distinct, "max": lim.max_files, "list": files},
            "tokens": {"total": c.tokens_total, "cached": c.tokens_cached, "window": sum(c.window),
                       "window_steps": lim.window_steps, "max_window": lim.max_window_tokens,
                       "since_progress": c.since_progress},
            "steps": c.steps,
            "consecutive_failures": c.consecutive_failures,
            "trips": [{"rule": t.rule.value, "state": t.state.value, "step": t.step, "time": t.time,
                       "reason": t.reason, "path": t.path} for t in trips],
            "last_feedback": feedback,
            "notes": notes,
            "checkpoints": checkpoints,
            "rollbacks": rollbacks,
            "omitted": omitted,
            "limits": lim.model_dump(),
        }

    def _files_snapshot(self, n: int, omitted: dict[str, int]) -> dict[str, Any]:
        """The *n* most rewritten files (by name), each with at most *n* symbols."""
        records = self.accounting.files
        chosen = heapq.nsmallest(n, records.items(), key=lambda kv: (-kv[1].rewrites, kv[0]))
        omitted["files"] = len(records) - len(chosen)
        omitted["symbols"] = 0
        out: dict[str, Any] = {}
        for path, rec in sorted(chosen):
            symbols = heapq.nsmallest(n, rec.symbols.items(), key=lambda kv: (-kv[1], kv[0]))
            omitted["symbols"] += len(rec.symbols) - len(symbols)
            out[path] = {"rewrites": rec.rewrites, "created": rec.created, "symbols": dict(sorted(symbols))}
        return out


def _clip(text: str, limit: int, key: str) -> str:
    """*text* cut at *limit* characters, with a marker saying how much was cut (and by which key)."""
    if len(text) <= limit:
        return text
    by = f": {key}={limit}" if key else ""
    return f"{text[:limit]} [... {len(text) - limit} more characters cut{by}]"


def _bounded(items: Sequence[Any], n: int, name: str, omitted: dict[str, int]) -> list[Any]:
    """At most *n* of *items*: the first and the most recent; the number left out goes to *omitted*."""
    omitted[name] = max(0, len(items) - n)
    if len(items) <= n:
        return list(items)
    head = n // 2
    return [*items[:head], *items[len(items) - (n - head):]]


def _limit_rule(rule: Rule) -> str:
    key = RULES[rule].limit_key
    return f"limits.{key}" if key else f"breaker.{rule.value}"

