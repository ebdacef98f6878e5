"""``guard demo``, the README's first look at every refusal, plays its drifting agent to the end."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.mount
def test_demo_passes_and_leaves_no_mount() -> None:
    proc = subprocess.run([sys.executable, "-m", "sandbox", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo passed" in proc.stdout
    assert "BAD" not in proc.stdout
    for errno_name in ("EACCES", "EROFS", "EDQUOT"):
        assert f"refused: {errno_name}" in proc.stdout
    match = re.search(r"guardfs demo in (\S+)", proc.stdout)
    assert match is not None
    root = Path(match.group(1))
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert str(root) not in f.read()
    shutil.rmtree(root)
