"""The image and the devcontainer, built and run for real with podman (containers/test-image.sh).

test_image_and_devcontainer is marked ``container``: it installs podman, runc and mmdebstrap
when missing, builds a Debian base image and the project's image from a clean clone of the
committed tree, and runs the checks inside (a few minutes; root). The other test is the
host side of the --user run-directory fix the image check relies on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import assert_container_checks

ROOT = Path(__file__).resolve().parent.parent

#: Every check the script must report, by name: a check that silently went missing fails.
EXPECTED = ["image-build", "podman-guard-demo", "devcontainer-up"] + [
    f"{where}-{what}" for where in ("podman", "devcontainer") for what in (
        "agent-uid", "cannot-unmount", "cannot-reach-backing", "cannot-signal-guard", "in-scope-write",
        "out-of-scope-write-refused", "exit-75-on-second-violation")
] + ["podman-default-run-dir", "devcontainer-cannot-approve-own-trip"] + [
    f"devcontainer-{what}" for what in (
        "shell-non-root", "view-mounted", "guard-status", "cannot-unmount", "cannot-reach-real",
        "cannot-signal-guard", "cannot-stop-guard", "out-of-scope-write-refused", "second-write-trips",
        "human-approves")
]


@pytest.mark.container
@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_image_and_devcontainer() -> None:
    result = subprocess.run(["bash", str(ROOT / "containers/test-image.sh")], capture_output=True, text=True,
                            timeout=1500, stdin=subprocess.DEVNULL)
    assert_container_checks(result, EXPECTED)


@pytest.mark.root
@pytest.mark.mount
def test_user_run_without_run_dir_goes_where_the_agent_can_reach(tmp_path: Path) -> None:
    """guard run --user, no --run-dir: the run directory is not under root's home, which
    the agent's bubblewrap cannot traverse to hide it (it failed: 'Can't mkdir parents')."""
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    manifest = tmp_path / "guard.toml"
    manifest.write_text('[task]\nid = "user-run-dir"\ngoal = "g"\n[paths]\nallowed = ["src/"]\n')
    tmp_path.chmod(0o755)
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--manifest", str(manifest),
         "--", "sh", "-c", "echo ok > src/out.txt"],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "HOME": "/root"},
    )
    run_dir = next((line.split("run directory ", 1)[1] for line in result.stderr.splitlines()
                    if line.startswith("guard: run directory ")), "")
    try:
        assert result.returncode == 0, result.stderr
        assert run_dir.startswith("/var/lib/guardfs/runs/"), result.stderr
        assert (ws / "src/out.txt").read_text() == "ok\n"
    finally:
        if run_dir.startswith("/var/lib/guardfs/runs/"):
            shutil.rmtree(run_dir, ignore_errors=True)
