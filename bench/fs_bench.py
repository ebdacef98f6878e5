"""guardfs against the native filesystem, measured in the same run, reported as ratios.

Usage (as root, which the loop-mounted ext4 needs):

    .venv/bin/python bench/fs_bench.py [--repeat 3] [--json bench/results/fs.json]

Both sides live on one journaled ext4 made in a loop file for this run (the machine's root
ext4 has no journal and drifts after mass deletes): ``native/`` is used directly,
``backing/`` through ``guard mount`` at ``mnt/``. The source tree is CPython's standard
library (>= 2,000 files). Kernel caches are dropped before each "first walk" workload.
Also measured: the decision's own cost per operation (policy + limits decider), in
process, without FUSE.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from guardfs.decision import Request
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = """
[task]
id = "bench"
goal = "Benchmark the mount"
[paths]
allowed = ["**"]
forbidden = [".env*", "**/migrations/", "src/auth/root_keys.ts"]
[limits]
max_files = "unlimited"
max_rewrites = "unlimited"
"""
GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b.invalid", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b.invalid", GIT_CONFIG_NOSYSTEM="1", HOME="/nonexistent")


def sh(*args: str, cwd: Path | None = None) -> None:
    """Run a command; fail loudly."""
    subprocess.run(args, cwd=cwd, check=True, env=GIT_ENV, stdout=subprocess.DEVNULL)


def drop_caches() -> None:
    """Evict page, dentry and inode caches so the next walk is a first walk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def source_tarball(dest: Path) -> tuple[Path, int]:
    """A tarball of the standard library (no site-packages, no __pycache__)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tar = dest / "stdlib.tar"
    count = 0
    with tarfile.open(tar, "w") as tf:
        for dirpath, dirnames, filenames in os.walk(stdlib):
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
            for name in filenames:
                p = Path(dirpath) / name
                if p.is_file() and not p.is_symlink():
                    tf.add(p, arcname=str(p.relative_to(stdlib.parent)))
                    count += 1
    return tar, count


@contextmanager
def loop_ext4(size_mb: int = 3072) -> Iterator[Path]:
    """A journaled ext4 in a loop file, mounted for this run."""
    base = Path(tempfile.mkdtemp(prefix="guardfs-bench-"))
    image, mnt = base / "ext4.img", base / "fs"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    sh("mkfs.ext4", "-q", "-F", "-O", "has_journal", str(image))
    sh("mount", "-o", "loop", str(image), str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def guard_mount(backing: Path, mnt: Path, events: Path) -> Iterator[None]:
    """``guard mount`` as a user runs it."""
    manifest = backing.parent / "bench.toml"
    manifest.write_text(MANIFEST)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", "--manifest", str(manifest),
                             "--events", str(events), str(backing), str(mnt)])
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("guard mount did not come up")
            time.sleep(0.02)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def atomic_writes(where: Path, n: int = 5000) -> None:
    """n small files, each written to a temporary and renamed into place (as editors save)."""
    d = where / "atomic"
    d.mkdir(exist_ok=True)
    data = b"x" * 2048
    for i in range(n):
        tmp = d / f".f{i}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
        os.rename(tmp, d / f"f{i}")


def workloads(tar: Path) -> list[tuple[str, bool, Callable[[Path], float | None]]]:
    """(name, drop caches first, action on a workspace directory)."""
    def extract(w: Path) -> None:
        sh("tar", "-xf", str(tar), cwd=w)

    def find(w: Path) -> None:
        sh("find", ".", "-name", "*.py", cwd=w)

    def grep(w: Path) -> None:
        subprocess.run(["grep", "-r", "-c", "def ", "."], cwd=w, check=False, stdout=subprocess.DEVNULL)

    def git(w: Path) -> None:
        sh("git", "init", "-q", cwd=w)
        sh("git", "config", "gc.auto", "0", cwd=w)
        sh("git", "add", "-A", cwd=w)
        sh("git", "commit", "-q", "-m", "tree", cwd=w)

    def git_status(w: Path) -> None:
        sh("git", "status", "--porcelain", cwd=w)

    def compileall(w: Path) -> None:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "1", "."], cwd=w, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def files(w: Path) -> list[Path]:
        return sorted(w.rglob("*.py"))[:2000]

    def stat_warm(w: Path) -> float:
        paths = files(w)
        for f in paths:  # the listing and a first pass warm the caches; the second is timed
            os.stat(f)
        start = time.perf_counter()
        for f in paths:
            os.stat(f)
        return time.perf_counter() - start

    def open_close(w: Path) -> float:
        paths = files(w)
        for f in paths:
            os.stat(f)
        start = time.perf_counter()
        for f in paths:
            os.close(os.open(f, os.O_RDONLY))
        return time.perf_counter() - start

    def pytest_run(w: Path) -> None:
        tests = w / "bench_tests"
        tests.mkdir(exist_ok=True)
        for i in range(60):
            (tests / f"test_m{i}.py").write_text(
                "import json, pathlib\n\n" + "".join(
                    f"def test_{j}(tmp_path):\n    p = tmp_path / 'f'\n    p.write_text(json.dumps({j}))\n"
                    f"    assert json.loads(p.read_text()) == {j}\n\n" for j in range(5)))
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench_tests"], cwd=w,
                       check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def dd_write(w: Path) -> None:
        sh("dd", "if=/dev/zero", f"of={w / 'big'}", "bs=1M", "count=256", "status=none")

    def dd_read(w: Path) -> None:
        sh("dd", f"if={w / 'big'}", "of=/dev/null", "bs=4k", "status=none")

    def rm(w: Path) -> None:
        for entry in w.iterdir():
            sh("rm", "-rf", str(entry))

    return [
        ("tar -x (source tree)", False, extract),
        ("find, first walk", True, find),
        ("grep -r, first walk", True, grep),
        ("git init + add + commit", False, git),
        ("git status", False, git_status),
        ("python -m compileall", False, compileall),
        ("stat, warm (2,000 files)", False, stat_warm),
        ("open + close (2,000 files)", False, open_close),
        ("pytest run (300 tests)", False, pytest_run),
        ("5,000 x write + rename", False, atomic_writes),
        ("dd write 256 MiB", False, dd_write),
        ("dd read 256 MiB, bs=4k, cold", True, dd_read),
        ("rm -rf", False, rm),
    ]


def time_it(fn: Callable[[Path], float | None], where: Path, drop: bool) -> float:
    """Seconds for one run of *fn* in *where* (or the time *fn* measured itself)."""
    if drop:
        drop_caches()
    start = time.perf_counter()
    measured = fn(where)
    elapsed = time.perf_counter() - start
    return measured if measured is not None else elapsed


def decision_cost(samples: int = 200_000) -> dict[str, float]:
    """The decision's own cost per operation: policy verdict + limits decider, in process."""
    from guardfs.fs import GuardFS

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "src").mkdir()
        fs = GuardFS(tmp, parse_manifest(MANIFEST), EventLog(None))
        where = fs.policy.classify("src/checkout/tax.py", False)
        request = Request("write", "src/checkout/tax.py", where, True)
        check = fs._check  # the exact call every judged operation makes
        clock = time.perf_counter_ns
        times = []
        for _ in range(samples):
            t0 = clock()
            check(request)
            times.append(clock() - t0)
        times.sort()
        fs.close()
    return {
        "median_us": times[len(times) // 2] / 1000,
        "p99_us": times[int(len(times) * 0.99)] / 1000,
        "samples": samples,
    }


def main() -> int:
    """Run everything, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload and side; the median is reported")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/fs.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("fs_bench: needs root (loop-mounted ext4, drop_caches)", file=sys.stderr)
        return 69
    cost = decision_cost()
    print(f"decision cost per operation: median {cost['median_us']:.2f} us, p99 {cost['p99_us']:.2f} us")
    results: dict[str, dict[str, list[float]]] = {}
    with loop_ext4() as fsroot:
        tar, files = source_tarball(fsroot)
        print(f"source tree: {files} files of the standard library")
        for run in range(args.repeat):
            native, backing, mnt = fsroot / f"native{run}", fsroot / f"backing{run}", fsroot / f"mnt{run}"
            for d in (native, backing, mnt):
                d.mkdir()
            with guard_mount(backing, mnt, fsroot / f"events{run}.jsonl"):
                for name, drop, fn in workloads(tar):
                    side = results.setdefault(name, {"native": [], "guardfs": []})
                    side["native"].append(time_it(fn, native, drop))
                    side["guardfs"].append(time_it(fn, mnt, drop))
    rows = []
    print(f"\n{'workload':<36} {'native s':>9} {'guardfs s':>10} {'ratio':>7}")
    for name, side in results.items():
        n, g = statistics.median(side["native"]), statistics.median(side["guardfs"])
        rows.append({"workload": name, "native_s": n, "guardfs_s": g, "ratio": g / n})
        print(f"{name:<36} {n:>9.3f} {g:>10.3f} {g / n:>6.1f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"decision": cost, "files": files, "repeat": args.repeat, "rows": rows},
                                    indent=2))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
