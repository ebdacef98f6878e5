"""Every ``connect`` from the sandbox, judged and performed by the guard: the host's unix
sockets stay out of the agent's reach, in every network mode.

The sandbox shows the host read-only, and a read-only mount does not stop a ``connect`` to
a socket on it (``/run/docker.sock``, the D-Bus system bus, ``/run/systemd/private``);
neither does Landlock. So the guard's seccomp filter (:mod:`sandbox.launch.seccomp`) stops
every ``connect`` and hands it here, and the guard answers in the kernel's stead:

1. It takes the caller's socket (``pidfd_getfd``: the same open file description) and reads
   the address from the caller's memory once, off the loop (the page may be a file of our
   own mount), checking the notification is still the caller's after the read.
2. Any socket but ``AF_UNIX`` (a socket's family never changes): connected as asked.
3. ``AF_UNIX``: a path is resolved as the agent sees it (``openat2`` beneath the caller's
   root, ``RESOLVE_IN_ROOT``; relative paths from its working directory) to an ``O_PATH``
   fd, and the socket found is judged (:meth:`SocketJudge.allows`); an allowed one is
   connected through ``/proc/self/fd/N``, which names exactly the inode judged. An abstract
   name is judged by the network mode. Refused: ``EACCES`` and an event (which the live
   console says, with the manifest key that would allow it).
4. The connect runs in a thread with the caller's uid, gids and (no) capabilities (a root
   guard takes them on for that one call): the peer sees the agent's credentials, and the
   kernel checks the agent's permissions, as it would have.

The guard never lets a connect go on (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``), not even a TCP
one: between its look and the kernel's, another thread of the caller could change the
address or put an ``AF_UNIX`` socket under the same descriptor number. Whatever the guard
connects is the socket and the address it judged, and the caller sees the result.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import platform
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from guardfs.errors import ManifestError
from guardfs.events import Emit
from sandbox.launch.seccomp import Listener, Notification, receive_listener

__all__ = ["HostSocket", "SocketJudge", "mount_device", "named_sockets", "serve_filter"]

_SYS_PIDFD_GETFD = 438  # the same number on every architecture
_PIDFD_THREAD = os.O_EXCL
_SOCKADDR_MAX = 128  # sizeof(struct sockaddr_storage): the kernel refuses more (EINVAL)
_SUN_PATH = 2  # offsetof(struct sockaddr_un, sun_path)
_SOCKADDR_UN_MAX = 110  # sizeof(struct sockaddr_un)
_RESOLVE_IN_ROOT = 0x10
_SYS_OPENAT2 = 437
_SOCK_TYPES = {int(socket.SOCK_DGRAM): "SOCK_DGRAM", int(socket.SOCK_RAW): "SOCK_RAW"}


@dataclass(frozen=True)
class _CredCalls:
    setgroups: int
    setresuid: int
    setresgid: int
    capget: int
    capset: int


_CRED_CALLS = {
    "x86_64": _CredCalls(setgroups=116, setresuid=117, setresgid=119, capget=125, capset=126),
    "aarch64": _CredCalls(setgroups=159, setresuid=147, setresgid=149, capget=90, capset=91),
}
_CAP_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


@dataclass(frozen=True)
class HostSocket:
    """A socket of the host that ``[sandbox] unix_sockets`` names, as found at the start."""

    entry: str  # as the manifest writes it
    path: str  # ~ expanded
    dev: int
    ino: int


def named_sockets(entries: Sequence[str], home: str, workspace: str) -> tuple[list[HostSocket], list[bytes]]:
    """``[sandbox] unix_sockets``: each path stat'ed now (it must be a socket; *home* is what
    ``~`` means), and the abstract names (``@name``). ManifestError naming the key otherwise."""
    found, abstract = [], []
    for entry in entries:
        if entry.startswith("@"):
            abstract.append(b"\0" + entry[1:].encode())
            continue
        path = home + entry[1:] if entry == "~" or entry.startswith("~/") else entry
        if os.path.normpath(path) == workspace or os.path.normpath(path).startswith(workspace.rstrip("/") + "/"):
            # The agent may replace what is there (a symlink to /run/docker.sock) before a later run
            # stats it; its own sockets there are reachable anyway.
            raise _bad(f"{entry!r} is inside the workspace, where every socket the agent makes is reachable "
                       "already: remove it from the list")
        try:
            st = os.stat(path)
        except OSError as err:
            raise _bad(f"{entry!r} ({path}): {err.strerror}; start the service that listens there first, "
                       "or remove it from the list") from err
        if not stat.S_ISSOCK(st.st_mode):
            raise _bad(f"{entry!r} ({path}) is not a socket; name the socket the service listens on")
        found.append(HostSocket(entry, path, st.st_dev, st.st_ino))
    return found, abstract


def _bad(reason: str) -> ManifestError:
    return ManifestError("the manifest", [("sandbox.unix_sockets", reason)])


def _mount_table() -> dict[str, int]:
    """Our mount table: each mount point's device (without a stat, which would go through it)."""
    table: dict[str, int] = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            where = fields[4].encode().decode("unicode_escape", errors="replace")  # \040 for a space
            major, minor = fields[2].split(":")
            table[where] = os.makedev(int(major), int(minor))
    return table


def mount_device(mountpoint: str) -> int | None:
    """The device of the filesystem mounted at *mountpoint* in our mount table."""
    return _mount_table().get(mountpoint)


@dataclass
class _Verdict:
    """What the thread that performed (or refused) a connect brings back to the loop."""

    error: int  # 0, or the errno the caller gets
    refused: str | None = None  # the socket refused, as the agent named it
    why: str = ""


class SocketJudge:
    """Judges and performs the sandbox's connects (see the module's docstring).

    A socket is allowed when it is the guard's agent socket (*agent_socket*'s device and
    inode), one that ``[sandbox] unix_sockets`` names (*named*, *abstract*), or one on a
    filesystem private to the sandbox (*private_devs*: its /tmp and /dev, the guarded
    mount), where no host process can have bound it. Abstract names are allowed with
    ``network = "none"`` (the sandbox's own namespace holds only its own). *as_caller*: a
    root guard, which takes on the caller's credentials for each unix connect."""

    def __init__(self, *, agent_socket: str, named: Sequence[HostSocket] = (), abstract: Sequence[bytes] = (),
                 network: str = "host", private_devs: Sequence[int] = (), emit: Emit,
                 say: Callable[[str], None], as_caller: bool | None = None) -> None:
        st = os.stat(agent_socket)
        self._agent = (st.st_dev, st.st_ino)
        self._named = {(s.dev, s.ino): s for s in named}
        self._abstract = set(abstract)
        self.network = network
        self.private_devs = set(private_devs)
        self.emit = emit
        self.say = say
        self.as_caller = os.geteuid() == 0 if as_caller is None else as_caller
        # Connects may block (a TCP handshake, a full backlog): their own threads, never the
        # ones the mount's work needs; unix ones apart, so that connects to a black-holed host
        # never keep the agent's hooks from the agent socket.
        self._threads = {True: trio.CapacityLimiter(64), False: trio.CapacityLimiter(256)}

    def trust(self, devices: Sequence[int]) -> None:
        """Take the devices the sandbox's entry step reported as its own (its /tmp, its /dev),
        but one that a filesystem of ours has (a sandbox without a private /tmp)."""
        ours = set(_mount_table().values())
        self.private_devs.update(d for d in devices if d not in ours)

    def allows(self, st: os.stat_result) -> bool:
        """Whether the socket of status *st* (a socket the agent's path names) may be reached."""
        key = (st.st_dev, st.st_ino)
        return key == self._agent or key in self._named or st.st_dev in self.private_devs

    async def connect(self, listener: Listener, call: Notification) -> None:
        """Answer the connect *call*: performed on the caller's socket, or refused."""
        fd, at, size = call.args[0] & 0xFFFFFFFF, call.args[1], ctypes.c_int32(call.args[2] & 0xFFFFFFFF).value
        try:
            sock = self._fetch(listener, call, fd)
        except OSError as err:
            listener.answer(call, err.errno or errno.EBADF)
            return
        if sock is None:
            return  # the caller is gone
        try:
            verdict = await trio.to_thread.run_sync(self._perform, listener, call, sock, at, size,
                                                    limiter=self._threads[sock.family == socket.AF_UNIX],
                                                    abandon_on_cancel=True)
        finally:
            sock.close()  # ours is a duplicate: the caller's stays open (and connected)
        if verdict.refused is not None:
            self._refused(verdict.refused, verdict.why)
        listener.answer(call, verdict.error)

    def refuse_socket(self, listener: Listener, call: Notification) -> None:
        """Answer a ``socket``/``socketpair`` of an AF_UNIX datagram socket: EACCES, recorded."""
        kind = _SOCK_TYPES.get(call.args[1] & 0xF, f"type {call.args[1] & 0xF}")
        what = f"AF_UNIX {kind}"
        self.emit("socket", what, "deny", rule="sandbox.unix_sockets", errno="EACCES",
                  reason="a datagram unix socket could send to any unix socket of the host without a connect; "
                         "use SOCK_STREAM (glibc's syslog() and Python's SysLogHandler fall back or fail quietly)")
        listener.answer(call, errno.EACCES)

    def _fetch(self, listener: Listener, call: Notification, fd: int) -> socket.socket | None:
        """The caller's socket *fd* (a duplicate), or None when the caller is gone. Cheap: on the loop."""
        try:
            pidfd = _pidfd(call.pid)
        except ProcessLookupError:
            return None
        try:
            if not listener.valid(call.id):  # the pid was reused before the pidfd pinned it
                return None
            got = _check(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
        finally:
            os.close(pidfd)
        try:
            os.set_inheritable(got, False)
            return socket.socket(fileno=got)  # ENOTSOCK for another file: the kernel's answer too
        except OSError:
            os.close(got)
            raise

    def _perform(self, listener: Listener, call: Notification, sock: socket.socket, at: int, size: int
                 ) -> _Verdict:
        """In a thread: read the address, judge it, connect. The errno, and what was refused."""
        if size < 0 or size > _SOCKADDR_MAX:
            return _Verdict(errno.EINVAL)
        address = listener.memory(call.pid, at, size)
        if address is None or len(address) < size:
            return _Verdict(errno.EFAULT)
        if not listener.valid(call.id):  # read from another process that took the pid
            return _Verdict(errno.EINTR)  # nobody waits for it
        if sock.family != socket.AF_UNIX:
            # As the caller too: a connect's own checks (netlink's multicast groups, an LSM's
            # hook) must see the agent's credentials, never the guard's capabilities.
            try:
                with _as_caller(call.pid) if self.as_caller else contextlib.nullcontext():
                    return _Verdict(_connect(sock, address))
            except OSError as err:
                return _Verdict(err.errno or errno.EACCES)
        if sock.type not in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
            return _Verdict(errno.EACCES, "a datagram unix socket", "datagram unix sockets are refused")
        if size <= _SUN_PATH or size > _SOCKADDR_UN_MAX or int.from_bytes(address[:2], "little") != socket.AF_UNIX:
            return _Verdict(errno.EINVAL)  # as unix_validate_addr
        name = address[_SUN_PATH:]
        if name[0] == 0:
            return self._abstract_connect(call, sock, address, name)
        path = name.partition(b"\0")[0]
        try:
            with _caller_view(call.pid) as (root, cwd), \
                    _as_caller(call.pid) if self.as_caller else contextlib.nullcontext():
                return self._path_connect(sock, path, root, cwd)
        except OSError as err:
            return _Verdict(err.errno or errno.EACCES)

    def _abstract_connect(self, call: Notification, sock: socket.socket, address: bytes, name: bytes) -> _Verdict:
        shown = "@" + name[1:].decode(errors="backslashreplace")
        if self.network != "none" and name not in self._abstract:
            return _Verdict(errno.EACCES, shown, "an abstract socket of the host (network = \"host\")")
        try:
            with _as_caller(call.pid) if self.as_caller else contextlib.nullcontext():
                return _Verdict(_connect(sock, address))
        except OSError as err:
            return _Verdict(err.errno or errno.EACCES)

    def _path_connect(self, sock: socket.socket, path: bytes, root: int, cwd: str | int) -> _Verdict:
        full = path if path.startswith(b"/") or isinstance(cwd, int) else os.fsencode(cwd).rstrip(b"/") + b"/" + path
        how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT if not isinstance(cwd, int) or
                       path.startswith(b"/") else 0)
        base = cwd if isinstance(cwd, int) and not path.startswith(b"/") else root
        target = _libc.syscall(_SYS_OPENAT2, base, full, ctypes.byref(how), ctypes.sizeof(how))
        if target < 0:
            return _Verdict(ctypes.get_errno())
        try:
            st = os.fstat(target)
            if not stat.S_ISSOCK(st.st_mode):
                return _Verdict(errno.ECONNREFUSED)  # as the kernel answers a path that is no socket
            if not self.allows(st):
                return _Verdict(errno.EACCES, os.fsdecode(path), "a unix socket of the host")
            magic = f"/proc/self/fd/{target}".encode()
            return _Verdict(_connect(sock, struct.pack("=H", socket.AF_UNIX) + magic + b"\0"))
        finally:
            os.close(target)

    def _refused(self, what: str, why: str) -> None:
        # The live console says each denial (rate-limited, never the event): the way out is in it.
        self.emit("connect", what, "deny", rule="sandbox.unix_sockets", errno="EACCES",
                  reason=f"{why}; to allow it, add {what!r} to [sandbox] unix_sockets")


def _pidfd(tid: int) -> int:
    """A pidfd of thread *tid* (PIDFD_THREAD, Linux 6.9: the caller is often not its process's
    first thread: a resolver's, a runtime's pool); before 6.9, of its process (whose descriptor
    table its threads share but if one unshared it: then the guard connects a socket the caller
    does not hold, and the caller's stays unconnected)."""
    try:
        return os.pidfd_open(tid, _PIDFD_THREAD)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    tgid = _status_lines(tid, b"Tgid").get(b"Tgid")
    return os.pidfd_open(int(tgid) if tgid else tid)


def _connect(sock: socket.socket, address: bytes) -> int:
    """connect(2) on *sock* with the raw *address*: 0 or the errno (the socket's own blocking
    mode and timeouts hold: it is the caller's open file)."""
    buffer = ctypes.create_string_buffer(address, len(address))
    if _libc.connect(sock.fileno(), buffer, len(address)) == 0:
        return 0
    return ctypes.get_errno()


@contextlib.contextmanager
def _caller_view(tid: int):  # type: ignore[no-untyped-def]
    """The caller's root (an O_PATH fd) and working directory: its path as the caller sees it,
    or an O_PATH fd when that path cannot be told (a directory removed since)."""
    root = os.open(f"/proc/{tid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    cwd_fd: int | None = None
    try:
        try:
            cwd: str | int = os.readlink(f"/proc/{tid}/cwd")
        except OSError:
            cwd = ""
        if not isinstance(cwd, str) or not cwd.startswith("/") or cwd.endswith(" (deleted)"):
            cwd_fd = os.open(f"/proc/{tid}/cwd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            cwd = cwd_fd
        yield root, cwd
    finally:
        os.close(root)
        if cwd_fd is not None:
            os.close(cwd_fd)


def _status_lines(tid: int, *keys: bytes) -> dict[bytes, bytes]:
    """The values of lines *keys* of ``/proc/<tid>/status`` (those found), in one read as a
    rule: the kernel writes the whole file at the first read, whose 4 KiB hold the lines
    asked for here (Tgid, Uid, Gid, Groups come first), read on only when the last asked ends
    past it (thousands of groups). Bytes, never decoded: on every connect of a root guard."""
    fd = os.open(f"/proc/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = b"\n" + os.read(fd, 4096)
        while True:
            found: dict[bytes, bytes] = {}
            for key in keys:
                start = data.find(b"\n" + key + b":")
                end = data.find(b"\n", start + 1) if start >= 0 else -1
                if end < 0:
                    break
                found[key] = data[start + len(key) + 2:end].strip()
            else:
                return found
            more = os.read(fd, 1 << 16)
            if not more:  # the end of the file: what is there is all there is
                return found
            data += more
    finally:
        os.close(fd)


def _status_ids(tid: int) -> tuple[int, int, list[int]]:
    """The effective uid and gid and the groups of thread *tid*, as our namespace sees them.

    Read afresh for every connect, never cached by thread: a thread changes its own
    credentials between two connects (``setresuid``, ``setgroups``, ``capset``; glibc's
    ``setuid`` has every thread do it), and nothing the kernel shows changes with them more
    cheaply than this file (the owner of ``/proc/<tid>`` is the effective ids only while the
    task is dumpable, and never says the groups). While the caller waits in this connect
    they cannot change (only a thread changes its own credentials, and one stopped in a
    system call runs nothing: under WAIT_KILLABLE_RECV, sandbox.launch.seccomp, even glibc's
    signal that has it change them waits for the answer), so this read is exact."""
    lines = _status_lines(tid, b"Uid", b"Gid", b"Groups")
    try:
        uid, gid = int(lines[b"Uid"].split()[1]), int(lines[b"Gid"].split()[1])
        groups = [int(g) for g in lines[b"Groups"].split()]
    except (KeyError, IndexError, ValueError) as err:
        raise OSError(errno.ESRCH, "the caller's credentials could not be read") from err
    return uid, gid, groups


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


@contextlib.contextmanager
def _as_caller(tid: int):  # type: ignore[no-untyped-def]
    """This thread (only: raw system calls, not libc's process-wide ones) with the effective
    uid, gid and groups of thread *tid* and no effective capability, then back. A root
    guard's: the saved uid stays 0, so the way back is open."""
    calls = _CRED_CALLS[platform.machine()]
    uid, gid, groups = _status_ids(tid)
    header = _CapHeader(_CAP_VERSION_3, 0)
    caps = (_CapData * 2)()
    _check(_libc.syscall(calls.capget, ctypes.byref(header), caps))
    own_gid, own_groups = os.getegid(), os.getgroups()
    wanted = (ctypes.c_uint32 * max(1, len(groups)))(*groups)
    _check(_libc.syscall(calls.setgroups, len(groups), wanted))
    try:
        _check(_libc.syscall(calls.setresgid, -1, gid, -1))
        try:
            _check(_libc.syscall(calls.setresuid, -1, uid, -1))
            try:
                dropped = (_CapData * 2)(*[_CapData(0, c.permitted, c.inheritable) for c in caps])
                _check(_libc.syscall(calls.capset, ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), dropped))
                yield
            finally:
                _check(_libc.syscall(calls.capset, ctypes.byref(_CapHeader(_CAP_VERSION_3, 0)), caps))
                _check(_libc.syscall(calls.setresuid, -1, 0, -1))
        finally:
            _check(_libc.syscall(calls.setresgid, -1, own_gid, -1))
    finally:
        mine = (ctypes.c_uint32 * max(1, len(own_groups)))(*own_groups)
        _check(_libc.syscall(calls.setgroups, len(own_groups), mine))


async def serve_filter(sock: socket.socket, judge: SocketJudge,
                       removals: Callable[[Listener, trio.MemoryReceiveChannel[Notification]], Awaitable[None]]
                       | None = None) -> None:
    """The guard's end of the sandbox's seccomp filter (:mod:`sandbox.launch.seccomp`), for as
    long as the sandbox lives: *sock* brings the listener; every call it stops is answered,
    connects by *judge*, datagram sockets refused, removals handed in order to *removals*
    (:meth:`sandbox.launch.inject.MidRunBinder.serve_removals`) when it is given."""
    with sock:
        await trio.lowlevel.wait_readable(sock)
        got = receive_listener(sock)
    if isinstance(got, str):
        judge.say(f"the agent is not started: the sandbox's seccomp filter did not reach the guard ({got}); "
                  "it keeps the host's unix sockets out of the agent's reach. Pass --no-isolation to run without "
                  "a sandbox at all")
        return
    fd, devices = got
    judge.trust(devices)
    listener = Listener(fd)
    send, receive = trio.open_memory_channel[Notification](math.inf)
    try:
        async with trio.open_nursery() as nursery:
            if removals is not None:
                nursery.start_soon(removals, listener, receive)
            while True:
                await trio.lowlevel.wait_readable(listener)
                if listener.ended():
                    break
                call = listener.receive()
                if call is None:
                    continue  # its caller is gone
                kind = call.call
                if kind == "connect":
                    nursery.start_soon(judge.connect, listener, call)
                elif kind == "socket":
                    judge.refuse_socket(listener, call)
                elif kind == "removal" and removals is not None:
                    send.send_nowait(call)
                else:  # nothing else is notified: never let an unknown call go on
                    listener.answer(call, errno.ENOSYS)
            nursery.cancel_scope.cancel()  # every caller is gone: nothing waits for an answer
    finally:
        send.close()
        listener.close()
