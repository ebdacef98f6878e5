"""A hostile agent's moves from issue 10, all in one real ``guard run --ci``, as root and as
``--user nobody``: each is refused or handled, the guard keeps serving, the run directory
stays bounded, and the next real violation still trips and stops the run (exit 75).

LONG: about 45 s per user (100,000 socket messages and 3,000 notes answered one by one,
~19,000 descriptors, a 1,200-deep tree, 1 GiB of output). The agent is a stdlib-only script
run by the system's python3, so that ``nobody`` can run it; it reports on stderr, one JSON
line per move, because its stdout carries the 1 GiB flood.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .helpers import FIX_TAX, reports
from .test_bounds_disk import MiB, _guard_run_measured

# Each test runs guard run for real: root (as CI) and a FUSE mount.
pytestmark = [pytest.mark.root, pytest.mark.mount]


HOSTILE = r'''
import errno, json, os, resource, socket, sys, threading, time

def say(**kw):
    print(json.dumps(kw), file=sys.stderr, flush=True)

path = os.environ["GUARD_SOCKET"]

def ask(payload, s=None):
    own = s is None
    if own:
        s = socket.socket(socket.AF_UNIX); s.connect(path); s.settimeout(60)
    s.sendall(payload)
    f = s.makefile("rb")
    line = f.readline()
    if own:
        s.close()
    return json.loads(line) if line else None

def alive():
    r = ask(b'{"type":"status"}\n')
    return bool(r and r.get("ok"))

t = time.monotonic()
# 1. crash inputs
r = ask(b"[" * 50000 + b"\n")
say(phase="brackets", ok=r["ok"], error=r.get("error", "")[:120], alive=alive())
r = ask(b'{"type":"step","tokens_in":' + b"9" * 5000 + b"}\n")
say(phase="digits", ok=r["ok"], error=r.get("error", "")[:120], alive=alive())
r = ask(json.dumps({"type": "hook", "agent": "claude", "event": {"hook_event_name": "PreToolUse", "tool_name": "Edit",
        "cwd": os.getcwd(), "tool_input": {"edits": 5}}}).encode() + b"\n")
say(phase="hook_edits5", reply={k: (str(v)[:160]) for k, v in r.items()}, alive=alive())
# 2. a name that is not UTF-8
try:
    os.close(os.open(b"src/checkout/\xff", os.O_CREAT | os.O_WRONLY, 0o644)); res = "created"
except OSError as e:
    res = f"errno {e.errno}"
say(phase="touch_xff", result=res, alive=alive())
# 3. a 1,200-deep tree, renamed
fd = os.open("src/checkout", os.O_RDONLY | os.O_DIRECTORY)
os.mkdir("deep", dir_fd=fd); cur = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
for _ in range(1200):
    os.mkdir("d", dir_fd=cur); nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur); os.close(cur); cur = nxt
os.close(os.open("leaf.py", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=cur)); os.close(cur)
t0 = time.monotonic()
try:
    os.rename("deep", "deep2", src_dir_fd=fd, dst_dir_fd=fd); res = "renamed"
except OSError as e:
    res = f"errno {e.errno}"
say(phase="deep_rename", result=res, seconds=round(time.monotonic() - t0, 2), alive=alive())
os.close(fd)
# 4. ~20,000 open files through the mount
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, err = [], None
while len(held) < 20000:
    try:
        held.append(os.open("src/checkout/tax.py", os.O_RDONLY))
    except OSError as e:
        err = errno.errorcode.get(e.errno); break
for h in held:
    os.close(h)
n = len(held); held = []
say(phase="open_20000", opened=n, stopped_by=err, hard=hard, alive=alive())
# after: an in-scope write still works (the ledger/event log kept their reserve)
with open("src/checkout/tax.py", "a") as f:
    f.write("# after the fd flood\n")
say(phase="write_after_fds", ok=True)
# 5. 100,000 invalid socket messages on one connection
s = socket.socket(socket.AF_UNIX); s.connect(path)
def send():
    for _ in range(100):
        s.sendall(b"this is not json\n" * 1000)
th = threading.Thread(target=send); th.start()
f = s.makefile("rb"); errs = 0; last = None
for _ in range(100000):
    line = f.readline()
    if not line:
        break
    last = json.loads(line); errs += not last["ok"]
th.join(); s.close()
say(phase="invalid_100k", error_replies=errs, last=str(last)[:120], alive=alive())
# 6. 3,000 notes of 4,000 chars
s = socket.socket(socket.AF_UNIX); s.connect(path); f = s.makefile("rb"); oks = 0
for i in range(3000):
    s.sendall(json.dumps({"type": "note", "text": f"note {i} " + "n" * 3990}).encode() + b"\n")
    oks += json.loads(f.readline())["ok"]
s.close()
say(phase="notes_3000", ok_replies=oks, alive=alive())
# 7. append one byte to a 2 GiB sparse file; meanwhile time other requests
lat, done = [], threading.Event()
def other():
    while not done.is_set():
        t0 = time.monotonic()
        os.stat("src/checkout/tax.py")
        open("README.md").read()
        lat.append(time.monotonic() - t0)
th = threading.Thread(target=other); th.start()
t0 = time.monotonic()
try:
    with open("src/checkout/big.bin", "ab") as b:
        b.write(b"x")
    res = "appended"
except OSError as e:
    res = f"errno {e.errno}"
took = time.monotonic() - t0
time.sleep(0.5); done.set(); th.join()
say(phase="sparse_2g", result=res, append_seconds=round(took, 2), other_requests=len(lat),
    other_max_s=round(max(lat), 3), alive=alive())
say(phase="elapsed", seconds=round(time.monotonic() - t, 1))
# 8. 1 GiB on stdout without a newline
chunk = b"a" * (1 << 20)
t0 = time.monotonic()
for _ in range(1024):
    os.write(1, chunk)
say(phase="flood_1g", seconds=round(time.monotonic() - t0, 1), alive=alive())
# 9. the next real violation still trips; a terminal trip stops us (--ci)
for target in ("README.md", "src/other.py"):
    try:
        with open(target, "a") as f:
            f.write("x\n")
        say(phase="violation", target=target, result="WRITTEN")
    except OSError as e:
        say(phase="violation", target=target, result=f"errno {e.errno}")
r = ask(b'{"type":"step","tokens_in":10}\n'); say(phase="step_after", reply=str(r)[:200])
say(phase="ran on after the trips")
sys.exit(3)
'''


def moves(stderr_log: Path) -> dict[str, dict[str, Any]]:
    """The agent's report: one JSON object per move, by phase."""
    out: dict[str, dict[str, Any]] = {}
    for report in reports(stderr_log):
        out.setdefault(report["phase"], report)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_hostile_agent_inside_a_real_run(tmp_path: Path, user: str | None) -> None:
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "README.md").write_text("readme\n")
    with open(ws / "src/checkout/big.bin", "wb") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    flags = []
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        flags = ["--user", user]
    manifest = tmp_path / "manifest.toml"
    # The flood of 100,000 invalid messages must pass the event rate however slowly a loaded machine
    # sends it: at 50 events a second a sender would need over half an hour to stay under it.
    manifest.write_text(FIX_TAX + "[record]\nevents_per_second = 50.0\nevents_burst = 1000\n")
    run_dir = tmp_path / "run"
    try:
        status, peak, _out, err = _guard_run_measured(
            ["run", "--ci", *flags, "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
             python3, "-c", HOSTILE], ws, tmp_path, timeout=600)
        check_run(ws, run_dir, status, peak, err)
    finally:
        # pytest's own cleanup of tmp_path recurses on depth (shutil.rmtree): GNU rm does not.
        subprocess.run(["rm", "-rf", str(ws / "src/checkout/deep"), str(ws / "src/checkout/deep2")], check=True)


def check_run(ws: Path, run_dir: Path, status: int, peak: int, err: str) -> None:
    """Every move handled, the guard served on, and the run stopped by the last violation."""
    got = moves(run_dir / "stderr.log")
    assert status == 75, (err[-3000:], got)  # stopped by the trip; not 70 (a crash), not the agent's 3
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    check_inputs_names_depth_descriptors(got, ws, run_dir, err)
    check_bounded_records_and_output(got, ws, run_dir, err, peak)
    # The next real violations: the first refused (EROFS) and recoverable, the second stops the agent.
    assert got["violation"] == {"phase": "violation", "target": "README.md", "result": "errno 30"}
    assert "step_after" not in got and (ws / "README.md").read_text() == "readme\n"
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["state"] == "OPEN_SCOPE_SPILL", ledger["state"]
    assert [t["rule"] for t in ledger["trips"]] == ["scope_spill", "scope_spill"]


def check_inputs_names_depth_descriptors(got: dict[str, dict[str, Any]], ws: Path, run_dir: Path, err: str) -> None:
    """The crash inputs, the name that is not UTF-8, the deep tree and the descriptor flood."""
    # Each crash input of issue 10 got an error reply, and the guard kept serving.
    assert not got["brackets"]["ok"] and "nested 50000 levels deep" in got["brackets"]["error"]
    assert not got["digits"]["ok"] and "5000 digits" in got["digits"]["error"]
    hook = got["hook_edits5"]["reply"]
    assert hook["exit"] == "2" and "tool_input.edits must be an array" in hook["stderr"], hook
    assert all(m["alive"] for m in got.values() if "alive" in m), got
    # A name that is not UTF-8 is made, and written escaped (lossless, no markdown injection).
    assert got["touch_xff"]["result"] == "created"
    assert os.path.exists(os.fsencode(ws / "src/checkout") + b"/\xff")
    events_text = (run_dir / "events.jsonl").read_text()
    assert '"path":"src/checkout/\\\\xff"' in events_text
    # (A file only created holds no content yet: a mutated file, no rewrite — issue 20's size-only rule.)
    assert "| src/checkout/\\xff | 0 |" in (run_dir / "STATE.md").read_text()
    # The 1,200-deep tree was renamed, no recursion on its depth.
    assert got["deep_rename"]["result"] == "renamed"
    assert (ws / "src/checkout/deep2/d").is_dir() and not (ws / "src/checkout/deep").exists()
    # ~20,000 opens: refused with an errno before the guard ran out, then served again.
    assert got["open_20000"]["stopped_by"] in {"ENFILE", "EMFILE"} and got["open_20000"]["opened"] > 10_000
    assert "descriptors available again" in err
    assert got["write_after_fds"]["ok"] and "# after the fd flood" in (ws / "src/checkout/tax.py").read_text()


def check_bounded_records_and_output(got: dict[str, dict[str, Any]], ws: Path, run_dir: Path, err: str,
                                     peak: int) -> None:
    """Floods of messages and notes, the sparse file and the output: all bounded."""
    events_text = (run_dir / "events.jsonl").read_text()
    # 100,000 invalid messages: each answered with an error; the event log bounded and every one counted.
    assert got["invalid_100k"]["error_replies"] == 100_000
    events = [json.loads(line) for line in events_text.splitlines()]
    kept = sum(e["op"] == "protocol" for e in events)
    dropped = sum(e["kinds"].get("protocol", 0) for e in events if e["op"] == "dropped")
    assert kept + dropped >= 100_000 and dropped > 0, (kept, dropped)
    assert (run_dir / "events.jsonl").stat().st_size < 16 * MiB  # 59 MB before issue 10
    # 3,000 notes of 4,000 characters: accepted, and the ledger and STATE.md stay small (12 MB each before).
    assert got["notes_3000"]["ok_replies"] == 3000
    assert (run_dir / "ledger.json").stat().st_size < MiB and (run_dir / "STATE.md").stat().st_size < MiB
    # Nobody but the guard may rewrite the run's verdict.
    assert not (run_dir / "ledger.json").stat().st_mode & 0o022
    # A byte appended to a 2 GiB sparse file: done, and other requests meanwhile under 2 s each.
    sparse = got["sparse_2g"]
    assert sparse["result"] == "appended" and sparse["other_max_s"] < 2.0, sparse
    assert (ws / "src/checkout/big.bin").stat().st_size == (2 << 30) + 1
    # 1 GiB without a newline: stdout.log capped at its default (64 MiB), the guard small.
    assert got["flood_1g"]["alive"]
    assert (run_dir / "stdout.log").stat().st_size < 64 * MiB + 4096
    assert "output capped: stdout.log: 1073741824 bytes printed" in err
    assert peak < 300 * MiB, f"the guard's peak RSS was {peak // MiB} MiB"


DISTINCT_CALLS = r'''
import json, os, socket
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["GUARD_SOCKET"])
replies = s.makefile("rb")
ok = 0
for i in range(600):  # 600 distinct Bash calls of 1 MiB each (a hook event may carry 4 MiB)
    s.sendall(json.dumps({"type": "check", "tool": "Bash", "mutating": False,
                          "args": {"command": f"{i} " + "x" * (1 << 20)}}).encode() + b"\n")
    ok += json.loads(replies.readline())["ok"]
print("answered", ok, flush=True)
'''


def test_distinct_tool_calls_do_not_grow_the_guard(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(FIX_TAX)
    run_dir = tmp_path / "run"
    status, peak, _out, err = _guard_run_measured(
        ["run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         "python3", "-c", DISTINCT_CALLS], ws, tmp_path)
    assert status == 0 and "answered 600" in (run_dir / "stdout.log").read_text(), err
    # Kept whole, the calls took ~1.2 GiB; measured here ~52 MiB alone, ~210 MiB once on a
    # loaded machine (the allocator's arenas): the bound says "does not grow with the calls".
    assert peak < 256 * MiB, f"the guard's peak RSS was {peak // MiB} MiB after 600 MiB of distinct calls"
