"""Open flags pyfuse3 cannot set: the kernel's directory-listing cache and no FLUSH on close,
and directories listed without OPENDIR.

:mod:`guardfs._fusereply` (C, built with the package) replaces libfuse's ``fuse_reply_open``
for pyfuse3 and reads the flags from the top byte of the file handle; :func:`handle` puts
them there. It must be loaded with RTLD_GLOBAL before pyfuse3 first replies to an open, so
:func:`load` runs when the ``guardfs`` package is imported (half a millisecond).

Directories: the module also wraps the directory operations pyfuse3 registers, so that a
request the kernel sends without a handle (after OPENDIR answered ENOSYS, it sends none and
caches every listing) carries the directory's inode as its handle (:func:`dirs_by_inode`).

No flag is asked for until the module has seen a reply pass through it (:func:`active`): a
handle with a flag in it must never reach the kernel, which would hand it back to us as is.
Without the module (a build without a C compiler) every directory listing and close goes to
the filesystem, as pyfuse3 alone does: slower, the same answers.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

__all__ = ["CACHE_DIR", "NOFLUSH", "active", "applied", "dirs_by_inode", "handle", "load", "loaded_first"]

log = logging.getLogger(__name__)

#: Cache this directory's listing in the kernel (FOPEN_CACHE_DIR, with FOPEN_KEEP_CACHE).
CACHE_DIR = 1
#: Send no FLUSH when a descriptor of this file is closed (FOPEN_NOFLUSH).
NOFLUSH = 2
_SHIFT = 56

_module: ModuleType | None = None
_active = False
_first = False


def load() -> None:
    """Load the C module into the global symbol scope (once; a missing module is no error)."""
    global _module, _first  # noqa: PLW0603 - one process-wide library, loaded once
    if _module is not None:
        return
    # pyfuse3 binds fuse_reply_open when it is loaded: loaded before this, it never calls us
    # (and active() stays false). sandbox imports guardfs first for that reason.
    _first = "pyfuse3" not in sys.modules
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from guardfs import _fusereply
    except ImportError as err:
        log.debug("guardfs._fusereply is not available (%s): no kernel listing cache", err)
        return
    finally:
        sys.setdlopenflags(flags)
    if (_fusereply.FLAG_SHIFT, _fusereply.CACHE_DIR, _fusereply.NOFLUSH) != (_SHIFT, CACHE_DIR, NOFLUSH):
        raise ImportError("guardfs._fusereply was built from another version of guardfs: reinstall guardfs")
    _module = _fusereply


def loaded_first() -> bool:
    """Whether the C module was loaded, and before pyfuse3 (so that pyfuse3 will call it)."""
    return _module is not None and _first


def active() -> bool:
    """Whether pyfuse3's replies pass through the C module (proven by one that did)."""
    global _active  # noqa: PLW0603 - true once, for the process
    if not _active and _module is not None:
        _active = _module.seen() > 0
    return _active


def dirs_by_inode() -> bool:
    """Whether the mounted session's directory requests name their inode when the kernel
    sends no handle (see guardfs/_fusereply.c): then OPENDIR answers ENOSYS, and every
    directory handle guardfs is given is an inode."""
    return _module is not None and _module.dirs_by_inode()


def handle(fh: int, flags: int) -> int:
    """*fh* asking for *flags* in the reply, when the C module is there to take them off."""
    return fh | flags << _SHIFT if active() else fh


def applied() -> int:
    """How many replies carried a flag to the kernel (for tests and benchmarks)."""
    return 0 if _module is None else int(_module.applied())
