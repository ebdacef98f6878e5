"""The state ledger: ``ledger.json`` and ``STATE.md``, for humans, CI and the agent.

The same markdown is what guardfs serves as ``.guard/STATE.md`` inside the mount.
Files in the run directory are replaced atomically (write a temporary, fsync, rename), so a
reader never sees half a ledger, also when the guard is killed mid-write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["render_state", "write_atomic", "write_ledger"]


def render_state(snap: dict[str, Any]) -> str:
    """STATE.md from a breaker snapshot."""
    files, tokens, scope = snap["files"], snap["tokens"], snap["scope"]
    max_files = "unlimited" if files["max"] is None else files["max"]
    max_window = "unlimited" if tokens["max_window"] is None else tokens["max_window"]
    failure = snap.get("guard_failure")  # set by guard run when the guard itself failed
    lines = [
        f"# guard state: {snap['state']}" if failure is None else
        f"# guard state: GUARD FAILED (internal error; the breaker was {snap['state']})",
        "",
        *([f"**The guard failed** ({failure['error']}) and stopped the agent; traceback in "
           f"`{failure['traceback']}`.", ""] if failure is not None else []),
        f"**Task {snap['task']['id']}**: {snap['task']['goal']}",
        "",
        "## Scope",
        f"- writes allowed in: {', '.join(scope['allowed']) or 'nowhere (read-only)'}",
        f"- forbidden (no read, no write): {', '.join(scope['forbidden']) or 'nothing'}",
        *(f"- {inv}" for inv in scope["invariants"]),
        "",
        "## Budget",
        f"- files mutated: {files['distinct']} of {max_files}",
        f"- tokens: {tokens['total']} total, {tokens['window']} in the last {tokens['window_steps']} steps "
        f"(max {max_window}), {tokens['since_progress']} since the last progress",
        f"- steps: {snap['steps']}; failed tool calls in a row: {snap['consecutive_failures']}",
    ]
    if files["list"]:
        lines += ["", "## Files mutated", "| file | rewrites |", "|---|---|"]
        lines += [f"| {path} | {rec['rewrites']} |" for path, rec in files["list"].items()]
    if snap["trips"]:
        lines += ["", "## Trips", "| step | rule | state | reason |", "|---|---|---|---|"]
        lines += [f"| {t['step']} | {t['rule']} | {t['state']} | {t['reason']} |" for t in snap["trips"]]
    if snap["last_feedback"]:
        lines += ["", "## Last feedback", "```", snap["last_feedback"], "```"]
    disproved = [n for n in snap["notes"] if n["kind"] == "disproved"]
    others = [n for n in snap["notes"] if n["kind"] != "disproved"]
    if disproved:
        lines += ["", "## Hypotheses disproved", *(f"- {n['text']}" for n in disproved)]
    if others:
        lines += ["", "## Notes", *(f"- ({n['kind']}) {n['text']}" for n in others)]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, data: bytes) -> None:
    """Replace *path* with *data* so that readers see the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_ledger(run_dir: Path, snap: dict[str, Any]) -> None:
    """Write ledger.json and STATE.md into *run_dir*."""
    write_atomic(run_dir / "ledger.json", json.dumps(snap, indent=2, default=str).encode())
    write_atomic(run_dir / "STATE.md", render_state(snap).encode())
