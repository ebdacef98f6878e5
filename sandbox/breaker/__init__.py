"""The breaker and everything that speaks to it.

- :mod:`sandbox.breaker.machine`: the circuit breaker itself, a pure state machine (no I/O,
  time passed in) over what the mount and the agent report; it returns effects (checkpoint,
  rollback, freeze, halt, resume) that the :class:`~sandbox.session.Session` carries out;
- :mod:`sandbox.breaker.protocol`: the socket messages (pydantic), bounded before parsing;
- :mod:`sandbox.breaker.daemon`: the agent and control sockets, newline-delimited JSON;
- :mod:`sandbox.breaker.client`: the client library for hooks, harnesses and operators;
- :mod:`sandbox.breaker.ledger`: ``ledger.json`` and ``STATE.md``.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox.breaker.machine import NO_EFFECTS, Breaker, Effect, Effects, Reply, Rule, State, Trip

# Resolved on first use (PEP 562): an agent's harness importing sandbox.breaker.client does
# not pay for pydantic and pathspec, which the state machine needs.
_MACHINE = frozenset({"NO_EFFECTS", "Breaker", "Effect", "Effects", "Reply", "Rule", "State", "Trip"})


def __getattr__(name: str) -> object:
    if name not in _MACHINE:
        raise AttributeError(f"module 'sandbox.breaker' has no attribute {name!r}")
    return getattr(importlib.import_module("sandbox.breaker.machine"), name)


__all__ = ["NO_EFFECTS", "Breaker", "Effect", "Effects", "Reply", "Rule", "State", "Trip"]
