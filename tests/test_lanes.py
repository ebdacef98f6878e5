"""Fast lanes: which subtrees go native, their masks, and what a lane keeps and gives up,
shown through a real ``guard run`` (bubblewrap binds over the real FUSE mount)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pathspec
import pytest

from guardfs.errors import ManifestError
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy
from sandbox.launch import lanes
from sandbox.launch.lanes import LaneStage, plan_lanes
from sandbox.launch.run import RunOptions, _fast_lanes
from sandbox.session import Session

from .helpers import snapshot, wait_for
from .test_run import guard_run

LANES = """
[task]
id = "lanes"
goal = "Fix the tax helper"
[paths]
allowed = ["src/checkout/**"]
forbidden = ["/.env*", "docs/.env*", "node_modules/pkg/secrets/"]
[sandbox]
fast_lanes = ["node_modules"]
out_of_scope_fast_lanes = true
"""


def tree(root: Path) -> Path:
    """A workspace with an in-scope dir, out-of-scope trees, secrets inside them, a repo."""
    for d in ("src/checkout", "src/auth", "docs/api", "node_modules/pkg/secrets", "node_modules/pkg/lib",
              "vendor/lib", ".git"):
        (root / d).mkdir(parents=True)
    (root / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (root / "src/auth/login.py").write_text("def login():\n    pass\n")
    (root / "docs/api/index.md").write_text("# API\n")
    (root / "docs/.env.docs").write_text("TOKEN=docs-secret\n")
    (root / "node_modules/pkg/index.js").write_text("module.exports = 1\n")
    (root / "node_modules/pkg/secrets/key.pem").write_text("PRIVATE\n")
    (root / "node_modules/pkg/lib/util.js").write_text("module.exports = 2\n")
    (root / "vendor/lib/util.py").write_text("X = 1\n")
    (root / "vendor/.env").symlink_to("../docs/.env.docs")
    (root / ".env").write_text("SECRET=1\n")
    return root


def test_plan_picks_out_of_scope_trees_and_splits_them_around_forbidden_paths(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    lanes = plan_lanes(parse_manifest(LANES), ws)
    # src/ holds the allowed src/checkout/, so only its out-of-scope sibling goes native;
    # .git/ never does. docs/ and node_modules/pkg/ could hold forbidden paths (now or later):
    # they stay behind the mount, their other subdirectories are lanes.
    assert lanes.trees == ["docs/api", "node_modules/pkg/lib", "src/auth", "vendor"]
    text = "\n".join(lanes.skipped)
    assert "docs: paths.forbidden 'docs/.env*' could match inside; only docs/api is a lane" in text
    assert "node_modules: paths.forbidden 'node_modules/pkg/secrets/' could match inside" in text


def test_a_forbidden_pattern_at_any_depth_leaves_no_lanes_but_in_generated_trees(tmp_path: Path) -> None:
    """'.env*' could match in any directory, also for a file the host creates mid-run,
    which a lane (a plain bind of the live directory) would show: no lanes, said why. But
    it does not reach into a generated tree (node_modules/), for the mount as for a lane
    (guardfs.policy), so the lane there stays."""
    ws = tree(tmp_path / "ws")
    lanes = plan_lanes(parse_manifest(LANES.replace('"/.env*", ', '".env*", ')), ws)
    assert lanes.trees == ["node_modules/pkg/lib"]
    assert "paths.forbidden '.env*' matches at any depth" in lanes.skipped[0]
    assert "node_modules" not in lanes.skipped[0]
    assert "'/.env*'" in lanes.skipped[0]  # the way out: anchor it


def test_a_hard_link_of_a_forbidden_file_keeps_its_directory_behind_the_mount(tmp_path: Path) -> None:
    """The mount refuses a forbidden file under any name it had at start; a lane would not."""
    ws = tree(tmp_path / "ws")
    (ws / "vendor/lib/deep").mkdir()
    os.link(ws / ".env", ws / "vendor/lib/env_hl")
    lanes = plan_lanes(parse_manifest(LANES), ws)
    assert "vendor/lib/deep" in lanes.trees
    assert not any(t in ("vendor", "vendor/lib") for t in lanes.trees)
    assert any("vendor: it holds another name (a hard link) of a forbidden file" in r for r in lanes.skipped)



def test_the_planner_takes_the_links_the_session_found_rather_than_walking_again(tmp_path: Path) -> None:
    """guard run hands the planner the inodes its session's walk at start found: the planner
    judges by those (an empty list taints nothing), and the session's own list equals a walk."""
    ws = tree(tmp_path / "ws")
    (ws / "vendor/lib/deep").mkdir()
    os.link(ws / ".env", ws / "vendor/lib/env_hl")
    manifest = parse_manifest(LANES)
    untainted = plan_lanes(manifest, ws, links=set())
    assert "vendor" in untainted.trees and not any("hard link" in r for r in untainted.skipped)
    session = Session(manifest, ws, EventLog(None))
    try:
        assert set(session.forbidden_links) == {(ws / ".env").stat().st_ino}
        given = plan_lanes(manifest, ws, policy=session.policy, links=session.forbidden_links)
    finally:
        session.close()
    walked = plan_lanes(manifest, ws, policy=session.policy)
    assert (given.trees, given.skipped) == (walked.trees, walked.skipped)
    assert any("vendor: it holds another name (a hard link) of a forbidden file" in r for r in given.skipped)

PATTERNS = ["a", "docs", ".env*", "*.pem", "d*", "?ocs", "**", "*", "[ds]ocs", "sec"]


def test_forbidden_reach_never_misses_what_gitignore_matches() -> None:
    """Ground truth: pathspec's GitIgnoreSpec (what the mount uses). Wherever forbidden_reach
    says a pattern cannot reach beneath a directory, no path beneath it matches."""
    rng = random.Random(12)  # noqa: S311 - a reproducible sample of patterns, not a secret
    names = ["a", "b", ".env", ".env.x", "docs", "sec", "x.pem"]
    checked = 0
    for _ in range(4000):
        pattern = "/".join(rng.choice(PATTERNS) for _ in range(rng.randint(1, 4)))
        pattern = ("/" if rng.random() < 0.3 else "") + pattern + ("/" if rng.random() < 0.3 else "")
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
        directory = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
        reach = lanes.forbidden_reach(pattern, directory)
        if reach is lanes.Reach.NONE:
            for _ in range(20):
                below = directory + "/" + "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
                assert not spec.match_file(below) and not spec.match_file(below + "/"), (pattern, below)
            checked += 1
    assert checked > 500  # the rule was put to the test, not skipped


def test_forbidden_reach_in_a_generated_tree_never_misses_what_the_policy_makes_secret() -> None:
    """Ground truth: PathPolicy.secret (what the mount and the native trees judge by), where
    a pattern reaching at any depth stops at a generated tree unless it names it. Wherever
    forbidden_reach says a pattern cannot reach beneath a directory of a generated tree, no
    path beneath it is a secret by that pattern."""
    rng = random.Random(20)  # noqa: S311 - a reproducible sample of patterns, not a secret
    names = ["a", "node_modules", ".venv", ".env", "x.pem", "sec", "lib"]
    tree_patterns = [*PATTERNS, "node_modules", ".venv", "n*", "*v*"]
    checked = 0
    for _ in range(3000):
        pattern = "/".join(rng.choice(tree_patterns) for _ in range(rng.randint(1, 3)))
        pattern = ("**/" if rng.random() < 0.3 else "") + pattern + ("/" if rng.random() < 0.3 else "")
        try:
            manifest = parse_manifest(f'[task]\nid = "t"\ngoal = "g"\n[paths]\nsecret = ["{pattern}"]\n'
                                      'generated = ["node_modules/", ".venv/"]\n')
        except ManifestError:
            continue  # over-broad: never a manifest's
        policy = PathPolicy(manifest)
        directory = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
        within = policy.generated_tree(directory)
        if within is None:
            continue
        if lanes.forbidden_reach(pattern, directory, within) is lanes.Reach.NONE:
            for _ in range(10):
                below = directory + "/" + "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
                assert policy.secret(below, False) is None and policy.secret(below, True) is None, (pattern, below)
            checked += 1
    assert checked > 300  # the rule was put to the test, not skipped


@pytest.mark.parametrize(("pattern", "directory", "reach"), [
    (".env*", "docs", "ALL"), ("**/secrets/", "docs", "ALL"), ("docs/.env*", "docs", "SOME"),
    ("docs/.env*", "docs/api", "NONE"), ("/.env*", "docs", "NONE"), ("docs/", "docs/api", "ALL"),
    ("node_modules/pkg/secrets/", "node_modules/pkg/lib", "NONE"), ("a/**/x", "a", "SOME"), ("a/**/x", "a/b", "ALL"),
    ("!docs/x", "docs", "NONE"), ("[dx]ocs/x", "vendor", "SOME"), ("d*/x", "vendor", "NONE"),
])
def test_forbidden_reach_table(pattern: str, directory: str, reach: str) -> None:
    assert lanes.forbidden_reach(pattern, directory) is lanes.Reach[reach]


def test_plan_says_why_a_lane_is_left_out(tmp_path: Path) -> None:
    ws = tree(tmp_path / "ws")
    (ws / "linked").symlink_to("docs")
    for i in range(5):
        (ws / "docs" / f"sub{i}").mkdir()
    manifest = parse_manifest(LANES.replace('fast_lanes = ["node_modules"]', 'fast_lanes = ["nope", "linked", "docs"]')
                              .replace('allowed = ["src/checkout/**"]', 'allowed = ["*.py"]'))
    planned = plan_lanes(manifest, ws, max_lanes=3)
    assert planned.trees == []
    text = "\n".join(planned.skipped)
    assert "nope: does not exist" in text
    assert "linked: not a directory" in text
    assert "docs: more than 3 lanes once split around the forbidden paths" in text  # docs/api and sub0..4
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
    import errno, json, os, subprocess, sys
    out = {}
    def attempt(name, fn):
        try:
            out[name] = fn()
        except OSError as err:
            out[name] = errno.errorcode[err.errno]
    def fstype(path):
        return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    out["fs docs"] = fstype("docs")
    out["fs docs/api"] = fstype("docs/api")
    out["fs node_modules/pkg/lib"] = fstype("node_modules/pkg/lib")
    out["fs src/auth"] = fstype("src/auth")
    out["fs src/checkout"] = fstype("src/checkout")
    attempt("read lane", lambda: open("docs/api/index.md").read())
    attempt("read node_modules", lambda: open("node_modules/pkg/index.js").read())
    attempt("list docs", lambda: sorted(os.listdir("docs")))
    attempt("list pkg", lambda: sorted(os.listdir("node_modules/pkg")))
    attempt("write lane", lambda: open("src/auth/login.py", "a").write("x"))
    attempt("create in lane", lambda: open("vendor/lib/new.py", "w").write("x"))
    attempt("write in scope", lambda: open("src/checkout/tax.py", "a").write("# fixed\\n"))
    # One forbidden read per run: the mount refuses it (a recoverable trip), a second stops the run.
    attempt("read forbidden", lambda: open(sys.argv[1]).read())
    print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize(("forbidden", "denied_as"), [
    ("docs/.env.docs", "docs/.env.docs"),  # in a directory that could hold one: behind the mount
    ("vendor/.env", "docs/.env.docs"),  # a symlink in a lane, to a forbidden file: resolved through the mount
    ("node_modules/pkg/secrets/key.pem", "node_modules/pkg/secrets"),
])
def test_guard_run_reads_lanes_natively_and_keeps_them_read_only(tmp_path: Path, forbidden: str,
                                                                 denied_as: str) -> None:
    ws = tree(tmp_path / "ws")
    manifest = tmp_path / "lanes.toml"
    manifest.write_text(LANES.replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]'))
    before = snapshot(ws)
    run = guard_run(manifest, ws, tmp_path / "run", AGENT.replace("sys.argv[1]", repr(forbidden)), "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert "fast lanes (read natively" in run.stderr
    # Lanes are the real directory (ext2/ext3/ext4 here, tmpfs on a tmpfs /tmp), not FUSE;
    # a directory that could hold a forbidden path is not a lane.
    assert not out["fs docs/api"].startswith("fuse")
    assert out["fs src/auth"] == out["fs docs/api"] == out["fs node_modules/pkg/lib"]
    assert out["fs src/checkout"].startswith("fuse")
    assert out["fs docs"].startswith("fuse")
    assert out["read lane"] == "# API\n"
    assert out["read node_modules"] == "module.exports = 1\n"
    # Forbidden paths are neither listed nor readable, whatever the route.
    assert out["list docs"] == ["api"]
    assert out["list pkg"] == ["index.js", "lib"]
    assert out["read forbidden"] == "EACCES"
    # Nothing in a lane can be written; the kernel answers as guardfs would (EROFS)...
    assert out["write lane"] == "EROFS"
    assert out["create in lane"] == "EROFS"
    assert out["write in scope"] == 1 + len("# fixed")
    events = [json.loads(line) for line in (tmp_path / "run/events.jsonl").read_text().splitlines()]
    # ...but the guard never hears of it: the lane's refused writes are not events, while
    # the forbidden read (through the mount) is.
    denied = {e["path"] for e in events if e.get("decision") == "deny"}
    assert denied_as in denied
    assert not any(p.startswith(("src/auth", "vendor/lib", "docs/api", "node_modules/pkg/lib")) for p in denied)
    assert any(e["op"] == "lanes" and "docs/api" in e["trees"] for e in events)
    after = snapshot(ws)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert changed == {"src/checkout/tax.py"}


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
    script = ("id -u; stat -f -c %T docs/api; cat docs/api/index.md; cat docs/.env.docs || echo masked; "
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


MIDRUN = """
import errno, json, os, subprocess, sys, time
go, lists, forbidden = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
def fstype(path):
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
out = {"fs": {d: fstype(d) for d in lists}}
print("READY", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)  # the host creates the forbidden files, then go
for d in lists:
    out["list:" + d] = sorted(os.listdir(d))
try:
    out["read"] = open(forbidden).read()
except OSError as err:
    out["read"] = errno.errorcode[err.errno]
print(json.dumps(out), flush=True)
"""


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("user", [None, "nobody"])
@pytest.mark.parametrize(("forbid", "created", "lanes_left"), [
    # Anchored: docs/ could hold a match, so it is behind the mount; its subdirectory a lane.
    ("/.env*", ["docs/.env.late"], "docs/api"),
    # At any depth: a match could appear in any directory, so there are no lanes but in the
    # generated tree node_modules/, which the pattern does not reach into.
    (".env*", ["docs/api/.env.late", "vendor/lib/.env", "src/auth/.env"], "node_modules/pkg/lib"),
])
def test_a_forbidden_file_the_host_creates_mid_run_is_neither_listed_nor_readable(
    tmp_path: Path, user: str | None, forbid: str, created: list[str], lanes_left: str | None,
) -> None:
    """The host creates forbidden files in out-of-scope directories while the agent runs
    (hostile: it polls for them). Whatever the lanes' plan, the agent sees what the mount
    shows: the names are not listed, the content is refused, and the mount records it."""
    shared = Path(tempfile.mkdtemp(prefix="guardfs-lanes-", dir="/var/tmp"))
    try:
        shared.chmod(0o711)
        exposed = shared / "exposed"
        exposed.mkdir()
        ws = tree(tmp_path / "ws")
        if user:
            subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
            os.chown(exposed, 65534, 65534)
        manifest = tmp_path / "lanes.toml"
        manifest.write_text(LANES.replace('"/.env*", ', f'"{forbid}", ')
                            .replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]')
                            + f'writable = ["{exposed}"]\n')
        lists = sorted({os.path.dirname(p) for p in created} | {"docs/api"} | ({lanes_left} if lanes_left else set()))
        run_dir = tmp_path / "run"
        agent = subprocess.Popen(
            [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
             *(["--user", user] if user else []), "--", "/usr/bin/python3", "-c", MIDRUN, str(exposed / "go"),
             json.dumps(lists), created[0]],
            cwd=ws, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )
        try:
            wait_for(lambda: agent.poll() is not None or (
                (run_dir / "stdout.log").exists() and "READY" in (run_dir / "stdout.log").read_text()),
                "the agent to start", timeout=60)
            assert agent.poll() is None
            for path in created:
                (ws / path).write_text("LATE-SECRET\n")
            (exposed / "go").touch()
            _, err = agent.communicate(timeout=120)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        assert agent.returncode == 0, err
        found = json.loads((run_dir / "stdout.log").read_text().splitlines()[-1])
        for path in created:
            parent, name = os.path.split(path)
            assert name not in found[f"list:{parent}"], found
        assert found["read"] == "EACCES", found
        assert "LATE-SECRET" not in (run_dir / "stdout.log").read_text()
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert any(e.get("decision") == "deny" and e["path"] == created[0] for e in events)
        if forbid == ".env*":
            assert "matches at any depth" in err
        if lanes_left:
            assert "fast lanes (read natively" in err
            assert not found["fs"][lanes_left].startswith("fuse"), found  # still a lane
            assert all(found["fs"][os.path.dirname(p)].startswith("fuse") for p in created), found
        else:
            assert "matches at any depth" in err and "fast lanes (read natively" not in err
            assert all(fs.startswith("fuse") for fs in found["fs"].values()), found
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.root
@pytest.mark.mount
def test_a_hard_link_of_a_forbidden_file_in_a_lane_is_refused_as_through_the_mount(tmp_path: Path) -> None:
    """ln .env vendor/lib/env_hl before the run: vendor/lib is then no lane, and the mount
    refuses the link by its inode; vendor/lib/deep, beside it, is still a lane."""
    ws = tree(tmp_path / "ws")
    (ws / "vendor/lib/deep").mkdir()
    os.link(ws / ".env", ws / "vendor/lib/env_hl")
    manifest = tmp_path / "lanes.toml"
    manifest.write_text(LANES.replace("[sandbox]", '[breaker]\nrecoverable = ["forbidden_path"]\n[sandbox]'))
    script = """
        import errno, json, subprocess
        out = {"fs": subprocess.run(["stat", "-f", "-c", "%T", "vendor/lib", "vendor/lib/deep"],
                                    capture_output=True, text=True).stdout.split()}
        try:
            out["read"] = open("vendor/lib/env_hl").read()
        except OSError as err:
            out["read"] = errno.errorcode[err.errno]
        print(json.dumps(out))
    """
    run = guard_run(manifest, ws, tmp_path / "run", script, "--ci")
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "run/stdout.log").read_text())
    assert out["read"] == "EACCES"
    assert out["fs"][0].startswith("fuse") and not out["fs"][1].startswith("fuse"), out
    assert "vendor: it holds another name (a hard link) of a forbidden file" in run.stderr
