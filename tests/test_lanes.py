"""Fast lanes: which subtrees go native, their masks, and what a lane keeps and gives up,
shown through a real ``guard run`` (bubblewrap binds over the real FUSE mount)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from guardfs.errors import ManifestError
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.launch import lanes
from sandbox.launch.lanes import LaneStage, plan_lanes
from sandbox.launch.run import RunOptions, _fast_lanes

from .helpers import snapshot
from .test_run import guard_run

LANES = """
[task]
id = "lanes"
goal = "Fix the tax helper"
[paths]
allowed = ["src/checkout/**"]
forbidden = [".env*", "**/secrets/"]
[sandbox]
fast_lanes = ["node_modules"]
out_of_scope_fast_lanes = true
"""


def tree(root: Path) -> Path:
    """A workspace with an in-scope dir, out-of-scope trees, secrets inside them, a repo."""
    for d in ("src/checkout", "src/auth", "docs/api", "node_modules/pkg/secrets", "vendor/lib", ".git"):
        (root / d).mkdir(parents=True)
    (root / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (root / "src/auth/login.py").write_text("def login():\n    pass\n")
    (root / "docs/api/index.md").write_text("# API\n")
    (root / "docs/.env.docs").write_text("TOKEN=docs-secret\n")
    (root / "node_modules/pkg/index.js").write_text("module.exports = 1\n")
    (root / "node_modules/pkg/secrets/key.pem").write_text("PRIVATE\n")
    (root / "vendor/lib/util.py").write_text("X = 1\n")
    (root / "vendor/.env").symlink_to("../docs/.env.docs")
    (root / ".env").write_text("SECRET=1\n")
    return root


def test_plan_picks_out_of_scope_trees_and_masks_forbidden_paths(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    lanes = plan_lanes(parse_manifest(LANES), ws)
    # src/ holds the allowed src/checkout/, so only its out-of-scope sibling goes native;
    # .git/ never does.
    assert lanes.trees == ["docs", "node_modules", "src/auth", "vendor"]
    assert lanes.masked_files == ["docs/.env.docs"]  # vendor/.env is a symlink: judged where it points
    assert lanes.masked_dirs == ["node_modules/pkg/secrets"]
    assert lanes.skipped == []


def test_plan_says_why_a_lane_is_left_out(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    (ws / "linked").symlink_to("docs")
    for i in range(5):
        (ws / "docs" / f".env{i}").write_text("x\n")
    manifest = parse_manifest(LANES.replace('fast_lanes = ["node_modules"]', 'fast_lanes = ["nope", "linked", "docs"]')
                              .replace('allowed = ["src/checkout/**"]', 'allowed = ["*.py"]'))
    lanes = plan_lanes(manifest, ws, max_masks=3)
    assert lanes.trees == []
    text = "\n".join(lanes.skipped)
    assert "nope: does not exist" in text
    assert "linked: not a directory" in text
    assert "docs: more than 3 forbidden paths" in text
    assert "matches at any depth" in text  # '*.py' leaves no directory surely out of scope


@pytest.mark.parametrize(("lane", "why"), [
    ("/abs", "relative to the workspace root"),
    ("node_modules/*", "not patterns"),
    ("a/../b", "plain relative path"),
    (".git/objects", "cannot be a fast lane"),
])
def test_manifest_rejects_bad_lanes(lane: str, why: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(LANES.replace('fast_lanes = ["node_modules"]', f"fast_lanes = [{json.dumps(lane)}]"))
    assert why in str(caught.value)
    assert "sandbox.fast_lanes[0]" in str(caught.value)


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
    out["fs docs"] = fstype("docs/api")
    out["fs src/auth"] = fstype("src/auth")
    out["fs src/checkout"] = fstype("src/checkout")
    attempt("read lane", lambda: open("docs/api/index.md").read())
    attempt("read node_modules", lambda: open("node_modules/pkg/index.js").read())
    attempt("read masked file", lambda: open("docs/.env.docs").read())
    attempt("list masked dir", lambda: os.listdir("node_modules/pkg/secrets"))
    attempt("read masked dir file", lambda: open("node_modules/pkg/secrets/key.pem").read())
    attempt("read through symlink", lambda: open("vendor/.env").read())
    attempt("write lane", lambda: open("src/auth/login.py", "a").write("x"))
    attempt("create in lane", lambda: open("vendor/lib/new.py", "w").write("x"))
    attempt("write in scope", lambda: open("src/checkout/tax.py", "a").write("# fixed\\n"))
    attempt("read forbidden at root", lambda: open(".env").read())
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
def test_guard_run_reads_lanes_natively_and_keeps_them_read_only(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "lanes.toml"
    manifest.write_text(LANES.replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]'))
    before = snapshot(ws)
    run = guard_run(manifest, ws, tmp_path / "run", AGENT, "--ci")
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert "fast lanes (read natively" in run.stderr
    # Lanes are the real directory (ext2/ext3/ext4 here, tmpfs on a tmpfs /tmp), not FUSE.
    assert out["fs docs"] != "fuseblk" and not out["fs docs"].startswith("fuse")
    assert out["fs src/auth"] == out["fs docs"]
    assert out["fs src/checkout"].startswith("fuse")
    assert out["read lane"] == "# API\n"
    assert out["read node_modules"] == "module.exports = 1\n"
    # Forbidden paths inside lanes are masked: no content, whatever the route.
    assert out["read masked file"] == "EACCES"
    assert out["list masked dir"] == "EACCES"
    assert out["read masked dir file"] == "EACCES"
    assert out["read through symlink"] == "EACCES"
    # Nothing in a lane can be written; the kernel answers as guardfs would (EROFS)...
    assert out["write lane"] == "EROFS"
    assert out["create in lane"] == "EROFS"
    assert out["write in scope"] == 1 + len("# fixed")
    assert out["read forbidden at root"] == "EACCES"
    events = [json.loads(line) for line in (tmp_path / "run/events.jsonl").read_text().splitlines()]
    # ...but the guard never hears of it: the lane's refused writes are not events, while
    # the forbidden read through the mount is.
    denied = {e["path"] for e in events if e.get("decision") == "deny"}
    assert ".env" in denied
    assert not any(p.startswith(("src/auth", "vendor", "docs", "node_modules")) for p in denied)
    assert any(e["op"] == "lanes" and "docs" in e["trees"] for e in events)
    after = snapshot(ws)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed == {"src/checkout/tax.py"}
    assert not (tmp_path / "run/mask-file").exists()


@pytest.mark.root
@pytest.mark.mount
def test_without_lanes_the_same_reads_cross_fuse(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "plain.toml"
    manifest.write_text(LANES.replace('fast_lanes = ["node_modules"]', "fast_lanes = []")
                        .replace("out_of_scope_fast_lanes = true", "out_of_scope_fast_lanes = false"))
    script = 'import subprocess; print(subprocess.run(["stat", "-f", "-c", "%T", "docs"], ' \
             'capture_output=True, text=True).stdout.strip())'
    run = guard_run(manifest, ws, tmp_path / "run", script, "--ci")
    assert (tmp_path / "run/stdout.log").read_text().startswith("fuse")
    assert "fast lanes" not in run.stderr


@pytest.mark.mount
def test_lanes_need_the_sandbox(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "lanes.toml"
    manifest.write_text(LANES)
    run = guard_run(manifest, ws, tmp_path / "run", "print('ok')", "--ci", "--no-isolation")
    assert "fast lanes are off" in run.stderr
    assert (tmp_path / "run/stdout.log").read_text() == "ok\n"
    assert os.path.exists(ws / "docs/.env.docs")  # planning touches nothing


@pytest.mark.root
@pytest.mark.mount
def test_lanes_for_an_agent_of_another_user(tmp_path: Path) -> None:
    """--user (the devcontainer case): the lanes are staged by the guard, since the agent's
    user cannot traverse the path to the real workspace (a root-only pytest directory)."""
    ws = tree(tmp_path / "ws")
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    manifest = tmp_path / "lanes.toml"
    manifest.write_text(LANES.replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]'))
    script = ("id -u; stat -f -c %T docs; cat docs/api/index.md; cat docs/.env.docs || echo masked; "
              "echo x >> src/auth/login.py || echo read-only")
    run = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--manifest", str(manifest),
         "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr
    log = (tmp_path / "run/stdout.log").read_text().splitlines()
    assert log[0] == "65534"
    assert not log[1].startswith("fuse")
    assert log[2:] == ["# API", "masked", "read-only"]
    assert (ws / "src/auth/login.py").read_text() == "def login():\n    pass\n"
    assert not (tmp_path / "run/lanes").exists()


def test_a_lane_that_cannot_be_staged_falls_back_to_the_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Lanes are a speed-up only: if staging one fails (injected: a bind refused), the run
    goes on with every path through the mount, says so, and leaves nothing staged."""
    def refused(source: str, target: str) -> None:
        raise OSError(1, f"binding {source} at {target}: Operation not permitted")

    monkeypatch.setattr(lanes, "bind_read_only", refused)
    ws = tree(tmp_path / "ws")
    stage = tmp_path / "stage"
    stage.mkdir()
    opts = RunOptions(parse_manifest(LANES), ws, tmp_path / "run", ["true"], ws, user="nobody")
    events = EventLog(tmp_path / "events.jsonl")
    assert _fast_lanes(opts, "/usr/bin/bwrap", LaneStage(stage), events) == []
    events.close()
    assert "fast lanes are off: [Errno 1] binding" in capsys.readouterr().err
    assert list(stage.iterdir()) == []
    assert "lanes" not in (tmp_path / "events.jsonl").read_text()
