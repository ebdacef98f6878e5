"""Pre-images since the last checkpoint, so that a workspace can be rolled back.

Before guardfs lets a path change for the first time after a checkpoint, it records how
the path was: absent, a directory (its mode), a symlink (its target), or a file (its mode
and a copy of its bytes). The index is a JSON-lines file appended and flushed as it goes,
so it survives the guard being killed; ``guard rollback`` replays it in reverse.

A file's bytes are copied off the FUSE loop: a reflink (FICLONE) where the backing
filesystem shares extents, else a copy of its data extents only (holes stay holes) in a
worker thread. The request that changes the file waits for its copy; every other request
goes on meanwhile. The copies of one generation may take at most ``[sandbox]
checkpoint_max_bytes`` of file data; a file past that is recorded as not restorable, and
a rollback names it and leaves it as it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NotRequired, TextIO, TypedDict

import trio

from guardfs.backing import Backing
from guardfs.events import Emit

__all__ = ["CHECKPOINT_MAX_BYTES", "PreImages", "Rollback", "last_rollback", "rollback_offline"]

_COPY_CHUNK = 1 << 20
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# What a reflink or copy_file_range answers where it cannot work here: fall back to copying.
_NO_SHORTCUT = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}
#: The default of ``[sandbox] checkpoint_max_bytes``.
CHECKPOINT_MAX_BYTES = 1 << 30
_LAST_ROLLBACK = "last-rollback.json"


class _Record(TypedDict):
    """One line of a generation's index.jsonl: how *path* was before its first change."""

    path: str
    kind: str  # absent, dir, symlink, fifo, file, unrestorable
    mode: NotRequired[int]
    target: NotRequired[str]  # symlink
    size: NotRequired[int]  # unrestorable
    blob: NotRequired[str]  # file: its copy's name in the generation directory


@dataclass
class Rollback:
    """What a rollback did: the paths restored, and the files it could not restore (their
    pre-image would have passed ``checkpoint_max_bytes``), left as they were."""

    restored: list[str] = field(default_factory=list)
    not_restorable: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Copy:
    """A file's bytes on their way into its blob."""

    path: str
    mode: int
    blob: Path
    generation: int
    cost: int  # bytes of data counted against the cap
    done: trio.Event | None = None  # None until a request starts the copy; set when it ended
    error: OSError | None = None


class PreImages:
    """The pre-images of one run, stored in *store* (a directory of the run dir).

    *max_bytes* bounds the file data kept per generation; *emit* (an event log's emit)
    hears of each file recorded as not restorable.
    """

    def __init__(
        self, backing: Backing, store: Path, max_bytes: int = CHECKPOINT_MAX_BYTES,
        emit: Emit | None = None,
    ) -> None:
        self.backing = backing
        self.store = store
        self.max_bytes = max_bytes
        self.used = 0  # bytes of file data kept (or being copied) in this generation
        self.generation = 0
        self.recorded: set[str] = set()  # recorded, or with a copy still pending
        self.last_rollback: Rollback | None = None
        self._emit = emit
        self._pending: dict[str, _Copy] = {}
        self._blobs = 0
        self._index: TextIO | None = None
        self._open_generation()

    def _dir(self) -> Path:
        return self.store / f"{self.generation:04d}"

    def _open_generation(self) -> None:
        if self._index is not None:
            self._index.close()
        self._dir().mkdir(parents=True, exist_ok=True)
        self._index = open(self._dir() / "index.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        (self.store / "current").write_text(str(self.generation))

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
        self.recorded.add(path)
        try:
            self._record(path)
        except BaseException:
            self.recorded.discard(path)  # not recorded: the next change tries again
            raise

    def _record(self, path: str) -> None:
        try:
            st = self.backing.lstat(path)
        except FileNotFoundError:
            self._write({"path": path, "kind": "absent"})
            return
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            self._write({"path": path, "kind": "dir", "mode": mode})
        elif stat.S_ISLNK(st.st_mode):
            dir_fd, name = self.backing.parent(path)
            self._write({"path": path, "kind": "symlink", "target": os.readlink(name, dir_fd=dir_fd)})
        elif stat.S_ISREG(st.st_mode):
            cost = min(st.st_size, st.st_blocks * 512)  # the data; a sparse file's holes are free
            if self.used + cost > self.max_bytes:
                self._write({"path": path, "kind": "unrestorable", "mode": mode, "size": st.st_size})
                if self._emit is not None:
                    self._emit("preimage", path, "allow", rule="sandbox.checkpoint_max_bytes", restorable=False,
                               reason=f"keeping {cost} bytes of {path} would pass checkpoint_max_bytes="
                                      f"{self.max_bytes} ({self.used} kept since the checkpoint): "
                                      f"guard rollback will leave it as it is")
                return
            # Opened when the copy starts, not here: a tree that moves may hold many files.
            # Until the copy ends, every change of the path waits for it (keep), so the path
            # still names the same file then.
            self._blobs += 1
            self.used += cost
            blob = self._dir() / f"{self._blobs:08d}"
            self._pending[path] = _Copy(path, mode, blob, self.generation, cost)
        elif stat.S_ISFIFO(st.st_mode):
            self._write({"path": path, "kind": "fifo", "mode": mode})

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
            # Not cancellable: the thread runs to its end, and so does the request's wait.
            await trio.to_thread.run_sync(_copy_file, src, copy.blob)
        except OSError as err:
            copy.error = err
            if copy.generation == self.generation:
                self.recorded.discard(copy.path)  # the change is refused; the next one tries again
                self.used -= copy.cost
            with contextlib.suppress(OSError):
                copy.blob.unlink()
        else:
            if copy.generation == self.generation:
                self._write({"path": copy.path, "kind": "file", "mode": copy.mode, "blob": copy.blob.name})
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

    def checkpoint(self) -> None:
        """The workspace is known-good: forget older pre-images and start afresh."""
        self._pending = {}  # copies not started are dropped: their requests record the paths again
        old = self._dir()
        self.generation += 1
        self.recorded.clear()
        self.used = 0
        self._open_generation()
        shutil.rmtree(old, ignore_errors=True)

    def rollback(self, on_changed: Callable[[str], None] | None = None) -> list[str]:
        """Restore every recorded path; returns the paths restored (the files that could not
        be are in :attr:`last_rollback`). Starts a new generation."""
        assert self._index is not None
        self._index.flush()
        result = _restore(self.backing, self._dir(), on_changed)
        self.last_rollback = result
        if self._emit is not None:
            for path in result.not_restorable:
                self._emit("rollback", path, "allow", restored=False, rule="sandbox.checkpoint_max_bytes",
                           reason=f"{path} was not restored: its pre-image passed checkpoint_max_bytes")
        self.checkpoint()
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
    pos = 0
    while pos < size:
        try:
            data = os.lseek(src, pos, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:
                break  # nothing but a hole up to the end
            if err.errno != errno.EINVAL:
                raise
            data, end = pos, size  # no SEEK_DATA here: all of it is data
        else:
            end = min(os.lseek(src, data, os.SEEK_HOLE), size)
        _copy_range(src, out, data, end - data)
        pos = end
    os.ftruncate(out, size)


def _copy_range(src: int, out: int, offset: int, count: int) -> None:
    """Copy *count* bytes at *offset* from *src* to the same offset of *out*."""
    end = offset + count
    try:
        while offset < end:
            done = os.copy_file_range(src, out, min(end - offset, 1 << 30), offset, offset)
            if done == 0:
                return  # the file ended sooner
            offset += done
        return
    except OSError as err:
        if err.errno not in _NO_SHORTCUT:
            raise
    while offset < end:
        chunk = os.pread(src, min(end - offset, _COPY_CHUNK), offset)
        if not chunk:
            return
        view = memoryview(chunk)
        while view:
            written = os.pwrite(out, view, offset)
            view = view[written:]
            offset += written


def _records(generation_dir: Path) -> list[_Record]:
    index = generation_dir / "index.jsonl"
    if not index.exists():
        return []
    out: list[_Record] = []
    for line in index.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: everything before it is whole
    return out


def _remove(backing: Backing, path: str) -> None:
    try:
        st = backing.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        dir_fd, name = backing.parent(path)
        os.unlink(name, dir_fd=dir_fd)
        return
    # Children before parents: the walk's order reversed (no recursion on the tree's depth).
    for below, is_dir in [*reversed(list(backing.walk(path))), (path, True)]:
        dir_fd, name = backing.parent(below)
        if is_dir:
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    backing.forget_dirs()


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


def _restore(backing: Backing, generation_dir: Path, on_changed: Callable[[str], None] | None) -> Rollback:
    """Restore from *generation_dir*; the outcome is also kept in the store's last-rollback.json."""
    everything = _at_checkpoint(_records(generation_dir))
    # A file whose pre-image passed the cap stays as it is, in both passes.
    records = [r for r in everything if r["kind"] != "unrestorable"]
    not_restorable = sorted({r["path"] for r in everything if r["kind"] == "unrestorable"})
    # Deepest first: take away what did not exist; then shallowest first: put back the rest.
    for rec in sorted(records, key=lambda r: -r["path"].count("/")):
        try:
            current = backing.lstat(rec["path"])
        except FileNotFoundError:
            continue
        if rec["kind"] == "dir" and stat.S_ISDIR(current.st_mode):
            continue  # kept; what changed inside it has records of its own
        _remove(backing, rec["path"])
    for rec in sorted(records, key=lambda r: r["path"].count("/")):
        kind, path = rec["kind"], rec["path"]
        if kind == "absent":
            continue
        dir_fd, name = backing.parent(path)
        if kind == "dir":
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, rec["mode"], dir_fd=dir_fd)
            os.chmod(name, rec["mode"], dir_fd=dir_fd)
        elif kind == "symlink":
            os.symlink(rec["target"], name, dir_fd=dir_fd)
        elif kind == "fifo":
            os.mkfifo(name, rec["mode"], dir_fd=dir_fd)
        elif kind == "file":
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, rec["mode"], dir_fd=dir_fd)
            try:
                src = os.open(generation_dir / rec["blob"], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    _clone(src, fd)
                finally:
                    os.close(src)
                os.fchmod(fd, rec["mode"])
            finally:
                os.close(fd)
    changed = [r["path"] for r in records]
    if on_changed is not None:
        for path in changed:
            on_changed(path)
    result = Rollback(changed, not_restorable)
    (generation_dir.parent / _LAST_ROLLBACK).write_text(
        json.dumps({"restored": changed, "not_restorable": not_restorable}) + "\n", encoding="utf-8")
    return result


def last_rollback(store: Path) -> Rollback | None:
    """What the last rollback from *store* did (live or offline), if there was one."""
    try:
        data = json.loads((store / _LAST_ROLLBACK).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return Rollback(list(data["restored"]), list(data["not_restorable"]))


def rollback_offline(workspace: str, store: Path) -> Rollback:
    """Roll *workspace* back to its last checkpoint, with no guard running."""
    current = (store / "current").read_text().strip() if (store / "current").exists() else "0000"
    backing = Backing(workspace)
    try:
        return _restore(backing, store / f"{int(current):04d}", None)
    finally:
        backing.close()
