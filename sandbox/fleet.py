"""One view over many runs: ``guard report --fleet DIR [DIR ...]``.

A CI matrix's downloaded artifacts, a directory of Kubernetes Jobs' outputs, a queue's runs:
:func:`find_runs` finds the run directories (a directory holding ``ledger.json``) in or below
each DIR, :func:`summarize` reads what one run shows (through :func:`sandbox.report.load_run`,
the one reader of a run directory), :func:`fleet` adds them up and :func:`render_fleet_html`
writes the page. Each run's own report is linked, written beside its run when absent
(:func:`run_report`).

The JSON (``--json``) is :func:`fleet`'s dict:

- ``version``: :data:`FLEET_VERSION`; ``generated``: seconds since the epoch.
- ``runs``: one :func:`summarize` dict per run, in path order.
- ``totals``: :func:`totals`'s dict.
"""

from __future__ import annotations

import html
import os
import tarfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from guardfs.events import printable
from sandbox.report import (
    ReportError,
    RunRecord,
    link,
    load_run,
    render_html,
    shown,
    stopped_by,
    utc,
)

__all__ = [
    "ARCHIVES",
    "FLEET_VERSION",
    "OUTCOMES",
    "UNPACK_MAX_BYTES",
    "FleetError",
    "find_runs",
    "fleet",
    "outcome",
    "render_fleet_html",
    "run_report",
    "summarize",
    "totals",
    "unpack",
]

FLEET_VERSION = 1
#: A run's ``outcome``, with the words the page says for it:
OUTCOMES = {
    "clean": "clean exit",  # the agent exited 0 and nothing tripped
    "recovered": "exit 0 after recovered trips",  # the agent exited 0; every trip was recovered from
    "agent-failed": "agent failed",  # the agent exited non-zero by itself
    "tripped": "stopped by the breaker",  # a terminal trip stopped it (``terminal_rule`` says which)
    "timeout": "idle timeout",  # the breaker's idle_transport rule stopped it
    "stopped": "human stop",  # an operator's guard stop
    "signal": "signal",  # SIGINT, SIGTERM or SIGHUP to the guard
    "guard-failed": "guard failed",  # the guard's own internal error
    "unknown": "not recorded",  # no run.json (an older guard, or a guard killed mid-run)
}
_KIND_OUTCOME = {"breaker": "tripped", "timeout": "timeout", "operator": "stopped", "signal": "signal",
                 "guard-failure": "guard-failed"}


class FleetError(ReportError):
    """A DIR given to ``--fleet`` that holds no run."""


#: Archives ``--fleet`` unpacks: a run directory tarred as it was uploaded, or the zip a
#: browser downloads from GitHub's artifact page.
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")
#: Bytes one archive may unpack to.
UNPACK_MAX_BYTES = 4 << 30


def _archive(path: Path) -> bool:
    return path.name.endswith(ARCHIVES)


def unpack(archive: Path, into: Path) -> Path:
    """Unpack *archive* into a fresh directory below *into*; FleetError for one that cannot be
    read or would unpack past :data:`UNPACK_MAX_BYTES`. Tar members go through tarfile's
    ``data`` filter (no absolute names, no link or name out of the directory, no devices, no
    set-id bits); zip names are made safe by zipfile."""
    dest = into / archive.name
    suffix = 0
    while dest.exists():
        suffix += 1
        dest = into / f"{archive.name}.{suffix}"
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                _bounded(archive, sum(i.file_size for i in z.infolist()))
                dest.mkdir(parents=True)
                z.extractall(dest)  # noqa: S202 (zipfile drops absolute names and ..; it makes no links)
        else:
            with tarfile.open(archive) as t:
                _bounded(archive, sum(m.size for m in t.getmembers()))
                dest.mkdir(parents=True)
                t.extractall(dest, filter="data")
        # A run directory is mode 000 (the guard's alone): what was unpacked is the reader's to read.
        for root, subdirs, _names in os.walk(dest):
            for name in subdirs:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, os.lstat(path).st_mode & 0o7777 | 0o700)
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as err:
        raise FleetError(f"cannot unpack {archive}: {err}; give the unpacked directory instead") from err
    return dest


def _bounded(archive: Path, size: int) -> None:
    if size > UNPACK_MAX_BYTES:
        raise FleetError(f"{archive} would unpack to {size:,} bytes, past {UNPACK_MAX_BYTES:,}: unpack it "
                         "yourself and give the directory")


def find_runs(dirs: Sequence[Path], unpack_into: Path | None = None) -> list[Path]:
    """The run directories in or below each of *dirs*, sorted, each once; FleetError naming a
    DIR that does not exist or holds none. Symlinks are not followed (an artifact may hold
    what an agent left). With *unpack_into*, an archive (:data:`ARCHIVES`) given or found
    is unpacked there (:func:`unpack`) and searched too."""
    found: set[Path] = set()
    for top in dirs:
        if unpack_into is not None and _archive(top) and top.is_file():
            top = unpack(top, unpack_into)  # noqa: PLW2901 (the archive is searched as its directory)
        elif not top.is_dir():
            raise FleetError(f"{top} is no directory: give run directories (the one guard run printed) or "
                             "directories holding them (a CI matrix's downloaded artifacts"
                             + (", or their .tar or .zip files)" if unpack_into is not None else ", unpacked)"))
        here = []
        pending = [top]
        while pending:
            for root, subdirs, names in os.walk(pending.pop()):
                if "ledger.json" in names:
                    here.append(Path(root))
                    subdirs.clear()  # a run's own checkpoint/ and exec/ hold no run
                    continue
                subdirs.sort()
                if unpack_into is not None:
                    pending += [unpack(Path(root) / name, unpack_into) for name in sorted(names)
                                if _archive(Path(name)) and (Path(root) / name).is_file()]
        if not here:
            raise FleetError(f"{top} holds no run: no ledger.json in it or below it. Give the run directory "
                             "guard run printed, or a directory holding run directories (or their archives)")
        found.update(p.absolute() for p in here)
    return sorted(found)


def outcome(record: RunRecord) -> str:
    """How the run ended, one of :data:`OUTCOMES`."""
    stop = record.facts.get("stopped_by")
    if isinstance(stop, dict):
        kind = stop.get("kind")
        if kind == "agent":
            if record.facts.get("exit_status") != 0:
                return "agent-failed"
            return "recovered" if record.counts["trips"] else "clean"
        return _KIND_OUTCOME.get(str(kind), "unknown")
    if record.ledger.get("guard_failure"):
        return "guard-failed"
    return "unknown"


def _tokens_after_first_trip(record: RunRecord) -> int | None:
    """Tokens of the steps reported after the first trip (None: no trip)."""
    if not record.trips:
        return None
    first = int(record.trips[0].get("step") or 0)
    return sum(int(s.get("tokens") or 0) for s in record.steps if int(s.get("step") or 0) > first)


def summarize(record: RunRecord, report: Path | None = None, label: str | None = None) -> dict[str, Any]:
    """One run for the fleet's JSON.

    Fields:

    - ``run_dir``: absolute; ``label``: *label* (the run's path below the directory holding
      all the fleet's runs, e.g. ``guard-run-3/run``), else its name; ``report``: its HTML
      report's absolute path, or None;
    - ``task``, ``goal``: the manifest's; ``outcome``: one of :data:`OUTCOMES`;
      ``stopped_by``: the words of the run's page; ``exit_status``: None if not recorded;
    - ``state``: the breaker's last; ``terminal_rule``: the rule whose trip stopped the run, or
      None; ``rules``: trips per rule; ``trips``, ``denials``, ``steps``: counts;
    - ``tokens``; ``tokens_after_first_trip``: of the steps after the first trip, None without one;
    - ``files``: ``changed``, ``in_scope``, ``out_of_scope``, ``lines_added``,
      ``lines_deleted`` from run.json's diff stat, or None when it has none;
    - ``started``: seconds since the epoch, or None; ``duration_s``: or None.
    """
    facts, led = record.facts, record.ledger
    stop: dict[str, Any] = facts["stopped_by"] if isinstance(facts.get("stopped_by"), dict) else {}
    diff: dict[str, Any] = facts["diff"] if isinstance(facts.get("diff"), dict) else {}
    sums: dict[str, Any] | None = diff["totals"] if isinstance(diff.get("totals"), dict) else None
    task = led.get("task", {}) if isinstance(led.get("task"), dict) else {}
    tokens = led.get("tokens", {}) if isinstance(led.get("tokens"), dict) else {}
    return {
        "run_dir": str(record.run_dir.absolute()),
        "label": label or record.run_dir.name,
        "report": str(report.absolute()) if report is not None else None,
        "task": str(task.get("id", "")),
        "goal": str(task.get("goal", "")),
        "outcome": outcome(record),
        "stopped_by": stopped_by(record),
        "exit_status": facts.get("exit_status"),
        "state": str(led.get("state", "")),
        "terminal_rule": stop.get("rule") or None,
        "rules": dict(Counter(str(t.get("rule")) for t in record.trips)),
        "trips": record.counts["trips"],
        "denials": record.counts["denials"],
        "steps": record.counts["steps"],
        "tokens": int(tokens.get("total") or 0),
        "tokens_after_first_trip": _tokens_after_first_trip(record),
        "files": None if sums is None else {
            "changed": int(sums.get("files", 0)), "in_scope": int(sums.get("in_scope", 0)),
            "out_of_scope": int(sums.get("out_of_scope", 0)), "lines_added": int(sums.get("lines_added", 0)),
            "lines_deleted": int(sums.get("lines_deleted", 0))},
        "started": record.started,
        "duration_s": facts.get("duration_s"),
    }


def totals(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The fleet's totals over :func:`summarize` dicts.

    Fields: ``runs``; ``by_outcome`` (runs per outcome); ``by_rule`` (runs with at least one
    trip of each rule); ``by_terminal_rule`` (runs stopped by each rule); ``tokens``;
    ``tokens_after_first_trip`` (over the runs that tripped); ``share_after_first_trip``
    (that over ``tokens``, 0 to 1, None when no token was reported); ``files_changed``,
    ``files_in_scope``, ``files_out_of_scope``, ``lines_added``, ``lines_deleted`` (over the
    runs with a diff stat); ``runs_without_diff``.
    """
    runs = list(runs)
    by_rule: Counter[str] = Counter()
    for r in runs:
        by_rule.update(r["rules"].keys())
    spent = sum(r["tokens"] for r in runs)
    after = sum(r["tokens_after_first_trip"] or 0 for r in runs)
    with_diff = [r["files"] for r in runs if r["files"] is not None]
    return {
        "runs": len(runs),
        "by_outcome": dict(Counter(r["outcome"] for r in runs)),
        "by_rule": dict(by_rule),
        "by_terminal_rule": dict(Counter(r["terminal_rule"] for r in runs if r["terminal_rule"])),
        "tokens": spent,
        "tokens_after_first_trip": after,
        "share_after_first_trip": round(after / spent, 4) if spent else None,
        **{f"files_{key}": sum(f[key] for f in with_diff) for key in ("changed", "in_scope", "out_of_scope")},
        "lines_added": sum(f["lines_added"] for f in with_diff),
        "lines_deleted": sum(f["lines_deleted"] for f in with_diff),
        "runs_without_diff": len(runs) - len(with_diff),
    }


def run_report(record: RunRecord, spare: Path) -> Path:
    """The run's HTML report: its ``report.html`` when there is one, else written there, else
    (a run directory that cannot be written) at *spare*."""
    own = record.run_dir / "report.html"
    if own.is_file():
        return own
    for out in (own, spare):
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(render_html(record, out), encoding="utf-8")
        except OSError:
            continue
        return out
    raise ReportError(f"cannot write a report for {record.run_dir}: neither {own} nor {spare} is writable; "
                      "give --html a writable place")


def fleet(dirs: Sequence[Path], out: Path | None) -> tuple[dict[str, Any], list[RunRecord]]:
    """The fleet's JSON dict (see the module's docstring) and the runs' records. Each run's report
    is written when absent (:func:`run_report`; beside *out*, in ``<out>-runs/``, for a run
    directory that cannot be written); archives are unpacked in ``<out>-runs/unpacked/``."""
    spare_dir = (out.parent / f"{out.stem}-runs") if out is not None else Path.cwd() / "guard-fleet-runs"
    paths = find_runs(dirs, spare_dir / "unpacked")
    records = [load_run(path) for path in paths]
    top = os.path.commonpath([p.parent for p in paths])
    runs = []
    for i, record in enumerate(records, 1):
        name = f"{i:03d}-{printable(str(record.ledger.get('task', {}).get('id', 'run')))[:60]}.html".replace("/", "_")
        runs.append(summarize(record, run_report(record, spare_dir / name), os.path.relpath(record.run_dir, top)))
    return {"version": FLEET_VERSION, "generated": time.time(), "runs": runs, "totals": totals(runs)}, records


# --- HTML -----------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#1d2330;padding:0 16px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dce4}
table{border-collapse:collapse;width:100%;margin:6px 0} th,td{border:1px solid #d8dce4;padding:4px 6px;
text-align:left;vertical-align:top} th{background:#f2f4f8} td.n{text-align:right;font-variant-numeric:tabular-nums;
white-space:nowrap} .path{font-size:12px;word-break:break-all} a b{color:#1f4fa8}
.o{display:inline-block;padding:1px 7px;border-radius:4px;font-weight:600;color:#fff;background:#5b6475}
.o.clean{background:#2f8f46} .o.recovered{background:#6a9a3a} .o.agent-failed{background:#9a5b13}
.o.tripped,.o.timeout{background:#c4352b} .o.stopped{background:#2b5cc4} .o.signal,.o.guard-failed{background:#6b3fa0}
.state{font-size:12px;font-family:ui-monospace,monospace} .state.open{color:#c4352b} .state.half{color:#c98a12}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:8px 0} .card{border:1px solid #d8dce4;border-radius:6px;
padding:8px 12px;min-width:150px} .card b{display:block;font-size:20px} .muted{color:#5b6475}
.bar{display:flex;height:10px;background:#eef0f4;border-radius:3px;overflow:hidden;min-width:120px}
.bar i{display:block;background:#4a78c2} .bar i.after{background:#c4352b} .out{color:#b3261e;font-weight:600}
.add{color:#1f7a35} .del{color:#b3261e}
"""


def render_fleet_html(data: dict[str, Any], out: Path | None) -> str:
    """The fleet's page from :func:`fleet`'s dict; links relative to *out*'s directory (or
    absolute ``file:`` URIs without *out*)."""
    e, t, runs = html.escape, data["totals"], data["runs"]
    share = t["share_after_first_trip"]
    cards = [("runs", str(t["runs"])), ("tripped (any rule)", str(sum(1 for r in runs if r["rules"]))),
             ("tokens spent", f"{t['tokens']:,}"),
             ("after the first trip", f"{t['tokens_after_first_trip']:,}" + (f" ({share:.0%})" if share is not None
                                                                             else "")),
             ("files changed in scope", str(t["files_in_scope"])),
             ("out of scope", str(t["files_out_of_scope"]))]
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>guard fleet: {t['runs']} runs</title><style>{_CSS}</style></head><body>",
        f"<h1>guard fleet: {t['runs']} run(s)</h1>",
        f"<p class=muted>written {e(utc(data['generated']))}</p>",
        "<div class=cards>" + "".join(f"<div class=card><b>{e(v)}</b>{e(k)}</div>" for k, v in cards) + "</div>",
        "<h2 id=outcomes>Runs by outcome</h2>",
        _counts(t["by_outcome"], "outcome", _badge),
        "<h2 id=rules>Runs by rule</h2>",
        _rules(t) if t["by_rule"] else "<p>No run tripped.</p>",
        "<h2 id=runs>Runs</h2>",
        _runs_table(runs, out),
    ]
    if t["runs_without_diff"]:
        parts.append(f"<p class=muted>{t['runs_without_diff']} run(s) have no diff stat (run.json without one: an "
                     "older guard, or a guard killed before the end): their files are not counted.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _badge(name: str) -> str:
    return f"<span class='o {html.escape(name)}'>{html.escape(OUTCOMES.get(name, name))}</span>"


def _counts(counts: dict[str, int], head: str, label: Callable[[str], str]) -> str:
    rows = "".join(f"<tr><td>{label(k)}</td><td class=n>{n}</td></tr>"
                   for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"<table style='width:auto'><tr><th>{head}</th><th>runs</th></tr>{rows}</table>"


def _rules(t: dict[str, Any]) -> str:
    e = html.escape
    stopped = t["by_terminal_rule"]
    rows = "".join(f"<tr><td>{e(rule)}</td><td class=n>{n}</td><td class=n>{stopped.get(rule, 0)}</td></tr>"
                   for rule, n in sorted(t["by_rule"].items(), key=lambda kv: (-kv[1], kv[0])))
    return ("<table style='width:auto'><tr><th>rule</th><th>runs that tripped it</th><th>runs it stopped</th></tr>"
            f"{rows}</table>")


def _bar(run: dict[str, Any]) -> str:
    spent, after = run["tokens"], run["tokens_after_first_trip"] or 0
    if not spent:
        return "<span class=muted>no steps</span>"
    before = 100 * (spent - after) / spent
    return (f"<div class=bar title='{spent - after:,} before the first trip, {after:,} after'>"
            f"<i style='width:{before:.1f}%'></i><i class=after style='width:{100 - before:.1f}%'></i></div>"
            f"<span class=muted>{spent - after:,} / {after:,}</span>" if run["tokens_after_first_trip"] is not None
            else "<div class=bar><i style='width:100%'></i></div><span class=muted>no trip</span>")


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "?"


def _text(value: Any, missing: str) -> str:
    return missing if value is None else str(value)


def _detail(run: dict[str, Any]) -> str:
    """What ended the run, in a few words under its outcome."""
    if run["terminal_rule"]:
        return f"{run['terminal_rule']} trip ({run['state']})"
    if run["outcome"] in ("clean", "recovered", "agent-failed"):
        return f"exit {_text(run['exit_status'], '?')}"
    return str(run["stopped_by"]).rpartition(": ")[2]  # the badge says who: here, how


def _runs_table(runs: list[dict[str, Any]], out: Path | None) -> str:
    e = html.escape
    head = ["run", "outcome", "exit", "trips by rule", "denials", "tokens", "before / after the first trip",
            "files in / out of scope", "lines", "duration"]
    rows = []
    for r in runs:
        files = r["files"]
        rules = ", ".join(f"{e(rule)}&nbsp;&times;{n}" for rule, n in sorted(r["rules"].items())) or "-"
        name = f"<b>{e(shown(r['task']))}</b>"
        if r["report"]:
            name = f"<a href='{e(link(Path(r['report']), out), quote=True)}'>{name}</a>"
        rows.append(
            f"<tr><td title='{e(shown(r['goal']), quote=True)}'>{name}<br><span class='muted path'>"
            f"{e(shown(r['label']))}</span></td>"
            f"<td>{_badge(r['outcome'])}<br><span class=muted>{e(_detail(r))}</span></td>"
            f"<td class=n>{e(_text(r['exit_status'], '?'))}</td><td>{rules}</td>"
            f"<td class=n>{r['denials']}</td><td class=n>{r['tokens']:,}</td><td>{_bar(r)}</td>"
            + (f"<td class=n>{files['in_scope']} / <span class={'out' if files['out_of_scope'] else ''}>"
               f"{files['out_of_scope']}</span></td><td class=n><span class=add>+{files['lines_added']}</span> "
               f"<span class=del>&minus;{files['lines_deleted']}</span></td>" if files is not None else
               "<td class=muted>not recorded</td><td></td>")
            + f"<td class=n>{e(_seconds(r['duration_s']))}</td></tr>")
    return ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
            "<p class=muted>Each run's name links to its own report; hover a name for the task's goal.</p>")
