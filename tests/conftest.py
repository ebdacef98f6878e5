"""Fixtures: real guarded mounts served from a thread of the test process.

Each mount is torn down in a ``finally``: the FUSE loop is stopped, the mount removed and
the server thread joined, and the teardown asserts that all three happened, also when the
test itself failed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from guardfs.accounting import WriteAccounting
from guardfs.decision import Decider
from guardfs.events import EventLog
from guardfs.fs import GuardFS
from guardfs.manifest import parse_manifest
from guardfs.mount import serve
from sandbox.breaker import Breaker
from sandbox.daemon import Daemon

from .helpers import wait_for

CHECKOUT_MANIFEST = """
[task]
id = "fix-tax-rounding"
goal = "Fix the tax rounding helper in src/checkout/ so coupons cannot go negative"

[paths]
allowed = ["src/checkout/", "tests/checkout/", "work/"]
forbidden = [".env*", "src/auth/root_keys.ts", ".github/workflows/", "**/migrations/"]

[limits]
max_files = "unlimited"
max_rewrites = "unlimited"
"""


@dataclass
class Guarded:
    """A live guarded mount: the server object, both directories and the events."""

    fs: GuardFS
    backing: Path
    mnt: Path
    events_path: Path
    calls: dict[str, int] = field(default_factory=dict)
    daemon: Daemon | None = None

    def events(self) -> list[dict[str, Any]]:
        """Every event written so far."""
        with open(self.events_path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def denials(self) -> list[dict[str, Any]]:
        """Denial events written so far."""
        return [e for e in self.events() if e["decision"] == "deny"]


def _counting(fs: GuardFS, calls: dict[str, int]) -> None:
    """Count each handler invocation (for the operation registry test)."""
    for name, member in vars(pyfuse3.Operations).items():
        if name.startswith("_") or not inspect.iscoroutinefunction(member):
            continue

        def make(n: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            async def wrapped(*args: Any, **kwargs: Any) -> Any:
                calls[n] = calls.get(n, 0) + 1
                return await fn(*args, **kwargs)

            return wrapped

        setattr(fs, name, make(name, getattr(fs, name)))


@contextmanager
def guarded_mount(
    root: Path,
    manifest: str = CHECKOUT_MANIFEST,
    *,
    decider: Decider | None = None,
    cache_timeout: float = 60.0,
    options: set[str] | None = None,
    count_calls: bool = False,
    run_dir: Path | None = None,
    xattrs: bool = True,
) -> Iterator[Guarded]:
    """Mount ``root/backing`` at ``root/mnt`` and serve it from a thread.

    With *run_dir*, the breaker daemon runs in the same loop, as ``guard mount --run-dir``.
    Extended attributes are on by default here, so that the policy on them is tested.
    """
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing: this test needs a real FUSE mount")
    backing, mnt = root / "backing", root / "mnt"
    backing.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    events_path = root / "events.jsonl"
    parsed = parse_manifest(manifest)
    events = EventLog(events_path, caps=parsed.record)
    daemon = None
    companions: list[Any] = []
    state_text = None
    accounting = WriteAccounting()
    if run_dir is not None:
        breaker = Breaker(parsed, accounting, now=time.time, emit=events.emit)
        daemon = Daemon(breaker, run_dir, str(mnt), events, on_stop=pyfuse3.terminate)
        daemon.prepare()
        decider, state_text = breaker, daemon.state_text
        companions.append(daemon.run)
    fs = GuardFS(str(backing), parsed, events, decider, cache_timeout, state_text, accounting, xattrs=xattrs)
    g = Guarded(fs, backing, mnt, events_path, daemon=daemon)
    if count_calls:
        _counting(fs, g.calls)
    server = _ServerThread(fs, mnt, options, companions)
    try:
        server.start()
        yield g
    finally:
        server.stop()
        if daemon is not None:
            daemon.cleanup()
        events.close()
        server.check_clean()


class _ServerThread:
    """serve() in a thread of the test process; stopped and checked in teardown."""

    def __init__(self, fs: GuardFS, mnt: Path, options: set[str] | None, companions: list[Any]) -> None:
        self.fs, self.mnt, self.options, self.companions = fs, mnt, options, companions
        self.token: list[trio.lowlevel.TrioToken] = []
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="guardfs-server", daemon=True)
        self.still_mounted = False

    def _run(self) -> None:
        try:
            serve(
                self.fs, str(self.mnt), handle_signals=False, options=self.options, companions=self.companions,
                on_ready=lambda: self.token.append(trio.lowlevel.current_trio_token()),
            )
        except BaseException as err:  # reported by check_clean()
            self.failure.append(err)

    def start(self) -> None:
        self.thread.start()
        wait_for(lambda: bool(self.failure) or (bool(self.token) and os.path.ismount(self.mnt)), "the mount")
        if self.failure:
            raise self.failure[0]

    def stop(self) -> None:
        if self.token and self.thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):  # it stopped by itself meanwhile
                trio.from_thread.run_sync(pyfuse3.terminate, trio_token=self.token[0])
        self.thread.join(timeout=20)
        self.still_mounted = os.path.ismount(self.mnt)
        if self.still_mounted:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False)

    def check_clean(self) -> None:
        assert not self.thread.is_alive(), "the guardfs server thread did not exit"
        assert not self.still_mounted, f"{self.mnt} was still mounted after the server stopped"
        if self.failure and not isinstance(self.failure[0], Exception):
            raise self.failure[0]
        assert not self.failure, f"the server failed: {self.failure[0]!r}"


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Guarded]:
    """A guarded mount of an empty workspace with the checkout manifest."""
    with guarded_mount(tmp_path) as g:
        yield g


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """After the whole session: no guardfs mount and no stray child process."""
    yield
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        left = [line for line in f if " - fuse.guardfs " in line]
    assert not left, f"guardfs mounts left behind: {left}"
    import psutil

    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"processes left behind: {children}"


def git_env(home: Path) -> dict[str, str]:
    """An environment in which git needs no user configuration."""
    env = dict(os.environ)
    env.update(
        HOME=str(home), GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="Agent", GIT_AUTHOR_EMAIL="agent@example.invalid",
        GIT_COMMITTER_NAME="Agent", GIT_COMMITTER_EMAIL="agent@example.invalid",
    )
    return env


def require(tool: str) -> str:
    """The path of *tool*, or skip naming it."""
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip, with the reason, `mount` tests where FUSE cannot be used and `root` tests when not root."""
    from .machine import skip_what_this_machine_cannot_run

    skip_what_this_machine_cannot_run(items)
