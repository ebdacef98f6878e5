"""Exit statuses of the ``guard`` command (sysexits.h names where one fits).

One definition, in :mod:`guardfs.errors`, next to the errors that carry them.
"""

from __future__ import annotations

from guardfs.errors import Exit

__all__ = ["Exit"]
