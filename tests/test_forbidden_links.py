"""Forbidden by inode: a file forbidden by name at start is forbidden under every other name.

The hard links are made on the backing before the mount, as a host user would
(``ln ws/.env ws/src/checkout/env_hl``); the agent's side is a real mount.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from guardfs.backing import Backing
from guardfs.harvest import remove_tree
from guardfs.links import HARD_LINK_KEY, forbidden_links
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy, Scope

from .helpers import dir_chain
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
