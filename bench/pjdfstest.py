"""pjdfstest through ``guard mount`` with an allow-all manifest: which POSIX checks fail, and why.

Not a test of the suite: pjdfstest needs the network to fetch and autotools to build. Given a
built checkout (``git clone https://github.com/pjd/pjdfstest; autoreconf -ifs; ./configure;
make pjdfstest``), this runs ``prove -r`` of its tests inside a fresh mount, as root, and
prints the failures per test file (JSON in ``bench/results/pjdfstest.json``). With
``--no-devices`` the tests run from a copy whose type loops leave out block and character
devices (which the mount refuses by design, EPERM), so what is left is the set-ID rule
(SECURITY.md, "Set-ID bits"), the few device nodes made outside those loops (``unlink/00``,
``mknod/02``, ``mknod/03``) and anything else worth a look. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = """
[task]
id = "pjdfstest"
goal = "Run pjdfstest through the mount"
[paths]
allowed = ["**"]
generated = []
[limits]
max_files = "unlimited"
max_rewrites = "unlimited"
max_returns = "unlimited"
"""
_FAILED = re.compile(r"^(\S+\.t)\s+\(Wstat: \d+ Tests: (\d+) Failed: (\d+)\)", re.MULTILINE)
_TOTAL = re.compile(r"^Files=(\d+), Tests=(\d+)", re.MULTILINE)


def without_devices(tests: Path, into: Path) -> Path:
    """A copy of pjdfstest's *tests* whose type loops leave out block and char devices; the plan
    of each changed file is printed at its end (TAP allows it), counted as the tests ran."""
    shutil.copytree(tests, into)
    for t in into.rglob("*.t"):
        text = t.read_text()
        if " block char" not in text:
            continue
        text = re.sub(r"^(\s*for type\d? in .*) block char", r"\1", text, flags=re.MULTILINE)
        text = re.sub(r'^(\s*)echo "1\.\.\d+"', r"\1:", text, flags=re.MULTILINE)
        t.write_text(text + 'echo "1..$((ntest-1))"\n')
    for name in ("11.t",):  # mknod/11.t: device nodes only
        (into / "mknod" / name).unlink(missing_ok=True)
    return into


def main() -> int:
    """Mount, run prove, unmount, report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pjdfstest", type=Path, help="a built pjdfstest checkout (holding pjdfstest and tests/)")
    parser.add_argument("--no-devices", action="store_true", help="leave block and char devices out of the loops")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("pjdfstest needs root (it changes owners and switches users)", file=sys.stderr)
        return 77
    if not (args.pjdfstest / "pjdfstest").is_file():
        print(f"{args.pjdfstest}/pjdfstest is missing: build it first (see this file's docstring)", file=sys.stderr)
        return 66
    with tempfile.TemporaryDirectory(prefix="guardfs-pjdfstest-") as tmp:
        work = Path(tmp)
        tests = args.pjdfstest / "tests"
        if args.no_devices:
            (work / "suite").mkdir()
            shutil.copy(args.pjdfstest / "pjdfstest", work / "suite/pjdfstest")
            tests = without_devices(tests, work / "suite/tests")
        (work / "backing").mkdir()
        (work / "mnt").mkdir()
        (work / "manifest.toml").write_text(MANIFEST)
        guard = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", "--manifest", str(work / "manifest.toml"),
                                  str(work / "backing"), str(work / "mnt")], cwd=ROOT)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(work / "mnt"):
                if guard.poll() is not None or time.monotonic() > deadline:
                    print("guard mount did not come up", file=sys.stderr)
                    return 70
                time.sleep(0.05)
            started = time.monotonic()
            # prove exits 1 when any check fails: its summary is the result.
            out = subprocess.run(["prove", "-r", str(tests)], cwd=work / "mnt", capture_output=True, text=True,
                                 check=False).stdout
            took = time.monotonic() - started
        finally:
            guard.send_signal(signal.SIGTERM)
            guard.wait(timeout=60)
    failed = {m[1].rpartition("/tests/")[2]: int(m[3]) for m in _FAILED.finditer(out)}
    total = _TOTAL.search(out)
    tests_run = int(total[2]) if total else 0
    for name, n in sorted(failed.items()):
        print(f"{name:<24} {n:>5} failed")
    print(f"{'total':<24} {sum(failed.values()):>5} failed of {tests_run} ({took:.0f} s)")
    results = ROOT / "bench/results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "pjdfstest.json").write_text(json.dumps(
        {"no_devices": args.no_devices, "tests": tests_run, "failed": failed, "seconds": round(took)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
