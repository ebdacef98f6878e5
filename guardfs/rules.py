"""The breaker's rules: one enum and one table of what each rule means.

The names are those of the manifest (``[breaker] recoverable``), the events (``rule``) and
the breaker's OPEN states (``OPEN_<RULE>``). The table lives here, below the breaker, because
the manifest needs it too (the default of ``recoverable``) and guardfs never imports sandbox.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["RULES", "Rule", "RuleSpec", "default_recoverable"]


class Rule(enum.StrEnum):
    """The breakers of the design's table, named as in ``[breaker] recoverable``."""

    FORBIDDEN_PATH = "forbidden_path"
    SCOPE_SPILL = "scope_spill"
    BLAST_RADIUS = "blast_radius"
    OSCILLATION = "oscillation"
    TOKEN_SURGE = "token_surge"
    TOKEN_VELOCITY = "token_velocity"
    REPEATED_ACTION = "repeated_action"
    STAGNATION = "stagnation"
    CONSECUTIVE_FAILURES = "consecutive_failures"
    IDLE_TRANSPORT = "idle_transport"
    STEP_BUDGET = "step_budget"


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """What one rule means to the breaker, its feedback and its manifest."""

    #: The breaker's terminal state after this rule trips for good: always ``OPEN_<RULE>``.
    open_state: str
    #: The ``[limits]`` key behind the rule (named in feedback; ``guard approve --raise`` raises it).
    limit_key: str | None
    #: Whether the rule's first trip is recoverable unless ``[breaker] recoverable`` says otherwise.
    recoverable: bool
    #: The corrective words the agent gets after "The way back:".
    way_back: str
    #: Whether the rule's recovery is spent by its first trip: any later trip of it in the
    #: run is terminal, even after the breaker closed again.
    once: bool = False


RULES: Mapping[Rule, RuleSpec] = MappingProxyType({
    Rule.FORBIDDEN_PATH: RuleSpec(
        # The read was refused, so nothing leaked: a first attempt is the common innocent
        # case (an agent that tries `cat .env` once and is told why); a second is not.
        "OPEN_FORBIDDEN_PATH", None, True,
        "Do not read or write that path; the task does not need it. A second attempt, "
        "even later in the run, stops it (looking a name up is no attempt).", once=True),
    Rule.SCOPE_SPILL: RuleSpec(
        "OPEN_SCOPE_SPILL", None, True,
        "Make the change inside the allowed paths, or stop and say why the task needs more."),
    Rule.BLAST_RADIUS: RuleSpec(
        "OPEN_BLAST_RADIUS", "max_files", True,
        "Finish with the files already changed; the task should not touch more."),
    Rule.OSCILLATION: RuleSpec(
        "OPEN_OSCILLATION", "max_rewrites", True,
        "You are rewriting the same code again. Step back, re-read the goal and the last "
        "test output, and choose one approach."),
    Rule.TOKEN_SURGE: RuleSpec(
        "OPEN_TOKEN_SURGE", "max_window_tokens", True,
        "Stop reading large outputs; narrow the next command (head, grep, a single test)."),
    Rule.TOKEN_VELOCITY: RuleSpec(
        "OPEN_TOKEN_VELOCITY", "max_tokens_without_progress", True,
        "Many tokens without a file change or a passing test: make one small, tested step."),
    Rule.REPEATED_ACTION: RuleSpec(
        "OPEN_REPEATED_ACTION", "max_identical_calls", True,
        "You already ran this exact call; its result will not change. Try something else."),
    Rule.STAGNATION: RuleSpec(
        "OPEN_STAGNATION", None, True,
        "The last attempts are nearly identical and keep failing: change approach."),
    Rule.CONSECUTIVE_FAILURES: RuleSpec(
        "OPEN_CONSECUTIVE_FAILURES", "max_consecutive_failures", True,
        "Several commands failed in a row: read the last error before the next step."),
    Rule.IDLE_TRANSPORT: RuleSpec(
        "OPEN_IDLE_TRANSPORT", None, False,
        "No activity for too long."),
    Rule.STEP_BUDGET: RuleSpec(
        "OPEN_STEP_BUDGET", "max_steps", False,
        "The turn budget is spent."),
})


def default_recoverable() -> list[Rule]:
    """The rules whose first trip is recoverable by default, in table order."""
    return [rule for rule, spec in RULES.items() if spec.recoverable]
