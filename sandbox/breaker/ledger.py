"""The state ledger: ``ledger.json`` and ``STATE.md``, for humans, CI and the agent.

The same markdown is what guardfs serves as ``.guard/STATE.md`` inside the mount. What the
agent controls in it (names, notes, reasons quoting names) is escaped, so that it cannot
forge the document's structure; both files are bounded by the snapshot's bounds.
Files in the run directory are replaced atomically (write a temporary, fsync, rename), so a
reader never sees half a ledger, also when the guard is killed mid-write.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from guardfs.events import json_safe, md_text, printable

__all__ = ["render_state", "write_atomic", "write_ledger"]

def _fenced(text: str) -> list[str]:
    """*text* as a fenced block that no line of it can close: the fence is longer than
    any run of backticks inside. Lines keep their breaks; each line is made printable."""
    lines = [printable(line) for line in text.split("\n")]
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence, *lines, fence]


def _more(omitted: dict[str, int], key: str, what: str) -> list[str]:
    n = omitted.get(key, 0)
    return [f"- ({n} {what} not shown; record.ledger_max_items bounds this list)"] if n else []


def _rollback_lines(rollbacks: list[dict[str, Any]]) -> list[str]:
    """One item per rollback, and one below it per path it could not put back or moved aside."""
    lines = []
    for r in rollbacks:
        incomplete = f"; **{r['failed_count']} path(s) NOT restored**" if r["failed_count"] else ""
        lines.append(f"- step {r['step']}, asked by the {md_text(r['by'])}, to {md_text(r['to'])}: "
                     f"{r['restored']} path(s) restored{incomplete}")
        lines += [f"  - NOT restored: {md_text(f['path'])}: {md_text(f['reason'])}" for f in r["failed"]]
        if r["failed_count"] > len(r["failed"]):
            lines.append(f"  - ({r['failed_count'] - len(r['failed'])} more not shown; record.ledger_max_items)")
        lines += [f"  - moved aside: {md_text(m['path'])} -> {md_text(m['to'])}" for m in r["moved_aside"]]
        if r["moved_aside_count"] > len(r["moved_aside"]):
            lines.append(f"  - ({r['moved_aside_count'] - len(r['moved_aside'])} more moved aside, not shown)")
    return lines


def _listed(patterns: list[str]) -> str:
    return ", ".join(map(md_text, patterns)) or "nothing"


def render_state(snap: dict[str, Any]) -> str:
    """STATE.md from a breaker snapshot; every text the agent controls is escaped."""
    files, tokens, scope = snap["files"], snap["tokens"], snap["scope"]
    omitted: dict[str, int] = snap.get("omitted", {})
    max_files = "unlimited" if files["max"] is None else files["max"]
    max_window = "unlimited" if tokens["max_window"] is None else tokens["max_window"]
    failure = snap.get("guard_failure")  # set by guard run when the guard itself failed
    lines = [
        f"# guard state: {snap['state']}" if failure is None else
        f"# guard state: GUARD FAILED (internal error; the breaker was {snap['state']})",
        "",
        *([f"**The guard failed** ({md_text(failure['error'])}) "
           + ("and stopped the agent" if "after_agent" not in failure else
              f"after the agent had ended (status {md_text(failure['after_agent'])})")
           + f"; traceback in {md_text(failure['traceback'])}.", ""] if failure is not None else []),
        f"**Task {md_text(snap['task']['id'])}**: {md_text(snap['task']['goal'])}",
        "",
        "## Scope",
        f"- writes allowed in: {', '.join(map(md_text, scope['allowed'])) or 'nowhere (read-only)'}",
        f"- secret, never read nor written (paths.secret): {_listed(scope['forbidden'])}",
        f"- read-only, never written (paths.protected): {_listed(scope.get('protected', []))}",
        *(f"- {md_text(inv)}" for inv in scope["invariants"]),
        "",
        "## Budget",
        f"- files mutated: {files['distinct']} of {max_files}",
        f"- tokens: {tokens['total']} total, {tokens['window']} in the last {tokens['window_steps']} steps "
        f"(max {max_window}), {tokens['since_progress']} since the last progress",
        f"- steps: {snap['steps']}; failed tool calls in a row: {snap['consecutive_failures']}",
        *([f"- denials (operations or tool calls refused): {counts['denials']}; trips: {counts['trips']}"]
          if (counts := snap.get("counts")) else []),
    ]
    if files["list"]:
        lines += ["", "## Files mutated", "| file | rewrites |", "|---|---|"]
        lines += [f"| {md_text(path)} | {rec['rewrites']} |" for path, rec in files["list"].items()]
        lines += _more(omitted, "files", "more files (fewer rewrites)")
    if snap["trips"]:
        lines += ["", "## Trips", "| step | rule | path | state | reason |", "|---|---|---|---|---|"]
        lines += [f"| {t['step']} | {md_text(t['rule'])} | {md_text(t.get('path') or '-')} | {md_text(t['state'])} "
                  f"| {md_text(t['reason'])} |" for t in snap["trips"]]
        lines += _more(omitted, "trips", "trips between the first and the most recent")
    if rollbacks := snap.get("rollbacks"):
        lines += ["", "## Rollbacks", *_rollback_lines(rollbacks)]
        lines += _more(omitted, "rollbacks", "rollbacks between the first and the most recent")
    if snap["last_feedback"]:
        lines += ["", "## Last feedback", *_fenced(snap["last_feedback"])]
    disproved = [n for n in snap["notes"] if n["kind"] == "disproved"]
    others = [n for n in snap["notes"] if n["kind"] != "disproved"]
    if disproved:
        lines += ["", "## Hypotheses disproved", *(f"- {md_text(n['text'])}" for n in disproved)]
    if others:
        lines += ["", "## Notes", *(f"- ({md_text(n['kind'])}) {md_text(n['text'])}" for n in others)]
    if omitted.get("notes"):
        lines += ["", f"({omitted['notes']} older notes not shown; record.max_notes and "
                      "record.ledger_max_items bound them)"]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, data: bytes) -> None:
    """Replace *path* with *data* so that readers see the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    # An explicit mode, whatever the umask: the ledger is the guard's record, for the guard's
    # user alone (a writable one would let a local user rewrite the run's verdict).
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # a temporary left behind by a killed guard keeps its old mode
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_ledger(run_dir: Path, snap: dict[str, Any]) -> None:
    """Write ledger.json and STATE.md into *run_dir*.

    Strings in ledger.json are escaped as in events.jsonl (:func:`guardfs.events.escape_name`).
    """
    write_atomic(run_dir / "ledger.json", json.dumps(json_safe(snap), indent=2, default=str).encode())
    write_atomic(run_dir / "STATE.md", render_state(snap).encode())
