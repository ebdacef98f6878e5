"""``guard report`` and the GitHub Actions conventions of ``guard run --ci``, on real runs."""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.launch.facts import diff_stat
from sandbox.report import ANNOTATION_LIMIT, github_annotations, load_run

from .helpers import npm_cli, wait_for
from .model_server import Turn, scripted_model
from .runs import CHROMIUM_FLAGS, committed_workspace, guard, guard_sh, hrefs, numstat, resolve_href
from .runs import chromium as find_chromium
from .test_claude_code import CLAUDE_CLI, run_claude
from .test_claude_code import setup as claude_setup
from .test_run import guard_run, workspace

# An agent that reports steps with tokens, writes in scope, reads .env (refused, recoverable),
# goes back to work, then writes out of scope twice: the second violation stops the run.
AGENT = """
    import os
    from sandbox.breaker.client import GuardClient
    def spill(name):
        try:
            with open(name, "a") as f:
                f.write("spill\\n")
        except OSError:
            pass
    with GuardClient(os.environ["GUARD_SOCKET"]) as guard:
        for tokens in (1200, 3400, 800):
            guard.request({"type": "step", "tokens_in": tokens, "tokens_out": 100})
        with open("src/checkout/tax.py", "a") as f:
            f.write("# fixed\\n")
        spill("README.md")  # refused, recoverable: the breaker re-anchors
        guard.request({"type": "step", "tokens_in": 5000, "tokens_out": 200})
        with open("src/checkout/tax.py", "a") as f:
            f.write("# and tested\\n")  # back in scope with progress: closed again
        spill("notes|x.md")
        spill("README.md")  # the second violation in a row stops the run
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], Path]:
    """One real guarded run under GitHub Actions' conventions: (run_dir, the run, the summary file)."""
    tmp = tmp_path_factory.mktemp("report")
    ws, manifest = workspace(tmp)
    run_dir = tmp / "run"
    summary = tmp / "step-summary.md"
    summary.write_text("# earlier step\n")  # the guard appends, never replaces
    env = {**os.environ, "GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary), "GUARD_ARTIFACT": "guard-run"}
    proc = guard_run(manifest, ws, run_dir, AGENT, "--ci", env=env)
    return run_dir, proc, summary


@pytest.mark.root
@pytest.mark.mount
def test_github_annotations_and_step_summary(run: tuple[Path, subprocess.CompletedProcess[str], Path]) -> None:
    run_dir, proc, summary = run
    assert proc.returncode == 75, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("::error ")]
    record = load_run(run_dir)
    assert errors == github_annotations(record)
    assert 0 < len(errors) <= ANNOTATION_LIMIT
    # Trips first, each naming its rule and pointing at the file it tripped on; then denials.
    assert errors[0].startswith("::error file=README.md,line=1,title=guard%3A scope_spill trip::step 3: README.md is "
                                "outside")
    assert any(line.startswith("::error file=README.md,line=1,title=guard%3A ") for line in errors)
    assert any(line.startswith("::error file=notes|x.md,line=1,") for line in errors)
    assert all("\n" not in line for line in errors)
    text = summary.read_text()
    assert text.startswith("# earlier step\n### guard: fix-tax\n")
    assert "| exit status | 75 |" in text
    assert "| breaker | `OPEN_SCOPE_SPILL` |" in text
    assert "| tokens | 10900 in 4 steps |" in text
    assert "uploaded as artifact `guard-run`" in text
    assert "| src/checkout/tax.py | 2 |" in text
    assert re.search(r"\| 3 \| scope_spill \| README\.md ", text)
    assert re.search(r"\| 4 \| scope_spill \| notes\\\|x\.md ", text)  # the agent's | cannot open a column


def test_annotations_past_the_limit_are_summarised(tmp_path: Path) -> None:
    (tmp_path / "ledger.json").write_text(json.dumps({"state": "CLOSED", "task": {"id": "t"}}))
    events = [{"op": "write", "path": f"a{i},b:c.py", "decision": "deny", "rule": "paths.allowed",
               "reason": f"line one\nline two {i}% done"} for i in range(25)]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "not json\n")
    record = load_run(tmp_path)
    assert record.bad_lines == 1
    lines = github_annotations(record)
    assert len(lines) == ANNOTATION_LIMIT
    assert lines[0] == ("::error file=a0%2Cb%3Ac.py,line=1,title=guard%3A write refused::"
                        "line one%0Aline two 0%25 done")
    assert lines[-1].startswith(f"::error title=guard::{25 - ANNOTATION_LIMIT + 1} more trip(s) and denial(s)")


@pytest.mark.root
@pytest.mark.mount
def test_report_html_in_headless_chromium(run: tuple[Path, subprocess.CompletedProcess[str], Path],
                                          tmp_path: Path) -> None:
    run_dir, _proc, _summary = run
    out = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", str(run_dir), "--html", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    page = out.read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained
    assert page.count("<rect class=step") == 4
    assert "notes|x.md" in page
    # The page is written outside the run directory: its links lead there all the same.
    logs = [resolve_href(href, out) for href in hrefs(page) if not href.startswith("#")]
    assert run_dir / "stdout.log" in logs and run_dir / "events.jsonl" in logs
    assert all(path.is_file() for path in logs), logs
    chromium = find_chromium()
    # What a person sees: the DOM after Chromium laid the page out, and a screenshot kept as an artifact.
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Timeline: tokens per step" in dom.stdout
    assert "feedback the agent got" in dom.stdout
    assert "<th>stopped by</th><td>the breaker: scope_spill trip</td>" in dom.stdout
    assert dom.stdout.count("class=\"step\"") == 4
    assert dom.stdout.count("<td>scope_spill</td>") == 3
    artifacts = Path(os.environ.get("GUARD_TEST_ARTIFACTS", tmp_path / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report.png"
    taken = subprocess.run([chromium, *flags, "--window-size=1200,1400", f"--screenshot={shot}", out.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_a_directory_that_is_no_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 64
    assert f"{tmp_path}/ledger.json does not exist" in proc.stderr


# A shell agent: no steps, no hook. It changes five files in scope (one of each change, a binary
# file and a symlink among them), then writes out of scope twice: the first is refused and
# recoverable, the second stops the run.
SHELL = ("echo 'x = 1' >> src/checkout/tax.py; printf 'p\\nq\\n' > src/checkout/new.py; rm src/checkout/old.py; "
         "printf 'a\\000b' > src/checkout/blob.bin; ln -s tax.py src/checkout/link.py; "
         "echo spill >> README.md; echo spill >> notes.md; echo never")


@pytest.fixture(scope="module")
def shell_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """One real guarded run of a shell agent: (workspace, run_dir, the run)."""
    tmp = tmp_path_factory.mktemp("shell")
    ws, manifest = committed_workspace(tmp)
    run_dir = tmp / "run"
    return ws, run_dir, guard_sh(manifest, ws, run_dir, SHELL)


@pytest.mark.root
@pytest.mark.mount
def test_report_of_a_shell_agent(shell_run: tuple[Path, Path, subprocess.CompletedProcess[str]],
                                 tmp_path: Path) -> None:
    ws, run_dir, proc = shell_run
    assert proc.returncode == 75, proc.stderr
    out = tmp_path / "elsewhere/deep/page.html"
    out.parent.mkdir(parents=True)
    made = guard("report", "--run-dir", str(run_dir), "--html", str(out))
    assert made.returncode == 0, made.stderr
    page = out.read_text()
    # The header: how it ended, who stopped it, when, how long, what ran, in which scope.
    assert "<th>exit status</th><td>75</td>" in page
    assert "<th>stopped by</th><td>the breaker: scope_spill trip</td>" in page
    assert re.search(r"<th>started</th><td>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</td>", page)
    assert re.search(r"<th>duration</th><td>\d+\.\d s</td>", page)
    assert "<th>command</th><td><details><summary><code>sh -c" in page  # a long one folds
    assert f"<code>{html.escape(shlex.join(['sh', '-c', SHELL]))}</code></details>" in page
    assert "<th>writes allowed in</th><td><code>src/checkout/</code></td>" in page
    assert "<th>forbidden</th><td><code>.env*</code></td>" in page
    # The diff stat: git's own count of what changed since the start, file by file.
    truth = numstat(ws)
    assert truth == {"src/checkout/new.py": (2, 0), "src/checkout/old.py": (0, 3), "src/checkout/tax.py": (1, 0),
                     "src/checkout/blob.bin": (None, None), "src/checkout/link.py": (1, 0)}
    changes = {"src/checkout/new.py": "added", "src/checkout/old.py": "deleted", "src/checkout/tax.py": "modified",
               "src/checkout/blob.bin": "added", "src/checkout/link.py": "added"}
    for path, (added, deleted) in truth.items():
        lines = (f"<td class=n><span class=add>+{added}</span></td><td class=n><span class=del>&minus;{deleted}</span>"
                 "</td>" if added is not None else "<td class=n>binary</td><td class=n></td>")
        assert f"<tr><td>{path}</td><td>{changes[path]}</td>{lines}<td>in scope</td></tr>" in page, path
    assert "<b>5</b> file(s) changed: 5 in scope, <b class=>0 out of scope</b>; 3 added, 1 modified, 1 deleted" in page
    facts = json.loads((run_dir / "run.json").read_text())
    assert {f["path"]: (f["added"], f["deleted"]) for f in facts["diff"]["files"]} == truth
    # No step came: the timeline is of file events over time, and trips are placed by time.
    assert "Timeline: file events over time" in page
    assert page.count("<line class=trip") == 2
    assert page.count("<rect class=change") >= 5 and page.count("<rect class=refused") == 2
    assert "at step 0" not in page and ">step 0<" not in page  # (the feedback text itself says "step 0.")
    assert len(re.findall(r"<td class=n>\+\d+\.\d\d s</td><td>scope_spill</td>", page)) == 2
    # In scope or not is the manifest's policy, asked at the end of the run: the same pre-images
    # judged by another policy say so.
    judged = diff_stat(ws, run_dir / "checkpoint",
                       lambda path, _d: "out-of-scope" if path.endswith(".bin") else "allowed")
    assert judged["totals"]["out_of_scope"] == 1 and judged["totals"]["in_scope"] == 4
    assert [f["path"] for f in judged["files"] if not f["in_scope"]] == ["src/checkout/blob.bin"]
    # Each distinct message the agent got once, in full; the tables point at it.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    messages = {e["feedback"] for e in events if e["op"] == "trip"} | {
        e["reason"] for e in events if e.get("decision") == "deny" and e["op"] != "trip"}
    assert len(messages) == 2  # the trip's feedback and the refusal's reason are one text
    assert page.count("<div class=fb ") == len(messages)
    for message in messages:
        assert page.count(html.escape(message)) == 1, message
    assert page.count("[feedback 1]") == 2 and page.count("[feedback 2]") == 2  # a trip and a denial each
    # Links from a page written two directories away lead to the run's files.
    targets = [resolve_href(h, out) for h in hrefs(page) if not h.startswith("#")]
    assert {p.name for p in targets} >= {"stdout.log", "stderr.log", "events.jsonl", "ledger.json", "run.json"}
    assert all(p.is_file() and p.parent == run_dir for p in targets), targets


@pytest.mark.root
@pytest.mark.mount
def test_report_links_work_wherever_the_page_is(shell_run: tuple[Path, Path, subprocess.CompletedProcess[str]],
                                                tmp_path: Path) -> None:
    _ws, run_dir, _proc = shell_run
    # In the run directory (the default): plain names.
    assert guard("report", "--run-dir", str(run_dir)).returncode == 0
    inside = run_dir / "report.html"
    names = [h for h in hrefs(inside.read_text()) if not h.startswith("#")]
    assert "stdout.log" in names and all(resolve_href(h, inside).is_file() for h in names)
    # Beside it, as a relative path from another working directory.
    beside = tmp_path / "beside.html"
    made = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", os.path.relpath(run_dir, tmp_path),
                           "--html", "beside.html"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    links = [h for h in hrefs(beside.read_text()) if not h.startswith("#")]
    assert links and all(not h.startswith("/") and resolve_href(h, beside).is_file() for h in links), links
    # On stdout the page has no place: absolute file: URIs.
    printed = guard("report", "--run-dir", str(run_dir), "--html", "-")
    uris = [h for h in hrefs(printed.stdout) if not h.startswith("#")]
    assert uris and all(h.startswith("file:///") and resolve_href(h, beside).is_file() for h in uris), uris


@pytest.mark.root
@pytest.mark.mount
def test_report_of_a_claude_code_run(tmp_path: Path) -> None:
    """The real Claude Code CLI, driven by the scripted model: steps come from its stream, a Write
    out of scope is refused by its hook, a shell write out of scope by the mount."""
    claude = npm_cli(*CLAUDE_CLI)
    ws, home, manifest = claude_setup(tmp_path)
    run_dir = tmp_path / "run"
    script = [
        Turn("Write", {"file_path": str(ws / "src/checkout/tax.py"),
                       "content": "def total(x):\n    return max(0, round(x, 2))\n"}),
        Turn("Write", {"file_path": str(ws / "src/auth/jwt.py"), "content": "SECRET = 'x'\n"}),
        Turn("Bash", {"command": "echo hacked >> README.md", "description": "append"}),
        Turn(text="All done."),
    ]
    with scripted_model(script) as (url, _model):
        result = run_claude(claude, ws, home, manifest, run_dir, url)
    assert result.returncode == 75, result.stdout + result.stderr
    out = tmp_path / "site/report.html"
    out.parent.mkdir()
    made = guard("report", "--run-dir", str(run_dir), "--html", str(out))
    assert made.returncode == 0, made.stderr
    page = out.read_text()
    record = load_run(run_dir)
    assert record.steps and page.count("<rect class=step") == len(record.steps)
    assert "Timeline: tokens per step" in page
    assert "<th>exit status</th><td>75</td>" in page
    assert "<th>stopped by</th><td>the breaker: scope_spill trip</td>" in page
    assert f"<code>{html.escape(str(claude))} -p &#x27;Fix the rounding helper&#x27;" in page
    assert ("<tr><td>src/checkout/tax.py</td><td>modified</td><td class=n><span class=add>+1</span></td>"
            "<td class=n><span class=del>&minus;1</span></td><td>in scope</td></tr>") in page
    assert "<b>1</b> file(s) changed: 1 in scope" in page
    messages = {str(t.get("feedback")) for t in record.trips} | {str(d.get("reason")) for d in record.denials}
    assert page.count("<div class=fb ") == len(messages) >= 2
    for message in messages:  # once in full; a one-line message is also its tables' first line
        assert page.count(f"<pre>{html.escape(message)}</pre>") == 1, message
        assert "\n" not in message or page.count(html.escape(message)) == 1, message
    assert all(resolve_href(h, out).is_file() for h in hrefs(page) if not h.startswith("#"))
    artifacts = Path(os.environ.get("GUARD_TEST_ARTIFACTS", tmp_path / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report-claude.png"
    taken = subprocess.run([find_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                            "--window-size=1200,2000", f"--screenshot={shot}", out.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.root
@pytest.mark.mount
def test_report_says_a_signal_ended_the_run(tmp_path: Path) -> None:
    ws, manifest = committed_workspace(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         "sh", "-c", "echo 'x = 1' >> src/checkout/tax.py; touch src/checkout/ready; sleep 60"],
        cwd=ws, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (ws / "src/checkout/ready").exists() or proc.poll() is not None, "the agent at work", 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    page = guard("report", "--run-dir", str(run_dir), "--html", "-").stdout
    assert f"<th>exit status</th><td>{128 + signal.SIGTERM}</td>" in page
    assert "<th>stopped by</th><td>a signal to the guard: SIGTERM</td>" in page
    assert "<b>2</b> file(s) changed: 2 in scope" in page  # tax.py and ready, as far as the agent got
