"""The guard's life and the agent's: long idle sessions, death with the guard, the host's
mounts, a guard that fails. Real ``guard run``, real bubblewrap, real signals.

Two tests here take long on purpose: an agent idle for 15 s, and one running 120 s with
idle gaps (``test_long_..._120s``): the agent used to be SIGKILLed 10 s into any run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from .helpers import FIX_TAX, wait_for

pytestmark = [pytest.mark.mount, pytest.mark.root]


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    """A small repository and a manifest for it."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(FIX_TAX)
    return ws, manifest


def guard_argv(manifest: Path, run_dir: Path, *agent: str) -> list[str]:
    """``guard run --ci`` of *agent*."""
    return [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
            "--", *agent]


def python_agent(script: str, marker: str) -> list[str]:
    """A Python script as the agent; *marker* in its command line finds its processes."""
    return [sys.executable, "-c", textwrap.dedent(script) + f"# {marker}"]


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds *marker* (bubblewrap's and the agent's)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def host_mounts() -> str:
    """The mount table of this (the host's) namespace. Tests look for their own paths in it
    only: other guards may be running on this machine."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return f.read()


def reap_killed_guard(guard: subprocess.Popen[bytes], marker: str) -> None:
    """After a test killed the guard with SIGKILL: make sure it and every process of its run
    (found by *marker*) are gone, whatever the test saw, and that SIGKILL is what ended it."""
    guard.kill()
    guard.wait(timeout=30)
    for p in processes_with(marker):
        p.kill()
    assert guard.returncode == -signal.SIGKILL


def log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


@pytest.mark.slow
def test_an_agent_idle_for_15s_survives_and_its_status_passes_through(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        guard_argv(manifest, run_dir, "sh", "-c", "sleep 15; echo '# after 15 s' >> src/checkout/tax.py; exit 3"),
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 3, result.stderr
    assert (ws / "src/checkout/tax.py").read_text().endswith("# after 15 s\n")
    assert "exit status: 3" in result.stderr


@pytest.mark.slow
def test_long_agent_with_idle_gaps_survives_120s(tmp_path: Path) -> None:
    """LONG (120 s): a session with quiet gaps of 15 to 30 s between in-scope writes."""
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    script = """
        import sys, time
        for i, gap in enumerate([15, 30, 20, 25, 30]):
            time.sleep(gap)
            with open(f"src/checkout/step{i}.py", "w") as f:  # one file each: within max_rewrites
                f.write(f"# edit {i} after a {gap} s gap\\n")
            print("edit", i, flush=True)
        sys.exit(3)
    """
    result = subprocess.run(
        guard_argv(manifest, run_dir, *python_agent(script, "guardfs-long-session")),
        cwd=ws, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 3, result.stderr
    for i, gap in enumerate([15, 30, 20, 25, 30]):
        assert (ws / f"src/checkout/step{i}.py").read_text() == f"# edit {i} after a {gap} s gap\n"
    assert (run_dir / "stdout.log").read_text().splitlines() == [f"edit {i}" for i in range(5)]


def test_sigkill_of_the_guard_ends_an_idle_agent_within_2s_and_leaves_no_mount(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    marker = "guardfs-lifecycle-kill9"
    # Idle past trio's thread-cache timeout (10 s) first: the agent must by then be bound
    # to the guard's process, no longer to the thread that forked it.
    script = """
        import time
        time.sleep(11)
        print("idle for 11 s", flush=True)
        time.sleep(600)
    """
    guard = subprocess.Popen(guard_argv(manifest, run_dir, *python_agent(script, marker)), cwd=ws,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: log_has(run_dir / "stdout.log", "idle for 11 s"), "the agent's idle time", timeout=60)
        assert processes_with(marker)
        guard.send_signal(signal.SIGKILL)
        wait_for(lambda: not processes_with(marker), "the agent's tree to die with the guard", timeout=2.0)
    finally:
        reap_killed_guard(guard, marker)
    assert str(tmp_path) not in host_mounts()


def test_a_host_unmount_during_a_run_reaches_the_run(tmp_path: Path) -> None:
    """A mount of the host unmounted while a run is active is gone from the run's namespace
    (the guard's and the agent's), and nothing the run mounts shows on the host."""
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    # Propagation goes by the parent mount: the host's mount sits on a shared parent, as
    # every mount does on a systemd host (this machine's / may well be private).
    parent = tmp_path / "host"
    host = parent / "mnt"
    host.mkdir(parents=True)
    source = f"lifecycle-host-{os.getpid()}"
    subprocess.run(["mount", "--bind", str(parent), str(parent)], check=True)
    mounted = [parent]
    subprocess.run(["mount", "--make-shared", str(parent)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", source, str(host)], check=True)
    mounted.append(host)
    marker = "guardfs-lifecycle-propagation"
    script = """
        import signal, sys
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        print("ready", flush=True)
        signal.sigwait({signal.SIGUSR1})
        sys.exit(3)
    """
    guard = subprocess.Popen(guard_argv(manifest, run_dir, *python_agent(script, marker)), cwd=ws,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        wait_for(lambda: log_has(run_dir / "stdout.log", "ready"), "the agent to start")
        agent = next(p for p in processes_with(marker) if p.cmdline()[1:2] == ["-c"])  # not bwrap, not the guard
        views = {"guard": Path(f"/proc/{guard.pid}/mountinfo"), "agent": Path(f"/proc/{agent.pid}/mountinfo")}
        for name, view in views.items():
            assert source in view.read_text(), f"the {name} never saw the host's mount"
        on_host = host_mounts()
        assert str(run_dir) not in on_host and str(ws) not in on_host  # the guard's mount, the agent's binds
        subprocess.run(["umount", str(host)], check=True)
        mounted.remove(host)
        for name, view in views.items():
            wait_for(lambda v=view: source not in v.read_text(), f"the host's unmount to reach the {name}",  # type: ignore[misc]
                     timeout=5)
        agent.send_signal(signal.SIGUSR1)
        _out, err = guard.communicate(timeout=60)
    finally:
        if guard.poll() is None:
            guard.kill()
            guard.communicate()
        for path in reversed(mounted):
            subprocess.run(["umount", "-l", str(path)], check=False)
    assert guard.returncode == 3, err
    assert str(run_dir) not in host_mounts() and str(ws) not in host_mounts()


#: Faults injected into a real guard (a mock, since a guard without defects cannot be made
#: to fail for real): each raises where no handler of ours expects an exception.
FAULTS = {
    "fuse handler": """
        from guardfs.fs import GuardFS
        real = GuardFS.mkdir
        async def mkdir(self, parent, name, mode, ctx):
            if name == b"inject-fault":
                raise RuntimeError("injected fault")
            return await real(self, parent, name, mode, ctx)
        GuardFS.mkdir = mkdir
    """,
    "daemon": """
        from sandbox.breaker import Breaker
        real = Breaker.tick
        def tick(self):
            if self.snapshot()["steps"]:
                raise RuntimeError("injected fault")
            return real(self)
        Breaker.tick = tick
    """,
    "pump": """
        from sandbox.launch.quarantine import Recorder
        real = Recorder.feed
        def feed(self, data):
            if b"inject-fault" in data:
                raise RuntimeError("injected fault")
            return real(self, data)
        Recorder.feed = feed
    """,
}

#: What the agent does to set each fault off; then it would sleep for 10 minutes.
TRIGGERS = {
    "fuse handler": "os.mkdir('src/checkout/inject-fault')",
    "daemon": ("from sandbox.breaker.client import GuardClient; "
               "GuardClient().__enter__().step(tokens_in=1, tokens_out=1)"),
    "pump": "print('inject-fault', flush=True)",
}


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_a_defect_of_the_guard_is_recorded_and_stops_the_agent(tmp_path: Path, where: str) -> None:
    ws, manifest = workspace(tmp_path)
    run_dir = tmp_path / "run"
    marker = f"guardfs-lifecycle-fault-{where.replace(' ', '-')}"
    agent = f"""
        import os, time
        with open("src/checkout/tax.py", "a") as f:
            f.write("# before the fault\\n")
        {TRIGGERS[where]}
        time.sleep(600)
    """
    guard = textwrap.dedent(FAULTS[where]) + "import sys\nfrom sandbox.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    result = subprocess.run(
        [sys.executable, "-c", guard, *guard_argv(manifest, run_dir, *python_agent(agent, marker))[3:]],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 70, result.stderr
    assert not processes_with(marker), "the agent outlived its guard's failure"
    traceback_path = run_dir / "guard-error.log"
    assert "RuntimeError: injected fault" in traceback_path.read_text()
    assert f"GUARD FAILED: internal error (RuntimeError); the agent was stopped; traceback in {traceback_path}" \
        in result.stderr
    assert "the guard failed (internal error" in result.stdout  # the --ci digest
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["guard_failure"]["traceback"] == str(traceback_path)
    assert ledger["guard_failure"]["error"] == "RuntimeError"
    state = (run_dir / "STATE.md").read_text()
    assert state.startswith("# guard state: GUARD FAILED (internal error; the breaker was CLOSED)"), state[:200]
    assert str(traceback_path) in state
    assert (ws / "src/checkout/tax.py").read_text().endswith("# before the fault\n")  # nothing lost before
    assert str(tmp_path) not in host_mounts()
