"""What a process means by looking up a forbidden name: the system call it is blocked in.

A FUSE lookup says only "resolve this name"; ``stat``, ``access``, ``open`` and ``execve``
all begin with one. The caller's thread is asleep inside its system call while the guard
answers, so ``/proc/<tid>/syscall`` names that call and its arguments (the kernel lets a
process that may ptrace the caller read it: the guard runs the agent, as its parent or as
root). A lookup whose call only asks about the name (stat, access, listxattr, an
``O_PATH`` open, chdir) touches no content; any other call (open for reading or writing,
execve, readlink, getxattr, unlink, rename, chmod, ...) means to read or change what the
name holds. Unknown calls and callers the guard cannot see count as contact: the rule
fails toward the breaker.

The numbers are those of the native 64-bit ABI. On x86_64 a 64-bit process can also enter
the kernel through the i386 ABI (``int 0x80``), whose numbers mean other calls (i386 301,
``unlinkat``, reads as x86_64 ``fanotify_mark``); ``/proc/<tid>/syscall`` does not say
which ABI, so a call that would be metadata counts only if the instruction before the
caller's program counter is ``syscall`` (``0f 05``). (An AMD CPU also takes ``syscall``
from a 32-bit code segment; that residual is in SECURITY.md.)
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

__all__ = ["CONTACT_UNKNOWN", "Intent", "lookup_intent"]


@dataclass(frozen=True, slots=True)
class Intent:
    """The call behind a lookup: its name (for events) and whether it reaches content."""

    call: str
    contact: bool


#: The caller could not be observed (gone, or not ours to see): counted as contact.
CONTACT_UNKNOWN = Intent("unknown", True)

_O_PATH = 0o10000000  # the same on every Linux architecture guardfs runs on
_O_DIRECTORY = {"x86_64": 0o200000, "aarch64": 0o40000}

# Per architecture: system calls that only ask about a name (no content read or changed).
# Numbers from the kernel's syscall tables (arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h for arm64).
_METADATA: dict[str, dict[int, str]] = {
    "x86_64": {
        4: "stat", 6: "lstat", 21: "access", 80: "chdir", 137: "statfs", 161: "chroot",
        194: "listxattr", 195: "llistxattr", 254: "inotify_add_watch", 262: "newfstatat",
        269: "faccessat", 301: "fanotify_mark", 303: "name_to_handle_at", 332: "statx",
        428: "open_tree", 439: "faccessat2", 465: "listxattrat",
    },
    "aarch64": {
        11: "listxattr", 12: "llistxattr", 27: "inotify_add_watch", 43: "statfs", 48: "faccessat",
        49: "chdir", 51: "chroot", 79: "newfstatat", 263: "fanotify_mark", 264: "name_to_handle_at",
        291: "statx", 428: "open_tree", 439: "faccessat2", 465: "listxattrat",
    },
}
# Opens: system call number → index of the flags argument (O_PATH opens are metadata).
_OPENS: dict[str, dict[int, tuple[str, int]]] = {
    "x86_64": {2: ("open", 1), 257: ("openat", 2)},
    "aarch64": {56: ("openat", 2)},
}
# Names of the common contact calls, for events (any other number is "syscall <n>").
_CONTACT_NAMES: dict[str, dict[int, str]] = {
    "x86_64": {
        59: "execve", 76: "truncate", 82: "rename", 83: "mkdir", 84: "rmdir", 85: "creat",
        86: "link", 87: "unlink", 88: "symlink", 89: "readlink", 90: "chmod", 92: "chown",
        94: "lchown", 188: "setxattr", 189: "lsetxattr", 191: "getxattr", 192: "lgetxattr",
        197: "removexattr", 198: "lremovexattr", 260: "fchownat", 263: "unlinkat",
        264: "renameat", 265: "linkat", 267: "readlinkat", 268: "fchmodat", 280: "utimensat",
        316: "renameat2", 322: "execveat", 437: "openat2", 464: "getxattrat",
    },
    "aarch64": {
        5: "setxattr", 6: "lsetxattr", 8: "getxattr", 9: "lgetxattr", 14: "removexattr",
        34: "mkdirat", 35: "unlinkat", 37: "linkat", 38: "renameat", 45: "truncate",
        53: "fchmodat", 54: "fchownat", 78: "readlinkat", 88: "utimensat", 221: "execve",
        276: "renameat2", 281: "execveat", 437: "openat2", 464: "getxattrat",
    },
}
_ARCH = platform.machine()


def lookup_intent(tid: int, arch: str = _ARCH) -> Intent:
    """The intent of thread *tid*'s current system call (see the module's docstring)."""
    if tid <= 0 or arch not in _METADATA:
        return CONTACT_UNKNOWN
    try:
        with open(f"/proc/{tid}/syscall", "rb") as f:
            fields = f.read(512).split()
    except OSError:
        return CONTACT_UNKNOWN
    intent = classify(fields, arch)
    if not intent.contact and arch == "x86_64" and not _entered_by_syscall(tid, fields):
        return Intent(f"{intent.call} (not the 64-bit ABI)", True)
    return intent


def _entered_by_syscall(tid: int, fields: list[bytes]) -> bool:
    """Whether thread *tid* entered its current call by the x86_64 ``syscall`` instruction
    (the two bytes before its program counter, the last field of *fields*)."""
    try:
        pc = int(fields[8], 16)
        fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except (IndexError, ValueError, OSError):
        return False
    try:
        return os.pread(fd, 2, pc - 2) == b"\x0f\x05"
    except (OSError, OverflowError):
        return False
    finally:
        os.close(fd)


def classify(fields: list[bytes], arch: str = _ARCH) -> Intent:
    """The intent of one ``/proc/<tid>/syscall`` line, split into *fields*."""
    try:
        nr = int(fields[0])
    except (IndexError, ValueError):
        return CONTACT_UNKNOWN  # "running", or not in a system call
    name = _METADATA[arch].get(nr)
    if name is not None:
        return Intent(name, False)
    opened = _OPENS[arch].get(nr)
    if opened is not None:
        call, index = opened
        try:
            flags = int(fields[1 + index], 16)
        except (IndexError, ValueError):
            return Intent(call, True)
        if flags & _O_PATH:
            return Intent(f"{call}(O_PATH)", False)
        mode = ("read", "write", "read-write", "read-write")[flags & os.O_ACCMODE]
        what = "directory" if flags & _O_DIRECTORY[arch] else mode
        return Intent(f"{call}({what})", True)
    return Intent(_CONTACT_NAMES[arch].get(nr, f"syscall {nr}"), True)
