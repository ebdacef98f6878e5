"""sandbox: the process boundary of the guard, and the ``guard`` command line.

It builds on :mod:`guardfs` (never the reverse): the circuit breaker (a pure state machine
over what the mount and the agent report), its daemon (the agent and control sockets, the
ledger), the launcher of ``guard run`` (bubblewrap, Landlock, lanes, supervision of the
agent), the agent adapters and hooks, quarantined tool runs (``guard exec``), reports, and
the CLI that ties them together (``guard check|mount|run|status|approve|stop|checkpoint|
rollback|feed|hook|exec|report|doctor|demo``).
"""

# guardfs first, before anything of ours imports pyfuse3: guardfs.fusereply must be loaded
# before pyfuse3 is, or the kernel's listing cache stays off.
import guardfs  # noqa: F401
