"""The walk of git's whole store for secret paths (guardfs.githistory), on real repositories
made with git: what it finds and where it says each lives, the repositories it finds, the
cache and its key, and the bounds that make it fail closed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pathspec
import pytest

import guardfs.githistory
from guardfs.events import EventLog
from guardfs.githistory import (
    HistoryTooLarge,
    Repository,
    check_workspace,
    find_repositories,
    scan_repository,
    secret_files,
    tail_spec,
)
from guardfs.gitscope import ForbiddenInGitError
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy, Scope
from sandbox.session import Session

from .helpers import git_env

PATTERNS = [".env", "/config/secrets/*.yml"]
SPEC = pathspec.GitIgnoreSpec.from_lines(PATTERNS)


def _secret(path: str) -> bool:
    return bool(SPEC.match_file(path))


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env=git_env(cwd)).stdout


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    _git(path, "init", "-q", "-b", "main")
    (path / "README").write_text("hello\n")
    _git(path, "add", "README")
    _git(path, "commit", "-qm", "init")
    return path


def _root(ws: Path) -> Repository:
    return Repository("", str(ws / ".git"), str(ws / ".git"))


def _where(ws: Path, cache: Path | None = None) -> dict[str, tuple[str, ...]]:
    scan = scan_repository(_root(ws), _secret, PATTERNS, cache_dir=cache,
                           secrets_on_disk=lambda: secret_files(str(ws), _secret))
    return {f.path: f.where for f in scan.found}


def test_tail_spec_matches_every_trailing_part_anywhere() -> None:
    spec = tail_spec(["/config/secrets/*.yml", ".env*", "!.env.example", "keys/"])
    assert spec.match_file("a.yml") and spec.match_file("secrets/a.yml") and spec.match_file("x/config/secrets/a.yml")
    assert spec.match_file(".env.example")  # a negation only narrows: ignored, the safe side
    assert spec.match_file("deep/keys/id") and not spec.match_file("a.txt")


def test_a_deleted_secret_is_found_in_the_commit_that_held_it(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    (ws / ".env").write_text("S=1\n")
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "add")
    _git(ws, "rm", "-q", "--cached", ".env")
    _git(ws, "commit", "-qm", "remove")
    held = _git(ws, "rev-parse", "HEAD~1").strip()
    where = _where(ws)
    assert list(where) == [".env"]
    assert where[".env"] == (f"commit {held[:12]} (main~1)",)  # not the commit that deleted it


def test_an_anchored_directory_pattern_in_a_tree_no_commit_holds(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    (ws / "secrets").mkdir()
    (ws / "secrets/prod.yml").write_text("k: v\n")
    _git(ws, "add", "secrets")
    tree = _git(ws, "write-tree").strip()
    sub = _git(ws, "rev-parse", f"{tree}:secrets").strip()
    _git(ws, "reset", "-q")
    # The whole tree dangles: judged as if placed anywhere, so config/secrets/*.yml's tail matches.
    where = _where(ws)
    assert where == {"secrets/prod.yml": (f"tree {tree[:12]}, which no commit holds",)}, where
    # A tag of the subtree alone (no commit holds it either): its entry names, placed anywhere.
    _git(ws, "tag", "subtree", sub)
    assert "prod.yml" in _where(ws)


def test_the_stash_a_dangling_commit_and_a_nameless_blob(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    (ws / ".env").write_text("S=stash\n")
    (ws / "README").write_text("changed\n")
    _git(ws, "stash", "-q", "-u")
    assert any("stash@{0}" in w for w in _where(ws)[".env"])
    _git(ws, "stash", "drop", "-q")  # the stash commit now dangles
    assert any("on no branch or tag" in w for w in _where(ws)[".env"])
    _git(ws, "reflog", "expire", "--expire-unreachable=now", "--all")
    _git(ws, "gc", "-q", "--prune=now")
    assert _where(ws) == {}
    (ws / ".env").write_text("S=blob\n")
    blob = _git(ws, "hash-object", "-w", ".env").strip()
    assert _where(ws) == {".env": (f"unreachable blob {blob[:12]} (its content as it is now)",)}
    (ws / ".env").write_text("S=changed since\n")  # an older version cannot be told from any blob
    assert _where(ws) == {}


def test_the_repositories_of_a_workspace(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    _repo(ws / "lib/vendor")
    _repo(tmp_path / "main")
    _git(tmp_path / "main", "worktree", "add", "-q", str(ws / "wt"))
    _git(ws, "init", "-q", f"--separate-git-dir={tmp_path / 'store'}", str(ws / "sep"))
    lib = _repo(tmp_path / "upstream")
    _git(ws, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "mods/up")
    _git(ws, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), "mods/gone")
    shutil.rmtree(ws / "mods/gone")  # its git directory stays in .git/modules: no work tree uses it
    found = {r.prefix: r for r in find_repositories(str(ws))}
    assert set(found) == {"", "lib/vendor", "wt", "sep", "mods/up", None}
    assert found["mods/up"].git_dir == str(ws / ".git/modules/mods/up")
    assert found[None].git_dir == str(ws / ".git/modules/mods/gone")
    assert found["wt"].common_dir == str(tmp_path / "main/.git")
    assert found["wt"].git_dir == str(tmp_path / "main/.git/worktrees/wt")
    assert found["sep"].git_dir == found["sep"].common_dir == str(tmp_path / "store")


def test_the_cache_is_keyed_by_the_stores_state(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    cache = tmp_path / "cache"
    first = scan_repository(_root(ws), _secret, PATTERNS, cache_dir=cache)
    again = scan_repository(_root(ws), _secret, PATTERNS, cache_dir=cache)
    assert not first.cached and again.cached and again.found == first.found == []
    assert scan_repository(_root(ws), _secret, [*PATTERNS, "*.pem"], cache_dir=cache).cached is False
    (ws / ".env").write_text("S=1\n")
    _git(ws, "add", ".env")
    _git(ws, "commit", "-qm", "add")  # new loose objects: another key
    _git(ws, "rm", "-q", "--cached", ".env")
    later = scan_repository(_root(ws), _secret, PATTERNS, cache_dir=cache)
    assert not later.cached and [f.path for f in later.found] == [".env"]
    cached = scan_repository(_root(ws), _secret, PATTERNS, cache_dir=cache)
    assert cached.cached and [f.path for f in cached.found] == [".env"]


def test_a_store_past_the_bound_is_not_walked(tmp_path: Path) -> None:
    ws = _repo(tmp_path / "ws")
    with pytest.raises(HistoryTooLarge, match="the guard walks at most 2"):
        scan_repository(_root(ws), _secret, PATTERNS, max_objects=2)
    scan = check_workspace(str(ws), _secret, PATTERNS, max_objects=2)
    assert scan.problem is not None and "cannot check git's history" in scan.problem


def test_a_separate_git_dir_inside_the_workspace_is_read_only_or_hidden() -> None:
    manifest = parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["gitdata/", "src/"]\n'
                              'forbidden = [".env"]\n')
    assert PathPolicy(manifest).classify("gitdata/hooks/pre-commit", False).scope is Scope.ALLOWED  # the control
    policy = PathPolicy(manifest, git_dirs=["gitdata"])
    assert policy.classify("gitdata/hooks/pre-commit", False).scope is Scope.PROTECTED
    assert policy.classify("gitdata", True).scope is Scope.PROTECTED
    assert policy.classify("src/a.py", False).scope is Scope.ALLOWED
    hidden = PathPolicy(manifest, git_dirs=["gitdata"], hide_git=True)
    assert hidden.classify("gitdata/objects/ab/cd", False).scope is Scope.FORBIDDEN
    assert hidden.classify("lib/vendor/.git/objects/ab/cd", False).scope is Scope.FORBIDDEN  # nested too
    assert hidden.classify("src/a.py", False).scope is Scope.ALLOWED


@pytest.mark.parametrize("mode", ["refuse", "hide-git", "warn"])
def test_a_store_too_large_to_check_fails_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A store past the bound (here lowered: a real one has five million objects) is not
    walked: "refuse" does not start, "hide-git" hides git, "warn" says it is unchecked."""
    ws = _repo(tmp_path / "ws")
    manifest = parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/"]\nforbidden = [".env"]\n'
                              f'forbidden_in_git = "{mode}"\n')
    monkeypatch.setattr(guardfs.githistory, "MAX_OBJECTS", 2)
    events = EventLog(tmp_path / "events.jsonl")
    try:
        if mode == "refuse":
            with pytest.raises(ForbiddenInGitError, match=r"the guard walks at most 2.*cannot check git's history"):
                Session(manifest, ws, events)
            return
        session = Session(manifest, ws, events)
        try:
            notice = " ".join(session.notices)
            assert "git's history was not checked" in notice, notice
            assert session.policy.hide_git is (mode == "hide-git")
        finally:
            session.close()
    finally:
        events.close()
