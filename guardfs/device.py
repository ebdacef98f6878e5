"""What the machine gives guardfs to mount with: the FUSE device and the mount helper.

Checked without libfuse, for real (the device is opened, as the mount will open it), by
:func:`guardfs.mount.check_fuse_available` before every mount and by ``guard doctor``, which
shows the same findings with the one command that fixes each.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from dataclasses import dataclass
from typing import Literal

__all__ = ["FUSE_DEVICE", "POD_FUSE", "Finding", "fuse_device", "mount_capability", "mount_helper"]

FUSE_DEVICE = "/dev/fuse"
#: The FUSE device's numbers (Documentation/admin-guide/devices.txt: misc 229).
_MAJOR, _MINOR = 10, 229

Status = Literal["ok", "MISSING", "warn"]


@dataclass(frozen=True)
class Finding:
    """What was found: *detail* in a few words; when not ok, *advice* (the rest of the sentence a
    refused mount says) and *fix* (one command)."""

    status: Status
    detail: str
    advice: str = ""
    fix: str | None = None

    @property
    def message(self) -> str:
        """The sentence a refused mount says."""
        return f"{self.detail}; {self.advice}" if self.advice else self.detail


#: What a Kubernetes pod asks for to get /dev/fuse (containers/k8s/README.md lists the plugins).
POD_FUSE = ("resources.limits: {squat.ai/fuse: 1} (or your cluster's FUSE device plugin's resource; "
            "see containers/k8s/README.md), not a hostPath volume of /dev/fuse")


def _devices_cgroup() -> str | None:
    """The cgroup v1 devices directory this process is in (None: cgroup v2, or none found)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _num, controllers, path = line.split(":", 2)
        if "devices" in controllers.split(","):
            where = os.path.join("/sys/fs/cgroup/devices", path.lstrip("/"))
            return where if os.path.isdir(where) else None
    return None


def _refused_by_cgroup(mode: int, device_fix: str | None) -> Finding:
    """EPERM on open, whatever the mode: the devices cgroup (a container without --device)."""
    kubernetes = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    detail = (f"/dev/fuse is there (mode {mode:04o}) but opening it is refused (Operation not permitted) as uid "
              f"{os.geteuid()}: the devices cgroup does not allow the FUSE device here, not its mode")
    if kubernetes:
        advice = (f"the pod got /dev/fuse without the device itself (a hostPath volume); give the pod a FUSE "
                  f"device plugin's resource, {POD_FUSE}")
        fix = device_fix or f"in the pod spec: {POD_FUSE}"
    else:
        advice = ("a container started without --device /dev/fuse (a bind mount of /dev/fuse is not enough) "
                  "sees the node and may not open it: pass --device /dev/fuse to the container's run command")
        cgroup = _devices_cgroup()
        fix = device_fix or (f"echo 'c {_MAJOR}:{_MINOR} rwm' > {cgroup}/devices.allow" if cgroup is not None
                             else "docker run --device /dev/fuse ... (the container's run command, on the host)")
    return Finding("MISSING", detail, advice, fix)


def fuse_device(container_fix: str | None = None, device_fix: str | None = None) -> Finding:
    """/dev/fuse: present, the FUSE character device, and openable read-write by this user.
    *container_fix* is how the container we are in gets the device (None: not in one);
    *device_fix* how it gets it let through its devices cgroup (None: not in one)."""
    device_fix_missing = container_fix or "modprobe fuse"
    try:
        st = os.stat(FUSE_DEVICE)
    except FileNotFoundError:
        return Finding("MISSING", "/dev/fuse does not exist",
                       (f"in a Kubernetes pod, give it {POD_FUSE}" if os.environ.get("KUBERNETES_SERVICE_HOST")
                        else "load the fuse module (modprobe fuse) or, in a container, pass --device /dev/fuse "
                        "--cap-add SYS_ADMIN"), device_fix_missing)
    numbers = (os.major(st.st_rdev), os.minor(st.st_rdev))
    if not stat.S_ISCHR(st.st_mode) or numbers != (_MAJOR, _MINOR):
        return Finding("MISSING", f"/dev/fuse is not the FUSE device (a character device {_MAJOR},{_MINOR})",
                       "replace it with the real one", f"rm /dev/fuse && mknod -m 0666 /dev/fuse c {_MAJOR} {_MINOR}")
    mode = stat.S_IMODE(st.st_mode)
    try:
        os.close(os.open(FUSE_DEVICE, os.O_RDWR | os.O_CLOEXEC))
    except OSError as err:
        if err.errno == errno.EPERM:
            return _refused_by_cgroup(mode, device_fix)
        if err.errno == errno.EACCES and os.statvfs(FUSE_DEVICE).f_flag & os.ST_NODEV:
            return Finding("MISSING", "/dev/fuse lies on a filesystem mounted nodev: no device on it may be opened",
                           "remount it without nodev, or use the /dev the container runtime makes",
                           f"mount -o remount,dev {_mount_point(FUSE_DEVICE)}")
        if err.errno == errno.EACCES:
            # fusermount3 is no way around it: it opens the device as the calling user (tested).
            return Finding(
                "MISSING",
                f"/dev/fuse is mode {mode:04o} (owner uid {st.st_uid}, group gid {st.st_gid}): uid {os.geteuid()} "
                "may not open it, nor may fusermount3, which opens it as the same user",
                "as root, chmod 0666 /dev/fuse (the mode fuse3 gives it), or run guard as root",
                "chmod 0666 /dev/fuse")
        return Finding("MISSING", f"/dev/fuse cannot be opened: {err.strerror}",
                       "a container's device rules refuse it: pass --device /dev/fuse to the container",
                       device_fix or device_fix_missing)
    return Finding("ok", f"character device {_MAJOR},{_MINOR}, mode {mode:04o}, opened read-write as uid "
                         f"{os.geteuid()}")


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


#: CAP_SYS_ADMIN's number (linux/capability.h).
_CAP_SYS_ADMIN = 21


def mount_capability() -> Finding:
    """As root, CAP_SYS_ADMIN in the effective set (/proc/self/status CapEff): root mounts
    directly with it, and without it fusermount3 (libfuse's fallback) is refused too."""
    if os.geteuid() != 0:
        return Finding("ok", "not root: mounts through fusermount3")
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            found = re.search(r"^CapEff:\s*([0-9a-f]+)$", f.read(), re.M)
    except OSError:
        found = None
    if found is None or int(found[1], 16) >> _CAP_SYS_ADMIN & 1:
        return Finding("ok", "root with CAP_SYS_ADMIN")
    return Finding("MISSING", "guard runs as root without CAP_SYS_ADMIN, which the FUSE mount needs",
                   "a container needs --cap-add SYS_ADMIN in its run command, a Kubernetes pod "
                   "securityContext.capabilities.add: [SYS_ADMIN]", "docker run --cap-add SYS_ADMIN ...")


def mount_helper() -> Finding:
    """fusermount3, through which anyone but root mounts: on PATH and setuid root."""
    helper = shutil.which("fusermount3")
    root = os.geteuid() == 0
    st = os.stat(helper) if helper is not None else None
    if helper is not None and st is not None and st.st_mode & stat.S_ISUID and st.st_uid == 0:
        return Finding("ok", f"{helper}, setuid root")
    found = "there is no fusermount3 on PATH" if helper is None else f"{helper} is not setuid root"
    if root:  # libfuse mounts and unmounts directly as root
        return Finding("warn", f"{found}; not needed as root (only users other than root mount through it)")
    return Finding("MISSING", f"uid {os.geteuid()} may not mount, and {found} to mount for it",
                   "install fuse3 (apt-get install fuse3: its fusermount3 is setuid root), or run guard as root",
                   f"chmod u+s {helper}" if st is not None and st.st_uid == 0 else "apt-get install fuse3")
