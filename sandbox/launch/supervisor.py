"""Starting the agent and supervising its process tree.

Every signal goes through :class:`psutil.Process`, which checks that a pid still names the
process we started (no signalling a recycled pid).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import psutil
import trio

__all__ = ["ProcessTree", "Spawner", "wait_exit"]


class Spawner:
    """Starts processes from one thread of ours that lives until :meth:`close`.

    Why a thread of its own: bubblewrap's ``--die-with-parent`` is ``PR_SET_PDEATHSIG``,
    and the kernel sends that signal when the *thread* that forked the child exits, not
    when its process does. trio's ``open_process`` forks from a worker of its thread cache,
    which exits after 10 s idle: every agent was SIGKILLed 10 s into its run. Nor can the
    main thread fork it: ``Popen`` waits for the exec, and with ``--no-isolation`` the
    exec (or the chdir before it) may need the guarded mount, which that very thread
    serves. This thread outlives the agent (close it only once the agent has ended) and
    dies with the guard's process, so a guard killed by SIGKILL still takes the agent's
    whole tree with it.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="guard-spawner", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    async def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(argv, **options)``, forked by this spawner's thread."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[subprocess.Popen[bytes]] = []
        failure: list[BaseException] = []

        def job() -> None:
            try:
                result.append(subprocess.Popen(argv, **options))
            except BaseException as err:  # handed back to the caller below
                failure.append(err)
            finally:
                token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):  # a child started but never reported is a leak
            await done.wait()
        if failure:
            raise failure[0]
        return result[0]

    def close(self) -> None:
        """End the thread (its children then receive their parent-death signal, if any)."""
        self._jobs.put(None)
        self._thread.join()

    def __enter__(self) -> Spawner:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    """Wait, without blocking the loop, for *proc* to exit; returns its return code."""
    pidfd = os.pidfd_open(proc.pid)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return proc.wait()


class ProcessTree:
    """The process we started and all its descendants (bubblewrap's PID namespace included)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.frozen = False

    def members(self) -> list[psutil.Process]:
        """The live members, root first."""
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [self.root, *children]

    def _each(self, action: str) -> None:
        for proc in self.members():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                getattr(proc, action)()

    def freeze(self) -> None:
        """SIGSTOP the whole tree (for a human to look at it)."""
        self._each("suspend")
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT the whole tree."""
        self._each("resume")
        self.frozen = False

    async def terminate(self, grace: float = 5.0) -> None:
        """SIGTERM the whole tree, then SIGKILL what is left after *grace* seconds."""
        procs = self.members()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)  # pending while stopped: handled first on resume
                proc.resume()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        with trio.move_on_after(grace):
            while any(_alive(p) for p in procs):
                await trio.sleep(0.05)
        for proc in [*procs, *self.members()]:  # late forks too
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                proc.kill()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
