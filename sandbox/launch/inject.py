"""Generated trees made during the run, bound natively into the running sandbox.

:mod:`sandbox.launch.native` binds the literal generated directories that exist when the
run starts. The usual case is the other one: ``python -m venv .venv``, ``npm install`` make
their tree during the run, and the whole install then crosses FUSE file by file. So when the
mount creates (``mkdir``) a directory that :func:`~sandbox.launch.native.plan_native` would
have bound had it existed at the start (the same judgement: :class:`MidRunRules`), the guard
binds it, writable, over its place in the sandbox's own mount namespace:

1. in the guard's (private) namespace, ``open_tree(OPEN_TREE_CLONE)`` of the real directory,
   opened beneath the workspace without following a symlink, and the very inode the mount
   just made; for a new root of the run's scratch layer (generated output out of scope,
   :mod:`guardfs.scratch`), the scratch directory itself, opened beneath RUN_DIR/scratch the
   same way (the mount shows it with its inode number offset by ``SCRATCH_INO``), never the
   workspace's path: the host still never sees what the agent writes there;
2. ``setns`` into the mount namespace of a process of the sandbox;
3. ``move_mount`` of that detached copy onto the directory as the sandbox sees it, opened
   beneath the workspace the same way and checked to be the same inode (a name renamed or
   replaced in between is left alone).

Steps 2 and 3 need a single-threaded process (``setns`` refuses a process that shares its
filesystem context with threads, as the guard does) and step 3's lookup goes through our own
FUSE mount: a short-lived helper process does the three steps while the guard's trio loop
goes on serving, never waiting on it inside a FUSE request.

Nothing written before the bind lands is lost or doubled: the mount wrote it into the same
real directory that is then bound, so it is there, once, on both sides of the bind; a file
opened through the mount before the bind keeps writing into that same file.

A bound tree the agent empties and removes (``rm -rf .venv``) would fail on the directory
itself: the kernel never removes a mount point (EBUSY). :meth:`MidRunBinder.serve_removals`
gives such a tree back to the mount just before its removal goes on (see
:mod:`sandbox.launch.seccomp`): a helper enters the sandbox's namespace the same way and
detaches the bind, from inside it (``umount2(".", MNT_DETACH)``), once it has checked the
directory there is the tree's, by device and inode. Trees bound at the start are given back
the same way.

This needs a root guard (its private mount namespace, and the right to enter the sandbox's);
an unprivileged guard leaves such trees to the mount, and says so once. A failed bind is
said (``guard: ...``) and the tree stays behind the mount: it is a speed-up, never a reason
to fail the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import trio

from guardfs.backing import openat2
from guardfs.events import EventLog
from guardfs.fs import GuardFS
from guardfs.scratch import SCRATCH_INO
from sandbox.launch.native import MAX_TREES, MidRunRules
from sandbox.launch.seccomp import Listener, Notification, Removal
from sandbox.launch.supervisor import ProcessTree

__all__ = ["MidRunBinder", "may_name"]

#: How long a bind may take (its lookups go through the mount, which may be busy).
BIND_TIMEOUT = 30.0
#: How long reading the path of a directory removal from the agent's memory may take.
READ_TIMEOUT = 2.0

# The helpers' common start. System call numbers (Python 3.11 has no wrappers), the same on
# every architecture since the tables were unified (alpha aside): open_tree 428, move_mount
# 429, openat2 437. RESOLVE_NO_MAGICLINKS | NO_SYMLINKS | BENEATH: beneath the workspace,
# never through a symlink.
_PRELUDE = r"""
import ctypes, errno, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def check(ret, what):
    if ret < 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret

class OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))

def enter(namespace, workspace):
    check(libc.setns(namespace, 0x20000), "setns into the sandbox's mount namespace")  # CLONE_NEWNS
    return os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

def beneath(root, path, resolve):
    how = OpenHow(os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, resolve)
    return libc.syscall(437, root, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
"""

# Binds: `python -I -S -c _BIND <source fd> <namespace fd> <workspace> <path> <inode>`.
_BIND = _PRELUDE + r"""
source, namespace, workspace, path, ino = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5], int(sys.argv[5])
# OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH: a detached copy of the directory's mount.
tree = check(libc.syscall(428, source, b"", 0x1 | os.O_CLOEXEC | 0x1000), "open_tree")
root = enter(namespace, workspace)
# The agent's mkdir looked the name up first, and the mount answers an absent name with a
# cached negative entry; until the mkdir's caller runs again and turns that entry into the new
# directory (on a busy machine, well after our reply), a lookup here finds it still absent.
# The mkdir has been answered: wait for it, a bounded while. RESOLVE_NO_XDEV too: the
# directory in the mount, nowhere else.
for _ in range(100):
    target = beneath(root, path, 0x0F)
    if target >= 0 or ctypes.get_errno() != errno.ENOENT:
        break
    time.sleep(0.02)
target = check(target, f"opening {path}")
if os.fstat(target).st_ino != ino:
    sys.exit(f"{path} was replaced before the bind")
# MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH: both ends are the fds.
check(libc.syscall(429, tree, b"", target, b"", 0x04 | 0x40), "move_mount")
"""

# Unbinds: `python -I -S -c _UNBIND <namespace fd> <workspace> <path> <device> <inode> <as owner: 0|1>`.
_UNBIND = _PRELUDE + r"""
import fcntl
namespace, workspace, path, dev, ino, owner = int(sys.argv[1]), *sys.argv[2:4], *map(int, sys.argv[4:7])
if owner:  # first into the user namespace that owns the mount namespace (NS_GET_USERNS)
    check(libc.setns(fcntl.ioctl(namespace, 0xB701), 0x10000000), "setns into the sandbox's user namespace")
root = enter(namespace, workspace)
# Into the bind (no RESOLVE_NO_XDEV): its root is the real directory, device and inode.
target = check(beneath(root, path, 0x0E), f"opening {path}")
st = os.fstat(target)
if (st.st_dev, st.st_ino) != (dev, ino):
    sys.exit(f"{path} is no longer the bound tree")
# The mount whose root the fd is, and no other (the sandbox's /proc is not this pid's: no
# /proc/self/fd path): from inside it, lazily (MNT_DETACH), as a process may stand in it.
os.fchdir(target)
check(libc.umount2(b".", 2), "umount")
"""


class MidRunBinder:
    """Binds each generated directory the mount creates, that :class:`MidRunRules` admits,
    into the running sandbox (see the module's docstring).

    :meth:`created` is the mount's hook (``GuardFS.on_generated_dir``), called inside the
    ``mkdir`` request: it only queues. :meth:`serve` binds, one tree after another, once the
    agent's process tree exists. Without *enabled* (an unprivileged guard) nothing is bound
    and the first candidate is said once."""

    def __init__(self, rules: MidRunRules, seen_as: str, events: EventLog, say: Callable[[str], None],
                 enabled: bool = True) -> None:
        self.rules = rules
        self.seen_as = seen_as  # the workspace's path inside the sandbox
        self.events = events
        self.say = say
        self.enabled = enabled
        self._send, self._queue = trio.open_memory_channel[tuple[str, int]](math.inf)  # at most one per candidate
        self._namespace: int | None = None  # the sandbox's mount namespace
        self._said = False
        self._said_full = False
        self._reader = trio.CapacityLimiter(1)  # reads of removals' paths (see _path)
        self._trees = trio.Lock()  # held by a bind, or an unbind, from start to its note in rules.trees
        self._pending: dict[str, trio.Event] = {}  # candidates queued, set once judged (bound or not)

    def attach(self, fs: GuardFS) -> None:
        """Take the mount's hooks: directories it makes and removes, renames and links it judges."""
        fs.on_generated_dir = self.created
        fs.native_crossing = self.rules.crossing
        fs.on_removed_dir = self.rules.removed

    def created(self, path: str, ino: int) -> None:
        """The mount made directory *path* (inode *ino*), in scope and generated, or a new root
        of the scratch layer (*ino* at or past SCRATCH_INO): queue it if it names a native tree.
        Runs inside the FUSE request: cheap, never waits."""
        if not self.rules.candidate(path, scratch=ino >= SCRATCH_INO):
            if self.enabled and self.rules.full and not self._said_full:
                self._said_full = True
                self.say(f"generated tree {path} made during the run goes through the mount: {MAX_TREES} were "
                         "judged for a native bind in this run, the rest stay behind the mount")
            return
        if self.enabled:
            self.rules.pin(path)  # before the reply: nothing crosses its edge from now on
            self._pending.setdefault(path, trio.Event())
            self._send.send_nowait((path, ino))
        elif not self._said:
            self._said = True
            self.say(f"generated tree {path} made during the run goes through the mount: binding it into the "
                     "running sandbox needs a root guard"
                     + ("" if ino >= SCRATCH_INO else " (bound natively from the next run on)"))

    async def serve(self, tree: ProcessTree) -> None:
        """Bind what is queued, for as long as the agent runs (cancelled when it ends)."""
        try:
            async for path, ino in self._queue:
                # A bind under way when the agent ends is finished and said (bounded by
                # BIND_TIMEOUT): cancelled, its line and event would be lost with the bind done.
                with trio.CancelScope(shield=True):
                    try:
                        async with self._trees:
                            await self._bind(tree, path, ino)
                    finally:
                        if (judged := self._pending.pop(path, None)) is not None:
                            judged.set()
        finally:
            if self._namespace is not None:
                # Held, it would keep the sandbox's namespace alive, with the mount's bind in it.
                os.close(self._namespace)
                self._namespace = None

    async def _bind(self, tree: ProcessTree, path: str, ino: int, tries: int = 3) -> None:
        # The mount's inode *ino* is what the sandbox sees (the helper checks it there); the
        # source must be the directory the mount made, in its layer, under its real number.
        scratch = self.rules.scratch if ino >= SCRATCH_INO else None
        base = self.rules.root if scratch is None else scratch
        judge = self.rules.refusal if scratch is None else self.rules.scratch_refusal
        reason = await trio.to_thread.run_sync(judge, path)
        if reason is not None and self._current(base, path, scratch) == ino:
            self.rules.unpin(path)  # never bound: moves across it are the mount's to judge again
            if reason:
                self.say(f"generated tree left to the mount: {reason}")
            return
        source: int | None = None
        if reason is None:
            try:
                source = _open_beneath(base, path)  # a directory (O_DIRECTORY)
            except FileNotFoundError:
                pass
            except OSError as err:
                self.rules.unpin(path)
                self.say(f"generated tree {path} made during the run stays behind the mount: {err}")
                return
        if source is not None and os.fstat(source).st_ino != (ino if scratch is None else ino - SCRATCH_INO):
            os.close(source)
            source = None
        if source is None:
            # Removed since, perhaps made again (whose mkdir found the name taken): that
            # directory is the candidate now. Its removal waits for the lock we hold, so this
            # settles at once; *tries* bounds it all the same.
            now = self._current(base, path, scratch)
            if now is None or tries == 0:
                self.rules.forget(path)  # a directory made there from now on is a new candidate
                return
            await self._bind(tree, path, now, tries - 1)
            return
        try:
            namespace = self._sandbox(tree)
            await _helper(_BIND, [source, namespace, self.seen_as, path, ino], (source, namespace))
        except OSError as err:
            self.say(f"generated tree {path} made during the run stays behind the mount: {err}")
            return
        finally:
            os.close(source)
        self.rules.trees.append(path)
        if scratch is not None:
            self.rules.scratch_trees.append(path)
        where = "" if scratch is None else " from the run's scratch layer, never the workspace"
        self.say(f"generated tree made during the run (written natively{where} from now on, not seen by the "
                 f"breaker): {path}")
        self.events.emit("native", path, "allow", trees=[path], masked=0, during_run=True,
                         scratch=None if scratch is None else True)


    async def serve_removals(self, tree: ProcessTree, listener: Listener,
                             removals: trio.MemoryReceiveChannel[Notification]) -> None:
        """Give a bound tree the agent empties and removes back to the mount, so that the
        removal works as it would natively (:mod:`sandbox.launch.seccomp`): *removals* are the
        directory removals the sandbox's filter stopped (:func:`sandbox.launch.sockets.serve_filter`
        hands them over, in order), each let go here once judged. For as long as the agent runs."""
        async for call in removals:
            removal = Removal.of(call)
            try:
                # Most removals meet no empty tree and no candidate waiting for its bind:
                # let go at once, without reading their path (a thread's round trip).
                if self._pending or self._emptied(None):
                    await self._settle(listener, removal, tree)
            finally:
                listener.resume(removal)

    async def _settle(self, listener: Listener, removal: Removal, tree: ProcessTree) -> None:
        """Give the trees *removal* may name back to the mount, if emptied."""
        path = await self._path(listener, removal)
        if not path:
            return
        # A directory it may name that waits for its bind is bound first: let go before, the
        # removal could meet the bind landing. And after any bind under way: the agent may see
        # a tree bound (and remove it) before the binder has taken note of it. As a bind,
        # finished and said even when the agent ends meanwhile.
        for waiting in [done for name, done in self._pending.items() if may_name(path, name)]:
            await waiting.wait()
        with trio.CancelScope(shield=True):
            async with self._trees:
                for emptied in self._emptied(path):
                    await self._unbind(tree, emptied)

    async def _path(self, listener: Listener, removal: Removal) -> bytes | None:
        """The path a removal names, read off the loop: the caller's memory may be a file of
        our own mount, whose read this loop serves. One read at a time, for at most
        READ_TIMEOUT (a page the agent never lets be read is its own removal's loss)."""
        with trio.move_on_after(READ_TIMEOUT):
            return await trio.to_thread.run_sync(listener.path, removal, limiter=self._reader,
                                                 abandon_on_cancel=True)
        return None

    def _emptied(self, path: bytes | None) -> list[tuple[str, os.stat_result]]:
        """The bound trees *path* may name (:func:`may_name`; None: any) that are empty now,
        each with its real directory's status. Cheap: a few system calls a tree."""
        found = []
        for tree in self.rules.trees:
            if path is not None and not may_name(path, tree):
                continue
            base = self.rules.scratch if tree in self.rules.scratch_trees else self.rules.root
            try:
                fd = _open_beneath(base or self.rules.root, tree, os.O_RDONLY)
            except OSError:
                continue  # gone from the host's side: the kernel answers the agent as it will
            try:
                with os.scandir(fd) as entries:
                    if next(entries, None) is None:
                        found.append((tree, os.fstat(fd)))
            finally:
                os.close(fd)
        return found

    async def _unbind(self, tree: ProcessTree, emptied: tuple[str, os.stat_result]) -> None:
        path, st = emptied
        try:
            namespace = self._sandbox(tree)
            # An unprivileged guard enters the user namespace its bubblewrap made first (it has
            # every capability there); root has them already.
            owner = int(os.geteuid() != 0)
            await _helper(_UNBIND, [namespace, self.seen_as, path, st.st_dev, st.st_ino, owner], (namespace,))
        except OSError as err:
            self.say(f"generated tree {path} was emptied but stays bound, so removing it fails with EBUSY ({err}); "
                     "an empty tree serves as well as none, or set [sandbox] native_generated = false")
            return
        self.rules.release(path)
        self.say(f"generated tree {path} emptied and removed by the agent: behind the mount again "
                 "(bound again if made again)")
        self.events.emit("native", path, "allow", trees=[path], unbound=True)

    @staticmethod
    def _current(base: Path, path: str, scratch: Path | None) -> int | None:
        """The mount's inode of the directory at *path* now (in the scratch layer with
        *scratch*), or None when there is none."""
        try:
            st = (base / path).lstat()
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        return st.st_ino if scratch is None else st.st_ino + SCRATCH_INO

    def _sandbox(self, tree: ProcessTree) -> int:
        """The sandbox's mount namespace, found once (an fd, held until the agent ends)."""
        if self._namespace is None:
            self._namespace = _sandbox_namespace(tree)
        return self._namespace


def may_name(path: bytes, tree: str) -> bool:
    """Whether *path*, as the agent wrote it (relative to a directory we do not know), may
    name the workspace's *tree*: their last components agree as far as both go, after the
    path's last '.' or '..'."""
    tail = [part for part in os.fsdecode(path).split("/") if part]
    dots = [i for i, part in enumerate(tail) if part in (".", "..")]
    tail = tail[dots[-1] + 1:] if dots else tail
    parts = tree.split("/")
    depth = min(len(parts), len(tail))
    return depth > 0 and parts[-depth:] == tail[-depth:]


async def _helper(code: str, args: list[str | int], fds: tuple[int, ...]) -> None:
    """Run a helper (a single-threaded process: see the module's docstring) with *args*,
    passing it *fds*; OSError with its last words when it fails, or past BIND_TIMEOUT."""
    argv = [sys.executable, "-I", "-S", "-c", code, *map(str, args)]
    with trio.move_on_after(BIND_TIMEOUT) as waited:
        done = await trio.run_process(argv, pass_fds=fds, capture_stderr=True, check=False)
    if waited.cancelled_caught:
        raise OSError(f"no answer within {BIND_TIMEOUT:.0f} s")
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        raise OSError(said[-1] if said else f"the helper exited with {done.returncode}")


def _open_beneath(root: Path, path: str, flags: int = os.O_PATH) -> int:
    """An fd (*flags*: O_PATH) of directory *path* beneath *root*, no symlink followed on the way."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return openat2(root_fd, path, flags | os.O_DIRECTORY)
    finally:
        os.close(root_fd)


def _sandbox_namespace(tree: ProcessTree) -> int:
    """An fd of the mount namespace of the sandbox: the first of the agent's processes,
    breadth-first, whose namespace is not the guard's (bubblewrap's own pid, the tree's root,
    stays outside the namespaces it makes)."""
    ours = os.stat("/proc/self/ns/mnt").st_ino
    level = [tree.root]
    while level:
        below: list[psutil.Process] = []
        for proc in level:
            try:
                fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # gone
            # Still the process we meant (pid reuse), checked after the open that pins the namespace.
            if os.fstat(fd).st_ino != ours and proc.is_running():
                return fd
            os.close(fd)
            with contextlib.suppress(psutil.Error):
                below += proc.children()
        level = below
    raise OSError("no process of the sandbox found to enter its mount namespace")
