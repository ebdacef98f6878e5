"""``guard hook claude|codex|gemini`` and the hook command agents are given.

Agents run their hook as a new process for every tool call, so it must start fast: guard
run compiles ``guard_hook.c`` once (with the system's C compiler) into a helper that
forwards the hook's JSON to the daemon, which decides with :mod:`sandbox.agents.fasthook`'s
logic. Where there is no compiler, agents get ``python3 -S -E fasthook.py`` instead (the
same answers, tens of milliseconds slower). ``guard hook`` runs the Python one. The helper is
compiled with what it must know (the protocol version, the agents' blocking status, the Python
hook it hands every call it cannot settle to) from :data:`~sandbox.agents.fasthook.VERSION`, the
agents' table and this interpreter.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from sandbox.agents import fasthook
from sandbox.agents.fasthook import MUTATING_TOOLS, VERSION, run_hook
from sandbox.agents.registry import AGENTS, HOOKED, Launch

__all__ = [
    "AGENT_STATE", "MUTATING_TOOLS", "agent_state", "compiled_helper", "helper_cache", "helper_defines",
    "hook_command", "launch", "run_hook",
]

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("guard_hook.c")


def helper_cache() -> Path:
    """Where the compiled hook helper is kept: the user's cache directory, never the package's
    own folder (read-only in a system install, and shared by every user of it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "guardfs"


def _c_string(text: str) -> str:
    """*text* as a C string literal (any byte but printable ASCII written in octal)."""
    return '"' + "".join(chr(b) if 0x20 <= b < 0x7F and b not in b'"\\?' else f"\\{b:03o}"
                         for b in os.fsencode(text)) + '"'


def helper_defines() -> list[str]:
    """The compiler's -D options that give ``guard_hook.c`` the protocol version, the agents' blocking
    statuses and the Python hook it hands what it cannot settle to (this interpreter, this fasthook.py)."""
    blocks = "".join(f"{{{_c_string(a.name)},{a.hook.block_status}}}," for a in HOOKED.values() if a.hook is not None)
    return [
        f"-DGUARD_PROTOCOL_VERSION={VERSION}",
        f"-DGUARD_AGENT_BLOCK={blocks}",
        f"-DGUARD_PYTHON={_c_string(sys.executable)}",
        f"-DGUARD_FASTHOOK={_c_string(fasthook.__file__)}",
    ]


@functools.cache
def compiled_helper() -> Path | None:
    """The compiled hook helper, built on first use; None where it cannot be built."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    defines = helper_defines()
    # The table is part of what is built: a change to it is a new helper.
    digest = hashlib.sha256(_SOURCE.read_bytes() + "\0".join(defines).encode()).hexdigest()[:12]
    folder = helper_cache()
    binary = folder / f"guard-hook-{digest}"
    if binary.exists():
        return binary
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".guard-hook-{digest}.{os.getpid()}"
        built = subprocess.run([cc, "-O2", *defines, "-o", str(tmp), str(_SOURCE)], capture_output=True, text=True,
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
    """The shell command an agent's settings name for our hook. *compiled* False: for an agent of
    another user (``guard run --user``), who cannot reach the helper in this user's cache, nor
    perhaps this interpreter (a virtualenv under /root, hidden in the sandbox: every hook call
    would fail with 127, which agents take as "not blocked"); it gets the Python hook run by the
    system's python3, as the sandbox's entry step is (:func:`sandbox.launch.isolation.system_entry`):
    the hook needs the standard library only."""
    helper = compiled_helper() if compiled else None
    if helper is not None:
        return f"{shlex.quote(str(helper))} {agent}"
    python = sys.executable if compiled else shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    return f"{shlex.quote(python)} -S -E {shlex.quote(fasthook.__file__)} {agent}"


def launch(agent: str, command: list[str], compiled: bool = True) -> tuple[list[str], Launch]:
    """*command* as *agent* (a name in the agents' table) is started under guard: with what it needs
    to call our hooks (never its own config files), and the files still to be written for it. The
    command of any other agent is left as it is."""
    known = AGENTS.get(agent)
    if known is None:
        return list(command), Launch()
    setup = known.launch(hook_command(known.name, compiled) if known.hook is not None else "")
    return [command[0], *setup.args, *command[1:]], setup


#: Where, in the staging (or run) directory, the agents' state directories are made; the run
#: removes it at its end (it holds copies of the user's login).
AGENT_STATE = "agent-state"


#: The largest login or settings file copied into an agent's state directory.
_MAX_STATE_FILE = 1 << 20


def _read_own(source: Path, uid: int | None) -> bytes | None:
    """The content of the regular file *source* (None if there is none), which must belong to
    *uid* when given: the guard copies it as root for an agent of another user, and that user
    may point the name (a symlink, ``CODEX_HOME``) at a file only root may read."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        if uid is not None and st.st_uid != uid:
            raise PermissionError(errno.EACCES, f"owned by uid {st.st_uid}, not by the agent's user ({uid})")
        data = f.read(_MAX_STATE_FILE + 1)
    if len(data) > _MAX_STATE_FILE:
        raise OSError(errno.EFBIG, f"larger than {_MAX_STATE_FILE} bytes")
    return data


def agent_state(
    setup: Launch, where: Path, environ: Mapping[str, str], owner: tuple[int, int] | None = None
) -> Path | None:
    """The agent's state directory of the run's own (:attr:`Launch.state`), created in *where*
    with copies of the user's files (those that exist; *environ* is the agent's environment, for
    the variable and HOME), owned by *owner* (uid, gid) when given; None when the agent needs none."""
    if setup.state is None:
        return None
    var, default, names, beside = setup.state
    (where / AGENT_STATE).mkdir(mode=0o711, exist_ok=True)
    state = where / AGENT_STATE / var.lower()
    state.mkdir(mode=0o700, exist_ok=True)
    home = environ.get("HOME") or str(Path.home())

    def expand(path: str) -> Path:
        return Path(home + path[1:] if path == "~" or path.startswith("~/") else path)

    user = Path(environ[var]) if environ.get(var) else expand(default)
    sources = [(user / name, name) for name in names]
    sources += [(user / name if environ.get(var) else expand(elsewhere), name) for name, elsewhere in beside]
    for source, name in sources:
        copy = state / name
        try:
            data = _read_own(source, owner[0] if owner is not None else None)
            if data is not None:
                copy.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                copy.touch(mode=0o600)
                copy.write_bytes(data)
        except OSError as err:  # the agent starts without it, and says what it misses
            log.warning("%s: not copied into the run's %s (%s)", source, var, err.strerror or err)
    if owner is not None:
        for path in (state, *state.rglob("*")):
            os.chown(path, *owner, follow_symlinks=False)
    return state
