"""``guard hook claude|codex|gemini`` and the hook command agents are given.

Agents run their hook as a new process for every tool call, so it must start fast: guard
run compiles ``guard_hook.c`` once (with the system's C compiler) into a helper that
forwards the hook's JSON to the daemon, which decides with :mod:`sandbox.agents.fasthook`'s
logic. Where there is no compiler, agents get ``python3 -S -E fasthook.py`` instead (the
same answers, tens of milliseconds slower). ``guard hook`` runs the Python one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from sandbox.agents import fasthook
from sandbox.agents.fasthook import MUTATING_TOOLS, run_hook

__all__ = ["MUTATING_TOOLS", "compiled_helper", "helper_cache", "hook_command", "run_hook"]

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("guard_hook.c")


def helper_cache() -> Path:
    """Where the compiled hook helper is kept: the user's cache directory, never the package's
    own folder (read-only in a system install, and shared by every user of it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "guardfs"


@functools.cache
def compiled_helper() -> Path | None:
    """The compiled hook helper, built on first use; None where it cannot be built."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    folder = helper_cache()
    binary = folder / f"guard-hook-{digest}"
    if binary.exists():
        return binary
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".guard-hook-{digest}.{os.getpid()}"
        built = subprocess.run([cc, "-O2", "-o", str(tmp), str(_SOURCE)], capture_output=True, text=True,
                               timeout=120, check=False)
        if built.returncode != 0:
            log.warning("cannot build the hook helper: %s", built.stderr.strip()[-300:])
            return None
        os.replace(tmp, binary)  # atomic: concurrent runs never see a half-written helper
    except OSError as err:
        log.warning("cannot build the hook helper in %s: %s (agents get the Python hook)", folder, err)
        return None
    return binary


def hook_command(agent: str, compiled: bool = True) -> str:
    """The shell command an agent's settings name for our hook."""
    helper = compiled_helper() if compiled else None
    if helper is not None:
        return f"{shlex.quote(str(helper))} {agent}"
    return f"{shlex.quote(sys.executable)} -S -E {shlex.quote(fasthook.__file__)} {agent}"
