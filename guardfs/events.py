"""The audit trail: one JSON line per denial, mutation and limit reached.

Events are data, not log lines. Each is written and flushed as it happens so that a guard
killed mid-run loses nothing already decided. Allowed reads are only counted.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["EventLog"]


class EventLog:
    """Appends events to a JSONL file (or keeps them in memory when no file is given)."""

    def __init__(self, path: str | os.PathLike[str] | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self.counts: Counter[str] = Counter()  # "read" (allowed reads, counted only), "deny", ops
        self._file: TextIO | None = None
        if path is not None:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the log

    def emit(self, op: str, path: str, decision: str, **fields: Any) -> dict[str, Any]:
        """Record one event; returns it."""
        event: dict[str, Any] = {"time": round(self.clock(), 6), "op": op, "path": path, "decision": decision}
        event.update((k, v) for k, v in fields.items() if v is not None)
        self.counts["deny" if decision == "deny" else op] += 1
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
            self._file.flush()
        return event

    def close(self) -> None:
        """Flush and close the file."""
        if self._file is not None:
            self._file.close()
            self._file = None
