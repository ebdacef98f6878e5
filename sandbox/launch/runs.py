"""Run directories out of every other sandbox's reach, and the staging directories of dead guards.

A run directory can be anywhere (``--run-dir``); a root agent, whose uid owns every guard's
files, would read another run's logs, ledger and checkpoints wherever they are. Two layers
keep it out:

- A root guard makes its run directory mode 000 (:func:`claim_run_dir`). The guard reads and
  writes it by its capabilities (CAP_DAC_OVERRIDE); a root agent has none (every capability
  is dropped), and the kernel judges an owner by the owner bits alone, so uid 0 without
  capabilities can neither list nor enter it, whenever and wherever it was made: a run
  started *after* a sandbox was built is as closed to that sandbox as one made before. The
  agent cannot chmod it back: the host is read-only in the sandbox. (Unless the run
  directory lies under a path that sandbox was given writable, ``[sandbox] writable``: then
  the root agent, its owner, may chmod it; see SECURITY.md.)
- Each root guard writes its run directory into :data:`REGISTRY` (root-only) for as long as
  it runs, and each new sandbox covers every live one listed there with an empty tmpfs, so
  its entries are not even named there.

A guard killed with SIGKILL cannot remove its staging directory under /tmp (empty on the
host: its tmpfs lived in the guard's own mount namespace). The name carries the guard's
PID namespace and pid; the next guard removes those whose guard is gone
(:func:`remove_stale_stages`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["REGISTRY", "STAGE_PREFIX", "SYSTEM_RUNS", "claim_run_dir", "default_runs_bases", "live_run_dirs",
           "registered", "remove_stale_stages", "stage_prefix", "user_runs"]

log = logging.getLogger(__name__)

#: One file per live root guard, named by its pid, holding its run directory.
REGISTRY = Path("/run/guardfs/runs")
#: Staging directories are named STAGE_PREFIX + the guard's pid + "-" + a random tail.
STAGE_PREFIX = "guardfs-stage-"
#: Where runs of an agent of another user (--user) go by default: root's home is closed to
#: that user, whose bubblewrap must reach the run directory to hide it.
SYSTEM_RUNS = Path("/var/lib/guardfs/runs")


def user_runs() -> Path:
    """Where ``guard run`` makes run directories by default: the user's state directory."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "guardfs/runs"


def git_history_cache() -> Path:
    """Where the start's check of git's stores for secrets keeps what it found
    (guardfs.githistory), beside the user's runs: ``guard run``, ``guard mount`` and ``guard
    check`` share it, and every sandbox hides it (the homes are covered)."""
    return user_runs().parent / "git-history"


def default_runs_bases() -> list[Path]:
    """Every place ``guard run`` makes run directories by default (``guard status`` looks there)."""
    return [user_runs(), SYSTEM_RUNS]


def claim_run_dir(run_dir: Path) -> None:
    """Create *run_dir* (a new or empty directory) before anything is written in it; as root,
    mode 000, so that no root agent of any sandbox, earlier or later, can read it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chmod(run_dir, 0)


def _pid_namespace() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def stage_prefix() -> str:
    """The name prefix of this guard's staging directory: its PID namespace and pid, for
    :func:`remove_stale_stages`."""
    return f"{STAGE_PREFIX}{_pid_namespace()}.{os.getpid()}-"


def remove_stale_stages(base: Path = Path("/tmp")) -> list[Path]:
    """Remove the empty staging directories under *base* whose guard is gone; returns them.

    A live guard's directory also looks empty from here (its tmpfs is in that guard's mount
    namespace), so the pid in the name decides, never emptiness: a directory whose pid is
    alive is kept, even if the pid now belongs to another process (kept too long is harmless;
    removed under a live guard would detach its mounts). rmdir removes only what is empty.
    """
    removed: list[Path] = []
    ours = _pid_namespace()
    try:
        entries = list(base.glob(STAGE_PREFIX + "*"))
    except OSError:
        return removed
    for entry in entries:
        owner, sep, _ = entry.name[len(STAGE_PREFIX):].partition("-")
        namespace, _, pid = owner.partition(".")
        # Judged only by a guard that sees the same pids (a /tmp shared with a container is
        # not); a name without them (mkdtemp's tail has no '-') is not ours to judge either.
        if not (sep and pid.isdigit()) or namespace != ours or os.path.exists(f"/proc/{pid}") \
                or entry.is_symlink():
            continue
        try:
            entry.rmdir()
        except OSError as err:
            log.warning("stale staging directory %s of guard %s left in place: %s", entry, pid, err.strerror)
        else:
            removed.append(entry)
    return removed


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
