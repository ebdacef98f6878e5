"""guardfs: the filesystem boundary of the guard.

Layers, from the pure core outwards:

- :mod:`guardfs.manifest` validates a task's scope manifest (TOML, pydantic);
- :mod:`guardfs.policy` compiles it into one :class:`~guardfs.policy.Classification` per path;
- :mod:`guardfs.accounting` and :mod:`guardfs.signature` count what the agent mutates;
- :mod:`guardfs.decision` is the protocol through which an injected decider (the breaker)
  judges each operation;
- :mod:`guardfs.fs` is the FUSE passthrough itself, one thin handler per request, over
  :mod:`guardfs.gate` (the one path from a request to verdict, accounting, the decider's
  commit and the event), :mod:`guardfs.sessions` (write sessions of open files),
  :mod:`guardfs.rename` (rename planning), :mod:`guardfs.virtual` (``.guard/STATE.md``),
  :mod:`guardfs.inodes` and :mod:`guardfs.backing`; :mod:`guardfs.mount` serves it.

The FUSE layer (which needs libfuse) is imported from :mod:`guardfs.fs` on demand, so the
manifest tools work on a machine without FUSE. guardfs knows nothing of processes or
sockets; ``sandbox`` builds on it, never the reverse.
"""

import importlib
from typing import TYPE_CHECKING

from guardfs import fusereply

# Before anything imports pyfuse3 (guardfs.fusereply says why).
fusereply.load()

if TYPE_CHECKING:
    from guardfs.decision import Decider, LimitsDecider, Request, Verdict
    from guardfs.errors import GuardError, ManifestError, MountError
    from guardfs.events import EventLog
    from guardfs.manifest import Manifest, load_manifest, parse_manifest
    from guardfs.policy import Classification, PathPolicy, Scope

# Re-exports are resolved on first use (PEP 562): `guard hook`, which runs before every tool
# call, imports guardfs.errors without paying for pydantic and pathspec.
_HOME = {
    "Decider": "decision", "LimitsDecider": "decision", "Request": "decision", "Verdict": "decision",
    "GuardError": "errors", "ManifestError": "errors", "MountError": "errors",
    "EventLog": "events",
    "Manifest": "manifest", "load_manifest": "manifest", "parse_manifest": "manifest",
    "Classification": "policy", "PathPolicy": "policy", "Scope": "policy",
}


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'guardfs' has no attribute {name!r}")
    return getattr(importlib.import_module(f"guardfs.{module}"), name)


__all__ = [
    "Classification",
    "Decider",
    "EventLog",
    "GuardError",
    "LimitsDecider",
    "Manifest",
    "ManifestError",
    "MountError",
    "PathPolicy",
    "Request",
    "Scope",
    "Verdict",
    "load_manifest",
    "parse_manifest",
]
