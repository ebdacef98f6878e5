"""``guard doctor``: what this machine must give guard, each piece tried for real, and for each
one missing the one command that fixes it.

The checks are the ones guard's own refusals rest on, not copies: the FUSE device and
fusermount3 as :func:`guardfs.mount.check_fuse_available` finds them (:mod:`guardfs.device`),
bubblewrap started as :func:`sandbox.launch.isolation.probe` starts it before every run,
Landlock's ABI (:mod:`sandbox.launch.landlock`) and the guard's own seccomp filter with its
listener (:mod:`sandbox.launch.seccomp`), installed in a child process. Namespaces are tried
with util-linux's ``unshare``. What is found about the container we may be in (and its seccomp
profile) shapes the fixes: inside one, the fix is an option of the container's run command.

Every failure of ``guard run``, ``guard mount`` or ``guard demo`` to start for want of something
the machine lacks ends with :data:`POINTER`.

Standard library only at import: :mod:`sandbox.launch.enter` imports :data:`POINTER` inside
the sandbox.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from guardfs.device import POD_FUSE, Finding, fuse_device, mount_helper

__all__ = ["POINTER", "Check", "Where", "checks", "main", "where"]

#: The sentence every refused start for want of something the machine lacks ends with.
POINTER = "Run `guard doctor` to see what this machine lacks and how to fix it."

#: Below this, no Landlock (5.13); below the second, the seccomp filter's killable wait (5.19).
KERNEL_NEEDED = (5, 13)
KERNEL_FULL = (5, 19)

Status = Literal["ok", "MISSING", "warn"]


@dataclass(frozen=True)
class Check:
    """One check's outcome: *fix* is one command, given when *status* is MISSING."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    def lines(self) -> list[str]:
        """How ``guard doctor`` prints it."""
        out = [f"{self.status:<8}{self.name}: {self.detail}"]
        if self.fix is not None:
            out.append(f"        fix: {self.fix}")
        return out


@dataclass(frozen=True)
class Where:
    """The container we run in (*runtime* None: none found), what says so, and our seccomp state."""

    runtime: str | None
    evidence: str
    seccomp_mode: int  # /proc/self/status Seccomp: 0 none, 1 strict, 2 filter
    seccomp_filters: int

    def run_option(self, option: str) -> str:
        """The fix that gives the container *option* of its run command (on the host)."""
        if self.runtime == "kubernetes":
            spec = {"--security-opt seccomp=unconfined": "securityContext.seccompProfile: {type: Unconfined}",
                    "--device /dev/fuse": POD_FUSE,
                    "--device /dev/fuse --cap-add SYS_ADMIN": f"{POD_FUSE}; and securityContext.capabilities.add: "
                                                              "[SYS_ADMIN]"}
            if re.fullmatch(r"(?:--cap-add \w+ ?)+", option):
                return "in the pod spec: securityContext.capabilities.add: [" + \
                    ", ".join(re.findall(r"--cap-add (\w+)", option)) + "]"
            return f"in the pod spec: {spec.get(option, option)}"
        if self.runtime is None:  # a filter the process that started guard installed
            return f"start guard without the seccomp filter it runs under (Seccomp_filters: {self.seccomp_filters})"
        runtime = self.runtime if self.runtime in ("docker", "podman") else "docker"
        return f"{runtime} run {option} ... (the container's run command, on the host)"

    @property
    def filtered(self) -> bool:
        """Under a seccomp filter (in a container: Docker's and podman's default profiles)."""
        return self.seccomp_mode == 2


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def where() -> Where:
    """Whether we are in a container, and which (what says so), with our seccomp state."""
    status = _read("/proc/self/status") or ""
    mode = re.search(r"^Seccomp:\s*(\d+)", status, re.M)
    filters = re.search(r"^Seccomp_filters:\s*(\d+)", status, re.M)
    seccomp = (int(mode[1]) if mode else 0, int(filters[1]) if filters else 0)
    cgroup = _read("/proc/1/cgroup") or ""
    found: tuple[str, str] | None = None
    if os.environ.get("KUBERNETES_SERVICE_HOST"):  # first: a pod's runtime may leave /.dockerenv too
        found = ("kubernetes", "KUBERNETES_SERVICE_HOST is set")
    elif os.path.exists("/run/.containerenv"):
        found = ("podman", "/run/.containerenv")
    elif os.path.exists("/.dockerenv"):
        found = ("docker", "/.dockerenv")
    elif os.path.isdir("/var/run/secrets/kubernetes.io"):
        found = ("kubernetes", "a Kubernetes service account")
    elif (hit := re.search(r"(docker|kubepods|libpod|lxc)", cgroup)) is not None:
        found = ({"kubepods": "kubernetes", "libpod": "podman"}.get(hit[1], hit[1]), f"/proc/1/cgroup names {hit[1]}")
    elif named := os.environ.get("container"):  # noqa: SIM112 - systemd's name for it, in lower case
        found = (named, "$container")
    elif (detect := shutil.which("systemd-detect-virt")) is not None:
        try:
            said = subprocess.run([detect, "--container"], capture_output=True, text=True, timeout=10,
                                  check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            said = ""
        if said and said != "none":
            found = (said, "systemd-detect-virt --container")
    if found is None:
        return Where(None, "no /.dockerenv, /run/.containerenv or container cgroup", *seccomp)
    return Where(found[0], found[1], *seccomp)


def _try(argv: list[str]) -> str | None:
    """Run *argv*: None when it succeeds, else what it said."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=30, check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if proc.returncode == 0:
        return None
    return " ".join((proc.stderr or proc.stdout).split()) or f"exit status {proc.returncode}"


def _sysctl(name: str) -> str | None:
    value = _read("/proc/sys/" + name.replace(".", "/"))
    return value.strip() if value is not None else None


def _namespace_fix(at: Where, unprivileged: bool) -> str:
    """The one command that lets this machine make the namespaces it refused."""
    if at.filtered:
        return at.run_option("--security-opt seccomp=unconfined")
    if unprivileged:
        if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":  # Ubuntu 23.10 and later
            return "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
        if _sysctl("kernel.unprivileged_userns_clone") == "0":  # Debian's switch before 11
            return "sysctl -w kernel.unprivileged_userns_clone=1"
        if _sysctl("user.max_user_namespaces") == "0":
            return "sysctl -w user.max_user_namespaces=15000"
    if at.runtime is not None:
        return at.run_option("--cap-add SYS_ADMIN")
    if _sysctl("user.max_mnt_namespaces") == "0":
        return "sysctl -w user.max_mnt_namespaces=15000"
    return "run guard as root (sudo guard ...)"


def _from(name: str, finding: Finding) -> Check:
    return Check(name, finding.status, finding.detail, finding.fix if finding.status == "MISSING" else None)


def _fuse(at: Where) -> Check:
    inside = at.runtime is not None
    return _from("/dev/fuse", fuse_device(at.run_option("--device /dev/fuse --cap-add SYS_ADMIN") if inside else None,
                                          at.run_option("--device /dev/fuse") if inside else None))


def _bubblewrap(at: Where) -> Check:
    from sandbox.launch.isolation import try_sandbox

    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Check("bubblewrap", "MISSING", "bwrap is not on PATH", "apt-get install bubblewrap")
    failed = try_sandbox(bwrap)
    if failed is not None:
        return Check("bubblewrap", "MISSING", failed, _namespace_fix(at, os.geteuid() != 0))
    version = _try_output([bwrap, "--version"]) or "bubblewrap"
    return Check("bubblewrap", "ok", f"{bwrap} ({version}) made the sandbox's namespaces and mounts")


def _try_output(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


_AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _user_namespaces(at: Where) -> Check:
    name = "user namespaces"
    unshare = shutil.which("unshare")
    if unshare is None:
        return Check(name, "MISSING", "cannot be tried: no unshare on PATH", "apt-get install util-linux")
    argv = [unshare, "--user", "--map-root-user", "true"]
    if os.geteuid() != 0:
        failed = _try(argv)
        if failed is not None:
            return Check(name, "MISSING", f"uid {os.geteuid()} cannot make one ({failed}); bubblewrap needs one "
                         "when guard does not run as root", _namespace_fix(at, unprivileged=True))
        return Check(name, "ok", f"uid {os.geteuid()} made one")
    failed = _try([*_AS_NOBODY, *argv])
    if failed is not None:
        return Check(name, "warn", f"uid 65534 cannot make one ({failed}): guard as root needs none, but "
                     f"guard run --user and guard as another user do; the fix: {_namespace_fix(at, True)}")
    return Check(name, "ok", "made by uid 65534 (guard as root needs none; guard run --user does)")


def _mount_namespaces(at: Where) -> Check:
    name = "mount namespaces"
    unshare = shutil.which("unshare")
    if unshare is None:
        return Check(name, "MISSING", "cannot be tried: no unshare on PATH", "apt-get install util-linux")
    root = os.geteuid() == 0
    failed = _try([unshare, "--mount", "true"] if root else [unshare, "--user", "--map-root-user", "--mount", "true"])
    if failed is not None:
        return Check(name, "MISSING", f"uid {os.geteuid()} cannot make one ({failed}); the guard's mount and the "
                     "sandbox live in one", _namespace_fix(at, unprivileged=not root))
    return Check(name, "ok", f"uid {os.geteuid()} made one" + ("" if root else " (in a user namespace)"))


def _capabilities(at: Where) -> Check:
    from sandbox.launch.capabilities import FOR_ANY_ROOT_RUN, FOR_USER, missing, own

    name = "capabilities"
    if os.geteuid() != 0:
        ambient = re.search(r"^CapAmb:\s*([0-9a-f]+)", _read("/proc/self/status") or "", re.M)
        said = f" (its ambient ones, {ambient[1]}, are cleared before bubblewrap starts)" \
            if ambient and int(ambient[1], 16) else ""
        return Check(name, "ok", f"uid {os.geteuid()}: a guard that is not root needs none{said}")
    lacking = missing("--user")

    def fix(names: Iterable[str]) -> str:
        if at.runtime is None:
            return ("start guard from a process that has them (not under setpriv --bounding-set, capsh --drop "
                    "or a service's CapabilityBoundingSet=)")
        return at.run_option(" ".join(f"--cap-add {n}" for n in names))

    listed = ", ".join(f"CAP_{n} ({why})" for n, why in lacking.items())
    if any(n in FOR_ANY_ROOT_RUN for n in lacking):
        return Check(name, "MISSING", f"uid 0 lacks {listed}; guard run as root needs "
                     f"{', '.join('CAP_' + n for n in FOR_ANY_ROOT_RUN)}", fix(lacking))
    if lacking:
        return Check(name, "warn", f"uid 0 lacks {listed}: guard run as root works, guard run --user does not; "
                     f"the fix: {fix(lacking)}")
    every = [n for n in (*FOR_ANY_ROOT_RUN, *FOR_USER) if own().has(n)]
    return Check(name, "ok", f"uid 0 has {', '.join('CAP_' + n for n in every)} (all guard run --user needs)")


def _kernel_release() -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(found[1]), int(found[2])) if found else None


def _kernel_fix() -> str:
    return "apt-get install linux-image-" + {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), "amd64") \
        + " && reboot"


def _landlock(at: Where) -> Check:
    from sandbox.launch.landlock import LandlockUnavailable, abi_version

    try:
        abi = abi_version()
    except LandlockUnavailable as err:
        if err.errno == errno.EOPNOTSUPP:
            fix = ("sed -i 's/^GRUB_CMDLINE_LINUX=\"/&lsm=landlock,lockdown,yama,integrity,apparmor /' "
                   "/etc/default/grub && update-grub && reboot")
        elif at.filtered:
            fix = at.run_option("--security-opt seccomp=unconfined")
        else:
            fix = _kernel_fix()
        return Check("landlock", "MISSING", f"{err.strerror}; guard confines the agent's writes with it", fix)
    scopes = " (with scopes: abstract unix sockets and signals)" if abi >= 6 else ""
    return Check("landlock", "ok", f"ABI {abi}{scopes}")


# Run in a child: no_new_privs (which the filter needs, as in the sandbox), then the guard's filter,
# from sandbox/launch/seccomp.py loaded by its path (standard library only: no package to import).
_LISTENER = """
import ctypes, importlib.util, sys
if ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_NO_NEW_PRIVS) failed")
spec = importlib.util.spec_from_file_location("guard_seccomp", sys.argv[1])
seccomp = sys.modules["guard_seccomp"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(seccomp)
try:
    seccomp.try_listener()
except OSError as err:
    sys.exit(f"{err.errno} {err.strerror}")
"""


def _seccomp(at: Where) -> Check:
    name = "seccomp user notification"
    try:
        from sandbox.launch import seccomp

        proc = subprocess.run([sys.executable, "-I", "-S", "-c", _LISTENER, seccomp.__file__], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Check(name, "MISSING", f"the probe could not run: {err}", "reinstall guardfs")
    if proc.returncode == 0:
        return Check(name, "ok", "the guard's filter and its listener installed (in a child process)")
    said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
    code, _, words = said.partition(" ")
    detail = f"the guard's filter cannot be installed ({words or said}); it keeps the host's unix sockets out of " \
             "the sandbox's reach"
    if code == str(errno.EBUSY):
        return Check(name, "MISSING", detail + " (another seccomp listener is already above us)",
                     at.run_option("--security-opt seccomp=unconfined"))
    if at.filtered:
        return Check(name, "MISSING", detail, at.run_option("--security-opt seccomp=unconfined"))
    if code == str(errno.ENOSYS) and "no seccomp filter for" in said:
        return Check(name, "MISSING", detail, "guard run --no-isolation -- CMD (unsandboxed: x86_64 and aarch64 only)")
    return Check(name, "MISSING", detail, _kernel_fix())


def _kernel() -> Check:
    release, have = platform.release(), _kernel_release()
    if have is None:
        return Check("kernel", "warn", f"{release}: cannot tell the version")
    if have < KERNEL_NEEDED:
        return Check("kernel", "warn", f"{release}: guard needs Linux >= 5.13 (Landlock); the fix: {_kernel_fix()}")
    if have < KERNEL_FULL:
        return Check("kernel", "warn", f"{release}: below 5.19, a signal the agent handles during a guarded connect "
                     "may restart it (no SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV)")
    return Check("kernel", "ok", f"Linux {release} (>= 5.19: everything guard uses)")


def _container(at: Where) -> Check:
    seccomp = {0: "no seccomp filter", 1: "seccomp strict mode"}.get(
        at.seccomp_mode, f"under a seccomp filter (Seccomp: {at.seccomp_mode}, Seccomp_filters: {at.seccomp_filters})")
    if at.runtime is None:
        return Check("container", "warn" if at.filtered else "ok", f"not in a container ({at.evidence}); {seccomp}")
    if at.filtered and at.runtime is not None:
        return Check("container", "warn", f"{at.runtime} ({at.evidence}), {seccomp}: Docker's and podman's default "
                     "profiles refuse the namespaces bubblewrap makes; where a check above is MISSING: "
                     f"{at.run_option('--security-opt seccomp=unconfined')}")
    return Check("container", "ok", f"{at.runtime} ({at.evidence}); {seccomp}")


def checks() -> list[Check]:
    """Every check, in the order ``guard doctor`` prints them."""
    at = where()
    return [_fuse(at), _from("fusermount3", mount_helper()), _bubblewrap(at), _user_namespaces(at),
            _mount_namespaces(at), _capabilities(at), _landlock(at), _seccomp(at), _kernel(), _container(at)]


def main(as_json: bool = False) -> int:
    """Print the checks (one line each, or JSON); 0 when nothing required is missing, else 69."""
    found = checks()
    if as_json:
        print(json.dumps([asdict(c) for c in found], indent=2))
    else:
        for check in found:
            print("\n".join(check.lines()))
    missing = [c.name for c in found if c.status == "MISSING"]
    if missing:
        print(f"guard doctor: missing: {', '.join(missing)}", file=sys.stderr)
        return 69
    return 0
