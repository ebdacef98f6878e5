"""Bounds on what the agent makes the guard record: the event log (size and rate), notes
and the ledger, and names of any bytes everywhere the guard writes them.

Real mounts, a real daemon and real sockets; the caps are set low in the manifest so a
test fills them in a fraction of a second.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from guardfs.decision import ERRNO_LIMIT
from guardfs.events import EventLog, escape_name, printable, unescape
from guardfs.manifest import Record
from sandbox.breaker.client import GuardClient

from .helpers import FIX_TAX, FORBIDDEN_TERMINAL, wait_for
from .mounts import CHECKOUT_MANIFEST, Guarded, guarded_mount

INVALID = 2000  # malformed lines sent on the agent socket: a flood of droppable events


def flood_invalid(sock_path: Path, n: int) -> None:
    """Send *n* malformed lines on the agent socket and read every error reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        s.settimeout(20)
        s.sendall(b"this is not json\n" * n)
        got = b""
        while got.count(b"\n") < n:
            chunk = s.recv(65536)
            assert chunk, "the daemon closed the connection before answering every line"
            got += chunk
    replies = [json.loads(line) for line in got.splitlines()]
    assert len(replies) == n and not any(r["ok"] for r in replies)


def refused(action: Any) -> int:
    """Run *action*, which the guard must refuse; its errno."""
    with pytest.raises(OSError) as info:
        action()
    assert info.value.errno is not None
    return info.value.errno


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="ascii").splitlines()]


def assert_flood_accounted(events: list[dict[str, Any]], denied: list[str]) -> dict[str, int]:
    """Every protocol event was written or counted as dropped; every denial and trip is there."""
    dropped_lines = [e for e in events if e["op"] == "dropped"]
    assert dropped_lines, "no 'dropped' line although the cap was passed"
    dropped = sum(e["kinds"].get("protocol", 0) for e in dropped_lines)
    written = sum(1 for e in events if e["op"] == "protocol")
    assert dropped > 0 and written + dropped == 2 * INVALID  # nothing lost silently
    assert all(e["count"] == sum(e["kinds"].values()) and set(e["kinds"]) == {"protocol"} for e in dropped_lines)
    denials = {e["path"] for e in events if e["decision"] == "deny" and e["op"] != "protocol"}
    missing = [p for p in denied if p not in denials]
    assert not missing, f"denials dropped from the event log: {missing}"
    trips = [e["rule"] for e in events if e["op"] == "trip"]
    assert trips == ["forbidden_path"], trips  # after the first flood; terminal, so the only one
    return {cap: n for e in dropped_lines for cap, n in e["caps"].items()}


def violate(mnt: Path, round_: int, denied: list[str]) -> None:
    """Denials through the mount: in round 0 a forbidden read (trips forbidden_path,
    terminal), then out-of-scope creates. Each denied path is recorded in *denied*."""
    if round_ == 0:
        assert refused((mnt / ".env").read_text) == errno.EACCES
        denied.append(".env")
    for i in range(5):
        name = f"docs/out-{round_}-{i}.md"
        assert refused(lambda n=name: (mnt / n).write_text("x")) in (errno.EROFS, errno.EACCES, errno.EPERM)
        denied.append(name)


def flood_between_violations(g: Guarded, denied: list[str]) -> None:
    """Invalid socket messages by the thousand, each flood followed by real violations."""
    assert g.daemon is not None
    (g.backing / "docs").mkdir()
    (g.backing / ".env").write_text("SECRET=1\n")
    for round_ in (0, 1):
        flood_invalid(g.daemon.agent_path, INVALID)
        violate(g.mnt, round_, denied)


@pytest.mark.mount
def test_event_rate_cap_drops_the_flood_and_keeps_every_denial(tmp_path: Path) -> None:
    manifest = CHECKOUT_MANIFEST + FORBIDDEN_TERMINAL + "[record]\nevents_per_second = 1\nevents_burst = 50\n"
    denied: list[str] = []
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run") as g:
        flood_between_violations(g, denied)
        # The breaker still works: a terminal trip refuses even an in-scope write now.
        assert refused(lambda: (g.mnt / "src/checkout").mkdir(parents=True)) == ERRNO_LIMIT
    events = read_events(g.events_path)  # closed: the last 'dropped' line is written
    caps = assert_flood_accounted(events, denied)
    assert caps == {"events_per_second": 1.0}


@pytest.mark.mount
def test_event_size_cap_stops_the_file_growing_but_not_denials(tmp_path: Path) -> None:
    cap = 8192
    manifest = CHECKOUT_MANIFEST + FORBIDDEN_TERMINAL + f"[record]\nevents_max_bytes = {cap}\n"
    denied: list[str] = []
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run") as g:
        flood_between_violations(g, denied)
    events = read_events(g.events_path)
    assert assert_flood_accounted(events, denied) == {"events_max_bytes": cap}
    # Past the cap only what is never dropped was written: denials, trips, 'dropped' lines;
    # what can be dropped takes no more than the cap (plus the one line that crossed it).
    size = droppable = 0
    for line in g.events_path.read_bytes().splitlines(keepends=True):
        event = json.loads(line)
        kept = event["op"] in ("dropped", "trip") or (event["decision"] == "deny" and event["op"] != "protocol")
        assert kept or size < cap, event
        droppable += 0 if kept else len(line)
        size += len(line)
    assert droppable < cap + 1000


def test_dropped_line_written_at_close_and_counts_survive(tmp_path: Path) -> None:
    """The order of 'dropped' lines (before the next written event once a second has passed
    since the first drop, and at close: never one per kept event) and the run's totals, on a
    hand-moved clock."""
    clock = [100.0]
    log = EventLog(tmp_path / "e.jsonl", clock=lambda: clock[0], caps=Record(events_per_second=1, events_burst=3))
    for _ in range(10):
        log.emit("note", "", "allow", kind="note")
    log.emit("open", "src/\udcff", "deny", rule="paths.forbidden")  # within the second: no line yet
    clock[0] += 0.5
    log.emit("open", "src/a", "deny", rule="paths.forbidden")
    clock[0] += 0.6  # a second since the first drop: the count goes out before the next event
    log.emit("open", "src/b", "deny", rule="paths.forbidden")
    for _ in range(4):
        log.emit("hello", "", "allow")
    log.close()
    events = read_events(tmp_path / "e.jsonl")
    # the bucket refilled one token in that second: one hello is written, three are dropped
    assert [e["op"] for e in events] == ["note"] * 3 + ["open", "open", "dropped", "open", "hello", "dropped"]
    assert events[5]["kinds"] == {"note": 7} and events[8]["kinds"] == {"hello": 3}
    assert events[3]["path"] == "src/\\xff" and unescape(events[3]["path"]) == b"src/\xff"
    assert log.dropped == {"note": 7, "hello": 3}
    assert log.counts["deny"] == 3 and log.counts["note"] == 10


def test_name_escapes_are_lossless_and_visible() -> None:
    names = [b"src/\xff", b"a\\xff", b"a\nb|c", "é\u2028".encode(), b"\x85\xc2", b"tab\there", b"\x1b[31mred"]
    for raw in names:
        text = os.fsdecode(raw)
        for form in (escape_name(text), printable(text)):
            assert unescape(form) == raw
            form.encode("utf-8")  # always encodable
        assert not any(c in printable(text) for c in "\n\r\t\x1b\u2028")
    assert printable(os.fsdecode(b"src/\xff")) == "src/\\xff"
    assert escape_name("a\\b") == "a\\\\b"


@pytest.mark.mount
def test_notes_and_ledger_bounded_and_the_final_state_written(tmp_path: Path) -> None:
    manifest = CHECKOUT_MANIFEST + (
        "[record]\nmax_notes = 20\nmax_note_chars = 100\nledger_max_items = 10\nledger_min_interval_s = 60\n"
    )
    run_dir = tmp_path / "run"
    def on_disk() -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((run_dir / "ledger.json").read_text())
        return doc

    with guarded_mount(tmp_path, manifest, run_dir=run_dir) as g, GuardClient(run_dir / "agent.sock") as agent:
        assert agent.note("note 0 " + "x" * 3000)["ok"]
        wait_for(lambda: len(on_disk()["notes"]) == 1, "the first note in ledger.json")
        for i in range(1, 300):
            assert agent.note(f"note {i} " + "x" * 3000)["ok"]
        # The writer rests 60 s after a write: the 299 changes since are coalesced, not written.
        assert len(on_disk()["notes"]) == 1
        state = (g.mnt / ".guard/STATE.md").read_text()
        assert len(state) < 8000
        assert "(290 older notes not shown" in state
        assert "note 299 " in state and "note 279 " not in state
    # The loop rested 60 s after its first write: what is on disk is cleanup()'s final state.
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert len(ledger["notes"]) == 10 and ledger["omitted"]["notes"] == 290
    assert ledger["notes"][-1]["text"].startswith("note 299 ")
    assert ledger["notes"][-1]["text"].endswith("[... 2909 more characters cut: record.max_note_chars=100]")
    assert (run_dir / "ledger.json").stat().st_size < 10_000
    assert (run_dir / "STATE.md").stat().st_size < 8000


def test_record_settings_are_validated() -> None:
    from guardfs.errors import ManifestError
    from guardfs.manifest import parse_manifest

    for bad, key in (("events_max_bytes = 10", "record.events_max_bytes"),
                     ("events_per_second = 0", "record.events_per_second"),
                     ("max_notes = \"many\"", "record.max_notes"),
                     ("max_note = 3", "record.max_note")):
        with pytest.raises(ManifestError) as info:
            parse_manifest(FIX_TAX + "[record]\n" + bad + "\n")
        assert key in str(info.value), (bad, str(info.value))



ODD_NAMES = """
    import json, os, sys
    from sandbox.breaker.client import GuardClient
    with open(b"src/checkout/\\xff", "w") as f:
        f.write("not utf-8 name\\n")
    with open("src/checkout/a\\n| forged | row |", "w") as f:
        f.write("newline and pipes\\n")
    import socket
    with socket.socket(socket.AF_UNIX) as s:  # a flood of malformed lines, past the rate cap
        s.connect(os.environ["GUARD_SOCKET"])
        s.sendall(b"[[[\\n" * 500)
        got = b""
        while got.count(b"\\n") < 500:
            got += s.recv(65536)
    with GuardClient() as guard:
        guard.hello("test")
        guard.note("\\n## Trips\\n(none)")
        guard.note("```\\n# heading", kind="disproved")
        print(open(".guard/STATE.md").read(), flush=True)
        try:
            open("README.md", "a").write("out of scope\\n")
        except OSError as err:
            print("refused", err.errno, flush=True)
        print(json.dumps(guard.status()["state"]), flush=True)
    sys.exit(3)
"""


@pytest.mark.root
@pytest.mark.mount
def test_guard_run_with_odd_names_and_a_forging_note(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "README.md").write_text("readme\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(FIX_TAX + "[record]\nevents_per_second = 1\nevents_burst = 20\n")
    run_dir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--", sys.executable, "-c", textwrap.dedent(ODD_NAMES)],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 3, run.stderr  # the agent's own status: the guard did not crash
    assert "Traceback" not in run.stderr
    assert (ws / "src/checkout").joinpath(os.fsdecode(b"\xff")).read_text() == "not utf-8 name\n"
    out = (run_dir / "stdout.log").read_text()
    assert "refused 30" in out and '"HALF_OPEN_REANCHOR"' in out  # the breaker tripped after it all
    state = (run_dir / "STATE.md").read_text(encoding="utf-8")
    for text in (out, state):  # the served .guard/STATE.md (read inside) and the run directory's
        lines = text.splitlines()
        assert any(ln.startswith("| src/checkout/\\xff | ") for ln in lines), text
        assert any(ln.startswith("| src/checkout/a\\n\\| forged \\| row \\| | ") for ln in lines), text
        assert "- (note) \\n## Trips\\n(none)" in lines
        assert "- \\`\\`\\`\\n# heading" in lines
        assert "(none)" not in lines and "# heading" not in lines
        assert len([ln for ln in lines if ln.startswith("```")]) == (2 if text is state else 0)  # feedback's fence
    assert [ln for ln in state.splitlines() if ln.startswith("## ")].count("## Trips") == 1
    assert any(ln.startswith("| 0 | scope_spill | ") and " | HALF_OPEN_REANCHOR | " in ln for ln in state.splitlines())
    ledger = json.loads((run_dir / "ledger.json").read_text(encoding="ascii"))
    assert {unescape(p) for p in ledger["files"]["list"]} == {b"src/checkout/\xff", b"src/checkout/a\n| forged | row |"}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text(encoding="ascii").splitlines()]
    created = {unescape(e["path"]) for e in events if e["op"] == "create"}
    assert b"src/checkout/\xff" in created and b"src/checkout/a\n| forged | row |" in created
    dropped = sum(e["count"] for e in events if e["op"] == "dropped")
    protocol = sum(e["kinds"].get("protocol", 0) for e in events if e["op"] == "dropped")
    assert protocol >= 480 and sum(1 for e in events if e["op"] == "protocol") + protocol == 500
    assert [e["rule"] for e in events if e["op"] == "trip"] == ["scope_spill"]
    assert f"events dropped by the event log's caps: {dropped} (" in run.stderr
    assert f"protocol {protocol}); every denial counted, every trip and violation kept" in run.stderr
    assert "files mutated: 2 (" in run.stderr
    assert "src/checkout/\\xff" in run.stderr and "src/checkout/a\\n| forged | row |" in run.stderr


def test_what_the_agent_repeats_at_will_is_droppable_and_breaker_changes_are_not(tmp_path: Path) -> None:
    """Checkpoints (one per passing test run) and notes can flood; trips, breaker changes,
    denials and operator acts cannot be dropped, even past the size cap."""
    log = EventLog(tmp_path / "e.jsonl", caps=Record(events_max_bytes=4096))
    for _ in range(100):
        log.emit("checkpoint", "", "allow", id=1, label="passing test: pytest")
    kept = [("trip", "deny"), ("breaker", "allow"), ("approve", "allow"), ("stop", "deny"),
            ("rollback", "allow"), ("limit", "allow"), ("open", "deny"), ("check", "deny")]
    for op, decision in kept:
        log.emit(op, "p", decision)
    log.emit("protocol", "agent", "deny", reason="not valid JSON")
    log.close()
    ops = [e["op"] for e in read_events(tmp_path / "e.jsonl")]
    assert [op for op in ops if op not in ("checkpoint", "dropped")] == [op for op, _ in kept]
    assert log.dropped["checkpoint"] > 0 and log.dropped["protocol"] == 1
