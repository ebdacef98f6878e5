"""Real guarded mounts served from a thread of the test process, built by a Session.

Each mount is torn down in a ``finally``: the FUSE loop is stopped, the mount removed and
the server thread joined, and the teardown asserts that all three happened, also when the
test itself failed.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio

from guardfs.events import EventLog
from guardfs.fs import GuardFS
from guardfs.manifest import parse_manifest
from guardfs.mount import serve
from sandbox.breaker.daemon import Daemon
from sandbox.session import Session

from .helpers import wait_for

__all__ = ["CHECKOUT_MANIFEST", "Guarded", "guarded_mount"]

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
    """A live guarded mount: its session, the server object, both directories and the events."""

    session: Session
    backing: Path
    mnt: Path
    events_path: Path
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def fs(self) -> GuardFS:
        """The filesystem being served."""
        return self.session.fs

    @property
    def daemon(self) -> Daemon | None:
        """The breaker daemon (with a run directory)."""
        return self.session.daemon if self.session.guarded else None

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
    cache_timeout: float = 60.0,
    options: set[str] | None = None,
    count_calls: bool = False,
    run_dir: Path | None = None,
    checkpoints: bool = False,
    xattrs: bool = True,
) -> Iterator[Guarded]:
    """Mount ``root/backing`` at ``root/mnt`` and serve it from a thread, built by a
    :class:`~sandbox.session.Session` as ``guard mount`` builds it.

    With *run_dir*, the breaker daemon runs in the same loop, as ``guard mount --run-dir``;
    with *checkpoints* too, pre-images are kept for rollback, as in ``guard run``.
    Extended attributes are on by default here, so that the policy on them is tested.
    """
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is missing: this test needs a real FUSE mount")
    backing, mnt = root / "backing", root / "mnt"
    backing.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    events_path = root / "events.jsonl"
    parsed = parse_manifest(manifest)
    with contextlib.closing(EventLog(events_path, caps=parsed.record)) as events, Session(
        parsed, backing, events, run_dir=run_dir, mountpoint=mnt, checkpoints=checkpoints,
        cache_timeout=cache_timeout, xattrs=xattrs, on_stop=pyfuse3.terminate,
    ) as session:
        g = Guarded(session, backing, mnt, events_path)
        if count_calls:
            _counting(session.fs, g.calls)
        server = _ServerThread(session.fs, mnt, options, [session.daemon.run] if session.guarded else [])
        try:
            server.start()
            yield g
        finally:
            server.stop()
            server.check_clean()  # then the session and the event log close


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
