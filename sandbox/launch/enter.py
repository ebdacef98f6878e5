"""The last step into the sandbox: Landlock and no_new_privs, the guard's seccomp filter
(:mod:`sandbox.launch.seccomp`: connects, datagram sockets, io_uring, and directory removals
with ``--removals``) handed to the guard over ``--filter FD``, then exec the agent.

Run by ``guard run`` as the command inside bubblewrap (bubblewrap itself needs to mount,
which a Landlock-restricted process may not):

    python -m sandbox.launch.enter --write /workspace --write /tmp --filter FD [--removals] -- CMD ARGS...

Without ``--filter`` (only the tests of this step leave it out) no filter is installed. With
it, the agent starts only once the guard holds the filter: else exit 69, saying why.
"""

from __future__ import annotations

import argparse
import os
import sys

from sandbox.doctor import POINTER
from sandbox.launch.landlock import LandlockUnavailable, restrict_writes
from sandbox.launch.seccomp import hand_over


def main(argv: list[str] | None = None) -> int:
    """Restrict, then exec; returns only on failure (exit 69 or 127)."""
    parser = argparse.ArgumentParser(prog="guard-enter")
    parser.add_argument("--write", action="append", default=[], help="a directory writes may land beneath")
    parser.add_argument("--filter", type=int, metavar="FD",
                        help="a socket to send the guard the listener of its seccomp filter")
    parser.add_argument("--removals", action="store_true",
                        help="the filter hands directory removals to the guard too")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("guard: no command to run", file=sys.stderr)
        return 64
    try:
        restrict_writes([p for p in args.write if os.path.exists(p)])
    except LandlockUnavailable as err:
        print(f"guard: refusing to start the agent: {err.strerror}; pass --no-isolation to run without "
              f"(then nothing but the mount's own rules stops writes outside the workspace). {POINTER}",
              file=sys.stderr)
        return 69
    if args.filter is not None and (why := hand_over(args.filter, args.removals)) is not None:
        # After no_new_privs, which a filter needs. Without it the host's unix sockets would
        # be in the agent's reach: no start.
        print(f"guard: refusing to start the agent: the guard's seccomp filter is not in place ({why}); "
              "it keeps the host's unix sockets out of the sandbox's reach. It needs a kernel with "
              "seccomp user notification (Linux >= 5.9, x86_64 or aarch64); pass --no-isolation to run "
              f"without a sandbox at all. {POINTER}", file=sys.stderr)
        return 69
    try:
        os.execvp(command[0], command)  # noqa: S606 - exec'ing the agent is this module's job
    except OSError as err:
        print(f"guard: cannot run {command[0]}: {err.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
