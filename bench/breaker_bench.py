"""The breaker's per-event cost, in process, and a ``check`` round trip over the socket.

Usage: .venv/bin/python bench/breaker_bench.py [--events 200000] [--checks 20000]

- write event: what guardfs does for a judged write on a known inode: read the cached
  classification from the inode table, build the request, policy verdict + breaker.
- token step: ``Breaker.step`` with token counts (and, separately, with a tool call).
- check round trip: a client on the agent socket asks ``check`` and reads the reply, the
  daemon running in its own trio loop as in ``guard mount --run-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import daemon_in_thread, percentiles, timed

from guardfs.decision import Request
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.breaker.client import GuardClient
from sandbox.session import Session

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = """
[task]
id = "bench"
goal = "Benchmark the breaker"
[paths]
allowed = ["src/checkout/"]
forbidden = [".env*", "**/migrations/"]
[limits]
max_files = "unlimited"
max_window_tokens = "unlimited"
max_tokens_without_progress = "unlimited"
max_steps = "unlimited"
max_identical_calls = "unlimited"
"""


def in_process(n: int) -> dict[str, dict[str, float]]:
    """Per-event costs without any I/O."""
    manifest = parse_manifest(MANIFEST)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as run:
        (Path(tmp) / "src/checkout").mkdir(parents=True)
        (Path(tmp) / "src/checkout/tax.py").write_text("x = 1\n")
        session = Session(manifest, tmp, EventLog(None), run_dir=Path(run), now=time.monotonic)  # not served
        fs, breaker = session.fs, session.breaker
        st = os.stat(Path(tmp) / "src/checkout/tax.py")
        ino = fs.inodes.remember(st.st_ino, st.st_mode, "src/checkout/tax.py").ino
        get, check = fs.inodes.get, fs.gate.check

        def write_event(_: int) -> None:
            entry = get(ino)
            assert entry is not None
            check(Request("write", entry.path, entry.where, True))

        results = {
            "write event (path decision + breaker)": timed(write_event, n),
            "token step": timed(lambda i: breaker.step(tokens_in=1200, tokens_out=300), n),
            "token step with a tool call": timed(
                lambda i: breaker.step(tokens_in=1200, tokens_out=300, tool="Edit", args={"file": f"src/f{i}.py"}), n),
        }
        session.close()
    return results


def round_trips(n: int) -> dict[str, float]:
    """``check`` over the agent socket against a daemon in its own thread."""
    session = daemon_in_thread(MANIFEST)
    samples = []
    with GuardClient(session.daemon.agent_path) as guard:
        for i in range(n):
            t0 = time.perf_counter_ns()
            guard.check("Edit", [f"src/checkout/f{i % 50}.py"])
            samples.append(time.perf_counter_ns() - t0)
    session.close()
    return percentiles(samples)


def main() -> int:
    """Measure, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--checks", type=int, default=20_000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/breaker.json")
    args = parser.parse_args()
    results = in_process(args.events)
    results["check round trip over the socket"] = round_trips(args.checks)
    print(f"{'event':<40} {'median us':>10} {'p99 us':>9}")
    for name, r in results.items():
        print(f"{name:<40} {r['median_us']:>10.2f} {r['p99_us']:>9.2f}")
    print("seed design, in-process breaker per tool call: median 2.00 us, p99 9.50 us")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
