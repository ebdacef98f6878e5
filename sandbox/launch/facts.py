"""What a run records about itself for its report: ``run.json`` in the run directory.

The ledger is the breaker's, rewritten by the daemon as the run goes; ``run.json`` is the
launcher's: what was run, where and when, and, once the agent ended, how the run ended and
what it changed. A report read later and elsewhere (a CI artifact, without the workspace)
needs nothing more than the run directory.

Fields (a reader takes each as optional: a run of an older guard has no ``run.json``, and a
guard killed mid-run leaves the start's fields only). Paths in ``diff`` are escaped as in the
ledger (:func:`guardfs.events.escape_name`); the command is as given.

- ``version``: 1.
- ``command``: the agent's argv; ``cwd``, ``workspace``: where it ran; ``agent``: its name in
  the agents' table, or ``generic``; ``ci``: whether ``--ci`` was given.
- ``started``, ``ended``: seconds since the epoch; ``duration_s``: ``ended - started``.
- ``exit_status``: what ``guard run`` exited with.
- ``stopped_by``: who or what ended the run, ``{"kind", "detail", ...}`` with *kind* one of
  :data:`STOP_KINDS` (``rule`` and ``state`` for the breaker's kinds, ``signal`` for a signal,
  ``status`` for the agent's own exit).
- ``diff``: what the run changed, :func:`diff_stat`; or ``{"error": why}`` when it could not be
  computed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guardfs.backing import Backing
from guardfs.checkpoint import start_images
from guardfs.events import escape_name
from sandbox.breaker.ledger import write_atomic

__all__ = ["CHANGES", "DIFF_MAX_FILES", "LINES_MAX_BYTES", "LINES_TOTAL_MAX_BYTES", "RUN_FILE", "STOP_KINDS",
           "diff_stat", "read_facts", "record_end", "record_start"]

RUN_FILE = "run.json"
#: ``stopped_by.kind``: the agent ended by itself; the breaker stopped it on a terminal trip;
#: its idle timeout (the breaker's ``idle_transport`` rule) did; an operator's ``guard stop``;
#: a signal to the guard (SIGINT, SIGTERM, SIGHUP); the guard's own failure.
STOP_KINDS = ("agent", "breaker", "timeout", "operator", "signal", "guard-failure")
#: What a file's ``change`` is, in ``diff``.
CHANGES = ("added", "modified", "deleted", "type-changed")
#: Files listed in ``diff.files``; the totals count every one.
DIFF_MAX_FILES = 500
#: A side of a file larger than this is not read for its lines (its change is listed, lines None).
LINES_MAX_BYTES = 8 << 20
#: Bytes read for line counts over the whole run (both sides); past that, files are listed with lines None.
LINES_TOTAL_MAX_BYTES = 256 << 20
#: Git's test for a binary file: a NUL byte in its first 8000 bytes.
_BINARY_PROBE = 8000


def record_start(run_dir: Path, command: list[str], cwd: Path, workspace: Path, agent: str, ci: bool) -> None:
    """Write ``run.json`` with what is known when the run starts."""
    _write(run_dir, {"version": 1, "command": list(command), "cwd": str(cwd), "workspace": str(workspace),
                     "agent": agent, "ci": ci, "started": time.time()})


def record_end(run_dir: Path, exit_status: int, stopped_by: dict[str, Any], diff: dict[str, Any]) -> None:
    """Complete ``run.json`` with how the run ended and what it changed."""
    facts = read_facts(run_dir)
    ended = time.time()
    facts.update(ended=ended, exit_status=exit_status, stopped_by=stopped_by, diff=diff)
    if isinstance(facts.get("started"), int | float):
        facts["duration_s"] = round(ended - facts["started"], 3)
    _write(run_dir, facts)


def read_facts(run_dir: Path) -> dict[str, Any]:
    """``run.json`` of *run_dir* as a dict; ``{}`` when there is none (an older guard's run)
    or it is no JSON object (a guard killed while writing it)."""
    try:
        facts = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def _write(run_dir: Path, facts: dict[str, Any]) -> None:
    # Any name, any bytes: a string not UTF-8 goes as JSON's \u escapes of its surrogates.
    write_atomic(run_dir / RUN_FILE, json.dumps(facts, indent=2).encode())


# --- diff stat ------------------------------------------------------------------------------

#: The scopes (guardfs.policy.Scope values) a change in is in the task's scope.
_IN_SCOPE = frozenset({"allowed", "generated"})


def diff_stat(workspace: Path, store: Path, scope_of: Callable[[str, bool], str]) -> dict[str, Any]:
    """What the run changed, from its pre-images (``store``: the run's ``checkpoint/``) against
    the workspace as the run left it.

    Returns ``{"files": [...], "omitted": n, "totals": {...}, "git_files": n}``. Each file is
    ``{"path", "change", "added", "deleted", "binary", "scope", "in_scope"}``: *change* is
    ``added``, ``modified``, ``deleted`` or ``type-changed``; *added* and *deleted* count lines
    (None for a binary file, a side past :data:`LINES_MAX_BYTES`, or once the run's files
    passed :data:`LINES_TOTAL_MAX_BYTES`; a line moved within a file counts as neither);
    *scope* is the policy's (``guardfs.policy.Scope``) for the path, *in_scope* whether that
    is the task's scope; *path* is escaped as in the ledger. Totals: ``files``, ``in_scope``,
    ``out_of_scope``, ``lines_added``, ``lines_deleted`` and a count per change (each of
    :data:`CHANGES`). Directories are not listed (git does not list them either), nor git's
    own files (``git_files`` counts them) nor generated output (never kept: ``[paths]
    generated``). ``scope_of(path, is_dir)`` classifies.
    """
    images = start_images(store)
    backing = Backing(str(workspace))
    files: list[dict[str, Any]] = []
    git_files = 0
    budget = LINES_TOTAL_MAX_BYTES
    try:
        for path in sorted(images):
            record, blob = images[path]
            if record["kind"] in ("generated", "dir"):
                continue
            before = _Side.from_record(record, blob)
            after = _Side.from_workspace(backing, path)
            if after.kind == "dir":
                continue
            change = _change(before, after)
            if change is None:
                continue
            scope = scope_of(path, False)
            if scope.startswith("git-"):
                git_files += 1
                continue
            budget -= len(before.data or b"") + len(after.data or b"")
            added, deleted = _lines(before, after) if budget >= 0 else (None, None)
            files.append({"path": escape_name(path), "change": change, "added": added, "deleted": deleted,
                          "binary": before.binary or after.binary, "scope": scope, "in_scope": scope in _IN_SCOPE})
    finally:
        backing.close()
    in_scope = sum(f["in_scope"] for f in files)
    totals = {"files": len(files), "in_scope": in_scope, "out_of_scope": len(files) - in_scope,
              "lines_added": sum(f["added"] or 0 for f in files),
              "lines_deleted": sum(f["deleted"] or 0 for f in files),
              **{change: sum(f["change"] == change for f in files) for change in CHANGES}}
    return {"files": files[:DIFF_MAX_FILES], "omitted": max(len(files) - DIFF_MAX_FILES, 0), "totals": totals,
            "git_files": git_files}


class _Side:
    """One side of a path's change: its kind and, for a file or symlink, its bytes (None when
    too large to read or not kept)."""

    def __init__(self, kind: str, data: bytes | None = None) -> None:
        self.kind = kind
        self.data = data

    @property
    def binary(self) -> bool:
        return self.data is not None and b"\0" in self.data[:_BINARY_PROBE]

    @classmethod
    def from_record(cls, record: dict[str, object], blob: Path | None) -> _Side:
        kind = str(record["kind"])
        if kind == "symlink":
            return cls("symlink", os.fsencode(str(record.get("target", ""))))
        if kind == "file" and blob is not None:
            with contextlib.suppress(OSError):
                if blob.lstat().st_size <= LINES_MAX_BYTES:
                    return cls("file", blob.read_bytes())
            return cls("file")
        if kind == "unrestorable":  # a file past checkpoint_max_bytes: it was a file, its bytes unknown
            return cls("file")
        return cls(kind)  # absent, fifo

    @classmethod
    def from_workspace(cls, backing: Backing, path: str) -> _Side:
        try:
            st = backing.lstat(path)
        except OSError:  # gone, or a parent replaced by a symlink or a file: nothing stands there
            return cls("absent")
        if stat.S_ISDIR(st.st_mode):
            return cls("dir")
        if stat.S_ISLNK(st.st_mode):
            parent, name = backing.parent(path)
            with contextlib.suppress(OSError):
                return cls("symlink", os.fsencode(os.readlink(name, dir_fd=parent)))
            return cls("symlink")
        if not stat.S_ISREG(st.st_mode):
            return cls("fifo")  # a FIFO, socket or device: never opened
        if st.st_size > LINES_MAX_BYTES:
            return cls("file")
        try:
            fd = backing.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return cls("file")
        with open(fd, "rb") as f:
            return cls("file", f.read(LINES_MAX_BYTES + 1))


def _change(before: _Side, after: _Side) -> str | None:
    if before.kind == "absent":
        return None if after.kind == "absent" else "added"
    if after.kind == "absent":
        return "deleted"
    if before.kind != after.kind:
        return "type-changed"
    if before.data is not None and before.data == after.data:
        return None
    return "modified"


def _lines(before: _Side, after: _Side) -> tuple[int | None, int | None]:
    """Lines added and deleted, as multisets of lines: None for an unknown or binary side."""
    old: collections.Counter[bytes] = collections.Counter()
    new: collections.Counter[bytes] = collections.Counter()
    for side, counter in ((before, old), (after, new)):
        if side.kind in ("absent", "fifo"):
            continue
        if side.data is None or side.binary:
            return None, None
        counter.update(side.data.splitlines(keepends=True))
    return sum((new - old).values()), sum((old - new).values())
