"""What a root guard's connect judge pays to take on the caller's credentials, per connect.

Usage: .venv/bin/python bench/connect_creds.py [--calls 20000]

``sandbox.launch.sockets`` reads the caller's uid, gid and groups from ``/proc/<tid>/status``
at every connect (never cached: a thread changes its credentials between two connects). This
times, on a real child process: the read as it was before issue 22 (text mode, every line
split), the read now (one ``read`` of bytes, three lines looked up), the kernel's part alone
(``open`` + one 4 KiB ``read`` + ``close``), and, as root, the whole ``_as_caller`` (the read
plus the nine system calls that switch this thread's credentials and back). Median and p99 in
microseconds; JSON in ``bench/results/connect_creds.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import subprocess
import sys

from common import ROOT, timed

from sandbox.launch.sockets import _as_caller, _status_ids


def _before(tid: int) -> tuple[int, int, list[int]]:
    """``_status_ids`` as it was before issue 22 (the reference)."""
    uid = gid = -1
    groups: list[int] = []
    with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key == "Uid":
                uid = int(value.split()[1])
            elif key == "Gid":
                gid = int(value.split()[1])
            elif key == "Groups":
                groups = [int(g) for g in value.split()]
    if uid < 0 or gid < 0:
        raise OSError(errno.ESRCH, "the caller's credentials could not be read")
    return uid, gid, groups


def _kernel(tid: int) -> None:
    fd = os.open(f"/proc/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.read(fd, 4096)
    finally:
        os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as child:
        try:
            pid = child.pid
            assert _before(pid) == _status_ids(pid)
            rows = {"before (text, every line)": timed(lambda _: _before(pid), args.calls),
                    "now (bytes, one read, three lines)": timed(lambda _: _status_ids(pid), args.calls),
                    "the kernel's part (open, read 4 KiB, close)": timed(lambda _: _kernel(pid), args.calls)}
            if os.geteuid() == 0:
                def whole(_: int) -> None:
                    with _as_caller(pid):
                        pass
                rows["_as_caller, whole (now)"] = timed(whole, args.calls)
        finally:
            with contextlib.suppress(OSError):
                child.stdin.close()  # type: ignore[union-attr]
            child.wait()
    width = max(map(len, rows))
    print(f"{'per connect':<{width}}  median µs   p99 µs")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_us']:9.1f}  {row['p99_us']:7.1f}")
    before, now = rows["before (text, every line)"], rows["now (bytes, one read, three lines)"]
    print(f"ratio before/now (median): {before['median_us'] / now['median_us']:.2f}x")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "connect_creds.json").write_text(json.dumps({"calls": args.calls, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
