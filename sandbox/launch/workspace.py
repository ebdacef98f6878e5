"""The workspace of a ``guard run``: the repository's top level, wherever in it the run starts.

A run started in a subdirectory of a repository guards the whole repository (the manifest's
patterns are relative to its top level, and ``../.env`` is the repository's own), and the agent
starts in that subdirectory inside the mount. The top level is found as git finds it, by
looking upwards for ``.git`` (a directory, or a file saying ``gitdir:``, as a linked worktree or
a submodule has), without running git: no process started on a repository the agent may have
prepared, no ``safe.directory`` refusal for a checkout of another user, and no dependency on git
being installed. Like git, the search stops at a filesystem boundary.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["repository_top", "workspace_for"]


def _is_git_dir_entry(path: Path) -> bool:
    """Whether *path* is a ``.git`` git would take: a directory holding ``HEAD``, or a gitfile."""
    try:
        if path.is_dir():
            return (path / "HEAD").is_file()
        if path.is_file():
            with open(path, "rb") as f:
                return f.read(8) == b"gitdir: "
    except OSError:
        return False
    return False


def repository_top(start: Path) -> Path | None:
    """The top level of the git repository *start* (a real directory path) lies in, or None."""
    here = start
    device = os.stat(here).st_dev
    while True:
        if _is_git_dir_entry(here / ".git"):
            return here
        parent = here.parent
        if parent == here:
            return None
        try:
            if os.stat(parent).st_dev != device:  # git's GIT_DISCOVERY_ACROSS_FILESYSTEM default
                return None
        except OSError:
            return None
        here = parent


def workspace_for(cwd: Path, given: str | None) -> Path:
    """The workspace of a run started in *cwd*: *given* (``--workspace``) when there is one, else
    the top level of the repository *cwd* is in, else *cwd* itself. A real path."""
    if given is not None:
        return Path(os.path.realpath(given))
    real = Path(os.path.realpath(cwd))
    return repository_top(real) or real
