"""Which runs are live on this machine, so that each sandbox can hide the others' directories.

A run directory can be anywhere (``--run-dir``); a root agent, whose uid owns every guard's
files, would read another run's logs, ledger and checkpoints wherever they are. Each root
guard therefore writes its run directory into :data:`REGISTRY` (root-only) for as long as it
runs, and each new sandbox covers every live one listed there with an empty tmpfs. A run
started *after* a sandbox was built is not covered in it: its default places (/root,
/var/lib/guardfs, /tmp) are, whatever the order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["REGISTRY", "live_run_dirs", "registered"]

#: One file per live root guard, named by its pid, holding its run directory.
REGISTRY = Path("/run/guardfs/runs")


@contextlib.contextmanager
def registered(run_dir: Path, registry: Path = REGISTRY) -> Iterator[None]:
    """List *run_dir* as live while the block runs (root only; a no-op otherwise)."""
    if os.geteuid() != 0:
        yield
        return
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    entry = registry / str(os.getpid())
    entry.write_text(str(run_dir.resolve()))
    try:
        yield
    finally:
        entry.unlink(missing_ok=True)


def live_run_dirs(exclude: Path, registry: Path = REGISTRY) -> list[str]:
    """The run directories of the other live guards (entries of dead ones are removed)."""
    out: list[str] = []
    try:
        entries = list(registry.iterdir())
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        if not os.path.exists(f"/proc/{entry.name}"):
            entry.unlink(missing_ok=True)  # a guard that died without cleaning up
            continue
        with contextlib.suppress(OSError):
            path = entry.read_text()
            if path and path != str(exclude.resolve()) and os.path.isdir(path):
                out.append(path)
    return out
