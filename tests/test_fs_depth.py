"""Trees and sources of any depth: nothing the agent nests deeply crashes the guard."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from guardfs.checkpoint import PreImages, rollback_offline

from .helpers import dir_chain
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


DEPTH = 1200


def _deep_tree(top: Path, depth: int) -> None:
    """*depth* nested directories below *top*, made one level at a time through dir fds
    (the full path is longer than a process may name in one call)."""
    fd = dir_chain(top, depth)
    try:
        with open(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("deep\n")
    finally:
        os.close(fd)


def _violation_trips(g: Guarded) -> None:
    with pytest.raises(OSError) as info:
        (g.mnt / "README.md").write_text("out of scope\n")
    assert info.value.errno == errno.EROFS
    assert [e["rule"] for e in g.events() if e["op"] == "trip"] == ["scope_spill"]


def test_renaming_a_1200_deep_tree_keeps_the_guard_serving(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    store = tmp_path / "checkpoint"
    try:
        _rename_deep_tree(tmp_path, run, store)
    finally:  # pytest's own clean-up of old temporary directories recurses: leave no deep tree
        subprocess.run(["rm", "-rf", str(tmp_path / "backing")], check=True)


def _rename_deep_tree(tmp_path: Path, run: Path, store: Path) -> None:
    with guarded_mount(tmp_path, run_dir=run) as g:
        # The pre-images walk the moving tree too (as under `guard run`).
        g.fs.preimages = PreImages(g.fs.backing, store)
        (g.mnt / "work/tree").mkdir(parents=True)
        _deep_tree(g.mnt / "work/tree", DEPTH)
        os.rename(g.mnt / "work/tree", g.mnt / "work/moved")
        assert (g.mnt / "work/moved/d/d").is_dir() and not (g.mnt / "work/tree").exists()
        assert (g.backing / "work/moved").is_dir()
        # Carried past its scope, the tree is still walked to its bottom and refused.
        (g.backing / "work/moved").joinpath(*["d"] * 3, ".env").write_text("SECRET=1\n")
        with pytest.raises(OSError) as info:
            os.rename(g.mnt / "work/moved", g.mnt / "work/again")
        assert info.value.errno == errno.EACCES
        (g.mnt / "work/after.txt").write_text("still serving\n")
        _violation_trips(g)
    # Rolling back removes the tree made since the checkpoint, as deep as it is.
    rollback_offline(str(tmp_path / "backing"), store)
    assert not (tmp_path / "backing/work").exists()


def test_a_python_file_nested_past_the_parser_is_still_counted(tmp_path: Path) -> None:
    """ast.parse raises RecursionError or MemoryError on such sources: lines are counted instead."""
    run = tmp_path / "run"
    run.mkdir()
    with guarded_mount(tmp_path, run_dir=run) as g:
        deep = g.mnt / "src/checkout/deep.py"
        deep.parent.mkdir(parents=True)
        for n in (100_000, 100_001, 100_002):
            deep.write_text("x = " + "1+" * n + "1\n")
            deep.write_text("y = " + "-" * n + "1\n")
        assert g.fs.accounting.files["src/checkout/deep.py"].rewrites == 6
        _violation_trips(g)
