"""guardfs against the native filesystem, measured in the same run, reported as ratios.

Usage (as root, which the loop-mounted ext4 needs):

    .venv/bin/python bench/fs_bench.py [--repeat 3] [--control-repeat 1] [--json bench/results/fs.json]

Every side lives on one journaled ext4 made in a loop file for this run (the machine's root
ext4 has no journal and drifts after mass deletes): ``native/`` is used directly; each FUSE
server serves its own ``backing/`` at its own mountpoint: guardfs (``guard mount``), the C
reference ``passthrough_hp`` (libfuse's example, built from the Debian source), and a plain
pyfuse3 passthrough with no policy (bench/passthrough.py) with cache timeouts 0 and 60 s.
The source tree is Django 5.2's ``django/`` package (3,660 files). Kernel caches are dropped
before each "first walk" workload. The read workloads run again inside ``guard run`` with
out-of-scope fast lanes. Also measured: the decision's own cost per operation (policy +
limits decider), in process, without FUSE.
"""

from __future__ import annotations

import argparse
import contextlib
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
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common import timed

from guardfs.decision import Request
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench"
DJANGO = "5.2"
# What libfuse's meson build would put in config.h on this system.
LANES = "guardfs + fast lanes"
HP_DEFINES = ["-DHAVE_UTIMENSAT", "-DHAVE_POSIX_FALLOCATE", "-DHAVE_SETXATTR"]
MANIFEST = """
[task]
id = "bench"
goal = "Benchmark the mount"
[paths]
allowed = ["**"]
forbidden = [".env*", "**/secrets/", "src/auth/root_keys.ts"]
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


def source_tarball(dest: Path, cache: Path) -> tuple[Path, int, str]:
    """A tarball of Django 5.2's ``django/`` package (the standard library without the network)."""
    tar = dest / "tree.tar"
    wheel = next(cache.glob(f"Django-{DJANGO}-*.whl"), None)
    if wheel is None:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(cache), f"django=={DJANGO}"], check=False)
        wheel = next(cache.glob(f"Django-{DJANGO}-*.whl"), None)
    count = 0
    with tarfile.open(tar, "w") as tf:
        if wheel is not None:
            with zipfile.ZipFile(wheel) as zf:
                for info in zf.infolist():
                    if info.filename.startswith("django/") and not info.is_dir():
                        member = tarfile.TarInfo(info.filename)
                        member.size, member.mode = info.file_size, 0o644
                        member.mtime = int(time.mktime((*info.date_time, 0, 0, -1)))
                        tf.addfile(member, zf.open(info))
                        count += 1
            return tar, count, f"Django {DJANGO}'s django/ package"
        print("fs_bench: Django could not be downloaded; using the standard library instead", file=sys.stderr)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for dirpath, dirnames, filenames in os.walk(stdlib):
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
            for name in filenames:
                p = Path(dirpath) / name
                if p.is_file() and not p.is_symlink():
                    tf.add(p, arcname=str(p.relative_to(stdlib.parent)))
                    count += 1
    return tar, count, "the standard library"


def passthrough_hp(cache: Path) -> Path | None:
    """libfuse's C reference ``passthrough_hp``, built once from the Debian source of the
    installed libfuse3 (the example is not packaged in binary form); None if that fails."""
    binary = cache / "passthrough_hp"
    if binary.exists():
        return binary
    if shutil.which("g++") is None:
        print("fs_bench: no passthrough_hp column: it is C++; install g++ (apt-get install g++)", file=sys.stderr)
        return None
    version = subprocess.run(["pkg-config", "--modversion", "fuse3"], check=False, capture_output=True,
                             text=True).stdout.strip()
    url = f"http://deb.debian.org/debian/pool/main/f/fuse3/fuse3_{version}.orig.tar.xz"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "src.tar.xz"
            with urllib.request.urlopen(url, timeout=60) as response:
                archive.write_bytes(response.read())
            with tarfile.open(archive) as tf:
                members = [m for m in tf.getmembers() if m.name.endswith(("example/passthrough_hp.cc",
                                                                          "example/cxxopts.hpp"))]
                tf.extractall(tmp, members=members, filter="data")
            source = next(Path(tmp).glob("*/example/passthrough_hp.cc"))
            flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True,
                                   check=True).stdout.split()
            compile_ = ["g++", "-O2", "-std=c++17", *HP_DEFINES, "-o", str(binary), str(source), *flags, "-lpthread"]
            subprocess.run(compile_, check=True)
    except (OSError, subprocess.CalledProcessError, StopIteration, tarfile.TarError) as err:
        print(f"fs_bench: no passthrough_hp column ({url}: {err})", file=sys.stderr)
        return None
    return binary


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
def served(command: list[str], mnt: Path) -> Iterator[None]:
    """A FUSE server started with *command*, mounted at *mnt* for the block."""
    proc = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not mount {mnt}")
            time.sleep(0.02)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


Side = Callable[[Path, Path], list[str]]


def sides(hp: Path | None) -> dict[str, Side]:
    """The FUSE servers compared with native: name -> command(backing, mountpoint)."""
    control = str(ROOT / "bench" / "passthrough.py")

    def guardfs(backing: Path, mnt: Path) -> list[str]:
        manifest = backing.parent / "bench.toml"
        manifest.write_text(MANIFEST)
        return [sys.executable, "-m", "sandbox", "mount", "--manifest", str(manifest),
                "--events", str(backing.parent / f"{backing.name}.events.jsonl"), str(backing), str(mnt)]

    found: dict[str, Side] = {"guardfs": guardfs}
    if hp is not None:
        found["passthrough_hp (C)"] = lambda b, m: [str(hp), "--foreground", str(b), str(m)]
    found["pyfuse3 passthrough"] = lambda b, m: [sys.executable, control, str(b), str(m)]
    found["pyfuse3, 60 s timeouts"] = lambda b, m: [sys.executable, control, "--timeout", "60", str(b), str(m)]
    return found


#: The same tree with the task scoped to src/checkout/ and out-of-scope trees as fast lanes:
#: django/ is then read natively inside guard run's sandbox. The forbidden patterns are
#: anchored: one that matches at any depth ('.env*') leaves no lanes (sandbox.launch.lanes).
LANES_MANIFEST = MANIFEST.replace('allowed = ["**"]', 'allowed = ["src/checkout/**"]').replace(
    '".env*", "**/secrets/"', '"/.env*", "src/**/secrets/"') + """
[sandbox]
out_of_scope_fast_lanes = true
"""
#: The workloads that only read, measured again through fast lanes. (Not the first walks:
#: planning the lanes walks the tree for forbidden paths, so a lanes run never starts cold.)
LANE_WORKLOADS = ("git status", "repeated walk: find + grep -r + git status", "stat, warm (2,000 files)",
                  "open + close (2,000 files)")


def lanes_side(fsroot: Path, tar: Path, run: int) -> dict[str, tuple[float, float]]:
    """The read workloads natively and inside ``guard run`` with fast lanes, on one tree
    prepared natively as a clone would be (extracted, committed, objects packed):
    name -> (native s, guarded s)."""
    ws = fsroot / f"lanes{run}"
    (ws / "src/checkout").mkdir(parents=True)
    sh("tar", "-xf", str(tar), cwd=ws)
    steps = (["init", "-q"], ["config", "gc.auto", "0"], ["add", "-A"], ["commit", "-q", "-m", "tree"], ["gc", "-q"])
    for step in steps:
        sh("git", *step, cwd=ws)
    manifest = fsroot / "lanes.toml"
    manifest.write_text(LANES_MANIFEST)
    out: dict[str, tuple[float, float]] = {}
    for name, drop, fn in workloads(tar):
        if name not in LANE_WORKLOADS:
            continue
        native = time_it(fn, ws, drop)
        if drop:
            drop_caches()
        run_dir = fsroot / f"lanes-run{run}-{len(out)}"
        done = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest),
                               "--run-dir", str(run_dir), "--workspace", str(ws), "--",
                               sys.executable, str(Path(__file__).resolve()), "--inner", name],
                              check=False, cwd=ws, capture_output=True, text=True, env=GIT_ENV)
        if done.returncode != 0:
            raise RuntimeError(f"guard run of {name!r} failed ({done.returncode}):\n{done.stderr}")
        out[name] = (native, float((run_dir / "stdout.log").read_text().split()[-1]))
    return out


def inner(name: str) -> int:
    """Inside guard run: time one workload in the current directory and print the seconds."""
    fn = next(fn for n, _, fn in workloads(Path("/nonexistent")) if n == name)
    print(time_it(fn, Path.cwd(), False))
    return 0


def atomic_writes(where: Path, n: int = 5000) -> None:
    """n small files, each written to a temporary and renamed into place (as editors save)."""
    d = where / "atomic"
    d.mkdir(exist_ok=True)
    data = b"x" * 4096
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

    def dd_read_warm(w: Path) -> float:
        dd_read(w)
        start = time.perf_counter()
        dd_read(w)
        return time.perf_counter() - start

    def repeated_walk(w: Path) -> float:
        def walk() -> None:
            find(w)
            grep(w)
            git_status(w)

        walk()  # the first walk fills the caches; the second is timed
        start = time.perf_counter()
        walk()
        return time.perf_counter() - start

    def rm(w: Path) -> None:
        for entry in w.iterdir():
            sh("rm", "-rf", str(entry))

    return [
        ("tar -x (source tree)", False, extract),
        ("find, first walk", True, find),
        ("grep -r, first walk", True, grep),
        ("git init + add + commit", False, git),
        ("git status", False, git_status),
        ("repeated walk: find + grep -r + git status", False, repeated_walk),
        ("python -m compileall", False, compileall),
        ("stat, warm (2,000 files)", False, stat_warm),
        ("open + close (2,000 files)", False, open_close),
        ("pytest run (300 tests)", False, pytest_run),
        ("5,000 x write + rename", False, atomic_writes),
        ("dd write 256 MiB", False, dd_write),
        ("dd read 256 MiB, bs=4k, cold", True, dd_read),
        ("dd read 256 MiB, bs=4k, warm", False, dd_read_warm),
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
    from sandbox.session import Session

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "src").mkdir()
        session = Session(parse_manifest(MANIFEST), tmp, EventLog(None))  # as guard mount builds it
        fs = session.fs
        where = fs.policy.classify("src/checkout/tax.py", False)
        request = Request("write", "src/checkout/tax.py", where, True)
        check = fs.gate.check  # the exact call every judged operation makes
        cost = timed(lambda _: check(request), samples)
        session.close()
    return cost | {"samples": samples}


def main() -> int:
    """Run everything, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload and side; the median is reported")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/fs.json")
    parser.add_argument("--only", action="append", default=[], metavar="SIDE",
                        help="measure only this FUSE side (repeatable): guardfs, 'passthrough_hp (C)', ...")
    parser.add_argument("--control-repeat", type=int, default=1,
                        help="runs of the control servers (C, plain pyfuse3); they are references, not the subject")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args.inner)
    if os.geteuid() != 0:
        print("fs_bench: needs root (loop-mounted ext4, drop_caches)", file=sys.stderr)
        return 69
    cost = decision_cost()
    print(f"decision cost per operation: median {cost['median_us']:.2f} us, p99 {cost['p99_us']:.2f} us")
    servers = sides(passthrough_hp(CACHE))
    if args.only:
        servers = {name: cmd for name, cmd in servers.items() if name in args.only}
    results: dict[str, dict[str, list[float]]] = {}
    with loop_ext4() as fsroot:
        tar, files, what = source_tarball(fsroot, CACHE)
        print(f"source tree: {files} files of {what}")
        for run in range(args.repeat):
            places = {"native": fsroot / f"native{run}"}
            with contextlib.ExitStack() as stack:
                places["native"].mkdir()
                for i, (name, command) in enumerate(servers.items()):
                    if name != "guardfs" and run >= args.control_repeat:
                        continue
                    backing, mnt = fsroot / f"backing{run}.{i}", fsroot / f"mnt{run}.{i}"
                    backing.mkdir()
                    mnt.mkdir()
                    stack.enter_context(served(command(backing, mnt), mnt))
                    places[name] = mnt
                for workload, drop, fn in workloads(tar):
                    for name, where in places.items():
                        results.setdefault(workload, {}).setdefault(name, []).append(time_it(fn, where, drop))
            for name, (native, guarded) in lanes_side(fsroot, tar, run).items():
                results[name].setdefault("native, lanes tree", []).append(native)
                results[name].setdefault(LANES, []).append(guarded)
            print(f"run {run + 1} of {args.repeat} done", file=sys.stderr)
    rows = []
    names = ["native", *servers, LANES]
    print(f"\n{'workload':<44} {'native s':>9}" + "".join(f" {n[:22]:>22}" for n in names[1:]))
    for workload, measured in results.items():
        medians = {name: statistics.median(times) for name, times in measured.items()}
        ratios = {name: medians[name] / medians["native"] for name in names[1:-1] if name in medians}
        if LANES in medians:  # against native on its own tree, measured beside it
            ratios[LANES] = medians[LANES] / medians["native, lanes tree"]
        rows.append({"workload": workload, "seconds": medians, "ratio": ratios})
        print(f"{workload:<44} {medians['native']:>9.3f}"
              + "".join(f" {ratios[n]:>21.1f}x" if n in ratios else f" {'-':>22}" for n in names[1:]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"decision": cost, "files": files, "tree": what, "repeat": args.repeat,
                                     "rows": rows}, indent=2))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
