"""Descriptor exhaustion through the mount: refused with an errno, and the guard keeps working."""

from __future__ import annotations

import errno
import json
import resource
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from guardfs import fusereply
from guardfs.fs import FD_RESERVE

from .helpers import wait_for
from .mounts import guarded_mount

pytestmark = pytest.mark.mount

# Opens one file through the mount until refused, says how many and why, then holds them
# all until its stdin closes. A child of its own: the test process (which serves the mount
# in a thread) has the same descriptor limit and holds the guard's side of each open.
HOLDER = """
import os, sys
fds = []
while True:
    try:
        fds.append(os.open(sys.argv[1], os.O_RDONLY))
    except OSError as err:
        print(len(fds), err.errno, flush=True)
        break
sys.stdin.read()
"""


def _trips(events: list[dict[str, object]]) -> list[object]:
    return [e["rule"] for e in events if e["op"] == "trip"]


def _errno_of(action: Callable[[], object]) -> int:
    """The errno *action* fails with (it must fail)."""
    with pytest.raises(OSError) as info:
        action()
    return info.value.errno or 0


def test_open_files_until_refused_then_the_guard_still_works(tmp_path: Path) -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft > 1 << 16:
        pytest.skip(f"RLIMIT_NOFILE is {soft}: exhausting it would take too long here")
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "backing/work").mkdir(parents=True)
    (tmp_path / "backing/work/f").write_text("data\n")
    with guarded_mount(tmp_path, run_dir=run) as g:
        assert g.daemon is not None
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(g.mnt / "work/f")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdin is not None
            count, err = map(int, holder.stdout.readline().split())
            # Refused by the guard, at its reserve, long before the holder's own limit.
            assert err == errno.ENFILE
            assert soft - FD_RESERVE - 100 < count < soft - FD_RESERVE
            # Refused the same way in this process: a read-only open and a create in scope.
            assert _errno_of((g.mnt / "work/f").read_text) == errno.ENFILE
            assert _errno_of(lambda: (g.mnt / "work/new").write_text("x\n")) == errno.ENFILE
            # A listing holds none of the guard's descriptors (read by inode: opened and closed
            # within the request, guardfs.fusereply), so it is still served.
            assert fusereply.dirs_by_inode()
            assert [p.name for p in (g.mnt / "work").iterdir()] == ["f"]
            # The reserve: a violation is judged, recorded and trips; the ledger is written.
            assert _errno_of(lambda: (g.mnt / "README.md").write_text("out of scope\n")) == errno.EROFS
            assert _trips(g.events()) == ["scope_spill"]
            ledger = run / "ledger.json"
            wait_for(lambda: json.loads(ledger.read_text())["state"] != "CLOSED", "the ledger to record the trip")
            # ...and the control socket answers.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as control:
                control.connect(str(g.daemon.control_path))
                control.sendall(b'{"type": "approve"}\n')
                with control.makefile() as answers:
                    reply = json.loads(answers.readline())
            assert reply["state"] == "CLOSED"
            holder.stdin.close()
            assert holder.wait(timeout=60) == 0
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
            assert holder.stdout is not None
            holder.stdout.close()
        # Once the files are closed, the mount serves opens again.
        wait_for(lambda: not g.fs._files, "the holder's files to be released")
        (g.mnt / "work/new").write_text("x\n")
        assert (g.mnt / "work/f").read_text() == "data\n"
        with pytest.raises(OSError) as info:
            (g.mnt / "README.md").write_text("out of scope\n")
        assert info.value.errno == errno.EROFS
        assert _trips(g.events()) == ["scope_spill", "scope_spill"]
