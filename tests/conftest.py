"""Fixtures: a guarded mount (see tests/mounts.py) and the session-wide check that no
mount and no process is left behind; how the suite is ordered and split under pytest-xdist;
earlier sessions' basetemps removed before pytest's own removal can fail on them (tests/basetemp.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .basetemp import pytest_configure as _remove_old_basetemps
from .mounts import Guarded, guarded_mount

#: The guardfs mounts that were there when the session (the controller, under xdist) began.
_MOUNTS_BEFORE = pytest.StashKey[set[str]]()


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


@pytest.fixture
def dev_fuse_mode_to_myself() -> Iterator[None]:
    """For a test that opens /dev/fuse to other users and checks its mode is restored: no other
    such test on this machine meanwhile (pytest-xdist workers, another suite), or one would take
    the other's opened mode for the original."""
    with open(Path(tempfile.gettempdir()) / "guardfs-tests-dev-fuse-mode.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the whole session: no guardfs mount and no stray child process.

    Mounts that were there before the session (another suite's, a user's own guard) are not
    this session's to judge. Under pytest-xdist a worker sees the other workers' live mounts,
    so the controller judges the mounts once every worker is done (pytest_sessionfinish)
    and each worker judges its own processes."""
    before = _guardfs_mounts()
    yield
    if not _is_xdist_worker(request.config):
        left = _guardfs_mounts() - before
        assert not left, f"guardfs mounts left behind: {sorted(left)}"
    import psutil

    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {children}"


def _guardfs_mounts() -> set[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return {line for line in f if " - fuse.guardfs " in line}


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _is_xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def pytest_configure(config: pytest.Config) -> None:
    """Before pytest makes its basetemp: the earlier sessions' basetemps it is about to remove,
    removed first (tests/basetemp.py: a deep tree a failed run left made pytest's own removal
    fail the session)."""
    _remove_old_basetemps(config)


def pytest_sessionstart(session: pytest.Session) -> None:
    """The controller's view of the mounts before any worker starts."""
    if _is_xdist_controller(session.config):
        session.config.stash[_MOUNTS_BEFORE] = _guardfs_mounts()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under xdist, after every worker ended: no guardfs mount is left behind (the session
    fails naming them)."""
    before = session.config.stash.get(_MOUNTS_BEFORE, None)
    if not _is_xdist_controller(session.config) or before is None:
        return
    left = _guardfs_mounts() - before
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"guardfs mounts left behind: {sorted(left)}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, `mount` tests where FUSE cannot be used and `root` tests when not root.

    Under pytest-xdist (``--dist loadfile --no-loadscope-reorder``, as ./dev.sh test runs the
    suite: a module's tests on one worker, so a module-scoped fixture such as a real guarded run
    or the wheel build is set up once), the modules holding `slow` tests, which mostly wait
    (quiet gaps of real agent sessions, the image build), are handed out first, so that they
    overlap the rest instead of ending the run alone."""
    from .machine import skip_what_this_machine_cannot_run

    skip_what_this_machine_cannot_run(items)
    if _is_xdist_worker(config):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: otherwise as collected
