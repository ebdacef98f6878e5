"""The capabilities a root guard needs, read once from /proc/self/status, checked before a run.

A guard running as root in a container or a pod has only the capabilities it was given. What
each one is for (found by dropping them one at a time, in tests/test_k8s.py's reproduced pod
and in tests/test_start_refusals.py):

- CAP_SYS_ADMIN: the guard's private mount namespace, its staging tmpfs, the FUSE mount and
  the sandbox's namespaces and binds (bubblewrap, started as root).
- CAP_DAC_OVERRIDE: the run directory, mode 000 so that no sandbox (not even a root agent
  without capabilities) can enter it; the guard, root, writes in it through this capability.

With ``--user`` (the agent runs as another user), besides:

- CAP_SETUID, CAP_SETGID: starting the agent (and bubblewrap) as that user.
- CAP_CHOWN: giving that user what it makes through the mount (its files are its own).
- CAP_FOWNER: changing the mode and times of that user's files through the mount (the
  guard, root, does its chmod and touch on the real files).
- CAP_KILL: stopping the agent, a process of another uid, at a trip.

Standard library only: ``guard doctor`` reads the same table.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from guardfs.errors import UnavailableError

__all__ = ["CAPABILITY_BITS", "FOR_ANY_ROOT_RUN", "FOR_USER", "Capabilities", "CapabilitiesMissing", "missing",
           "own", "require"]

#: linux/capability.h's numbers of the capabilities guard uses.
CAPABILITY_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "KILL": 5, "SETGID": 6, "SETUID": 7, "SYS_ADMIN": 21}

#: What a root guard needs for any run, and what for.
FOR_ANY_ROOT_RUN = {
    "SYS_ADMIN": "the guard's private mount namespace, the FUSE mount and the sandbox's namespaces",
    "DAC_OVERRIDE": "the run directory, mode 000 so that no sandbox can enter it",
}
#: What it needs besides for ``guard run --user``.
FOR_USER = {
    "SETUID": "starting the agent as the --user",
    "SETGID": "starting the agent in the --user's groups",
    "CHOWN": "giving the --user what it makes through the mount",
    "FOWNER": "the --user's chmod and touch through the mount, done by the guard on its files",
    "KILL": "stopping the agent, a process of the --user, at a trip",
}


class CapabilitiesMissing(UnavailableError):
    """A root guard without a capability its run needs; refused before anything starts."""

    machine = True


@dataclass(frozen=True)
class Capabilities:
    """The effective and bounding sets, as /proc/self/status shows them (CapEff, CapBnd)."""

    effective: int
    bounding: int

    def has(self, name: str) -> bool:
        return bool(self.effective >> CAPABILITY_BITS[name] & 1)

    def bounded(self, name: str) -> bool:
        """Whether *name* is in the bounding set (else no process here can ever have it)."""
        return bool(self.bounding >> CAPABILITY_BITS[name] & 1)


@functools.cache
def own() -> Capabilities:
    """This process's sets, read once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            status = f.read()
    except OSError:
        return Capabilities(~0, ~0)  # no /proc: nothing to tell; the run says what fails
    found = {key: int(value, 16) for key, value in re.findall(r"^(CapEff|CapBnd):\s*([0-9a-f]+)$", status, re.M)}
    return Capabilities(found.get("CapEff", ~0), found.get("CapBnd", ~0))


def needed(user: str | None) -> dict[str, str]:
    """What a root guard needs for a run (an agent of *user*, or of root), and what for."""
    return {**FOR_ANY_ROOT_RUN, **(FOR_USER if user is not None else {})}


def missing(user: str | None, caps: Capabilities | None = None) -> dict[str, str]:
    """What this root guard lacks for the run (empty when not root: it needs none)."""
    if os.geteuid() != 0:
        return {}
    have = caps or own()
    return {name: why for name, why in needed(user).items() if not have.has(name)}


def require(user: str | None) -> None:
    """Raise CapabilitiesMissing naming each capability this root guard lacks and what needs it."""
    lacking = missing(user)
    if not lacking:
        return
    names = ", ".join(f"CAP_{name} ({why})" for name, why in lacking.items())
    options = " ".join(f"--cap-add {name}" for name in lacking)
    pod = ", ".join(lacking)
    caps = own()
    unbounded = [name for name in lacking if caps.bounded(name)]
    origin = (f"; {', '.join('CAP_' + n for n in unbounded)} in the bounding set but not effective: the process "
              "that started guard dropped them") if unbounded else ""
    run = "guard run --user" if user is not None else "guard run as root"
    raise CapabilitiesMissing(
        f"{run} needs capabilities this guard does not have: {names}{origin}. Refusing to start the agent; "
        f"a container needs {options} in its run command, a Kubernetes pod "
        f"securityContext.capabilities.add: [{pod}]")
