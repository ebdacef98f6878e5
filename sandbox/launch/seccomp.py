"""The guard's seccomp filter: the system calls the sandbox makes that the guard answers itself.

Installed by the sandbox's last step (:mod:`sandbox.launch.enter`, after Landlock and
no_new_privs) in every isolated run; its listener (``SECCOMP_FILTER_FLAG_NEW_LISTENER``) is
handed to the guard, which acknowledges it before the agent starts. A sandbox that cannot
install the filter, or whose guard does not take the listener, never starts the agent: the
filter is what keeps the host's unix sockets out of reach (:mod:`sandbox.launch.sockets`).

What the filter does, by system call:

- ``connect``: waits for the guard (``SECCOMP_RET_USER_NOTIF``), which performs the connect
  itself, on the caller's own socket, and answers with its result; the guard never lets a
  connect go on (``CONTINUE``), whose address and socket another thread of the caller could
  change after the guard looked.
- ``socket`` and ``socketpair`` of an ``AF_UNIX`` socket of any type but ``SOCK_STREAM`` and
  ``SOCK_SEQPACKET``: a datagram socket can ``sendto`` any path without a ``connect``, so
  the guard refuses them (``EACCES``) and records it. Every other socket is made as usual.
- ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``: ``ENOSYS`` (a ring could
  connect without a system call the filter sees); runtimes fall back to plain calls.
- a system call of another ABI (a 32-bit ``int 0x80``, x32's numbers): ``ENOSYS``.
- directory removals (``rmdir``, ``unlinkat`` with ``AT_REMOVEDIR``), only when generated
  trees are bound natively: wait for the guard, which gives an emptied tree back to the mount
  (:meth:`sandbox.launch.inject.MidRunBinder.serve_removals`) and lets the call go on as if
  never stopped (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``). No guarantee rests on that: all the
  guard ever does for a removal is hand an *empty* tree back to the mount, which judges
  everything; at worst a tree goes back early: slower, never looser.

Every other system call passes untouched.

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

__all__ = ["ACK", "Listener", "Notification", "Removal", "hand_over", "receive_listener", "try_listener"]


@dataclass(frozen=True)
class _Abi:
    arch: int  # AUDIT_ARCH_*
    seccomp: int  # the seccomp system call's number
    rmdir: int | None  # aarch64 has unlinkat only
    unlinkat: int
    connect: int
    socket: int
    socketpair: int
    x32: bool  # x86_64: numbers with __X32_SYSCALL_BIT are another ABI under the same arch


_ABIS = {
    "x86_64": _Abi(arch=0xC000003E, seccomp=317, rmdir=84, unlinkat=263, connect=42, socket=41, socketpair=53,
                   x32=True),
    "aarch64": _Abi(arch=0xC00000B7, seccomp=277, rmdir=None, unlinkat=35, connect=203, socket=198,
                    socketpair=199, x32=False),
}
_IO_URING = (425, 426, 427)  # io_uring_setup, _enter, _register: the same on every architecture
_X32_BIT = 0x40000000

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV = 1 << 5  # Linux 5.19
_RET_ALLOW = 0x7FFF0000
_RET_USER_NOTIF = 0x7FC00000
_RET_ERRNO = 0x00050000
_AT_REMOVEDIR = 0x200
_SOCK_TYPE_MASK = 0xF
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

#: What the guard answers once it holds the listener; the sandbox starts the agent only then.
ACK = b"ok"


def _program(abi: _Abi, removals: bool) -> bytes:
    """The classic BPF program (see the module's docstring)."""
    ld, jeq, jge, jset, alu_and, ret = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
    # Instructions (code, k, true target, false target), targets being labels (None: the next
    # one), and labels as plain strings; resolved to relative jumps below.
    steps: list[tuple[int, int, str | None, str | None] | str] = [
        (ld, _ARCH, None, None),
        (jeq, abi.arch, None, "enosys"),
        (ld, _NR, None, None),
        *([(jge, _X32_BIT, "enosys", None)] if abi.x32 else []),
        (jeq, abi.connect, "notify", None),
        (jeq, abi.socket, "family", None),
        (jeq, abi.socketpair, "family", None),
        *[(jeq, nr, "enosys", None) for nr in _IO_URING],
    ]
    if removals:
        steps += [
            *([(jeq, abi.rmdir, "notify", None)] if abi.rmdir is not None else []),
            (jeq, abi.unlinkat, None, "allow"),
            (ld, _ARG0 + 2 * 8, None, None),  # the flags' low 32 bits (little-endian)
            (jset, _AT_REMOVEDIR, "notify", "allow"),
        ]
    else:
        steps.append((ret, _RET_ALLOW, None, None))
    steps += [
        "family",
        (ld, _ARG0, None, None),  # the domain (an int)
        (jeq, socket.AF_UNIX, None, "allow"),
        (ld, _ARG0 + 8, None, None),  # the type, with SOCK_NONBLOCK / SOCK_CLOEXEC above its low bits
        (alu_and, _SOCK_TYPE_MASK, None, None),
        (jeq, socket.SOCK_STREAM, "allow", None),
        (jeq, socket.SOCK_SEQPACKET, "allow", "notify"),
        "notify", (ret, _RET_USER_NOTIF, None, None),
        "enosys", (ret, _RET_ERRNO | errno.ENOSYS, None, None),
        "allow", (ret, _RET_ALLOW, None, None),
    ]
    labels: dict[str, int] = {}
    for step in steps:
        if isinstance(step, str):
            labels[step] = sum(1 for s in steps[:steps.index(step)] if not isinstance(s, str))
    code = [s for s in steps if not isinstance(s, str)]
    return b"".join(
        struct.pack("=HBBI", op, labels[t] - i - 1 if t else 0, labels[f] - i - 1 if f else 0, k)
        for i, (op, k, t, f) in enumerate(code)
    )


class _Fprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _install(removals: bool) -> int:
    """Install the filter on this process (no_new_privs must be set) and return its listener."""
    machine = platform.machine()
    abi = _ABIS.get(machine)
    if abi is None:
        raise OSError(errno.ENOSYS, f"the guard has no seccomp filter for {machine}")
    code = _program(abi, removals)
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _Fprog(len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # Once the guard has taken a call, a signal the caller handles (node's SIGCHLD) waits for the
    # answer: else the call would be restarted after the guard had connected it (EISCONN, EALREADY).
    # A fatal signal still ends the caller. Older kernels: without.
    fd = -1
    for flags in (_SECCOMP_FILTER_FLAG_NEW_LISTENER | _SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV,
                  _SECCOMP_FILTER_FLAG_NEW_LISTENER):
        fd = libc.syscall(abi.seccomp, _SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(prog))
        if fd >= 0 or ctypes.get_errno() != errno.EINVAL:
            break
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
    return int(fd)  # close-on-exec: the agent never holds it


def try_listener() -> None:
    """Install the guard's filter on this process and close its listener at once; OSError when
    the kernel refuses (no user notification, no_new_privs not set, a listener already above).
    Only for a process that ends right after (``guard doctor`` runs it in a child): what the
    filter notifies fails from then on (ENOSYS), nobody listening."""
    os.close(_install(removals=False))


def hand_over(sock_fd: int, removals: bool = False) -> str | None:
    """Inside the sandbox, after no_new_privs: install the filter (directory removals notified
    too with *removals*), send its listener to the guard over the socket *sock_fd* (closed
    here) and wait for the guard's :data:`ACK`. None once the guard holds it; else why not
    (and the guard is told, when it can be): the agent must then not start."""
    with socket.socket(fileno=sock_fd) as sock:
        try:
            listener = _install(removals)
        except OSError as err:
            with contextlib.suppress(OSError):  # the guard is gone
                sock.sendall(str(err.strerror).encode())
            return str(err.strerror)
        # With it, the devices of the sandbox's own /tmp and /dev (tmpfs bubblewrap made): no
        # host process can have bound a socket there. Told before the agent runs.
        private = b"listener %d %d" % (os.stat("/tmp").st_dev, os.stat("/dev").st_dev)
        try:
            socket.send_fds(sock, [private], [listener])
            answer = sock.recv(len(ACK))
        except OSError as err:
            return f"handing the filter to the guard: {err.strerror}"
        finally:
            os.close(listener)
        return None if answer == ACK else "the guard did not take the filter"


def receive_listener(sock: socket.socket) -> tuple[int, list[int]] | str:
    """The guard's side of :func:`hand_over` (*sock* readable): the listener's fd, once
    acknowledged to the sandbox, with the devices of the sandbox's private /tmp and /dev; or
    why the sandbox sent none."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, 512, 1, socket.MSG_CMSG_CLOEXEC)
    except OSError as err:
        return f"reading the sandbox's answer: {err.strerror}"
    if not fds:
        return data.decode(errors="replace") or "the sandbox ended before it installed the filter"
    try:
        sock.sendall(ACK)
    except OSError as err:
        os.close(fds[0])
        return f"answering the sandbox: {err.strerror}"
    return fds[0], [int(word) for word in data.split()[1:] if word.isdigit()]


@dataclass(frozen=True)
class Notification:
    """One system call waiting for the guard."""

    id: int
    pid: int  # the calling thread, in the guard's PID namespace
    nr: int
    args: tuple[int, ...]

    @property
    def call(self) -> str:
        """"removal", "connect", "socket" (a socket or socketpair the filter stopped), or "other"."""
        abi = _ABIS[platform.machine()]
        if self.nr in (abi.rmdir, abi.unlinkat):
            return "removal"
        if self.nr == abi.connect:
            return "connect"
        if self.nr in (abi.socket, abi.socketpair):
            return "socket"
        return "other"


@dataclass(frozen=True)
class Removal:
    """One directory removal waiting for the guard."""

    id: int
    pid: int  # in the guard's PID namespace
    path_at: int  # the address of the path in the caller's memory

    @classmethod
    def of(cls, notification: Notification) -> Removal:
        """The removal *notification* (its call "removal") stands for."""
        abi = _ABIS[platform.machine()]
        at = notification.args[0] if notification.nr == abi.rmdir else notification.args[1]
        return cls(id=notification.id, pid=notification.pid, path_at=at)


class Listener:
    """The guard's end of the filter: notifications as they come, each answered once, by
    :meth:`answer` or (a removal only) :meth:`resume`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def ended(self) -> bool:
        """Whether nothing is waiting and nothing can come (every process of the sandbox is gone)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        events = dict(poller.poll(0)).get(self.fd, 0)
        return bool(events & select.POLLHUP) and not events & select.POLLIN

    def receive(self) -> Notification | None:
        """The next notification (call once the fd is readable); None if its caller is gone already."""
        buffer = bytearray(_NOTIF.size)
        try:
            fcntl.ioctl(self.fd, _IOCTL_RECV, buffer, True)
        except OSError as err:
            if err.errno == errno.ENOENT:
                return None
            raise
        id_, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buffer)
        return Notification(id=id_, pid=pid, nr=nr, args=tuple(args))

    def valid(self, id_: int) -> bool:
        """Whether notification *id_* still waits: its caller (and so its pid) is still the one."""
        try:
            fcntl.ioctl(self.fd, _IOCTL_ID_VALID, struct.pack("=Q", id_))
        except OSError:
            return False
        return True

    def memory(self, pid: int, at: int, size: int) -> bytes | None:
        """*size* bytes at *at* in the memory of thread *pid* (None when unreadable or gone).
        May block on a page of a file of our own mount: never call it on the mount's loop."""
        try:
            mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return os.pread(mem, size, at) if size else b""
        except OSError:
            return None
        finally:
            os.close(mem)

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
        if not self.valid(removal.id):  # the pid was reused while we read
            return None
        return read.partition(b"\0")[0]

    def resume(self, removal: Removal | Notification) -> None:
        """Let *removal* go on: the kernel runs it as if it was never stopped. Never for a
        connect or a socket (see the module's docstring)."""
        self._send(_RESP.pack(removal.id, 0, 0, _FLAG_CONTINUE))

    def answer(self, notification: Notification, error: int = 0) -> None:
        """Answer *notification* in the kernel's stead: 0, or -*error* (an errno)."""
        self._send(_RESP.pack(notification.id, 0, -error if error else 0, 0))

    def _send(self, response: bytes) -> None:
        try:
            fcntl.ioctl(self.fd, _IOCTL_SEND, response)
        except OSError as err:
            if err.errno != errno.ENOENT:  # its caller is gone: nothing waits for the answer
                raise

    def close(self) -> None:
        """Stop listening: calls still to come fail (ENOSYS), as the sandbox is ending."""
        os.close(self.fd)
