"""tests/basetemp.py: a deep tree a failed run left in an old basetemp no longer fails the
next session. A real inner pytest, under ``filterwarnings = error``, over a real tree of
2,200 levels: exit 1 without the hook (pytest's recursive removal), 0 with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guardfs.harvest import remove_tree

from .helpers import dir_chain

_REPO = Path(__file__).resolve().parent.parent
_DEPTH = 2_200


def _inner(tmp_path: Path, temproot: Path, *args: str, hook: bool) -> subprocess.CompletedProcess[str]:
    """A pytest session of one passing test that uses tmp_path, its temp root *temproot*."""
    inner = tmp_path / "inner"
    inner.mkdir(exist_ok=True)
    (inner / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    (inner / "test_one.py").write_text("def test_one(tmp_path):\n    assert tmp_path.is_dir()\n")
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(temproot), "PYTHONPATH": str(_REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    plugins = ["-p", "tests.basetemp"] if hook else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, *args,
                           str(inner)], cwd=inner, env=env, capture_output=True, text=True, timeout=120, check=False)


def _deep(top: Path) -> None:
    top.mkdir(parents=True)
    os.close(dir_chain(top, _DEPTH))


def _numbered(temproot: Path) -> Path:
    """Three basetemps of earlier sessions, the oldest holding the deep tree (the one the
    next session prunes); the root."""
    import getpass

    root = temproot / f"pytest-of-{getpass.getuser()}"
    _deep(root / "pytest-0" / "test_deep0")
    for n in (1, 2):
        (root / f"pytest-{n}").mkdir()
    return root


@pytest.mark.parametrize("hook", [False, True], ids=["pytest alone", "with tests/basetemp.py"])
def test_a_deep_tree_in_a_pruned_basetemp(tmp_path: Path, hook: bool) -> None:
    temproot = tmp_path / "temproot"
    root = _numbered(temproot)
    try:
        done = _inner(tmp_path, temproot, hook=hook)
        if hook:
            assert done.returncode == 0, done.stdout + done.stderr
            assert "1 passed" in done.stdout
            left = sorted(p.name for p in root.iterdir())
            assert left == ["pytest-1", "pytest-2", "pytest-3", "pytest-current"], left  # pytest-0 pruned, all of it
        else:  # the failure the hook mends (if pytest ever mends it itself, this says so)
            assert done.returncode == 1, done.stdout + done.stderr
            assert "unclosed scandir iterator" in done.stdout + done.stderr
            assert any(p.name.startswith("garbage-") for p in root.iterdir())
    finally:
        assert remove_tree(temproot) == []  # never left for this session's own pytest to choke on


def test_a_deep_tree_in_the_given_basetemp(tmp_path: Path) -> None:
    """pytest removes a given --basetemp at start, as recursively: removed first, any depth."""
    given = tmp_path / "given"
    _deep(given / "test_deep0")
    try:
        done = _inner(tmp_path, tmp_path / "temproot", f"--basetemp={given}", hook=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(p.name for p in given.iterdir()) == ["test_one0", "test_onecurrent"]
    finally:
        assert remove_tree(given) == []
