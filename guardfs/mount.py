"""Serving a GuardFS: mount, run the FUSE loop on trio, unmount on the way out."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
from collections.abc import Awaitable, Callable, Iterator, Sequence

import pyfuse3
import trio

from guardfs.errors import MountError
from guardfs.fs import GuardFS

__all__ = ["check_fuse_available", "fusermount", "init_mount", "keepalive", "mount_options", "serve"]

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
    """Raise MountError saying what is missing when FUSE cannot work here."""
    if not os.path.exists("/dev/fuse"):
        raise MountError(
            "/dev/fuse does not exist: load the fuse module (modprobe fuse) or, in a container, "
            "pass --device /dev/fuse --cap-add SYS_ADMIN"
        )
    if os.access("/dev/fuse", os.R_OK | os.W_OK):
        return
    helper = shutil.which("fusermount3")
    if helper is None or not os.stat(helper).st_mode & stat.S_ISUID:
        raise MountError(
            "/dev/fuse is not readable and writable by this user, and there is no setuid fusermount3 "
            "to mount for it (apt-get install fuse3)"
        )


def mount_options(name: str = "guardfs") -> set[str]:
    """Mount options: kernel permission checks by mode bits, shared with the agent's user."""
    options = {f"fsname={name}", "subtype=guardfs", "default_permissions"}
    if os.geteuid() == 0:
        options.add("allow_other")  # the agent may run as another user
    return options


def fusermount(mountpoint: str, options: set[str]) -> tuple[int, subprocess.Popen[bytes]]:
    """Mount through the setuid ``fusermount3`` and receive the /dev/fuse fd from it.

    For a user who cannot open /dev/fuse (libfuse only falls back to fusermount3 when
    mount(2) fails, not when the device cannot be opened). With ``auto_unmount``,
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


async def _serve(
    fs: GuardFS,
    handle_signals: bool,
    on_ready: Callable[[], None] | None,
    companions: Sequence[Callable[..., Awaitable[None]]],
) -> None:
    async with trio.open_nursery() as nursery:
        if handle_signals:
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
        for companion in companions:
            await nursery.start(companion)  # e.g. the daemon: its sockets listen before we mount
        if on_ready is not None:
            on_ready()
        await pyfuse3.main()
        nursery.cancel_scope.cancel()  # unmounted from outside


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s: unmounting", signal.Signals(signum).name)
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

    The mount is always removed before this returns, also when the loop fails; *fs* is
    left open for its owner (a :class:`~sandbox.session.Session`) to close.
    *options* replaces :func:`mount_options` (tests use it to drop ``default_permissions``).
    *companions* run in the same trio loop (the breaker daemon) and are cancelled with it;
    each is started with ``nursery.start`` and must report ``task_status.started()``.
    """
    check_fuse_available()
    if not os.path.isdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is not a directory; create it (mkdir) or give an existing one")
    try:
        pyfuse3.init(fs, mountpoint, mount_options() if options is None else options)
    except RuntimeError as err:
        raise MountError(f"cannot mount at {mountpoint}: {err}{_MOUNT_HINT}") from err
    try:
        with keepalive(mountpoint):
            trio.run(_serve, fs, handle_signals, on_ready, companions)
    finally:
        pyfuse3.close(unmount=True)  # *fs* stays open: whoever built it closes it
