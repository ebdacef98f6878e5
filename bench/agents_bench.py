"""What the agent adapters cost: a hook call per tool call, and the output parser's speed.

Usage: .venv/bin/python bench/agents_bench.py [--hooks 60] [--repeat 2000]

- hook: the hook as guard run registers it for the agents (the compiled helper, and the
  ``python3 -S -E fasthook.py`` fallback), a new process per tool call with JSON on stdin,
  against a live daemon, from process start to exit: median and p99 in ms.
- parser: the Claude Code stream-json parser over the captured stream (with partial
  messages), in lines per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import daemon_in_thread

from sandbox.agents import fasthook
from sandbox.agents.hooks import compiled_helper
from sandbox.agents.parsers import make_parser

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/claude-code/stream-json.partial-messages.jsonl"
MANIFEST = """
[task]
id = "bench"
goal = "Benchmark the hook"
[paths]
allowed = ["src/checkout/"]
[limits]
max_identical_calls = "unlimited"
"""


def hook_latency(n: int, argv: list[str]) -> dict[str, float]:
    """Run the hook (*argv*) n times against a daemon serving in a thread."""
    session = daemon_in_thread(MANIFEST)
    daemon = session.daemon
    ws = daemon.run_dir.parent / "ws"
    samples = []
    for i in range(n):
        event = {"hook_event_name": "PreToolUse", "tool_name": "Write", "cwd": str(ws),
                 "tool_input": {"file_path": f"src/checkout/f{i}.py", "content": "x = 1\n"}}
        t0 = time.perf_counter()
        proc = subprocess.run(argv, input=json.dumps(event), check=False,
                              capture_output=True, text=True, env={"GUARD_SOCKET": str(daemon.agent_path),
                                                                   "PATH": "/usr/bin:/bin"})
        samples.append((time.perf_counter() - t0) * 1000)
        assert proc.returncode == 0, proc.stderr
    session.close()
    samples.sort()
    return {"median_ms": statistics.median(samples), "p99_ms": samples[int(len(samples) * 0.99)],
            "calls": n}


def parser_throughput(repeat: int) -> dict[str, float]:
    """Lines per second of the Claude Code parser."""
    lines = FIXTURE.read_bytes().splitlines() * repeat
    parser = make_parser("claude-stream-json")
    t0 = time.perf_counter()
    for line in lines:
        parser.feed(line)
    elapsed = time.perf_counter() - t0
    return {"lines": len(lines), "lines_per_s": len(lines) / elapsed,
            "mib_per_s": sum(map(len, lines)) / elapsed / (1 << 20)}


def main() -> int:
    """Measure, print, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hooks", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/agents.json")
    args = parser.parse_args()
    helper = compiled_helper()
    hooks = {"python": hook_latency(args.hooks, [sys.executable, "-S", "-E", fasthook.__file__, "claude"])}
    if helper is not None:
        hooks["compiled"] = hook_latency(args.hooks, [str(helper), "claude"])
    parse = parser_throughput(args.repeat)
    for name, hook in hooks.items():
        print(f"hook ({name}) per tool call, process start included: median {hook['median_ms']:.2f} ms, "
              f"p99 {hook['p99_ms']:.2f} ms over {hook['calls']} calls")
    print(f"Claude Code stream-json parser: {parse['lines_per_s']:,.0f} lines/s "
          f"({parse['mib_per_s']:.1f} MiB/s) over {parse['lines']:,} lines")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"hook": hooks, "parser": parse}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
