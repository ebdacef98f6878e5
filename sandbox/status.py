"""``guard status``: the state of a run, live over its control socket or, once it ended, from its ledger.

Without ``--run-dir`` it takes the latest run of this workspace: the run directories under
the default places ``guard run`` makes them (:func:`sandbox.launch.runs.default_runs_bases`)
whose ``workspace`` marker names the workspace — the git top level of the current
directory, else the directory itself, as ``guard run`` decides it
(:func:`sandbox.launch.workspace.workspace_for`). ``--follow`` prints a
line per change of the breaker's state (and per new trip) until the run ends, then the
run's last state from its ledger, and exits 0: ``guard status`` reports a run, it does not
judge it (the run's own exit status is ``guard run``'s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from guardfs.errors import UnavailableError
from guardfs.events import printable
from sandbox.breaker.client import GuardClient, GuardUnreachable, control_socket_path
from sandbox.breaker.ledger import render_state
from sandbox.exitcodes import Exit
from sandbox.launch.runs import default_runs_bases
from sandbox.launch.workspace import workspace_for

__all__ = ["FINAL_LEDGER_WAIT_S", "FOLLOW_INTERVAL_S", "latest_run", "show_status", "this_workspace"]

#: How often --follow asks the guard for its state.
FOLLOW_INTERVAL_S = 0.2
#: How long --follow waits, once the guard no longer answers, for it to write its last ledger.
FINAL_LEDGER_WAIT_S = 10.0


def this_workspace(cwd: Path | None = None) -> Path:
    """The workspace ``guard run`` would guard from *cwd* (sandbox.launch.workspace): the git
    top level, else *cwd*."""
    return workspace_for(cwd or Path.cwd(), None)


def latest_run(workspace: Path, bases: list[Path] | None = None) -> Path:
    """The run directory of the latest ``guard run`` of *workspace* (by the time its marker
    was written, at the run's start); raises UnavailableError naming where it looked."""
    bases = default_runs_bases() if bases is None else bases
    found: list[tuple[float, str, Path]] = []
    for base in bases:
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for entry in entries:
            marker = entry / "workspace"
            try:
                named = marker.read_text().strip()
                started = marker.stat().st_mtime
            except OSError:
                continue
            if os.path.realpath(named) == str(workspace):
                found.append((started, entry.name, entry))
    if not found:
        raise UnavailableError(
            f"no guard run of workspace {workspace} under {', '.join(map(str, bases))}; give the run "
            "directory guard run printed with --run-dir, or run guard status from inside that workspace")
    return max(found)[2]


def _ask(run_dir: Path) -> dict[str, Any] | None:
    """The live guard's status reply, or None when no guard answers there."""
    try:
        with GuardClient(control_socket_path(run_dir)) as guard:
            reply: dict[str, Any] = guard.status()
    except GuardUnreachable:
        return None
    return reply


def _ledger(run_dir: Path, unreachable: str) -> dict[str, Any]:
    """The ledger a finished run left; UnavailableError when there is none."""
    path = run_dir / "ledger.json"
    try:
        ledger: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        reason = "no ledger.json" if isinstance(err, FileNotFoundError) else f"cannot read {path}: {err}"
        raise UnavailableError(
            f"no guard answers in run directory {run_dir} ({unreachable}), nor does it hold a finished run "
            f"({reason}); give the run directory guard run or guard mount printed, and check that guard is "
            "still running") from err
    return ledger


def _line(ledger: dict[str, Any]) -> str:
    """The state, the counts and the latest trip, in one line."""
    counts = ledger.get("counts") or {}
    trips = ledger.get("trips") or []
    last = ""
    if trips:
        t = trips[-1]
        on = f" on {printable(str(t['path']))}" if t.get("path") else ""
        last = f"; last trip: {printable(str(t.get('rule')))}{on} at step {t.get('step')}"
    return (f"{printable(str(ledger.get('state')))}: denials {counts.get('denials', '?')}, "
            f"trips {counts.get('trips', len(trips))}{last}")


def show_status(run_dir: Path, *, as_json: bool, follow: bool, out: TextIO,
                sleep: Callable[[float], None] = time.sleep) -> int:
    """Print the state of the run in *run_dir*: the live guard's, else the finished run's
    ledger; with *follow*, a line per change until the run ends. Returns the exit status."""
    reply = _ask(run_dir)
    if not follow:
        if reply is not None:
            ledger = reply["ledger"]
        else:
            ledger = _ledger(run_dir, f"{control_socket_path(run_dir)} does not answer")
            # With --json, stdout stays one JSON document.
            print(f"(the run in {run_dir} has ended; this is its last ledger)", file=sys.stderr if as_json else out)
        print(json.dumps(ledger, indent=2) if as_json else render_state(ledger), end="", file=out)
        return Exit.OK
    print(f"following the run in {run_dir} until it ends (Ctrl-C stops following, not the run)", file=out, flush=True)
    seen: tuple[Any, ...] | None = None
    while reply is not None:
        ledger = reply["ledger"]
        now = (ledger.get("state"), len(ledger.get("trips") or []), (ledger.get("omitted") or {}).get("trips"))
        if now != seen:
            seen = now
            print(f"{time.strftime('%H:%M:%S')} " + (json.dumps(ledger) if as_json else _line(ledger)),
                  file=out, flush=True)
        sleep(FOLLOW_INTERVAL_S)
        reply = _ask(run_dir)
    # A guard that stopped answering may still be writing its last ledger: it removes its control
    # socket once that is done (one a killed guard left behind is waited for a bounded time).
    deadline = time.monotonic() + FINAL_LEDGER_WAIT_S
    while Path(control_socket_path(run_dir)).exists() and time.monotonic() < deadline:
        sleep(FOLLOW_INTERVAL_S / 4)
    ledger = _ledger(run_dir, "the guard no longer answers")
    print(f"{time.strftime('%H:%M:%S')} the run has ended: " + (json.dumps(ledger) if as_json else _line(ledger))
          + ("" if as_json else f" (ledger: {run_dir / 'ledger.json'})"), file=out, flush=True)
    return Exit.OK
