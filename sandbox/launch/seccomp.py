"""Directory removals handed to the guard before the kernel runs them (seccomp user notification).

A generated tree bound natively into the sandbox (:mod:`sandbox.launch.native`,
:mod:`sandbox.launch.inject`) is a mount point there, and the kernel refuses to remove a mount
point (``EBUSY``) before any filesystem is asked: ``rm -rf node_modules && npm install`` would
empty the tree, fail on the directory itself and stop the chain, where natively (and through
the mount) it works. The guard cannot see that refusal: it never reaches FUSE.

So the sandbox's last step (:mod:`sandbox.launch.enter`) installs this seccomp filter: every
directory removal (``rmdir``, ``unlinkat`` with ``AT_REMOVEDIR``) waits for the guard
(``SECCOMP_RET_USER_NOTIF``), which gives an emptied tree back to the mount
(:meth:`sandbox.launch.inject.MidRunBinder.watch_removals`) and then lets the call go on as
if never stopped (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``). Every other system call, and a
removal in another ABI (x32, a 32-bit call), passes the filter untouched.

No guarantee rests on this filter: a ``CONTINUE`` is no decision (another thread of the
caller may change the path after the guard read it), and all the guard ever does on a
notification is hand an *empty* tree back to the mount, which judges everything. At worst a
tree goes back to the mount early: slower, never looser.

This module is imported inside the sandbox by the system's Python for an agent of another
user: standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import select
import socket
import struct
from dataclasses import dataclass

__all__ = ["Listener", "Removal", "hand_over", "receive_listener"]


@dataclass(frozen=True)
class _Abi:
    arch: int  # AUDIT_ARCH_*
    seccomp: int  # the seccomp system call's number
    rmdir: int | None  # aarch64 has unlinkat only
    unlinkat: int


_ABIS = {
    "x86_64": _Abi(arch=0xC000003E, seccomp=317, rmdir=84, unlinkat=263),
    "aarch64": _Abi(arch=0xC00000B7, seccomp=277, rmdir=None, unlinkat=35),
}

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_RET_ALLOW = 0x7FFF0000
_RET_USER_NOTIF = 0x7FC00000
_AT_REMOVEDIR = 0x200
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR, _ARCH, _ARG0 = 0, 4, 16
# struct seccomp_notif {__u64 id; __u32 pid; __u32 flags; struct seccomp_data data;}: 80 bytes;
# struct seccomp_notif_resp {__u64 id; __s64 val; __s32 error; __u32 flags;}: 24 bytes.
_NOTIF = struct.Struct("=QIIiIQ6Q")
_RESP = struct.Struct("=QqiI")
_IOCTL_RECV = 0xC0000000 | _NOTIF.size << 16 | ord("!") << 8 | 0  # _IOWR('!', 0, struct seccomp_notif)
_IOCTL_SEND = 0xC0000000 | _RESP.size << 16 | ord("!") << 8 | 1  # _IOWR('!', 1, struct seccomp_notif_resp)
_IOCTL_ID_VALID = 0x40000000 | 8 << 16 | ord("!") << 8 | 2  # _IOW('!', 2, __u64)
_FLAG_CONTINUE = 1
_PATH_MAX = 4096


def _program(abi: _Abi) -> bytes:
    """The classic BPF program: removals notify, everything else is allowed."""
    ld, jeq, jset, ret = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
    # (code, k, true target, false target): targets are labels, resolved to relative jumps below.
    steps: list[tuple[int, int, str | None, str | None]] = [
        (ld, _ARCH, None, None),
        (jeq, abi.arch, None, "allow"),
        (ld, _NR, None, None),
        *([(jeq, abi.rmdir, "notify", None)] if abi.rmdir is not None else []),
        (jeq, abi.unlinkat, None, "allow"),
        (ld, _ARG0 + 2 * 8, None, None),  # the flags' low 32 bits (little-endian)
        (jset, _AT_REMOVEDIR, "notify", "allow"),
    ]
    labels = {"notify": len(steps), "allow": len(steps) + 1}
    code = b"".join(
        struct.pack("=HBBI", op, labels[t] - i - 1 if t else 0, labels[f] - i - 1 if f else 0, k)
        for i, (op, k, t, f) in enumerate(steps)
    )
    return code + struct.pack("=HBBI", ret, 0, 0, _RET_USER_NOTIF) + struct.pack("=HBBI", ret, 0, 0, _RET_ALLOW)


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _install() -> int:
    """Install the filter on this process (no_new_privs must be set) and return its listener."""
    machine = platform.machine()
    abi = _ABIS.get(machine)
    if abi is None:
        raise OSError(errno.ENOSYS, f"no removal filter for {machine}")
    code = _program(abi)
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _Fprog(len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(abi.seccomp, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_NEW_LISTENER, ctypes.byref(prog))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
    return int(fd)  # close-on-exec: the agent never holds it


def hand_over(sock_fd: int) -> None:
    """Inside the sandbox, after no_new_privs: install the filter and send its listener to the
    guard over the socket *sock_fd* (closed here), or, when it cannot be installed, why not."""
    with socket.socket(fileno=sock_fd) as sock:
        try:
            listener = _install()
        except OSError as err:
            with contextlib.suppress(OSError):  # the guard is gone
                sock.sendall(str(err.strerror).encode())
            return
        try:
            with contextlib.suppress(OSError):  # the guard is gone
                socket.send_fds(sock, [b"listener"], [listener])
        finally:
            os.close(listener)


def receive_listener(sock: socket.socket) -> int | str:
    """The guard's side of :func:`hand_over` (*sock* readable): the listener's fd, or why the
    sandbox sent none."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 512, 1, socket.MSG_CMSG_CLOEXEC)
    except OSError as err:
        return f"reading the sandbox's answer: {err.strerror}"
    if fds:
        return fds[0]
    return data.decode(errors="replace") or "the sandbox ended before it installed the filter"


@dataclass(frozen=True)
class Removal:
    """One directory removal waiting for the guard."""

    id: int
    pid: int  # in the guard's PID namespace
    path_at: int  # the address of the path in the caller's memory


class Listener:
    """The guard's end of the filter: removals as they come, each let go with :meth:`resume`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def ended(self) -> bool:
        """Whether no removal is waiting and none can come (every process of the sandbox is gone)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        events = dict(poller.poll(0)).get(self.fd, 0)
        return bool(events & select.POLLHUP) and not events & select.POLLIN

    def receive(self) -> Removal | None:
        """The next removal (call once the fd is readable); None if its caller is gone already."""
        buffer = bytearray(_NOTIF.size)
        try:
            fcntl.ioctl(self.fd, _IOCTL_RECV, buffer, True)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return None
            raise
        id_, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buffer)
        abi = _ABIS[platform.machine()]
        return Removal(id=id_, pid=pid, path_at=args[0] if nr == abi.rmdir else args[1])

    def path(self, removal: Removal) -> bytes | None:
        """The path *removal* names, read from its caller's memory (None when unreadable or the
        caller is gone). Only ever a hint: the caller's other threads may change it after."""
        try:
            mem = os.open(f"/proc/{removal.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            read, at = b"", removal.path_at
            while len(read) < _PATH_MAX and b"\0" not in read:
                chunk = os.pread(mem, _PATH_MAX - at % _PATH_MAX, at)  # never across a page it may lack
                if not chunk:
                    return None
                read, at = read + chunk, at + len(chunk)
        except OSError:
            return None
        finally:
            os.close(mem)
        # Still that call's: the pid was not reused while we read.
        try:
            fcntl.ioctl(self.fd, _IOCTL_ID_VALID, struct.pack("=Q", removal.id))
        except OSError:
            return None
        return read.partition(b"\0")[0]

    def resume(self, removal: Removal) -> None:
        """Let *removal* go on: the kernel runs it as if it was never stopped."""
        try:
            fcntl.ioctl(self.fd, _IOCTL_SEND, _RESP.pack(removal.id, 0, 0, _FLAG_CONTINUE))
        except OSError as err:
            if err.errno != errno.ENOENT:  # its caller is gone: nothing waits for the answer
                raise

    def close(self) -> None:
        """Stop listening: removals still to come fail (ENOSYS), as the sandbox is ending."""
        os.close(self.fd)

