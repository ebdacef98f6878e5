"""The breaker as a pure state machine: one table row per rule, with its boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from guardfs.accounting import WriteAccounting
from guardfs.decision import Request, Verdict, policy_verdict
from guardfs.manifest import parse_manifest
from sandbox.breaker import Breaker, Reply, State

from .helpers import FIX_TAX, state_of

MANIFEST = FIX_TAX + """
[limits]
max_files = 2
max_rewrites = 2
window_steps = 3
max_window_tokens = 1000
max_tokens_without_progress = 1500
max_consecutive_failures = 3
max_identical_calls = 3
stagnation_similarity = 0.8
idle_timeout_s = 300
max_steps = 8
"""


class Clock:
    """The one source of time, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(extra: str = "") -> tuple[Breaker, Clock]:
    clock = Clock()
    manifest = parse_manifest(MANIFEST + extra)
    return Breaker(manifest, WriteAccounting(), now=clock), clock


def fs(b: Breaker, op: str, path: str, mutating: bool = True, **kw: object) -> Verdict:
    """A filesystem request, judged as guardfs does (policy first, then the decider)."""
    request = Request(op, path, b.policy.classify(path, False), mutating, **kw)  # type: ignore[arg-type]
    return b.decide(request, policy_verdict(request))


def write(b: Breaker, path: str) -> Verdict:
    """A write of a new counted file that lands (committed when allowed)."""
    new = (path,) if b.accounting.is_new(path) else ()
    request = Request("create", path, b.policy.classify(path, False), True, new_files=new)
    verdict = b.decide(request, policy_verdict(request))
    if verdict.allow:
        for p in new:
            b.accounting.touch(p, created=True)
        b.committed(request)
    return verdict


def rewrite(b: Breaker, path: str, old: bytes, new: bytes) -> Verdict:
    """An atomic save of *path* from *old* to *new*."""
    plan = b.accounting.plan_rewrite(path, old, new)
    request = Request("rename", path, b.policy.classify(path, False), True, rewrite=plan)
    verdict = b.decide(request, policy_verdict(request))
    if verdict.allow:
        b.accounting.commit_rewrite(plan, old)
        b.committed(request)
    return verdict


def fn(body: str) -> bytes:
    return f"def total(x):\n    return {body}\n".encode()


Outcome = Verdict | Reply | None


@dataclass
class Case:
    """Events that trip a rule, and the longest prefix-like sequence that must not."""

    rule: str
    state: State
    trips: Callable[[Breaker, Clock], Outcome]
    boundary: Callable[[Breaker, Clock], Outcome]


def _steps(b: Breaker, tokens: list[int]) -> Outcome:
    out: Outcome = None
    for t in tokens:
        out = b.step(tokens_in=t)
    return out


def _calls(b: Breaker, n: int, similar: bool = False, fail: bool = True) -> Outcome:
    out: Outcome = None
    for i in range(n):
        args = {"cmd": f"pytest tests/checkout -k total_{i}"} if similar else {"cmd": "ls"}
        out = b.step(tool="Bash", args=args)
        if not out.allow:
            return out
        out = b.tool_result("Bash", 1 if fail else 0)
    return out


def _failures(b: Breaker, codes: list[int]) -> Outcome:
    out: Outcome = None
    for i, code in enumerate(codes):
        b.step(tool="Bash", args={"cmd": f"make step{i}-{'x' * i * 7}"})
        out = b.tool_result("Bash", code)
    return out


def _idle(b: Breaker, clock: Clock, wait: float) -> Outcome:
    b.hello("test")
    clock.t += wait
    return b.tick()


CASES = [
    Case("forbidden_path", State.OPEN_FORBIDDEN_PATH,
         lambda b, c: fs(b, "open", ".env", mutating=False),
         # git stats tracked files: refused, but no trip
         lambda b, c: fs(b, "lookup", ".env", mutating=False, actor="git")),
    Case("scope_spill", State.HALF_OPEN_REANCHOR,
         lambda b, c: fs(b, "open", "src/auth/session.ts"),
         lambda b, c: fs(b, "open", "src/auth/session.ts", mutating=False)),
    Case("blast_radius", State.HALF_OPEN_REANCHOR,
         lambda b, c: [write(b, f"src/checkout/{n}.py") for n in "abc"][-1],
         lambda b, c: [write(b, f"src/checkout/{n}.py") for n in "aba"][-1]),
    Case("oscillation", State.HALF_OPEN_REANCHOR,
         lambda b, c: (rewrite(b, "src/checkout/t.py", fn("x"), fn("x + 1")),
                       rewrite(b, "src/checkout/t.py", fn("x + 1"), fn("x + 2")),
                       rewrite(b, "src/checkout/t.py", fn("x + 2"), fn("x + 3")))[-1],
         lambda b, c: (rewrite(b, "src/checkout/t.py", fn("x"), fn("x + 1")),
                       rewrite(b, "src/checkout/t.py", fn("x + 1"), fn("x + 2")))[-1]),
    Case("oscillation", State.HALF_OPEN_REANCHOR,  # A -> B -> A, within max_rewrites of each unit
         lambda b, c: (rewrite(b, "src/checkout/r.txt", b"A\n", b"B\n"),
                       rewrite(b, "src/checkout/r.txt", b"B\n", b"A\n"))[-1],
         lambda b, c: rewrite(b, "src/checkout/r.txt", b"A\n", b"B\n")),
    Case("token_surge", State.HALF_OPEN_REANCHOR,
         lambda b, c: _steps(b, [400, 400, 201]),
         lambda b, c: _steps(b, [400, 400, 200, 400])),  # the window slides: 200+400+... stays <= 1000
    Case("token_velocity", State.HALF_OPEN_REANCHOR,
         lambda b, c: _steps(b, [300] * 5 + [1]),
         lambda b, c: (_steps(b, [300] * 5), write(b, "src/checkout/a.py"), _steps(b, [300]))[-1]),
    Case("repeated_action", State.HALF_OPEN_REANCHOR,
         lambda b, c: _calls(b, 3, fail=False),
         lambda b, c: _calls(b, 2, fail=False)),
    Case("stagnation", State.HALF_OPEN_REANCHOR,
         lambda b, c: _calls(b, 3, similar=True),
         lambda b, c: (_calls(b, 2, similar=True), _calls(b, 1, similar=True, fail=False))[-1]),
    Case("consecutive_failures", State.HALF_OPEN_REANCHOR,
         lambda b, c: _failures(b, [1, 1, 1]),
         lambda b, c: _failures(b, [1, 1, 0, 1, 1])),
    Case("idle_transport", State.OPEN_TRANSPORT_IDLE,
         lambda b, c: _idle(b, c, 301),
         lambda b, c: _idle(b, c, 300)),
    Case("step_budget", State.OPEN_STEP_BUDGET,
         lambda b, c: _steps(b, [1] * 9),
         lambda b, c: _steps(b, [1] * 8)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule}-{i}" for i, c in enumerate(CASES)])
def test_rule_trips_and_its_boundary_does_not(case: Case) -> None:
    b, clock = make()
    if case.rule == "stagnation":  # with the failure limit out of the way
        b.limits = b.limits.model_copy(update={"max_consecutive_failures": None})
    out = case.trips(b, clock)
    assert out is not None
    assert not out.allow
    assert state_of(b) is case.state
    assert b.trips[-1].rule.value == case.rule
    text = out.feedback if isinstance(out, Reply) else out.reason
    assert f"Rule: {case.rule}" in text
    assert "Fix the tax rounding helper" in text
    assert "src/checkout/" in text

    b2, clock2 = make()
    if case.rule == "stagnation":
        b2.limits = b2.limits.model_copy(update={"max_consecutive_failures": None})
    case.boundary(b2, clock2)
    assert state_of(b2) is State.CLOSED
    assert not b2.trips


def test_half_open_refuses_then_closes_on_progress() -> None:
    b, _ = make()
    spill = fs(b, "open", "src/auth/session.ts")
    assert not spill.allow and spill.errno == 30  # EROFS: the operation itself is refused
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    assert "HALF_OPEN" in spill.reason and "The way back" in spill.reason
    assert write(b, "src/checkout/tax.py").allow
    assert state_of(b) is State.CLOSED


def test_second_violation_is_terminal_and_approve_resumes() -> None:
    b, _ = make()
    fs(b, "open", "src/auth/session.ts")
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    fs(b, "open", "src/billing/invoice.ts")
    assert state_of(b) is State.OPEN_SCOPE_SPILL
    refused = write(b, "src/checkout/tax.py")  # in scope, but the run is halted
    assert not refused.allow and "approves" in refused.reason
    assert not b.check("Write", ["src/checkout/tax.py"]).allow
    assert b.approve().state is State.CLOSED
    assert write(b, "src/checkout/tax.py").allow


def test_trip_without_an_operation_refuses_the_next_mutation_once() -> None:
    b, _ = make()
    surge = b.step(tokens_in=1500)
    assert surge.trip is not None and b.state is State.HALF_OPEN_REANCHOR
    refused = write(b, "src/checkout/a.py")
    assert not refused.allow and "token_surge" in refused.reason
    assert write(b, "src/checkout/a.py").allow  # feedback delivered; back in scope with progress
    assert state_of(b) is State.CLOSED


def test_approve_can_raise_the_limit_that_tripped() -> None:
    b, _ = make('\n[breaker]\nrecoverable = []\n')
    write(b, "src/checkout/a.py")
    write(b, "src/checkout/b.py")
    write(b, "src/checkout/c.py")
    assert state_of(b) is State.OPEN_BLAST_RADIUS_EXCEEDED
    assert not b.approve(raise_to=2).allow  # not higher than the current limit
    assert b.approve(raise_to=4).state is State.CLOSED
    assert b.limits.max_files == 4
    assert write(b, "src/checkout/c.py").allow


def test_check_judges_paths_before_a_tool_runs() -> None:
    b, _ = make()
    assert b.check("Write", ["src/checkout/tax.py"]).allow
    denied = b.check("Write", ["src/auth/session.ts"])
    assert not denied.allow and denied.trip is not None and "scope_spill" in denied.feedback
    b.approve()
    assert not b.check("Read", [".env"], mutating=False).allow
    assert state_of(b) is State.OPEN_FORBIDDEN_PATH
    b.approve()
    assert not b.check("Write", [], outside=["/etc/passwd"]).allow


def test_warning_on_the_second_identical_call() -> None:
    b, _ = make()
    assert b.step(tool="Bash", args={"cmd": "pytest"}).warning == ""
    second = b.step(tool="Bash", args={"cmd": "pytest"})
    assert second.allow and "already made 1 time" in second.warning


def test_passing_test_is_progress_and_notes_reach_the_snapshot() -> None:
    b, _ = make()
    b.step(tokens_in=900)
    b.step(tool="Bash", args={"cmd": "pytest tests/checkout"})
    b.tool_result("Bash", 0, "pytest tests/checkout")
    assert b.snapshot()["tokens"]["since_progress"] == 0
    b.note("disproved", "rounding is not the bug")
    b.checkpoint("green")
    snap = b.snapshot()
    assert snap["notes"][0]["kind"] == "disproved"
    assert [c["label"] for c in snap["checkpoints"]] == ["passing test: pytest tests/checkout", "green"]
    assert b.stop().state is State.OPEN_STOPPED


def test_the_same_violation_again_is_a_second_violation() -> None:
    """Retries below the agent (a buffered write failing again at close) are absorbed by the
    filesystem, per open file; an agent trying the same thing again is a new act."""
    b, _ = make()
    fs(b, "open", "src/auth/session.ts")
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    fs(b, "open", "src/auth/session.ts")
    assert state_of(b) is State.OPEN_SCOPE_SPILL
