"""``guard exec -- CMD``: one tool command, quarantined, reported to the breaker.

Inside ``guard run`` an agent (or its harness) runs test and build commands through it:
the output goes to logs under ``$GUARD_RUN_DIR/exec/`` (under ``guard run``, a directory
of the guard's bound into the sandbox; the guard copies its regular files into
``RUN_DIR/exec/`` once the agent has ended, each cut at the cap, and names whatever else the
agent left there in the run's summary: :mod:`guardfs.harvest`),
each capped at ``$GUARD_LOG_MAX_BYTES`` (head and tail kept, as the agent's own logs; the
manifest's ``[sandbox] log_max_bytes``), the console gets a digest
(exit status, the failing lines in at most 1,200 characters, the logs' paths: where they
are on the host, ``RUN_DIR/exec/`` as ``guard run`` passes it in ``GUARD_HOST_EXEC_DIR``,
and where the sandbox sees them), and the
exit status goes to the breaker as a ``tool_result`` (consecutive failures, stagnation; a
passing test marks a checkpoint). ``--live`` also streams the output as it comes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from sandbox.breaker.client import GuardClient, GuardClientError
from sandbox.exitcodes import Exit
from sandbox.launch.quarantine import LOG_MAX_BYTES, Recorder, digest

__all__ = ["run_exec"]


def _pump(stream: IO[bytes], recorder: Recorder) -> None:
    fd = stream.fileno()
    for chunk in iter(lambda: os.read(fd, 65536), b""):
        recorder.feed(chunk)
    recorder.close()


def run_exec(command: list[str], live: bool = False) -> int:
    """Run *command*; returns its exit status (127 when it cannot start)."""
    cap = _log_cap()
    if cap is None:
        return Exit.USAGE
    base = Path(os.environ.get("GUARD_RUN_DIR") or tempfile.gettempdir()) / "exec"
    base.mkdir(parents=True, exist_ok=True)
    stem = base / f"{time.strftime('%H%M%S')}-{os.getpid()}"
    out_log, err_log = Path(f"{stem}.out.log"), Path(f"{stem}.err.log")
    echo_out = os.fdopen(os.dup(1), "wb", buffering=0) if live else None
    echo_err = os.fdopen(os.dup(2), "wb", buffering=0) if live else None
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as err:
        print(f"guard exec: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
        status = 127
    else:
        assert proc.stdout is not None
        assert proc.stderr is not None
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, Recorder(out_log, echo_out, cap))),
                 threading.Thread(target=_pump, args=(proc.stderr, Recorder(err_log, echo_err, cap)))]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:
            t.join()
        status = 128 - code if code < 0 else code
    print(digest(f"{shlex.join(command)} exited with status {status}", [out_log, err_log], failed=status != 0,
                 shown=_where(out_log, err_log)), flush=True)
    _report(command, status)
    return status


def _where(*logs: Path) -> str:
    """Where the logs are, for the digest: on the host (for the human, who reads them in the
    run directory), then here (for the agent, who may read them in its sandbox)."""
    host = os.environ.get("GUARD_HOST_EXEC_DIR")
    here = ", ".join(str(p) for p in logs)
    if not host or Path(host) == logs[0].parent:
        return here
    return ", ".join(str(Path(host) / p.name) for p in logs) + f" (the same names in {logs[0].parent}/ in here)"


def _log_cap() -> int | None:
    """The cap of each log: what guard run passes in the environment, else the default;
    None (said on stderr) when the variable is not a byte count."""
    raw = os.environ.get("GUARD_LOG_MAX_BYTES", "")
    if not raw:
        return LOG_MAX_BYTES
    if raw.isdigit() and len(raw) < 20 and int(raw) >= 2:
        return int(raw)
    print(f"guard exec: GUARD_LOG_MAX_BYTES={raw[:40]!r} is not a byte count (at least 2); unset it, "
          "or set it as guard run does", file=sys.stderr)
    return None


def _report(command: list[str], status: int) -> None:
    if not os.environ.get("GUARD_SOCKET"):
        return
    try:
        with GuardClient() as guard:
            reply = guard.tool_result("exec", status, shlex.join(command)[:4000])
    except GuardClientError as err:
        print(f"guard exec: could not report to the guard: {err}", file=sys.stderr)
        return
    if reply.get("feedback"):
        print(reply["feedback"], file=sys.stderr)
