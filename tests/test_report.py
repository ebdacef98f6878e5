"""``guard report`` and the GitHub Actions conventions of ``guard run --ci``, on real runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.report import ANNOTATION_LIMIT, github_annotations, load_run

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
    assert "<a href='stdout.log'>stdout.log</a>" in page
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: ./dev.sh installs it (Debian package chromium)")
    # What a person sees: the DOM after Chromium laid the page out, and a screenshot kept as an artifact.
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Timeline: tokens per step" in dom.stdout
    assert "feedback the agent got" in dom.stdout
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
