"""Adapters for real agents: output parsers, hooks and launch settings.

What each agent is (its detection, launch settings, parser, mutating tools and hook
convention) is one entry of the table in :mod:`sandbox.agents.registry`.

A parser turns an agent's machine-readable output into :class:`Event` values; the same
events feed the breaker in ``guard run`` (in process) and in ``guard feed`` (over the
socket), through :func:`to_messages`.
"""

from sandbox.agents.events import Event, Step, Tool, ToolDone, Totals, to_messages

__all__ = ["Event", "Step", "Tool", "ToolDone", "Totals", "to_messages"]
