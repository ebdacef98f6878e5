"""A small sample of the cohort benchmark, through the same code path, so it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench/cohorts.py"


@pytest.mark.root
@pytest.mark.mount
def test_eight_trajectories(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--per-cohort", "2", "--jobs", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "false trips in cohort A: 0" in proc.stdout
    summary = json.loads((tmp_path / "cohorts.json").read_text())["summary"]
    assert summary["all"]["trajectories"] == 8
    assert summary["all"]["out_of_scope_landed_guarded"] == 0
    assert summary["B"]["out_of_scope_landed_unguarded"] > 0  # the drift is real without the guard
    assert summary["A"]["runs_with_trips"] == 0
    assert summary["B"]["first_trip_rules"] == {"scope_spill": 2}
    assert summary["C"]["first_trip_rules"] == {"oscillation": 2}
    assert summary["D"]["first_trip_rules"] == {"token_surge": 2}
    assert summary["D"]["tokens_saved"] > 0
    assert (tmp_path / "cohorts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by matplotlib
