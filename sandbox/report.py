"""What a finished (or live) run looked like, for people: ``guard report`` and CI conventions.

One reader, :func:`load_run`, turns a run directory (``ledger.json``, ``run.json``,
``events.jsonl``, the quarantined logs) into a :class:`RunRecord`; the renderers only format it. Its counts of
denials and trips are the ledger's (``counts``, kept by the guard as each event happened),
the same numbers the run's summary printed, whatever the event log's caps left out of
``events.jsonl``; the rows are the events the log kept.

- :func:`render_html`: one self-contained page (inline CSS and SVG, no script, no network):
  how the run ended and who stopped it, its command and scope, what it changed (a diff stat
  from ``run.json``), a timeline (tokens per step, or file events over time when no step was
  reported), each distinct feedback message once, and links to the logs that work from
  wherever the page is written;
- :func:`github_annotations` and :func:`github_step_summary`: GitHub Actions' workflow
  commands and job summary, for ``guard run --ci`` under ``GITHUB_ACTIONS=true``.

Everything in a run directory that the agent could influence (paths, reasons, feedback,
tool names) is escaped for the format it lands in.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shlex
import stat
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guardfs.errors import UsageError
from guardfs.events import printable, tally_kind
from sandbox.launch.facts import read_facts

__all__ = [
    "ANNOTATION_LIMIT", "ReportError", "RunRecord", "github_annotations", "github_step_summary", "load_run",
    "render_html", "write_github",
]

#: GitHub shows at most 10 error annotations per step; past that the rest are summarised in one.
ANNOTATION_LIMIT = 10
#: Rows kept of each kind read from events.jsonl; a larger log is summarised by count.
ROW_LIMIT = 2000
#: The run directory's own files the page links to, beside exec/'s logs.
_RECORDS = ("stdout.log", "stderr.log", "events.jsonl", "ledger.json", "run.json", "STATE.md", "guard-error.log")


class ReportError(UsageError):
    """The run directory cannot be reported on (missing or unreadable files)."""


@dataclass
class RunRecord:
    """What a report shows of one run."""

    run_dir: Path
    ledger: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    trips: list[dict[str, Any]] = field(default_factory=list)
    denials: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"steps": 0, "trips": 0, "denials": 0, "events": 0})
    logs: list[tuple[Path, int]] = field(default_factory=list)  # (path, size in bytes), regular files only
    bad_lines: int = 0  # lines of events.jsonl that were not JSON objects (a crash mid-write, say)
    facts: dict[str, Any] = field(default_factory=dict)  # run.json (sandbox.launch.facts); {} for an older guard's
    changes: list[dict[str, Any]] = field(default_factory=list)  # file events (allowed or refused), for the timeline

    @property
    def started(self) -> float | None:
        """When the run started: run.json's, else the first event's time (None without either)."""
        for value in (self.facts.get("started"), *(e.get("time") for e in (self.changes[:1] + self.trips[:1]))):
            if isinstance(value, int | float):
                return float(value)
        return None

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """Files mutated, with their rewrite counts, from the ledger."""
        listed: dict[str, dict[str, Any]] = self.ledger.get("files", {}).get("list", {})
        return listed


def load_run(run_dir: Path) -> RunRecord:
    """Read a run directory; raise ReportError naming what is missing."""
    ledger_path = run_dir / "ledger.json"
    try:
        ledger = json.loads(ledger_path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ReportError(f"{ledger_path} does not exist: is {run_dir} the run directory guard run printed?") from err
    except (OSError, ValueError) as err:
        raise ReportError(f"cannot read {ledger_path}: {err}") from err
    if not isinstance(ledger, dict):
        raise ReportError(f"{ledger_path} is not a ledger (a JSON object was expected)")
    record = RunRecord(run_dir, ledger)
    try:
        with open(run_dir / "events.jsonl", "rb") as f:
            for raw in f:  # streamed: an event log can be large
                _take(record, raw)
    except FileNotFoundError:
        pass  # a run that ended before its first event
    except OSError as err:
        raise ReportError(f"cannot read {run_dir / 'events.jsonl'}: {err}") from err
    counts = ledger.get("counts")
    if isinstance(counts, dict):  # a ledger of a guard before counts: what events.jsonl holds
        for kind in ("denials", "trips"):
            if isinstance(counts.get(kind), int):
                record.counts[kind] = counts[kind]
    record.logs = _logs(run_dir)
    record.facts = read_facts(run_dir)
    return record


def _logs(run_dir: Path) -> list[tuple[Path, int]]:
    """The run's logs with their sizes: regular files only, judged by lstat. A run directory
    of an older guard may hold what an agent put in ``exec/`` (a symlink to a secret, a FIFO):
    no link is followed, no target stat'ed, nothing opened."""
    found = []
    for path in (run_dir / name for name in _RECORDS):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                found.append((path, st.st_size))
    with contextlib.suppress(OSError):
        if stat.S_ISDIR((run_dir / "exec").lstat().st_mode):
            with os.scandir(run_dir / "exec") as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        if entry.name.endswith(".log") and entry.is_file(follow_symlinks=False):
                            found.append((Path(entry.path), entry.stat(follow_symlinks=False).st_size))
    return sorted(found)


def _take(record: RunRecord, raw: bytes) -> None:
    try:
        event = json.loads(raw)
    except ValueError:
        record.bad_lines += 1
        return
    if not isinstance(event, dict):
        record.bad_lines += 1
        return
    record.counts["events"] += 1
    op = event.get("op")
    kind = "steps" if op == "step" else tally_kind(str(op), str(event.get("decision")))
    if op != "trip" and event.get("path") and len(record.changes) < ROW_LIMIT:
        record.changes.append(event)
    if kind is None:
        return
    rows = {"steps": record.steps, "trips": record.trips, "denials": record.denials}[kind]
    record.counts[kind] += 1
    if len(rows) < ROW_LIMIT:
        rows.append(event)


def _text(value: Any) -> str:
    return "" if value is None else str(value)


# --- HTML -----------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#1d2330;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dce4}
.state{display:inline-block;padding:2px 8px;border-radius:4px;font-weight:600;color:#fff;background:#2f8f46}
.state.open{background:#c4352b} .state.half{background:#c98a12} .state.fail{background:#6b3fa0}
table{border-collapse:collapse;width:100%;margin:6px 0} th,td{border:1px solid #d8dce4;padding:4px 6px;
text-align:left;vertical-align:top} th{background:#f2f4f8} td.n{text-align:right;
font-variant-numeric:tabular-nums;white-space:nowrap}
table.facts th{width:150px;font-weight:600} table.facts td code{word-break:break-all}
pre{white-space:pre-wrap;margin:0;font:12px/1.4 ui-monospace,monospace;background:#f7f8fa;padding:6px}
code{font:12px ui-monospace,monospace} .add{color:#1f7a35} .del{color:#b3261e} .out{background:#fdecea}
.muted{color:#5b6475} svg text{font:11px system-ui,sans-serif} .fb{margin:10px 0;padding:0 0 0 10px;
border-left:3px solid #c4352b} .fb h3{font-size:14px;margin:0 0 4px}
"""


def state_class(state: str) -> str:
    """The badge's CSS class for a breaker state (open, half, or none for CLOSED)."""
    return "open" if state.startswith("OPEN") else "half" if state.startswith("HALF") else ""


def render_html(record: RunRecord, out: Path | None = None) -> str:
    """One self-contained HTML page for the run. Links to the run's files are relative to the
    directory of *out* (where the page is written); without *out* (a page sent to stdout)
    they are absolute ``file:`` URIs."""
    led = record.ledger
    state = _text(led.get("state", "?"))
    task = led.get("task", {})
    tokens = led.get("tokens", {})
    files = led.get("files", {})
    e = html.escape
    feedback = _Feedback(record)
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>guard report: {e(_text(task.get('id')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>guard report: {e(_text(task.get('id')))}</h1>",
        f"<p>{e(_text(task.get('goal')))}</p>",
        f"<p>Breaker: <span class='state {state_class(state)}'>{e(state)}</span> &nbsp; "
        f"steps: {record.counts['steps']} &nbsp; tokens: {e(_text(tokens.get('total', 0)))} &nbsp; "
        f"files mutated: {e(_text(files.get('distinct', 0)))} of {e(_text(files.get('max') or 'unlimited'))} &nbsp; "
        f"denials: {record.counts['denials']} &nbsp; trips: {record.counts['trips']}</p>",
        _header(record),
        "<h2 id=diff>What the run changed</h2>",
        _diff_table(record),
        "<h2 id=timeline>Timeline: tokens per step</h2>" if record.steps else
        "<h2 id=timeline>Timeline: file events over time</h2>",
        _timeline_svg(record) if record.steps else _events_svg(record),
        "<h2 id=trips>Trips</h2>",
        _trips_table(record, feedback),
        "<h2 id=denials>Denials</h2>",
        _denials_table(record, feedback),
        "<h2 id=feedback>Feedback the agent got</h2>",
        feedback.render(),
        "<h2 id=files>Files mutated: rewrites</h2>",
        _files_table(record),
        "<h2 id=logs>Logs and records</h2>",
        _logs_list(record, out),
    ]
    if record.bad_lines:
        parts.append(f"<p class=muted>{record.bad_lines} line(s) of events.jsonl were not JSON and were skipped.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def shown(text: str) -> str:
    """*text* (which may hold a name's undecodable bytes as surrogates) for a UTF-8 page."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def utc(seconds: float) -> str:
    """A time as ``2026-12-02 03:04:05 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def stopped_by(record: RunRecord) -> str:
    """Who or what ended the run, in words: run.json's ``stopped_by``, else what the ledger says."""
    stop = record.facts.get("stopped_by")
    if isinstance(stop, dict):
        kind = _text(stop.get("kind"))
        words = {"agent": "the agent exited by itself", "breaker": "the breaker",
                 "timeout": "the breaker's idle timeout", "operator": "a human",
                 "signal": "a signal to the guard", "guard-failure": "the guard's own failure"}.get(kind, kind)
        detail = _text(stop.get("detail"))
        return f"{words}: {detail}" if detail and kind != "agent" else detail or words
    if led_failure := record.ledger.get("guard_failure"):
        return f"the guard's own failure ({_text(led_failure.get('error') if isinstance(led_failure, dict) else '')})"
    return "not recorded (no run.json: a run of an older guard, or one killed before it ended)"


#: Characters of the command the header shows before folding the rest (an agent's prompt can be long).
_COMMAND_SHOWN = 240


def _header(record: RunRecord) -> str:
    facts, led, e = record.facts, record.ledger, html.escape
    rows: list[tuple[str, str]] = []
    status = facts.get("exit_status")
    rows.append(("exit status", e(_text(status)) if status is not None else "<span class=muted>not recorded</span>"))
    rows.append(("stopped by", e(stopped_by(record))))
    started = record.started
    rows.append(("started", e(utc(started)) + ("" if "started" in facts else " <span class=muted>(its first event; "
                                                "run.json has no start)</span>") if started is not None
                 else "<span class=muted>not recorded</span>"))
    duration = facts.get("duration_s")
    rows.append(("duration", e(f"{duration:.1f} s") if isinstance(duration, int | float)
                 else "<span class=muted>not recorded (the run did not end, or an older guard)</span>"))
    command = facts.get("command")
    if isinstance(command, list):
        text = shown(shlex.join(str(a) for a in command))
        rows.append(("command", f"<code>{e(text)}</code>" if len(text) <= _COMMAND_SHOWN else
                     f"<details><summary><code>{e(text[:_COMMAND_SHOWN])}</code>&hellip; ({len(text):,} characters: "
                     f"open for all)</summary><code>{e(text)}</code></details>"))
    for key in ("cwd", "workspace"):
        if facts.get(key):
            rows.append((key if key != "cwd" else "directory", f"<code>{e(shown(_text(facts[key])))}</code>"))
    task = led.get("task", {})
    rows.append(("task", f"{e(_text(task.get('id')))}"))
    scope = led.get("scope", {})
    if isinstance(scope, dict):
        for key, label, empty in (("allowed", "writes allowed in", "nowhere (read-only)"),
                                  ("forbidden", "forbidden", "nothing"), ("protected", "read-only", "")):
            items = scope.get(key) or []
            if items or empty:
                rows.append((label, ", ".join(f"<code>{e(_text(p))}</code>" for p in items) or e(empty)))
    rows.append(("run directory", f"<code>{e(shown(os.path.abspath(record.run_dir)))}</code>"))
    return "<table class=facts>" + "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _diff_table(record: RunRecord) -> str:
    diff = record.facts.get("diff")
    if not isinstance(diff, dict) or "totals" not in diff:
        why = _text(diff.get("error")) if isinstance(diff, dict) else \
            "run.json has no diff (a run of an older guard, or one killed before it ended)"
        return f"<p class=muted>No diff stat: {html.escape(why)}. The rewrites below are the ledger's.</p>"
    totals, e = diff["totals"], html.escape
    if not totals.get("files"):
        return "<p>The run left no file changed.</p>"
    summary = (f"<p><b>{totals['files']}</b> file(s) changed: {totals.get('in_scope', 0)} in scope, "
               f"<b class={'out' if totals.get('out_of_scope') else ''}>{totals.get('out_of_scope', 0)} out of "
               f"scope</b>; {totals.get('added', 0)} added, {totals.get('modified', 0)} modified, "
               f"{totals.get('deleted', 0)} deleted; <span class=add>+{totals.get('lines_added', 0)}</span> "
               f"<span class=del>&minus;{totals.get('lines_deleted', 0)}</span> lines</p>")
    rows = []
    for f in diff.get("files", []):
        lines = ("binary" if f.get("binary") else "?") if f.get("added") is None else None
        rows.append([e(printable(_text(f.get("path")))), e(_text(f.get("change"))),
                     f"<span class=add>+{f['added']}</span>" if lines is None else e(lines),
                     f"<span class=del>&minus;{f['deleted']}</span>" if lines is None else "",
                     "in scope" if f.get("in_scope") else
                     f"<b class=out>out of scope</b> ({e(_text(f.get('scope')))})"])
    more = diff.get("omitted") or 0
    return summary + _table(["file", "change", "lines added", "lines deleted", "scope"], rows, frozenset({2, 3})) + (
        f"<p class=muted>and {more} more file(s), counted above.</p>" if more else "")


def _timeline_svg(record: RunRecord) -> str:
    steps = record.steps
    width, height, left, bottom, top = 1000, 254, 64, 34, 26  # the top margin holds the trips' labels
    plot_w, plot_h = width - left - 12, height - bottom - top
    peak = max(int(s.get("tokens") or 0) for s in steps) or 1
    n = len(steps)
    bar = plot_w / n
    out = [f"<svg role=img aria-label='tokens per step' viewBox='0 0 {width} {height}' width='100%'>",
           f"<line x1={left} y1={top + plot_h} x2={left + plot_w} y2={top + plot_h} stroke='#555'/>",
           f"<line x1={left} y1={top} x2={left} y2={top + plot_h} stroke='#555'/>",
           f"<text x={left - 6} y={top + 4} text-anchor=end>{peak:,}</text>",
           f"<text x={left - 6} y={top + plot_h} text-anchor=end>0</text>",
           f"<text x={left + plot_w / 2} y={height - 4} text-anchor=middle>step (1 to {n})</text>",
           f"<text transform='translate(14 {top + plot_h / 2}) rotate(-90)' text-anchor=middle>tokens</text>"]
    for i, step in enumerate(steps):
        value = int(step.get("tokens") or 0)
        h = plot_h * value / peak
        x = left + i * bar
        tool = html.escape(_text(step.get("tool")) or "-")
        out.append(f"<rect class=step x={x + bar * 0.1:.1f} y={top + plot_h - h:.1f} width={max(bar * 0.8, 0.5):.1f} "
                   f"height={h:.1f} fill='#4a78c2'><title>step {step.get('step')}: {value:,} tokens, "
                   f"tool {tool}</title></rect>")
    at_step: dict[int, list[str]] = {}
    for trip in record.trips:
        at_step.setdefault(int(trip.get("step") or 0), []).append(_text(trip.get("rule")))
    for index, rules in at_step.items():
        # A trip at step N came after the agent reported its Nth step: between bars N and N+1.
        x = left + min(index, n) * bar
        label = html.escape(", ".join(f"{rule} \u00d7{k}" if k > 1 else rule for rule, k in Counter(rules).items()))
        anchor, dx = ("end", -4) if x > left + plot_w * 0.75 else ("start", 4)
        for rule in rules:
            out.append(f"<line class=trip x1={x:.1f} y1={top} x2={x:.1f} y2={top + plot_h} stroke='#c4352b' "
                       f"stroke-width=2 stroke-dasharray='5 3'><title>trip at step {index}: {html.escape(rule)}"
                       "</title></line>")
        out.append(f"<text x={x + dx:.1f} y={top - 8} text-anchor={anchor} fill='#c4352b'>{label}</text>")
    out.append("</svg>")
    if record.counts["steps"] > len(steps):
        out.append(f"<p class=muted>first {len(steps)} of {record.counts['steps']} steps shown.</p>")
    return "\n".join(out)


def _offset(record: RunRecord, event: dict[str, Any]) -> float | None:
    """Seconds from the run's start to *event* (None without a time)."""
    start, when = record.started, event.get("time")
    return max(float(when) - start, 0.0) if isinstance(when, int | float) and start is not None else None


def when(record: RunRecord, event: dict[str, Any]) -> str:
    """Where in the run *event* happened: its step when the agent reported steps, else the
    seconds since the start."""
    if record.steps:
        if isinstance(event.get("step"), int):
            return f"step {event['step']}"
        at = event.get("time")  # a denial has no step of its own: the steps reported before it
        if isinstance(at, int | float):
            return f"step {sum(1 for s in record.steps if float(s.get('time') or 0) <= at)}"
    offset = _offset(record, event)
    return f"+{offset:.2f} s" if offset is not None else f"step {_text(event.get('step'))}"


def _events_svg(record: RunRecord) -> str:
    """No step came (a shell agent, no hook): the file events and trips over time, in lanes."""
    timed = [(o, ev) for ev in record.changes if (o := _offset(record, ev)) is not None]
    trips = [(o, t) for t in record.trips if (o := _offset(record, t)) is not None]
    if not timed and not trips:
        return "<p class=muted>No steps were reported and no file event was recorded.</p>"
    # From the first event to the last: a shell agent's events come within milliseconds, long
    # after the mount's set-up; the axis says where that window lies in the run.
    offsets = [o for o, _ in timed + trips]
    lo, hi = min(offsets), max(offsets)
    pad = max((hi - lo) * 0.04, 0.0005)
    lo, span = max(lo - pad, 0.0), hi + pad - max(lo - pad, 0.0)
    width, left, top, lane, bottom = 1000, 90, 10, 34, 28
    plot_w = width - left - 16
    lanes = [("changes", "#4a78c2"), ("refused", "#d9822b"), ("trips", "#c4352b")]
    height = top + lane * len(lanes) + bottom
    e = html.escape
    out = [f"<svg role=img aria-label='file events over time' viewBox='0 0 {width} {height}' width='100%'>"]
    for i, (name, _colour) in enumerate(lanes):
        y = top + lane * i + lane / 2
        out.append(f"<text x={left - 8} y={y + 4:.0f} text-anchor=end>{name}</text>"
                   f"<line x1={left} y1={y:.0f} x2={left + plot_w} y2={y:.0f} stroke='#e1e4ea'/>")
    base = top + lane * len(lanes)
    out.append(f"<line x1={left} y1={base} x2={left + plot_w} y2={base} stroke='#555'/>"
               f"<text x={left} y={base + 16} text-anchor=start>+{lo:.3f} s</text>"
               f"<text x={left + plot_w} y={base + 16} text-anchor=end>+{lo + span:.3f} s</text>"
               f"<text x={left + plot_w / 2} y={base + 16} text-anchor=middle>seconds since the start "
               "(no steps were reported: positions are times)</text>")

    def x(offset: float) -> float:
        return left + plot_w * (offset - lo) / span

    for offset, ev in timed:
        refused = ev.get("decision") == "deny"
        y = top + lane * (1 if refused else 0) + 6
        colour = lanes[1 if refused else 0][1]
        out.append(f"<rect class={'refused' if refused else 'change'} x={x(offset) - 2:.1f} y={y} width=4 "
                   f"height={lane - 12} fill='{colour}'><title>+{offset:.2f} s: {e(_text(ev.get('op')))} "
                   f"{e(printable(_text(ev.get('path'))))} ({e(_text(ev.get('decision')))})</title></rect>")
    for offset, trip in trips:
        out.append(f"<line class=trip x1={x(offset):.1f} y1={top} x2={x(offset):.1f} y2={base} stroke='#c4352b' "
                   f"stroke-width=2 stroke-dasharray='4 3'><title>+{offset:.2f} s: {e(_text(trip.get('rule')))} "
                   f"trip on {e(printable(_text(trip.get('on'))))}</title></line>"
                   f"<circle cx={x(offset):.1f} cy={top + lane * 2.5:.0f} r=6 fill='#c4352b'/>")
    out.append("</svg>")
    out.append("<p class=muted>No steps were reported (no agent hook, stream or client fed tokens): "
               "the token rules judged nothing.</p>")
    if len(record.changes) >= ROW_LIMIT:
        out.append(f"<p class=muted>first {ROW_LIMIT} file events shown.</p>")
    return "\n".join(out)


def _table(head: list[str], rows: list[list[str]], numeric: frozenset[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td class=n>{c}</td>" if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


class _Feedback:
    """Each distinct message the agent got (a trip's feedback, a denial's reason) once, with
    where it was given: today's messages repeat the task, scope and way back in full."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.ids: dict[str, int] = {}
        self.given: list[list[str]] = []
        for trip in record.trips:
            self._add(_text(trip.get("feedback")),
                      f"trip {_text(trip.get('rule'))} on {printable(_text(trip.get('on')) or '-')} "
                      f"at {when(record, trip)}")
        for denial in record.denials:
            self._add(_text(denial.get("reason")),
                      f"denial of {_text(denial.get('op'))} {printable(_text(denial.get('path')))}")

    def _add(self, message: str, where: str) -> None:
        if not message:
            return
        if message not in self.ids:
            self.ids[message] = len(self.ids) + 1
            self.given.append([])
        self.given[self.ids[message] - 1].append(where)

    def cell(self, message: str) -> str:
        """A table cell for *message*: its first line and a link to the message in full."""
        if not message:
            return ""
        n = self.ids[message]
        first = html.escape(message.split("\n", 1)[0])
        return f"{first} <a href='#fb{n}'>[feedback {n}]</a>"

    def render(self) -> str:
        if not self.ids:
            return "<p>No feedback was given: nothing was refused.</p>"
        e = html.escape
        out = [f"<p class=muted>{len(self.ids)} distinct message(s), each shown once.</p>"]
        for message, n in self.ids.items():
            where = self.given[n - 1]
            listed = "; ".join(where[:20]) + (f"; and {len(where) - 20} more" if len(where) > 20 else "")
            out.append(f"<div class=fb id=fb{n}><h3>Feedback {n}: given {len(where)} time(s)</h3>"
                       f"<p class=muted>{e(listed)}</p><pre>{e(message)}</pre></div>")
        return "\n".join(out)


def _trips_table(record: RunRecord, feedback: _Feedback) -> str:
    if not record.trips:
        return "<p>No trips: the breaker stayed closed.</p>"
    e = html.escape
    rows = [[e(when(record, t)), e(_text(t.get("rule"))), e(printable(_text(t.get("on")))), e(_text(t.get("state"))),
             e(_text(t.get("reason"))), feedback.cell(_text(t.get("feedback")))] for t in record.trips]
    more = record.counts["trips"] - len(record.trips)
    return _table(["when", "rule", "path", "state", "reason", "feedback the agent got"], rows, frozenset({0})) + (
        f"<p class=muted>and {more} more not listed in events.jsonl.</p>" if more > 0 else "")


def _denials_table(record: RunRecord, feedback: _Feedback) -> str:
    if not record.denials and not record.counts["denials"]:
        return "<p>No operation was refused.</p>"
    e = html.escape
    rows = [[e(when(record, d)), e(_text(d.get("op"))), e(printable(_text(d.get("path")))), e(_text(d.get("rule"))),
             e(_text(d.get("errno"))), feedback.cell(_text(d.get("reason")))] for d in record.denials]
    more = record.counts["denials"] - len(record.denials)
    return _table(["when", "operation", "path", "rule", "errno", "what the agent was told"], rows, frozenset({0})) + (
        f"<p class=muted>and {more} more (counted by the guard; events.jsonl lists those its caps "
        "kept).</p>" if more > 0 else "")


def _files_table(record: RunRecord) -> str:
    if not record.files:
        return "<p>No file was changed.</p>"
    e = html.escape
    rows = []
    for path, info in record.files.items():
        symbols = info.get("symbols") or {}
        detail = ", ".join(f"{name}: {count}" for name, count in symbols.items()) if isinstance(symbols, dict) else ""
        rows.append([e(path), e(_text(info.get("rewrites"))), "yes" if info.get("created") else "", e(detail)])
    return _table(["file", "rewrites", "created", "rewrites per symbol"], rows, frozenset({1}))


def link(target: Path, out: Path | None) -> str:
    """An href to *target* from a page written at *out*: relative to its directory, or an
    absolute ``file:`` URI when the page has no place (stdout). Percent-encoded by its bytes."""
    if out is None:
        return Path(os.path.abspath(target)).as_uri()
    rel = os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(out)))
    return urllib.parse.quote(os.fsencode(rel))


def _logs_list(record: RunRecord, out: Path | None) -> str:
    if not record.logs:
        return "<p class=muted>No logs in the run directory.</p>"
    items = []
    for log, size in record.logs:
        rel = os.path.relpath(log, record.run_dir)
        # The name is the agent's, any bytes: the link by its bytes, percent-encoded; the text escaped.
        items.append(f"<li><a href='{html.escape(link(log, out), quote=True)}'>"
                     f"{html.escape(printable(rel))}</a> "
                     f"({size:,} bytes)</li>")
    return "<ul>" + "".join(items) + "</ul>"


# --- GitHub Actions ------------------------------------------------------------------------

def _gh_data(text: str) -> str:
    """Escape a workflow command's message (GitHub's rules: %, CR, LF)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(text: str) -> str:
    """Escape a workflow command's property value (also ':' and ',')."""
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(record: RunRecord, limit: int = ANNOTATION_LIMIT) -> list[str]:
    """``::error`` lines for the run's trips, then its denials; past *limit*, one line saying how
    many more there were and where to look."""
    items: list[tuple[str, str, str]] = []  # (file, title, message)
    for trip in record.trips:
        items.append((_text(trip.get("on")), f"guard: {_text(trip.get('rule'))} trip",
                      f"step {_text(trip.get('step'))}: {_text(trip.get('reason'))}"))
    for denial in record.denials:
        items.append((_text(denial.get("path")), f"guard: {_text(denial.get('op'))} refused",
                      _text(denial.get("reason")) or f"refused by {_text(denial.get('rule'))}"))
    total = record.counts["trips"] + record.counts["denials"]
    out = []
    shown = items[:limit] if total <= limit else items[:limit - 1]
    for file, title, message in shown:
        where = f"file={_gh_property(file)},line=1," if file else ""
        out.append(f"::error {where}title={_gh_property(title)}::{_gh_data(message)}")
    if total > len(shown):
        out.append(f"::error title=guard::{total - len(shown)} more trip(s) and denial(s): see "
                   f"{_gh_data(str(record.run_dir / 'events.jsonl'))} or the job summary")
    return out


def github_step_summary(record: RunRecord, exit_status: int, artifact: str | None = None) -> str:
    """The job summary's markdown for the run."""
    led = record.ledger
    tokens = led.get("tokens", {})
    files = record.files

    def cell(value: Any) -> str:
        return _text(value).replace("|", "\\|").replace("\n", " ").replace("`", "'")

    lines = [
        f"### guard: {cell(led.get('task', {}).get('id'))}",
        "",
        "| | |",
        "|---|---|",
        f"| exit status | {exit_status} |",
        f"| breaker | `{cell(led.get('state'))}` |",
        f"| files mutated | {cell(led.get('files', {}).get('distinct', len(files)))} |",  # the list is bounded
        f"| denials | {record.counts['denials']} |",
        f"| trips | {record.counts['trips']} |",
        f"| tokens | {cell(tokens.get('total', 0))} in {record.counts['steps']} steps |",
        f"| run directory | {'uploaded as artifact `' + cell(artifact) + '`' if artifact else cell(record.run_dir)} |",
    ]
    if record.trips:
        lines += ["", "| step | rule | path | reason |", "|---|---|---|---|"]
        lines += [f"| {cell(t.get('step'))} | {cell(t.get('rule'))} | {cell(t.get('on') or '-')} "
                  f"| {cell(t.get('reason'))} |" for t in record.trips]
    if files:
        lines += ["", "| file | rewrites |", "|---|---|"]
        lines += [f"| {cell(path)} | {cell(info.get('rewrites'))} |" for path, info in files.items()]
    return "\n".join(lines) + "\n"


def github_outputs(record: RunRecord, exit_status: int) -> dict[str, str]:
    """The step outputs of the run (what the action in action.yml exposes): the exit status,
    the run directory, the breaker's state and the rule of the last trip ('' when none)."""
    return {
        "exit-status": str(exit_status),
        "run-dir": str(record.run_dir),
        "breaker": _text(record.ledger.get("state")),
        "tripped-rule": _text(record.trips[-1].get("rule")) if record.trips else "",
    }


def _output_lines(outputs: dict[str, str]) -> str:
    """*outputs* in ``$GITHUB_OUTPUT``'s multiline form, whose delimiter no value holds (a run
    directory's name is anybody's bytes)."""
    text = ""
    for name, value in outputs.items():
        delimiter = "guard_EOF"
        while delimiter in value:
            delimiter += "_"
        text += f"{name}<<{delimiter}\n{value}\n{delimiter}\n"
    return text


def write_github(record: RunRecord, exit_status: int, out: Any, environ: dict[str, str] | None = None) -> None:
    """Under GitHub Actions: print the annotations to *out*, append the job summary to
    ``$GITHUB_STEP_SUMMARY`` and the step outputs (:func:`github_outputs`) to ``$GITHUB_OUTPUT``
    (each when set). ``GUARD_ARTIFACT`` names the artifact the workflow uploads the run
    directory as, for the summary to say so."""
    env = os.environ if environ is None else environ
    if env.get("GITHUB_ACTIONS") != "true":
        return
    for line in github_annotations(record):
        print(line, file=out)
    summary = env.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(github_step_summary(record, exit_status, env.get("GUARD_ARTIFACT")))
    output = env.get("GITHUB_OUTPUT")
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write(_output_lines(github_outputs(record, exit_status)))
