"""Landlock: the kernel's unprivileged access control, applied to ourselves before exec.

Only writes are restricted (reads are governed by what bubblewrap shows): after
:func:`restrict_writes`, this process and everything it starts can create, write, remove or
rename files only beneath the given directories. ``no_new_privs`` is set first, as Landlock
requires; a setuid program can then gain nothing either.

Where the kernel has them (ABI >= 6), the ruleset's scopes are set too: no connect to an
abstract unix socket made outside the sandbox, no signal to a process outside it. Defence in
depth: the guard's seccomp filter judges every connect already (:mod:`sandbox.launch.sockets`).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable

__all__ = ["LandlockUnavailable", "abi_version", "restrict_writes"]

_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# Access rights (include/uapi/linux/landlock.h), by the ABI version that introduced them.
_WRITE_FILE = 1 << 1
_REMOVE_DIR = 1 << 4
_REMOVE_FILE = 1 << 5
_MAKE_CHAR = 1 << 6
_MAKE_DIR = 1 << 7
_MAKE_REG = 1 << 8
_MAKE_SOCK = 1 << 9
_MAKE_FIFO = 1 << 10
_MAKE_BLOCK = 1 << 11
_MAKE_SYM = 1 << 12
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_IOCTL_DEV = 1 << 15  # ABI 5 (not a write: left alone)
# Scopes (ABI 6).
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
_SCOPE_SIGNAL = 1 << 1

_WRITES_V1 = (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG | _MAKE_SOCK
              | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class LandlockUnavailable(OSError):
    """The kernel has no (usable) Landlock."""


class _RulesetAttr(ctypes.Structure):
    # Grown by ABI 4 (network) and 6 (scopes); an older kernel takes the larger struct as long
    # as what it does not know is zero.
    _fields_ = (("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64))


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def abi_version() -> int:
    """The Landlock ABI the kernel offers; raise LandlockUnavailable when none."""
    ret = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    if ret < 0:
        err = ctypes.get_errno()
        reason = "disabled at boot (lsm=)" if err == errno.EOPNOTSUPP else os.strerror(err)
        raise LandlockUnavailable(err, f"Landlock is not available: {reason}")
    return int(ret)


def _write_rights(abi: int) -> int:
    rights = _WRITES_V1
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def restrict_writes(writable: Iterable[str]) -> int:
    """Allow writes only beneath *writable* (existing paths) for this process and its
    descendants, for good. Returns the ABI used."""
    abi = abi_version()
    rights = _write_rights(abi)
    attr = _RulesetAttr(rights, 0, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    ruleset = _check(_libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr),
                                   ctypes.c_uint32(0)), "landlock_create_ruleset")
    try:
        for path in writable:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
                # Directory-only rights on a file would be EINVAL.
                allowed = rights if is_dir else rights & (_WRITE_FILE | _TRUNCATE)
                rule = _PathBeneathAttr(allowed, fd)
                _check(_libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule),
                                     ctypes.c_uint32(0)), f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _check(_libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi
