"""What the machine lacks, taken away for real, and guard's start: capabilities dropped with
setpriv (in the pod the Kubernetes manifests describe, tests/test_k8s.py's harness), a devices
cgroup that refuses /dev/fuse, and podman's ambient capability given to a user other than root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


DEVICES_V1 = Path("/sys/fs/cgroup/devices")


@pytest.fixture
def fuse_denied() -> Iterator[tuple[str, ...]]:
    """A command prefix that runs its command in a devices cgroup denying the FUSE device (c
    10:229): what a container started without --device /dev/fuse is in, a bind-mounted node or
    a Kubernetes hostPath volume of /dev/fuse notwithstanding."""
    if not (DEVICES_V1 / "devices.deny").exists():
        pytest.skip("no cgroup v1 devices controller here (cgroup v2 denies devices with a BPF program)")
    group = Path(tempfile.mkdtemp(prefix="guardfs-no-fuse-", dir=DEVICES_V1))
    try:
        (group / "devices.deny").write_text("c 10:229 rwm\n")
        yield ("sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "in-cgroup")
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), 9)
        os.rmdir(group)


@pytest.mark.root
@pytest.mark.mount  # the host's /dev/fuse, which the devices cgroup then refuses
@pytest.mark.parametrize("kubernetes", [False, True], ids=["container", "pod"])
def test_dev_fuse_refused_by_the_devices_cgroup(fuse_denied: tuple[str, ...], tmp_path: Path,
                                                kubernetes: bool) -> None:
    """/dev/fuse there, mode 0666, yet EPERM as root: doctor and guard run name the devices
    cgroup and the real fix (--device /dev/fuse; in a pod, a device plugin's resource), not the mode."""
    from guardfs.device import POD_FUSE
    from sandbox.doctor import where

    probe = subprocess.run([*fuse_denied, "python3", "-c", "import os; os.open('/dev/fuse', os.O_RDWR)"],
                           capture_output=True, text=True)
    assert "PermissionError: [Errno 1] Operation not permitted" in probe.stderr, probe.stderr  # really refused
    env = {**os.environ, **({"KUBERNETES_SERVICE_HOST": "10.96.0.1"} if kubernetes else {})}
    if not kubernetes:
        env.pop("KUBERNETES_SERVICE_HOST", None)
    doctor = subprocess.run([*fuse_denied, sys.executable, "-m", "sandbox", "doctor", "--json"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert doctor.returncode == 69, doctor.stderr
    fuse = {c["name"]: c for c in json.loads(doctor.stdout)}["/dev/fuse"]
    assert fuse["status"] == "MISSING" and "the devices cgroup does not allow the FUSE device" in fuse["detail"], fuse
    assert "chmod" not in str(fuse["fix"])
    runtime = where().runtime
    if kubernetes:
        assert fuse["fix"] == f"in the pod spec: {POD_FUSE}", fuse
    elif runtime is not None:
        assert str(fuse["fix"]).endswith(" run --device /dev/fuse ... (the container's run command, on the host)"), fuse
    else:
        assert str(fuse["fix"]).startswith("echo 'c 10:229 rwm' > /sys/fs/cgroup/devices/guardfs-no-fuse-"), fuse
    ws, manifest = _workspace(tmp_path)
    run = subprocess.run([*fuse_denied, sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest),
                          "--run-dir", str(tmp_path / "run"), "--", "true"], cwd=ws, capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 69, run.stderr
    assert "the devices cgroup does not allow the FUSE device here, not its mode" in run.stderr
    assert ("squat.ai/fuse" in run.stderr) == kubernetes and "chmod" not in run.stderr
    assert run.stderr.rstrip("\n").endswith(POINTER)
    assert not (tmp_path / "run").exists()


# --- a root guard without a capability its run needs ------------------------------------------

ROOT_AGENT_CAPS = ["SYS_ADMIN", "DAC_OVERRIDE"]
#: The --user of each case (tests/test_k8s.py's AGENT_USER), or none: the agent is root.
AGENT_USER_OR_NONE = {True: "nobody", False: None}


def _pod_run(base: Path, caps: list[str], user: bool, agent: str) -> subprocess.CompletedProcess[str]:
    from .test_k8s import AGENT_USER, in_pod
    from .test_k8s import _workspace as pod_workspace

    ws, manifest = pod_workspace(base)
    if not user:
        subprocess.run(["chown", "-R", "0:0", str(ws)], check=True)
    return in_pod([sys.executable, "-m", "sandbox", "run", "--ci", *(("--user", AGENT_USER) if user else ()),
                   "--manifest", str(manifest), "--run-dir", str(base / "run"), "--", "sh", "-c", agent],
                  caps=caps, fuse=True, cwd=ws)


@pytest.mark.root
@pytest.mark.mount
def test_a_root_agent_needs_sys_admin_and_dac_override_only(reachable: Path) -> None:
    """The set guard asks of a root guard whose agent is root works: no capability more is needed."""
    result = _pod_run(reachable, ROOT_AGENT_CAPS, user=False, agent="id -u; echo '# ok' >> src/checkout/tax.py")
    assert result.returncode == 0, result.stderr
    assert (reachable / "run/stdout.log").read_text() == "0\n"
    assert (reachable / "ws/src/checkout/tax.py").read_text().endswith("# ok\n")


def _pod_caps() -> list[str]:
    from .test_k8s import POD_CAPS

    return POD_CAPS


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize(("user", "dropped"), [(False, cap) for cap in ROOT_AGENT_CAPS] +
                         [(True, cap) for cap in ["SYS_ADMIN", "DAC_OVERRIDE", "SETUID", "SETGID", "CHOWN",
                                                   "FOWNER", "KILL"]],
                         ids=lambda v: {True: "user", False: "root"}.get(v, v) if isinstance(v, bool) else v)
def test_a_missing_capability_is_refused_at_start(reachable: Path, user: bool, dropped: str) -> None:
    """Each capability the run needs, taken away: guard run refuses before the agent starts (69),
    naming it and what needs it, with the pointer to guard doctor; no traceback, no exit 70."""
    from sandbox.launch.capabilities import needed

    assert set(needed(AGENT_USER_OR_NONE[user])) == set(_pod_caps() if user else ROOT_AGENT_CAPS)
    caps = [cap for cap in (_pod_caps() if user else ROOT_AGENT_CAPS) if cap != dropped]
    result = _pod_run(reachable, caps, user=user, agent="echo agent-ran")
    assert result.returncode == 69, result.stderr
    assert f"CAP_{dropped} ({needed(AGENT_USER_OR_NONE[user])[dropped]})" in result.stderr, result.stderr
    assert f"--cap-add {dropped}" in result.stderr and f"capabilities.add: [{dropped}]" in result.stderr
    assert result.stderr.rstrip("\n").endswith(POINTER), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert not (reachable / "run/stdout.log").exists()  # the agent never started


@pytest.mark.root
@pytest.mark.mount  # guard mount reaches the mount itself only where /dev/fuse is
def test_guard_mount_as_root_without_sys_admin(tmp_path: Path) -> None:
    """guard mount as root without CAP_SYS_ADMIN: refused naming it, with the pointer (not
    fusermount3's "mount failed" and a guess about the mountpoint)."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "mnt").mkdir()
    proc = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--", sys.executable, "-m", "sandbox", "mount",
                           str(tmp_path / "ws"), str(tmp_path / "mnt")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 69, proc.stderr
    assert proc.stderr.startswith("guard mount: guard runs as root without CAP_SYS_ADMIN, which the FUSE mount needs; "
                                  "a container needs --cap-add SYS_ADMIN"), proc.stderr
    assert proc.stderr.rstrip("\n").endswith(POINTER)
    assert str(tmp_path / "mnt") not in Path("/proc/mounts").read_text()
