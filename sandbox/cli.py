"""The ``guard`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from guardfs.errors import ManifestError, MountError
from guardfs.events import EventLog
from guardfs.manifest import Manifest, load_manifest, parse_manifest
from guardfs.policy import PathPolicy
from sandbox.exitcodes import Exit

__all__ = ["main"]

log = logging.getLogger("guard")

# Without --manifest, `guard mount` serves a read-only view (git internals stay writable).
_READ_ONLY = """
[task]
id = "read-only"
goal = "Read the workspace; no --manifest was given, so nothing outside .git/ is writable."
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(Exit.USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="guard",
        description="Keep an autonomous coding agent inside the scope of its task.",
        epilog=(
            "exit statuses: 0 ok, 64 bad usage, 65 invalid manifest, "
            "69 FUSE unavailable, 70 internal error"
        ),
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every denial to stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = sub.add_parser(
        "check",
        help="validate a scope manifest and print the compiled policy",
        description=(
            "Validate MANIFEST and print the compiled policy. Exits 0 when valid, 65 with a "
            "message naming the file, the key and the reason when not. Schema: [task] id, goal; "
            "[paths] allowed, forbidden (gitignore-style patterns), git_internals; [limits] "
            "max_files, max_rewrites, window_steps, max_window_tokens, "
            "max_tokens_without_progress, max_consecutive_failures, max_identical_calls, "
            "stagnation_similarity, idle_timeout_s, max_steps."
        ),
    )
    check.add_argument("manifest", metavar="MANIFEST", help="path of the TOML manifest")

    mount = sub.add_parser(
        "mount",
        help="serve a guarded mount of BACKING at MOUNTPOINT in the foreground",
        description=(
            "Mount BACKING at MOUNTPOINT through guardfs and serve until SIGINT/SIGTERM or an "
            "external unmount (fusermount3 -u), then unmount and exit 0. Without --manifest "
            "the mount is read-only except git's internals."
        ),
    )
    mount.add_argument("--manifest", metavar="M", help="scope manifest (TOML)")
    mount.add_argument("--events", metavar="FILE", help="append events as JSON lines to FILE")
    mount.add_argument(
        "--cache-timeout", metavar="S", type=float, default=60.0,
        help="seconds the kernel may cache entries and attributes (default 60)",
    )
    mount.add_argument("backing", metavar="BACKING", help="the real workspace directory")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT", help="where the guarded view appears")

    sub.add_parser(
        "demo",
        help="play a drifting agent against a real guarded mount of a sample repository",
        description="Build a sample repository, guard it, and show what a drifting agent meets.",
    )
    return p


def _manifest(path: str | None) -> Manifest:
    return load_manifest(path) if path else parse_manifest(_READ_ONLY, "<built-in read-only>")


def _cmd_check(args: argparse.Namespace) -> int:
    print(PathPolicy(load_manifest(args.manifest)).describe())
    return Exit.OK


def _cmd_mount(args: argparse.Namespace) -> int:
    manifest = _manifest(args.manifest)
    for what, path in (("BACKING", args.backing), ("MOUNTPOINT", args.mountpoint)):
        if not os.path.isdir(path):
            print(f"guard mount: {what} {path} is not a directory", file=sys.stderr)
            return Exit.USAGE
    if os.path.realpath(args.backing) == os.path.realpath(args.mountpoint):
        print("guard mount: BACKING and MOUNTPOINT must differ", file=sys.stderr)
        return Exit.USAGE
    if args.cache_timeout < 0:
        print("guard mount: --cache-timeout must be >= 0", file=sys.stderr)
        return Exit.USAGE
    try:
        from guardfs.fs import GuardFS  # needs libfuse
        from guardfs.mount import serve
    except ImportError as err:
        raise MountError(f"libfuse 3 is not usable ({err}); install fuse3 and libfuse3-3") from err
    events = EventLog(args.events)
    try:
        fs = GuardFS(args.backing, manifest, events, cache_timeout=args.cache_timeout)
        os.umask(0)  # the kernel already applied the caller's umask to every mode we get
        serve(fs, args.mountpoint, on_ready=lambda: log.info("serving %s at %s", args.backing, args.mountpoint))
    finally:
        events.close()
    return Exit.OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``guard``; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="guard: %(message)s",
    )
    try:
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "demo":
            from sandbox.demo import run_demo

            return run_demo()
        return _cmd_mount(args)
    except ManifestError as err:
        print(f"guard: {err}", file=sys.stderr)
        return Exit.DATAERR
    except MountError as err:
        print(f"guard: {err}", file=sys.stderr)
        return Exit.UNAVAILABLE
    except Exception:
        log.exception("internal error")
        return Exit.SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
