"""``guard report --fleet``: one page and one JSON over real runs that ended every way a run ends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .helpers import FIX_TAX, wait_for
from .runs import CHROMIUM_FLAGS, chromium, committed_workspace, guard, guard_sh, hrefs, numstat, resolve_href

# A Python agent that reports steps: three, a recoverable spill (trip at step 3), one more step
# back in scope, and a clean exit: 5,200 of its 10,900 tokens come after the first trip.
RECOVERS = """
    import os
    from sandbox.breaker.client import GuardClient
    with GuardClient(os.environ["GUARD_SOCKET"]) as guard:
        for tokens in (1200, 3400, 800):
            guard.request({"type": "step", "tokens_in": tokens, "tokens_out": 100})
        try:
            open("README.md", "a").write("spill\\n")
        except OSError:
            pass
        guard.request({"type": "step", "tokens_in": 5000, "tokens_out": 200})
        with open("src/checkout/tax.py", "a") as f:
            f.write("# and tested\\n")
"""
# (name, extra manifest text, shell script or None for RECOVERS, the outcome the fleet must say)
SCENARIOS = [
    ("clean", "", "echo 'x = 1' >> src/checkout/tax.py", "clean"),
    ("spill", "", "echo 'x = 1' >> src/checkout/tax.py; echo s >> README.md; echo s >> notes.md", "tripped"),
    ("blast", "[limits]\nmax_files = 2\n", "for i in 1 2 3 4 5 6; do echo \"v = $i\" > src/checkout/f$i.py; done",
     "tripped"),
    ("failed", "", "printf 'y = 2\\nz = 3\\n' >> src/checkout/tax.py; exit 3", "agent-failed"),
    ("recovered", "", None, "recovered"),
    ("stopped", "", "echo 'x = 1' >> src/checkout/tax.py; touch src/checkout/ready; sleep 60", "stopped"),
]


def _stopped_run(manifest: Path, ws: Path, run_dir: Path, script: str) -> int:
    """A run a human stops with guard stop once the agent is at work; its exit status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), "--",
         "sh", "-c", script], cwd=ws, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (ws / "src/checkout/ready").exists() or proc.poll() is not None, "the agent at work", 60)
        stop = guard("stop", "--run-dir", str(run_dir))
        assert stop.returncode == 0, stop.stderr
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture(scope="module")
def fleet_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[Path, int, Any]]]:
    """Six real runs laid out as a CI matrix's downloaded artifacts: (artifacts, {name: (run_dir, exit
    status, git's numstat of what it changed)})."""
    tmp = tmp_path_factory.mktemp("fleet")
    artifacts = tmp / "artifacts"
    runs = {}
    for name, extra, script, _outcome in SCENARIOS:
        ws, manifest = committed_workspace(tmp / name, FIX_TAX.replace('"fix-tax"', f'"fix-tax-{name}"') + extra)
        run_dir = artifacts / f"guard-run-{name}" / "run"
        run_dir.parent.mkdir(parents=True)
        if name == "stopped":
            assert script is not None
            status = _stopped_run(manifest, ws, run_dir, script)
        elif script is None:
            status = subprocess.run(
                [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir),
                 "--", sys.executable, "-c", textwrap.dedent(RECOVERS)],
                cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL).returncode
        else:
            status = guard_sh(manifest, ws, run_dir, script).returncode
        runs[name] = (run_dir, status, numstat(ws))
    return artifacts, runs


@pytest.mark.root
@pytest.mark.mount
def test_fleet_page_and_json_over_real_runs(fleet_runs: tuple[Path, dict[str, tuple[Path, int, Any]]],
                                            tmp_path: Path) -> None:
    artifacts, runs = fleet_runs
    assert {name: status for name, (_d, status, _n) in runs.items()} == {
        "clean": 0, "spill": 75, "blast": 75, "failed": 3, "recovered": 0, "stopped": 75}
    out, out_json = tmp_path / "site/fleet.html", tmp_path / "site/fleet.json"
    out.parent.mkdir()
    made = guard("report", "--fleet", str(artifacts), "--html", str(out), "--json", str(out_json))
    assert made.returncode == 0, made.stderr
    data = json.loads(out_json.read_text())
    assert data["version"] == 1
    by_dir = {Path(r["run_dir"]): r for r in data["runs"]}
    assert set(by_dir) == {run_dir for run_dir, _s, _n in runs.values()}
    for (name, _extra, _script, outcome), (run_dir, status, truth) in zip(SCENARIOS, runs.values(), strict=True):
        run = by_dir[run_dir]
        assert run["outcome"] == outcome, (name, run)
        assert run["exit_status"] == status, name
        assert run["task"] == f"fix-tax-{name}"
        assert run["label"] == f"guard-run-{name}/run"
        # Files changed, in scope: git's own count of the workspace the run left.
        assert run["files"] == {"changed": len(truth), "in_scope": len(truth), "out_of_scope": 0,
                                "lines_added": sum(a for a, _d in truth.values()),
                                "lines_deleted": sum(d for _a, d in truth.values())}, name
        assert Path(run["report"]) == run_dir / "report.html" and Path(run["report"]).is_file()
    assert by_dir[runs["spill"][0]]["terminal_rule"] == "scope_spill"
    assert by_dir[runs["blast"][0]]["terminal_rule"] == "blast_radius"
    assert by_dir[runs["stopped"][0]]["stopped_by"] == "a human: guard stop"
    assert by_dir[runs["recovered"][0]]["tokens_after_first_trip"] == 5200
    totals = data["totals"]
    assert totals["runs"] == 6
    assert totals["by_outcome"] == {"clean": 1, "tripped": 2, "agent-failed": 1, "recovered": 1, "stopped": 1}
    assert totals["by_terminal_rule"] == {"scope_spill": 1, "blast_radius": 1}
    assert totals["by_rule"] == {"scope_spill": 2, "blast_radius": 1}
    assert totals["tokens"] == 10900 and totals["tokens_after_first_trip"] == 5200
    assert totals["share_after_first_trip"] == round(5200 / 10900, 4)
    assert totals["files_in_scope"] == sum(len(n) for _d, _s, n in runs.values()) and totals["files_out_of_scope"] == 0
    assert totals["runs_without_diff"] == 0
    # The page: the same counts, and a link to each run's report that leads to it from where the page is.
    page = out.read_text()
    assert "<h1>guard fleet: 6 run(s)</h1>" in page
    assert "<div class=card><b>5,200 (48%)</b>after the first trip</div>" in page
    for outcome, n in totals["by_outcome"].items():
        assert f"{outcome}'>" in page and page.count(f"<span class='o {outcome}'>") == n + 1  # the table and its row
    reports = [resolve_href(h, out) for h in hrefs(page)]
    assert sorted(reports) == sorted(run_dir / "report.html" for run_dir, _s, _n in runs.values())
    # What a person sees, kept as an artifact.
    shots = Path(os.environ.get("GUARD_TEST_ARTIFACTS", tmp_path / "artifacts"))
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / "fleet.png"
    taken = subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                            "--window-size=1400,1100", f"--screenshot={shot}", out.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.root
@pytest.mark.mount
def test_fleet_json_on_stdout_and_a_dir_with_no_run(fleet_runs: tuple[Path, dict[str, tuple[Path, int, Any]]],
                                                     tmp_path: Path) -> None:
    artifacts, runs = fleet_runs
    one = runs["clean"][0]
    # A run directory itself is a DIR too; given twice (itself and its parent), it is one run.
    made = guard("report", "--fleet", str(one), str(one.parent), "--html", str(tmp_path / "f.html"), "--json", "-")
    assert made.returncode == 0, made.stderr
    data = json.loads(made.stdout[:made.stdout.rindex("}") + 1])
    assert [r["run_dir"] for r in data["runs"]] == [str(one)]
    empty = tmp_path / "downloaded"
    (empty / "logs").mkdir(parents=True)
    refused = guard("report", "--fleet", str(artifacts), str(empty))
    assert refused.returncode == 64
    assert f"{empty} holds no run: no ledger.json in it or below it" in refused.stderr
    missing = guard("report", "--fleet", str(tmp_path / "nowhere"))
    assert missing.returncode == 64 and "is no directory" in missing.stderr
    assert not (Path.cwd() / "guard-fleet.html").exists()


def test_json_goes_with_fleet_only(tmp_path: Path) -> None:
    proc = guard("report", "--run-dir", str(tmp_path), "--json", str(tmp_path / "x.json"))
    assert proc.returncode == 64 and "--json goes with --fleet" in proc.stderr
    proc = guard("report", "--fleet", str(tmp_path), "--html", "-", "--json", "-")
    assert proc.returncode == 64 and "cannot both go to stdout" in proc.stderr


@pytest.mark.root
@pytest.mark.mount
def test_fleet_over_downloaded_archives(fleet_runs: tuple[Path, dict[str, tuple[Path, int, Any]]],
                                        tmp_path: Path) -> None:
    """A CI download: one job's run directory tarred (by tar, as a workflow does), another's as the
    zip GitHub's artifact page gives; the fleet unpacks both beside its page."""
    _artifacts, runs = fleet_runs
    downloads = tmp_path / "downloads"
    (downloads / "job-spill").mkdir(parents=True)
    spill = runs["spill"][0]
    subprocess.run(["tar", "-C", str(spill.parent), "-cf", str(downloads / "job-spill/run-dir.tar"), spill.name],
                   check=True)
    shutil.make_archive(str(downloads / "guard-run-clean"), "zip", runs["clean"][0])
    out = tmp_path / "site/fleet.html"
    out.parent.mkdir()
    made = guard("report", "--fleet", str(downloads), "--html", str(out), "--json", str(tmp_path / "fleet.json"))
    assert made.returncode == 0, made.stderr
    data = json.loads((tmp_path / "fleet.json").read_text())
    assert sorted(r["outcome"] for r in data["runs"]) == ["clean", "tripped"]
    unpacked = tmp_path / "site/fleet-runs/unpacked"
    assert {Path(r["run_dir"]).relative_to(unpacked).parts[0] for r in data["runs"]} == {
        "run-dir.tar", "guard-run-clean.zip"}
    assert all(resolve_href(h, out).is_file() for h in hrefs(out.read_text()))
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar")
    refused = guard("report", "--fleet", str(broken), "--html", str(tmp_path / "b.html"))
    assert refused.returncode == 64 and f"cannot unpack {broken}" in refused.stderr
