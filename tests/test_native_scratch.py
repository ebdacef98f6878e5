"""Generated trees made out of scope during the run: their scratch directory (RUN_DIR/scratch/<path>)
bound natively into the running sandbox (sandbox.launch.inject): the rules, and real
``guard run --ci`` runs (bubblewrap, Landlock, the real FUSE mount, real mypy)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from guardfs.scratch import SCRATCH_INO
from sandbox.launch import native
from sandbox.launch.inject import MidRunBinder
from sandbox.launch.native import MAX_TREES, MidRunRules

from .helpers import run_events
from .test_native_midrun import PRELUDE, ledger
from .test_run import guard_run

NARROW = """
[task]
id = "scratch-native"
goal = "Fix the tax helper"
[paths]
allowed = ["src/checkout/"]
forbidden = [".env*"]
[limits]
max_files = 1
"""

# Inside the sandbox, besides PRELUDE: the root of a mount (its source directory, as its
# filesystem sees it), and a bounded wait for the test, outside, to say it has looked.
MORE = """
    def mount_root(path):
        return next(line.split()[3] for line in open("/proc/self/mountinfo")
                    if line.split()[4] == os.path.abspath(path))
    def wait_checked():
        deadline = time.monotonic() + 60
        while not os.path.exists("src/checkout/checked"):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True
"""


def workspace(tmp_path: Path, text: str = NARROW) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x: int) -> int:\n    return x\n")
    (ws / ".env").write_text("SECRET=1\n")
    manifest = tmp_path / "scratch.toml"
    manifest.write_text(text)
    return ws, manifest


def tree_of(ws: Path) -> dict[str, tuple[int, int] | None]:
    """Every path of the workspace outside the allowed paths, a file's with its size and mtime."""
    out: dict[str, tuple[int, int] | None] = {}
    for path in ws.rglob("*"):
        rel = path.relative_to(ws).as_posix()
        if not rel.startswith("src/checkout/"):
            st = path.lstat()
            out[rel] = None if path.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def wait_for(condition: Callable[[], bool], what: str, bound: float = 60) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {bound:.0f} s")
        time.sleep(0.01)


@contextmanager
def running_guard(manifest: Path, ws: Path, run_dir: Path, script: str) -> Iterator[subprocess.Popen[str]]:
    """``guard run --ci`` a Python script as the agent, in the background; its stderr in
    run_dir/../guard.err. Stopped (SIGTERM: the guard ends its agent) if the test fails first."""
    with open(run_dir.parent / "guard.err", "w") as err:
        proc = subprocess.Popen(
            # A short cache bound: the agent sees the test's "checked" file soon after it is written.
            [sys.executable, "-m", "sandbox", "run", "--ci", "--cache-timeout", "0.2", "--manifest", str(manifest),
             "--run-dir", str(run_dir), "--", sys.executable, "-c", textwrap.dedent(script)],
            cwd=ws, stdout=subprocess.DEVNULL, stderr=err, text=True, stdin=subprocess.DEVNULL,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=60)


def test_rules_for_a_new_scratch_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws, manifest = workspace(tmp_path)
    scratch = tmp_path / "run/scratch"
    rules = MidRunRules(parse_manifest(manifest.read_text()), ws, planned=[], scratch=scratch)
    # Literal names, at most MAX_DEPTH deep, each once; __pycache__/ stays behind the mount.
    assert rules.candidate(".mypy_cache", scratch=True)
    assert not rules.candidate(".mypy_cache", scratch=True)
    assert not rules.candidate(".mypy_cache/3.11/build", scratch=True)
    assert not rules.candidate("docs/__pycache__", scratch=True)
    assert not rules.candidate("a/b/c/d/build", scratch=True)  # 5 deep
    assert rules.candidate("a/b/build", scratch=True)
    assert not MidRunRules(parse_manifest(manifest.read_text()), ws, []).candidate(".ruff_cache", scratch=True)
    for d in (".mypy_cache", "a/b/build", "lib/node_modules", ".git/x/node_modules", "docs/dist"):
        (scratch / d).mkdir(parents=True)
    assert rules.scratch_refusal(".mypy_cache") is None
    assert rules.scratch_refusal(".git/x/node_modules") == (".git/x/node_modules: inside a repository's .git/ "
                                                            "or the guard's own files")
    (scratch / "lib/node_modules/.env.prod").write_text("SECRET=2\n")
    # '.env*' stops at a generated tree (guardfs.policy); a pattern naming the tree reaches in.
    assert rules.scratch_refusal("lib/node_modules") is None
    named = MidRunRules(parse_manifest(manifest.read_text().replace('[".env*"]', '[".env*", "**/node_modules/.env*"]')),
                        ws, planned=[], scratch=scratch)
    assert named.scratch_refusal("lib/node_modules") == ("lib/node_modules: forbidden paths are already inside; "
                                                         "it stays behind the mount")
    # A symlinked parent, in the workspace the agent walks or in the scratch layer.
    (ws / "a").symlink_to("src")
    assert rules.scratch_refusal("a/b/build") == "a/b/build: a is a symlink; it stays behind the mount"
    (scratch / "ln").symlink_to("docs")
    assert rules.scratch_refusal("ln/dist") == "ln/dist: ln is a symlink; it stays behind the mount"
    assert rules.scratch_refusal("gone/build") == "gone/build: No such file or directory"
    # Counted with the trees in scope, against one limit.
    rules.trees = [f"src/checkout/p{i}/build" for i in range(MAX_TREES - 1)]
    assert rules.scratch_refusal(".mypy_cache") is None
    rules.trees.append(".mypy_cache")
    assert rules.scratch_refusal("docs/dist") == f"docs/dist: more than {MAX_TREES} generated trees; it stays " \
                                                 "behind the mount"
    assert rules.refusal("src/checkout/build") == f"src/checkout/build: more than {MAX_TREES} generated trees; it " \
                                                  "stays behind the mount"
    monkeypatch.setattr(native, "MAX_TREES", 100)
    assert rules.scratch_refusal("docs/dist") is None


def test_an_unprivileged_guard_leaves_scratch_roots_to_the_mount(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    said: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    rules = MidRunRules(parse_manifest(manifest.read_text()), ws, [], scratch=tmp_path / "run/scratch")
    binder = MidRunBinder(rules, str(ws), events, said.append, enabled=False)
    binder.created("__pycache__", SCRATCH_INO + 5)  # never a candidate
    binder.created(".mypy_cache", SCRATCH_INO + 7)
    binder.created(".ruff_cache", SCRATCH_INO + 8)
    events.close()
    assert said == ["generated tree .mypy_cache made during the run goes through the mount: binding it into the "
                    "running sandbox needs a root guard"]


WRITTEN = PRELUDE + MORE + """
    import errno, shutil
    out = {}
    os.mkdir(".mypy_cache")  # out of scope: a new root of the scratch layer
    with open(".mypy_cache/before.txt", "w") as f:
        f.write("written through the mount\\n")
    held = open(".mypy_cache/held.txt", "w")  # opened through the mount, written on both sides of the bind
    held.write("one\\n")
    held.flush()
    out["bound"] = wait_mounted(".mypy_cache")
    held.write("two\\n")
    held.close()
    with open(".mypy_cache/after.txt", "w") as f:
        f.write("written natively\\n")
    os.makedirs(".mypy_cache/3.11/last")
    out["fs"] = fstype(".mypy_cache")
    out["root"] = mount_root(".mypy_cache")
    out["checked"] = wait_checked()
    out["listing"] = sorted(os.listdir(".mypy_cache"))
    out["read"] = [open(f".mypy_cache/{n}").read() for n in ("before.txt", "held.txt", "after.txt")]
    try:  # a mount point, emptied, then given back to the mount and removed (sandbox.launch.seccomp)
        shutil.rmtree(".mypy_cache")
        out["rmtree"] = "removed"
    except OSError as err:
        out["rmtree"] = errno.errorcode[err.errno]
    out["left"] = os.path.exists(".mypy_cache")
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_a_scratch_root_made_during_the_run_is_bound_from_the_scratch_layer(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    before = tree_of(ws)
    run_dir = tmp_path / "run"
    mine = run_dir / "scratch/.mypy_cache"
    with running_guard(manifest, ws, run_dir, WRITTEN) as proc:
        # While the agent waits: what it wrote, on both sides of the bind, is in the run's
        # scratch directory, once, and nowhere in the real workspace.
        wait_for(lambda: (mine / "3.11/last").is_dir() or proc.poll() is not None, "the agent's last directory")
        assert sorted(p.name for p in mine.iterdir()) == ["3.11", "after.txt", "before.txt", "held.txt"]
        assert (mine / "before.txt").read_text() == "written through the mount\n"
        assert (mine / "held.txt").read_text() == "one\ntwo\n"
        assert (mine / "after.txt").read_text() == "written natively\n"
        assert not (ws / ".mypy_cache").exists()
        (ws / "src/checkout/checked").write_text("")
        assert proc.wait(timeout=120) == 0, (tmp_path / "guard.err").read_text()
    stderr = (tmp_path / "guard.err").read_text()
    out = json.loads((run_dir / "stdout.log").read_text())
    assert out["bound"] is True and out["checked"] is True, stderr
    assert not out["fs"].startswith("fuse")
    assert out["root"].endswith("/run/scratch/.mypy_cache")  # the bind's source: never the workspace
    assert out["listing"] == ["3.11", "after.txt", "before.txt", "held.txt"]
    assert out["read"] == ["written through the mount\n", "one\ntwo\n", "written natively\n"]
    assert (out["rmtree"], out["left"]) == ("removed", False)
    assert ("generated tree made during the run (written natively from the run's scratch layer, never the "
            "workspace from now on, not seen by the breaker): .mypy_cache") in stderr
    native_events = [e for e in run_events(run_dir) if e["op"] == "native"]
    assert native_events == [{**native_events[0], "path": ".mypy_cache", "trees": [".mypy_cache"],
                              "during_run": True, "scratch": True},
                             {**native_events[1], "path": ".mypy_cache", "trees": [".mypy_cache"], "unbound": True}]
    book = ledger(run_dir)
    assert book["trips"] == []
    assert book["files"]["distinct"] == 0
    assert tree_of(ws) == before  # nothing out of scope reached the host
    assert not (run_dir / "scratch").exists()  # the run's alone: removed with it


MYPY = PRELUDE + """
    import sys
    out = {}
    mypy = [sys.executable, "-m", "mypy", "--strict", "src/checkout/tax.py"]
    cold = subprocess.run(mypy, capture_output=True, text=True)
    out["cold"] = [cold.returncode, cold.stdout]
    out["bound"] = wait_mounted(".mypy_cache")
    out["fs"] = fstype(".mypy_cache")
    warm = subprocess.run([*mypy, "-v"], capture_output=True, text=True)
    out["warm"] = [warm.returncode, warm.stdout]
    out["fresh"] = "Metadata fresh for tax: file src/checkout/tax.py" in warm.stderr
    out["stale"] = [line for line in warm.stderr.splitlines() if "Metadata abandoned" in line][:3]
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_mypy_cold_then_warm_with_its_cache_bound_from_the_scratch_layer(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    before = tree_of(ws)
    run_dir = tmp_path / "run"
    run = guard_run(manifest, ws, run_dir, MYPY, "--ci", timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads((run_dir / "stdout.log").read_text())
    ok = [0, "Success: no issues found in 1 source file\n"]
    assert out["cold"] == ok and out["warm"] == ok, run.stderr
    assert out["bound"] is True, run.stderr
    assert not out["fs"].startswith("fuse")
    assert out["fresh"] is True and out["stale"] == []  # the warm run read the cache the cold one wrote
    assert [e["path"] for e in run_events(run_dir) if e["op"] == "native"] == [".mypy_cache"]
    book = ledger(run_dir)
    assert book["trips"] == []
    assert book["files"]["distinct"] == 0
    assert tree_of(ws) == before


def planned_trees(ws: Path, count: int) -> None:
    """*count* in-scope build/ directories, bound natively from the start."""
    for i in range(count):
        (ws / f"src/checkout/p{i:02}/build").mkdir(parents=True)


BOTH = PRELUDE + MORE + """
    out = {}
    os.mkdir("src/checkout/node_modules")  # in scope: from the workspace
    os.mkdir(".ruff_cache")  # out of scope: from the scratch layer
    os.mkdir(".pytest_cache")  # one past MAX_TREES: behind the mount
    out["bound"] = [wait_mounted("src/checkout/node_modules"), wait_mounted(".ruff_cache")]
    out["checked"] = wait_checked()
    out["past the limit"] = [mounted(".pytest_cache"), fstype(".pytest_cache")]
    with open(".ruff_cache/x", "w") as f:
        f.write("x")
    with open(".pytest_cache/y", "w") as f:
        f.write("y")
    out["binds"] = sum(os.path.abspath(".") + "/" in line.split()[4] for line in open("/proc/self/mountinfo"))
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_trees_in_scope_and_in_scratch_are_bound_in_one_run_within_max_trees(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    planned_trees(ws, MAX_TREES - 2)
    before = tree_of(ws)
    run_dir = tmp_path / "run"
    with running_guard(manifest, ws, run_dir, BOTH) as proc:
        refused = f".pytest_cache: more than {MAX_TREES} generated trees; it stays behind the mount"
        wait_for(lambda: refused in (tmp_path / "guard.err").read_text() or proc.poll() is not None,
                 "the binder's judgement of the tree past the limit")
        (ws / "src/checkout/checked").write_text("")
        assert proc.wait(timeout=120) == 0, (tmp_path / "guard.err").read_text()
    stderr = (tmp_path / "guard.err").read_text()
    assert refused in stderr
    out = json.loads((run_dir / "stdout.log").read_text())
    assert out["bound"] == [True, True] and out["checked"] is True, stderr
    assert out["past the limit"][0] is False and out["past the limit"][1].startswith("fuse")
    assert out["binds"] == MAX_TREES  # the planned trees and the two made during the run
    native_events = [e for e in run_events(run_dir) if e["op"] == "native"]
    assert [(e["path"], e.get("scratch")) for e in native_events[1:]] == [("src/checkout/node_modules", None),
                                                                          (".ruff_cache", True)]
    assert len(native_events[0]["trees"]) == MAX_TREES - 2
    assert ledger(run_dir)["trips"] == []
    assert tree_of(ws) == before
    assert (ws / "src/checkout/node_modules").is_dir()
