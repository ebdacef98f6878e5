"""A small sample of the cohort benchmark, through the same code path, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench/cohorts.py"


@pytest.fixture(scope="module")
def cohorts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], Path]:
    """Two trajectories per cohort, guarded and not: the printed table, the summary, the output."""
    out = tmp_path_factory.mktemp("cohorts")
    proc = subprocess.run([sys.executable, str(BENCH), "--per-cohort", "2", "--jobs", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((out / "cohorts.json").read_text())["summary"], out


@pytest.mark.root
@pytest.mark.mount
def test_eight_trajectories(cohorts: tuple[str, dict[str, Any], Path]) -> None:
    stdout, summary, out = cohorts
    assert summary["all"]["trajectories"] == 8
    assert summary["all"]["out_of_scope_landed_guarded"] == 0
    assert summary["B"]["out_of_scope_landed_unguarded"] > 0  # the drift is real without the guard
    assert summary["B"]["first_trip_rules"] == {"scope_spill": 2}
    assert summary["C"]["first_trip_rules"] == {"oscillation": 2}
    # Step 19 is the first return (a revert: allowed); step 20, the flip back, is the second.
    assert summary["C"]["first_trip_step_median"] == 20
    assert summary["D"]["first_trip_rules"] == {"token_surge": 2}
    assert summary["D"]["tokens_saved"] > 0
    assert summary["A"]["trajectories"] == 2
    assert "false trips in cohort A:" in stdout
    assert (out / "cohorts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by matplotlib


@pytest.mark.root
@pytest.mark.mount
def test_clean_cohort_never_trips(cohorts: tuple[str, dict[str, Any], Path]) -> None:
    stdout, summary, _ = cohorts
    assert summary["A"]["trips_by_rule"] == {}
    assert summary["A"]["runs_stopped"] == 0
    assert summary["A"]["tokens_saved"] == 0
    assert "false trips in cohort A: 0" in stdout
