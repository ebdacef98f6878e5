"""guard doctor on this machine, and with pieces really taken away: /dev/fuse hidden by a
bubblewrap sandbox with a fresh /dev, bubblewrap hidden from PATH, a seccomp filter like
Docker's default profile; and guard run, guard mount and guard demo refusing to start there
with the pointer to guard doctor."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.doctor import POINTER

from .helpers import require

NAMES = ["/dev/fuse", "fusermount3", "bubblewrap", "user namespaces", "mount namespaces", "capabilities", "landlock",
         "seccomp user notification", "kernel", "container"]
GUARD = [sys.executable, "-m", "sandbox"]
IN_CONTAINER = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
_LINE = re.compile(r"^(ok      |MISSING |warn    )([^:]+): (.+)$")


def _parse(stdout: str) -> list[dict[str, str | None]]:
    """guard doctor's lines, read back as its JSON has them (every line must be one of the three forms)."""
    found: list[dict[str, str | None]] = []
    for line in stdout.splitlines():
        if line.startswith("        fix: "):
            assert found and found[-1]["status"] == "MISSING", line
            found[-1]["fix"] = line.removeprefix("        fix: ")
            continue
        match = _LINE.match(line)
        assert match is not None, line
        found.append({"name": match[2], "status": match[1].strip(), "detail": match[3], "fix": None})
    return found


def _doctor(prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
            ) -> tuple[int, dict[str, dict[str, str | None]]]:
    """Run guard doctor (after *prefix*) as text and as JSON; the two must agree. Returns the
    exit status and the checks by name."""
    text = subprocess.run([*prefix, *GUARD, "doctor"], capture_output=True, text=True, timeout=120, env=env)
    as_json = subprocess.run([*prefix, *GUARD, "doctor", "--json"], capture_output=True, text=True, timeout=120,
                             env=env)
    assert text.returncode == as_json.returncode, (text.stderr, as_json.stderr)
    parsed, listed = _parse(text.stdout), json.loads(as_json.stdout)
    assert [c["name"] for c in parsed] == NAMES
    assert [(c["name"], c["status"], c["fix"]) for c in listed] == [(c["name"], c["status"], c["fix"]) for c in parsed]
    missing = [c["name"] for c in parsed if c["status"] == "MISSING"]
    assert text.returncode == (69 if missing else 0), text.stdout + text.stderr
    assert all(c["fix"] for c in parsed if c["status"] == "MISSING"), text.stdout  # every MISSING has its fix
    return text.returncode, {str(c["name"]): c for c in parsed}


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    manifest = tmp_path / "guard.toml"
    manifest.write_text('[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/"]\n')
    return ws, manifest


def _refused(proc: subprocess.CompletedProcess[str], verb: str) -> None:
    """A start refused for want of something the machine lacks: 69, ending with the pointer."""
    assert proc.returncode == 69, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"guard {verb}: "), proc.stderr
    assert proc.stderr.rstrip("\n").endswith(POINTER), proc.stderr


@pytest.mark.root
@pytest.mark.mount
def test_everything_guard_needs_is_here() -> None:
    """As CI runs (root, /dev/fuse, bubblewrap): every check ok, exit 0."""
    status, checks = _doctor()
    assert status == 0
    assert {name: c["status"] for name, c in checks.items() if name not in ("kernel", "container")} == \
        dict.fromkeys(NAMES[:8], "ok"), checks
    assert checks["/dev/fuse"]["detail"] == "character device 10,229, mode 0666, opened read-write as uid 0"
    assert f"ABI {int(str(checks['landlock']['detail']).split()[1])}" in str(checks["landlock"]["detail"])
    assert platform.release() in str(checks["kernel"]["detail"])
    seccomp = re.search(r"^Seccomp:\s*(\d+)", Path("/proc/self/status").read_text(), re.M)
    assert seccomp is not None
    assert ("no seccomp filter" in str(checks["container"]["detail"])) == (seccomp[1] == "0"), checks["container"]


@pytest.mark.root
def test_without_dev_fuse(tmp_path: Path) -> None:
    """In a sandbox whose /dev has no fuse: doctor says MISSING with the fix; guard run, guard
    mount and guard demo refuse to start with the pointer."""
    no_fuse = (require("bwrap"), "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--")
    assert subprocess.run([*no_fuse, "test", "-e", "/dev/fuse"]).returncode == 1  # really gone
    status, checks = _doctor(no_fuse)
    assert status == 69
    fuse = checks["/dev/fuse"]
    assert (fuse["status"], fuse["detail"]) == ("MISSING", "/dev/fuse does not exist")
    if IN_CONTAINER:
        assert str(fuse["fix"]).endswith(" run --device /dev/fuse --cap-add SYS_ADMIN ... (the container's run "
                                         "command, on the host)"), fuse
    else:
        assert fuse["fix"] == "modprobe fuse"
    assert [n for n, c in checks.items() if c["status"] == "MISSING"] == ["/dev/fuse"]  # nothing else taken
    ws, manifest = _workspace(tmp_path)
    run = subprocess.run([*no_fuse, *GUARD, "run", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run"),
                          "--", "true"], cwd=ws, capture_output=True, text=True, timeout=120)
    _refused(run, "run")
    assert "/dev/fuse does not exist" in run.stderr
    (tmp_path / "mnt").mkdir()
    mount = subprocess.run([*no_fuse, *GUARD, "mount", str(ws), str(tmp_path / "mnt")], capture_output=True,
                           text=True, timeout=120)
    _refused(mount, "mount")
    demo = subprocess.run([*no_fuse, *GUARD, "demo"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert demo.returncode == 69, demo.stdout + demo.stderr
    assert demo.stdout.rstrip("\n").endswith(POINTER), demo.stdout
    assert POINTER in demo.stderr  # guard run's own words first


def test_without_bubblewrap_on_path(tmp_path: Path) -> None:
    """PATH with everything of /usr/bin and /bin but bwrap: bubblewrap MISSING, apt-get install
    bubblewrap; guard run refuses, pointing to doctor."""
    farm = tmp_path / "bin"
    farm.mkdir()
    for top in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        for entry in os.scandir(top):
            if entry.name != "bwrap" and not (farm / entry.name).exists():
                (farm / entry.name).symlink_to(entry.path)
    env = {**os.environ, "PATH": str(farm)}
    assert shutil.which("bwrap", path=env["PATH"]) is None and shutil.which("unshare", path=env["PATH"])
    _status, checks = _doctor(env=env)
    assert (checks["bubblewrap"]["status"], checks["bubblewrap"]["detail"], checks["bubblewrap"]["fix"]) == \
        ("MISSING", "bwrap is not on PATH", "apt-get install bubblewrap")
    assert checks["mount namespaces"]["status"] == checks["landlock"]["status"] == "ok"  # only bwrap is gone
    ws, manifest = _workspace(tmp_path)
    run = subprocess.run([*GUARD, "run", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run"), "--",
                          "true"], cwd=ws, capture_output=True, text=True, timeout=120, env=env)
    _refused(run, "run")
    assert "bubblewrap is not installed (apt-get install bubblewrap)" in run.stderr
    assert not (tmp_path / "run").exists()


# Docker's default profile for a container without CAP_SYS_ADMIN, in its parts that matter here:
# no unshare, setns or mount, no clone of new namespaces, and clone3 ENOSYS (so that glibc falls
# back to clone, whose flags a filter can see). Then exec the command given.
_DOCKER_LIKE = """
import ctypes, os, struct, sys
LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
NEW_NAMESPACES = 0x7E020000
code = [(LD, 0, 0, 0)]
for nr in (272, 308, 165):  # unshare, setns, mount
    code += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
code += [(JEQ, 0, 1, 435), (RET, 0, 0, ENOSYS),  # clone3
         (JEQ, 0, 3, 56), (LD, 0, 0, 16), (JSET, 0, 1, NEW_NAMESPACES), (RET, 0, 0, EPERM),  # clone
         (RET, 0, 0, ALLOW)]
program = b"".join(struct.pack("=HBBI", *step) for step in code)
buffer = ctypes.create_string_buffer(program, len(program))
fprog = struct.pack("=HxxxxxxQ", len(code), ctypes.addressof(buffer))
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.syscall(317, 1, 0, ctypes.c_char_p(fprog)) == 0, os.strerror(ctypes.get_errno())
os.execvp(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.root
@pytest.mark.mount  # /dev/fuse present: the filter alone is what is missing
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter's system call numbers are x86_64's")
def test_under_a_seccomp_filter_like_dockers_default(tmp_path: Path) -> None:
    """Under a filter that refuses new namespaces (Docker's default profile): bubblewrap and
    mount namespaces MISSING, the container check names the filter; guard run refuses."""
    prefix = (sys.executable, "-c", textwrap.dedent(_DOCKER_LIKE))
    probe = subprocess.run([*prefix, "unshare", "--mount", "true"], capture_output=True, text=True)
    assert probe.returncode != 0 and "Operation not permitted" in probe.stderr, probe  # the filter holds
    status, checks = _doctor(prefix)
    assert status == 69
    assert {n for n, c in checks.items() if c["status"] == "MISSING"} == {"bubblewrap", "mount namespaces"}, checks
    assert "cannot make the sandbox here" in str(checks["bubblewrap"]["detail"])
    assert checks["user namespaces"]["status"] == "warn"  # root needs none; --user would
    assert checks["landlock"]["status"] == checks["seccomp user notification"]["status"] == "ok"
    assert checks["capabilities"]["status"] == "ok"  # a filter takes no capability away
    assert "Seccomp: 2, Seccomp_filters: 1" in str(checks["container"]["detail"])
    assert checks["container"]["status"] == "warn"
    for name in ("bubblewrap", "mount namespaces"):
        fix = str(checks[name]["fix"])
        if IN_CONTAINER:
            assert fix.endswith(" run --security-opt seccomp=unconfined ... (the container's run command, on the "
                                "host)"), fix
        else:
            assert fix == "start guard without the seccomp filter it runs under (Seccomp_filters: 1)", fix
    ws, manifest = _workspace(tmp_path)
    run = subprocess.run([*prefix, *GUARD, "run", "--manifest", str(manifest), "--run-dir", str(tmp_path / "run"), "--",
                          "true"], cwd=ws, capture_output=True, text=True, timeout=120)
    _refused(run, "run")
    assert "isolation is impossible here" in run.stderr and "cannot make the sandbox here" in run.stderr


@pytest.mark.root
@pytest.mark.mount
def test_as_a_user_other_than_root(installation: str) -> None:
    """As uid 65534: the checks that differ for a user (fusermount3 setuid, an unprivileged user
    namespace, bubblewrap in one, the filter after no_new_privs) pass here for real."""
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {**os.environ, "PYTHONPATH": installation, "HOME": "/tmp"}
    proc = subprocess.run([*user, "/usr/bin/python3", "-m", "sandbox", "doctor", "--json"], capture_output=True,
                          text=True, timeout=120, env=env, cwd="/tmp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["/dev/fuse"]["detail"].endswith("opened read-write as uid 65534")
    assert checks["fusermount3"] == {"name": "fusermount3", "status": "ok", "fix": None,
                                     "detail": "/usr/bin/fusermount3, setuid root"}
    assert (checks["user namespaces"]["status"], checks["user namespaces"]["detail"]) == ("ok", "uid 65534 made one")
    assert checks["mount namespaces"]["detail"] == "uid 65534 made one (in a user namespace)"
    assert checks["bubblewrap"]["status"] == checks["seccomp user notification"]["status"] == "ok"


@pytest.mark.root
@pytest.mark.parametrize("kubernetes", [False, True], ids=["here", "pod"])
def test_capabilities_taken_away(kubernetes: bool) -> None:
    """As root without CAP_SYS_ADMIN (setpriv --bounding-set): capabilities MISSING with the fix
    (--cap-add; in a pod securityContext.capabilities.add); without only CAP_KILL and CAP_FOWNER,
    which guard run --user alone needs: a warning naming them."""
    env = {**os.environ, **({"KUBERNETES_SERVICE_HOST": "10.96.0.1"} if kubernetes else {})}
    if not kubernetes:
        env.pop("KUBERNETES_SERVICE_HOST", None)
    status, checks = _doctor(("setpriv", "--bounding-set=-sys_admin", "--"), env=env)
    assert status == 69
    caps = checks["capabilities"]
    assert caps["status"] == "MISSING" and str(caps["detail"]).startswith("uid 0 lacks CAP_SYS_ADMIN ("), caps
    assert "CAP_DAC_OVERRIDE (" not in str(caps["detail"])  # only what is missing is named
    if kubernetes:
        assert caps["fix"] == "in the pod spec: securityContext.capabilities.add: [SYS_ADMIN]"
    elif IN_CONTAINER:
        assert str(caps["fix"]).endswith(" run --cap-add SYS_ADMIN ... (the container's run command, on the host)")
    else:
        assert str(caps["fix"]).startswith("start guard from a process that has them")
    status, checks = _doctor(("setpriv", "--bounding-set=-kill,-fowner", "--"), env=env)
    caps = checks["capabilities"]
    assert caps["status"] == "warn", caps
    assert "lacks CAP_FOWNER (" in str(caps["detail"]) and ", CAP_KILL (" in str(caps["detail"])
    assert "guard run as root works, guard run --user does not" in str(caps["detail"])
    if kubernetes:
        assert str(caps["detail"]).endswith("the fix: in the pod spec: securityContext.capabilities.add: "
                                            "[FOWNER, KILL]")
