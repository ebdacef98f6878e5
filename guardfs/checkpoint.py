"""Pre-images of a run's restore points, so that a workspace can be rolled back.

Before guardfs lets a path change for the first time after a restore point, it records how
the path was: absent, a directory (its mode), a symlink (its target), or a file (its mode
and a copy of its bytes), with its owner (and a file's inode). The index is a JSON-lines
file appended and flushed as it goes, so it survives the guard being killed; ``guard
rollback`` replays it in reverse.

A rollback trusts nothing it finds in the workspace: it works from the root's descriptor
only (openat2 one component at a time, never through a symlink or into another mount),
replaces whatever stands at or above a restored path where the record says something else
was, moves aside (into the run directory, by rename) what would lose bytes no record keeps,
and names each path it still cannot put back (:class:`_Restorer`); it never raises for
what the agent left.

Restore points are generations: ``0000`` holds the pre-images of the run's start, each
checkpoint (an operator's, or a passing test the agent reports) starts the next one, and
none is ever dropped while the run goes on: whatever the agent reports, ``guard rollback
--to start`` still reaches the start. A rollback to a point replays the generations from
the newest down to that one, then forgets the later ones.

The store is the guard's alone (directories 0700, files 0600, owned by the guard) and
is validated when read: a record whose path leaves the workspace, whose blob is not one
of the generation's own copies, or whose mode carries setuid, setgid or sticky bits is
refused, naming the line, before anything is restored.

A file's bytes are copied off the FUSE loop: a reflink (FICLONE) where the backing
filesystem shares extents, else a copy of its data extents only (holes stay holes) in a
worker thread. The request that changes the file waits for its copy; every other request
goes on meanwhile. The copies of all the run's restore points together may take at most
``[sandbox] checkpoint_max_bytes`` of file data; a file past that is recorded as not
restorable, and a rollback names it and leaves it as it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NotRequired, TextIO, TypedDict

import trio

from guardfs.backing import Backing, openat2
from guardfs.errors import Exit, GuardError
from guardfs.events import Emit
from guardfs.harvest import copy_extents

__all__ = [
    "CHECKPOINT_MAX_BYTES", "CheckpointError", "PreImages", "Rollback", "last_rollback", "restore_points",
    "rollback_offline", "start_images",
]

# Files up to this size are copied on the loop, not in a worker thread.
_INLINE_COPY_BYTES = 1 << 16
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# What a reflink or copy_file_range answers where it cannot work here: fall back to copying.
_NO_SHORTCUT = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}
#: The default of ``[sandbox] checkpoint_max_bytes``.
CHECKPOINT_MAX_BYTES = 1 << 30
_LAST_ROLLBACK = "last-rollback.json"
#: In the run directory: what a rollback took away that held bytes no restore point keeps.
_ASIDE = "rollback-aside"
_POINTS = "points.jsonl"  # {"generation": n, "label": text}: which restore point each generation starts
_CURRENT = "current"
_INDEX = "index.jsonl"
#: Labels kept per generation (an agent may report passing tests without changing anything).
_MAX_LABELS = 64
_MAX_LABEL_CHARS = 200
_BLOB_NAME = re.compile(r"[0-9]{8}")
_KINDS = frozenset({"absent", "dir", "symlink", "fifo", "file", "unrestorable", "generated"})
#: Whether a path (a directory when the flag says so) is generated output (paths.generated).
Generated = Callable[[str, bool], bool]
_FIELDS = frozenset({"path", "kind", "mode", "target", "size", "blob", "ino", "uid", "gid"})


class CheckpointError(GuardError):
    """A restore point that cannot be used: its record was tampered with, or it does not exist."""

    exit_code = Exit.DATAERR


def _private_file(path: Path) -> int:
    """Open *path* for appending, created 0600 (whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _write_private(path: Path, text: str) -> None:
    """Replace *path* with *text*, 0600 (a reader sees the old or the new file, whole)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("utf-8", "surrogateescape"))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    """Make directory *path*, 0700 (whatever the umask)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    os.chmod(path, 0o700, follow_symlinks=False)


class _Record(TypedDict):
    """One line of a generation's index.jsonl: how *path* was before its first change."""

    path: str
    kind: str  # absent, dir, symlink, fifo, file, unrestorable
    mode: NotRequired[int]
    target: NotRequired[str]  # symlink
    size: NotRequired[int]  # unrestorable
    blob: NotRequired[str]  # file: its copy's name in the generation directory
    ino: NotRequired[int]  # its inode then: a rollback knows the file wherever the agent moved it
    uid: NotRequired[int]  # its owner then: a guard running as root gives it back
    gid: NotRequired[int]


@dataclass
class Rollback:
    """What a rollback did: the paths restored, and the files it could not restore (their
    pre-image would have passed ``checkpoint_max_bytes``), left as they were."""

    restored: list[str] = field(default_factory=list)
    not_restorable: list[str] = field(default_factory=list)
    #: Generated output written since the restore point (its top-most generated directory,
    #: or the file): never kept, so left as it is (``[paths] generated``).
    generated: list[str] = field(default_factory=list)
    #: Paths that could not be put back (something in the way the rollback could not take
    #: away), each with the reason. A rollback with any keeps its restore points, so that it
    #: can be run again once the obstacle is gone.
    failed: dict[str, str] = field(default_factory=dict)
    #: What stood at a restored path and held bytes no restore point keeps (made where the
    #: guard did not see it, or a file too large to keep, moved there): moved whole, by
    #: rename, from the path (key) to the run directory's ``rollback-aside/`` (value).
    moved_aside: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class _Copy:
    """A file's bytes on their way into its blob."""

    path: str
    mode: int
    blob: Path
    generation: int
    cost: int  # bytes of data counted against the cap
    ino: int  # the file's inode, recorded with it
    owner: tuple[int, int]  # and its owner
    done: trio.Event | None = None  # None until a request starts the copy; set when it ended
    error: OSError | None = None


class PreImages:
    """The pre-images of one run, stored in *store* (a directory of the run dir).

    *max_bytes* bounds the file data kept per generation; *emit* (an event log's emit)
    hears of each file recorded as not restorable. Paths *generated* says are generated
    output are not kept: their top-most generated directory is recorded once, as left as
    it is by a rollback.
    """

    def __init__(
        self, backing: Backing, store: Path, max_bytes: int = CHECKPOINT_MAX_BYTES,
        emit: Emit | None = None, generated: Generated | None = None,
    ) -> None:
        self.backing = backing
        self.store = store
        self.max_bytes = max_bytes
        self.used = 0  # bytes of file data kept (or being copied) for all the restore points
        self.generation = 0
        self.recorded: set[str] = set()  # recorded, or with a copy still pending
        self.last_rollback: Rollback | None = None
        self._emit = emit
        self._generated = generated
        self._generated_roots: set[str] = set()  # recorded as generated since the checkpoint
        self._pending: dict[str, _Copy] = {}
        self._blobs = 0
        self._used_by: dict[int, int] = {0: 0}  # bytes kept per generation
        self._labels: dict[int, int] = {}  # labels written per generation
        self._index: TextIO | None = None
        self.store.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(self.store)
        self._open_generation()
        self._label("start")

    def _dir(self) -> Path:
        return self.store / f"{self.generation:04d}"

    def _open_generation(self) -> None:
        if self._index is not None:
            self._index.close()
        _private_dir(self._dir())
        self._index = open(_private_file(self._dir() / _INDEX), "a", encoding="utf-8")  # noqa: SIM115
        _write_private(self.store / _CURRENT, str(self.generation))

    def _label(self, label: str) -> None:
        """Name the current generation's restore point *label* too (at most _MAX_LABELS each)."""
        written = self._labels.get(self.generation, 0)
        if written >= _MAX_LABELS:
            return
        self._labels[self.generation] = written + 1
        fd = _private_file(self.store / _POINTS)
        try:
            line = json.dumps({"generation": self.generation, "label": label[:_MAX_LABEL_CHARS]}) + "\n"
            os.write(fd, line.encode("utf-8", "surrogateescape"))
        finally:
            os.close(fd)

    async def keep(self, *paths: str) -> None:
        """Record each of *paths* as it is now, unless recorded since the checkpoint, and
        return once their pre-images are complete: only then may the caller change them."""
        while True:
            generation = self.generation
            for path in paths:
                self.before(path)
            await self._settle(lambda p: p in paths)
            if self.generation == generation:
                return
            # A checkpoint came while we waited: the paths are recorded again, afresh.

    async def keep_tree(self, path: str) -> None:
        """:meth:`keep` for *path* and everything beneath it (a directory about to move)."""
        prefix = f"{path}/"
        while True:
            generation = self.generation
            self.before_tree(path)
            await self._settle(lambda p: p == path or p.startswith(prefix))
            if self.generation == generation:
                return

    def before(self, path: str) -> None:
        """Record *path* as it is now, unless already recorded since the checkpoint. A file's
        bytes are only planned here; :meth:`keep` copies them (callers other than the walk
        of :meth:`before_tree` use :meth:`keep`)."""
        if path in self.recorded or path == "":
            return
        if self._generated is not None and (root := self._generated_root(path)) is not None:
            if root not in self._generated_roots:
                self._generated_roots.add(root)
                self.recorded.add(root)
                self._write({"path": root, "kind": "generated"})
            return
        self.recorded.add(path)
        try:
            self._record(path)
        except BaseException:
            self.recorded.discard(path)  # not recorded: the next change tries again
            raise

    def _generated_root(self, path: str) -> str | None:
        """The top-most generated directory holding *path* (or *path* itself), or None when
        *path* is no generated output."""
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for prefix in prefixes:
            if prefix in self._generated_roots:
                return prefix  # the common case in a tree being installed: one set lookup per level
        assert self._generated is not None
        if not (self._generated(path, False) or self._generated(path, True)):
            return None
        return next((p for p in prefixes[:-1] if self._generated(p, True)), path)

    def _record(self, path: str) -> None:
        try:
            st = self.backing.lstat(path)
        except FileNotFoundError:
            self._write({"path": path, "kind": "absent"})
            return
        # Never setuid, setgid or sticky: a rollback (maybe as root) must not make such a file.
        mode = stat.S_IMODE(st.st_mode) & 0o777
        uid, gid = st.st_uid, st.st_gid
        if stat.S_ISDIR(st.st_mode):
            self._write({"path": path, "kind": "dir", "mode": mode, "uid": uid, "gid": gid})
        elif stat.S_ISLNK(st.st_mode):
            dir_fd, name = self.backing.parent(path)
            self._write({"path": path, "kind": "symlink", "target": os.readlink(name, dir_fd=dir_fd),
                         "uid": uid, "gid": gid})
        elif stat.S_ISREG(st.st_mode):
            cost = min(st.st_size, st.st_blocks * 512)  # the data; a sparse file's holes are free
            if self.used + cost > self.max_bytes:
                self._write({"path": path, "kind": "unrestorable", "mode": mode, "size": st.st_size,
                             "ino": st.st_ino})
                if self._emit is not None:
                    self._emit("preimage", path, "allow", rule="sandbox.checkpoint_max_bytes", restorable=False,
                               reason=f"keeping {cost} bytes of {path} would pass checkpoint_max_bytes="
                                      f"{self.max_bytes} ({self.used} kept for this run's restore points): "
                                      f"guard rollback will leave it as it is")
                return
            # Opened when the copy starts, not here: a tree that moves may hold many files.
            # Until the copy ends, every change of the path waits for it (keep), so the path
            # still names the same file then.
            self._blobs += 1
            self.used += cost
            self._used_by[self.generation] = self._used_by.get(self.generation, 0) + cost
            blob = self._dir() / f"{self._blobs:08d}"
            self._pending[path] = _Copy(path, mode, blob, self.generation, cost, st.st_ino, (st.st_uid, st.st_gid))
        elif stat.S_ISFIFO(st.st_mode):
            self._write({"path": path, "kind": "fifo", "mode": mode, "uid": uid, "gid": gid})

    async def _settle(self, wanted: Callable[[str], bool]) -> None:
        """Complete the pending copies of the paths *wanted* picks: run each that no request
        has started, wait for the others."""
        for copy in [c for p, c in self._pending.items() if wanted(p)]:
            if copy.done is None:
                if copy.generation != self.generation:
                    continue  # dropped by a checkpoint; keep() records the path again
                await self._copy(copy)
            else:
                await copy.done.wait()
            if copy.error is not None:
                raise OSError(copy.error.errno, f"keeping the pre-image of {copy.path}: {copy.error.strerror}")

    async def _copy(self, copy: _Copy) -> None:
        copy.done = trio.Event()
        src = -1
        try:
            src = self.backing.open(copy.path, os.O_RDONLY)
            if os.fstat(src).st_size <= _INLINE_COPY_BYTES:
                # A source file an agent edits: copied in microseconds, cheaper than the hop
                # to a worker thread and back (and a second FUSE worker task meanwhile).
                _copy_file(src, copy.blob)
            else:
                # Not cancellable: the thread runs to its end, and so does the request's wait.
                await trio.to_thread.run_sync(_copy_file, src, copy.blob)
        except OSError as err:
            copy.error = err
            if copy.generation == self.generation:
                self.recorded.discard(copy.path)  # the change is refused; the next one tries again
                self.used -= copy.cost
                self._used_by[copy.generation] -= copy.cost
            with contextlib.suppress(OSError):
                copy.blob.unlink()
        else:
            if copy.generation == self.generation:
                self._write({"path": copy.path, "kind": "file", "mode": copy.mode, "blob": copy.blob.name,
                             "ino": copy.ino, "uid": copy.owner[0], "gid": copy.owner[1]})
        finally:
            if src >= 0:
                os.close(src)
            if self._pending.get(copy.path) is copy:
                del self._pending[copy.path]
            copy.done.set()

    def before_tree(self, path: str) -> None:
        """Record *path* and everything beneath it (a directory about to move)."""
        self.before(path)
        for below, _is_dir in self.backing.walk(path):
            self.before(below)

    def _write(self, record: _Record) -> None:
        assert self._index is not None
        self._index.write(json.dumps(record) + "\n")
        self._index.flush()

    def statistics(self) -> dict[str, int]:
        """Copies in progress, requests waiting for one, and bytes of data kept (or being
        copied) since the checkpoint."""
        running = [c for c in self._pending.values() if c.done is not None and not c.done.is_set()]
        waiting = sum(c.done.statistics().tasks_waiting for c in running if c.done is not None)
        return {"copying": len(running), "waiting": waiting, "bytes": self.used}

    def checkpoint(self, label: str = "") -> None:
        """A new restore point named *label*: later changes are recorded afresh, and every
        earlier point is kept. With nothing changed since the last point, that point takes
        the label too (a flood of checkpoints costs no directories)."""
        if self.recorded or self._pending:
            # Copies not started are dropped: their requests record the paths again.
            self._pending = {}
            self.generation += 1
            self.recorded.clear()
            self._generated_roots.clear()
            self._used_by[self.generation] = 0
            self._open_generation()
        self._label(label)

    def points(self) -> list[tuple[int, str]]:
        """The restore points: (generation, label), oldest first."""
        return _points(self.store, self.generation)

    def rollback(self, on_changed: Callable[[str], None] | None = None, to: str = "last") -> list[str]:
        """Restore every recorded path back to the restore point *to* (``start``, ``last``
        or a label); returns the paths restored (the files that could not be are in
        :attr:`last_rollback`). The points after it are forgotten. Raises CheckpointError
        (and changes nothing) if *to* names no point or the store was tampered with."""
        assert self._index is not None
        self._index.flush()
        target = _generation_for(self.store, self.generation, to)
        result = _restore_to(self.backing, self.store, self.generation, target, on_changed)
        self.last_rollback = result
        if self._emit is not None:
            for path, why in result.failed.items():
                self._emit("rollback", path, "allow", restored=False, rule="rollback", reason=f"{path} was not "
                           f"restored: {why}")
            for path, where in result.moved_aside.items():
                self._emit("rollback", path, "allow", restored=True, rule="rollback", moved_to=where,
                           reason=f"what stood at {path} holds bytes no restore point keeps: moved to {where}")
            for path in result.not_restorable:
                self._emit("rollback", path, "allow", restored=False, rule="sandbox.checkpoint_max_bytes",
                           reason=f"{path} was not restored: its pre-image passed checkpoint_max_bytes")
            for path in result.generated:
                self._emit("rollback", path, "allow", restored=False, rule="paths.generated",
                           reason=f"{path} is generated output: never kept, so not restored")
        if result.failed:
            # Every restore point is kept as it was, so that the rollback can run again once
            # the way is clear; what this one put back stays recorded as it was then.
            return result.restored
        self._index.close()
        self._index = None
        self._pending = {}
        _forget_after(self.store, self.generation, target)
        self.generation = target
        self.recorded.clear()
        self._generated_roots.clear()
        self._used_by = {g: n for g, n in self._used_by.items() if g < target}
        self._used_by[target] = 0
        self._labels = {g: n for g, n in self._labels.items() if g <= target}
        self.used = sum(self._used_by.values())
        self._open_generation()
        return result.restored

    def close(self) -> None:
        """Close the index."""
        self._pending = {}
        if self._index is not None:
            self._index.close()
            self._index = None


def _copy_file(src: int, blob: Path) -> None:
    """Copy the file open at *src* into *blob*: a reflink if the filesystem can, else its
    data extents (holes stay holes). Runs in a worker thread."""
    out = os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _clone(src, out)
    finally:
        os.close(out)


def _clone(src: int, out: int) -> None:
    """Make the empty file *out* a copy of *src*: a reflink, or the data extents."""
    try:
        fcntl.ioctl(out, _FICLONE, src)
        return
    except OSError as err:
        if err.errno not in _NO_SHORTCUT:
            raise
    size = os.fstat(src).st_size
    copy_extents(src, out, size)
    os.ftruncate(out, size)


def _check_private(path: Path, what: str) -> os.stat_result:
    """lstat *path* and refuse it unless it is the guard's own: not a symlink, owned by
    this user, writable by no one else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing: the run's restore points cannot be read") from None
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise CheckpointError(
            f"{what} {path} is not the guard's own (a symlink, owned by uid {st.st_uid}, or writable by others: "
            f"mode {stat.S_IMODE(st.st_mode):04o}); refusing to restore from it. Inspect the run directory "
            "before trusting anything in it")
    return st


def _bad(index: Path, number: int, line: str, why: str) -> CheckpointError:
    shown = line if len(line) <= 200 else f"{line[:200]}..."
    return CheckpointError(
        f"{index}:{number}: refusing the checkpoint index: {why}: {shown!r}. The guard writes this file "
        "alone; someone else changed it. Nothing was restored")


def _confined(path: object) -> bool:
    """Whether *path* is a plain relative path beneath the workspace."""
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _check_record(rec: object) -> str | None:
    """What is wrong with one decoded index line, or None."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if extra := set(rec) - _FIELDS:
        return f"unknown field(s) {', '.join(sorted(extra))}"
    if rec.get("kind") not in _KINDS:
        return f"kind must be one of {', '.join(sorted(_KINDS))}"
    if not _confined(rec.get("path")):
        return "the path is not confined beneath the workspace"
    if "mode" in rec:
        mode = rec["mode"]
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
            return "the mode must be permission bits only (never setuid, setgid or sticky)"
    kind = rec["kind"]
    if kind in ("dir", "fifo", "file", "unrestorable") and "mode" not in rec:
        return f"a {kind} record needs a mode"
    if kind == "file" and not (isinstance(rec.get("blob"), str) and _BLOB_NAME.fullmatch(rec["blob"])):
        return "the blob must name one of the generation's own copies (8 digits)"
    if kind != "file" and "blob" in rec:
        return "only a file record has a blob"
    if kind == "symlink" and not (isinstance(rec.get("target"), str) and "\0" not in rec["target"]):
        return "a symlink record needs a target"
    if "size" in rec and (not isinstance(rec["size"], int) or rec["size"] < 0):
        return "the size must be a count of bytes"
    for key in ("uid", "gid"):
        if key in rec and (not isinstance(rec[key], int) or isinstance(rec[key], bool) or rec[key] < 0
                           or kind in ("absent", "generated")):
            return f"the {key} must be a number, on a record of something that was there"
    if "ino" in rec and (not isinstance(rec["ino"], int) or isinstance(rec["ino"], bool) or rec["ino"] < 0
                         or kind not in ("file", "unrestorable")):
        return "only a file record has an inode, a number"
    return None


def _records(generation_dir: Path) -> list[_Record]:
    """The validated records of one generation; raises CheckpointError naming a bad line."""
    index = generation_dir / _INDEX
    _check_private(generation_dir, "restore point")
    try:
        _check_private(index, "checkpoint index")
    except CheckpointError:
        if not os.path.lexists(index):
            return []  # nothing was recorded in it yet
        raise
    text = index.read_text(encoding="utf-8", errors="surrogateescape")
    lines = text.split("\n")
    out: list[_Record] = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the last line, cut short by a kill: everything before it is whole
            raise _bad(index, number, line, "not JSON") from None
        if (why := _check_record(rec)) is not None:
            raise _bad(index, number, line, why)
        out.append(rec)
    return out


def _points(store: Path, current: int) -> list[tuple[int, str]]:
    """The restore points of *store*: (generation, label), oldest first; 0 is the start."""
    points: list[tuple[int, str]] = [(0, "start")]
    path = store / _POINTS
    if not os.path.lexists(path):
        return points
    _check_private(path, "restore point list")
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="surrogateescape").split("\n"), 1):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # cut short by a kill
        if (not isinstance(rec, dict) or not isinstance(rec.get("label"), str)
                or not isinstance(rec.get("generation"), int) or not 0 <= rec["generation"] <= current):
            raise _bad(path, number, line, f"a restore point is a generation 0..{current} and a label")
        if (rec["generation"], rec["label"]) != (0, "start"):
            points.append((rec["generation"], rec["label"]))
    return points


def _generation_for(store: Path, current: int, to: str) -> int:
    """The generation of restore point *to*: ``start``, ``last``, or a label (its latest)."""
    if to == "start":
        return 0
    if to == "last":
        return current
    named = [g for g, label in _points(store, current) if label == to]
    if not named:
        labels = sorted({label for _, label in _points(store, current) if label})
        shown = ", ".join(repr(label) for label in labels[:20]) + (" ..." if len(labels) > 20 else "")
        raise CheckpointError(f"no restore point is labelled {to!r}; give start, last or one of: {shown}")
    return max(named)


def _restore_to(
    backing: Backing, store: Path, current: int, target: int, on_changed: Callable[[str], None] | None,
) -> Rollback:
    """Replay the generations from *current* down to *target*: the workspace as it was at
    restore point *target*. Every index is validated before anything changes; a path that
    cannot be put back is named in the result (:attr:`Rollback.failed`), never raised."""
    _check_private(store, "checkpoint store")
    records = {g: _records(store / f"{g:04d}") for g in range(current, target - 1, -1)}
    known = _Known.of([rec for recs in records.values() for rec in recs])
    restored: list[str] = []
    not_restorable: set[str] = set()
    generated: set[str] = set()
    failed: dict[str, str] = {}
    moved: dict[str, str] = {}
    aside = Path(os.path.abspath(store.parent / _ASIDE))  # named in the output: absolute
    backing.forget_dirs()  # whatever it cached may name what the rollback replaces
    try:
        for g, recs in records.items():  # newest first
            done = _Restorer(backing.root_fd, store / f"{g:04d}", aside, known).restore(recs)
            generated |= set(done.generated)
            not_restorable -= set(done.restored)  # an older point had its bytes
            not_restorable |= set(done.not_restorable)
            failed = {p: why for p, why in failed.items() if p not in done.restored}  # an older point's fixed it
            failed.update(done.failed)
            moved.update(done.moved_aside)
            restored += [p for p in done.restored if p not in restored]
            if on_changed is not None:
                for path in [*done.restored, *done.failed]:
                    on_changed(path)
    finally:
        backing.forget_dirs()
    result = Rollback([p for p in restored if p not in not_restorable and p not in failed], sorted(not_restorable),
                      sorted(generated), dict(sorted(failed.items())), moved)
    _write_private(store / _LAST_ROLLBACK, json.dumps(
        {"restored": result.restored, "not_restorable": result.not_restorable, "generated": result.generated,
         "failed": result.failed, "moved_aside": result.moved_aside}) + "\n")
    return result


def _forget_after(store: Path, current: int, target: int) -> None:
    """After a rollback to *target*: forget the later points, and empty *target*'s own
    records (the workspace is as it was then)."""
    for g in range(current, target - 1, -1):
        shutil.rmtree(store / f"{g:04d}", ignore_errors=True)
    _private_dir(store / f"{target:04d}")
    kept = [json.dumps({"generation": g, "label": label}) for g, label in _points(store, current)
            if g <= target and (g, label) != (0, "start")]
    _write_private(store / _POINTS, "".join(f"{line}\n" for line in [json.dumps(
        {"generation": 0, "label": "start"}), *kept]))
    _write_private(store / _CURRENT, str(target))


def _at_checkpoint(records: list[_Record]) -> list[_Record]:
    """The records that say how things were at the checkpoint.

    A path recorded after one of its ancestors was recorded absent (or as a non-directory)
    did not exist then: it was created, or moved in, since.
    """
    kinds = {r["path"]: r["kind"] for r in records}
    out = []
    for rec in records:
        parts = rec["path"].split("/")
        ancestors = ("/".join(parts[:i]) for i in range(1, len(parts)))
        if all(kinds.get(a, "dir") == "dir" for a in ancestors):
            out.append(rec)
    return out


class _Blocked(Exception):
    """*path* (a directory on the way to a restored path) is *what* now, not a directory."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(path, what)
        self.path = path
        self.what = what


_KIND_WORDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISLNK, "a symlink"),
               (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"))


def _kind_of(st: os.stat_result) -> str:
    """What *st* is, in words."""
    return next((word for test, word in _KIND_WORDS if test(st.st_mode)), "something else")


def _open_dir(root_fd: int, path: str) -> int:
    """An O_PATH fd of directory *path* beneath *root_fd* (the caller closes it), reached one
    component at a time with openat2: never through a symlink, never into another mount.
    Raises _Blocked naming the first component that is not a directory (or is missing)."""
    fd = os.dup(root_fd)
    walked: list[str] = []
    try:
        for name in path.split("/") if path else ():
            walked.append(name)
            try:
                below = openat2(fd, name, os.O_PATH | os.O_DIRECTORY)
            except OSError as err:
                where = "/".join(walked)
                if err.errno == errno.ENOENT:
                    raise _Blocked(where, "missing") from None
                if err.errno == errno.EXDEV:
                    raise _Blocked(where, "a mount point") from None
                if err.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                try:
                    what = _kind_of(os.stat(name, dir_fd=fd, follow_symlinks=False))
                except OSError:
                    what = "not a directory"
                raise _Blocked(where, what) from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _set_mode_at(dir_fd: int, name: str, rec: _Record, is_kind: Callable[[int], bool]) -> None:
    """Give *name* in *dir_fd* the owner (as root) and mode *rec* records, through an O_PATH
    fd of the entry itself (openat2: never a symlink, never another mount's root), once it
    proved to be of the kind *is_kind* tests."""
    try:
        fd = openat2(dir_fd, name, os.O_PATH)
    except OSError as err:
        if err.errno == errno.EXDEV:
            raise OSError(err.errno, f"{rec['path']} is a mount point: unmount it") from None
        raise
    try:
        st = os.fstat(fd)
        if not is_kind(st.st_mode):
            raise OSError(errno.EEXIST, f"{_kind_of(st)} is in the way")
        if "uid" in rec and os.geteuid() == 0:
            os.chown(f"/proc/self/fd/{fd}", rec["uid"], rec.get("gid", -1))
        os.chmod(f"/proc/self/fd/{fd}", rec["mode"])
    finally:
        os.close(fd)


def _scan(root_fd: int, path: str) -> list[tuple[str, os.stat_result]]:
    """Everything beneath directory *path*, parents before children, each lstat'ed; symlinks
    are not followed, and one directory is open at a time (the agent decides the depth)."""
    out: list[tuple[str, os.stat_result]] = []
    stack = [path]
    while stack:
        top = stack.pop()
        fd = openat2(root_fd, top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                listing = [(f"{top}/{de.name}", de.stat(follow_symlinks=False)) for de in it]
        finally:
            os.close(fd)
        out += listing
        stack += [sub for sub, st in listing if stat.S_ISDIR(st.st_mode)]
    return out


@dataclass(frozen=True)
class _Known:
    """What the restore points being replayed account for, to tell what a rollback may
    delete (the agent made it, or its pre-image goes back elsewhere) from what it must move
    aside (nothing else keeps its bytes)."""

    paths: frozenset[str]  # named by a record: made or changed under the guard's eye
    generated: frozenset[str]  # roots of generated output (regenerable, never kept)
    kept: frozenset[int]  # inodes of files whose bytes a record keeps (moved since, maybe)
    lost: frozenset[int]  # inodes of files recorded as not restorable (their bytes are nowhere else)

    @classmethod
    def of(cls, records: list[_Record]) -> _Known:
        """What *records* (of every generation replayed) account for."""
        def inodes(kind: str) -> frozenset[int]:
            return frozenset(r["ino"] for r in records if r["kind"] == kind and "ino" in r)
        return cls(frozenset(r["path"] for r in records if r["kind"] not in ("unrestorable", "generated")),
                   frozenset(r["path"] for r in records if r["kind"] == "generated"), inodes("file"),
                   inodes("unrestorable"))

    def deletable(self, path: str, st: os.stat_result) -> bool:
        """Whether a rollback may delete what is at *path* (*st*) without losing bytes."""
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return True  # a directory, a symlink, a FIFO, a socket, a device node, an empty file: no data
        if st.st_ino in self.lost:
            return False
        parts = path.split("/")
        if any("/".join(parts[:i]) in self.generated for i in range(1, len(parts) + 1)):
            return True
        return path in self.paths or st.st_ino in self.kept


class _Restorer:
    """Puts one generation's records back (read from *generation_dir*), working only from
    the workspace's root fd: every directory is opened with openat2 one component at a time
    and every entry is touched through its parent's fd, never by a path string the kernel
    resolves again. Whatever stands where a record says something else was (a symlink, a
    FIFO, a socket, a device node, a directory where a file was or a file where a directory
    was) is taken away first: deleted when the agent made it or its bytes go back elsewhere,
    else moved whole into *aside* (the run directory's) and named. What still cannot be done
    is named in :attr:`Rollback.failed` with the reason; the rest goes on."""

    def __init__(self, root_fd: int, generation_dir: Path, aside: Path, known: _Known) -> None:
        self.root_fd = root_fd
        self.generation_dir = generation_dir
        self.aside = aside
        self.known = known
        self.failed: dict[str, str] = {}
        self.moved_aside: dict[str, str] = {}

    def restore(self, validated: list[_Record]) -> Rollback:
        """Restore *validated* (this generation's records)."""
        everything = _at_checkpoint(validated)
        # A file whose pre-image passed the cap stays as it is, in both passes; so does
        # generated output, of which nothing was kept.
        records = [r for r in everything if r["kind"] not in ("unrestorable", "generated")]
        not_restorable = sorted({r["path"] for r in everything if r["kind"] == "unrestorable"})
        generated = sorted({r["path"] for r in everything if r["kind"] == "generated"})
        # Deepest first: take away what was not there; then shallowest first: put back the rest.
        for rec in sorted(records, key=lambda r: -r["path"].count("/")):
            self._guarded(rec["path"], self._take_away_if_changed, rec)
        for rec in sorted(records, key=lambda r: r["path"].count("/")):
            if rec["kind"] != "absent":
                self._guarded(rec["path"], self._put_back, rec)
        done = [r["path"] for r in records if r["path"] not in self.failed]
        return Rollback(done, not_restorable, generated, self.failed, self.moved_aside)

    def _guarded(self, path: str, step: Callable[[_Record], None], rec: _Record) -> None:
        """Run one *step* for *rec*; what the filesystem refuses is a failure of *path*."""
        if path in self.failed:
            return
        try:
            step(rec)
        except _Blocked as err:
            self.failed[path] = (f"its directory {err.path} is {err.what} now, where the restore point has a "
                                 "directory: it was changed where the guard did not see it, or could not be "
                                 "restored itself; move it out of the way")
        except OSError as err:
            self.failed[path] = f"{err.strerror or err}"

    def _take_away_if_changed(self, rec: _Record) -> None:
        head, _, name = rec["path"].rpartition("/")
        try:
            parent = _open_dir(self.root_fd, head)
        except _Blocked:
            return  # not there as such: its directory is replaced by its own record, or named then
        try:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return
            if rec["kind"] == "dir" and stat.S_ISDIR(st.st_mode):
                return  # kept; what changed inside it has records of its own
            self._take_away(parent, rec["path"], name, st)
        finally:
            os.close(parent)

    def _take_away(self, parent: int, path: str, name: str, st: os.stat_result) -> None:
        """Delete what is at *path* (*name* in *parent*, *st*), or move it aside whole when
        that would lose bytes that nothing else keeps."""
        where = f"{_kind_of(st)} is at {path} where the restore point has something else"
        if not stat.S_ISDIR(st.st_mode):
            if self.known.deletable(path, st):
                _unlink(parent, name, where)
            else:
                self._move_aside(parent, path, name, where)
            return
        try:
            tree = _scan(self.root_fd, path)
        except OSError as err:
            raise OSError(err.errno, f"{where}, and it cannot be listed: {err.strerror}") from None
        if not all(self.known.deletable(sub, sub_st) for sub, sub_st in tree):
            self._move_aside(parent, path, name, where)
            return
        for sub, sub_st in reversed(tree):  # children before parents
            head, _, below = sub.rpartition("/")
            below_fd = _open_dir(self.root_fd, head)
            try:
                if stat.S_ISDIR(sub_st.st_mode):
                    _rmdir(below_fd, below, f"{where}, and {sub} in it")
                else:
                    _unlink(below_fd, below, f"{where}, and {sub} in it")
            finally:
                os.close(below_fd)
        _rmdir(parent, name, where)

    def _move_aside(self, parent: int, path: str, name: str, where: str) -> None:
        """Move *name* (in *parent*, at *path*) into the run directory, whole, by rename."""
        _private_dir(self.aside)
        number = 1 + max((int(n) for n in os.listdir(self.aside) if n.isdigit()), default=0)
        dest = self.aside / f"{number:04d}" / path
        for level in reversed(dest.parents[:len(Path(path).parts)]):  # aside/NNNN and the path's directories
            _private_dir(level)
        dest_fd = os.open(dest.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.rename(name, dest.name, src_dir_fd=parent, dst_dir_fd=dest_fd)
        except OSError as err:
            hint = " (the run directory is on another filesystem)" if err.errno == errno.EXDEV else ""
            raise OSError(err.errno, f"{where}, and holds bytes no restore point keeps; moving it aside to "
                          f"{dest} failed{hint}: {err.strerror}. Move it away yourself") from None
        finally:
            os.close(dest_fd)
        self.moved_aside[path] = str(dest)

    def _put_back(self, rec: _Record) -> None:
        kind, path = rec["kind"], rec["path"]
        head, _, name = path.rpartition("/")
        parent = _open_dir(self.root_fd, head)
        try:
            if kind == "dir":
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=parent)
                _set_mode_at(parent, name, rec, stat.S_ISDIR)
            elif kind == "symlink":
                os.symlink(rec["target"], name, dir_fd=parent)
                _chown_at(parent, name, rec)
            elif kind == "fifo":
                os.mkfifo(name, 0o600, dir_fd=parent)
                _set_mode_at(parent, name, rec, stat.S_ISFIFO)
            elif kind == "file":
                self._put_back_file(parent, name, rec)
        except FileExistsError:
            raise OSError(errno.EEXIST, f"something is still at {path}, where the restore point has "
                          f"{'a directory' if kind == 'dir' else 'a ' + kind}: move it away") from None
        finally:
            os.close(parent)

    def _put_back_file(self, parent: int, name: str, rec: _Record) -> None:
        blob = self.generation_dir / rec["blob"]
        src = os.open(blob, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(src).st_mode):
                raise CheckpointError(f"{blob} is not a copy the guard made")
            # The recorded permission bits only: never setuid, setgid or sticky (validated).
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=parent)
            try:
                _clone(src, fd)
                if "uid" in rec and os.geteuid() == 0:
                    os.fchown(fd, rec["uid"], rec.get("gid", -1))
                os.fchmod(fd, rec["mode"])  # after the owner: set-ID bits are never restored anyway
            finally:
                os.close(fd)
        finally:
            os.close(src)


def _chown_at(parent: int, name: str, rec: _Record) -> None:
    """Give symlink *name* (in *parent*, just made) its recorded owner, when the guard may (as
    root); a guard running as a user restores only what that user owns anyway."""
    if "uid" in rec and os.geteuid() == 0:
        os.chown(name, rec["uid"], rec.get("gid", -1), dir_fd=parent, follow_symlinks=False)


def _unlink(parent: int, name: str, where: str) -> None:
    try:
        os.unlink(name, dir_fd=parent)
    except OSError as err:
        raise OSError(err.errno, f"{where}, and it cannot be removed: {err.strerror}") from None


def _rmdir(parent: int, name: str, where: str) -> None:
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError as err:
        raise OSError(err.errno, f"{where}, and it cannot be removed: {err.strerror}") from None


def last_rollback(store: Path) -> Rollback | None:
    """What the last rollback from *store* did (live or offline), if there was one."""
    try:
        data = json.loads((store / _LAST_ROLLBACK).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return Rollback(list(data["restored"]), list(data["not_restorable"]), list(data.get("generated", [])),
                    dict(data.get("failed", {})), dict(data.get("moved_aside", {})))


def _current(store: Path) -> int:
    path = store / _CURRENT
    if not os.path.lexists(path):
        return 0
    _check_private(path, "restore point marker")
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit() or not text.isascii():
        raise CheckpointError(f"{path} should hold a generation number, not {text[:40]!r}")
    return int(text)


def restore_points(store: Path) -> list[tuple[int, str]]:
    """The restore points kept in *store* (live or offline): (generation, label), oldest first."""
    return _points(store, _current(store))


def start_images(store: Path) -> dict[str, tuple[dict[str, object], Path | None]]:
    """How each path the run changed was at the start: ``{path: (record, blob)}``, the record
    as in index.jsonl (``kind``: absent, dir, symlink, fifo, file, unrestorable, generated) and
    *blob* the copy of a file's bytes (None for any other kind). A path first changed after a
    checkpoint was unchanged before it, so the oldest record of each path is its start.
    Raises CheckpointError for a store that was tampered with."""
    found: dict[str, tuple[dict[str, object], Path | None]] = {}
    for generation in range(_current(store) + 1):
        directory = store / f"{generation:04d}"
        if not os.path.lexists(directory):
            continue
        for rec in _records(directory):
            if rec["path"] not in found:
                blob = directory / rec["blob"] if rec["kind"] == "file" and "blob" in rec else None
                found[rec["path"]] = (dict(rec), blob)
    return found


def rollback_offline(workspace: str, store: Path, to: str = "last") -> Rollback:
    """Roll *workspace* back to restore point *to* (``start``, ``last`` or a label), with
    no guard running. Raises CheckpointError, changing nothing, if the store was tampered with."""
    current = _current(store)
    target = _generation_for(store, current, to)
    backing = Backing(workspace)
    try:
        result = _restore_to(backing, store, current, target, None)
    finally:
        backing.close()
    if not result.failed:  # else kept, so that the rollback can run again once the way is clear
        _forget_after(store, current, target)
    return result
