"""What a finished (or live) run looked like, for people: ``guard report`` and CI conventions.

One reader, :func:`load_run`, turns a run directory (``ledger.json``, ``events.jsonl``, the
quarantined logs) into a :class:`RunRecord`; the renderers only format it. Its counts of
denials and trips are the ledger's (``counts``, kept by the guard as each event happened),
the same numbers the run's summary printed, whatever the event log's caps left out of
``events.jsonl``; the rows are the events the log kept.

- :func:`render_html`: one self-contained page (inline CSS and SVG, no script, no network);
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
import stat
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guardfs.errors import UsageError
from guardfs.events import printable, tally_kind

__all__ = [
    "ANNOTATION_LIMIT", "ReportError", "RunRecord", "github_annotations", "github_step_summary", "load_run",
    "render_html", "write_github",
]

#: GitHub shows at most 10 error annotations per step; past that the rest are summarised in one.
ANNOTATION_LIMIT = 10
#: Rows kept of each kind read from events.jsonl; a larger log is summarised by count.
ROW_LIMIT = 2000


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
    return record


def _logs(run_dir: Path) -> list[tuple[Path, int]]:
    """The run's logs with their sizes: regular files only, judged by lstat. A run directory
    of an older guard may hold what an agent put in ``exec/`` (a symlink to a secret, a FIFO):
    no link is followed, no target stat'ed, nothing opened."""
    found = []
    for path in (run_dir / "stdout.log", run_dir / "stderr.log"):
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
.state.open{background:#c4352b} .state.half{background:#c98a12}
table{border-collapse:collapse;width:100%;margin:6px 0} th,td{border:1px solid #d8dce4;padding:4px 6px;
text-align:left;vertical-align:top} th{background:#f2f4f8} td.n{text-align:right;font-variant-numeric:tabular-nums}
pre{white-space:pre-wrap;margin:0;font:12px/1.4 ui-monospace,monospace;background:#f7f8fa;padding:6px}
.muted{color:#5b6475} svg text{font:11px system-ui,sans-serif}
"""


def render_html(record: RunRecord) -> str:
    """One self-contained HTML page for the run."""
    led = record.ledger
    state = _text(led.get("state", "?"))
    css_class = "open" if state.startswith("OPEN") else "half" if state.startswith("HALF") else ""
    task = led.get("task", {})
    tokens = led.get("tokens", {})
    files = led.get("files", {})
    e = html.escape
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>guard report: {e(_text(task.get('id')))}</title><style>{_CSS}</style></head><body>",
        f"<h1>guard report: {e(_text(task.get('id')))}</h1>",
        f"<p>{e(_text(task.get('goal')))}</p>",
        f"<p>Breaker: <span class='state {css_class}'>{e(state)}</span> &nbsp; "
        f"steps: {record.counts['steps']} &nbsp; tokens: {e(_text(tokens.get('total', 0)))} &nbsp; "
        f"files mutated: {e(_text(files.get('distinct', 0)))} of {e(_text(files.get('max') or 'unlimited'))} &nbsp; "
        f"denials: {record.counts['denials']} &nbsp; trips: {record.counts['trips']}</p>",
        f"<p class=muted>run directory: {e(str(record.run_dir))}</p>",
        "<h2 id=timeline>Timeline: tokens per step</h2>",
        _timeline_svg(record),
        "<h2 id=trips>Trips</h2>",
        _trips_table(record),
        "<h2 id=denials>Denials</h2>",
        _denials_table(record),
        "<h2 id=files>Files mutated</h2>",
        _files_table(record),
        "<h2 id=logs>Logs</h2>",
        _logs_list(record),
    ]
    if record.bad_lines:
        parts.append(f"<p class=muted>{record.bad_lines} line(s) of events.jsonl were not JSON and were skipped.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _timeline_svg(record: RunRecord) -> str:
    steps = record.steps
    if not steps:
        return "<p class=muted>No steps were reported (no agent hook, stream or client fed tokens).</p>"
    width, height, left, bottom, top = 1000, 240, 64, 34, 12
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
    for trip in record.trips:
        index = int(trip.get("step") or 0)
        x = left + max(index - 0.5, 0) * bar
        label = html.escape(_text(trip.get("rule")))
        out.append(f"<line class=trip x1={x:.1f} y1={top} x2={x:.1f} y2={top + plot_h} stroke='#c4352b' "
                   f"stroke-dasharray='4 3'><title>trip at step {index}: {label}</title></line>")
    out.append("</svg>")
    if record.counts["steps"] > len(steps):
        out.append(f"<p class=muted>first {len(steps)} of {record.counts['steps']} steps shown.</p>")
    return "\n".join(out)


def _table(head: list[str], rows: list[list[str]], numeric: frozenset[int] = frozenset()) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td class=n>{c}</td>" if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _trips_table(record: RunRecord) -> str:
    if not record.trips:
        return "<p>No trips: the breaker stayed closed.</p>"
    e = html.escape
    rows = [[e(_text(t.get("step"))), e(_text(t.get("rule"))), e(_text(t.get("on"))), e(_text(t.get("state"))),
             e(_text(t.get("reason"))), f"<pre>{e(_text(t.get('feedback')))}</pre>"] for t in record.trips]
    more = record.counts["trips"] - len(record.trips)
    return _table(["step", "rule", "path", "state", "reason", "feedback the agent got"], rows, frozenset({0})) + (
        f"<p class=muted>and {more} more not listed in events.jsonl.</p>" if more > 0 else "")


def _denials_table(record: RunRecord) -> str:
    if not record.denials and not record.counts["denials"]:
        return "<p>No operation was refused.</p>"
    e = html.escape
    rows = [[e(_text(d.get("op"))), e(_text(d.get("path"))), e(_text(d.get("rule"))), e(_text(d.get("errno"))),
             e(_text(d.get("reason")))] for d in record.denials]
    more = record.counts["denials"] - len(record.denials)
    return _table(["operation", "path", "rule", "errno", "reason"], rows) + (
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


def _logs_list(record: RunRecord) -> str:
    if not record.logs:
        return "<p class=muted>No logs in the run directory.</p>"
    items = []
    for log, size in record.logs:
        rel = os.path.relpath(log, record.run_dir)
        # The name is the agent's, any bytes: the link by its bytes, percent-encoded; the text escaped.
        items.append(f"<li><a href='{html.escape(urllib.parse.quote(os.fsencode(rel)), quote=True)}'>"
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
