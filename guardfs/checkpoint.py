"""Pre-images since the last checkpoint, so that a workspace can be rolled back.

Before guardfs lets a path change for the first time after a checkpoint, it records how
the path was: absent, a directory (its mode), a symlink (its target), or a file (its mode
and a copy of its bytes). The index is a JSON-lines file appended and flushed as it goes,
so it survives the guard being killed; ``guard rollback`` replays it in reverse.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guardfs.backing import Backing

__all__ = ["PreImages", "rollback_offline"]

_COPY_CHUNK = 1 << 20


class PreImages:
    """The pre-images of one run, stored in *store* (a directory of the run dir)."""

    def __init__(self, backing: Backing, store: Path) -> None:
        self.backing = backing
        self.store = store
        self.generation = 0
        self.recorded: set[str] = set()
        self._index: Any = None
        self._open_generation()

    def _dir(self) -> Path:
        return self.store / f"{self.generation:04d}"

    def _open_generation(self) -> None:
        if self._index is not None:
            self._index.close()
        self._dir().mkdir(parents=True, exist_ok=True)
        self._index = open(self._dir() / "index.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        (self.store / "current").write_text(str(self.generation))

    def before(self, path: str) -> None:
        """Record *path* as it is now, unless already recorded since the checkpoint."""
        if path in self.recorded or path == "":
            return
        self.recorded.add(path)
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
            blob = f"{len(self.recorded):08d}"
            src = self.backing.open(path, os.O_RDONLY)
            try:
                with open(self._dir() / blob, "wb") as out:
                    while chunk := os.read(src, _COPY_CHUNK):
                        out.write(chunk)
            finally:
                os.close(src)
            self._write({"path": path, "kind": "file", "mode": mode, "blob": blob})
        elif stat.S_ISFIFO(st.st_mode):
            self._write({"path": path, "kind": "fifo", "mode": mode})

    def before_tree(self, path: str) -> None:
        """Record *path* and everything beneath it (a directory about to move)."""
        self.before(path)
        for below, _is_dir in self.backing.walk(path):
            self.before(below)

    def _write(self, record: dict[str, Any]) -> None:
        self._index.write(json.dumps(record) + "\n")
        self._index.flush()

    def checkpoint(self) -> None:
        """The workspace is known-good: forget older pre-images and start afresh."""
        old = self._dir()
        self.generation += 1
        self.recorded.clear()
        self._open_generation()
        shutil.rmtree(old, ignore_errors=True)

    def rollback(self, on_changed: Callable[[str], None] | None = None) -> list[str]:
        """Restore every recorded path; returns them. Starts a new generation."""
        self._index.flush()
        changed = _restore(self.backing, self._dir(), on_changed)
        self.checkpoint()
        return changed

    def close(self) -> None:
        """Close the index."""
        if self._index is not None:
            self._index.close()
            self._index = None


def _records(generation_dir: Path) -> list[dict[str, Any]]:
    index = generation_dir / "index.jsonl"
    if not index.exists():
        return []
    out = []
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


def _at_checkpoint(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def _restore(backing: Backing, generation_dir: Path, on_changed: Callable[[str], None] | None) -> list[str]:
    records = _at_checkpoint(_records(generation_dir))
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
                with open(generation_dir / rec["blob"], "rb") as src:
                    while chunk := src.read(_COPY_CHUNK):
                        os.write(fd, chunk)
                os.fchmod(fd, rec["mode"])
            finally:
                os.close(fd)
    changed = [r["path"] for r in records]
    if on_changed is not None:
        for path in changed:
            on_changed(path)
    return changed


def rollback_offline(workspace: str, store: Path) -> list[str]:
    """Roll *workspace* back to its last checkpoint, with no guard running."""
    current = (store / "current").read_text().strip() if (store / "current").exists() else "0000"
    backing = Backing(workspace)
    try:
        return _restore(backing, store / f"{int(current):04d}", None)
    finally:
        backing.close()
