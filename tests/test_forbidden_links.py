"""Forbidden by inode: a file forbidden by name at start is forbidden under every other name.

The hard links are made on the backing before the mount, as a host user would
(``ln ws/.env ws/src/checkout/env_hl``); the agent's side is a real mount.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from guardfs.backing import Backing
from guardfs.harvest import remove_tree, walk
from guardfs.links import HARD_LINK_KEY, forbidden_links, walk_workspace
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy, Scope

from .helpers import dir_chain, git_env
from .mounts import CHECKOUT_MANIFEST, guarded_mount

SECRET = "SECRET=hunter2\n"


def _tree(backing: Path) -> None:
    """.env and a migration, each with other names made before the run; a plain shared file."""
    for d in ("src/checkout/sub", "docs", "db/migrations"):
        (backing / d).mkdir(parents=True, exist_ok=True)
    (backing / ".env").write_text(SECRET)
    os.link(backing / ".env", backing / "src/checkout/env_hl")  # where the agent may write
    os.link(backing / ".env", backing / "docs/env_copy")  # where it could never make a link
    os.link(backing / ".env", backing / "src/checkout/sub/deeper")
    (backing / "db/migrations/0001.sql").write_text("DROP TABLE users;\n")
    os.link(backing / "db/migrations/0001.sql", backing / "src/checkout/m.sql")
    (backing / ".env.local").write_text("ALONE=1\n")  # one link: nothing to record
    (backing / "src/checkout/a.py").write_text("a = 1\n")
    os.link(backing / "src/checkout/a.py", backing / "src/checkout/b.py")  # allowed both ways


def test_the_walk_records_only_forbidden_files_with_other_names(tmp_path: Path) -> None:
    _tree(tmp_path)
    policy = PathPolicy(parse_manifest(CHECKOUT_MANIFEST))
    backing = Backing(str(tmp_path))
    try:
        found = forbidden_links(backing, policy)
    finally:
        backing.close()
    assert set(found) == {(tmp_path / ".env").stat().st_ino, (tmp_path / "db/migrations/0001.sql").stat().st_ino}
    for verdict in found.values():
        assert verdict.scope is Scope.FORBIDDEN and verdict.key == HARD_LINK_KEY
    assert sorted(v.pattern or "" for v in found.values()) == ["**/migrations/", ".env*"]


@pytest.mark.mount
def test_pre_existing_hard_links_of_forbidden_files_are_forbidden(tmp_path: Path) -> None:
    _tree(tmp_path / "backing")
    with guarded_mount(tmp_path) as g:
        mnt = g.mnt
        for name in ("src/checkout/env_hl", "docs/env_copy", "src/checkout/sub/deeper", "src/checkout/m.sql"):
            with pytest.raises(PermissionError):
                (mnt / name).read_bytes()
            with pytest.raises(PermissionError):
                os.stat(mnt / name)
        # Not listed, as a forbidden name is not: the name of a secret is not handed out.
        assert sorted(os.listdir(mnt / "src/checkout")) == ["a.py", "b.py", "sub"]
        assert os.listdir(mnt / "docs") == []
        # Learnt first under its forbidden name, then under another: still refused.
        with pytest.raises(PermissionError):
            (mnt / ".env").read_text()
        with pytest.raises(PermissionError):
            (mnt / "src/checkout/env_hl").read_text()
        # Neither written, removed, nor linked or renamed to a name of the agent's.
        with pytest.raises(OSError) as exc:
            os.link(mnt / "src/checkout/env_hl", mnt / "src/checkout/mine")
        assert exc.value.errno == errno.EACCES
        for op in (lambda: os.unlink(mnt / "src/checkout/env_hl"),
                   lambda: os.rename(mnt / "src/checkout/env_hl", mnt / "src/checkout/mine"),
                   lambda: (mnt / "src/checkout/env_hl").write_text("owned\n")):
            with pytest.raises(PermissionError):
                op()
        # A directory that carries one moves (it is the agent's), and the file stays forbidden.
        os.rename(mnt / "src/checkout/sub", mnt / "src/checkout/sub2")
        with pytest.raises(PermissionError):
            (mnt / "src/checkout/sub2/deeper").read_text()
        # Two names of a file no pattern forbids: both served as before.
        assert (mnt / "src/checkout/b.py").read_text() == "a = 1\n"
        (mnt / "src/checkout/b.py").write_text("a = 2\n")
        assert (mnt / "src/checkout/a.py").read_text() == "a = 2\n"
        events = [json.loads(line) for line in g.events_path.read_text().splitlines()]
    denied = [e for e in events if e.get("decision") == "deny" and e.get("rule") == HARD_LINK_KEY]
    assert {e["path"] for e in denied} >= {"src/checkout/env_hl", "docs/env_copy", "src/checkout/m.sql"}
    assert all(e["errno"] == "EACCES" for e in denied)
    assert (tmp_path / "backing/.env").read_text() == SECRET
    assert (tmp_path / "backing/src/checkout/sub2/deeper").read_text() == SECRET
    assert not (tmp_path / "backing/src/checkout/mine").exists()


def test_the_walk_reaches_below_path_max(tmp_path: Path) -> None:
    """A tree deeper than PATH_MAX (an agent can leave one in a native generated tree) is walked
    a piece at a time: a hard link of a secret at its bottom is found, and the start never fails."""
    _tree(tmp_path)
    deep = dir_chain(tmp_path, 700, "d123456")  # 700 times "d123456/" = 5,600 bytes
    try:
        os.link(tmp_path / ".env", "bottom", dst_dir_fd=deep)
        assert os.stat("bottom", dir_fd=deep).st_nlink == 5
    finally:
        os.close(deep)
    policy = PathPolicy(parse_manifest(CHECKOUT_MANIFEST))
    backing = Backing(str(tmp_path))
    try:
        found = forbidden_links(backing, policy)
    finally:
        backing.close()
        assert remove_tree(tmp_path / "d123456") == []  # pytest's own clean-up recurses
    assert (tmp_path / ".env").stat().st_ino in found


def _git_readers_before(root: str, is_secret: Callable[[str], bool]) -> tuple[list[tuple[str, str, bool]], set[str]]:
    """What find_repositories and secret_files read of the workspace before issue 22, each by
    its own walk (harvest.walk: paths, ``.git`` pruned, unreadable and too long left): the
    reference the one walk must equal."""
    gits: list[tuple[str, str, bool]] = []
    secrets: set[str] = set()
    for dirpath, dirnames, filenames in walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel
        if ".git" in dirnames:
            gits.append((prefix, os.path.join(dirpath, ".git"), True))
        elif ".git" in filenames:
            gits.append((prefix, os.path.join(dirpath, ".git"), False))
        dirnames[:] = [d for d in dirnames if d != ".git"]
        secrets.update(p for name in filenames if is_secret(p := name if rel == "." else f"{rel}/{name}"))
    return gits, secrets


def test_one_walk_keeps_each_readers_rules(tmp_path: Path) -> None:
    """The one walk at start (walk_workspace) gives the links what forbidden_links found, and
    git's reader exactly what its own walks read: ``.git`` entered by the first only, a tree
    past PATH_MAX read a piece at a time by the first, left by the second."""
    ws = tmp_path / "ws"
    _tree(ws)
    env = git_env(tmp_path)
    subprocess.run(["git", "init", "-q", str(ws)], check=True, env=env)
    subprocess.run(["git", "init", "-q", "--separate-git-dir", str(ws / "gitdata"), str(ws / "sub")], check=True,
                   env=env)
    (ws / ".git/.env.bak").write_text(SECRET)  # a secret's name inside .git: the links see it
    os.link(ws / ".git/.env.bak", ws / "docs/bak")
    deep = dir_chain(ws, 700, "d123456")  # past PATH_MAX: a repository and a secret at its bottom
    try:
        os.mkdir(".git", dir_fd=deep)
        os.mkdir(".git/objects", dir_fd=deep)
        os.link(ws / ".env", ".env.deep", dst_dir_fd=deep)
    finally:
        os.close(deep)
    policy = PathPolicy(parse_manifest(CHECKOUT_MANIFEST))

    def is_secret(path: str) -> bool:
        return policy.classify(path, False).scope is Scope.FORBIDDEN

    try:
        walked = walk_workspace(ws, policy)
        gits, secrets = _git_readers_before(str(ws), is_secret)
        alone = walk_workspace(ws, is_secret=is_secret)  # guard check's: no policy, no links
    finally:
        assert remove_tree(ws / "d123456") == []
    assert set(walked.links) == {(ws / ".env").stat().st_ino, (ws / "db/migrations/0001.sql").stat().st_ino,
                                 (ws / "docs/bak").stat().st_ino}
    assert walked.gits == alone.gits == gits
    assert [g[0] for g in gits] == ["", "sub"]
    assert set(walked.secrets) == set(alone.secrets) == secrets
    assert ".env" in secrets and ".git/.env.bak" not in secrets and not any("d123456" in s for s in secrets)
    assert alone.links == {}


@pytest.mark.root
def test_one_walk_enters_another_filesystem_for_git_only(tmp_path: Path) -> None:
    """A filesystem mounted inside the workspace: the links never enter it (the mount refuses
    it), git's reader does, as its own walk did."""
    ws = tmp_path / "ws"
    (ws / "mnt").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ws / "mnt")], check=True)
    try:
        (ws / "mnt/repo").mkdir()
        subprocess.run(["git", "init", "-q", str(ws / "mnt/repo")], check=True, env=git_env(tmp_path))
        (ws / "mnt/.env").write_text(SECRET)
        os.link(ws / "mnt/.env", ws / "mnt/env2")
        policy = PathPolicy(parse_manifest(CHECKOUT_MANIFEST))
        walked = walk_workspace(ws, policy)
        gits, secrets = _git_readers_before(
            str(ws), lambda p: policy.classify(p, False).scope is Scope.FORBIDDEN)
    finally:
        subprocess.run(["umount", str(ws / "mnt")], check=True)
    assert walked.links == {}
    assert walked.gits == gits == [("mnt/repo", str(ws / "mnt/repo/.git"), True)]
    assert set(walked.secrets) == secrets == {"mnt/.env"}


def test_hide_git_decided_after_the_walk_forbids_what_a_walk_under_it_forbids(tmp_path: Path) -> None:
    """The Session's policy hides git only once the walk told it where git's directories are:
    the walk's links as that policy judges them (links_for, git's directories walked again) are
    the links a walk under that policy finds from the top."""
    ws = tmp_path / "ws"
    _tree(ws)
    env = git_env(tmp_path)
    subprocess.run(["git", "init", "-q", str(ws)], check=True, env=env)
    subprocess.run(["git", "init", "-q", "--separate-git-dir", str(ws / "gitdata"), str(ws / "sub")], check=True,
                   env=env)
    (ws / "vendor/deep").mkdir(parents=True)
    os.link(ws / ".git/HEAD", ws / "vendor/HEAD.copy")  # cp -al of a git directory's file
    os.link(ws / "gitdata/config", ws / "vendor/deep/config")  # of the separate git directory's
    os.link(ws / "sub/.git", ws / "vendor/gitfile")  # of a gitfile
    manifest = parse_manifest(CHECKOUT_MANIFEST)
    first = PathPolicy(manifest)
    hidden = PathPolicy(manifest, hide_git=True, git_dirs=["gitdata"])
    backing = Backing(str(ws))
    try:
        fresh = forbidden_links(backing, hidden)
    finally:
        backing.close()
    walked = walk_workspace(ws, first)
    assert walked.links_for(first) == walked.links
    assert walked.links_for(hidden) == fresh
    assert {(ws / n).stat().st_ino for n in ("vendor/HEAD.copy", "vendor/deep/config", "vendor/gitfile")} \
        <= set(fresh) - set(walked.links)
