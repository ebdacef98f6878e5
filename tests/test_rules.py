"""The breaker's rule table: one row per rule, and state names that match rule names."""

from __future__ import annotations

import pytest

from guardfs.manifest import BreakerSettings, Limits, parse_manifest
from guardfs.rules import RULES, Rule
from sandbox.breaker import Reply, State

from .helpers import FIX_TAX, state_of
from .test_breaker import CASES, Case, make


def test_the_table_covers_every_rule_and_every_open_state() -> None:
    assert list(RULES) == list(Rule)
    for rule, spec in RULES.items():
        assert spec.open_state == f"OPEN_{rule.name}" == f"OPEN_{rule.value.upper()}"
        assert State(spec.open_state).terminal
        assert spec.way_back.strip()
        assert spec.limit_key is None or spec.limit_key in Limits.model_fields
    rule_states = {State(spec.open_state) for spec in RULES.values()}
    assert {s for s in State if s.terminal} == rule_states | {State.OPEN_STOPPED}


def test_the_manifest_default_is_the_tables_recoverable_column() -> None:
    assert BreakerSettings().recoverable == [r for r in Rule if RULES[r].recoverable]
    assert Rule.FORBIDDEN_PATH in BreakerSettings().recoverable  # a first forbidden read recovers (issue 14)


def test_the_rule_cases_cover_every_rule() -> None:
    assert {Rule(c.rule) for c in CASES} == set(Rule)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.rule}-{i}" for i, c in enumerate(CASES)])
def test_an_unrecoverable_trip_opens_the_state_named_for_its_rule(case: Case) -> None:
    b, clock = make("\n[breaker]\nrecoverable = []\n")
    if case.rule == "stagnation":  # with the failure limit out of the way
        b.limits = b.limits.model_copy(update={"max_consecutive_failures": None})
    out = case.trips(b, clock)
    assert out is not None and not out.allow
    assert state_of(b).value == f"OPEN_{case.rule.upper()}"
    assert b.trips[-1].rule is Rule(case.rule)
    text = out.feedback if isinstance(out, Reply) else out.reason
    spec = RULES[Rule(case.rule)]
    assert f"The way back: {spec.way_back}" in text
    # The limit that tripped: the rule's own, or for oscillation the flip's max_returns.
    limit = b.trips[-1].limit
    assert limit == spec.limit_key or (case.rule == "oscillation" and limit == "max_returns")
    assert (f"(limits.{limit})" in text) == (limit is not None)


def test_feedback_without_forbidden_paths_reads_plainly() -> None:
    from guardfs.accounting import WriteAccounting
    from sandbox.breaker import Breaker

    manifest = parse_manifest(FIX_TAX.replace('forbidden = [".env*"]', "forbidden = []"))
    assert not manifest.paths.forbidden
    b = Breaker(manifest, WriteAccounting(), now=lambda: 0.0)
    text = b.check("Write", ["src/auth/session.ts"]).feedback  # a scope spill
    assert "never touch nothing" not in text
    assert "no path is forbidden beyond the guard's own protections." in text


def test_guardfs_never_imports_sandbox() -> None:
    """The rule table and the error root live in guardfs so that it needs nothing from sandbox."""
    import subprocess
    import sys

    code = ("import sys, guardfs.rules, guardfs.errors, guardfs.manifest, guardfs.policy, guardfs.decision, "
            "guardfs.accounting, guardfs.events, guardfs.checkpoint, guardfs.fs, guardfs.mount; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sandbox'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
