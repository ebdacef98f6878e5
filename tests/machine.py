"""What a test needs from the machine: FUSE and root, checked for the `mount` and `root` markers.

``pytest -m "not mount"`` runs everything that needs neither; without the filter, a test
marked ``mount`` on a machine that cannot mount FUSE, or ``root`` when not root, is skipped
with the reason, never failed.
"""

from __future__ import annotations

import functools
import os
import stat

import pytest

__all__ = ["fuse_unavailable", "skip_what_this_machine_cannot_run"]

#: The FUSE device's numbers (the kernel's Documentation/admin-guide/devices.txt: char 10, 229).
_FUSE_DEVICE = (10, 229)


@functools.cache
def fuse_unavailable() -> str | None:
    """Why this process cannot mount a FUSE filesystem, or None when it can.

    The device is opened for real rather than tested for existence: a container may list
    /dev/fuse without letting anyone open it, or bind something else over it.
    """
    try:
        st = os.stat("/dev/fuse")
    except FileNotFoundError:
        return "/dev/fuse is missing: this test needs a real FUSE mount (`pytest -m 'not mount'` runs the rest)"
    except OSError as err:
        return f"/dev/fuse cannot be examined ({err.strerror}): this test needs a real FUSE mount"
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != _FUSE_DEVICE:
        return "/dev/fuse is not the FUSE device (char 10:229): this test needs a real FUSE mount"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as err:
        return f"/dev/fuse cannot be opened read-write ({err.strerror}): this test needs a real FUSE mount"
    return None


def skip_what_this_machine_cannot_run(items: list[pytest.Item]) -> None:
    """Mark `mount` tests skipped where FUSE cannot be used and `root` tests when not root."""
    for item in items:
        if item.get_closest_marker("mount") is not None and (reason := fuse_unavailable()) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("root") is not None and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason=f"needs root, as CI runs it (running as uid {os.geteuid()})"))
