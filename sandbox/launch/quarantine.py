"""Quarantine of an agent's output: every byte recorded up to a cap, a digest for CI and for agents.

The streams go to log files in the run directory as they come, while the console sees
them live (or, with ``--ci``, only the digest): the exit status, the failing lines
(errors, assertions, tracebacks, and the errno words of the guard's refusals) that fit in
1,200 characters, and where the logs are. After a failure the last lines of each log come
first, whatever words they hold: the line that says why a program exited is mostly its last
(``bash: line 1: taggit/utils.py: Read-only file system``).
A log keeps at most ``[sandbox] log_max_bytes`` of its stream: the first half and the
last half, with one marker line between them saying how many bytes were left out, so a
tool printing without end cannot fill the host's disk. The digest streams the logs in
bounded chunks: neither a whole log nor a whole line is ever held in memory.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from guardfs.events import printable

__all__ = ["DIGEST_LIMIT", "LOG_MAX_BYTES", "Recorder", "digest"]

DIGEST_LIMIT = 1200
#: The default cap of one log (the manifest's ``[sandbox] log_max_bytes``).
LOG_MAX_BYTES = 64 << 20
# Words that mark a failing line, in any case. Searched with bytes.find on the lowered
# text: a regex alternation scanned a 64 MiB log at ~15 MB/s, this at memchr speed.
_FAILING = (b"error", b"fail", b"assert", b"traceback", b"exception", b"panic", b"fatal", b"denied",
            b"refused", b"not found", b"segmentation",
            # How the guard's refusals read to a program (EROFS, EDQUOT, EACCES, EPERM, EXDEV).
            b"read-only file system", b"quota exceeded", b"not permitted", b"cross-device")
#: Lines at the end of each log a failure's digest keeps first.
TAIL_LINES = 3
_OVERLAP = 16  # longer than any word of _FAILING, so one split across two chunks is still found
_CHUNK = 1 << 16
_LINE_KEEP = 1024  # bytes of a line kept for the digest, which shows at most 200 characters of one


class Recorder:
    """Records one stream in its log, capped, and, unless quiet, echoes it to the console.

    The first half of *max_bytes* is written in place; past it, the rest goes to a ring
    of the other half in the same file, so the log holds the head and the latest tail.
    While the stream stays under the cap the log is the stream, byte for byte. Over it,
    :meth:`close` puts the ring back in order behind one marker line (if the guard is
    killed before that, the tail is still there, in ring order, without the marker).
    """

    def __init__(self, log: Path, echo: BinaryIO | None, max_bytes: int = LOG_MAX_BYTES) -> None:
        if max_bytes < 2:
            raise ValueError(f"a log cap of {max_bytes} bytes cannot keep a head and a tail")
        self.path = log
        self.max_bytes = max_bytes
        self._head = max_bytes // 2
        self._ring = max_bytes - self._head
        # Written with pwrite, every chunk at once (no user-space buffer): a guard killed
        # mid-run loses nothing the agent printed before.
        # The record: its owner only; never written through a symlink someone put at its name.
        self._fd: int | None = os.open(log, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self._base = os.lseek(self._fd, 0, os.SEEK_END)  # a log of an earlier run here is kept before ours
        self._echo = echo
        self.bytes = 0

    @property
    def dropped(self) -> int:
        """How many bytes of the stream the log leaves out (0 while under the cap)."""
        return max(0, self.bytes - self.max_bytes)

    def describe(self) -> str:
        """One line on what the log kept, for the run summary."""
        if not self.dropped:
            return f"{self.path.name}: all {self.bytes} bytes"
        return (f"{self.path.name}: {self.bytes} bytes printed, the first {self._head} and the last "
                f"{self._ring} kept, {self.dropped} left out (log_max_bytes = {self.max_bytes})")

    def feed(self, data: bytes) -> None:
        """Record a chunk (and show it)."""
        if self._fd is not None:
            self._record(memoryview(data))
        if self._echo is not None:
            try:
                self._echo.write(data)
                self._echo.flush()
            except (BrokenPipeError, ValueError):
                self._echo = None  # the console went away; the log goes on

    def _record(self, view: memoryview) -> None:
        assert self._fd is not None
        off = self.bytes
        self.bytes += len(view)
        while view:
            if off < self._head:
                where, room = off, self._head - off
            else:  # the ring: offset o of the stream lands at head + (o - head) mod ring
                r = (off - self._head) % self._ring
                where, room = self._head + r, self._ring - r
            take = min(len(view), room)
            _pwrite_all(self._fd, view[:take], self._base + where)
            off += take
            view = view[take:]

    def flush(self) -> None:
        """Nothing to do: every chunk is handed to the kernel as it is fed."""

    def close(self) -> None:
        """Put the tail back in order behind the marker, if anything was left out; close."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.dropped:
                self._unroll(fd)
        finally:
            os.close(fd)

    def _unroll(self, fd: int) -> None:
        """Rewrite the log as head, marker, tail (oldest first), through a file renamed over it."""
        head_end = self._base + self._head
        oldest = (self.bytes - self._head) % self._ring
        last = os.pread(fd, 1, head_end - 1) if head_end > 0 else b"\n"
        marker = (b"" if last == b"\n" else b"\n") + (
            f"[guard: {self.dropped} bytes of output left out here; this log keeps the first "
            f"{self._head} and the last {self._ring} bytes (log_max_bytes = {self.max_bytes})]\n"
        ).encode()
        tmp = self.path.with_name(self.path.name + ".unroll")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            src = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                at = _copy(src, out, 0, head_end, 0)
                _pwrite_all(out, memoryview(marker), at)
                at += len(marker)
                at = _copy(src, out, head_end + oldest, self._ring - oldest, at)
                _copy(src, out, head_end, oldest, at)
            finally:
                os.close(src)
        except BaseException:
            os.close(out)
            tmp.unlink(missing_ok=True)
            raise
        os.close(out)
        os.replace(tmp, self.path)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done


def _copy(src: int, dst: int, offset: int, count: int, at: int) -> int:
    """Copy *count* bytes of *src* from *offset* to *dst* at *at*, in bounded chunks; returns
    where the copy ended in *dst*."""
    while count > 0:
        chunk = os.pread(src, min(count, 1 << 20), offset)
        if not chunk:
            break  # the file is shorter than expected (changed under us): keep what there is
        _pwrite_all(dst, memoryview(chunk), at)
        offset += len(chunk)
        at += len(chunk)
        count -= len(chunk)
    return at


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, bool]]:
    """Each line of *f*: its first bytes (at most _LINE_KEEP) and whether a failure word
    occurs anywhere in it. Memory: one chunk and one kept prefix, however long the line."""
    kept = bytearray()
    matched = False
    carry = b""
    while chunk := f.read(_CHUNK):
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            piece = chunk[start:nl] if nl >= 0 else chunk[start:]
            if len(kept) < _LINE_KEEP:
                kept += piece[: _LINE_KEEP - len(kept)]
            if not matched:
                window = carry + piece
                low = window.lower()
                matched = any(word in low for word in _FAILING)
                carry = window[-_OVERLAP:]
            if nl < 0:
                break
            yield bytes(kept).rstrip(b"\r"), matched
            kept, matched, carry = bytearray(), False, b""
            start = nl + 1
    if kept or matched:
        yield bytes(kept).rstrip(b"\r"), matched


def _failing_lines(path: Path, keep: int = 400) -> list[bytes]:
    """The last *keep* lines of *path* that look like failures, with traceback bodies
    (each line cut to its first _LINE_KEEP bytes)."""
    return [line for _, line in _scan(path, keep)[0]]


def _scan(path: Path, keep: int = 400, tail: int = 0) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
    """:func:`_failing_lines` of *path*, and its last *tail* lines that are not blank; each
    as (line number, its first _LINE_KEEP bytes)."""
    found: list[tuple[int, bytes]] = []
    last: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=tail or None)
    in_traceback = False
    with open(path, "rb") as f:
        for number, (line, failing) in enumerate(_lines(f)):
            if tail and line.strip():
                last.append((number, line))
            if line.startswith(b"Traceback"):
                in_traceback = True
            elif in_traceback and not line.startswith((b" ", b"\t")):
                in_traceback = False
                found.append((number, line))  # the exception line ending the traceback
                continue
            if in_traceback or failing:
                found.append((number, line))
                if len(found) > keep * 2:
                    del found[:keep]
    return found[-keep:], list(last) if tail else []


def digest(status: str, logs: list[Path], limit: int = DIGEST_LIMIT, *, failed: bool = False,
           shown: str | None = None) -> str:
    """At most *limit* characters: the status, the last failing lines, the logs' paths (or
    *shown*, what to say of where they are). When the command *failed*, the last
    :data:`TAIL_LINES` lines of each log are kept first, failure words or not."""
    head = f"guard: {status}"
    tail = "full log: " + (shown if shown is not None else ", ".join(str(p) for p in logs))
    budget = limit - len(head) - len(tail) - 2
    failing: list[tuple[int, int, str]] = []  # (log, line number, text), in the logs' order
    last: list[tuple[int, int, str]] = []
    for index, log in enumerate(logs):
        if log.exists():
            found, end = _scan(log, tail=TAIL_LINES if failed else 0)
            failing += [(index, n, ln.decode("utf-8", "replace")) for n, ln in found]
            last += [(index, n, ln.decode("utf-8", "replace")) for n, ln in end]
    picked: dict[tuple[int, int], str] = {}
    # A failure's last lines first (the most recent first), then the failing lines, most recent first.
    for where_log, number, raw in [*reversed(last), *reversed(failing)]:
        if (where_log, number) in picked:
            continue
        line = _shown(raw)
        if len(line) + 1 > budget:
            break
        picked[(where_log, number)] = line
        budget -= len(line) + 1
    body = "\n".join(picked[key] for key in sorted(picked))
    text = "\n".join(part for part in (head, body, tail) if part)
    if len(text) > limit:  # only if the log paths alone are too long
        text = text[: limit - 3] + "..."
    return text


#: What starts a workflow command of a CI runner (GitHub Actions' ``::cmd::``, Azure's and the
#: older runner's ``##[cmd]``): a log line that does is the agent's text, never a command.
_COMMANDS = ("::", "##[", "##vso[")


def _shown(raw: str) -> str:
    """A log line (the agent's bytes) as the digest prints it: at most 200 characters, control
    characters escaped (no escape sequence reaches a terminal), and a line a CI runner would
    take for a workflow command (``::stop-commands::``, which would silence the guard's own
    annotations) marked as the agent's."""
    line = printable(raw if len(raw) <= 200 else raw[:197] + "...")
    return f"(agent) {line}" if line.lstrip().startswith(_COMMANDS) else line


def console() -> BinaryIO | None:
    """Our own stdout as a binary stream, if there is one."""
    try:
        os.fstat(1)
    except OSError:
        return None
    return os.fdopen(os.dup(1), "wb", buffering=0)
