"""An agent's working day in a real repository: native, under guard run, and over passthrough_hp.

Usage (as root, which the loop-mounted ext4 and guard run's isolation need):

    .venv/bin/python bench/workday.py [--quick] [--repeat 1] [--modes native,guard,guard-fuse,passthrough_hp]
                                      [--manifest MODE=PATH] [--json bench/results/workday.json]

The repository is Django 5.2's source distribution (about 6,900 files: ``django/``, its test
suite, the docs), fetched once with pip into ``.cache/bench/workday/`` with the wheels its
editable install needs, so the day itself runs offline. It is extracted, committed and packed
as a clone would be, on a journaled ext4 in a loop file, and copied afresh for every side.
The day, in the order an agent runs it: ``git status``, ``grep -r``, ``find``, a venv and
``pip install -e .`` (from the local wheels), the test suite (a subset of Django's
``runtests.py`` apps), ``ruff`` and ``mypy`` with their caches (cold, and again after the
edits), ten edits in ``django/utils/``, ``git diff``, ``git add``, ``git commit``.

Sides, in the same run, each reported per step and for the whole day as a ratio to native:

- ``native``: the tree used directly;
- ``guard``: inside ``guard run --ci`` with the manifest's default settings (the task scoped
  to ``django/utils/`` and ``tests/utils_tests/``; what guard binds natively by default, it
  binds);
- ``guard-fuse``: the same with everything through the mount (no fast lanes and, when the
  manifest knows them, no native binds of generated directories);
- ``passthrough_hp``: libfuse's C reference over a copy of the tree (the floor of FUSE);
- ``guard-lanes`` (only when named in ``--modes``): ``guard`` with ``out_of_scope_fast_lanes``
  (every directory wholly outside the task's scope read natively; while the built-in manifest
  allows unanchored cache patterns, guard plans no lanes and says so).

``--manifest MODE=PATH`` replaces a guard side's manifest (for example to measure a manifest
of your own). Kernel caches are dropped before each side's day. Each guard side also reports
its breaker trips: a trip is a finding (the day is clean work in scope).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fs_bench import CACHE, GIT_ENV, drop_caches, loop_ext4, passthrough_hp, served, sh

from guardfs.manifest import Paths, SandboxSettings

ROOT = Path(__file__).resolve().parent.parent
WHEELS = CACHE / "workday"
DJANGO = "5.2"
#: What the editable install of Django 5.2 needs, from local wheels: its build backend
#: (setuptools pinned below 69.3 by its pyproject) and its two runtime dependencies.
REQUIREMENTS = ["setuptools>=61,<69.3", "wheel", "asgiref>=3.8.1", "sqlparse>=0.3.1"]
#: Apps of Django's own test suite: about a minute natively for the full day, seconds for --quick.
TESTS = ["utils_tests", "template_tests", "forms_tests", "queries", "model_fields", "expressions", "lookup",
         "aggregation", "migrations", "validators", "i18n", "humanize_tests", "model_forms", "admin_changelist"]
QUICK_TESTS = ["utils_tests"]
#: Django's own .gitignore (the repository's, which the sdist leaves out).
DJANGO_GITIGNORE = """*.egg-info
*.pot
*.py[co]
.tox/
__pycache__
MANIFEST
dist/
docs/_build/
docs/locale/
node_modules/
tests/coverage_html/
tests/.coverage*
build/
tests/report/
tests/screenshots/
"""
MODES = ("native", "guard", "guard-fuse", "guard-lanes", "passthrough_hp")
GUARD_MODES = ("guard", "guard-fuse", "guard-lanes")
DEFAULT_MODES = ("native", "guard", "guard-fuse", "passthrough_hp")
ALLOWED = ["django/utils/", "tests/utils_tests/", ".venv/"]
#: Until the manifest has generated territory (issue 13), the caches and build outputs the day
#: writes must be allowed outright, and uncounted, or the clean day trips the breaker: pip's
#: install passes max_files, and mypy's SQLite cache, rewritten in place, trips oscillation.
GENERATED_STANDIN = ["**/__pycache__/", "Django.egg-info/", "build/", ".mypy_cache/", ".ruff_cache/"]
#: And mypy's default SQLite cache brings its -wal file back to an earlier content, which trips
#: oscillation whatever max_rewrites says: without generated territory, every side of the day
#: runs mypy with its per-module JSON cache instead (the same on every side, so ratios hold).
MYPY_STANDIN = [] if "generated" in Paths.model_fields else ["--no-sqlite-cache"]
#: Manifest switches that make guard run bind trees natively, and the value that turns each off;
#: only those this checkout's manifest knows are written.
NATIVE_SWITCHES = {"out_of_scope_fast_lanes": "false", "fast_lanes": "[]", "native_generated": "false"}


def manifest_text(mode: str) -> str:
    """The task's manifest for a guard side: default settings (guard), everything through the
    mount (guard-fuse), or out-of-scope fast lanes on (guard-lanes)."""
    allowed = list(ALLOWED)
    limits = ""
    if "generated" not in Paths.model_fields:
        allowed += GENERATED_STANDIN
        limits = '[limits]\nmax_files = "unlimited"\nmax_rewrites = "unlimited"\n'
    text = (f'[task]\nid = "workday"\ngoal = "Tidy django.utils helpers and keep the tests passing"\n\n'
            f"[paths]\nallowed = {json.dumps(allowed)}\nforbidden = [\".env*\"]\n\n{limits}")
    if mode == "guard-lanes":
        text += "\n[sandbox]\nout_of_scope_fast_lanes = true\n"
    if mode == "guard-fuse":
        switches = [f"{k} = {v}" for k, v in NATIVE_SWITCHES.items() if k in SandboxSettings.model_fields]
        text += "\n[sandbox]\n" + "\n".join(switches) + "\n"
    return text


def fetch(cache: Path) -> Path:
    """Django's source distribution and the wheels of its editable install, downloaded once."""
    sdist = cache / f"Django-{DJANGO}.tar.gz"
    if sdist.exists() and len(list(cache.glob("*.whl"))) >= len(REQUIREMENTS):
        return sdist
    cache.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(cache)]
    subprocess.run([*pip, "--no-deps", "--no-binary", ":all:", f"django=={DJANGO}"], check=True)
    subprocess.run([*pip, "--only-binary", ":all:", *REQUIREMENTS], check=True)
    return sdist


def make_template(sdist: Path, where: Path) -> Path:
    """The repository as a clone would leave it: extracted, committed, packed."""
    with tarfile.open(sdist) as tf:
        tf.extractall(where, filter="data")
    repo = where / "template"
    (where / f"Django-{DJANGO}").rename(repo)
    shutil.rmtree(repo / "Django.egg-info", ignore_errors=True)  # the sdist's, which an install rewrites
    # The sdist has no .gitignore; Django's repository does, and an agent's `git add -A` relies on
    # it: without it, bytecode (which under guard lives only in the run's scratch layer) would be
    # staged, and the index update refused.
    (repo / ".gitignore").write_text(DJANGO_GITIGNORE)
    for step in (["init", "-q"], ["config", "gc.auto", "0"], ["add", "-A"], ["commit", "-q", "-m", "Django 5.2"],
                 ["gc", "-q"]):
        sh("git", *step, cwd=repo)
    return repo


# ----- the day, run in the repository (natively, in the mount, or inside guard run) ----------

def day_steps(tests: list[str], quick: bool) -> list[tuple[str, Callable[[], int]]]:
    """(name, action returning an exit status), in the order an agent runs them, in the cwd."""
    env = dict(GIT_ENV, PIP_CONFIG_FILE="/dev/null", PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_FIND_LINKS", None)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the day's Python writes bytecode, as Python does by default
    tools = Path(sys.executable).parent  # the bench's own ruff and mypy

    def run(*argv: str) -> Callable[[], int]:
        return lambda: subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      check=False).returncode

    base = getattr(sys, "_base_executable", sys.executable)
    typed = ["django/utils/text.py", "django/utils/html.py"] if quick else ["django/utils/"]
    mypy = run(str(tools / "mypy"), "--ignore-missing-imports", "--follow-imports=silent", *MYPY_STANDIN,
               "--python-executable", ".venv/bin/python", *typed)
    ruff = run(str(tools / "ruff"), "check", "-q", "--exit-zero", "django", "tests")

    def edits() -> int:
        targets = sorted(Path("django/utils").glob("*.py"))[:10]
        for i, path in enumerate(targets):  # read, change, write back in place: an agent's Edit
            text = path.read_text()
            path.write_text(text + f"\n\ndef _workday_{i}(value):\n    \"\"\"Edit {i} of the day.\"\"\"\n"
                                   f"    return value\n")
        return 0

    return [
        ("git status", run("git", "status", "--porcelain")),
        ("grep -r", run("grep", "-rn", "--exclude-dir=.git", "def get_", ".")),
        ("find", run("find", ".", "-name", "*.py", "-not", "-path", "./.git/*")),
        ("python -m venv", run(base, "-m", "venv", ".venv")),
        ("pip install -e .", run(".venv/bin/python", "-m", "pip", "install", "-q", "--no-index", "--find-links",
                                 str(WHEELS), "-e", ".")),
        ("test suite", run(".venv/bin/python", "tests/runtests.py", "--parallel", "1", *tests)),
        ("ruff, cold cache", ruff),
        ("mypy, cold cache", mypy),
        ("ten edits in scope", edits),
        ("ruff, warm cache", ruff),
        ("mypy, warm cache", mypy),
        ("git diff", run("git", "diff", "--stat")),
        ("git add", run("git", "add", "-A", "django/utils")),
        ("git commit", run("git", "commit", "-q", "-m", "Tidy django.utils")),
    ]


def inner(tests: list[str], quick: bool) -> int:
    """Run the day in the current directory; one JSON line per step (name, seconds, status)."""
    for name, action in day_steps(tests, quick):
        start = time.perf_counter()
        status = action()
        print(json.dumps({"step": name, "seconds": time.perf_counter() - start, "status": status}), flush=True)
    return 0


def parse_day(out: str) -> dict[str, dict[str, Any]]:
    """The step records a day printed."""
    return {rec["step"]: rec for rec in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}


# ----- the sides ------------------------------------------------------------------------------

def day_here(where: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The day run directly in *where* (native, or a FUSE mountpoint)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *inner_args(args)], cwd=where,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the day failed in {where} ({done.returncode}):\n{done.stderr}")
    return parse_day(done.stdout)


def inner_args(args: argparse.Namespace) -> list[str]:
    """The arguments of the day as this program runs it in its repository."""
    return ["--inner", *(["--quick"] if args.quick else []), "--tests", ",".join(args.tests)]


def day_guarded(ws: Path, run_dir: Path, manifest: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The day inside ``guard run --ci``: its steps, guard's whole wall time, status and trips."""
    argv = [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
            "--workspace", str(ws), "--", sys.executable, str(Path(__file__).resolve()), *inner_args(args)]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ws, capture_output=True, text=True, env=GIT_ENV, check=False)
    wall = time.perf_counter() - start
    out = (run_dir / "stdout.log").read_text() if (run_dir / "stdout.log").exists() else ""
    ledger = run_dir / "ledger.json"
    trips = json.loads(ledger.read_text())["trips"] if ledger.exists() else []
    if done.returncode != 0:
        print(f"workday: guard run exited {done.returncode} ({len(trips)} trips):\n{done.stderr[-2000:]}",
              file=sys.stderr)
    return {"steps": parse_day(out), "wall": wall, "exit": done.returncode,
            "trips": [{k: t.get(k) for k in ("rule", "path", "step")} for t in trips]}


def one_round(fsroot: Path, template: Path, hp: Path | None, manifests: dict[str, Path], args: argparse.Namespace,
              rnd: int) -> dict[str, dict[str, Any]]:
    """Every side's day once, each on its own fresh copy of the repository."""
    out: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        base = fsroot / f"r{rnd}-{mode}"
        base.mkdir()
        ws = base / "repo"
        sh("cp", "-a", str(template), str(ws))
        drop_caches()
        if mode == "native":
            start = time.perf_counter()
            out[mode] = {"steps": day_here(ws, args), "exit": 0, "trips": []}
            out[mode]["wall"] = time.perf_counter() - start
        elif mode == "passthrough_hp":
            if hp is None:
                continue
            mnt = base / "mnt"
            mnt.mkdir()
            with served([str(hp), "--foreground", str(ws), str(mnt)], mnt):
                start = time.perf_counter()
                out[mode] = {"steps": day_here(mnt, args), "exit": 0, "trips": []}
                out[mode]["wall"] = time.perf_counter() - start
        else:
            out[mode] = day_guarded(ws, base / "run", manifests[mode], args)
        print(f"workday: round {rnd + 1}: {mode} done in {out[mode]['wall']:.1f} s", file=sys.stderr)
    return out


def table(rounds: list[dict[str, dict[str, Any]]], modes: list[str]) -> list[dict[str, Any]]:
    """Median seconds per step and side over the rounds, and ratios to native; printed."""
    modes = [m for m in modes if all(m in r for r in rounds)]
    steps = list(rounds[0]["native"]["steps"])
    rows: list[dict[str, Any]] = []
    for step in [*steps, "whole day (sum of steps)", "whole day (wall, guard start and stop incl.)"]:
        secs: dict[str, float] = {}
        status: dict[str, Any] = {}
        for mode in modes:
            if step.startswith("whole day") and any(len(r[mode]["steps"]) < len(steps) for r in rounds):
                continue  # a day stopped early has no whole-day time to compare
            if step.startswith("whole day (sum"):
                values = [sum(s["seconds"] for s in r[mode]["steps"].values()) for r in rounds]
            elif step.startswith("whole day (wall"):
                values = [r[mode]["wall"] for r in rounds]
            else:
                recs = [r[mode]["steps"].get(step) for r in rounds]
                if any(rec is None for rec in recs):
                    continue  # the day stopped before this step on that side
                values = [rec["seconds"] for rec in recs if rec is not None]
                status[mode] = [rec["status"] for rec in recs if rec is not None]
            secs[mode] = statistics.median(values)
        ratios = {m: secs[m] / secs["native"] for m in modes[1:] if m in secs and secs["native"] > 0}
        rows.append({"step": step, "seconds": secs, "ratio": ratios, "status": status})
    print(f"\n{'step':<46} {'native s':>9}" + "".join(f" {m:>15}" for m in modes[1:]))
    for row in rows:
        cells = "".join(f" {row['ratio'][m]:>14.2f}x" if m in row["ratio"] else f" {'stopped':>15}"
                        for m in modes[1:])
        print(f"{row['step']:<46} {row['seconds']['native']:>9.2f}{cells}")
    return rows


def main() -> int:
    """Prepare the repository, run every side's day, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one test app and a two-file mypy: a small day")
    parser.add_argument("--repeat", type=int, default=1, help="days per side; the median is reported")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--manifest", action="append", default=[], metavar="MODE=PATH",
                        help="use this manifest for a guard side (guard, guard-fuse, guard-lanes) instead of the "
                             "built-in one")
    parser.add_argument("--tests", help="comma-separated apps of Django's runtests.py (default: a minute's worth)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/workday.json")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tests = args.tests.split(",") if args.tests else (QUICK_TESTS if args.quick else TESTS)
    if args.inner:
        return inner(args.tests, args.quick)
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        print(f"workday: --modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 64
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    if "native" not in args.modes:
        args.modes.insert(0, "native")
    if os.geteuid() != 0:
        print("workday: needs root (loop-mounted ext4, drop_caches, guard run)", file=sys.stderr)
        return 69
    overrides: dict[str, Path] = {}
    for item in args.manifest:
        mode, sep, path = item.partition("=")
        if not sep or mode not in GUARD_MODES or not Path(path).is_file():
            print(f"workday: --manifest {item!r}: want MODE=PATH of an existing file, MODE one of "
                  f"{', '.join(GUARD_MODES)}",
                  file=sys.stderr)
            return 64
        overrides[mode] = Path(path).resolve()
    sdist = fetch(WHEELS)
    hp = passthrough_hp(CACHE) if "passthrough_hp" in args.modes else None
    rounds = []
    with loop_ext4(4096) as fsroot:
        manifests = {}
        for mode in GUARD_MODES:
            manifests[mode] = overrides.get(mode) or fsroot / f"{mode}.toml"
            if mode not in overrides:
                manifests[mode].write_text(manifest_text(mode))
        template = make_template(sdist, fsroot)
        files = int(subprocess.run(["git", "ls-files"], cwd=template, capture_output=True, text=True,
                                   check=True).stdout.count("\n"))
        print(f"workday: Django {DJANGO} source, {files} tracked files; tests: {' '.join(args.tests)}", file=sys.stderr)
        if MYPY_STANDIN:
            print("workday: this manifest has no [paths] generated: the built-in manifests allow the day's caches "
                  "and lift max_files and max_rewrites, and mypy runs with --no-sqlite-cache", file=sys.stderr)
        for rnd in range(args.repeat):
            rounds.append(one_round(fsroot, template, hp, manifests, args, rnd))
        texts = {m: p.read_text() for m, p in manifests.items() if m in args.modes}
    rows = table(rounds, args.modes)
    for mode in args.modes:
        trips = [t for r in rounds for t in r.get(mode, {}).get("trips", [])]
        failed = sorted({step for r in rounds for step, rec in r.get(mode, {}).get("steps", {}).items()
                         if rec["status"] != 0})
        print(f"{mode}: exit {[r[mode]['exit'] for r in rounds if mode in r]}, trips {len(trips)}"
              + (f" ({', '.join(sorted({str(t['rule']) for t in trips}))})" if trips else "")
              + (f"; steps with a non-zero status: {', '.join(failed)}" if failed else ""))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"files": files, "tests": args.tests, "quick": args.quick, "repeat": args.repeat,
                                     "manifests": texts, "rows": rows, "rounds": rounds}, indent=1))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
