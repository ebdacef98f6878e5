"""Supervision of the agent's process tree with psutil.

Every signal goes through :class:`psutil.Process`, which checks that a pid still names the
process we started (no signalling a recycled pid).
"""

from __future__ import annotations

import contextlib
import signal

import psutil
import trio

__all__ = ["ProcessTree"]


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
