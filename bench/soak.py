"""A soak: one guarded agent session of many minutes. Do the guard's memory, descriptors and
latency stay flat?

Usage (as root, like guard run in CI):

    .venv/bin/python bench/soak.py                     # 30 minutes, idle gaps of 15-120 s
    .venv/bin/python bench/soak.py --minutes 3 --gap-scale 0.05 --sample-seconds 15   # a quick check

One real ``guard run --ci`` of a simulated agent (a Python script, inside the sandbox) that
works in turns, in bursts of 3-8 turns separated by idle gaps of 15-120 s (random with a
fixed seed; ``--gap-scale`` shrinks them for short runs). A turn reports a model step with
its token counts over the agent socket (sandbox/breaker/client.py, GUARD_SOCKET), then uses one
tool: an in-scope edit in Python (append a function, or rewrite the module), the shell's
``>`` rewrite and ``>>`` append, reads of in-scope and out-of-scope files, or a test run
through ``guard exec`` (pytest on a small test file, or ``python3 -c``). Edits are checked
first the way agents do it: ``guard hook claude`` with a PreToolUse JSON on stdin, or the
client's ``check``. Each burst opens a new socket connection, so leaked connections show.

The manifest is generous on purpose (hundreds of files, a million rewrites, ten million
tokens a window): the point is a long session, not trips, and a clean agent here never trips.
A trip, a refused operation or a failed test is reported as a failure of the soak.

The agent times every operation and appends its records, once per burst, to
``soak/latency.jsonl`` in the workspace (the sandbox's /tmp is private to it; the workspace
is the same directory on both sides and the manifest allows ``soak/``). From the host, every
``--sample-seconds`` (default 60), this program samples the guard process (the ``guard run``
child it started) with psutil: RSS and open descriptors; the sizes of events.jsonl,
ledger.json and stdout.log in the run directory; and the median and p99 of the operations
the agent recorded since the previous sample (counted when they are read, so a burst that
spans a sample boundary lands in the later row).

Plateau: the median of the first third of the samples against the median of the last third.
RSS is bounded when it grew by less than ``--rss-growth-pct`` (default 25%), descriptors when
they grew by fewer than ``--fd-growth`` (default 8). Growth beyond that is reported as
unbounded, and the exit status is 1; so it is when the guard's exit status is not the
agent's (the agent did not survive, or the guard failed), when the breaker tripped, or when
an operation failed. Prints a table, writes ``results/soak.json`` and ``results/soak.png``
(with matplotlib: ``pip install -e '.[bench]'``; without it, no picture, said so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from common import ROOT, guard_run_argv, quantile

LATENCY = "soak/latency.jsonl"
MIB = 1 << 20

MANIFEST = """
[task]
id = "soak"
goal = "Maintain src/app/ and keep tests/ passing, for a long session (the soak benchmark)"

[paths]
allowed = ["src/app/", "tests/", "soak/"]
forbidden = [".env*"]

# Generous on purpose: the soak measures a long session, not trips. A clean agent never
# comes near these; the rules are still evaluated on every operation.
[limits]
max_files = 500
max_rewrites = 1000000
window_steps = 5
max_window_tokens = 10000000
max_tokens_without_progress = 100000000
max_consecutive_failures = 50
max_identical_calls = 1000
idle_timeout_s = 3600
"""

# The simulated agent, run inside the sandbox. argv: minutes, seed, gap scale.
AGENT = r'''
import json, os, random, shutil, subprocess, sys, time
from sandbox.breaker.client import GuardClient

minutes, seed, gap_scale = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + minutes * 60
rng = random.Random(seed)
GUARD = shutil.which("guard")
if GUARD is None:
    print("soak agent: guard is not on PATH inside the sandbox", file=sys.stderr)
    sys.exit(3)
WS = os.getcwd()
MODULES = [f"src/app/mod_{i}.py" for i in range(8)]
OUTSIDE = ["README.md", "docs/guide.md", "vendor/lib.py"]
counter = 0
failures = 0
records = []


class Failed(Exception):
    pass


def run(argv, **kw):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    if proc.returncode != 0:
        raise Failed(f"{argv[:4]} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")


def edit():
    path = rng.choice(MODULES)
    text = open(path).read()
    if text.count("\ndef ") >= 30:  # keep the files small: rewrite the module now and then
        with open(path, "w") as f:
            f.write(f'"""Module rewritten at turn {counter}."""\n\n\ndef base(x):\n    return x\n')
    else:
        with open(path, "a") as f:
            f.write(f"\n\ndef fn_{counter}(x):\n    return x + {counter}\n")


def shell_rewrite():
    run(["sh", "-c", f"printf 'note %s\\n' {counter} > src/app/notes.txt"])


def shell_append():
    if os.path.getsize("src/app/journal.txt") > 16384:
        run(["sh", "-c", f"echo 'journal restarted at turn {counter}' > src/app/journal.txt"])
    run(["sh", "-c", f"echo 'turn {counter}: done' >> src/app/journal.txt"])


def read_in():
    open(rng.choice([*MODULES, "tests/test_app.py"])).read()


def read_out():
    open(rng.choice(OUTSIDE)).read()


def pytest():
    run([GUARD, "exec", "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_app.py"])


def exec_c():
    run([GUARD, "exec", "--", sys.executable, "-c", "print(sum(range(10000)))"])


def hook(path):
    event = {"hook_event_name": "PreToolUse", "tool_name": "Edit", "cwd": WS, "session_id": "soak",
             "tool_input": {"file_path": path, "old_string": "x", "new_string": f"x{counter}"}}
    run([GUARD, "hook", "claude"], input=json.dumps(event))


def check(client, path):
    reply = client.check("Edit", [os.path.join(WS, path)], args={"turn": counter})
    if not reply["allow"]:
        raise Failed(f"check refused: {reply}")


def step(client):
    reply = client.step(tokens_in=rng.randint(800, 3000), tokens_out=rng.randint(100, 600),
                        tool=rng.choice(["Edit", "Bash", "Read"]), args={"turn": counter})
    if not reply["allow"]:
        raise Failed(f"step refused: {reply}")


def timed(op, fn, *args):
    global failures
    t0 = time.perf_counter()
    error = None
    try:
        fn(*args)
    except Exception as err:  # any failure is the soak's finding: recorded, the session goes on
        error = f"{type(err).__name__}: {err}"[:500]
        failures += 1
    records.append({"t": time.time(), "op": op, "ms": (time.perf_counter() - t0) * 1000, "ok": error is None,
                    **({"error": error} if error else {})})


TOOLS = [("edit", edit, 4), ("shell_rewrite", shell_rewrite, 2), ("shell_append", shell_append, 2),
         ("read_in", read_in, 3), ("read_out", read_out, 2), ("pytest", pytest, 1), ("exec_c", exec_c, 1)]
EDITS = {"edit", "shell_rewrite", "shell_append"}

while time.time() < deadline:
    with GuardClient() as client:
        client.hello("soak")
        for _ in range(rng.randint(3, 8)):
            counter += 1
            timed("step", step, client)
            name, fn, _w = rng.choices(TOOLS, weights=[w for *_, w in TOOLS])[0]
            if name in EDITS:  # asked first, as an agent's PreToolUse hook does
                if counter % 2:
                    timed("hook", hook, rng.choice(MODULES))
                else:
                    timed("check", check, client, rng.choice(MODULES))
            timed(name, fn)
    with open("soak/latency.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    records.clear()
    gap = rng.uniform(15, 120) * gap_scale
    time.sleep(max(0.0, min(gap, deadline - time.time())))

status = 0 if failures == 0 else 3
with open("soak/latency.jsonl", "a") as f:
    f.write(json.dumps({"done": True, "status": status, "failures": failures, "turns": counter}) + "\n")
sys.exit(status)
'''


@dataclass
class Sample:
    """One row of the table: the guard process and its files at one moment."""

    minute: float
    rss_mib: float | None  # None once the guard has exited (the final row)
    fds: int | None
    threads: int | None
    events_kib: float
    ledger_kib: float
    stdout_kib: float
    ops: int
    median_ms: float | None
    p99_ms: float | None


@dataclass
class Records:
    """What the agent recorded, read incrementally from its file in the workspace."""

    path: Path
    offset: int = 0
    all: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None

    def read_new(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last call."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        new = []
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec.get("done"):
                self.done = rec
            else:
                new.append(rec)
        self.all += new
        return new


def make_workspace(base: Path) -> Path:
    """A small project: code and tests in scope, docs and vendored code out of scope, a secret."""
    ws = base / "ws"
    (ws / "src/app").mkdir(parents=True)
    for i in range(8):
        (ws / f"src/app/mod_{i}.py").write_text(f'"""Module {i}."""\n\n\ndef base(x):\n    return x\n')
    (ws / "src/app/notes.txt").write_text("note 0\n")
    (ws / "src/app/journal.txt").write_text("journal\n")
    (ws / "tests").mkdir()
    (ws / "tests/test_app.py").write_text("def test_sum():\n    assert sum(range(10)) == 45\n\n\n"
                                          "def test_join():\n    assert ''.join(['a', 'b']) == 'ab'\n")
    (ws / "soak").mkdir()
    (ws / "docs").mkdir()
    (ws / "docs/guide.md").write_text("# Guide\n\n" + "Some prose about the app.\n" * 200)
    (ws / "vendor").mkdir()
    (ws / "vendor/lib.py").write_text("".join(f"def v{i}(x):\n    return x * {i}\n\n" for i in range(200)))
    (ws / "README.md").write_text("# app\n")
    (ws / ".env").write_text("SECRET=1\n")
    return ws


def _kib(path: Path) -> float:
    try:
        return path.stat().st_size / 1024
    except FileNotFoundError:
        return 0.0


def take_sample(start: float, guard: psutil.Process | None, run_dir: Path, records: Records) -> Sample:
    """Sample the guard (None once it has exited), its run directory and the agent's new records."""
    rss = fds = threads = None
    if guard is not None:
        try:
            with guard.oneshot():
                rss, fds, threads = guard.memory_info().rss / MIB, guard.num_fds(), guard.num_threads()
        except psutil.NoSuchProcess:
            pass
    new = [r["ms"] for r in records.read_new()]
    return Sample(
        minute=(time.time() - start) / 60, rss_mib=rss, fds=fds, threads=threads,
        events_kib=_kib(run_dir / "events.jsonl"), ledger_kib=_kib(run_dir / "ledger.json"),
        stdout_kib=_kib(run_dir / "stdout.log"), ops=len(new),
        median_ms=statistics.median(new) if new else None, p99_ms=quantile(new, 0.99) if new else None,
    )


HEAD = (f"{'minute':>7} {'RSS MiB':>8} {'fds':>5} {'events KiB':>11} {'ledger KiB':>11} {'stdout KiB':>11} "
        f"{'ops':>5} {'median ms':>10} {'p99 ms':>8}")


def row(s: Sample) -> str:
    """One line of the table."""
    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)
    return (f"{s.minute:>7.2f} {num(s.rss_mib, '.1f'):>8} {num(s.fds, 'd'):>5} {s.events_kib:>11.1f} "
            f"{s.ledger_kib:>11.1f} {s.stdout_kib:>11.1f} {s.ops:>5} {num(s.median_ms, '.1f'):>10} "
            f"{num(s.p99_ms, '.1f'):>8}")


def plateau(values: list[float]) -> tuple[float, float] | None:
    """(median of the first third, median of the last third), or None under three values."""
    if len(values) < 3:
        return None
    third = len(values) // 3
    return statistics.median(values[:third]), statistics.median(values[-third:])


def judge(samples: list[Sample], rss_pct: float, fd_slack: int) -> tuple[list[str], bool]:
    """Sentences saying whether RSS and descriptors came back to their plateau; True when bounded."""
    live = [s for s in samples if s.rss_mib is not None and s.fds is not None]
    rss = plateau([s.rss_mib for s in live if s.rss_mib is not None])
    fds = plateau([float(s.fds) for s in live if s.fds is not None])
    if rss is None or fds is None:
        return [f"growth not judged: {len(live)} sample(s) of the live guard, at least 3 needed "
                "(a longer --minutes or a shorter --sample-seconds)"], True
    third = len(live) // 3
    early = f"minutes {round(live[0].minute, 2):g}-{round(live[third - 1].minute, 2):g}"
    late = f"minutes {round(live[-third].minute, 2):g}-{round(live[-1].minute, 2):g}"
    rss_growth = 100 * (rss[1] - rss[0]) / rss[0]
    rss_ok = rss_growth < rss_pct
    fd_growth = fds[1] - fds[0]
    fd_ok = fd_growth < fd_slack
    lines = [
        f"RSS: plateau {rss[0]:.1f} MiB ({early}), end {rss[1]:.1f} MiB ({late}): {rss_growth:+.1f}%, "
        + (f"under {rss_pct:g}%: returned to its plateau (bounded)" if rss_ok else
           f"{rss_pct:g}% or more: did NOT return to its plateau (unbounded growth)"),
        f"descriptors: plateau {fds[0]:g} ({early}), end {fds[1]:g} ({late}): {fd_growth:+g}, "
        + (f"under {fd_slack}: returned to their plateau (bounded)" if fd_ok else
           f"{fd_slack} or more: did NOT return to their plateau (unbounded growth)"),
    ]
    return lines, rss_ok and fd_ok


def per_op(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Latency per kind of operation over the whole run, and its first third against its last."""
    out: dict[str, dict[str, Any]] = {}
    for op in sorted({r["op"] for r in records}):
        ms = [r["ms"] for r in records if r["op"] == op]
        third = max(1, len(ms) // 3)
        out[op] = {"count": len(ms), "failed": sum(1 for r in records if r["op"] == op and not r["ok"]),
                   "median_ms": statistics.median(ms), "p99_ms": quantile(ms, 0.99),
                   "median_first_third_ms": statistics.median(ms[:third]),
                   "median_last_third_ms": statistics.median(ms[-third:])}
    return out


def plot(samples: list[Sample], path: Path) -> bool:
    """RSS and descriptors, file sizes, latency, against minutes, as a PNG; False without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    live = [s for s in samples if s.rss_mib is not None]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    ax1.plot([s.minute for s in live], [s.rss_mib for s in live], color="#2e86de", label="RSS MiB")
    ax1.set_ylabel("RSS MiB")
    ax1.set_ylim(bottom=0)
    fd_axis = ax1.twinx()
    fd_axis.plot([s.minute for s in live], [s.fds for s in live], color="#e67e22", label="descriptors")
    fd_axis.set_ylabel("descriptors")
    fd_axis.set_ylim(bottom=0)
    ax1.legend(handles=[*ax1.get_lines(), *fd_axis.get_lines()], loc="lower right")
    ax1.set_title("guard process over the session")
    minutes = [s.minute for s in samples]
    for name, values in (("events.jsonl", [s.events_kib for s in samples]),
                         ("ledger.json", [s.ledger_kib for s in samples]),
                         ("stdout.log", [s.stdout_kib for s in samples])):
        ax2.plot(minutes, values, label=name)
    ax2.set_ylabel("KiB")
    ax2.legend(loc="upper left")
    timed = [s for s in samples if s.median_ms is not None]
    ax3.plot([s.minute for s in timed], [s.median_ms for s in timed], "o-", label="median")
    ax3.plot([s.minute for s in timed], [s.p99_ms for s in timed], "s--", label="p99")
    ax3.set_yscale("log")
    ax3.set_ylabel("ms per operation")
    ax3.set_xlabel("minute")
    ax3.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the guard run we started (SIGTERM ends the agent's tree and unmounts; then SIGKILL)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the session (fractions allowed)")
    parser.add_argument("--sample-seconds", type=float, default=60.0, help="time between samples")
    parser.add_argument("--gap-scale", type=float, default=1.0,
                        help="multiply the 15-120 s idle gaps by this (e.g. 0.05 for a quick check)")
    parser.add_argument("--seed", type=int, default=10, help="seed of the agent's choices and gaps")
    parser.add_argument("--rss-growth-pct", type=float, default=25.0,
                        help="RSS growth from plateau to end, in %%, counted as unbounded")
    parser.add_argument("--fd-growth", type=int, default=8, help="descriptor growth counted as unbounded")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results")
    parser.add_argument("--keep", action="store_true", help="keep the workspace and run directory")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sample_seconds <= 0 or args.gap_scale < 0:
        parser.error("--minutes and --sample-seconds must be positive, --gap-scale not negative")
    return args


@dataclass
class Session:
    """One guarded session and what was measured of it."""

    base: Path
    ws: Path
    run_dir: Path
    records: Records
    samples: list[Sample] = field(default_factory=list)
    status: int | None = None  # the guard's exit status


def run_session(args: argparse.Namespace, session: Session) -> None:
    """Start ``guard run`` of the agent and sample it until it exits, printing each row."""
    manifest = session.base / "manifest.toml"
    manifest.write_text(MANIFEST)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GUARD_SOCKET", None)
    command = [sys.executable, "-c", textwrap.dedent(AGENT), str(args.minutes), str(args.seed), str(args.gap_scale)]
    samples = session.samples
    with (session.base / "guard.out").open("wb") as out, (session.base / "guard.err").open("wb") as err:
        start = time.time()
        proc = subprocess.Popen(guard_run_argv(manifest, session.run_dir, session.ws, command), cwd=session.ws,
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            guard: psutil.Process | None = psutil.Process(proc.pid)  # the guard run process: our child
        except psutil.NoSuchProcess:
            guard = None  # already gone: the verdict says why
        # Past this, the agent is overdue by far: stop it rather than wait forever.
        limit = start + args.minutes * 60 + max(300.0, args.minutes * 6)
        try:
            while True:
                due = start + (len(samples) + 1) * args.sample_seconds
                try:
                    proc.wait(max(0.0, min(due, limit) - time.time()))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.time() >= limit:
                    print(f"soak: the session is {limit - start - args.minutes * 60:.0f} s overdue: stopping it",
                          file=sys.stderr)
                    break
                samples.append(take_sample(start, guard, session.run_dir, session.records))
                print(row(samples[-1]), flush=True)
        finally:
            _stop(proc)
    session.status = proc.returncode
    samples.append(take_sample(start, None, session.run_dir, session.records))
    print(row(samples[-1]) + "   (after the guard exited)\n")


def verdict(session: Session, args: argparse.Namespace) -> dict[str, Any]:
    """Growth, survival, trips and failed operations, in sentences, and whether all passed."""
    lines, bounded = judge(session.samples, args.rss_growth_pct, args.fd_growth)
    ok = bounded
    agent = session.records.done
    if agent is None:
        lines.append(f"the agent did NOT finish its session (no final record); the guard exited {session.status}: "
                     f"see {session.base / 'guard.err'} and {session.run_dir / 'stderr.log'}")
        ok = False
    elif session.status != agent["status"]:
        lines.append(f"the guard exited {session.status}, but the agent ended with {agent['status']}: "
                     "NOT passed through")
        ok = False
    else:
        lines.append(f"the guard survived: it exited {session.status}, the agent's status, "
                     f"after {agent['turns']} turns")
    trips = []
    if (session.run_dir / "ledger.json").exists():
        trips = json.loads((session.run_dir / "ledger.json").read_text()).get("trips", [])
    if trips:
        lines.append(f"the breaker tripped {len(trips)} time(s) on a clean agent: "
                     + "; ".join(f"{t.get('rule')} at step {t.get('step')}" for t in trips[:5]))
        ok = False
    failed = [r for r in session.records.all if not r["ok"]]
    if failed:
        lines.append(f"{len(failed)} operation(s) failed; the first: {failed[0]['op']}: {failed[0].get('error')}")
        ok = False
    return {"verdict": lines, "bounded": bounded, "guard_exit": session.status, "agent": agent, "trips": trips,
            "failed_ops": failed[:50], "ok": ok}


def main(argv: list[str] | None = None) -> int:
    """Run the session, sample it, print the table and the verdict, write JSON and PNG."""
    args = _arguments(argv)
    if os.geteuid() != 0:
        print("soak: run as root (guard run isolates the agent as in CI)", file=sys.stderr)
        return 69
    base = Path(tempfile.mkdtemp(prefix="guardfs-soak-"))
    ws = make_workspace(base)
    session = Session(base, ws, base / "run", Records(ws / LATENCY))
    print(f"soak: {args.minutes:g} min, idle gaps {15 * args.gap_scale:g}-{120 * args.gap_scale:g} s, a sample "
          f"every {args.sample_seconds:g} s; workspace {ws}, run directory {session.run_dir}\n")
    print(HEAD, flush=True)
    run_session(args, session)
    result = verdict(session, args)
    ops = per_op(session.records.all)
    print(f"{'operation':<14} {'count':>6} {'failed':>6} {'median ms':>10} {'p99 ms':>8} "
          f"{'median, 1st third':>18} {'median, last third':>19}")
    for op, s in ops.items():
        print(f"{op:<14} {s['count']:>6} {s['failed']:>6} {s['median_ms']:>10.2f} {s['p99_ms']:>8.2f} "
              f"{s['median_first_third_ms']:>18.2f} {s['median_last_third_ms']:>19.2f}")
    print("\n" + "\n".join(result["verdict"]))

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "samples": [asdict(s) for s in session.samples], "per_op": ops, **result}, indent=1))
    written = [str(args.out / "soak.json")]
    if plot(session.samples, args.out / "soak.png"):
        written.append(str(args.out / "soak.png"))
    else:
        print("matplotlib is not installed (pip install -e '.[bench]'): no soak.png")
    print(f"written: {', '.join(written)}")
    if result["ok"] and not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"kept: {base} (workspace, run directory, guard.out, guard.err)")
    return 0 if result["ok"] else 1

if __name__ == "__main__":
    sys.exit(main())
