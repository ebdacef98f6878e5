"""Native generated trees: in-scope build and install directories bound writable into the
sandbox, shown through a real ``guard run`` (bubblewrap binds over the real FUSE mount)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.launch import native
from sandbox.launch.native import NativeStage, plan_native
from sandbox.launch.run import RunOptions, _native_generated

from .helpers import snapshot
from .test_run import guard_run

NATIVE = """
[task]
id = "native"
goal = "Fix the tax helper"
[paths]
allowed = ["src/checkout/**"]
forbidden = [".env*", "**/secrets/", "**/.venv/.env*", "**/node_modules/**/secrets/"]
generated = [".venv/", "node_modules/", "/src/checkout/build/", "target/", "*.egg-info/"]
[limits]
max_files = 2
"""
# '.env*' and '**/secrets/' match at any depth, so they stop at a generated tree (guardfs.policy):
# the patterns that name .venv/ and node_modules/ are what reaches into them.


def tree(root: Path) -> Path:
    """A workspace with generated trees in scope (one holding secrets) and out of scope."""
    for d in ("src/checkout/.venv/lib", "src/checkout/node_modules/pkg/secrets", "src/checkout/build",
              "src/auth", "node_modules/dep", ".venv/bin"):
        (root / d).mkdir(parents=True)
    (root / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (root / "src/checkout/.venv/lib/site.py").write_text("X = 1\n")
    (root / "src/checkout/.venv/.env").write_text("SECRET=venv\n")
    (root / "src/checkout/node_modules/pkg/index.js").write_text("module.exports = 1\n")
    (root / "src/checkout/node_modules/pkg/secrets/key.pem").write_text("PRIVATE\n")
    (root / "src/auth/login.py").write_text("def login():\n    pass\n")
    (root / "node_modules/dep/index.js").write_text("module.exports = 2\n")
    (root / ".venv/bin/tool").write_text("#!/bin/sh\n")
    (root / ".env").write_text("SECRET=1\n")
    return root


def test_plan_binds_literal_generated_dirs_inside_allowed_only(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    (ws / "src/checkout/target").symlink_to("build")  # a symlink is no tree: it stays behind the mount
    plan = plan_native(parse_manifest(NATIVE), ws)
    # The root's .venv/ and node_modules/ are out of scope: not bound writable.
    assert plan.trees == ["src/checkout/.venv", "src/checkout/build", "src/checkout/node_modules"]
    assert plan.masked_files == ["src/checkout/.venv/.env"]
    assert plan.masked_dirs == ["src/checkout/node_modules/pkg/secrets"]
    assert plan.skipped == []
    assert plan.absent == []
    (ws / "src/checkout/build").rmdir()
    assert plan_native(parse_manifest(NATIVE), ws).absent == ["src/checkout/build"]


def test_plan_leaves_forbidden_and_crowded_trees_to_the_mount(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    for i in range(4):
        (ws / f"src/checkout/.venv/.env{i}").write_text("x\n")
    manifest = parse_manifest(NATIVE.replace('"**/secrets/"', '"**/secrets/", "src/checkout/build/"'))
    plan = plan_native(manifest, ws, max_masks=3)
    assert plan.trees == ["src/checkout/node_modules"]
    assert "src/checkout/build: forbidden as a whole" in "\n".join(plan.skipped)
    assert "src/checkout/.venv: more than 3 forbidden paths inside" in "\n".join(plan.skipped)


def test_plan_binds_nothing_with_generated_off_and_the_defaults_by_default(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    line = 'generated = [".venv/", "node_modules/", "/src/checkout/build/", "target/", "*.egg-info/"]\n'
    assert plan_native(parse_manifest(NATIVE.replace(line, "generated = []\n")), ws).trees == []
    defaults = plan_native(parse_manifest(NATIVE.replace(line, "")), ws).trees
    assert "src/checkout/.venv" in defaults  # .venv/ is one of the default generated names


def test_plan_finds_unanchored_names_in_scope_within_its_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = tmp_path / "ws"
    for d in ("pkgs/a/lib/.venv", "pkgs/b/lib/x/.venv", "pkgs/a/doc/.venv", "other/lib/.venv"):
        (ws / d).mkdir(parents=True)
    manifest = parse_manifest(NATIVE.replace('allowed = ["src/checkout/**"]', 'allowed = ["pkgs/*/lib/**"]'))
    # A glob component in an allowed pattern is followed; depth 4 is the last looked at.
    assert plan_native(manifest, ws).trees == ["pkgs/a/lib/.venv"]
    monkeypatch.setattr(native, "MAX_TREES", 0)
    assert plan_native(manifest, ws).skipped == ["pkgs/a/lib/.venv: more than 0 generated trees; it and the rest "
                                                 "stay behind the mount"]
    monkeypatch.setattr(native, "MAX_TREES", 64)
    monkeypatch.setattr(native, "MAX_SCAN", 2)
    plan = plan_native(manifest, ws)
    assert plan.trees == []
    assert plan.skipped == ["looked at 2 directories for .venv, node_modules, target; deeper ones stay behind "
                            "the mount"]


AGENT = """
    import errno, json, os, subprocess
    out = {}
    def attempt(name, fn):
        try:
            out[name] = fn()
        except OSError as err:
            out[name] = errno.errorcode[err.errno]
    def fstype(path):
        return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    def write(path, text="x\\n"):
        with open(path, "a") as f:
            return f.write(text)
    venv = "src/checkout/.venv"
    out["fs venv"] = fstype(venv)
    out["fs checkout"] = fstype("src/checkout")
    for i in range(10):  # five times max_files
        write(f"{venv}/lib/mod{i}.py")
    os.makedirs(f"{venv}/lib/pkg/sub")
    attempt("rewrite in tree", lambda: write(f"{venv}/lib/site.py", "X = 2\\n"))
    attempt("read masked file", lambda: open(f"{venv}/.env").read())
    attempt("replace masked file", lambda: os.rename(f"{venv}/lib/mod0.py", f"{venv}/.env"))
    attempt("remove masked file", lambda: os.unlink(f"{venv}/.env"))
    attempt("list masked dir", lambda: os.listdir("src/checkout/node_modules/pkg/secrets"))
    os.symlink("../../../auth/login.py", f"{venv}/lib/escape")
    attempt("read through symlink", lambda: open(f"{venv}/lib/escape").read())
    attempt("hard link out", lambda: os.link("src/auth/login.py", f"{venv}/lib/linked"))
    attempt("rename out", lambda: os.rename(f"{venv}/lib/mod1.py", "src/auth/mod1.py"))
    attempt("write in scope", lambda: write("src/checkout/tax.py", "# fixed\\n"))
    attempt("spill", lambda: write(f"{venv}/lib/escape"))  # the one spill: a second would be terminal
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_guard_run_writes_generated_trees_natively(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "native.toml"
    manifest.write_text(NATIVE)
    before = snapshot(ws)
    run = guard_run(manifest, ws, tmp_path / "run", AGENT, "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert "generated trees (written natively, not seen by the breaker): src/checkout/.venv, " \
           "src/checkout/build, src/checkout/node_modules; 2 forbidden path(s) masked inside" in run.stderr
    # The tree is the real directory (ext4 here, tmpfs on a tmpfs /tmp), not FUSE; Landlock lets writes land.
    assert not out["fs venv"].startswith("fuse")
    assert out["fs checkout"].startswith("fuse")
    assert out["rewrite in tree"] == len("X = 2\n")
    venv = ws / "src/checkout/.venv"
    assert sorted(p.name for p in (venv / "lib").iterdir()) == sorted(
        ["site.py", "pkg", "escape", *(f"mod{i}.py" for i in range(10))])
    assert (venv / "lib/site.py").read_text() == "X = 1\nX = 2\n"  # visible on the host at once
    # Forbidden paths inside are masked: no content, and the stand-in cannot be replaced or removed.
    assert out["read masked file"] == "EACCES"
    assert out["replace masked file"] == "EBUSY"
    assert out["remove masked file"] == "EBUSY"
    assert out["list masked dir"] == "EACCES"
    assert (venv / ".env").read_text() == "SECRET=venv\n"
    # Out of scope stays read-only, whatever route the agent takes from inside the tree.
    assert out["read through symlink"] == "def login():\n    pass\n"
    assert out["hard link out"] == "EXDEV"  # another mount: no link across it
    assert out["rename out"] == "EXDEV"
    assert out["spill"] == "EROFS"
    assert out["write in scope"] == len("# fixed\n")
    # Ten generated files did not count toward max_files = 2; the one source file did.
    ledger = json.loads((tmp_path / "run/ledger.json").read_text())
    assert list(ledger["files"]["list"]) == ["src/checkout/tax.py"]
    assert [t["rule"] for t in ledger["trips"]] == ["scope_spill"]  # recoverable: the agent went on
    events = [json.loads(line) for line in (tmp_path / "run/events.jsonl").read_text().splitlines()]
    assert not any(e["path"].startswith("src/checkout/.venv") for e in events)  # never crossed FUSE
    denied = {e["path"] for e in events if e.get("decision") == "deny"}
    assert "src/auth/login.py" in denied  # the spill through the mount still reached the breaker
    assert [e["trees"] for e in events if e["op"] == "native"] == [
        ["src/checkout/.venv", "src/checkout/build", "src/checkout/node_modules"]]
    after = snapshot(ws)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert {p for p in changed if not p.startswith("src/checkout/.venv/")} == {"src/checkout/tax.py"}
    assert not list(Path(run.stderr.split("run directory ")[1].split()[0]).glob("native*"))


@pytest.mark.root
@pytest.mark.mount
def test_native_generated_off_and_absent_trees_go_through_the_mount(tmp_path: Path) -> None:
    """native_generated = false binds nothing; a tree made during the run (`python -m venv`)
    is created through the mount (then bound into the running sandbox: tests/test_native_midrun.py),
    and the next run binds it from the start."""
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "off.toml"
    manifest.write_text(NATIVE.replace("[limits]", "[sandbox]\nnative_generated = false\n[limits]"))
    script = 'import subprocess; print(subprocess.run(["stat", "-f", "-c", "%T", "src/checkout/.venv"], ' \
             'capture_output=True, text=True).stdout.strip())'
    run = guard_run(manifest, ws, tmp_path / "run-off", script, "--ci")
    assert (tmp_path / "run-off/stdout.log").read_text().startswith("fuse")
    assert "generated trees" not in run.stderr
    manifest.write_text(NATIVE.replace("max_files = 2", 'max_files = "unlimited"'))
    (ws / "src/checkout/build").rmdir()
    script = 'import os, subprocess; os.mkdir("src/checkout/target"); print(subprocess.run(' \
             '["stat", "-f", "-c", "%T", "src/checkout/target"], capture_output=True, text=True).stdout.strip())'
    run = guard_run(manifest, ws, tmp_path / "run-absent", script, "--ci")
    assert "generated tree src/checkout/build does not exist yet" in run.stderr  # anchored: its place is known
    assert (ws / "src/checkout/target").is_dir()
    run = guard_run(manifest, ws, tmp_path / "run-next", script.replace('os.mkdir("src/checkout/target"); ', ""),
                    "--ci")
    assert "src/checkout/target" in run.stderr.split("generated trees")[1].splitlines()[0]
    assert not (tmp_path / "run-next/stdout.log").read_text().startswith("fuse")


@pytest.mark.root
@pytest.mark.mount
def test_native_trees_for_an_agent_of_another_user(tmp_path: Path) -> None:
    """--user: each tree is staged by the guard (the agent's user cannot traverse the path to
    the real workspace, a root-only pytest directory) and still written natively."""
    ws = tree(tmp_path / "ws")
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    manifest = tmp_path / "native.toml"
    manifest.write_text(NATIVE)
    script = ("id -u; stat -f -c %T src/checkout/.venv; echo new > src/checkout/.venv/lib/new.py && echo wrote; "
              "cat src/checkout/.venv/.env || echo masked")
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--manifest", str(manifest),
         "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "run/stdout.log").read_text().splitlines()
    assert log[0] == "65534"
    assert not log[1].startswith("fuse")
    assert log[2:] == ["wrote", "masked"]
    assert (ws / "src/checkout/.venv/lib/new.py").read_text() == "new\n"
    assert os.stat(ws / "src/checkout/.venv/lib/new.py").st_uid == 65534


def test_a_tree_that_cannot_be_staged_falls_back_to_the_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A speed-up only: if staging a tree fails (injected: a bind refused), the run goes on
    with every path through the mount, says so, and leaves nothing staged."""
    def refused(source: str, target: str) -> None:
        raise OSError(1, f"binding {source} at {target}: Operation not permitted")

    monkeypatch.setattr(native, "bind_writable", refused)
    ws = tree(tmp_path / "ws")
    stage = tmp_path / "stage"
    stage.mkdir()
    opts = RunOptions(parse_manifest(NATIVE), ws, tmp_path / "run", ["true"], ws, user="nobody")
    events = EventLog(tmp_path / "events.jsonl")
    assert _native_generated(opts, "/usr/bin/bwrap", NativeStage(stage), events) == ([], [])
    events.close()
    assert "native generated trees are off: [Errno 1] binding" in capsys.readouterr().err
    assert list(stage.iterdir()) == []
    assert "native" not in (tmp_path / "events.jsonl").read_text()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_a_real_venv_and_pip_install_in_a_native_tree(tmp_path: Path) -> None:
    """`python -m venv --clear` and `pip install` into an existing in-scope .venv under
    max_files = 2: the tool's own status, no trip, nothing counted, all of it on the host."""
    ws = tree(tmp_path / "ws")
    (ws / "src/checkout/.venv/.env").unlink()  # a masked path could not be cleared (EBUSY)
    manifest = tmp_path / "native.toml"
    manifest.write_text(NATIVE)
    venv = "src/checkout/.venv"
    script = (f"stat -f -c %T {venv} && /usr/bin/python3 -m venv --clear {venv} && {venv}/bin/pip install -q "
              f"iniconfig && {venv}/bin/python -c 'import iniconfig; print(\"IMPORTED\")'")
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest),
         "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr + (tmp_path / "run/stderr.log").read_text()
    fs, imported = (tmp_path / "run/stdout.log").read_text().split()
    assert not fs.startswith("fuse")
    assert imported == "IMPORTED"
    ledger = json.loads((tmp_path / "run/ledger.json").read_text())
    assert ledger["files"]["distinct"] == 0
    assert ledger["trips"] == []
    assert len(list((ws / venv).rglob("*"))) > 1000  # the whole venv is on the host
    assert list((ws / venv).glob("lib/python3*/site-packages/iniconfig/__init__.py"))
    assert not (ws / venv / "lib/site.py").exists()  # --clear emptied the bound directory in place
