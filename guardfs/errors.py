"""The one exception root of guardfs and the errors a user can meet."""

from __future__ import annotations


class GuardfsError(Exception):
    """Root of every error guardfs raises on purpose."""


class ManifestError(GuardfsError):
    """A scope manifest that cannot be used; names the file, each bad key and why."""

    def __init__(self, path: str, problems: list[tuple[str, str]]) -> None:
        self.path = path
        self.problems = problems
        lines = [f"{path}: {key}: {reason}" if key else f"{path}: {reason}" for key, reason in problems]
        super().__init__("invalid manifest\n" + "\n".join(lines))


class MountError(GuardfsError):
    """The guarded mount cannot be set up (no /dev/fuse, no libfuse, bad mountpoint)."""
