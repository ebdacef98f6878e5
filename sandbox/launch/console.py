"""What the human at the guard's console sees of the breaker while a run goes on.

One line on the guard's stderr per denial and per trip, as it happens (``--ci`` too): the
operation and its path, the rule, and what the agent was told. The agent decides how many
denials it causes, so their lines are rate-limited (:data:`LINES_PER_SECOND`, with a burst
of :data:`BURST`); what is held back is counted and said in one line (``… 37 more
denials``) when lines flow again, at most a second later, and when the run ends. Trips are
never held back: there are a few per run at most (the breaker is terminal by the second).

The events come from the run's :class:`~guardfs.events.EventLog` as they are emitted, so
the counts behind these lines are the ones the ledger, ``guard report`` and the CI summary
show (:func:`guardfs.events.tally_kind`). Everything the agent controls in a line (names,
reasons quoting them) is escaped for the terminal (:func:`guardfs.events.printable`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import trio

from guardfs.events import printable, tally_kind

__all__ = ["BURST", "LINES_PER_SECOND", "LiveConsole", "denial_line", "trip_line"]

#: Denial lines a second, sustained; a burst of up to BURST comes through at once.
LINES_PER_SECOND = 5
BURST = 10
_REASON_CHARS = 300


def _told(event: dict[str, object]) -> str:
    """What the agent got back for a refused operation: the errno, with its words."""
    name = str(event.get("errno") or "")
    code = getattr(errno, name, None)
    return f"{name} ({os.strerror(code)})" if isinstance(code, int) else name or "a refusal"


def _clip(text: str) -> str:
    """The first line of *text* (a reason, or the feedback a refusal carries), bounded."""
    first = text.split("\n", 1)[0].removeprefix("guard: refused: ")
    return first if len(first) <= _REASON_CHARS else first[:_REASON_CHARS - 3] + "..."


def denial_line(event: dict[str, object]) -> str:
    """One line for a denial event: what was refused, by which rule, what the agent was told."""
    op, path = str(event.get("op")), printable(str(event.get("path") or ""))
    reason = printable(_clip(str(event.get("reason") or "")))
    if op == "check":  # a tool call the agent's hook asked about
        where = f" on {path}" if path else ""
        return (f"denied {printable(str(event.get('tool') or 'tool'))} call{where}: {reason}; "
                "the agent's hook was told so")
    target = f" -> {printable(str(event['target']))}" if event.get("target") else ""
    rule = printable(str(event.get("rule") or "?"))
    return f"denied {printable(op)} {path or '.'}{target} [{rule}]: {reason}; the agent got {_told(event)}"


def trip_line(event: dict[str, object]) -> str:
    """One line for a trip: the rule, where, the state it led to, and what the agent was told."""
    state = str(event.get("state") or "")
    on = f" on {printable(str(event['on']))}" if event.get("on") else ""
    after = ("terminal" if state.startswith("OPEN_") else
             "recoverable: the agent was told why, the task's scope and the way back; its next step must be in scope")
    return (f"TRIP {printable(str(event.get('rule')))}{on} at step {event.get('step')}: "
            f"{printable(_clip(str(event.get('reason') or '')))} -> {printable(state)} ({after})")


class LiveConsole:
    """Says each denial and trip on *out* as it is emitted; see the module's docstring.

    Hand :meth:`on_event` to :meth:`guardfs.events.EventLog.watch`; run :meth:`run` in the
    run's loop (it says what was held back once lines may flow again); :meth:`close` says
    what is left at the end.
    """

    def __init__(self, out: TextIO, run_dir: Path, clock: Callable[[], float] = time.monotonic,
                 per_second: float = LINES_PER_SECOND, burst: int = BURST) -> None:
        self.out = out
        self.run_dir = run_dir
        self.clock = clock
        self.per_second = per_second
        self.burst = burst
        self.held = 0  # denials not shown since the last line that said so
        self._tokens = float(burst)
        self._refilled = clock()
        # A terminal in raw mode (an interactive agent's pty) does not return the carriage itself.
        try:
            self._end = "\r\n" if out.isatty() else "\n"
        except (AttributeError, ValueError):
            self._end = "\n"

    def on_event(self, event: dict[str, object]) -> None:
        """The EventLog's watcher: a line for a denial (if the rate allows) or a trip."""
        kind = tally_kind(str(event.get("op")), str(event.get("decision")))
        if kind == "trips":
            self._say_held()
            self._write(trip_line(event))
        elif kind == "denials":
            if not self._take():
                self.held += 1
                return
            self._say_held()
            self._write(denial_line(event))

    async def run(self) -> None:
        """Say what was held back as soon as the rate allows a line again (until cancelled)."""
        while True:
            await trio.sleep(1.0)
            if self.held and self._take():
                self._say_held()

    def close(self) -> None:
        """Say what is still held back."""
        self._say_held()

    def _take(self) -> bool:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._refilled) * self.per_second)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _say_held(self) -> None:
        if not self.held:
            return
        held, self.held = self.held, 0
        self._write(f"… {held} more denial(s) not shown (at most {self.per_second:g} lines a second here; "
                    f"{self.run_dir / 'events.jsonl'} lists them, the summary counts them)")

    def _write(self, line: str) -> None:
        try:
            self.out.write(f"guard: {line}{self._end}")
            self.out.flush()
        except (OSError, ValueError):  # the console went away; the run and its record go on
            pass
