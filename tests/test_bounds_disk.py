"""Bounded disk and bounded stalls (issue 10, item 4): capped output logs, a streaming digest,
guard exec's logs on the host, and checkpoint pre-images copied off the FUSE loop under a cap.

Real ``guard run`` processes, a real FUSE mount served from a thread of this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import guardfs.checkpoint
from guardfs.checkpoint import CHECKPOINT_MAX_BYTES
from guardfs.errors import ManifestError
from guardfs.events import EventLog
from guardfs.fs import GuardFS
from guardfs.manifest import parse_manifest
from sandbox.launch.quarantine import LOG_MAX_BYTES, Recorder, _failing_lines, digest

from .helpers import FIX_TAX, wait_for
from .mounts import _ServerThread
from .test_run import UNPRIVILEGED_PYTHON, workspace

MiB = 1 << 20


def _guard_run_measured(args: list[str], cwd: Path, out: Path, timeout: float = 300) -> tuple[int, int, str, str]:
    """Run ``guard ARGS``; returns its exit status, its peak RSS in bytes (it and the
    processes it waited for: wait4's account), its stdout and its stderr."""
    with open(out / "guard.out", "wb") as o, open(out / "guard.err", "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "sandbox", *args], cwd=cwd, stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise TimeoutError(f"guard {args[0]} did not end within {timeout}s")
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (proc.returncode, usage.ru_maxrss * 1024, (out / "guard.out").read_text(errors="replace"),
            (out / "guard.err").read_text(errors="replace"))


# ----- the agent's output ----------------------------------------------------------------

FLOOD = """
    import sys
    out = sys.stdout.buffer
    chunk = bytes(range(97, 123)) * ((1 << 20) // 26) + b"0123"   # 1 MiB of letters, no newline
    out.write(b"HEAD>")
    for _ in range({mib}):
        out.write(chunk)
    out.write(b"<TAIL fatal error: the end")
    out.flush()
    sys.stderr.write("a short stderr\\n")
    raise SystemExit(3)
"""


@pytest.mark.root
@pytest.mark.mount
def test_output_past_the_cap_keeps_head_and_tail_and_the_guard_stays_small(tmp_path: Path) -> None:
    """512 MiB without a newline, under a 1 MiB cap: the log keeps the first and the last
    512 KiB around one marker line, the digest stays short, and the guard's peak RSS stays
    under 300 MiB (it held a 512 MiB line in memory before)."""
    ws, manifest = workspace(tmp_path)
    cap = 1 * MiB
    manifest.write_text(FIX_TAX + f"[sandbox]\nlog_max_bytes = {cap}\n")
    run_dir = tmp_path / "run"
    mib = 512
    status, peak, out, err = _guard_run_measured(
        ["run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         sys.executable, "-c", textwrap.dedent(FLOOD.format(mib=mib))], ws, tmp_path)
    assert status == 3, err
    chunk = bytes(range(97, 123)) * ((1 << 20) // 26) + b"0123"
    end = b"<TAIL fatal error: the end"
    total = len(b"HEAD>") + mib * len(chunk) + len(end)
    head = (b"HEAD>" + chunk)[: cap // 2]
    tail = (chunk + end)[-(cap - cap // 2):]
    log = (run_dir / "stdout.log").read_bytes()
    assert log.startswith(head) and log.endswith(tail)
    marker = log[len(head):-len(tail)]
    assert marker.count(b"\n") == 2, marker  # one line of its own
    assert f"[guard: {total - cap} bytes of output left out here".encode() in marker, marker
    assert len(log) < cap + 200
    assert (run_dir / "stderr.log").read_bytes() == b"a short stderr\n"  # under the cap: untouched
    assert len(out) <= 1200 and "exited with status 3" in out and str(run_dir / "stdout.log") in out
    assert "output capped: stdout.log" in err and f"{total - cap} left out" in err
    assert "output capped: stderr.log" not in err
    assert peak < 300 * MiB, f"the guard's peak RSS was {peak // MiB} MiB"


def test_recorder_under_the_cap_is_the_stream_and_over_it_head_marker_tail(tmp_path: Path) -> None:
    for total in (0, 1, 4095, 4096, 4097, 10_000, 50_000):
        data = bytes((i * 7 + i // 251) % 256 for i in range(total))
        rec = Recorder(tmp_path / f"log{total}", None, 4096)
        for i in range(0, total, 333):
            rec.feed(data[i:i + 333])
        rec.close()
        rec.close()  # idempotent
        got = (tmp_path / f"log{total}").read_bytes()
        if total <= 4096:
            assert got == data and rec.dropped == 0
        else:
            assert got.startswith(data[:2048]) and got.endswith(data[-2048:])
            assert f"{total - 4096} bytes of output left out".encode() in got[2048:-2048]
            assert rec.dropped == total - 4096
    with pytest.raises(ValueError, match="cannot keep a head and a tail"):
        Recorder(tmp_path / "tiny", None, 1)


def test_the_digest_reads_a_huge_line_in_bounded_memory(tmp_path: Path) -> None:
    """A 16 MiB line with a failure word at its very end: found, shown cut, and read with
    less than 2 MiB allocated at any time."""
    log = tmp_path / "one-line.log"
    with open(log, "wb") as f:
        f.write(b"ok\nTraceback (most recent call last):\n  File x\nValueError: first\n")
        for _ in range(16):
            f.write(b"z" * MiB)
        f.write(b" segmentation fault at the end")
    tracemalloc.start()
    try:
        lines = _failing_lines(log)
        text = digest("status 1", [log])
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, f"peak {peak} bytes"
    assert lines[:3] == [b"Traceback (most recent call last):", b"  File x", b"ValueError: first"]
    assert len(lines) == 4 and lines[3].startswith(b"zzz") and len(lines[3]) <= 1024
    assert len(text) <= 1200 and "ValueError: first" in text and "zzz..." in text
    # A failure word cut in two by a chunk boundary is still found.
    split = tmp_path / "split.log"
    split.write_bytes(b"x" * ((1 << 16) - 3) + b"panic here\nquiet\n")
    assert len(_failing_lines(split)) == 1


def test_log_settings_in_the_manifest() -> None:
    m = parse_manifest(FIX_TAX)
    assert m.sandbox.log_max_bytes == LOG_MAX_BYTES == 64 * MiB
    assert m.sandbox.checkpoint_max_bytes == CHECKPOINT_MAX_BYTES == 1 << 30
    assert parse_manifest(FIX_TAX + "[sandbox]\nlog_max_bytes = 1_048_576\ncheckpoint_max_bytes = 0\n") \
        .sandbox.checkpoint_max_bytes == 0
    with pytest.raises(ManifestError, match="log_max_bytes"):
        parse_manifest(FIX_TAX + "[sandbox]\nlog_max_bytes = 100\n")
    with pytest.raises(ManifestError, match="checkpoint_max_bytes"):
        parse_manifest(FIX_TAX + "[sandbox]\ncheckpoint_max_bytes = -1\n")
    with pytest.raises(ManifestError, match="log_max_byte"):
        parse_manifest(FIX_TAX + "[sandbox]\nlog_max_byte = 100000\n")  # a typo is refused, not ignored


# ----- guard exec's logs --------------------------------------------------------------

EXEC = """
    import os, subprocess, sys
    guard = {guard!r}
    r = subprocess.run([*guard, "exec", "--", "sh", "-c", "echo hi; exit 3"], capture_output=True, text=True)
    print("exec status", r.returncode, r.stderr, flush=True)
    r = subprocess.run([*guard, "exec", "--", "sh", "-c", "head -c 100000 /dev/zero | tr '\\\\0' y"],
                       capture_output=True, text=True)
    print("flood status", r.returncode, flush=True)
    print("inside", sorted(os.listdir(os.environ["GUARD_RUN_DIR"])), flush=True)
"""


@pytest.mark.root
@pytest.mark.parametrize("user", [None, "nobody"])
@pytest.mark.mount
def test_guard_exec_logs_land_in_the_run_directory_capped(tmp_path: Path, user: str | None,
                                                           request: pytest.FixtureRequest) -> None:
    ws, manifest = workspace(tmp_path)
    # An agent of another user gets an allowlisted environment: PYTHONPATH is named for it.
    env_names = '\nenv = ["PYTHONPATH"]' if user is not None else ""
    manifest.write_text(FIX_TAX + f"[sandbox]\nlog_max_bytes = 4096{env_names}\n")
    run_dir = tmp_path / "run"
    flags: list[str] = []
    guard, env = ["guard"], dict(os.environ)
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        flags = ["--user", user]
        # This interpreter may live where that user cannot reach (under /root): the system's.
        guard, env["PYTHONPATH"] = [UNPRIVILEGED_PYTHON, "-m", "sandbox"], request.getfixturevalue("installation")
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest", str(manifest), "--run-dir",
         str(run_dir), "--", UNPRIVILEGED_PYTHON, "-c", textwrap.dedent(EXEC).format(guard=guard)],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
    )
    assert result.returncode == 0, result.stderr
    log = (run_dir / "stdout.log").read_text()
    assert "exec status 3" in log and "flood status 0" in log, log
    inside = next(line for line in log.splitlines() if line.startswith("inside"))
    assert "control.sock" not in inside and "ledger.json" not in inside  # the rest stays hidden
    logs = sorted((run_dir / "exec").iterdir())
    outs = [p for p in logs if p.name.endswith(".out.log")]
    assert len(outs) == 2 and len(logs) == 4, logs
    assert outs[0].read_bytes() == b"hi\n"
    flood = outs[1].read_bytes()
    assert flood.startswith(b"y" * 2048) and flood.endswith(b"y" * 2048)
    assert f"[guard: {100000 - 4096} bytes of output left out here".encode() in flood
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["exit_code"] for e in events if e["op"] == "tool_result"] == [3, 0]


# ----- checkpoint pre-images -----------------------------------------------------------

SPARSE = 2 << 30


@contextlib.contextmanager
def checkpointed_mount(root: Path, manifest: str) -> Iterator[tuple[GuardFS, Path, _ServerThread]]:
    """A guarded mount of root/backing that keeps pre-images in root/checkpoint."""
    backing, mnt = root / "backing", root / "mnt"
    mnt.mkdir(exist_ok=True)
    events = EventLog(root / "events.jsonl")
    fs = GuardFS(str(backing), parse_manifest(manifest), events, checkpoint_dir=root / "checkpoint")
    server = _ServerThread(fs, mnt, None, [])
    try:
        server.start()
        yield fs, mnt, server
    finally:
        server.stop()
        fs.close()
        events.close()
        server.check_clean()


def _data_extents(path: Path) -> list[tuple[int, int]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        out, pos, size = [], 0, os.fstat(fd).st_size
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            out.append((data, min(hole, size)))
            pos = hole
        return out
    finally:
        os.close(fd)


@pytest.mark.mount
def test_a_huge_file_first_change_does_not_stall_other_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the pre-image of a 2 GiB sparse file is being copied (held open here by a gate
    on the copy, standing in for a slow disk), stat and reads of other files each take under
    2 s; a second writer of the same file waits until the copy is complete; the copy stays
    sparse and equal to the file as it was."""
    big = _sparse_workspace(tmp_path / "backing")
    gate, entered = threading.Event(), threading.Event()
    real_clone = guardfs.checkpoint._clone

    def held_clone(src: int, out: int) -> None:
        entered.set()
        assert gate.wait(60), "the test never released the copy"
        real_clone(src, out)

    monkeypatch.setattr(guardfs.checkpoint, "_clone", held_clone)
    with checkpointed_mount(tmp_path, FIX_TAX) as (fs, mnt, _server):
        assert fs.preimages is not None
        preimages = fs.preimages
        results: dict[str, Any] = {}

        def append(key: str) -> None:
            try:
                with open(mnt / "src/checkout/big.bin", "ab") as f:
                    f.write(key.encode())
                results[key] = "done"
            except OSError as err:
                results[key] = err

        first = threading.Thread(target=append, args=("1",))
        second = threading.Thread(target=append, args=("2",))
        try:
            first.start()
            assert entered.wait(20), "the copy never started"
            second.start()
            wait_for(lambda: preimages.statistics()["waiting"] >= 1, "the second writer to wait for the copy")
            timings = []
            for i in range(5):
                t0 = time.monotonic()
                os.stat(mnt / f"src/checkout/other{i}.py")
                assert (mnt / f"src/checkout/other{i}.py").read_text() == f"x = {i}\n"
                os.listdir(mnt / "src/checkout")
                timings.append(time.monotonic() - t0)
            assert max(timings) < 2.0, timings
            assert results == {} and big.stat().st_size == SPARSE  # nothing changed it yet
            assert preimages.statistics()["copying"] == 1
        finally:
            gate.set()
            first.join(30)
            second.join(30)
        assert results == {"1": "done", "2": "done"}
    assert big.stat().st_size == SPARSE + 2
    _check_sparse_blob(tmp_path / "checkpoint/0000", big)


def _sparse_workspace(backing: Path) -> Path:
    """src/checkout/ with a 2 GiB sparse file (six bytes of data in its middle) and five small ones."""
    (backing / "src/checkout").mkdir(parents=True)
    big = backing / "src/checkout/big.bin"
    with open(big, "wb") as f:
        f.truncate(SPARSE)
        f.seek(SPARSE // 2)
        f.write(b"middle")
    for i in range(5):
        (backing / f"src/checkout/other{i}.py").write_text(f"x = {i}\n")
    return big


def _check_sparse_blob(generation: Path, big: Path) -> None:
    """The one pre-image in *generation* is the sparse file *big* as it was, holes and all."""
    (blob,) = [p for p in generation.iterdir() if p.name != "index.jsonl"]
    assert blob.stat().st_size == SPARSE
    assert blob.stat().st_blocks * 512 < 1 * MiB  # the holes stayed holes
    extents = _data_extents(blob)
    assert any(start <= SPARSE // 2 < end for start, end in extents), extents
    assert sum(end - start for start, end in extents) < 1 * MiB
    with open(blob, "rb") as f:
        f.seek(SPARSE // 2)
        assert f.read(6) == b"middle"
    index = [json.loads(line) for line in (generation / "index.jsonl").read_text().splitlines()]
    st = os.stat(big)
    assert index == [{"path": "src/checkout/big.bin", "kind": "file", "mode": 0o644, "blob": blob.name,
                      "ino": st.st_ino, "uid": st.st_uid, "gid": st.st_gid}]  # the owner, for a rollback


@pytest.mark.mount
def test_a_failed_copy_refuses_the_change_and_the_next_one_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pre-image, no change: a copy that fails (a full disk, injected) refuses the write
    with its errno and leaves the file as it was; the next write keeps the pre-image."""
    backing = tmp_path / "backing"
    (backing / "src/checkout").mkdir(parents=True)
    (backing / "src/checkout/tax.py").write_text("A = 1\n")
    real_clone = guardfs.checkpoint._clone
    failures = [OSError(28, "No space left on device")]

    def full_once(src: int, out: int) -> None:
        if failures:
            raise failures.pop()
        real_clone(src, out)

    monkeypatch.setattr(guardfs.checkpoint, "_clone", full_once)
    with checkpointed_mount(tmp_path, FIX_TAX) as (fs, mnt, server):
        with pytest.raises(OSError) as err:
            open(mnt / "src/checkout/tax.py", "a").close()
        assert err.value.errno == 28
        assert (backing / "src/checkout/tax.py").read_text() == "A = 1\n"
        with open(mnt / "src/checkout/tax.py", "a") as f:
            f.write("B = 2\n")
        restored = trio.from_thread.run_sync(fs.rollback, trio_token=server.token[0])
        assert restored == ["src/checkout/tax.py"]
    assert (backing / "src/checkout/tax.py").read_text() == "A = 1\n"


@pytest.mark.root
@pytest.mark.mount
def test_rollback_names_a_file_past_the_checkpoint_cap(tmp_path: Path) -> None:
    """Under checkpoint_max_bytes = 1 MiB a 2 MiB file's first change is recorded as not
    restorable (an event says so); guard rollback restores the rest and names it."""
    ws, manifest = workspace(tmp_path)
    manifest.write_text(FIX_TAX + f"[sandbox]\ncheckpoint_max_bytes = {MiB}\n")
    big = ws / "src/checkout/big.bin"
    big.write_bytes(os.urandom(2 * MiB))
    before = big.read_bytes()
    run_dir = tmp_path / "run"
    script = """
        open("src/checkout/tax.py", "a").write("# changed\\n")
        open("src/checkout/big.bin", "ab").write(b"more")
    """
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         "--", sys.executable, "-c", textwrap.dedent(script)],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (capped,) = [e for e in events if e["op"] == "preimage"]
    assert capped["path"] == "src/checkout/big.bin" and capped["restorable"] is False
    assert "checkpoint_max_bytes=1048576" in capped["reason"]
    rolled = subprocess.run([sys.executable, "-m", "sandbox", "rollback", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert rolled.returncode == 0, rolled.stderr
    assert "restored 1 path(s)" in rolled.stdout
    assert "NOT restored: src/checkout/big.bin" in rolled.stdout
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"
    assert big.read_bytes() == before + b"more"  # left as it is


def test_the_rss_measure_sees_a_big_child() -> None:
    """The peak-RSS measure used above can fail: a child touching 200 MiB is seen as such."""
    proc = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * 51200"])
    _pid, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    assert usage.ru_maxrss * 1024 > 200 * MiB
