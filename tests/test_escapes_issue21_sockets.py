"""Hostile agents against the host's unix sockets (issue 21, item 1): from inside a real
``guard run --ci``, as root and as ``--user nobody``, in both network modes, a listener of the
host (a real listening socket the test makes where the sandbox shows it) is never reached,
whatever the agent names or races; what the manifest names, the agent socket and the agent's
own sockets still work. The host's listeners are checked afterwards: they accepted nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from .helpers import FIX_TAX
from .hostile import hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]
NETWORKS = ["host", "none"]


class HostListener:
    """A listening unix socket of the host, at a path (and, with *abstract*, an abstract name)."""

    def __init__(self, where: Path, abstract: str | None = None) -> None:
        self.path = where / "service.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(64)
        self.sock.setblocking(False)
        os.chmod(self.path, 0o777)  # noqa: S103 - natively, any user could connect: only the guard stops one
        self.abstract: socket.socket | None = None
        if abstract is not None:
            self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.abstract.bind("\0" + abstract)
            self.abstract.listen(64)
            self.abstract.setblocking(False)

    def accepted(self) -> list[tuple[int, int, int]]:
        """The peer credentials (pid, uid, gid) of every connection made to it so far."""
        got = []
        for sock in (self.sock, self.abstract):
            while sock is not None:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                with conn:
                    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                    got.append(struct.unpack("3i", creds))
        return got

    def close(self) -> None:
        self.sock.close()
        if self.abstract is not None:
            self.abstract.close()


@pytest.fixture
def host_dirs() -> Iterator[list[Path]]:
    """Directories of the host outside /tmp that the sandbox shows read-only: one under
    /var/tmp, one under /run (where docker.sock, D-Bus and systemd listen)."""
    made = [Path(tempfile.mkdtemp(prefix="guardfs-sock-", dir=d)) for d in ("/var/tmp", "/run")]
    for path in made:
        path.chmod(0o755)
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _manifest(network: str, sockets: Sequence[str] = ()) -> str:
    return FIX_TAX + f'[sandbox]\nnetwork = "{network}"\nunix_sockets = {json.dumps(list(sockets))}\n'


# The hostile script's tools: a connect of a stream socket to an address, said as "ok" or an errno.
CONNECT = r'''
import socket
def connect(address, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_UNIX, kind)
    try:
        s.connect(address)
        return "ok"
    finally:
        s.close()
'''


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("user", USERS)
def test_the_hosts_unix_sockets_are_out_of_reach(tmp_path: Path, host_dirs: list[Path], user: str | None,
                                                 network: str) -> None:
    """Every way the agent can name a listener of the host: its path, relative from its
    directory, through a symlink it made in /tmp, through /proc/self/root, and its abstract
    name; a non-blocking connect too. Each is EACCES, recorded, and the host accepted nothing."""
    name = f"guardfs-test-{os.getpid()}-{network}-{user}"
    listeners = [HostListener(d, abstract=name if i == 0 else None) for i, d in enumerate(host_dirs)]
    try:
        ws = hostile_workspace(tmp_path)
        run_sock, var_sock = str(listeners[1].path), str(listeners[0].path)
        seen, events, proc = hostile_run(tmp_path, ws, user, CONNECT + textwrap.dedent(f'''
            attempt("var_tmp", lambda: connect({var_sock!r}))
            attempt("run", lambda: connect({run_sock!r}))
            os.symlink({run_sock!r}, "/tmp/link.sock")
            attempt("symlink", lambda: connect("/tmp/link.sock"))
            attempt("proc_root", lambda: connect("/proc/self/root" + {run_sock!r}))
            os.chdir({os.path.dirname(run_sock)!r})
            attempt("relative", lambda: connect("service.sock"))
            def nonblocking():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
                r = s.connect_ex({run_sock!r})
                return errno.errorcode[r] if r else "ok"
            attempt("nonblocking", nonblocking)
            attempt("abstract", lambda: connect("\\0{name}"))
        '''), manifest=_manifest(network))
        assert proc.returncode == 0, proc.stderr
        # /proc/self names the guard's pid, which the sandbox's /proc does not hold: the agent
        # cannot name its own /proc entry in a connect (it would have led to the host's socket).
        assert seen.pop("proc_root") in ("ENOENT", "ELOOP", "EXDEV"), seen
        refused = {k: "EACCES" for k in ("var_tmp", "run", "symlink", "relative", "nonblocking")}
        # network = "none": the sandbox's own abstract namespace, where no such name listens.
        assert seen == {**refused, "abstract": "EACCES" if network == "host" else "ECONNREFUSED"}, (seen, proc.stderr)
        assert [listener.accepted() for listener in listeners] == [[], []]
        denied = {e["path"] for e in events if e["op"] == "connect" and e["decision"] == "deny"}
        assert {var_sock, run_sock, "service.sock", "/tmp/link.sock"} <= denied, denied
        assert ("@" + name in denied) is (network == "host")
        assert "unix_sockets" in proc.stderr  # the console names the key that would allow it
    finally:
        for listener in listeners:
            listener.close()


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("user", USERS)
def test_a_socket_the_manifest_names_is_reachable_as_the_agent(tmp_path: Path, host_dirs: list[Path],
                                                               user: str | None, network: str) -> None:
    """``[sandbox] unix_sockets``: a socket under /run, and one under /tmp (which the sandbox
    covers: shown at its path) are reached; the peer sees the agent's uid, not the guard's.
    Another socket in the same directory stays refused."""
    named = HostListener(host_dirs[1])
    other = HostListener(host_dirs[0])
    hidden_dir = Path(tempfile.mkdtemp(prefix="guardfs-sock-", dir="/tmp"))
    hidden_dir.chmod(0o755)
    hidden = HostListener(hidden_dir)
    try:
        ws = hostile_workspace(tmp_path)
        seen, _, proc = hostile_run(tmp_path, ws, user, CONNECT + textwrap.dedent(f'''
            attempt("named", lambda: connect({str(named.path)!r}))
            attempt("under_tmp", lambda: connect({str(hidden.path)!r}))
            attempt("other", lambda: connect({str(other.path)!r}))
        '''), manifest=_manifest(network, [str(named.path), str(hidden.path)]))
        assert seen == {"named": "ok", "under_tmp": "ok", "other": "EACCES"}, (seen, proc.stderr)
        uid = 0 if user is None else 65534
        assert [creds[1:] for creds in named.accepted() + hidden.accepted()] == [(uid, uid)] * 2
        assert other.accepted() == []
    finally:
        for listener in (named, other, hidden):
            listener.close()
        shutil.rmtree(hidden_dir, ignore_errors=True)


def test_a_manifest_naming_a_missing_socket_is_refused_at_start(tmp_path: Path, host_dirs: list[Path]) -> None:
    ws = hostile_workspace(tmp_path)
    (host_dirs[0] / "plain").write_text("")
    for entry, words in ((str(host_dirs[0] / "absent.sock"), "No such file"), (str(host_dirs[0] / "plain"),
                                                                                 "is not a socket")):
        (tmp_path / "manifest.toml").write_text(_manifest("host", [entry]))
        proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--manifest",
                               str(tmp_path / "manifest.toml"), "--run-dir", str(tmp_path / "run"), "--", "true"],
                              cwd=ws, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert proc.returncode == 65, proc.stderr
        assert "sandbox.unix_sockets" in proc.stderr and words in proc.stderr and entry in proc.stderr
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("user", USERS)
def test_a_thread_racing_the_address_or_the_descriptor_never_reaches_the_host(
        tmp_path: Path, host_dirs: list[Path], user: str | None) -> None:
    """The address the guard judged is not the one the kernel reads later, nor the socket:
    one thread swaps the sockaddr between an allowed path (the agent's own socket in /tmp)
    and the host's listener while another connects in a loop; a third swaps a TCP socket and a
    unix socket under the same descriptor number while it is connected to the host's path."""
    host = HostListener(host_dirs[1])
    try:
        ws = hostile_workspace(tmp_path)
        seen, _, proc = hostile_run(tmp_path, ws, user, f'''
            import ctypes, socket, struct, threading
            libc = ctypes.CDLL(None, use_errno=True)
            own = socket.socket(socket.AF_UNIX); own.bind("/tmp/own.sock"); own.listen(4096)
            def addr(path):
                return struct.pack("=H", socket.AF_UNIX) + path.encode().ljust(108, b"\\0")
            good, bad = addr("/tmp/own.sock"), addr({str(host.path)!r})
            buf = ctypes.create_string_buffer(good, len(good))
            stop = threading.Event()
            def swap():
                while not stop.is_set():
                    ctypes.memmove(buf, bad, len(bad))
                    ctypes.memmove(buf, good, len(good))
            threading.Thread(target=swap, daemon=True).start()
            results = {{}}
            for _ in range(1500):
                s = socket.socket(socket.AF_UNIX)
                r = libc.connect(s.fileno(), buf, len(good))
                key = "ok" if r == 0 else errno.errorcode[ctypes.get_errno()]
                results[key] = results.get(key, 0) + 1
                s.close()
                while True:  # keep the agent's own backlog empty
                    own.setblocking(False)
                    try:
                        own.accept()[0].close()
                    except BlockingIOError:
                        break
            stop.set()
            print(json.dumps({{"swapped": sorted(results)}}), flush=True)
            # The descriptor: a TCP socket's number, a unix socket put there meanwhile.
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            unix = socket.socket(socket.AF_UNIX)
            n, spare = tcp.fileno(), os.dup(tcp.fileno())
            stop.clear()
            def dup():
                while not stop.is_set():
                    os.dup2(unix.fileno(), n)
                    os.dup2(spare, n)
            threading.Thread(target=dup, daemon=True).start()
            outcomes = set()
            for _ in range(1500):
                r = libc.connect(n, bad, len(bad))
                outcomes.add("ok" if r == 0 else errno.errorcode[ctypes.get_errno()])
            stop.set()
            print(json.dumps({{"fd_swapped": sorted(outcomes)}}), flush=True)
        ''', manifest=_manifest("host"))
        assert proc.returncode == 0, proc.stderr
        # Both outcomes happened (the race was run), and no connect of the host's socket succeeded.
        # (A path read half-swapped names nothing: ENOENT, ENOTDIR.)
        assert set(seen["swapped"]) <= {"ok", "EACCES", "ENOENT", "ENOTDIR"} and "ok" in seen["swapped"], seen
        assert "ok" not in seen["fd_swapped"], seen
        assert host.accepted() == []
    finally:
        host.close()


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("user", USERS)
def test_the_agents_own_sockets_and_the_agent_socket_keep_working(tmp_path: Path, user: str | None,
                                                                  network: str) -> None:
    """A real server and client inside the run: under the sandbox's /tmp, in the workspace
    (through the mount), relative to the working directory, and an abstract one with network
    = "none"; socketpairs of streams and seqpackets (asyncio, multiprocessing); TCP on
    loopback; and a step over the agent socket: the breaker counts it."""
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, CONNECT + textwrap.dedent(r'''
        import asyncio, multiprocessing, subprocess, threading
        def serve(address):
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(address)
            srv.listen()
            def answer():
                conn, _ = srv.accept()
                conn.sendall(conn.recv(5)[::-1])
                conn.close()
            threading.Thread(target=answer, daemon=True).start()
            c = socket.socket(socket.AF_UNIX)
            c.connect(address)
            c.sendall(b"hello")
            got = c.recv(5).decode()
            c.close()
            return got
        attempt("tmp", lambda: serve("/tmp/own.sock"))
        attempt("workspace", lambda: serve(os.path.abspath("src/checkout/own.sock")))
        os.chdir("src/checkout")
        attempt("relative", lambda: serve("rel.sock"))
        if os.environ.get("NETWORK") == "none":
            attempt("abstract", lambda: serve("\0own-abstract"))
        attempt("pair", lambda: len(socket.socketpair()))
        attempt("seqpacket", lambda: len(socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)))
        async def loop():
            await asyncio.sleep(0)
            return "ok"
        attempt("asyncio", lambda: asyncio.run(loop()))
        def pipe():
            a, b = multiprocessing.Pipe()
            a.send("x")
            return b.recv()
        attempt("mp_pipe", pipe)
        def tcp():
            srv = socket.create_server(("127.0.0.1", 0))
            c = socket.create_connection(srv.getsockname(), timeout=10)
            srv.accept()[0].close()
            c.close()
            return "ok"
        attempt("tcp", tcp)
        def feed():  # what guard feed and the hooks do (guard itself is out of nobody's reach here)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(os.environ["GUARD_SOCKET"])
                s.sendall(b'{"type": "step", "tokens_in": 7, "tokens_out": 1}\n')
                return "error" not in json.loads(s.makefile().readline())
        attempt("feed", feed)
    ''').replace('os.environ.get("NETWORK")', repr(network)), manifest=_manifest(network))
    assert proc.returncode == 0, proc.stderr
    expected = {"tmp": "olleh", "workspace": "olleh", "relative": "olleh", "pair": 2, "seqpacket": 2,
                "asyncio": "ok", "mp_pipe": "x", "tcp": "ok", "feed": True}
    if network == "none":
        expected["abstract"] = "olleh"
    assert seen == expected, (seen, proc.stderr)
    assert json.loads((tmp_path / "run/ledger.json").read_text())["steps"] == 1
    assert not (ws / "src/checkout/own.sock").exists() or (ws / "src/checkout/own.sock").is_socket()


@pytest.mark.parametrize("user", USERS)
def test_datagram_sockets_io_uring_and_foreign_abis_are_refused(tmp_path: Path, user: str | None) -> None:
    """A datagram unix socket (which could sendto any path without a connect) is refused with
    EACCES and recorded, SOCK_RAW (the kernel makes it a datagram socket) too; io_uring
    (connects no filter sees) and the 32-bit and x32 system calls get ENOSYS. glibc's syslog()
    and Python's SysLogHandler carry on."""
    ws = hostile_workspace(tmp_path)
    helper = ""
    if shutil.which("gcc") and os.uname().machine == "x86_64":
        # A 64-bit process making i386 system calls (int 0x80): socketcall(SYS_SOCKET) and getpid.
        src = tmp_path / "int80.c"
        src.write_text(r'''
#include <stdio.h>
int main(void) {
    long args[3] = {1, 1, 0}, r1, r2;
    __asm__ volatile ("int $0x80" : "=a"(r1) : "a"(102), "b"(1), "c"(args) : "memory");
    __asm__ volatile ("int $0x80" : "=a"(r2) : "a"(20) : "memory");
    printf("%ld %ld\n", r1, r2);
    return 0;
}''')
        subprocess.run(["gcc", "-o", str(ws / "int80"), str(src)], check=True)
        helper = str(ws / "int80")
    seen, events, proc = hostile_run(tmp_path, ws, user, f'''
        import ctypes, logging.handlers, socket, subprocess, syslog
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        attempt("dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) and "ok")
        cloexec = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
        attempt("dgram_cloexec", lambda: socket.socket(socket.AF_UNIX, cloexec) and "ok")
        attempt("raw", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_RAW) and "ok")
        attempt("pair_dgram", lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) and "ok")
        attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) and "ok")
        # The guard performs the connect, but with the agent's credentials: joining rtnetlink's
        # multicast groups at connect needs CAP_NET_ADMIN, which the agent (root or not) lacks.
        def netlink_groups():
            with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
                s.connect((0, 1))
                return "ok"
        attempt("netlink_groups", netlink_groups)
        def syscall(nr, *args):
            r = libc.syscall(nr, *args)
            return errno.errorcode[ctypes.get_errno()] if r < 0 else "ok"
        params = ctypes.create_string_buffer(120)
        attempt("io_uring_setup", lambda: syscall(425, 8, params))
        if os.uname().machine == "x86_64":
            attempt("x32_getpid", lambda: syscall(0x40000000 | 39))
        syslog.syslog("hello from the agent")
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        attempt("syslog", lambda: "carried on")
        if {helper!r}:
            attempt("int80", lambda: subprocess.run([{helper!r}], capture_output=True, text=True).stdout.split())
    ''', manifest=_manifest("host"))
    assert proc.returncode == 0, proc.stderr
    expected: dict[str, object] = {
        "dgram": "EACCES", "dgram_cloexec": "EACCES", "raw": "EACCES", "pair_dgram": "EACCES", "udp": "ok",
        "netlink_groups": "EPERM",
        "io_uring_setup": "ENOSYS", "syslog": "carried on"}
    if os.uname().machine == "x86_64":
        expected["x32_getpid"] = "ENOSYS"
    if helper:
        expected["int80"] = ["-38", "-38"]  # -ENOSYS for both: nothing of that ABI runs
    assert seen == expected, (seen, proc.stderr)
    refused = [e for e in events if e["op"] == "socket" and e["decision"] == "deny"]
    assert len(refused) >= 5 and {e["path"] for e in refused} >= {"AF_UNIX SOCK_DGRAM", "AF_UNIX SOCK_RAW"}
