"""Fixtures: a guarded mount (see tests/mounts.py) and the session-wide check that no
mount and no process is left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .mounts import Guarded, guarded_mount


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Guarded]:
    """A guarded mount of an empty workspace with the checkout manifest."""
    with guarded_mount(tmp_path) as g:
        yield g


@pytest.fixture(scope="session")
def installation() -> Iterator[str]:
    """guardfs and its dependencies copied where another user (``--user nobody``) can read
    them, under /tmp: a PYTHONPATH. (The checkout and its venv may live under /root.)"""
    from .test_run import _copy_installation

    lib = Path(tempfile.mkdtemp(prefix="guardfs-lib-"))
    try:
        os.chmod(lib, 0o755)  # noqa: S103 - the other user must read it
        yield _copy_installation(lib)
    finally:
        shutil.rmtree(lib)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the whole session: no guardfs mount and no stray child process.

    Mounts that were there before the session (another suite's, a user's own guard) are not
    this session's to judge."""
    before = _guardfs_mounts()
    yield
    left = _guardfs_mounts() - before
    assert not left, f"guardfs mounts left behind: {sorted(left)}"
    import psutil

    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {children}"


def _guardfs_mounts() -> set[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return {line for line in f if " - fuse.guardfs " in line}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip, with the reason, `mount` tests where FUSE cannot be used and `root` tests when not root."""
    from .machine import skip_what_this_machine_cannot_run

    skip_what_this_machine_cannot_run(items)
