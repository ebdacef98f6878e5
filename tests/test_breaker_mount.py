"""End to end: a process writing through the mount and a client on the socket drive one
breaker; the CLI steers it over the control socket."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.breaker.client import GuardClient
from sandbox.breaker.ledger import render_state

from .helpers import FIX_TAX, state_of, wait_for
from .mounts import guarded_mount

pytestmark = pytest.mark.mount


MANIFEST = FIX_TAX + "[limits]\nmax_window_tokens = 30000\n"


def guard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=60)


def test_token_surge_on_the_socket_refuses_the_next_write_through_the_mount(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    run_dir = tmp_path / "run"
    with guarded_mount(tmp_path, MANIFEST, run_dir=run_dir) as g:
        assert g.daemon is not None
        code = g.mnt / "src/checkout"
        (code / "tax.py").write_text("def total(x):\n    return x\n")  # in scope: fine
        with GuardClient(g.daemon.agent_path) as agent:
            assert agent.hello("test")["allow"]
            assert agent.step(tokens_in=12000, tokens_out=3000)["allow"]
            reply = agent.step(tokens_in=14000, tokens_out=2000)  # 31,000 in the window
        assert reply["allow"] is False and reply["trip"]["rule"] == "token_surge"
        with pytest.raises(OSError) as info:
            (code / "tax.py").write_text("def total(x):\n    return max(0, x)\n")
        assert info.value.errno == errno.EDQUOT
        assert (g.backing / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"
        state = (g.mnt / ".guard/STATE.md").read_text()
        assert "# guard state: HALF_OPEN_REANCHOR" in state
        assert "token_surge" in state and "31000 tokens in the last 2 steps" in state
        # The feedback has been delivered; an in-scope write closes the breaker.
        (code / "tax.py").write_text("def total(x):\n    return max(0, x)\n")
        assert "# guard state: CLOSED" in (g.mnt / ".guard/STATE.md").read_text()
        events = g.events()
        assert any(e["op"] == "trip" and e["rule"] == "token_surge" for e in events)
        wait_for(lambda: "token_surge" in (run_dir / "STATE.md").read_text(), "the run dir's STATE.md")


def test_half_open_then_terminal_then_approve_from_the_cli(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    (tmp_path / "backing/README.md").write_text("readme\n")
    run_dir = tmp_path / "run"
    with guarded_mount(tmp_path, MANIFEST, run_dir=run_dir) as g:
        assert g.daemon is not None
        breaker = g.daemon.breaker
        with pytest.raises(OSError) as info:
            (g.mnt / "README.md").write_text("spill")
        assert info.value.errno == errno.EROFS
        assert state_of(breaker).value == "HALF_OPEN_REANCHOR"
        (g.mnt / "src/checkout/a.py").write_text("a = 1\n")  # back in scope, progress
        assert state_of(breaker).value == "CLOSED"
        for name in ("README.md", "NOTES.md"):  # spill, then another while HALF_OPEN: terminal
            with pytest.raises(OSError):
                (g.mnt / name).write_text("spill")
        assert state_of(breaker).value == "OPEN_SCOPE_SPILL"
        with pytest.raises(OSError) as info:
            (g.mnt / "src/checkout/b.py").write_text("b = 1\n")
        assert info.value.errno == errno.EDQUOT
        status = guard("status", "--run-dir", str(run_dir))
        assert status.returncode == 0 and "# guard state: OPEN_SCOPE_SPILL" in status.stdout
        approved = guard("approve", "--run-dir", str(run_dir))
        assert approved.returncode == 0, approved.stderr
        assert "state: CLOSED" in approved.stdout
        (g.mnt / "src/checkout/b.py").write_text("b = 1\n")
        assert (g.backing / "src/checkout/b.py").read_text() == "b = 1\n"
        ledger = json.loads(guard("status", "--run-dir", str(run_dir), "--json").stdout)
        assert [t["rule"] for t in ledger["trips"]] == ["scope_spill", "scope_spill", "scope_spill"]
        assert render_state(ledger).startswith("# guard state: CLOSED")


def test_guard_mount_with_run_dir_stops_with_75_and_leaves_nothing(tmp_path: Path) -> None:
    backing, mnt, run_dir = tmp_path / "backing", tmp_path / "mnt", tmp_path / "run"
    backing.mkdir()
    mnt.mkdir()
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "mount", "--manifest", str(manifest), "--run-dir", str(run_dir),
         str(backing), str(mnt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: os.path.ismount(mnt) or proc.poll() is not None, "the mount")
        assert (run_dir / "agent.sock").exists()
        assert (run_dir / "control.sock").stat().st_mode & 0o777 == 0o600
        feed = subprocess.run(
            [sys.executable, "-m", "sandbox", "feed"], input='{"type":"hello"}\n{"type":"note","text":"rounding ok"}\n',
            capture_output=True, text=True, env={**os.environ, "GUARD_SOCKET": str(run_dir / "agent.sock")},
            timeout=60,
        )
        assert feed.returncode == 0, feed.stderr
        assert [json.loads(line)["ok"] for line in feed.stdout.splitlines()] == [True, True]
        rejected = subprocess.run(
            [sys.executable, "-m", "sandbox", "feed", "--socket", str(run_dir / "agent.sock")],
            input='{"type":"approve"}\n', capture_output=True, text=True, timeout=60,
        )
        assert rejected.returncode == 65 and "never approve" in rejected.stdout
        assert guard("stop", "--run-dir", str(run_dir)).returncode == 0
        assert proc.wait(timeout=30) == 75
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert not os.path.ismount(mnt)
    assert not (run_dir / "agent.sock").exists() and not (run_dir / "control.sock").exists()
    assert "rounding ok" in (run_dir / "STATE.md").read_text()
    ended = guard("status", "--run-dir", str(run_dir))  # the guard is gone: its last ledger
    assert ended.returncode == 0 and "has ended" in ended.stdout and "# guard state: OPEN_STOPPED" in ended.stdout
