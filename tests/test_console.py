"""What the human sees of a run while it goes and after: freeze or stop, a line per denial and
trip, one set of counts everywhere, guard exec's host paths, and ``guard status`` (issue 20,
items 5 and 6). Real ``guard run``s with shell and Python agents."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil
import pytest

from guardfs.accounting import WriteAccounting
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.breaker import Breaker
from sandbox.launch.console import BURST, LiveConsole
from sandbox.launch.run import RunOptions, terminal_action

from .helpers import FIX_TAX, wait_for
from .test_run import workspace

GUARD = [sys.executable, "-m", "sandbox"]


@pytest.fixture
def state() -> Iterator[Path]:
    """A state directory for default run directories (where ``guard status`` looks), with a
    short path: a control socket's path must fit in 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gcs-"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _env(state: Path, **extra: str) -> dict[str, str]:
    """The guard's environment: no CI and no GitHub (the runner's own would decide for the test),
    default run directories under *state*."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY")}
    return {**env, "XDG_STATE_HOME": str(state), **extra}


def _manifest(tmp_path: Path, text: str = FIX_TAX) -> Path:
    path = tmp_path / "guard.toml"
    path.write_text(text)
    return path


class _Lines:
    """A stream read line by line in a thread, so the test sees each line as it comes."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self._queue.put(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def seen(self, needle: str) -> bool:
        while not self._queue.empty():
            self.lines.append(self._queue.get())
        return any(needle in line for line in self.lines)

    def text(self) -> str:
        self._thread.join(timeout=30)
        self.seen("")
        return "\n".join(self.lines)


class _Pty:
    """The master side of a pty, drained in a thread (a full pty would block the guard)."""

    def __init__(self, master: int) -> None:
        self.data = b""
        self._master = master
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 4096)
            except OSError:  # EIO: every slave end is closed
                break
            if not chunk:
                break
            self.data += chunk

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    def close(self) -> None:
        self._thread.join(timeout=30)
        os.close(self._master)


def _run_dir(stderr: str) -> Path:
    found = re.search(r"guard: run directory (\S+)", stderr)
    assert found, stderr
    return Path(found.group(1))


# --- freeze or stop -------------------------------------------------------------------------

def _options(tmp_path: Path, manifest: str = FIX_TAX, ci: bool = False) -> RunOptions:
    return RunOptions(parse_manifest(manifest, "guard.toml"), tmp_path, tmp_path / "run", ["true"], tmp_path, ci=ci)


def test_freeze_only_with_a_terminal_on_stderr_and_no_ci(tmp_path: Path) -> None:
    master, slave = os.openpty()
    read, write = os.pipe()
    try:
        auto, freeze, stop = (_options(tmp_path), _options(tmp_path, FIX_TAX + '[breaker]\non_terminal = "freeze"\n'),
                              _options(tmp_path, FIX_TAX + '[breaker]\non_terminal = "stop"\n'))
        assert terminal_action(auto, {}, slave) == (False, "the guard's stderr is a terminal")
        stops, why = terminal_action(auto, {}, write)
        assert stops and "stderr is no terminal" in why and 'on_terminal = "freeze"' in why
        stops, why = terminal_action(auto, {"CI": "true"}, slave)
        assert stops and why.startswith("CI=true is set")
        assert terminal_action(auto, {"CI": "false"}, slave)[0] is False
        assert terminal_action(_options(tmp_path, ci=True), {}, slave) == (True, "--ci")
        # Asked for in the manifest: it holds without a terminal and under CI; --ci still stops.
        assert terminal_action(freeze, {"CI": "1"}, write) == (False, '[breaker] on_terminal = "freeze"')
        assert terminal_action(stop, {}, slave) == (True, '[breaker] on_terminal = "stop"')
        freeze_ci = _options(tmp_path, FIX_TAX + '[breaker]\non_terminal = "freeze"\n', ci=True)
        assert terminal_action(freeze_ci, {}, slave) == (True, "--ci")
    finally:
        for fd in (master, slave, read, write):
            os.close(fd)


#: The second spill is terminal; the marker tells this session's agents from another's.
MARKER = f"guardfs-console-test-{os.getpid()}"
SPILL_TWICE = f"echo x > README.md; echo y > NOTES.md; sleep 300  # {MARKER}"


@pytest.mark.root
@pytest.mark.mount
def test_no_terminal_no_ci_a_terminal_trip_stops_the_run(tmp_path: Path, state: Path) -> None:
    ws, _ = workspace(tmp_path)
    manifest = _manifest(tmp_path)  # the defaults: on_terminal = "auto"
    proc = subprocess.run([*GUARD, "run", "--manifest", str(manifest), "--", "bash", "-c", SPILL_TWICE],
                          cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=_env(state))
    assert proc.returncode == 75, proc.stderr
    assert "on a terminal trip the run stops (exit 75): the guard's stderr is no terminal" in proc.stderr
    assert "breaker OPEN_SCOPE_SPILL: stopping the agent" in proc.stderr
    # The summary names the path of every trip.
    assert "trips: 2 (scope_spill on README.md at step 0, scope_spill on NOTES.md at step 0)" in proc.stderr


def _decoy_runs(base: Path, ws: Path, elsewhere: Path) -> None:
    """Runs guard status must pass over: an older one of this workspace, a newer one of another."""
    for name, named, age in (("older", ws, -3600), ("other", elsewhere, 3600)):
        (base / name).mkdir(parents=True)
        (base / name / "workspace").write_text(str(named))
        (base / name / "ledger.json").write_text(json.dumps({"state": "CLOSED", "trips": []}))
        os.utime(base / name / "workspace", (time.time() + age, time.time() + age))


@pytest.mark.root
@pytest.mark.mount
def test_with_a_terminal_it_freezes_and_status_follows_it_to_the_stop(tmp_path: Path, state: Path) -> None:
    ws, _ = workspace(tmp_path)
    (ws / "src/checkout/deep").mkdir()
    manifest = _manifest(tmp_path)
    env = _env(state)
    base = state / "guardfs/runs"
    _decoy_runs(base, ws, tmp_path / "elsewhere")
    master, slave = os.openpty()
    proc = subprocess.Popen([*GUARD, "run", "--manifest", str(manifest), "--", "bash", "-c", SPILL_TWICE],
                            cwd=ws, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    console = _Pty(master)
    follow: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: "breaker OPEN_SCOPE_SPILL: the agent is frozen" in console.text(), "the freeze", timeout=60)
        text = console.text()
        assert "on a terminal trip the agent is frozen until 'guard approve' or 'guard stop'" in text
        assert "the guard's stderr is a terminal" in text
        run_dir = _run_dir(text)
        assert run_dir.parent == base
        agent = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["bash", "-c", SPILL_TWICE]]
        assert agent and all(p.status() == psutil.STATUS_STOPPED for p in agent), [p.status() for p in agent]
        # guard status, no --run-dir, from a subdirectory: the live run of this workspace.
        live = subprocess.run([*GUARD, "status"], cwd=ws / "src/checkout/deep", capture_output=True, text=True,
                              timeout=60, env=env)
        assert live.returncode == 0, live.stderr
        assert live.stdout.startswith("# guard state: OPEN_SCOPE_SPILL") and "has ended" not in live.stdout
        assert "| 0 | scope_spill | NOTES.md | OPEN_SCOPE_SPILL |" in live.stdout
        follow = subprocess.Popen([*GUARD, "status", "--follow"], cwd=ws, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        assert follow.stdout is not None
        assert follow.stdout.readline().startswith(f"following the run in {run_dir} ")
        first = follow.stdout.readline()
        assert "OPEN_SCOPE_SPILL: denials 2, trips 2; last trip: scope_spill on NOTES.md at step 0" in first
        # guard stop, no --run-dir either, from a subdirectory: the same run, named on stderr.
        stopped = subprocess.run([*GUARD, "stop"], cwd=ws / "src/checkout/deep", capture_output=True, text=True,
                                 timeout=60, env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert f"guard: run directory {run_dir} (the latest guard run of this workspace)" in stopped.stderr
        assert proc.wait(timeout=60) == 75
        rest, _err = follow.communicate(timeout=60)
        assert follow.returncode == 0, _err
        last = rest.splitlines()[-1]
        assert "the run has ended: OPEN_STOPPED" in last and str(run_dir / "ledger.json") in last
    finally:
        for p in (proc, follow):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        console.close()
    # After the end: the finished run, from its ledger, exit 0.
    ended = subprocess.run([*GUARD, "status"], cwd=ws, capture_output=True, text=True, timeout=60, env=env)
    assert ended.returncode == 0, ended.stderr
    assert f"(the run in {run_dir} has ended; this is its last ledger)" in ended.stdout
    assert "# guard state: OPEN_STOPPED" in ended.stdout
    as_json = subprocess.run([*GUARD, "status", "--json", "--run-dir", str(run_dir)], capture_output=True, text=True,
                             timeout=60, env=env)
    assert json.loads(as_json.stdout)["counts"] == {"denials": 2, "trips": 2}
    assert "has ended" in as_json.stderr


def test_status_without_a_run_of_this_workspace_says_where_it_looked(tmp_path: Path, state: Path) -> None:
    proc = subprocess.run([*GUARD, "status"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=_env(state))
    assert proc.returncode == 69
    assert f"no guard run of workspace {tmp_path} under {state}/guardfs/runs" in proc.stderr
    assert "--run-dir" in proc.stderr


# --- a line per denial and trip, as it happens -----------------------------------------------

WAIT_FOR_GO = """
    import time
    from sandbox.breaker.client import GuardClient
    try:
        open("README.md", "a").write("spill")
    except OSError as err:
        print("refused:", err.strerror, flush=True)
    with GuardClient() as guard:  # until the test, having seen the console's line, says go
        while not any(c["label"] == "go" for c in guard.status()["ledger"]["checkpoints"]):
            time.sleep(0.05)
    print("finished", flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
def test_the_console_says_each_denial_while_the_run_goes_on_in_ci_mode(tmp_path: Path, state: Path) -> None:
    ws, _ = workspace(tmp_path)
    manifest = _manifest(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*GUARD, "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
                             sys.executable, "-c", textwrap.dedent(WAIT_FOR_GO)],
                            cwd=ws, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=_env(state))
    assert proc.stderr is not None
    stderr = _Lines(proc.stderr)
    try:
        wait_for(lambda: stderr.seen("guard: denied open README.md"), "the denial's line", timeout=60)
        assert stderr.seen("guard: TRIP scope_spill on README.md at step 0")  # the first, recoverable trip
        line = next(x for x in stderr.lines if x.startswith("guard: denied open README.md"))
        assert "README.md is outside the task's scope" in line and "the agent got EROFS (Read-only file system)" in line
        assert proc.poll() is None  # the agent is still waiting: the line came while it ran
        assert "finished" not in (run_dir / "stdout.log").read_text()
        go = subprocess.run([*GUARD, "checkpoint", "--run-dir", str(run_dir), "--label", "go"], capture_output=True,
                            text=True, timeout=60)
        assert go.returncode == 0, go.stderr
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        text = stderr.text()
        proc.stderr.close()
    assert "finished" in (run_dir / "stdout.log").read_text()
    assert "denials: 1; trips: 1 (scope_spill on README.md at step 0)" in text
    # A shell agent reports no steps: the summary says the token rules judged nothing, not "0 in 0 steps".
    assert "tokens: no steps reported, so token_surge and token_velocity judged nothing" in text


# --- one set of counts ------------------------------------------------------------------------

LOOKUPS = 40
# Refused lookups of a forbidden name (no trip), a spill (a recoverable trip), back in scope,
# then two spills in a row: terminal.
MANY = f"""
    for i in $(seq {LOOKUPS}); do test -e .env; done
    echo x > README.md
    echo ok >> src/checkout/tax.py
    echo y > NOTES.md
    echo z > OTHER.md
"""
# The event log keeps almost none of the refused lookups (no violation: they are dropped
# past the caps); the counts keep them all.
TIGHT_RECORD = "[record]\nevents_per_second = 0.001\nevents_burst = 1\n"


@pytest.mark.root
@pytest.mark.mount
def test_console_ledger_report_and_github_summary_count_alike(tmp_path: Path, state: Path) -> None:
    ws, _ = workspace(tmp_path)
    manifest = _manifest(tmp_path, FIX_TAX + TIGHT_RECORD)
    run_dir = tmp_path / "run"
    summary = tmp_path / "step-summary.md"
    env = _env(state, GITHUB_ACTIONS="true", GITHUB_STEP_SUMMARY=str(summary))
    proc = subprocess.run([*GUARD, "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
                           "bash", "-c", MANY], cwd=ws, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 75, proc.stderr
    counted = re.search(r"denials: (\d+); trips: (\d+) \((.*)\)", proc.stderr)
    assert counted, proc.stderr
    denials, trips = int(counted.group(1)), int(counted.group(2))
    assert denials >= LOOKUPS + 3 and trips == 3
    assert counted.group(3) == ("scope_spill on README.md at step 0, scope_spill on NOTES.md at step 0, "
                                "scope_spill on OTHER.md at step 0")
    # The console: a line per denial up to the rate, then one saying how many were held back.
    shown = [line for line in proc.stderr.splitlines() if line.startswith("guard: denied ")]
    held = [int(m.group(1)) for m in re.finditer(r"guard: … (\d+) more denial\(s\) not shown", proc.stderr)]
    assert held and len(shown) >= BURST
    assert len(shown) + sum(held) == denials
    assert len([line for line in proc.stderr.splitlines() if line.startswith("guard: TRIP ")]) == trips
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["counts"] == {"denials": denials, "trips": trips}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert len([e for e in events if e["decision"] == "deny" and e["op"] not in ("trip", "breaker")]) < denials
    page = subprocess.run([*GUARD, "report", "--run-dir", str(run_dir), "--html", "-"], capture_output=True,
                          text=True, timeout=60)
    assert f"denials: {denials} &nbsp; trips: {trips}</p>" in page.stdout
    text = summary.read_text()
    assert f"| denials | {denials} |" in text and f"| trips | {trips} |" in text
    assert "| 0 | scope_spill | OTHER.md |" in text
    assert "::error file=README.md,line=1,title=guard%3A scope_spill trip::" in proc.stdout


def test_the_console_holds_back_past_its_rate_and_says_how_many(tmp_path: Path) -> None:
    now = [100.0]
    out = tmp_path / "console.txt"
    with open(out, "w") as f:
        console = LiveConsole(f, tmp_path, clock=lambda: now[0])
        for i in range(BURST + 25):
            console.on_event({"op": "open", "path": f"f{i}\x1b[2J", "decision": "deny", "rule": "paths.allowed",
                              "errno": "EROFS", "reason": "outside\nsecond line"})
        console.on_event({"op": "trip", "path": "", "decision": "deny", "rule": "scope_spill", "step": 2,
                          "on": "f0", "state": "OPEN_SCOPE_SPILL", "reason": "outside"})
        now[0] += 1.0
        console.on_event({"op": "open", "path": "late", "decision": "deny", "errno": "EROFS", "reason": "r"})
        console.on_event({"op": "open", "path": "ok", "decision": "allow"})
        console.close()
    lines = out.read_text().splitlines()
    assert len(lines) == BURST + 3
    assert lines[0] == ("guard: denied open f0\\x1b[2J [paths.allowed]: outside; the agent got EROFS "
                        "(Read-only file system)")  # the agent's names cannot drive the terminal
    assert lines[BURST].startswith("guard: … 25 more denial(s) not shown")  # said before the trip
    assert lines[BURST + 1].startswith("guard: TRIP scope_spill on f0 at step 2: outside -> OPEN_SCOPE_SPILL")
    assert lines[BURST + 2].startswith("guard: denied open late ")


# --- digests and guard exec -------------------------------------------------------------------

EXEC_THEN_FAIL = """
    guard exec -- sh -c 'echo building; echo "oops: the widget broke" >&2; exit 3'
    echo "exec status $?"
    echo x > README.md
"""


@pytest.mark.root
@pytest.mark.mount
def test_exec_names_host_paths_and_a_failure_digest_keeps_the_line_that_explains_it(tmp_path: Path,
                                                                                     state: Path) -> None:
    ws, _ = workspace(tmp_path)
    manifest = _manifest(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.run([*GUARD, "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
                           "bash", "-c", EXEC_THEN_FAIL], cwd=ws, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=_env(state))
    # bash's own words for the refused write are its last line, with no failure word of the
    # old list in it: the digest keeps it.
    assert proc.returncode == 1, proc.stderr
    assert "bash: line 4: README.md: Read-only file system" in proc.stdout
    log = (run_dir / "stdout.log").read_text()
    assert "exec status 3" in log
    # guard exec's digest: the failing command's last stderr line, and the logs where the host has them.
    assert "oops: the widget broke" in log
    named = re.search(rf"full log: ({re.escape(str(run_dir))}/exec/\S+\.out\.log), (\S+\.err\.log) "
                      r"\(the same names in /tmp/guard/exec/ in here\)", log)
    assert named, log
    assert Path(named.group(1)).read_text() == "building\n"
    assert Path(named.group(2)).read_text() == "oops: the widget broke\n"


@pytest.fixture(autouse=True)
def _no_leftover_agents() -> Iterator[None]:
    yield
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline"]) if MARKER in " ".join(
        p.info["cmdline"] or [])], "no agent of these tests to be left")


def test_a_hook_check_refused_is_counted_and_said_like_a_refused_operation(tmp_path: Path) -> None:
    """An agent with hooks is refused before its tool runs: no FUSE request, but one denial,
    with its path, in the same counts and on the same console."""
    events = EventLog(None)
    out = tmp_path / "console.txt"
    with open(out, "w") as f:
        events.watch(LiveConsole(f, tmp_path).on_event)
        breaker = Breaker(parse_manifest(FIX_TAX, "guard.toml"), WriteAccounting(), now=time.monotonic,
                          emit=events.emit)
        assert not breaker.check("Write", ["README.md"]).allow  # out of scope: a recoverable trip
        assert breaker.check("Read", ["README.md"], mutating=False).allow
        assert not breaker.check("Write", ["NOTES.md"]).allow  # terminal
        assert not breaker.check("Write", ["src/checkout/tax.py"]).allow  # refused while terminal
    assert events.tally == {"denials": 3, "trips": 2}
    assert [t["path"] for t in breaker.snapshot()["trips"]] == ["README.md", "NOTES.md"]
    lines = out.read_text().splitlines()
    assert lines[1].startswith("guard: denied Write call on README.md: README.md is outside the task's scope")
    assert lines[-1] == ("guard: denied Write call on src/checkout/tax.py: breaker OPEN_SCOPE_SPILL: refused until "
                         "guard approve or guard stop; the agent's hook was told so")
