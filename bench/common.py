"""Pieces the benchmark programs share."""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import trio

from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.session import Session

__all__ = ["ROOT", "daemon_in_thread", "guard_run_argv", "percentiles", "quantile", "timed"]

#: The checkout the benchmarks run from (what guard run's agent gets on PYTHONPATH).
ROOT = Path(__file__).resolve().parent.parent


def daemon_in_thread(manifest: str) -> Session:
    """A session of an empty workspace whose breaker daemon serves its sockets from a trio
    loop in a daemon thread (no mount), ready when this returns. Call ``close()`` when done."""
    tmp = Path(tempfile.mkdtemp(prefix="guardfs-bench-"))
    (tmp / "ws").mkdir()
    session = Session(parse_manifest(manifest), tmp / "ws", EventLog(None), run_dir=tmp / "run", now=time.monotonic)
    session.prepare()
    ready = threading.Event()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(session.daemon.run)
            ready.set()

    threading.Thread(target=lambda: trio.run(serve), daemon=True).start()
    if not ready.wait(10):
        raise RuntimeError("the daemon did not start")
    return session


def percentiles(samples: list[int]) -> dict[str, float]:
    """Median and p99 of nanosecond samples, in microseconds."""
    samples.sort()
    return {"median_us": samples[len(samples) // 2] / 1000, "p99_us": samples[int(len(samples) * 0.99)] / 1000}


def timed(fn: Callable[[int], object], n: int) -> dict[str, float]:
    """Time each of *n* calls of fn(i)."""
    clock = time.perf_counter_ns
    out = []
    for i in range(n):
        t0 = clock()
        fn(i)
        out.append(clock() - t0)
    return percentiles(out)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of *values* by nearest rank (0 when there are none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def guard_run_argv(manifest: Path, run_dir: Path, workspace: Path, command: list[str]) -> list[str]:
    """``guard run --ci`` of *command* over *workspace*, with this interpreter, as cohorts.py runs
    its trajectories: no terminal, a terminal trip stops the agent, the status is the agent's."""
    return [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
            "--workspace", str(workspace), "--", *command]
