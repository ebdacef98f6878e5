"""The one exception root of the guard, the errors a user can meet, and their exit statuses.

Every error raised on purpose derives from :class:`GuardError` and carries the status the
``guard`` command exits with (``exit_code``), so each verb maps an error the same way, in
one place (``sandbox.cli.main``). It lives here, in guardfs, because guardfs never imports
sandbox; sandbox's errors derive from the same classes.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "CantCreateError", "Exit", "GuardError", "ManifestError", "MountError", "UnavailableError", "UsageError",
]


class Exit(enum.IntEnum):
    """What ``guard`` exits with (sysexits.h names where one fits)."""

    OK = 0
    USAGE = 64  # EX_USAGE: bad command line
    DATAERR = 65  # EX_DATAERR: invalid manifest, or a message the guard rejected
    UNAVAILABLE = 69  # EX_UNAVAILABLE: no FUSE / libfuse / isolation, no guard at the socket
    SOFTWARE = 70  # EX_SOFTWARE: internal error
    CANTCREAT = 73  # EX_CANTCREAT: an output file cannot be written
    TRIPPED = 75  # EX_TEMPFAIL: a breaker trip stopped the agent


class GuardError(Exception):
    """Root of every error the guard raises on purpose; its text says what went wrong and what to do."""

    #: The status ``guard`` exits with when this error ends a command.
    exit_code: ClassVar[Exit] = Exit.SOFTWARE


class UsageError(GuardError):
    """The command line asks for something impossible (a missing directory, a busy run directory)."""

    exit_code = Exit.USAGE


class UnavailableError(GuardError):
    """Something the guard needs is not there: FUSE, isolation, or a guard at a socket."""

    exit_code = Exit.UNAVAILABLE
    #: Whether it is the machine that lacks it (``guard doctor`` says what, and how to fix it).
    machine: ClassVar[bool] = False


class CantCreateError(GuardError):
    """An output file cannot be written."""

    exit_code = Exit.CANTCREAT


class ManifestError(GuardError):
    """A scope manifest that cannot be used; names the file, each bad key and why."""

    exit_code = Exit.DATAERR

    def __init__(self, path: str, problems: list[tuple[str, str]]) -> None:
        self.path = path
        self.problems = problems
        lines = [f"{path}: {key}: {reason}" if key else f"{path}: {reason}" for key, reason in problems]
        super().__init__("invalid manifest\n" + "\n".join(lines))


class MountError(UnavailableError):
    """The guarded mount cannot be set up (no /dev/fuse, no libfuse, bad mountpoint)."""

    machine = True
