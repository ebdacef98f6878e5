"""Serving a GuardFS: mount, run the FUSE loop on trio, unmount on the way out."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shlex
import signal
import socket
import stat
import struct
import subprocess
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import FrameType

import pyfuse3
import trio

from guardfs.device import fuse_device, mount_capability, mount_helper
from guardfs.errors import MountError, UsageError
from guardfs.fs import GuardFS

__all__ = ["check_directory", "check_fuse_available", "check_mountpoint", "fusermount", "init_mount", "keepalive",
           "mount_options", "serve"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def keepalive(mountpoint: str, interval: float = 0.5) -> Iterator[None]:
    """Send the mount a STATFS every *interval* seconds, from a small helper process.

    pyfuse3 waits for /dev/fuse to be readable, then reads it *blocking*, holding the GIL.
    When the kernel withdraws a request between the two (its caller was killed: the agent's
    tree being stopped, a `timeout` inside the agent), that read - and the whole trio loop,
    sockets and supervision included - waits for the next request. This is that request.
    It comes from another process, since no thread of ours can run while the read holds
    the GIL; the helper dies with us (PR_SET_PDEATHSIG).
    """
    script = f"while sleep {interval}; do stat -f -- {shlex.quote(mountpoint)} > /dev/null 2>&1; done"
    helper = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "sh", "-c", script],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        helper.kill()
        helper.wait()


# What to do when libfuse or fusermount3 refuses a mount (their own message says little more).
_MOUNT_HINT = ("; check that the mountpoint is a directory you may mount on and not already a mount "
               "(grep fuse /proc/mounts; fusermount3 -u MOUNTPOINT frees it)")


def check_fuse_available() -> None:
    """Raise MountError saying what is missing when FUSE cannot work here (:mod:`guardfs.device`:
    the findings ``guard doctor`` shows)."""
    for finding in (fuse_device(), mount_helper(), mount_capability()):
        if finding.status == "MISSING":
            raise MountError(finding.message)


def check_directory(what: str, path: str) -> None:
    """Raise UsageError unless *path* is a directory, naming a dead FUSE mount as such (*what*
    is how the user gave it: "BACKING", "mountpoint")."""
    try:
        st = os.stat(path)  # may come from the kernel's cache of a dead mount's attributes
        os.statvfs(path)  # never cached: a dead FUSE mount answers ENOTCONN
    except OSError as err:
        if err.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise UsageError(
                f"{what} {path} is a dead FUSE mount: the guard that served it is gone ({err.strerror}); "
                f"unmount it with fusermount3 -u {shlex.quote(path)} (as root: umount -l), then try again"
            ) from err
        if err.errno == errno.ENOENT:
            raise UsageError(f"{what} {path} does not exist; create it (mkdir) or give an existing directory") \
                from err
        raise UsageError(f"{what} {path} cannot be used: {err.strerror}; give a directory you may use") from err
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {path} is not a directory; give an existing directory")


def _mount_at(path: str) -> str | None:
    """What is mounted at *path* ("fuse.guardfs guardfs:task"), from /proc/self/mountinfo; None
    when nothing is."""
    target = os.path.realpath(path)
    found = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", encoding="utf-8",
                                            errors="surrogateescape") as table:
        for line in table:
            fields, _, tail = line.partition(" - ")
            # The kernel escapes space, tab, newline and backslash as \ooo (octal).
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields.split(" ")[4])
            if point == target:
                found = " ".join(tail.split(" ")[:2])  # type and source; the last listed is on top
    return found


def check_mountpoint(mountpoint: str) -> None:
    """Raise UsageError unless a new mount can go at *mountpoint*: an existing directory that is
    neither a dead FUSE mount nor a live one (a second guard mount would hide the first, silently).
    Another kind of mount may be covered on purpose: the devcontainer's entrypoint puts the guarded
    view over an empty read-only tmpfs, so that /workspace shows nothing if the guard ever stops."""
    check_directory("mountpoint", mountpoint)
    mounted = _mount_at(mountpoint)
    if mounted is not None and mounted.startswith("fuse"):
        what = f" ({mounted})"
        raise UsageError(
            f"mountpoint {mountpoint} is already a mount{what}; a second mount would hide it. Unmount it "
            f"first (fusermount3 -u {shlex.quote(mountpoint)}; for a guard mount: stop that guard), or "
            "give another, empty directory"
        )


def mount_options(name: str = "guardfs") -> set[str]:
    """Mount options: kernel permission checks by mode bits, shared with the agent's user."""
    options = {f"fsname={name}", "subtype=guardfs", "default_permissions"}
    if os.geteuid() == 0:
        options.add("allow_other")  # the agent may run as another user
    return options


def fusermount(mountpoint: str, options: set[str]) -> tuple[int, subprocess.Popen[bytes]]:
    """Mount through the setuid ``fusermount3`` and receive the /dev/fuse fd from it.

    For a user who may not mount(2). (It opens /dev/fuse as that user: it is no way
    around a device closed to them, see :func:`check_fuse_available`.) With ``auto_unmount``,
    fusermount3 stays behind and unmounts as soon as our end of the device closes: even a
    guard killed by SIGKILL leaves no mount.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            ["fusermount3", "-o", ",".join(sorted(options | {"auto_unmount"})), "--", mountpoint],
            env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())}, pass_fds=[theirs.fileno()],
        )
        theirs.close()
        _msg, ancdata, _flags, _addr = ours.recvmsg(1, socket.CMSG_SPACE(struct.calcsize("i")))
    finally:
        ours.close()
        theirs.close()
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            return struct.unpack("i", data[: struct.calcsize("i")])[0], proc
    proc.wait()
    raise MountError(f"fusermount3 could not mount {mountpoint} (exit status {proc.returncode}){_MOUNT_HINT}")


def init_mount(fs: GuardFS, mountpoint: str, options: set[str]) -> Callable[[], None]:
    """Mount *fs* and return the function that unmounts it.

    As root, libfuse mounts directly (``guard run`` does so in a private mount namespace).
    Anyone else mounts through fusermount3 with ``auto_unmount``, so that a guard killed by
    SIGKILL leaves no mount behind.
    """
    if os.geteuid() == 0:
        try:
            pyfuse3.init(fs, mountpoint, options)
        except RuntimeError as err:
            raise MountError(f"cannot mount at {mountpoint}: {err}{_MOUNT_HINT}") from err
        return lambda: pyfuse3.close(unmount=True)
    fd, helper = fusermount(mountpoint, options)
    try:
        # From here libfuse owns the fd: given as /dev/fd/N, it becomes the session's
        # device, which pyfuse3.close() closes. Closing it again ourselves would close
        # whatever was opened under that number meanwhile (or fail with EBADF).
        pyfuse3.init(fs, f"/dev/fd/{fd}", options)
    except RuntimeError as err:
        os.close(fd)  # not taken: the session was never set up
        helper.wait(timeout=10)  # auto_unmount: gone with the last descriptor of the device
        raise MountError(f"cannot serve the mount at {mountpoint}: {err}{_MOUNT_HINT}") from err

    def unmount() -> None:
        pyfuse3.close(unmount=False)  # closes the device, which also tells fusermount3 to unmount
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False, stderr=subprocess.DEVNULL)
        helper.wait(timeout=10)

    return unmount


# The signals that end a served mount.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Record the stop signals that arrive while the block runs, instead of dying of them.

    Their default action kills the process wherever it is: between the mount and the serve
    loop's own receiver, or after that receiver returned, a SIGTERM left a dead mount
    (ENOTCONN) behind. `timeout` sends its signal twice, to the process and to its group, so
    the second often came just as the first was being handled. The loop's receiver replaces
    these handlers while it listens, and puts them back after.
    """
    received: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in _STOP_SIGNALS}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            # Once a stop signal ended the serving, the process is on its way out: a later one
            # (the test of a loaded machine: `timeout`'s second, to the group, sent after the
            # unmount) must not kill its clean-up with the default action.
            signal.signal(signum, signal.SIG_IGN if received else handler)


async def _serve(
    fs: GuardFS,
    held: list[int] | None,
    on_ready: Callable[[], None] | None,
    companions: Sequence[Callable[..., Awaitable[None]]],
) -> None:
    async with trio.open_nursery() as nursery:
        if held is not None:
            await nursery.start(_stop_on_signal, nursery.cancel_scope, held)
        for companion in companions:
            await nursery.start(companion)  # e.g. the daemon: its sockets listen before we mount
        if on_ready is not None:
            on_ready()
        await pyfuse3.main()
        nursery.cancel_scope.cancel()  # unmounted from outside


async def _stop_on_signal(scope: trio.CancelScope, held: list[int],
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
        task_status.started()
        if held:  # it came before the loop listened
            log.info("received %s: unmounting", signal.Signals(held[0]).name)
            scope.cancel()
            return
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
            held.append(signum)  # said to _signals_held: the process is stopping
            scope.cancel()
            return


def serve(
    fs: GuardFS,
    mountpoint: str,
    *,
    handle_signals: bool = True,
    on_ready: Callable[[], None] | None = None,
    options: set[str] | None = None,
    companions: Sequence[Callable[..., Awaitable[None]]] = (),
) -> None:
    """Mount *fs* at *mountpoint* and serve until a signal or an external unmount.

    The mount is always removed before this returns, also when the loop fails or a signal
    comes at any moment (with *handle_signals*, from before the mount until after the
    unmount, SIGINT, SIGTERM and SIGHUP only end the loop, and once one did they stay ignored:
    the caller is stopping); *fs* is left open for its owner
    (a :class:`~sandbox.session.Session`) to close. As root libfuse mounts; anyone else
    mounts through fusermount3 (:func:`init_mount`), which needs no access to /dev/fuse.
    *options* replaces :func:`mount_options` (tests use it to drop ``default_permissions``).
    *companions* run in the same trio loop (the breaker daemon) and are cancelled with it;
    each is started with ``nursery.start`` and must report ``task_status.started()``.
    """
    check_fuse_available()
    check_mountpoint(mountpoint)
    with _signals_held() if handle_signals else contextlib.nullcontext(None) as held:
        unmount = init_mount(fs, mountpoint, mount_options() if options is None else options)
        try:
            with keepalive(mountpoint):
                trio.run(_serve, fs, held, on_ready, companions)
        finally:
            unmount()  # *fs* stays open: whoever built it closes it
