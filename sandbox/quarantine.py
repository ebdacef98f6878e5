"""Quarantine of an agent's output: every byte recorded, a digest for CI and for agents.

The full streams go to log files in the run directory, byte for byte, while the console
sees them live (or, with ``--ci``, only the digest): the exit status, the failing lines
(errors, assertions, tracebacks) that fit in 1,200 characters, and where the logs are.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO

__all__ = ["DIGEST_LIMIT", "Recorder", "digest"]

DIGEST_LIMIT = 1200
_FAILING = re.compile(
    rb"(error|fail|assert|traceback|exception|panic|fatal|denied|refused|not found|segmentation)", re.IGNORECASE
)


class Recorder:
    """Appends one stream to its log and, unless quiet, echoes it to the console."""

    def __init__(self, log: Path, echo: BinaryIO | None) -> None:
        self.path = log
        # Unbuffered: every chunk reaches the file at once, so a guard killed mid-run loses
        # nothing the agent printed before.
        self._log = open(log, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self._echo = echo
        self.bytes = 0

    def feed(self, data: bytes) -> None:
        """Record a chunk (and show it)."""
        self._log.write(data)
        self.bytes += len(data)
        if self._echo is not None:
            try:
                self._echo.write(data)
                self._echo.flush()
            except (BrokenPipeError, ValueError):
                self._echo = None  # the console went away; the log goes on

    def flush(self) -> None:
        """Flush the log to the kernel."""
        self._log.flush()

    def close(self) -> None:
        """Flush and close the log."""
        self._log.close()


def _failing_lines(path: Path, keep: int = 400) -> list[bytes]:
    """The last *keep* lines of *path* that look like failures, with traceback bodies."""
    found: list[bytes] = []
    in_traceback = False
    with open(path, "rb") as f:
        for raw in f:
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"Traceback"):
                in_traceback = True
            elif in_traceback and not line.startswith((b" ", b"\t")):
                in_traceback = False
                found.append(line)  # the exception line ending the traceback
                continue
            if in_traceback or _FAILING.search(line):
                found.append(line)
                if len(found) > keep * 2:
                    del found[:keep]
    return found[-keep:]


def digest(status: str, logs: list[Path], limit: int = DIGEST_LIMIT) -> str:
    """At most *limit* characters: the status, the last failing lines, the logs' paths."""
    head = f"guard: {status}"
    tail = "full log: " + ", ".join(str(p) for p in logs)
    budget = limit - len(head) - len(tail) - 2
    lines: list[str] = []
    for log in logs:
        if log.exists():
            lines += [ln.decode("utf-8", "replace") for ln in _failing_lines(log)]
    picked: list[str] = []
    for raw in reversed(lines):  # the most recent failures matter most
        line = raw if len(raw) <= 200 else raw[:197] + "..."
        if len(line) + 1 > budget:
            break
        picked.append(line)
        budget -= len(line) + 1
    body = "\n".join(reversed(picked))
    text = "\n".join(part for part in (head, body, tail) if part)
    if len(text) > limit:  # only if the log paths alone are too long
        text = text[: limit - 3] + "..."
    return text


def console() -> BinaryIO | None:
    """Our own stdout as a binary stream, if there is one."""
    try:
        os.fstat(1)
    except OSError:
        return None
    return os.fdopen(os.dup(1), "wb", buffering=0)
