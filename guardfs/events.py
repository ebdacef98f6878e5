"""The audit trail: one JSON line per denial, mutation and limit reached.

Events are data, not log lines. Each is written and flushed as it happens so that a guard
killed mid-run loses nothing already decided. Allowed reads are only counted.

The agent decides how many events it causes, so the log is capped in size and in rate
(``[record]`` in the manifest). Past a cap, events are dropped and counted, and one
``dropped`` line says how many of which kinds, written before the next event that is
written and at close. Denials, trips and breaker changes are never dropped, except a
refused lookup that is no violation (``"contact": false``: a stat of a forbidden name, which
an agent may repeat at will).

Names are bytes on Linux and need not be UTF-8; guardfs carries them as ``str`` with
``surrogateescape``. Every string written here is escaped losslessly (see
:func:`escape_name`), so a name that is not UTF-8 is written, visibly, as ``\\xNN``;
the text forms for terminals and markdown (:func:`printable`, :func:`md_text`) live here
too, so that every writer of the guard escapes names the same way.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from guardfs.manifest import Record

__all__ = ["Emit", "EventLog", "escape_name", "json_safe", "md_text", "printable", "tally_kind", "unescape"]

# What needs escaping in JSON: backslashes and lone surrogates (undecodable bytes carried by
# surrogateescape are U+DC80..U+DCFF; JSON input can carry any other lone surrogate).
_JSON_SPECIAL = re.compile("[\\\\\ud800-\udfff]")
# For text a human or an agent reads, also control characters and the invisible format
# characters that reorder or break lines (U+2028/9, the bidi controls).
_TEXT_SPECIAL = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPE = re.compile(r"\\(\\|n|r|t|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4})")


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if ch in _SHORT:
        return _SHORT[ch]
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"  # a byte that is not UTF-8, as surrogateescape carries it
    if code < 0x80:
        return f"\\x{code:02x}"  # a control character; never ambiguous with a byte, which is >= 0x80
    return f"\\u{code:04x}"


def escape_name(text: str) -> str:
    """*text* with ``\\`` doubled and each byte that is not UTF-8 written ``\\xNN``.

    The form of every string in ``events.jsonl`` and ``ledger.json``; a name that is valid
    UTF-8 and has no backslash is unchanged. :func:`unescape` inverts it.
    """
    return _JSON_SPECIAL.sub(_escape_char, text)


def printable(text: str) -> str:
    """*text* for a terminal or markdown: as :func:`escape_name`, and control characters
    (``\\n``, ``\\t``, ``\\xNN``) and invisible line or direction marks (``\\uNNNN``) too."""
    return _TEXT_SPECIAL.sub(_escape_char, text)


# A character that would start a block (heading, quote, list, thematic break, setext
# underline) at the start of a list item or a line.
_BLOCK_MARK = re.compile(r"^[#>+*=~_-]")
_ORDERED = re.compile(r"^(\d+)([.)])")


def md_text(text: str) -> str:
    """*text* (a name, a note, anything the agent controls) safe inside one line of markdown.

    Lossless and visible: bytes that are not UTF-8 and control characters are written as
    escapes (``\\xff``, ``\\n``, see :func:`printable`); ``|``, backticks
    and ``<`` are backslash-escaped and a block marker at its start is escaped, so the text
    can neither end its line, nor forge a heading, a table row, a fence or HTML.
    """
    text = printable(text)
    text = text.replace("|", "\\|").replace("`", "\\`").replace("<", "\\<")
    return _ORDERED.sub(r"\1\\\2", _BLOCK_MARK.sub(r"\\\g<0>", text))


def unescape(text: str) -> bytes:
    """The bytes that :func:`escape_name` or :func:`printable` wrote as *text*."""
    out = bytearray()
    pos = 0
    for match in _ESCAPE.finditer(text):
        out += text[pos:match.start()].encode("utf-8", "surrogateescape")
        code = match.group(1)
        if code[0] in "xu":
            value = int(code[1:], 16)
            if code[0] == "x" and value >= 0x80:
                out.append(value)
            else:
                out += chr(value).encode("utf-8", "surrogatepass")
        else:
            out += {"\\": b"\\", "n": b"\n", "r": b"\r", "t": b"\t"}[code]
        pos = match.end()
    out += text[pos:].encode("utf-8", "surrogateescape")
    return bytes(out)


def json_safe(value: Any) -> Any:  # any JSON shape in, the same shape out: the caller knows it
    """*value* with every string in it (keys too) escaped by :func:`escape_name`."""
    if isinstance(value, str):
        return escape_name(value)
    if isinstance(value, dict):
        return {(escape_name(k) if isinstance(k, str) else k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


# Ops that change the breaker's state or the workspace as a whole: never dropped. Not
# "checkpoint": the agent makes one with every passing test run, as often as it likes (the
# ledger lists them, bounded).
_KEPT_OPS = frozenset({"trip", "breaker", "approve", "stop", "rollback", "limit"})
# A malformed socket message is refused before it reaches the breaker: it refuses no
# operation, and a flood of them is what the caps are for. Counted, and dropped past a cap.
_NOISE_OPS = frozenset({"protocol"})


#: A "dropped" line is written at most this often (and at close): under a sustained flood,
#: one line before every kept event would be a flood of its own.
DROPPED_EVERY_S = 1.0


# Denials that refuse no operation of the agent's: the breaker's bookkeeping (a trip, counted
# as one; the feedback delivered with a refusal, which has its own event; an operator's stop)
# and a malformed socket message.
_NOT_REFUSALS = frozenset({"trip", "breaker", "stop", "protocol"})


def tally_kind(op: str, decision: str) -> str | None:
    """What an event counts as, the one definition behind every count of a run (the console,
    ``ledger.json``'s ``counts``, ``guard report``, the CI summary): ``"trips"``,
    ``"denials"`` (an operation or a tool call the agent was refused), or None."""
    if op == "trip":
        return "trips"
    if decision == "deny" and op not in _NOT_REFUSALS:
        return "denials"
    return None


def _kept(op: str, decision: str, contact: object) -> bool:
    return op in _KEPT_OPS or (decision == "deny" and op not in _NOISE_OPS and contact is not False)


class Emit(Protocol):
    """Where an event goes: :meth:`EventLog.emit`, or a sink that wraps it."""

    def __call__(self, op: str, path: str, decision: str, **fields: object) -> object:
        """Record one event."""
        ...


def _private(path: str, flags: int) -> int:
    """os.open for the event log: created 0600."""
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class EventLog:
    """Appends events to a JSONL file (or keeps them in memory when no file is given).

    *caps* bound the file (size and rate); the manifest's ``[record]`` defaults without it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        clock: Callable[[], float] = time.time,
        caps: Record | None = None,
    ) -> None:
        self.path = path
        self.clock = clock
        self.caps = caps if caps is not None else Record()
        self.counts: Counter[str] = Counter()  # "read" (allowed reads, counted only), "deny", ops
        #: Denials and trips (:func:`tally_kind`), each counted when emitted, dropped by a cap or not.
        self.tally: Counter[str] = Counter({"denials": 0, "trips": 0})
        self._watchers: list[Callable[[dict[str, object]], None]] = []
        self.dropped: Counter[str] = Counter()  # every event dropped by a cap, by op, for the run
        self._pending: Counter[str] = Counter()  # dropped since the last "dropped" line
        self._pending_caps: set[str] = set()
        self._pending_since = 0.0
        self._tokens = float(self.caps.events_burst)
        self._refilled: float | None = None
        self._size = 0
        self._file: TextIO | None = None
        if path is not None:
            # 0600: the run's record is the guard's, whatever the umask.
            self._file = open(path, "a", encoding="utf-8", opener=_private)  # noqa: SIM115 - lives as long as the log
            self._size = os.fstat(self._file.fileno()).st_size

    def emit(self, op: str, path: str, decision: str, **fields: object) -> dict[str, object]:
        """Record one event; returns it (with its strings as given, not escaped)."""
        now = self.clock()
        event: dict[str, object] = {"time": round(now, 6), "op": op, "path": path, "decision": decision}
        event.update((k, v) for k, v in fields.items() if v is not None)
        self.counts["deny" if decision == "deny" else op] += 1
        if (kind := tally_kind(op, decision)) is not None:
            self.tally[kind] += 1
        for watcher in self._watchers:
            watcher(event)
        if self._file is None:
            return event
        if not _kept(op, decision, fields.get("contact")) and (cap := self._over_cap(now)) is not None:
            if not self._pending:
                self._pending_since = now
            self._pending[op] += 1
            self._pending_caps.add(cap)
            self.dropped[op] += 1
            return event
        if self._pending and now - self._pending_since >= DROPPED_EVERY_S:
            self._flush_dropped(now)  # at most one such line a second under a sustained flood
        self._write(event)
        return event

    def watch(self, watcher: Callable[[dict[str, object]], None]) -> Callable[[], None]:
        """Call *watcher* with every event as it is emitted (whatever the caps keep of it);
        returns the function that stops it. It must not block: it runs inside the request."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher)

    def _over_cap(self, now: float) -> str | None:
        """The cap that drops an event now, if any; takes a token from the bucket if not."""
        caps = self.caps
        if self._size >= caps.events_max_bytes:
            return "events_max_bytes"
        if self._refilled is not None:
            elapsed = max(0.0, now - self._refilled)  # a wall clock may step back
            self._tokens = min(float(caps.events_burst), self._tokens + elapsed * caps.events_per_second)
        self._refilled = now
        if self._tokens < 1.0:
            return "events_per_second"
        self._tokens -= 1.0
        return None

    def _flush_dropped(self, now: float) -> None:
        """Write the one line that counts what was dropped since the last such line."""
        if not self._pending:
            return
        line = {
            "time": round(now, 6), "op": "dropped", "path": "", "decision": "drop",
            "count": sum(self._pending.values()), "kinds": dict(sorted(self._pending.items())),
            "caps": {cap: getattr(self.caps, cap) for cap in sorted(self._pending_caps)},
            "since": round(self._pending_since, 6),
        }
        self._pending.clear()
        self._pending_caps.clear()
        self._write(line)

    def _write(self, event: dict[str, object]) -> None:
        assert self._file is not None
        line = json.dumps(json_safe(event), separators=(",", ":")) + "\n"  # ASCII: len is bytes
        self._file.write(line)
        self._file.flush()
        self._size += len(line)

    def close(self) -> None:
        """Write what was dropped and not yet said, flush and close the file."""
        if self._file is not None:
            self._flush_dropped(self.clock())
            self._file.close()
            self._file = None
