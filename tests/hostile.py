"""A hostile agent's script run inside a real ``guard run --ci``: the shared pieces of the
escape suites (tests/test_escapes_*.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .helpers import FIX_TAX, reports, run_events

__all__ = ["ATTEMPT", "SECRET", "SEND", "WAIT_MOUNTED", "hostile_run", "hostile_workspace"]

SECRET = "SECRET=hunter2\n"

#: The script's prelude: ``attempt(name, f)`` prints ``{name: what f returned, or the errno's name}``.
ATTEMPT = r'''
import errno, json, os, sys, time
def attempt(name, f):
    try:
        got = f()
    except OSError as err:
        got = errno.errorcode.get(err.errno, str(err.errno))
    print(json.dumps({name: got}), flush=True)
'''

#: ``send(msg)``: one message to the guard over the agent socket, as a harness sends it, and the
#: guard's reply (needs ``json``, ``os`` and ``socket``; no braces: it can go into a str.format template).
SEND = r'''
def send(msg):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ["GUARD_SOCKET"])
    s.sendall((json.dumps(dict(v=1, **msg)) + "\n").encode())
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    s.close()
    return json.loads(data)
'''

#: ``wait_mounted(path)``: wait, with a bound, until *path* is a mount point of its own (inside
#: the sandbox, a tree bound during the run); False when it never becomes one.
WAIT_MOUNTED = r'''
def mounted(path):
    return any(line.split()[4] == os.path.abspath(path) for line in open("/proc/self/mountinfo"))
def wait_mounted(path):
    deadline = time.monotonic() + 20
    while not mounted(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
'''


def hostile_workspace(tmp_path: Path) -> Path:
    """A workspace with a file in scope (src/checkout/tax.py) and a secret (.env)."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / ".env").write_text(SECRET)
    return ws


def hostile_run(tmp_path: Path, ws: Path, user: str | None, script: str, manifest: str = FIX_TAX,
                prelude: str = ATTEMPT, guard: Sequence[str] = ("-m", "sandbox"),
                ) -> tuple[dict[str, Any], list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """``guard run --ci`` the hostile *script* (after *prelude*) in *ws*, as *user* (None: the
    guard's own); what it reported, the run's events, the guard's process. *guard* is how the
    guard's interpreter is started (``-c CODE`` to start it another way)."""
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    flags: list[str] = []
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        flags = ["--user", user]
    (tmp_path / "manifest.toml").write_text(manifest)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, *guard, "run", "--ci", *flags, "--manifest", str(tmp_path / "manifest.toml"),
         "--run-dir", str(run_dir), "--", python3, "-c", prelude + textwrap.dedent(script)],
        cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    seen: dict[str, Any] = {}
    for report in reports(run_dir / "stdout.log"):
        seen.update(report)
    return seen, run_events(run_dir), proc
