"""The ``guard`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from guardfs.errors import CantCreateError, GuardError, MountError, UnavailableError, UsageError
from sandbox.agents.fasthook import VERSION, GuardClientError
from sandbox.agents.registry import AGENTS, FORMATS, HOOKED, detect
from sandbox.exitcodes import Exit

if TYPE_CHECKING:
    from guardfs.events import EventLog
    from guardfs.manifest import Manifest

# The manifest, policy and FUSE modules (pydantic, pathspec, libfuse) are imported by the
# commands that need them: `guard hook` runs before every tool call and must start fast.

__all__ = ["main"]

# The manifest's sections, for help texts (guardfs.schema generates the keys; a test keeps
# these names in step with the model without importing pydantic here).
_SECTION_NAMES = ("task", "paths", "limits", "breaker", "sandbox", "record")
_SECTIONS = ", ".join(f"[{name}]" for name in _SECTION_NAMES)
#: guardfs.manifest.DEFAULT_MANIFEST, kept here too so that `guard hook` imports no pydantic.
DEFAULT_MANIFEST = "guard.toml"

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


def _detect(command: list[str]) -> str:
    """The agent's name for --agent, from the command's name."""
    agent = detect(command)
    return agent.name if agent is not None else "generic"


def _report_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    """``guard report``'s arguments (a single run, or --fleet)."""
    report = sub.add_parser(
        "report",
        help="an HTML page of a run (or, with --fleet, of many): outcome, changes, trips, feedback, logs",
        description="Write one self-contained HTML page (no network, no script) for the run in RUN_DIR: its exit "
                    "status and who or what stopped it, start, duration, command and scope; a diff stat of what it "
                    "changed, in and out of scope; a timeline (tokens per step, or file events over time when no "
                    "step was reported); every trip and denial, each distinct feedback message once; links to the "
                    "logs that work from wherever the page is written. With --fleet: one page (and --json) over "
                    "many runs: runs by outcome and by rule, tokens spent and the share after the first trip, "
                    "files changed in and out of scope, a link to each run's report (written when absent).",
    )
    which = report.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-dir", help="the run directory guard run printed")
    which.add_argument("--fleet", nargs="+", metavar="DIR",
                       help="run directories, directories holding them (a CI matrix's downloaded artifacts), "
                            "or their .tar/.tar.gz/.zip archives (unpacked beside the page)")
    report.add_argument("--html", metavar="FILE",
                        help="where to write the page (default: RUN_DIR/report.html; with --fleet, "
                             "guard-fleet.html here); - for stdout")
    report.add_argument("--json", metavar="FILE",
                        help="with --fleet: also write the fleet's JSON (sandbox.fleet) here; - for stdout")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="guard",
        description="Keep an autonomous coding agent inside the scope of its task.",
        epilog=(
            "exit statuses, the same for every verb: 0 ok, 64 bad usage, 65 invalid manifest or a "
            "message the guard rejected, 69 FUSE, isolation or the guard unavailable (no guard "
            "answers at the run directory), 70 internal error, 73 an output file cannot be written, "
            "75 the run was stopped"
        ),
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every denial to stderr (also after the verb)")
    p.add_argument("--version", action="version", version=f"guard (guardfs) {_version()}")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)

    check = sub.add_parser(
        "check",
        help="validate a scope manifest and lint it against the workspace",
        description=(
            f"Validate MANIFEST (default: {DEFAULT_MANIFEST} at the workspace's top level) and lint it against the "
            "workspace: patterns that match nothing, negations that take nothing out, allowed patterns that "
            "secret or protected ones void, patterns that stop at a generated tree, secrets git tracks. "
            "Prints each warning with its fix, then one line; guard -v check also prints the compiled policy. "
            "Exits 0 when valid (65 with --strict and a warning), 65 with a message naming the file, the key "
            "and the reason when not. The manifest's sections: " + _SECTIONS + "; every key with its type, "
            "default and meaning: guard schema."
        ),
    )
    check.add_argument("manifest", metavar="MANIFEST", nargs="?",
                       help=f"path of the TOML manifest (default: WORKSPACE/{DEFAULT_MANIFEST})")
    check.add_argument("--workspace", metavar="DIR", help="the workspace to lint against (default: the top level "
                       "of the git repository the current directory is in, else the current directory)")
    check.add_argument("--strict", action="store_true", help="exit 65 when there is a warning")

    schema = sub.add_parser(
        "schema",
        help="print every manifest key with its type, default and meaning",
        description="Print every key of the manifest, section by section, with its type, default and meaning, "
                    "generated from the manifest's own model.",
    )
    schema.add_argument("section", nargs="?", choices=_SECTION_NAMES, help="only this section")

    _add_init(sub)

    _add_mount(sub)

    run = sub.add_parser(
        "run",
        help="run an agent inside the guarded, isolated workspace",
        description=(
            "Mount the workspace through guardfs with the breaker daemon, then run CMD isolated "
            "(bubblewrap: PID namespace, read-only host, private /tmp; Landlock; no_new_privs) "
            "so that the workspace's own path shows the guarded mount. Without --manifest it obeys "
            "guard.toml at the workspace's top level (guard init writes one). Exit status: the agent's "
            "own, 75 when a breaker trip stopped it, 64 bad usage, 65 invalid manifest, 69 FUSE "
            "or isolation unavailable, 70 internal error."
        ),
    )
    run.add_argument("--manifest", metavar="M", help="scope manifest (TOML); default: guard.toml at the "
                     "workspace's top level, as guard init writes it")
    run.add_argument("--workspace", metavar="DIR", help="the workspace (default: the top level of the git "
                     "repository the current directory is in, else the current directory; the agent starts "
                     "in the current directory)")
    run.add_argument("--run-dir", metavar="D", help="run directory (default: a new one under "
                     "$XDG_STATE_HOME/guardfs/runs, or /var/lib/guardfs/runs with --user; printed at start)")
    run.add_argument("--ci", action="store_true", help="CI mode: a terminal trip stops the agent at "
                     "once; the console gets a digest instead of the raw output")
    run.add_argument("--no-isolation", action="store_true", help="DANGEROUS: run the agent without "
                     "bubblewrap and Landlock (only the mount's rules then apply, and only to what "
                     "goes through it)")
    run.add_argument("--cache-timeout", metavar="S", type=float, default=60.0,
                     help="seconds the kernel may cache entries and attributes (default 60)")
    run.add_argument("--xattrs", action="store_true",
                     help="keep extended attributes on the mount (default: off; the kernel then skips the "
                     "security.capability lookup it sends before every write, and tools get EOPNOTSUPP)")
    run.add_argument("--agent", choices=[*AGENTS, "generic"],
                     help="which agent CMD is (default: from its name): sets up its hooks and parses its output")
    run.add_argument("--user", metavar="NAME", help="run the agent as this user (the guard must be root; "
                     "the devcontainer case)")
    run.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER, help="the agent's command, after --")

    exe = sub.add_parser(
        "exec",
        help="run one tool command quarantined: full logs, a digest on the console, its status to the breaker",
        description=(
            "Run CMD with its output recorded in full under $GUARD_RUN_DIR/exec/ and a digest "
            "(exit status, failing lines, log paths; at most 1,200 characters) on the console, "
            "and report its exit status to the guard (GUARD_SOCKET). Exits with CMD's status."
        ),
    )
    exe.add_argument("--live", action="store_true", help="also stream the output as it comes")
    exe.add_argument("command", metavar="CMD", nargs=argparse.REMAINDER, help="the command, after --")

    for name, text in (
        ("status", "print the breaker's state and the ledger of a run: live, or once it ended, from its ledger.json"),
        ("approve", "resume a run after a trip (optionally raising the limit that tripped)"),
        ("stop", "stop a run"),
        ("checkpoint", "mark a known-good point in a run"),
        ("rollback", "restore the workspace of a guard run to a restore point: the run's start, the last "
                     "one (a passing test or guard checkpoint, the default) or a labelled one; works also "
                     "after the run ended"),
    ):
        cmd = sub.add_parser(name, help=text, description=text + " (over the control socket in D).")
        cmd.add_argument("--run-dir", metavar="D", help="the run directory (default: the latest guard run "
                         "of this workspace: the git top level of the current directory, else the directory)")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the ledger as JSON")
            cmd.add_argument("--follow", action="store_true", help="print a line per change of the breaker's "
                             "state until the run ends, then its last state; exits 0")
        if name == "approve":
            cmd.add_argument("--raise", dest="raise_to", metavar="N", type=int,
                             help="new value for the limit that tripped (must be higher)")
        if name == "checkpoint":
            cmd.add_argument("--label", default="", help="a name for the checkpoint")
        if name == "rollback":
            cmd.add_argument("--to", default="last", metavar="start|last|LABEL",
                             help="the restore point: start (the run's start), last (default), or a "
                                  "checkpoint's label (its latest)")

    feed = sub.add_parser(
        "feed",
        help="send protocol messages (JSON lines on stdin) to the agent socket, print each reply",
        description="Read protocol messages, one JSON object per line, from stdin; send each to "
                    "the agent socket (GUARD_SOCKET or --socket); print each reply line. Exits 65 "
                    "if any message was rejected, 69 if the guard cannot be reached.",
    )
    feed.add_argument("--socket", metavar="PATH", help="the agent socket (default: $GUARD_SOCKET)")
    feed.add_argument("--format", choices=["protocol", *FORMATS],
                      default="protocol", help="what stdin holds: protocol messages (default), or an agent's "
                      "own output to parse into steps, tool calls and tool results")

    hook = sub.add_parser(
        "hook",
        help="the command an agent runs as its pre/post-tool hook",
        description="Read the agent's hook JSON on stdin, ask the guard (GUARD_SOCKET), and answer in the "
                    "agent's convention: exit 2 with the reason on stderr blocks the tool.",
    )
    hook.add_argument("agent", choices=list(HOOKED), help="whose hook format")

    _report_parser(sub)

    _add_doctor(sub)
    sub.add_parser(
        "demo",
        help="play a drifting agent against a real guarded mount of a sample repository",
        description="Build a sample repository, guard it, and show what a drifting agent meets.",
    )
    for verb in sub.choices.values():
        _accept_verbose(verb)
    return p


def _add_doctor(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The ``doctor`` verb's arguments."""
    doctor = sub.add_parser(
        "doctor",
        help="check what this machine gives guard (FUSE, bubblewrap, namespaces, Landlock, seccomp) and how to "
             "fix what it lacks",
        description="Try each thing guard needs from this machine, for real: /dev/fuse, fusermount3, bubblewrap, user "
                    "and mount namespaces, Landlock, seccomp user notification, the kernel, and the container it "
                    "may run in. One line per check (ok, warn or MISSING); each MISSING is followed by the one "
                    "command that fixes it. Exit 0 when nothing required is missing, 69 otherwise.",
    )
    doctor.add_argument("--json", action="store_true", help='print a JSON list of {"name", "status", "detail", '
                        '"fix"} instead')


def _add_mount(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The ``mount`` verb's arguments."""
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
    mount.add_argument(
        "--run-dir", metavar="D",
        help="run the breaker daemon: agent.sock, control.sock, ledger.json, STATE.md and "
             "events.jsonl in D (created if missing)",
    )
    mount.add_argument("--events", metavar="FILE", help="append events as JSON lines to FILE "
                       "(default with --run-dir: D/events.jsonl)")
    mount.add_argument(
        "--cache-timeout", metavar="S", type=float, default=60.0,
        help="seconds the kernel may cache entries and attributes (default 60)",
    )
    mount.add_argument("--xattrs", action="store_true",
                       help="keep extended attributes on the mount (default: off; the kernel then skips the "
                            "security.capability lookup it sends before every write, and tools get EOPNOTSUPP)")
    mount.add_argument("backing", metavar="BACKING", help="the real workspace directory")
    mount.add_argument("mountpoint", metavar="MOUNTPOINT", help="where the guarded view appears")


def _add_init(sub: argparse._SubParsersAction[_Parser]) -> None:
    """The ``init`` verb's arguments."""
    init = sub.add_parser(
        "init",
        help="write a commented guard.toml for a task, from what the repository holds",
        description=(
            "Write guard.toml at the top level of the repository the current directory is in (else the "
            "current directory): the task (GOAL, an id derived from it), where the agent may write "
            "(--allow), the secrets found there (.env files, keys, credentials; never read), the "
            "protected paths present (CI workflows, migrations, lockfiles; read, never written) and the "
            "generated trees of the ecosystems found, each section commented. Validated as guard check "
            "validates; never replaces an existing guard.toml without --force. Then: guard run -- AGENT."
        ),
    )
    init.add_argument("--allow", metavar="PATTERN", action="append", default=[],
                      help="where the agent may write: a gitignore-style pattern relative to the repository's "
                           "top level, like src/checkout/ (repeat for more; none: a read-only task)")
    init.add_argument("--id", dest="task_id", metavar="ID", help="the task's id (default: from GOAL's words)")
    init.add_argument("--force", action="store_true", help="replace an existing guard.toml")
    init.add_argument("--workspace", metavar="DIR", help="the repository (default: as guard run finds it)")
    init.add_argument("goal", metavar="GOAL", help="what the agent is to do, in a sentence")


def _version() -> str:
    """The installed distribution's version (its metadata, as pip shows it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("guardfs")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _accept_verbose(verb: argparse.ArgumentParser) -> None:
    """-v after the verb as before it (guard run -v as guard -v run), unless the verb gives
    -v a meaning of its own. SUPPRESS: absent after the verb, it leaves guard -v's value alone."""
    if "-v" not in verb._option_string_actions:
        verb.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="log every denial to stderr (as guard -v VERB)")


def _manifest(path: str | None) -> Manifest:
    from guardfs.manifest import load_manifest, parse_manifest

    return load_manifest(path) if path else parse_manifest(_READ_ONLY, "<built-in read-only>")


def _cmd_check(args: argparse.Namespace) -> int:
    from guardfs.lint import lint
    from guardfs.manifest import is_outside_secret, load_manifest
    from guardfs.policy import PathPolicy
    from sandbox.launch.runs import git_history_cache
    from sandbox.launch.workspace import workspace_for

    workspace = workspace_for(Path.cwd(), args.workspace)
    if not workspace.is_dir():
        raise UsageError(f"workspace {workspace} is not a directory; give the workspace with --workspace DIR")
    path = Path(args.manifest) if args.manifest else workspace / DEFAULT_MANIFEST
    if not args.manifest and not path.exists():
        raise UsageError(f"no manifest: {path} does not exist (guard check reads it when no MANIFEST is given). "
                         'Write one with guard init --allow DIR... "the task\'s goal", or name one: guard check '
                         "MANIFEST")
    manifest = load_manifest(path)
    warnings = lint(manifest, workspace, git_cache=git_history_cache())  # guard run's own
    for warning in warnings:
        print(f"warning: {warning}")
    p = manifest.paths
    secrets = len([s for s in p.secret if not is_outside_secret(s)]) + len(p.forbidden)
    outside = len(p.secret) - len([s for s in p.secret if not is_outside_secret(s)])
    print(f"{path}: valid; {len(p.allowed)} allowed, {secrets} secret"
          + (f" (and {outside} outside the workspace)" if outside else "")
          + f", {len(p.protected)} protected pattern(s); {len(warnings)} warning(s)"
          + (" (--strict: refused)" if warnings and args.strict else ""))
    if getattr(args, "verbose", False):  # guard -v check, or guard check -v
        print()
        print(PathPolicy(manifest).describe())
    return Exit.DATAERR if warnings and args.strict else Exit.OK


def _cmd_schema(args: argparse.Namespace) -> int:
    from guardfs.schema import schema_text

    print(schema_text(args.section))
    return Exit.OK


def _cmd_mount(args: argparse.Namespace) -> int:
    manifest = _manifest(args.manifest)
    if os.path.realpath(args.backing) == os.path.realpath(args.mountpoint):
        raise UsageError(f"BACKING and MOUNTPOINT are both {args.backing}; mount the workspace at another "
                         "(empty) directory")
    if args.cache_timeout < 0:
        raise UsageError(f"--cache-timeout must be >= 0 seconds, not {args.cache_timeout:g}")
    try:
        from guardfs.mount import check_directory, check_fuse_available, check_mountpoint, serve  # needs libfuse
        from sandbox.launch.runs import git_history_cache
        from sandbox.session import Session
    except ImportError as err:
        raise MountError(f"libfuse 3 is not usable ({err}); install fuse3 and libfuse3-3") from err
    check_directory("BACKING", args.backing)
    # serve() checks these again; here before a run directory is made
    check_mountpoint(args.mountpoint)
    run_dir = Path(args.run_dir).resolve() if args.run_dir else None
    if run_dir is not None:
        from sandbox.breaker.daemon import check_socket_room

        check_socket_room(run_dir)
    check_fuse_available()
    made = run_dir is not None and not os.path.lexists(run_dir)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    from guardfs.events import EventLog

    ready: list[bool] = []  # an entry once the mount serves

    def on_ready() -> None:
        ready.append(True)
        log.info("serving %s at %s", args.backing, args.mountpoint)

    try:
        events = EventLog(args.events or (run_dir / "events.jsonl" if run_dir else None), caps=manifest.record)
        try:
            if run_dir is None:
                with Session(manifest, args.backing, events, cache_timeout=args.cache_timeout,
                             xattrs=args.xattrs, git_cache=git_history_cache()) as session:
                    _say_notices(session.notices)
                    serve(session.fs, args.mountpoint, on_ready=on_ready)
                return Exit.OK
            return _mount_with_daemon(args, manifest, events, run_dir, on_ready)
        finally:
            events.close()
    except BaseException:
        if made and not ready and run_dir is not None:  # a refused start: the run directory held nothing yet
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _say_notices(notices: list[str]) -> None:
    """What the session found at start (git's stores checked, git hidden, secrets readable
    through git under "warn"), on stderr as guard run says it."""
    for notice in notices:
        print(f"guard mount: {notice}", file=sys.stderr)


def _mount_with_daemon(args: argparse.Namespace, manifest: Manifest, events: EventLog, run_dir: Path,
                       on_ready: Callable[[], None]) -> int:
    import pyfuse3

    from guardfs.mount import serve
    from sandbox.breaker import State
    from sandbox.breaker.daemon import RunDirBusy
    from sandbox.launch.runs import git_history_cache
    from sandbox.session import Session

    session = Session(manifest, args.backing, events, run_dir=run_dir, mountpoint=args.mountpoint,
                      cache_timeout=args.cache_timeout, xattrs=args.xattrs, on_stop=pyfuse3.terminate,
                      git_cache=git_history_cache())
    _say_notices(session.notices)
    try:
        session.prepare()
    except RunDirBusy as err:
        session.close()
        print(f"guard mount: {err}", file=sys.stderr)
        return Exit.USAGE
    try:
        print(f"guard: run directory {run_dir} (agent socket {session.daemon.agent_path})", file=sys.stderr)
        serve(session.fs, args.mountpoint, companions=[session.daemon.run], on_ready=on_ready)
    finally:
        session.close()
    return Exit.TRIPPED if session.breaker.state is State.OPEN_STOPPED else Exit.OK


def _run_manifest(given: str | None, workspace: Path) -> Manifest:
    """The manifest guard run obeys: --manifest, else guard.toml at the top of *workspace*."""
    from guardfs.manifest import DEFAULT_MANIFEST, load_manifest

    if given is not None:
        return load_manifest(given)
    default = workspace / DEFAULT_MANIFEST
    if not default.exists():
        raise UsageError(f"no {DEFAULT_MANIFEST} in the workspace {workspace}, and no --manifest given; write one "
                         "with guard init --allow DIR \"GOAL\" (DIR: where the agent may write), or pass "
                         "--manifest M")
    return load_manifest(default)


def _cmd_run(args: argparse.Namespace) -> int:
    from sandbox.launch.isolation import IsolationUnavailable

    try:
        from sandbox.launch.run import SYSTEM_RUNS, RunOptions, default_run_dir, run  # needs libfuse
    except ImportError as err:
        raise MountError(f"libfuse 3 is not usable ({err}); install fuse3 and libfuse3-3") from err

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("no command given; put the agent's command after --: guard run [--manifest M] -- CMD ARGS...")
    from sandbox.launch.workspace import workspace_for

    workspace = workspace_for(Path.cwd(), args.workspace)  # the repository's top level, unless --workspace
    if not workspace.is_dir():
        raise UsageError(f"workspace {workspace} is not a directory; give the workspace with --workspace DIR")
    manifest = _run_manifest(args.manifest, workspace)
    run_dir = Path(os.path.realpath(args.run_dir)) if args.run_dir else default_run_dir(
        manifest.task.id, SYSTEM_RUNS if args.user is not None else None)
    if run_dir.is_relative_to(workspace) or workspace.is_relative_to(run_dir):
        raise UsageError(f"the run directory {run_dir} must lie outside the workspace {workspace} "
                         "(it holds the control socket); give another --run-dir")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UsageError(f"run directory {run_dir} is not empty; give a new one with --run-dir")
    from sandbox.breaker.daemon import check_socket_room

    check_socket_room(run_dir)
    if args.user is not None:
        import pwd

        try:
            pwd.getpwnam(args.user)
        except KeyError:
            raise UsageError(f"no such user {args.user!r}; give an existing user to --user") from None
        if os.geteuid() != 0:
            raise UsageError("--user needs the guard to run as root; run guard as root, or drop --user")
    options = RunOptions(manifest, workspace, run_dir, command, Path(os.path.realpath(os.getcwd())),
                         ci=args.ci, isolation=not args.no_isolation, cache_timeout=args.cache_timeout,
                         xattrs=args.xattrs, user=args.user, agent=args.agent or _detect(command))
    try:
        return run(options)
    except IsolationUnavailable as err:
        raise IsolationUnavailable(f"isolation is impossible here: {err}. Refusing to start the agent; "
                                   "--no-isolation runs it unsandboxed (dangerous).") from err


def _cmd_report(args: argparse.Namespace) -> int:
    from sandbox.report import load_run, render_html

    if args.fleet is not None:
        return _cmd_fleet(args)
    if args.json is not None:
        raise UsageError("--json goes with --fleet; a single run's JSON is its ledger.json and run.json")
    run_dir = Path(args.run_dir)
    record = load_run(run_dir)  # ReportError: a usage error naming the file
    if args.html == "-":
        sys.stdout.write(render_html(record))
        return Exit.OK
    out = Path(args.html) if args.html else run_dir / "report.html"
    _write_out(out, render_html(record, out))
    print(out)
    return Exit.OK


def _cmd_fleet(args: argparse.Namespace) -> int:
    from sandbox.fleet import fleet, render_fleet_html

    if args.html == "-" and args.json == "-":
        raise UsageError("--html - and --json - cannot both go to stdout: give one of them a FILE")
    out = None if args.html == "-" else Path(args.html or "guard-fleet.html")
    data, _records = fleet([Path(d) for d in args.fleet], out)
    page = render_fleet_html(data, out)
    if out is None:
        sys.stdout.write(page)
    else:
        _write_out(out, page)
    if args.json == "-":
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif args.json is not None:
        _write_out(Path(args.json), json.dumps(data, indent=2) + "\n")
    if out is not None:
        print(out)
    return Exit.OK


def _write_out(out: Path, text: str) -> None:
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as err:
        raise CantCreateError(f"cannot write {out}: {err.strerror or err}; give a writable path with "
                              "--html FILE (or --json FILE), or - for stdout") from err


def _cmd_rollback_offline(run_dir: Path, unreachable: Exception, to: str) -> int:
    """Roll back the workspace of a run whose guard has ended to restore point *to*
    (*unreachable* says why no guard answered)."""
    from guardfs.checkpoint import rollback_offline

    marker = run_dir / "workspace"
    if not marker.exists() or not (run_dir / "checkpoint").is_dir():
        raise _no_guard(run_dir, unreachable, "nor does it hold a finished guard run to roll back")
    rollback_offline(marker.read_text().strip(), run_dir / "checkpoint", to)
    return _say_rolled_back(run_dir, to)


def _no_guard(run_dir: Path, err: Exception, more: str = "") -> UnavailableError:
    """The error every control verb gives when no guard answers in *run_dir*."""
    return UnavailableError(
        f"no guard answers in run directory {run_dir} ({err}){', ' + more if more else ''}; give the "
        "run directory guard run or guard mount printed, and check that guard is still running"
    )


def _say_rolled_back(run_dir: Path, to: str) -> int:
    """Report the last rollback of *run_dir* (to restore point *to*), naming each file it
    could not restore; exits CANTCREAT when something could not be put back."""
    from guardfs.checkpoint import last_rollback
    from guardfs.events import printable

    point = {"last": "the last checkpoint", "start": "the run's start"}.get(to, f"checkpoint {to!r}")
    done = last_rollback(run_dir / "checkpoint")
    if done is None:  # a guard of an older version: it kept no account
        print(f"restored the workspace to {point}")
        return Exit.OK
    print(f"restored {len(done.restored)} path(s) to {point}")
    for path, where in done.moved_aside.items():
        print(f"moved aside: {printable(path)} -> {printable(where)} (it stood where the restore point has "
              "something else and held bytes no restore point keeps; recover what you need from there)")
    for path in done.not_restorable:
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        print(f"NOT restored: {shown} (its pre-image would have passed [sandbox] checkpoint_max_bytes; "
              "it is left as it is)")
    if done.generated:
        shown = ", ".join(p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                          for p in done.generated[:5])
        more = f" and {len(done.generated) - 5} more" if len(done.generated) > 5 else ""
        print(f"NOT restored: generated output {shown}{more} ([paths] generated: never kept; left as it is)")
    for path, why in done.failed.items():
        print(f"NOT restored: {printable(path)}: {printable(why)}", file=sys.stderr)
    if done.failed:
        print(f"guard rollback: {len(done.failed)} path(s) could not be put back as they were at {point}; every "
              f"restore point is kept: clear what is in the way, then run guard rollback --run-dir {run_dir} "
              f"--to {to} again", file=sys.stderr)
        return Exit.CANTCREAT
    return Exit.OK


def _cmd_control(args: argparse.Namespace) -> int:
    from sandbox.breaker.client import GuardClient, GuardClientError, GuardUnreachable, control_socket_path
    from sandbox.status import latest_run, show_status, this_workspace

    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:  # the latest run of the workspace the human stands in, named so no one acts on another by mistake
        run_dir = latest_run(this_workspace())
        if args.verb != "status":
            print(f"guard: run directory {run_dir} (the latest guard run of this workspace)", file=sys.stderr)
    if args.verb == "status":
        try:
            return show_status(run_dir, as_json=args.json, follow=args.follow, out=sys.stdout)
        except GuardClientError as err:  # the guard answered, and refused the request
            raise type(err)(f"the guard in run directory {run_dir} refused status: {err}") from err
    try:
        with GuardClient(control_socket_path(run_dir)) as guard:
            if args.verb == "approve":
                reply = guard.approve(args.raise_to)
            elif args.verb == "stop":
                reply = guard.stop()
            elif args.verb == "checkpoint":
                reply = guard.checkpoint(args.label)
            else:
                reply = guard.request({"type": "rollback", "to": args.to})
    except GuardUnreachable as err:
        if args.verb == "rollback":
            return _cmd_rollback_offline(run_dir, err, args.to)  # the run is over
        raise _no_guard(run_dir, err) from err
    except GuardClientError as err:  # the guard answered, and refused the request
        raise type(err)(f"the guard in run directory {run_dir} refused {args.verb}: {err}") from err
    if args.verb == "rollback":
        return _say_rolled_back(run_dir, args.to)
    print(f"state: {reply['state']}")
    if not reply.get("allow", True) and args.verb == "approve":
        raise UsageError(reply.get("feedback", "refused"))
    return Exit.OK


def _feed_parsed(args: argparse.Namespace) -> int:
    from sandbox.agents import to_messages
    from sandbox.agents.parsers import make_parser
    from sandbox.breaker.client import GuardClient

    parser = make_parser(args.format)
    with GuardClient(args.socket) as guard:  # GuardUnreachable: 69, a rejected message: 65
        for line in sys.stdin.buffer:
            for event in parser.feed(line):
                for message in to_messages(event):
                    print(json.dumps(guard.request(message)), flush=True)
        for event in parser.finish():
            for message in to_messages(event):
                print(json.dumps(guard.request(message)), flush=True)
    return Exit.OK


def _cmd_feed(args: argparse.Namespace) -> int:
    from sandbox.breaker.client import GuardClient, GuardClientError, GuardUnreachable

    rejected = False
    if args.format != "protocol":
        return _feed_parsed(args)
    with GuardClient(args.socket) as guard:  # GuardUnreachable ends the feed: 69
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError("a message must be a JSON object")
                reply = guard.request(message)
            except GuardUnreachable:
                raise
            except (ValueError, GuardClientError) as err:  # one bad message: say so, go on
                rejected = True
                reply = {"v": VERSION, "ok": False, "error": str(err)}
            print(json.dumps(reply), flush=True)
    return Exit.DATAERR if rejected else Exit.OK


def _refuse_nested(verb: str) -> None:
    """Inside a guard run's sandbox (which has no /dev/fuse, by design) say so, rather than
    that the fuse module is missing."""
    inside = next((name for name in ("GUARD_SOCKET", "GUARD_RUN_DIR") if os.environ.get(name)), None)
    if inside is not None and not os.path.exists("/dev/fuse"):
        raise UnavailableError(
            f"guard {verb} cannot start here: this is the sandbox of a guard run ({inside} is set), "
            "which has no /dev/fuse, so no guard can be started inside another. Start it outside "
            "the sandbox, on the host; inside a run, guard exec -- CMD quarantines one tool command"
        )


#: What guard exits with when the reader of its standard output went away (``guard schema | head``):
#: 128 + SIGPIPE, the status of every tool a shell's pipeline cuts short (``yes | head``), so that
#: ``set -o pipefail`` sees guard as it sees them. Not 0: what guard printed was cut short.
EXIT_PIPE = 141


def _stdout_gone() -> bool:
    """Whether standard output is a pipe (or socket) whose reader is gone: poll says POLLERR."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``guard``; returns the exit status. A reader of its output that went away is no bug
    in guard: what is left unprinted is dropped, as Python's documentation recommends (devnull
    over stdout, so that the flush at exit fails no more), and guard exits :data:`EXIT_PIPE`."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a reader gone shows up as BrokenPipeError now
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe (a socket to a guard): a bug after all
            log.exception("internal error (a bug in guard: please report it with this traceback)")
            return Exit.SOFTWARE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="guard: %(message)s",
    )
    try:
        if args.verb in ("run", "mount"):
            _refuse_nested(args.verb)
        if args.verb == "check":
            return _cmd_check(args)
        if args.verb == "init":
            from sandbox.init import InitOptions, init

            return init(InitOptions(args.goal, args.allow, Path.cwd(), ident=args.task_id, force=args.force,
                                    workspace=args.workspace))
        if args.verb == "schema":
            return _cmd_schema(args)
        if args.verb == "doctor":
            from sandbox.doctor import main as doctor

            return doctor(as_json=args.json)
        if args.verb == "demo":
            from sandbox.demo import run_demo

            return run_demo()
        if args.verb in ("status", "approve", "stop", "checkpoint", "rollback"):
            return _cmd_control(args)
        if args.verb == "run":
            return _cmd_run(args)
        if args.verb == "exec":
            from sandbox.launch.exec import run_exec

            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise UsageError("no command given; put it after --: guard exec -- CMD ARGS...")
            return run_exec(command, live=args.live)
        if args.verb == "feed":
            return _cmd_feed(args)
        if args.verb == "report":
            return _cmd_report(args)
        if args.verb == "hook":
            from sandbox.agents.hooks import run_hook

            return run_hook(args.agent, sys.stdin.buffer.read())
        return _cmd_mount(args)
    except (GuardError, GuardClientError) as err:  # the one place an error becomes a status, for every verb
        if isinstance(err, UnavailableError) and err.machine:
            from sandbox.doctor import POINTER

            text = str(err)
            print(f"guard {args.verb}: {text}{' ' if text.endswith('.') else '. '}{POINTER}", file=sys.stderr)
        else:
            print(f"guard {args.verb}: {err}", file=sys.stderr)
        return int(err.exit_code)
    except Exception as err:
        if isinstance(err, BrokenPipeError) and _stdout_gone():
            raise  # main's: not a bug
        log.exception("internal error (a bug in guard: please report it with this traceback)")
        return Exit.SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
