"""Generated trees made during the run, bound natively into the running sandbox
(sandbox.launch.inject): the rules, and real ``guard run --ci`` runs (bubblewrap, Landlock,
the real FUSE mount)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import trio

from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.launch import native
from sandbox.launch.inject import MidRunBinder
from sandbox.launch.native import MidRunRules
from sandbox.launch.supervisor import ProcessTree

from .helpers import run_events
from .hostile import WAIT_MOUNTED
from .test_run import guard_run

MIDRUN = """
[task]
id = "midrun"
goal = "Fix the tax helper"
[paths]
allowed = ["src/checkout/", ".venv/"]
forbidden = [".env*"]
[limits]
max_files = 1
"""

# Inside the sandbox (indented as the scripts below are): wait, with a bound, until a tree is a
# mount of its own, and name the filesystem a path is on.
PRELUDE = textwrap.indent("import json, os, subprocess, time" + WAIT_MOUNTED + """
def fstype(path):
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
""", "    ")


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / ".env").write_text("SECRET=1\n")
    manifest = tmp_path / "midrun.toml"
    manifest.write_text(MIDRUN)
    return ws, manifest


def ledger(run_dir: Path) -> dict[str, Any]:
    book: dict[str, Any] = json.loads((run_dir / "ledger.json").read_text())
    return book


def test_rules_are_plan_natives_for_a_directory_made_during_the_run(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ws, manifest = workspace(tmp_path)
    rules = MidRunRules(parse_manifest(manifest.read_text()), ws, planned=["src/checkout/node_modules"])
    # Literal names only, at most MAX_DEPTH deep, each once, none inside another (a planned one included).
    assert rules.candidate(".venv")
    assert not rules.candidate(".venv")
    assert not rules.candidate(".venv/lib/node_modules")
    assert not rules.candidate("src/checkout/node_modules/dep/node_modules")
    assert not rules.candidate("src/checkout/pkg.egg-info")  # a glob names no one directory
    assert not rules.candidate("src/checkout/a/b/build")  # 5 deep
    assert rules.candidate("src/checkout/a/build")
    for d in (".venv", "src/checkout/a/build", "node_modules", "src/checkout/dist"):
        (ws / d).mkdir(parents=True)
    assert rules.refusal(".venv") is None
    assert rules.refusal("node_modules") == ""  # out of scope: the scratch layer's, never bound
    (ws / "src/checkout/a/build/.env.local").write_text("SECRET=2\n")  # put there by the host
    # '.env*' stops at a generated tree (guardfs.policy), for the mount as for a bind: a
    # pattern naming the tree is what makes a secret there.
    assert rules.refusal("src/checkout/a/build") is None
    named = MidRunRules(parse_manifest(MIDRUN.replace('[".env*"]', '[".env*", "**/build/.env*"]')), ws, [])
    assert named.refusal("src/checkout/a/build") == ("src/checkout/a/build: forbidden paths are already inside; "
                                                     "it stays behind the mount")
    (ws / "src/checkout/link").symlink_to("dist")
    assert "src/checkout/link is a symlink" in str(rules.refusal("src/checkout/link/build"))
    monkeypatch.setattr(native, "MAX_TREES", 1)
    assert rules.refusal(".venv") == ".venv: more than 1 generated trees; it stays behind the mount"


def test_an_unprivileged_guard_says_once_that_it_leaves_them_to_the_mount(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    said: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    binder = MidRunBinder(MidRunRules(parse_manifest(manifest.read_text()), ws, []), str(ws), events, said.append,
                          enabled=False)
    binder.created(".venv", 1)
    binder.created("src/checkout/node_modules", 2)
    binder.created("src/checkout/lib", 3)
    events.close()
    assert said == ["generated tree .venv made during the run goes through the mount: binding it into the running "
                    "sandbox needs a root guard (bound natively from the next run on)"]


async def test_a_bind_that_fails_is_said_and_the_tree_stays_behind_the_mount(tmp_path: Path) -> None:
    """A real failure, not a mock: the agent's process tree has no process in a namespace of
    its own (a plain child of ours), so there is no sandbox to enter. The binder says so and
    goes on; nothing is raised, nothing recorded as bound."""
    ws, manifest = workspace(tmp_path)
    (ws / ".venv").mkdir()
    said: list[str] = []
    events = EventLog(tmp_path / "events.jsonl")
    rules = MidRunRules(parse_manifest(manifest.read_text()), ws, [])
    binder = MidRunBinder(rules, str(ws), events, said.append)
    child = await trio.lowlevel.open_process(["sleep", "60"])
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(binder.serve, ProcessTree(child.pid))
            binder.created(".venv", (ws / ".venv").stat().st_ino)
            with trio.fail_after(20):
                while not said:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    finally:
        child.kill()
        await child.wait()
        events.close()
    assert said == ["generated tree .venv made during the run stays behind the mount: no process of the sandbox "
                    "found to enter its mount namespace"]
    assert rules.trees == []
    assert (tmp_path / "events.jsonl").read_text() == ""


HELD = PRELUDE + """
    out = {}
    os.mkdir(".venv")
    with open(".venv/before.txt", "w") as f:
        f.write("written through the mount\\n")
    held = open(".venv/held.txt", "w")  # opened through the mount, written on both sides of the bind
    held.write("one\\n")
    held.flush()
    out["bound"] = wait_mounted(".venv")
    held.write("two\\n")
    held.close()
    with open(".venv/after.txt", "w") as f:  # Landlock lets the agent write in the new mount
        f.write("written natively\\n")
    os.makedirs(".venv/lib/pkg")
    out["fs"] = fstype(".venv")
    out["listing"] = sorted(os.listdir(".venv"))
    out["held"] = open(".venv/held.txt").read()
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_a_tree_made_during_the_run_is_bound_and_nothing_written_before_is_lost(tmp_path: Path) -> None:
    ws, manifest = workspace(tmp_path)
    run = guard_run(manifest, ws, tmp_path / "run", HELD, "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert out["bound"] is True, run.stderr
    assert not out["fs"].startswith("fuse")
    # One directory, the real one: what the mount wrote before the bind is there once, beside what came after.
    assert out["listing"] == ["after.txt", "before.txt", "held.txt", "lib"]
    assert out["held"] == "one\ntwo\n"
    venv = ws / ".venv"
    assert sorted(p.name for p in venv.iterdir()) == ["after.txt", "before.txt", "held.txt", "lib"]
    assert (venv / "before.txt").read_text() == "written through the mount\n"
    assert (venv / "held.txt").read_text() == "one\ntwo\n"
    assert (venv / "after.txt").read_text() == "written natively\n"
    assert (venv / "lib/pkg").is_dir()
    assert "generated tree made during the run (written natively from now on, not seen by the breaker): .venv" \
        in run.stderr
    native_events = [e for e in run_events(tmp_path / "run") if e["op"] == "native"]
    assert native_events == [{**native_events[0], "path": ".venv", "trees": [".venv"], "during_run": True}]
    book = ledger(tmp_path / "run")
    assert book["trips"] == []
    assert book["files"]["distinct"] == 0


OUT_OF_SCOPE = PRELUDE + """
    out = {}
    os.mkdir("__pycache__")  # generated, out of scope: the run's scratch layer, left to the mount
    with open("__pycache__/x.pyc", "w") as f:
        f.write("bytecode\\n")
    os.mkdir("src/checkout/node_modules")  # in scope: bound, after __pycache__/ was judged (one queue)
    out["in scope bound"] = wait_mounted("src/checkout/node_modules")
    out["out of scope bound"] = mounted("__pycache__")
    out["out of scope fs"] = fstype("__pycache__")
    out["out of scope read"] = open("__pycache__/x.pyc").read()
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_a_pycache_made_out_of_scope_stays_in_the_scratch_layer_behind_the_mount(tmp_path: Path) -> None:
    """Other generated trees made out of scope are bound from the scratch layer
    (tests/test_native_scratch.py); __pycache__/ is left to the mount (native.SCRATCH_LEFT)."""
    ws, manifest = workspace(tmp_path)
    run = guard_run(manifest, ws, tmp_path / "run", OUT_OF_SCOPE, "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert out == {"in scope bound": True, "out of scope bound": False, "out of scope fs": out["out of scope fs"],
                   "out of scope read": "bytecode\n"}, run.stderr
    assert out["out of scope fs"].startswith("fuse")
    assert not (ws / "__pycache__").exists()  # never in the real workspace
    assert (ws / "src/checkout/node_modules").is_dir()
    assert [e["path"] for e in run_events(tmp_path / "run") if e["op"] == "native"] == ["src/checkout/node_modules"]
    assert ledger(tmp_path / "run")["trips"] == []


def tiny_wheel(dist: Path) -> Path:
    """A pure-Python wheel, written by hand: pip installs it with no index and no build."""
    dist.mkdir(parents=True)
    wheel = dist / "tiny-1.0-py3-none-any.whl"
    files = {
        "tiny/__init__.py": "GREETING = 'HELLO FROM TINY'\n",
        "tiny-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
        "tiny-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "tiny-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("tiny-1.0.dist-info/RECORD", record)
    return wheel


VENV = PRELUDE + """
    out = {}
    subprocess.run(["/usr/bin/python3", "-m", "venv", ".venv"], check=True)
    out["bound"] = wait_mounted(".venv")
    subprocess.run([".venv/bin/pip", "install", "-q", "--no-index", "src/checkout/dist/tiny-1.0-py3-none-any.whl"],
                   check=True)
    out["import"] = subprocess.run([".venv/bin/python", "-c", "import tiny; print(tiny.GREETING)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    out["fs"] = fstype(".venv")
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_a_venv_and_a_pip_install_made_during_the_run_land_natively(tmp_path: Path) -> None:
    """`python -m venv .venv` makes the tree through the mount (its first files may too), the
    bind lands, `pip install` writes natively: the tool's status, no trip, nothing counted
    under max_files = 1, the whole venv on the host."""
    ws, manifest = workspace(tmp_path)
    tiny_wheel(ws / "src/checkout/dist")
    run = guard_run(manifest, ws, tmp_path / "run", VENV, "--ci", timeout=300)
    assert run.returncode == 0, run.stderr + (tmp_path / "run/stderr.log").read_text()
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert out["bound"] is True, run.stderr
    assert out["import"] == "HELLO FROM TINY"
    assert not out["fs"].startswith("fuse")
    book = ledger(tmp_path / "run")
    assert book["trips"] == []
    assert book["files"]["distinct"] == 0
    venv = ws / ".venv"
    assert (venv / "pyvenv.cfg").is_file() and (venv / "bin/python").exists()
    assert list(venv.glob("lib/python3*/site-packages/tiny/__init__.py"))
    assert list(venv.glob("lib/python3*/site-packages/pip/__init__.py"))  # ensurepip's, before or after the bind


@pytest.mark.root
@pytest.mark.mount
def test_a_tree_made_during_the_run_of_an_agent_of_another_user(tmp_path: Path) -> None:
    """--user: bubblewrap runs unprivileged, in a user namespace of its own; the root guard
    still enters its mount namespace and binds the tree, which the agent writes natively."""
    ws, manifest = workspace(tmp_path)
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    # A bounded wait, inside the sandbox, for the bind to land (2,000 polls of 10 ms at most).
    script = ('mkdir .venv && for i in $(seq 2000); do grep -q " $PWD/.venv " /proc/self/mountinfo && break; '
              'sleep 0.01; done; id -u; stat -f -c %T .venv; echo new > .venv/new.txt && echo wrote')
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--manifest", str(manifest),
         "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr
    uid, fs, wrote = (tmp_path / "run/stdout.log").read_text().split()
    assert (uid, wrote) == ("65534", "wrote")
    assert not fs.startswith("fuse"), run.stderr
    assert (ws / ".venv/new.txt").read_text() == "new\n"
    assert os.stat(ws / ".venv/new.txt").st_uid == 65534



REMOVED = PRELUDE + """
    import errno
    out = {}
    os.mkdir(".venv")
    out["bound"] = wait_mounted(".venv")
    os.makedirs(".venv/lib/pkg")
    with open(".venv/lib/pkg/mod.py", "w") as f:
        f.write("x = 1\\n")
    try:  # not empty: still a mount point, and the kernel says so
        os.rmdir(".venv")
    except OSError as err:
        out["rmdir full"] = errno.errorcode[err.errno]
    out["start tree bound"] = mounted("src/checkout/node_modules")
    # What an agent runs to start afresh: the shell's rm, then the tree made again; for a tree
    # made during the run and for one bound at the start.
    rm = subprocess.run("rm -rf .venv src/checkout/node_modules && mkdir .venv && echo made", shell=True,
                        capture_output=True, text=True)
    out["rm"] = [rm.returncode, rm.stdout, rm.stderr]
    out["start tree gone"] = not os.path.exists("src/checkout/node_modules")
    out["rebound"] = wait_mounted(".venv")
    with open(".venv/again.txt", "w") as f:
        f.write("the second tree\\n")
    out["fs"] = fstype(".venv")
    # Removed at once, before the guard could bind it, then made again: bound, nothing said amiss.
    os.mkdir("src/checkout/build")
    os.rmdir("src/checkout/build")
    os.mkdir("src/checkout/build")
    out["quick"] = wait_mounted("src/checkout/build")
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_rm_rf_of_a_bound_tree_removes_it_and_a_tree_made_again_is_bound_again(tmp_path: Path) -> None:
    """A bound tree is a mount point in the sandbox, which the kernel will not remove (EBUSY):
    the guard gives an emptied one back to the mount as its removal comes (sandbox.launch.seccomp),
    so ``rm -rf .venv && ...`` works as natively, for trees bound during the run and at the start."""
    ws, manifest = workspace(tmp_path)
    (ws / "src/checkout/node_modules/dep").mkdir(parents=True)
    (ws / "src/checkout/node_modules/dep/index.js").write_text("module.exports = 1\n")
    run = guard_run(manifest, ws, tmp_path / "run", REMOVED, "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert out["bound"] is True and out["start tree bound"] is True, run.stderr
    assert out["rmdir full"] == "EBUSY"
    assert out["rm"] == [0, "made\n", ""], run.stderr
    assert out["start tree gone"] is True
    assert out["rebound"] is True and not out["fs"].startswith("fuse"), run.stderr
    # The real workspace: the first tree gone with everything in it, the second one's file there.
    assert sorted(p.name for p in (ws / ".venv").iterdir()) == ["again.txt"]
    assert (ws / ".venv/again.txt").read_text() == "the second tree\n"
    assert not (ws / "src/checkout/node_modules").exists()
    for tree in (".venv", "src/checkout/node_modules"):
        assert (f"generated tree {tree} emptied and removed by the agent: behind the mount again (bound again if "
                "made again)") in run.stderr
    assert out["quick"] is True and "stays behind the mount" not in run.stderr, run.stderr
    native_events = [e for e in run_events(tmp_path / "run") if e["op"] == "native" and "build" not in e["path"]]
    assert [(e["path"], e.get("during_run"), e.get("unbound")) for e in native_events] == [
        ("", None, None), (".venv", True, None), (".venv", None, True), ("src/checkout/node_modules", None, True),
        (".venv", True, None)]
    book = ledger(tmp_path / "run")
    assert book["trips"] == []
    assert book["files"]["distinct"] == 0
