"""Exit statuses of the ``guard`` command (sysexits.h names where one fits)."""

from __future__ import annotations

import enum

__all__ = ["Exit"]


class Exit(enum.IntEnum):
    """What ``guard`` exits with."""

    OK = 0
    USAGE = 64  # EX_USAGE: bad command line
    DATAERR = 65  # EX_DATAERR: invalid manifest
    UNAVAILABLE = 69  # EX_UNAVAILABLE: no FUSE / libfuse / isolation
    SOFTWARE = 70  # EX_SOFTWARE: internal error
    CANTCREAT = 73  # EX_CANTCREAT: an output file cannot be written
    TRIPPED = 75  # EX_TEMPFAIL: a breaker trip stopped the agent
