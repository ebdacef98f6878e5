"""The pieces of the connect judge (sandbox.launch.sockets) and Landlock's scopes, on the real
kernel, without a mount: ``[sandbox] unix_sockets`` checked at the start, and what the
Landlock scopes refuse a restricted process (defence in depth under the filter)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guardfs.errors import ManifestError
from sandbox.launch.landlock import abi_version
from sandbox.launch.sockets import named_sockets

ROOT = Path(__file__).resolve().parents[1]


def test_named_sockets_are_found_and_checked(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "agent.sock"))
    (tmp_path / "plain").write_text("")
    with sock:
        found, abstract = named_sockets(["~/agent.sock", "@ssh-agent"], str(tmp_path), "/nonexistent-ws")
        st = os.stat(tmp_path / "agent.sock")
        assert [(s.entry, s.path, s.dev, s.ino) for s in found] == [
            ("~/agent.sock", str(tmp_path / "agent.sock"), st.st_dev, st.st_ino)]
        assert abstract == [b"\0ssh-agent"]
        for entry, words in (("~/absent.sock", "No such file"), ("~/plain", "is not a socket"),
                             (str(tmp_path / "ws/x.sock"), "inside the workspace")):
            with pytest.raises(ManifestError) as caught:
                named_sockets([entry], str(tmp_path), str(tmp_path / "ws"))
            assert "sandbox.unix_sockets" in str(caught.value) and words in str(caught.value), caught.value


@pytest.mark.skipif(abi_version() < 6, reason="Landlock ABI < 6: no scopes")
def test_landlock_scopes_keep_abstract_sockets_and_signals_in(tmp_path: Path) -> None:
    """After restrict_writes, an abstract socket made outside is refused (EPERM) and so is a
    signal to a process outside; the restricted process's own abstract socket connects."""
    outside = socket.socket(socket.AF_UNIX)
    outside.bind(f"\0guardfs-scope-{os.getpid()}")
    outside.listen()
    code = textwrap.dedent(f"""
        import errno, os, socket, sys
        sys.path.insert(0, {str(ROOT)!r})
        from sandbox.launch.landlock import restrict_writes
        restrict_writes([{str(tmp_path)!r}])
        def attempt(f):
            try:
                f()
                return "ok"
            except OSError as err:
                return errno.errorcode[err.errno]
        s = socket.socket(socket.AF_UNIX)
        print(attempt(lambda: s.connect("\\0guardfs-scope-{os.getpid()}")))
        own = socket.socket(socket.AF_UNIX)
        own.bind("\\0guardfs-scope-own-{os.getpid()}")
        own.listen()
        print(attempt(lambda: socket.socket(socket.AF_UNIX).connect("\\0guardfs-scope-own-{os.getpid()}")))
        print(attempt(lambda: os.kill({os.getpid()}, 0)))
        print(attempt(lambda: os.kill(os.getpid(), 0)))
    """)
    with outside:
        proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["EPERM", "ok", "EPERM", "ok"]


# A process of the "sandbox": no_new_privs, the filter handed over, then its connects.
CALLER = """
import ctypes, errno, json, os, socket, sys
sys.path.insert(0, {root!r})
from sandbox.launch.seccomp import hand_over
ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
why = hand_over({fd})
if why is not None:
    sys.exit(why)
def attempt(name, f):
    try:
        got = f()
    except OSError as err:
        got = errno.errorcode[err.errno]
    print(json.dumps({{name: got}}), flush=True)
def unix(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return "ok"
attempt("agent", lambda: unix({agent!r}))
import threading  # a connect from a thread that is not the process's first (a resolver's, a pool's)
threaded = threading.Thread(target=attempt, args=("thread", lambda: unix({agent!r})))
threaded.start()
threaded.join()
attempt("host", lambda: unix({host!r}))
attempt("absent", lambda: unix({absent!r}))
attempt("einval", lambda: socket.socket(socket.AF_UNIX).connect(""))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=10) and "ok")
def nonblocking():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    return errno.errorcode.get(s.connect_ex(("127.0.0.1", {port})), "ok")
attempt("tcp_nonblocking", nonblocking)
attempt("not_a_socket", lambda: ctypes.CDLL(None, use_errno=True).connect(0, b"\\0" * 16, 16) == 0
        or errno.errorcode[ctypes.get_errno()])
attempt("dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) and "ok")
# Signals the caller handles (SA_RESTART), all along: a connect the guard has taken is never
# restarted after the guard connected it (EALREADY), nor cut short (EINTR).
import signal, struct
signal.signal(signal.SIGALRM, lambda *_: None)
signal.siginterrupt(signal.SIGALRM, False)  # SA_RESTART, as libuv's and Go's handlers have
signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
libc = ctypes.CDLL(None, use_errno=True)
address = struct.pack("=HH4s8x", socket.AF_INET, socket.htons({port}), socket.inet_aton("127.0.0.1"))
outcomes = set()
for _ in range(300):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
    outcomes.add(errno.errorcode.get(ctypes.get_errno(), "?") if libc.connect(s.fileno(), address, 16) else "ok")
    s.close()
signal.setitimer(signal.ITIMER_REAL, 0)
print(json.dumps({{"under_signals": sorted(outcomes)}}), flush=True)
"""


def test_the_judge_answers_every_connect_of_a_filtered_process(tmp_path: Path) -> None:
    """A real process under the real filter, the judge as its guard: the agent socket and TCP
    connect (blocking or not), a socket of the host is refused and recorded, the kernel's own
    answers (ENOENT, EINVAL, ENOTSOCK) come back as they would. This process's /tmp and /dev
    are in the guard's mount table: the devices the caller reports for them are not trusted."""
    import json

    import trio

    from sandbox.launch.sockets import SocketJudge, serve_filter

    agent, host = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    agent.bind(str(tmp_path / "agent.sock"))
    host.bind(str(tmp_path / "host.sock"))
    tcp = socket.create_server(("127.0.0.1", 0), backlog=1024)
    for sock in (agent, host):
        sock.listen()
    host.setblocking(False)
    events: list[tuple[str, str, str]] = []
    ours, theirs = socket.socketpair()
    code = textwrap.dedent(CALLER).format(root=str(ROOT), fd=theirs.fileno(), agent=str(tmp_path / "agent.sock"),
                                          host=str(tmp_path / "host.sock"), absent=str(tmp_path / "absent.sock"),
                                          port=tcp.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-I", "-c", code], pass_fds=(theirs.fileno(),),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    theirs.close()
    judge = SocketJudge(agent_socket=str(tmp_path / "agent.sock"), emit=lambda op, path, decision, **_: events.append(
        (op, path, decision)), say=lambda text: None)

    async def guard() -> None:
        with trio.fail_after(60):
            await serve_filter(ours, judge)

    with agent, host, tcp:
        trio.run(guard)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        seen = {k: v for line in out.splitlines() for k, v in json.loads(line).items()}
        assert seen == {"agent": "ok", "thread": "ok", "host": "EACCES", "absent": "ENOENT", "einval": "EINVAL",
                        "tcp": "ok", "tcp_nonblocking": "EINPROGRESS", "not_a_socket": "ENOTSOCK", "dgram": "EACCES",
                        "under_signals": ["EINPROGRESS"]}
        with pytest.raises(BlockingIOError):
            host.accept()
    assert events == [("connect", str(tmp_path / "host.sock"), "deny"), ("socket", "AF_UNIX SOCK_DGRAM", "deny")]
    assert not judge.private_devs  # /tmp and /dev reported by a caller that shares our mounts


def test_the_agent_does_not_start_when_the_guard_does_not_take_the_filter(tmp_path: Path) -> None:
    """The sandbox's entry step with its filter's socket to a guard that is gone: no agent, exit
    69, and the words say why and the way out."""
    ours, theirs = socket.socketpair()
    ours.close()  # the guard ended (or never read it)
    with theirs:
        proc = subprocess.run([sys.executable, "-m", "sandbox.launch.enter", "--write", str(tmp_path),
                               f"--filter={theirs.fileno()}", "--", "echo", "agent started"],
                              pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 69 and "agent started" not in proc.stdout, (proc.stdout, proc.stderr)
    assert "refusing to start the agent: the guard's seccomp filter is not in place" in proc.stderr
    assert "--no-isolation" in proc.stderr


@pytest.mark.root
def test_the_callers_credentials_are_read_afresh_at_each_connect() -> None:
    """What a root guard takes on for a connect (sockets._status_ids): the ids and groups the
    caller itself reports, a list of groups that ends past the first 4 KiB of its status read
    on, and a change of credentials between two connects seen at the second (nothing cached)."""
    from sandbox.launch.sockets import _pidfd, _status_ids

    groups = list(range(100_000, 103_000))  # "Groups:" alone about 21 KiB
    script = textwrap.dedent(f"""
        import os, sys
        def say():
            print(os.geteuid(), os.getegid(), *os.getgroups(), flush=True)
            sys.stdin.readline()
        os.setgroups({groups!r})
        os.setresgid(4321, 4321, 0)
        os.setresuid(1234, 1234, 0)  # the saved uid stays 0: the way back is open
        say()
        os.seteuid(0)
        os.setgroups([7])
        os.setresgid(77, 77, 0)
        os.setresuid(-1, 55, -1)
        say()
        """)
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            said = [int(w) for w in child.stdout.readline().split()]
            assert said[:2] == [1234, 4321] and sorted(said[2:]) == groups
            uid, gid, got = _status_ids(child.pid)
            assert (uid, gid, sorted(got)) == (1234, 4321, groups)
            child.stdin.write("\n")
            child.stdin.flush()
            assert [int(w) for w in child.stdout.readline().split()] == [55, 77, 7]
            assert _status_ids(child.pid) == (55, 77, [7])
            os.close(_pidfd(child.pid))  # the thread's pidfd, or its process's: either opens
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(30) == 0
        finally:
            child.kill()
