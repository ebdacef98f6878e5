"""What the machine lacks, taken away for real, and guard's start: capabilities dropped with
setpriv (in the pod the Kubernetes manifests describe, tests/test_k8s.py's harness), a devices
cgroup that refuses /dev/fuse, and podman's ambient capability given to a user other than root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.doctor import POINTER

from .helpers import FIX_TAX

#: What podman gives a container whose own user is not root (here uid 65534).
AMBIENT_SYS_ADMIN = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps", "+sys_admin",
                     "--ambient-caps", "+sys_admin"]


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory uid 65534 can reach (pytest's tmp_path sits under a mode 700 tree)."""
    base = Path(tempfile.mkdtemp(prefix="guardfs-startfail-"))
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the other user must reach it
        yield base
    finally:
        shutil.rmtree(base)


def _workspace(base: Path, owner: int | None = None) -> tuple[Path, Path]:
    ws = base / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    if owner is not None:
        subprocess.run(["chown", "-R", f"{owner}:{owner}", str(base)], check=True)
    manifest = base / "guard.toml"
    manifest.write_text(FIX_TAX)
    return ws, manifest


@pytest.mark.root
@pytest.mark.mount
def test_an_ambient_capability_does_not_stop_bubblewrap(installation: str, reachable: Path) -> None:
    """As uid 65534 with CAP_SYS_ADMIN ambient (podman, a container user other than root):
    bubblewrap alone refuses to start; guard doctor and guard run, which clear the ambient set
    first, start it."""
    said = subprocess.run([*AMBIENT_SYS_ADMIN, "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--", "true"],
                          capture_output=True, text=True)
    assert said.returncode != 0 and "Unexpected capabilities but not setuid" in said.stderr, said  # really there
    env = {**os.environ, "PYTHONPATH": installation, "HOME": str(reachable)}
    doctor = subprocess.run([*AMBIENT_SYS_ADMIN, "/usr/bin/python3", "-m", "sandbox", "doctor", "--json"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=reachable)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["bubblewrap"]["status"] == "ok", checks["bubblewrap"]
    ws, manifest = _workspace(reachable, owner=65534)
    run = subprocess.run([*AMBIENT_SYS_ADMIN, "/usr/bin/python3", "-m", "sandbox", "run", "--manifest", str(manifest),
                          "--run-dir", str(reachable / "run"), "--", "sh", "-c",
                          "grep CapAmb /proc/self/status; echo '# ok' >> src/checkout/tax.py"],
                         capture_output=True, text=True, timeout=180, env=env, cwd=ws)
    assert run.returncode == 0, run.stderr
    assert (ws / "src/checkout/tax.py").read_text().endswith("# ok\n")
    assert "CapAmb:\t0000000000000000" in (reachable / "run/stdout.log").read_text()
    assert POINTER not in run.stderr and "Traceback" not in run.stderr
