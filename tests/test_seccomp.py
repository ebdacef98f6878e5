"""The filter that hands directory removals to the guard (sandbox.launch.seccomp), on the real
kernel: a real process installs it and the test is its guard."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from sandbox.launch.inject import may_name
from sandbox.launch.seccomp import Listener, Removal, receive_listener

ROOT = Path(__file__).resolve().parents[1]

# The sandbox's side: no_new_privs, the filter handed over, then removals of every kind.
REMOVER = """
import ctypes, os, sys
sys.path.insert(0, {root!r})
from sandbox.launch.seccomp import hand_over
if {nnp}:
    ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)
hand_over({fd}, removals=True)
os.chdir({where!r})
os.makedirs("a/b")
open("a/file", "w").close()
os.unlink("a/file")                     # a file: not handed over
os.rmdir("a/b")                         # rmdir
parent = os.open(".", os.O_RDONLY)
os.rmdir("a", dir_fd=parent)            # unlinkat(AT_REMOVEDIR)
try:
    os.rmdir("absent")                  # handed over too, and the kernel's answer stands
except FileNotFoundError:
    print("absent: ENOENT")
"""


def _remover(tmp_path: Path, nnp: bool = True, user: str | None = None) -> tuple[socket.socket, subprocess.Popen[str]]:
    ours, theirs = socket.socketpair()
    code = textwrap.dedent(REMOVER).format(root=str(ROOT), nnp=nnp, fd=theirs.fileno(), where=str(tmp_path))
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []
    proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", code], pass_fds=(theirs.fileno(),),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    theirs.close()
    return ours, proc


def test_the_filter_hands_over_directory_removals_and_nothing_else(tmp_path: Path) -> None:
    ours, proc = _remover(tmp_path)
    with ours:
        assert select.select([ours], [], [], 30)[0], "no answer from the process"
        got = receive_listener(ours)
    assert isinstance(got, tuple), got
    listener = Listener(got[0])
    paths = []
    try:
        while True:
            assert select.select([listener], [], [], 30)[0], "the process neither removed nor ended"
            if listener.ended():
                break
            call = listener.receive()
            if call is None:
                continue
            assert call.call == "removal", call
            removal = Removal.of(call)
            try:
                paths.append(listener.path(removal))
            finally:
                listener.resume(removal)  # the kernel then runs the call as if never stopped
    finally:
        listener.close()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert paths == [b"a/b", b"a", b"absent"]
    assert out == "absent: ENOENT\n"
    assert os.listdir(tmp_path) == []  # every removal went on


def _no_new_privs() -> bool:
    status = Path("/proc/self/status").read_text()
    return "NoNewPrivs:\t1" in status


@pytest.mark.root
@pytest.mark.skipif(_no_new_privs(), reason="no_new_privs is set here (bubblewrap sets it): every filter installs")
def test_a_sandbox_that_cannot_install_the_filter_says_why(tmp_path: Path) -> None:
    """Without no_new_privs an unprivileged process may not install a filter: the guard is told
    why, and the process goes on (its removals are simply not handed over)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as where:  # tmp_path's parents are root's alone
        os.chown(where, 65534, 65534)
        ours, proc = _remover(Path(where), nnp=False, user="65534")
        with ours:
            assert select.select([ours], [], [], 30)[0], "no answer from the process"
            assert receive_listener(ours) == "seccomp: Permission denied"
        out, err = proc.communicate(timeout=30)
        assert (proc.returncode, out) == (0, "absent: ENOENT\n"), err


def test_a_sandbox_that_ends_first_is_said() -> None:
    ours, theirs = socket.socketpair()
    theirs.close()
    with ours:
        assert receive_listener(ours) == "the sandbox ended before it installed the filter"


@pytest.mark.parametrize(("path", "tree", "names"), [
    (b".venv", ".venv", True),
    (b".venv/", ".venv", True),
    (b"/work/ws/src/checkout/node_modules", "src/checkout/node_modules", True),
    (b"checkout/node_modules", "src/checkout/node_modules", True),
    (b"../checkout//node_modules", "src/checkout/node_modules", True),
    (b"src/checkout/t64/build", "src/checkout/t4/build", False),
    (b"node_modules/dep/node_modules", "src/checkout/node_modules", False),
    (b"build", ".venv", False),
    (b"..", ".venv", False),
    (b"/", ".venv", False),
])
def test_which_bound_tree_a_removal_may_name(path: bytes, tree: str, names: bool) -> None:
    assert may_name(path, tree) is names
