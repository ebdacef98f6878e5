"""The breaker as a pure state machine: one table row per rule, with its boundary."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from guardfs.accounting import WriteAccounting
from guardfs.decision import Request, Verdict, policy_verdict
from guardfs.events import json_safe, unescape
from guardfs.manifest import parse_manifest
from sandbox.breaker import Breaker, Reply, State
from sandbox.breaker.ledger import render_state

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
    Case("forbidden_path", State.HALF_OPEN_REANCHOR,
         lambda b, c: fs(b, "open", ".env", mutating=False),
         # a stat (git status, an indexer) is refused, but is no trip, whoever asks
         lambda b, c: fs(b, "lookup", ".env", mutating=False, contact=False, intent="newfstatat")),
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
    Case("oscillation", State.HALF_OPEN_REANCHOR,  # A -> B -> A -> B, a flip: its second return
         lambda b, c: (rewrite(b, "src/checkout/r.py", b"A = 1\n", b"B = 1\n"),
                       rewrite(b, "src/checkout/r.py", b"B = 1\n", b"A = 1\n"),
                       rewrite(b, "src/checkout/r.py", b"A = 1\n", b"B = 1\n"))[-1],
         # A -> B -> A, one revert: allowed (max_returns = 1 by default), counted as a rewrite
         lambda b, c: (rewrite(b, "src/checkout/r.py", b"A = 1\n", b"B = 1\n"),
                       rewrite(b, "src/checkout/r.py", b"B = 1\n", b"A = 1\n"))[-1]),
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
    Case("idle_transport", State.OPEN_IDLE_TRANSPORT,
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
    assert state_of(b) is State.OPEN_BLAST_RADIUS
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
    assert state_of(b) is State.HALF_OPEN_REANCHOR  # a first forbidden read recovers
    assert not b.check("Read", [".env"], mutating=False).allow
    assert state_of(b) is State.OPEN_FORBIDDEN_PATH
    b.approve()
    assert not b.check("Write", [], outside=["/etc/passwd"]).allow


def test_warning_on_the_second_identical_call() -> None:
    b, _ = make()
    assert b.step(tool="Bash", args={"cmd": "pytest"}).warning == ""
    second = b.step(tool="Bash", args={"cmd": "pytest"})
    assert second.allow and "already made 1 time" in second.warning


def test_the_same_test_command_after_a_real_change_is_no_repetition() -> None:
    """An edit-test loop repeats its test command; what counts is repetition with nothing changed."""
    b = Breaker(parse_manifest(FIX_TAX + '[limits]\nmax_identical_calls = 3\nmax_files = "unlimited"\n'),
                WriteAccounting(), now=Clock())
    for i in range(5):
        assert b.step(tool="Bash", args={"cmd": "pytest -q"}).allow, i
        assert write(b, f"src/checkout/f{i}.py").allow  # a real in-scope change in between
    b.step(tool="Bash", args={"cmd": "pytest -q"})
    b.step(tool="Bash", args={"cmd": "pytest -q"})
    third = b.step(tool="Bash", args={"cmd": "pytest -q"})
    assert not third.allow and third.trip is not None
    assert "for the 3rd time since the last change" in third.trip.reason


def test_distinct_calls_are_remembered_by_digest_and_bounded() -> None:
    b = Breaker(parse_manifest(FIX_TAX + '[limits]\nmax_steps = "unlimited"\nmax_window_tokens = "unlimited"\n'),
                WriteAccounting(), now=Clock())
    big = "x" * 10_000  # kept whole, 5,000 of them would be 50 MB
    for i in range(5000):
        assert b.step(tool="Write", args={"content": big, "i": i}).allow
    identical = b._c.identical
    assert len(identical) <= 4096 and all(len(key) == 16 for key in identical)
    assert all(len(call.text) <= 2000 for call in b._c.calls)


def test_passing_test_after_a_change_is_progress_and_notes_reach_the_snapshot() -> None:
    # Issue 12: a reported passing test is progress only after a real in-scope change.
    b, _ = make()
    b.step(tokens_in=900)
    assert write(b, "src/checkout/a.py").allow
    b.step(tokens_in=100, tool="Bash", args={"cmd": "pytest tests/checkout"})
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


def test_notes_are_capped_in_count_and_length_and_the_snapshot_in_every_list() -> None:
    b, _ = make("\n[record]\nmax_notes = 5\nmax_note_chars = 20\nledger_max_items = 4\n")
    for i in range(12):
        b.note("note", f"note {i}")
    assert [n["text"] for n in b.notes] == [f"note {i}" for i in range(7, 12)] and b.notes_dropped == 7
    b.note("disproved", "x" * 50)
    assert b.notes[-1]["text"] == "x" * 20 + " [... 30 more characters cut: record.max_note_chars=20]"
    for i in range(10):  # ten trips, each approved
        assert not fs(b, "open", f"src/auth/{i}.ts").allow
        b.approve()
        b.checkpoint(f"c{i}")
    for i in range(10):
        b.accounting.touch(f"src/checkout/f{i}.py", created=True)
    b.accounting.files["src/checkout/f7.py"].rewrites = 5
    snap = b.snapshot()
    assert [t["reason"].split()[0] for t in snap["trips"]] == [f"src/auth/{i}.ts" for i in (0, 1, 8, 9)]
    assert [c["label"] for c in snap["checkpoints"]] == ["c0", "c1", "c8", "c9"]
    assert [n["text"][:6] for n in snap["notes"]] == ["note 8", "note 9", "note 1", "xxxxxx"]
    assert len(snap["files"]["list"]) == 4 and "src/checkout/f7.py" in snap["files"]["list"]
    assert snap["files"]["distinct"] == 10
    assert snap["omitted"] == {"trips": 6, "checkpoints": 6, "notes": 1 + 8, "files": 6, "symbols": 0}
    state = render_state(snap)
    assert "(6 trips between the first and the most recent not shown" in state
    assert "(6 more files (fewer rewrites) not shown" in state and "(9 older notes not shown" in state
    # Bounded records change nothing of the rules: the breaker still trips.
    assert not fs(b, "open", "src/auth/again.ts").allow and len(b.trips) == 11


def test_the_state_file_names_the_secret_and_the_protected_paths_with_their_keys() -> None:
    """The agent reads its scope in .guard/STATE.md (guard status prints it): the protected paths
    were missing there, and the secrets were called 'forbidden', a key the manifest no longer writes."""
    protected = 'protected = ["uv.lock", ".github/workflows/"]\n'
    manifest = parse_manifest(FIX_TAX.replace("forbidden = ", "secret = ") + protected)
    lines = render_state(Breaker(manifest, WriteAccounting(), now=Clock()).snapshot()).splitlines()
    assert "- secret, never read nor written (paths.secret): .env*" in lines
    assert "- read-only, never written (paths.protected): uv.lock, .github/workflows/" in lines


def test_agent_text_cannot_forge_the_state_file() -> None:
    b, _ = make()
    odd = os.fsdecode(b"src/checkout/\xff")
    b.accounting.touch(odd, created=True)
    b.accounting.touch("src/checkout/a\n| forged | 9 |", created=True)
    b.note("note", "\n## Trips\n(none)")
    b.note("subtask", "# heading `code` <!-- hide")
    fs(b, "open", "src/auth/x\n## Notes\n```")
    state = render_state(b.snapshot())
    state.encode("utf-8")
    lines = state.splitlines()
    assert [ln for ln in lines if ln.startswith("#")] == [
        "# guard state: HALF_OPEN_REANCHOR", "## Scope", "## Budget", "## Files mutated", "## Trips",
        "## Last feedback", "## Notes"]
    assert "| src/checkout/\\xff | 0 |" in lines and "| src/checkout/a\\n\\| forged \\| 9 \\| | 0 |" in lines
    assert "- (note) \\n## Trips\\n(none)" in lines
    assert "- (subtask) \\# heading \\`code\\` \\<!-- hide" in lines
    assert all(ln.count("|") - ln.count("\\|") in (0, 3, 6) for ln in lines)  # no forged cell (trips: 5 columns)
    assert [ln for ln in lines if ln.startswith("```")] == ["````", "````"]  # longer than any run inside
    names = json_safe(b.snapshot())["files"]["list"]  # the ledger.json form: lossless
    assert {unescape(p) for p in names} == {b"src/checkout/\xff", b"src/checkout/a\n| forged | 9 |"}


def test_a_forbidden_lookup_is_refused_but_never_trips() -> None:
    """Trip on intent, refuse on contact: a stat is refused even in HALF_OPEN, without a trip."""
    b, _ = make()
    stat = fs(b, "lookup", ".env", mutating=False, contact=False, intent="statx")
    assert not stat.allow and stat.errno == 13 and not b.trips  # EACCES
    fs(b, "open", "src/auth/session.ts")
    assert state_of(b) is State.HALF_OPEN_REANCHOR
    assert not fs(b, "lookup", ".env", mutating=False, contact=False, intent="access").allow
    assert state_of(b) is State.HALF_OPEN_REANCHOR and len(b.trips) == 1  # no escalation


def test_a_forbidden_read_recovers_once_per_run() -> None:
    """The first read of a forbidden path is refused and recoverable; the second, even after
    the agent went back in scope and the breaker closed, stops the run."""
    b, _ = make()
    first = fs(b, "lookup", ".env", mutating=False, intent="openat(read)")
    assert not first.allow and first.errno == 13 and "Rule: forbidden_path" in first.reason
    assert "HALF_OPEN" in first.reason and state_of(b) is State.HALF_OPEN_REANCHOR
    assert "A second attempt, even later in the run, stops it" in first.reason
    assert write(b, "src/checkout/tax.py").allow
    assert state_of(b) is State.CLOSED
    second = fs(b, "lookup", ".env", mutating=False, intent="openat(read)")
    assert not second.allow and state_of(b) is State.OPEN_FORBIDDEN_PATH
    assert [t.rule.value for t in b.trips] == ["forbidden_path"] * 2


def test_the_manifest_can_make_a_forbidden_read_terminal_at_once() -> None:
    b, _ = make('\n[breaker]\nrecoverable = ["scope_spill"]\n')
    assert not fs(b, "open", ".env", mutating=False).allow
    assert state_of(b) is State.OPEN_FORBIDDEN_PATH


def _flip(b: Breaker, times: int) -> list[Verdict]:
    """Flip src/checkout/r.py between two versions *times* times (A -> B is the first)."""
    versions = [fn("x"), fn("x + 1")]
    return [rewrite(b, "src/checkout/r.py", versions[i % 2], versions[(i + 1) % 2]) for i in range(times)]


@pytest.mark.parametrize(("max_returns", "allowed"),
                         [("", 2), ("max_returns = 2\n", 3), ('max_returns = "unlimited"\n', 8)])
def test_max_returns_sets_how_often_a_file_may_flip_back(max_returns: str, allowed: int) -> None:
    """With max_rewrites out of the way, a file may return max_returns times; the next trips."""
    clock = Clock()
    manifest = parse_manifest(MANIFEST.replace("max_rewrites = 2\n", 'max_rewrites = "unlimited"\n' + max_returns))
    b = Breaker(manifest, WriteAccounting(), now=clock)
    verdicts = _flip(b, allowed + 1)  # the first flip is no return
    assert all(v.allow for v in verdicts) is (allowed == 8)
    if allowed == 8:
        assert not b.trips
        return
    assert all(v.allow for v in verdicts[:-1]) and not verdicts[-1].allow
    assert [t.rule.value for t in b.trips] == ["oscillation"]
    assert verdicts[-1].rule == "limits.max_returns"
    assert f"return {allowed} (max_returns={allowed - 1})" in verdicts[-1].reason


def test_a_return_that_landed_unjudged_trips_at_its_commit() -> None:
    """A return no write previewed (written in place, not truncated) trips once it landed."""
    b, _ = make()
    for old, new in ((b"A\n", b"B\n"), (b"B\n", b"A\n")):
        rewrite(b, "src/checkout/r.txt", old, new)
    plan = b.accounting.plan_rewrite("src/checkout/r.txt", b"A\n", b"B\n")
    b.accounting.commit_rewrite(plan, b"A\n")
    b.committed(Request("rewrite", "src/checkout/r.txt", b.policy.classify("src/checkout/r.txt", False), True,
                        rewrite=plan))
    assert [t.rule.value for t in b.trips] == ["oscillation"]
    assert "return 2 (max_returns=1)" in b.trips[0].reason


def test_approve_raises_the_limit_that_tripped_max_returns() -> None:
    """A flip names limits.max_returns, and guard approve --raise raises that one."""
    manifest = parse_manifest(MANIFEST.replace("max_rewrites = 2\n", "max_rewrites = 5\n"))
    b = Breaker(manifest, WriteAccounting(), now=Clock())
    verdicts = _flip(b, 3)
    assert not verdicts[-1].allow and b.trips[-1].limit == "max_returns"
    assert "Rule: oscillation (limits.max_returns)" in verdicts[-1].reason
    assert b.approve(raise_to=2).allow and b.limits.max_returns == 2 and b.limits.max_rewrites == 5
    versions = [fn("x"), fn("x + 1")]
    assert rewrite(b, "src/checkout/r.py", versions[0], versions[1]).allow  # the refused flip, now within it
    assert len(b.trips) == 1 and b.accounting.files["src/checkout/r.py"].returns == 2


def test_a_refused_rename_trips_on_the_path_the_refusal_names() -> None:
    """sed -i writes its temporary in scope and renames it over a file out of scope: the trip
    is recorded on the file the reason names, not on the temporary (seen under guard run:
    "TRIP scope_spill on src/sedpDyb8b" for a refusal of src/auth/jwt.py)."""
    b, _ = make()
    temp, target = "src/checkout/sedpDyb8b", "src/auth/jwt.py"
    verdict = fs(b, "rename", temp, target=target, target_where=b.policy.classify(target, False))
    assert not verdict.allow and f"guard: refused: {target} is outside the task's scope" in verdict.reason
    assert (b.trips[-1].rule.value, b.trips[-1].path) == ("scope_spill", target)
    # A refusal about the request's own path keeps it (the field stays empty).
    own = fs(b, "rename", target, target=temp, target_where=b.policy.classify(temp, False))
    assert not own.allow and b.trips[-1].path == target
