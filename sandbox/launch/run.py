"""``guard run``: the guarded mount, the breaker daemon and the agent, in one trio loop.

Order of things: the run directory; a private mount namespace (as root); the mount of the
workspace at ``RUN_DIR/mnt``; the daemon's sockets; then the agent inside bubblewrap with
the mount over the workspace's own path. The guard pumps the agent's output into the
quarantine logs, watches the breaker (freezing or stopping the tree on a terminal trip) and,
when the agent ends, unmounts and prints a summary.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import time
import traceback
import tty
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import pyfuse3
import trio

from guardfs.accounting import WriteAccounting
from guardfs.errors import GuardError, UsageError
from guardfs.events import EventLog, printable
from guardfs.harvest import harvest, remove_tree
from guardfs.manifest import Manifest, outside_secrets
from guardfs.mount import check_fuse_available, init_mount, keepalive, mount_options
from guardfs.rules import Rule
from sandbox.agents import Event, to_messages
from sandbox.agents.hooks import AGENT_STATE, agent_state, compiled_helper, launch
from sandbox.agents.registry import AGENTS, HOOKED
from sandbox.breaker import Breaker, Effect, Effects, State
from sandbox.breaker.client import control_socket_path
from sandbox.breaker.daemon import SOCKET_PATH_MAX, Daemon
from sandbox.breaker.ledger import write_ledger
from sandbox.exitcodes import Exit
from sandbox.launch.capabilities import require as require_capabilities
from sandbox.launch.console import LiveConsole
from sandbox.launch.facts import diff_stat, record_end, record_start
from sandbox.launch.inject import MidRunBinder
from sandbox.launch.install import Installation, installation, resolve_command, reveal
from sandbox.launch.isolation import (
    SANDBOX_RUN_DIR,
    HostMasks,
    bwrap_argv,
    host_secrets,
    mount_tmpfs,
    private_mount_namespace,
    probe,
    reachable_by,
    system_entry,
    unbind,
    visible_secrets,
)
from sandbox.launch.lanes import LaneStage, plan_lanes
from sandbox.launch.native import MidRunRules, NativeStage, plan_native, strip_set_id
from sandbox.launch.quarantine import Recorder, console, digest
from sandbox.launch.runs import (
    SYSTEM_RUNS,
    claim_run_dir,
    git_history_cache,
    live_run_dirs,
    registered,
    remove_stale_stages,
    stage_prefix,
    user_runs,
)
from sandbox.launch.sockets import HostSocket, SocketJudge, mount_device, named_sockets, serve_filter
from sandbox.launch.supervisor import ProcessTree, Spawner, wait_exit
from sandbox.session import Session

__all__ = ["BASE_ENV", "SYSTEM_RUNS", "RunOptions", "agent_environment", "default_run_dir", "run", "terminal_action"]


@dataclass
class RunOptions:
    """What ``guard run`` was asked to do."""

    manifest: Manifest
    workspace: Path
    run_dir: Path
    command: list[str]
    cwd: Path
    ci: bool = False
    isolation: bool = True
    cache_timeout: float = 60.0
    xattrs: bool = False  # extended attributes on the mount
    user: str | None = None  # run the agent as this user (the guard stays root)
    agent: str = "generic"  # a name in sandbox.agents.registry.AGENTS (hooks, output parsing), or generic


@dataclass
class _Outcome:
    status: int | None = None
    tripped: State | None = None
    interrupted: int | None = None
    notes: list[str] = field(default_factory=list)
    tree: ProcessTree | None = None  # the agent's, once started
    recorders: list[Recorder] = field(default_factory=list)  # the agent's logs, for the summary
    binder: MidRunBinder | None = None  # binds generated trees made during the run, once the agent runs
    failure: dict[str, str] | None = None  # the guard's own defect: what it was, where its traceback is
    stop_on_terminal: bool = True  # a terminal trip stops the run; else it freezes the agent (terminal_action)
    console: LiveConsole | None = None  # the lines of denials and trips on the guard's stderr
    # [sandbox] unix_sockets, as found at the start: the host's sockets and abstract names the agent may reach
    sockets: tuple[list[HostSocket], list[bytes]] = field(default_factory=lambda: ([], []))
    left: list[str] = field(default_factory=list)  # what the agent left in guard exec's stage, not kept as it was

    def recorder(self, log: Path, echo: BinaryIO | None, cap: int) -> Recorder:
        """A new quarantine log of the agent's, kept for the summary."""
        self.recorders.append(Recorder(log, echo, cap))
        return self.recorders[-1]


def default_run_dir(task_id: str, base: Path | None = None) -> Path:
    """A fresh directory under *base* (default: the user's state directory), the task's id in
    its name cut so that the control socket's path in it still fits a unix socket (guard init's
    ids from a goal are long, and so are homes: the bind failed as an internal error)."""
    base = base or user_runs()
    stamp, pid = time.strftime("%Y%m%d-%H%M%S"), os.getpid()
    room = SOCKET_PATH_MAX - len(os.fsencode(control_socket_path(base / f"{stamp}--{pid}")))
    return base / f"{stamp}-{task_id[:max(room, 1)].rstrip('-.')}-{pid}"


def _say(text: str) -> None:
    # A terminal in raw mode (an interactive agent's pty) does not return the carriage itself.
    end = "\r\n" if sys.stderr.isatty() else "\n"
    print(f"guard: {text}".replace("\n", end), file=sys.stderr, end=end, flush=True)


def run(opts: RunOptions) -> int:
    """Run the agent under guard; returns the exit status. A start refused before the mount
    was up (a secret git tracks, a busy run directory, no mount) leaves no run directory
    behind that it made: it held nothing yet."""
    bwrap = _sandbox_tool(opts)  # a usage error is said before anything about the machine
    _check_command(opts)  # the same: before the mount
    check_fuse_available()
    sockets = _unix_sockets(opts) if bwrap is not None else ([], [])  # a manifest error: before the mount
    made = not os.path.lexists(opts.run_dir)
    started: list[bool] = []
    try:
        return _run(opts, bwrap, started, sockets)
    except BaseException:
        if made and not started:
            shutil.rmtree(opts.run_dir, ignore_errors=True)
        raise


def _unix_sockets(opts: RunOptions) -> tuple[list[HostSocket], list[bytes]]:
    """``[sandbox] unix_sockets``, ``~`` being the agent's home; ManifestError for one that is
    not a socket now."""
    home = pwd.getpwnam(opts.user).pw_dir if opts.user is not None else os.environ.get("HOME") or str(Path.home())
    return named_sockets(opts.manifest.sandbox.unix_sockets, home, str(opts.workspace.resolve()))


def _run(opts: RunOptions, bwrap: str | None, started: list[bool],
         sockets: tuple[list[HostSocket], list[bytes]] = ([], [])) -> int:
    """:func:`run`, from its run directory on; *started* gets an entry once the mount is up."""
    run_dir = opts.run_dir
    claim_run_dir(run_dir)  # mode 000 as root: out of every sandbox's reach (sandbox.launch.runs)
    # What the agent's side must reach (the mount, the agent socket, the staged lanes) lives,
    # as root, in a staging directory under /tmp that only this guard's private mount
    # namespace sees: a tmpfs mounted over an empty directory. On the host (and in any other
    # run's sandbox) it stays empty; in the sandbox /tmp is a tmpfs of its own, whatever
    # TMPDIR says; an agent of another user can traverse it (0711) to reach what is bound.
    # Unprivileged, without a namespace of our own: the run directory, as before.
    if opts.agent in HOOKED and opts.user is None:
        compiled_helper()  # built (once per machine) before the mount is up, not in its loop
    stage, private = _stage(opts)
    mnt = stage / "mnt"
    mnt.mkdir(exist_ok=True)
    _say_where(opts)
    stop_on_terminal = _say_terminal_action(opts)
    record_start(run_dir, opts.command, opts.cwd, opts.workspace, opts.agent, opts.ci)  # for guard report
    events = EventLog(run_dir / "events.jsonl", caps=opts.manifest.record)
    with open(run_dir / "workspace", "w", opener=lambda p, f: os.open(p, f, 0o600)) as marker:
        marker.write(str(opts.workspace))  # for an offline guard rollback
    session = Session(opts.manifest, opts.workspace, events, run_dir=run_dir, agent_path=stage / "agent.sock",
                      checkpoints=True, cache_timeout=opts.cache_timeout, xattrs=opts.xattrs,
                      # the agent's own files in the workspace (the agents' table)
                      agent_files=AGENTS[opts.agent].own_files if opts.agent in AGENTS else (),
                      agent_caches=AGENTS[opts.agent].own_caches if opts.agent in AGENTS else (),
                      git_cache=git_history_cache())
    lane_stage = LaneStage(stage)
    # Planned with the mount's own policy ("hide-git" included: a lane never shows what the mount hides).
    lane_args = _fast_lanes(opts, bwrap, lane_stage, events, session)
    native_stage = NativeStage(stage)
    native_args, planned = _native_generated(opts, bwrap, native_stage, events, private, session)
    lane_args += native_args
    outcome = _Outcome(binder=_midrun_binder(opts, bwrap, private, events, planned),
                       stop_on_terminal=stop_on_terminal, console=_live_console(events, run_dir), sockets=sockets)
    for notice in session.notices:
        _say(notice)
    if outcome.binder is not None:
        outcome.binder.attach(session.fs)
    breaker, accounting = session.breaker, session.accounting
    try:
        # No umask(0): the agent keeps the user's umask; the mount gives each node it creates
        # the mode the kernel passes (with the agent's umask applied).
        session.prepare()
        unmount = init_mount(session.fs, str(mnt), mount_options(f"guardfs:{opts.manifest.task.id}"))
        started.append(True)
        try:
            with keepalive(str(mnt)), registered(run_dir):
                outcome.failure = _serve(opts, bwrap, session, outcome, mnt, lane_args)
        finally:
            unmount()
    finally:
        if outcome.binder is not None:
            rules = outcome.binder.rules  # the scratch layer's trees never reach the host: removed with it
            _strip_set_id(opts, [t for t in rules.native_trees() if t not in rules.scratch_trees], events)
        session.close()
        events.close()
        lane_stage.cleanup()
        native_stage.cleanup()
        _after_run(stage, opts, outcome)
    status = _finish(opts, session, outcome)
    _summary(opts, breaker, accounting, events, outcome, status)
    if not private:
        _say("(unprivileged run: the mount lived in the host's mount namespace and has been removed)")
    return status


def _check_command(opts: RunOptions) -> None:
    """The agent's command is found on its PATH: else a usage error saying where it was looked
    for, before anything starts (the agent would otherwise meet 127 inside the sandbox)."""
    resolve_command(opts.command[0], _lookup_path(opts, _search_path(os.environ)), str(opts.cwd))


def _lookup_path(opts: RunOptions, search: str) -> str:
    """The PATH the agent's command is looked up on: for an agent of another user, only the
    directories that user can search, as inside the sandbox (root's own are hidden there)."""
    if opts.user is None:
        return search
    pw = pwd.getpwnam(opts.user)
    groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
    return ":".join(d for d in search.split(":") if d and reachable_by(os.path.join(d, "_"), pw.pw_uid, groups))


def _say_where(opts: RunOptions) -> None:
    """The start banner's workspace (with where in it the agent starts) and run directory."""
    inside = opts.cwd != opts.workspace and opts.cwd.is_relative_to(opts.workspace)
    _say(f"workspace {opts.workspace}" + (f" (the agent starts in {os.path.relpath(opts.cwd, opts.workspace)}/)"
                                          if inside else ""))
    _say(f"run directory {opts.run_dir}")


def _clear_stage(stage: Path, run_dir: Path, cap: int) -> list[str]:
    """Empty and remove the staging directory once the mount is gone; guard exec's logs are
    copied into the run directory, the agent's copied login is not kept. Returns what the
    summary says of what the agent left there (guardfs.harvest: all of it hostile input)."""
    notes = _keep_exec_logs(stage, run_dir, cap)
    (stage / "unreadable").unlink(missing_ok=True)
    # Copies of the user's login, and whatever the agent made beside them: not kept.
    notes += [f"not removed: {p}" for p in remove_tree(stage / AGENT_STATE)]
    _drop_stage(stage, run_dir)
    return notes


def _drop_stage(stage: Path, run_dir: Path) -> None:
    """The staging directory's mount point gone (a tmpfs of the guard's: whatever the agent
    left in it goes with it)."""
    with contextlib.suppress(OSError):
        (stage / "mnt").rmdir()
    if stage != run_dir:
        unbind(str(stage))
        with contextlib.suppress(OSError):
            stage.rmdir()


def _after_run(stage: Path, opts: RunOptions, outcome: _Outcome) -> None:
    """:func:`_clear_stage`, its notes for the summary. Nothing the agent left there may make
    the guard fail: a defect of ours that still escapes is recorded as the guard's failure
    (the ledger, STATE.md and the summary say so; exit 70), and the stage is dropped all the same."""
    try:
        outcome.left = _clear_stage(stage, opts.run_dir, opts.manifest.sandbox.log_max_bytes)
    except Exception as err:
        if outcome.failure is None:
            outcome.failure = _record_failure(opts.run_dir, err, after=outcome.status)
        with contextlib.suppress(Exception):
            remove_tree(stage / AGENT_STATE)  # the user's login copies never stay, whatever failed
        with contextlib.suppress(Exception):
            _drop_stage(stage, opts.run_dir)


def _stage(opts: RunOptions) -> tuple[Path, bool]:
    """The staging directory, and whether the guard has a private mount namespace (made
    here, before trio starts any thread)."""
    if os.geteuid() == 0:
        remove_stale_stages()
    stage = Path(tempfile.mkdtemp(prefix=stage_prefix(), dir="/tmp")) if os.geteuid() == 0 else opts.run_dir
    private = private_mount_namespace()
    if private:
        mount_tmpfs(str(stage), 0o711 if opts.user is not None else 0o700)
    else:
        os.chmod(stage, 0o755)  # noqa: S103 - the agent (the same user) reaches agent.sock
    return stage, private


def _sandbox_tool(opts: RunOptions) -> str | None:
    """bubblewrap's path; None (said aloud) with --no-isolation. Raises IsolationUnavailable,
    which the CLI turns into 69. First, as root, the capabilities the run needs
    (sandbox.launch.capabilities): without one, the run would fail midway, the agent started."""
    if opts.isolation:
        require_capabilities(opts.user)
        return probe(opts.user).bwrap
    if opts.manifest.sandbox.network == "none":
        raise UsageError('[sandbox] network = "none" needs the sandbox (its own network namespace); '
                         "drop --no-isolation, or set network = \"host\"")
    require_capabilities(opts.user)
    _say("WARNING: --no-isolation: the agent runs unsandboxed; it can write anywhere its user can, "
         "and reach the real workspace; only the mount's own rules apply to what goes through it")
    return None


#: What a guard exec log holds beyond its cap: the quarantine's marker line between head and tail.
_EXEC_LOG_SLACK = 4096


def _keep_exec_logs(stage: Path, run_dir: Path, cap: int) -> list[str]:
    """Copy guard exec's logs into RUN_DIR/exec: from the staging directory (where an agent of
    another user, who cannot reach the run directory, writes them) and from RUN_DIR/exec itself
    (an unprivileged guard's stage, or --no-isolation), moved aside first. The agent wrote all of
    it: only regular files are kept, each cut at the log cap (*cap*) and copied by its data (a
    sparse file's holes are not written out); the rest is named in the returned notes, and what
    the agent left is removed. See guardfs.harvest."""
    dest, aside = run_dir / "exec", run_dir / "exec.left"
    sources = []
    notes = [f"not removed: {p}" for p in remove_tree(aside)]  # a killed guard's
    if os.path.lexists(dest):
        os.rename(dest, aside)
        sources.append(aside)
    if stage != run_dir:
        sources.append(stage / "exec")
    for source in sources:
        kept = harvest(source, dest, cap + _EXEC_LOG_SLACK)
        notes += kept.notes()
        notes += [f"not removed: {p}" for p in remove_tree(source)]
    return notes


def _serve(
    opts: RunOptions, bwrap: str | None, session: Session, outcome: _Outcome, mnt: Path, lane_args: list[str]
) -> dict[str, str] | None:
    """The run's trio loop. A defect of ours that escapes it (a FUSE handler, the daemon, a
    pump) has stopped the agent on its way out; it is recorded, and the run ends with 70."""
    try:
        trio.run(_main, opts, bwrap, session, outcome, mnt, lane_args)
    except Exception as err:
        return _record_failure(opts.run_dir, err)
    return None


def terminal_action(opts: RunOptions, environ: Mapping[str, str] = os.environ, console_fd: int = 2
                    ) -> tuple[bool, str]:
    """Whether a terminal trip stops the run (exit 75) rather than freezing the agent for a
    human, and why (the start banner says it).

    A freeze waits for 'guard approve' or 'guard stop': worth it only when someone learns that
    the run waits. The guard says so on its stderr, so a terminal there is the sign of a human
    who reads it; stdin is not (an approval never comes through it, and a script with its
    stderr in a file may well have a terminal for stdin). --ci always stops; the manifest's
    on_terminal = "freeze" or "stop" is asked for explicitly and holds otherwise; its default,
    "auto", stops when CI is set or stderr is no terminal.
    """
    setting = opts.manifest.breaker.on_terminal
    if opts.ci:
        return True, "--ci"
    if setting != "auto":
        return setting == "stop", f'[breaker] on_terminal = "{setting}"'
    ci = environ.get("CI", "")
    if ci and ci.lower() not in ("0", "false", "no"):
        return True, (f"CI={printable(ci)[:40]} is set, nobody is there to approve "
                      '([breaker] on_terminal = "freeze" waits for guard approve instead)')
    if not os.isatty(console_fd):
        return True, ("the guard's stderr is no terminal, nobody is there to approve "
                      '([breaker] on_terminal = "freeze" waits for guard approve instead)')
    return False, "the guard's stderr is a terminal"


def _say_terminal_action(opts: RunOptions) -> bool:
    """Say at start what a terminal trip will do, and why; returns whether it stops the run."""
    stop, why = terminal_action(opts)
    _say(f"on a terminal trip the run stops (exit {int(Exit.TRIPPED)}): {why}" if stop else
         f"on a terminal trip the agent is frozen until 'guard approve' or 'guard stop' "
         f"(--run-dir {opts.run_dir}): {why}")
    return stop


def _live_console(events: EventLog, run_dir: Path) -> LiveConsole:
    """The line per denial and per trip on the guard's stderr (sandbox.launch.console)."""
    live = LiveConsole(sys.stderr, run_dir)
    events.watch(live.on_event)
    return live


def _ledger_failure(run_dir: Path, daemon: Daemon, failure: dict[str, str] | None) -> None:
    """The ledger of a run whose guard failed says so: never a plain CLOSED."""
    if failure is not None:
        write_ledger(run_dir, {**daemon.snapshot(), "guard_failure": failure})


def _record_failure(run_dir: Path, err: Exception, after: int | None = None) -> dict[str, str]:
    """Write the traceback of the guard's own failure into the run directory; say where.
    *after*: the agent had already ended, with that status (the failure came after it)."""
    path = run_dir / "guard-error.log"
    path.write_text("".join(traceback.format_exception(err)), errors="backslashreplace")
    leaf: BaseException = err
    while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:  # trio's nurseries wrap it
        leaf = leaf.exceptions[0]
    what = "stopped the agent" if after is None else f"after the agent had ended (status {after})"
    _say(f"internal error ({type(leaf).__name__}): the guard failed {what}; traceback in {path}")
    failure = {"error": type(leaf).__name__, "message": str(leaf)[:500], "traceback": str(path)}
    if after is not None:
        failure["after_agent"] = str(after)
    return failure


def _finish(opts: RunOptions, session: Session, outcome: _Outcome) -> int:
    """The run's records once it ended (the ledger of a failed guard, run.json's end); its exit status."""
    _ledger_failure(opts.run_dir, session.daemon, outcome.failure)  # after the daemon's last write
    status = _exit_status(outcome)
    try:
        record_end(opts.run_dir, status, _stopped_by(outcome, session.breaker), _diff(opts, session))
    except OSError as err:  # the run's outcome and its summary stand; the report says run.json has no end
        _say(f"run.json not completed: {err}")
    return status


def _stopped_by(outcome: _Outcome, breaker: Breaker) -> dict[str, Any]:
    """Who or what ended the run, for run.json (sandbox.launch.facts.STOP_KINDS)."""
    if outcome.failure is not None:
        return {"kind": "guard-failure", "detail": f"internal error ({outcome.failure['error']})"}
    if outcome.tripped is State.OPEN_STOPPED:
        return {"kind": "operator", "detail": "guard stop", "state": outcome.tripped.value}
    if outcome.tripped is not None:
        trips = breaker.snapshot()["trips"]
        rule = str(trips[-1]["rule"]) if trips else ""
        kind = "timeout" if rule == Rule.IDLE_TRANSPORT else "breaker"
        return {"kind": kind, "detail": f"{rule} trip", "rule": rule, "state": outcome.tripped.value}
    if outcome.interrupted is not None:
        name = signal.Signals(outcome.interrupted).name
        return {"kind": "signal", "detail": name, "signal": name}
    return {"kind": "agent", "detail": f"the agent exited with status {outcome.status}", "status": outcome.status}


def _diff(opts: RunOptions, session: Session) -> dict[str, Any]:
    """What the run changed (sandbox.launch.facts.diff_stat), or why that is not known: the
    run's outcome stands whatever this finds."""
    try:
        return diff_stat(opts.workspace, opts.run_dir / "checkpoint",
                         lambda path, is_dir: session.policy.classify(path, is_dir).scope.value)
    except (OSError, GuardError) as err:
        _say(f"no diff stat for the report: {err}")
        return {"error": str(err)}


def _exit_status(outcome: _Outcome) -> int:
    if outcome.failure is not None:
        return Exit.SOFTWARE
    if outcome.tripped is not None:
        return Exit.TRIPPED
    if outcome.interrupted is not None:
        return 128 + outcome.interrupted
    return outcome.status if outcome.status is not None else Exit.SOFTWARE


async def _main(
    opts: RunOptions, bwrap: str | None, session: Session, outcome: _Outcome, mnt: Path, lane_args: list[str]
) -> None:
    async with trio.open_nursery() as services:
        await services.start(session.daemon.run)
        services.start_soon(pyfuse3.main)
        if outcome.console is not None:
            services.start_soon(outcome.console.run)
        try:
            await _run_agent(opts, bwrap, session, outcome, mnt, lane_args)
        finally:
            services.cancel_scope.cancel()


#: What an agent of another user gets of the guard's environment, beyond [sandbox] env.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_*", "TERM", "COLORTERM", "TZ")


def agent_environment(environ: dict[str, str], allowed: list[str]) -> dict[str, str]:
    """The variables of *environ* that :data:`BASE_ENV` or *allowed* name (a trailing '*':
    a prefix), for an agent of another user: never the guard's whole environment."""
    names = [*BASE_ENV, *allowed]
    exact = {n for n in names if not n.endswith("*")}
    prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
    return {k: v for k, v in environ.items() if k in exact or k.startswith(prefixes)}


def _search_path(env: Mapping[str, str]) -> str:
    """The agent's PATH: the one it was started with (its own tools, found where they are
    installed, first), then `guard exec` and `guard hook`, which must be found inside."""
    tools = f"{Path(sys.argv[0]).resolve().parent}:{Path(sys.executable).parent}"
    return f"{env.get('PATH', '/usr/bin:/bin')}:{tools}"


def _agent_argv(
    opts: RunOptions, bwrap: str | None, daemon: Daemon, pty: bool, mnt: Path, lane_args: list[str],
    filter_fd: int | None = None, removals: bool = False, sockets: list[str] | None = None, *,
    git_masks: Sequence[str] = (),
) -> tuple[list[str], Path, dict[str, str]]:
    # An agent of another user gets an allowlist of the guard's (root's) environment; an agent
    # of the guard's own user, that user's environment as it started guard.
    env = dict(os.environ) if opts.user is None else agent_environment(dict(os.environ), opts.manifest.sandbox.env)
    env["PATH"] = _search_path(env)
    # The user's home, before an agent's state of its own may stand in for it (HOME itself, for
    # some): where its credential stores are, and what ~ means in [sandbox] readable.
    home = pwd.getpwnam(opts.user).pw_dir if opts.user is not None else env.get("HOME") or str(Path.home())
    env["GUARD_LOG_MAX_BYTES"] = str(opts.manifest.sandbox.log_max_bytes)  # guard exec's cap
    env["GUARD_HOST_EXEC_DIR"] = str(opts.run_dir / "exec")  # where guard exec's logs are on the host, for its digest
    rel = os.path.relpath(opts.cwd, opts.workspace) if opts.cwd.is_relative_to(opts.workspace) else "."
    # An agent of another user may not reach the helper built for this one: the Python hook.
    command, setup = launch(opts.agent, opts.command, compiled=opts.user is None)
    files: list[tuple[str, str]] = []
    for var, name, content in setup.files:  # the agent's settings for this run, bound read-only
        written = mnt.parent / name
        written.write_text(content)
        # 0644 whatever the umask: Gemini skips a system settings file others may write.
        written.chmod(0o644)
        files.append((str(written), f"{SANDBOX_RUN_DIR}/{name}"))
        env[var] = f"{SANDBOX_RUN_DIR}/{name}" if bwrap is not None else str(written)
    pw_agent = pwd.getpwnam(opts.user) if opts.user is not None else None
    state = agent_state(setup, mnt.parent, {**env, **({"HOME": pw_agent.pw_dir} if pw_agent else {})},
                        (pw_agent.pw_uid, pw_agent.pw_gid) if pw_agent else None)
    if state is not None and setup.state is not None:  # the agent's state of its own, bound writable
        env[setup.state[0]] = str(state)
    if bwrap is None:
        env.update(GUARD_SOCKET=str(daemon.agent_path), GUARD_RUN_DIR=str(opts.run_dir),
                   GUARD_WORKSPACE=str(mnt))
        return command, mnt / rel, env
    cwd = opts.workspace / rel
    exec_logs = mnt.parent / "exec"  # in the run directory, or the staging one for another user
    exec_logs.mkdir(mode=0o755, exist_ok=True)
    if opts.user is not None:
        pw = pwd.getpwnam(opts.user)
        os.chown(exec_logs, pw.pw_uid, pw.pw_gid)
    own_home = pwd.getpwnam(opts.user).pw_dir if opts.user is not None else None
    other_runs = live_run_dirs(opts.run_dir)
    if opts.user is not None:
        # Another live run's directory the agent's user cannot even reach needs no cover, and
        # that user's bubblewrap could not place one there (it would fail to start).
        pw = pwd.getpwnam(opts.user)
        groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
        other_runs = [d for d in other_runs if reachable_by(d, pw.pw_uid, groups)]
    if opts.agent in HOOKED and opts.user is None and (helper := compiled_helper()) is not None:
        # The hook helper lives in the user's cache (~/.cache), which the sandbox may cover (/root,
        # a home under /tmp): without this bind every hook call fails (127), which agents take as
        # "not blocked".
        files.append((str(helper), str(helper)))
    mask_file = mnt.parent / "unreadable"
    mask_file.touch(mode=0)
    mask_file.chmod(0)
    search = _lookup_path(opts, env["PATH"])
    executable = resolve_command(command[0], search, str(opts.cwd))
    installed = installation(executable, search, str(opts.workspace.resolve())) | reveal(_readable(opts, home))
    masks = host_secrets(own_home, other_runs)
    writable = [str(p) for p in _extra_writable(opts)] + ([str(state)] if state else [])
    secrets = _credential_stores(opts, home, masks, writable, installed) + _git_masks(opts, git_masks)
    argv = bwrap_argv(
        bwrap=bwrap, mountpoint=str(mnt), workspace=str(opts.workspace), run_dir=str(opts.run_dir),
        agent_socket=str(daemon.agent_path), cwd=str(cwd), command=command,
        writable=writable, pty=pty,
        entry=system_entry() if opts.user is not None else None, files=files, over_workspace=lane_args,
        exec_logs=str(exec_logs), masks=masks,
        mask_file=str(mask_file), network=opts.manifest.sandbox.network, filter_fd=filter_fd,
        removals=removals, installed=installed, secrets=secrets, sockets=sockets or [],
    )
    if opts.user is not None:
        pw = pwd.getpwnam(opts.user)
        # HOME is the user's, unless the agent's state of its own stands for it (aider's does).
        moved = state is not None and setup.state is not None and setup.state.var == "HOME"
        env.update(HOME=env["HOME"] if moved else pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        # bubblewrap then runs unprivileged, in a user namespace of its own.
        argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups", *argv]
    if pty:
        argv = ["setsid", "--ctty", *argv]  # the pty becomes the agent's controlling terminal
    return argv, Path("/"), env


def _fast_lanes(opts: RunOptions, bwrap: str | None, stage: LaneStage, events: EventLog,
                session: Session | None = None) -> list[str]:
    """bubblewrap arguments for the run's fast lanes (see sandbox.launch.lanes), said aloud and
    recorded as an event; none when the manifest declares none or there is no sandbox."""
    settings = opts.manifest.sandbox
    if not (settings.fast_lanes or settings.out_of_scope_fast_lanes):
        return []
    if bwrap is None:
        _say("fast lanes are off: they need the sandbox (not --no-isolation)")
        return []
    try:
        lanes = plan_lanes(opts.manifest, opts.workspace, policy=session.policy if session else None,
                           links=session.forbidden_links if session else None)
        argv = stage.bwrap_args(lanes, opts.workspace.resolve(), str(opts.workspace), staged=opts.user is not None)
    except OSError as err:  # a speed-up only: without it everything goes through the mount
        stage.cleanup()
        _say(f"fast lanes are off: {err}; every path goes through the mount")
        return []
    for reason in lanes.skipped:
        _say(f"fast lane left out: {printable(reason)}")
    if not lanes.trees:
        return []
    _say(f"fast lanes (read natively, read-only, not seen by the breaker): {printable(', '.join(lanes.trees))}")
    events.emit("lanes", "", "allow", trees=lanes.trees)
    return argv


def _native_generated(opts: RunOptions, bwrap: str | None, stage: NativeStage, events: EventLog,
                      private: bool = True, session: Session | None = None) -> tuple[list[str], list[str]]:
    """bubblewrap arguments binding the run's in-scope generated directories natively and
    writable (see sandbox.launch.native), said aloud and recorded as an event; and the trees
    bound. *private*: the guard can bind trees made during the run (sandbox.launch.inject)."""
    if not opts.manifest.sandbox.native_generated or bwrap is None:
        return [], []  # without the sandbox, nothing is bound: every path goes through the mount
    try:
        native = plan_native(opts.manifest, opts.workspace, policy=session.policy if session else None,
                             links=session.forbidden_links if session else None)
        argv = stage.bwrap_args(native, opts.workspace.resolve(), str(opts.workspace), staged=opts.user is not None)
    except OSError as err:  # a speed-up only: without it the trees go through the mount
        stage.cleanup()
        _say(f"native generated trees are off: {err}; they go through the mount")
        return [], []
    for reason in native.skipped:
        _say(f"generated tree left to the mount: {printable(reason)}")
    for path in native.absent:
        _say(f"generated tree {printable(path)} does not exist yet: " + (
            "made during this run, it is bound natively once made" if private else
            "made during this run, it goes through the mount (bound natively from the next run on)"))
    if not native.trees:
        return [], []
    masked = len(native.masked_files) + len(native.masked_dirs)
    # The trees' paths (as every path below) are the agent's to name, in this run or an earlier one:
    # escaped, so that no escape sequence or newline of theirs reaches the human's terminal.
    _say(f"generated trees (written natively, not seen by the breaker): {printable(', '.join(native.trees))}"
         + (f"; {masked} forbidden path(s) masked inside" if masked else ""))
    events.emit("native", "", "allow", trees=native.trees, masked=masked)
    return argv, native.trees


def _midrun_binder(opts: RunOptions, bwrap: str | None, private: bool, events: EventLog,
                   planned: list[str]) -> MidRunBinder | None:
    """What binds the generated trees made during the run (sandbox.launch.inject): only a
    guard with a private mount namespace (root) can; an unprivileged one says so once."""
    if not opts.manifest.sandbox.native_generated or bwrap is None:
        return None
    # RUN_DIR/scratch: where sandbox.session puts the scratch layer (generated output out of scope).
    rules = MidRunRules(opts.manifest, opts.workspace, planned, scratch=opts.run_dir / "scratch")
    # Its notices are one line each, naming trees the agent made: escaped whole.
    return MidRunBinder(rules, str(opts.workspace), events, lambda text: _say(printable(text)), enabled=private)


def _strip_set_id(opts: RunOptions, trees: list[str], events: EventLog) -> None:
    """Take set-user/group-ID off what the agent left in the native trees (sandbox.launch.native)."""
    for path in strip_set_id(opts.workspace.resolve(), trees):
        _say(f"{printable(path)}: set-user-ID/set-group-ID removed (left by the agent in a native generated tree)")
        events.emit("chmod", path, "deny", rule="native_generated", reason="set-user-ID/set-group-ID removed")


def _readable(opts: RunOptions, home: str) -> list[str]:
    """``[sandbox] readable``, ``~`` being the agent's *home*."""
    return [home + entry[1:] if entry == "~" or entry.startswith("~/") else entry
            for entry in opts.manifest.sandbox.readable]


def _credential_stores(opts: RunOptions, home: str, masks: HostMasks, writable: list[str],
                       installed: Installation) -> list[str]:
    """The credential stores (guardfs.manifest.outside_secrets) the sandbox would show and so
    masks, said aloud: of the agent's HOME and of its user's home in the password database."""
    try:
        own = pwd.getpwnam(opts.user).pw_dir if opts.user is not None else pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        own = home
    paths = [p for h in dict.fromkeys((home, own)) for p in outside_secrets(opts.manifest.paths, h)]
    found = visible_secrets(paths, ["/tmp", *masks.dirs], [*masks.reveal, *writable, *installed.trees],
                            str(opts.workspace))
    if found:
        _say(f"credential stores masked (a read is refused with EACCES; outside the mount, so not counted): "
             f"{', '.join(found)}")
    return found


def _git_masks(opts: RunOptions, git_dirs: Sequence[str]) -> list[str]:
    """The git directories outside the workspace that "hide-git" masks in the sandbox (a
    linked worktree's common directory, a separate git directory), said aloud; for an agent
    of another user, those it can reach (its bubblewrap could mask no other, and it cannot
    read them anyway)."""
    if opts.user is not None:
        pw = pwd.getpwnam(opts.user)
        groups = set(os.getgrouplist(pw.pw_name, pw.pw_gid))
        git_dirs = [d for d in git_dirs if reachable_by(os.path.join(d, "_"), pw.pw_uid, groups)]
    found = [d for d in git_dirs if os.path.isdir(d)]
    if found:
        _say(f"git directories outside the workspace masked (paths.forbidden_in_git = \"hide-git\"): "
             f"{printable(', '.join(found))}")
    return found


def _extra_writable(opts: RunOptions) -> list[Path]:
    """``[sandbox] writable``'s directories that exist; the start banner names the others, skipped
    (a cache the agent's tool would make, like ``~/.npm``, stays read-only until it exists)."""
    out: list[Path] = []
    missing: list[Path] = []
    for entry in opts.manifest.sandbox.writable:
        path = Path(os.path.expanduser(entry))
        (out if path.exists() else missing).append(path)
    if missing:
        names = printable(" ".join(map(str, missing)))
        _say(f"[sandbox] writable names what does not exist, so the agent cannot write there in this run: {names} "
             f"(create it before the run: mkdir -p {names})")
    return out


async def _run_agent(
    opts: RunOptions, bwrap: str | None, session: Session, outcome: _Outcome, mnt: Path, lane_args: list[str]
) -> None:
    daemon = session.daemon
    use_pty = not opts.ci and os.isatty(0) and os.isatty(1)
    echo = None if opts.ci else console()
    logs, cap = opts.run_dir, opts.manifest.sandbox.log_max_bytes
    # The spawner's thread forks the agent and outlives it: see Spawner for why no trio
    # worker thread may (bubblewrap's --die-with-parent is relative to the forking thread).
    with Spawner() as spawner, contextlib.ExitStack() as streams:
        handover, fds = _filter_socket(bwrap, streams)
        argv, cwd, env = _agent_argv(opts, bwrap, daemon, use_pty, mnt, lane_args, fds[0] if fds else None,
                                     removals=outcome.binder is not None,
                                     sockets=[named.path for named in outcome.sockets[0]],
                                     git_masks=session.git_masks)
        async with trio.open_nursery() as nursery:
            if use_pty:
                master, slave = _openpty(opts.user)
                _copy_winsize(0, slave)
                try:
                    proc = await spawner.popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                               pass_fds=fds)
                finally:
                    os.close(slave)
                (logs / "stderr.log").touch(mode=0o600)  # as the recorder makes stdout.log
                nursery.start_soon(_pump_fd, master, outcome.recorder(logs / "stdout.log", echo, cap), daemon,
                                   _Lines(opts.agent, daemon))
                nursery.start_soon(_forward_stdin, master)
            else:
                stdout, out_w = _pipe(streams, opts.user)
                stderr, err_w = _pipe(streams, opts.user)
                try:
                    proc = await spawner.popen(argv, stdin=None if not opts.ci else subprocess.DEVNULL,
                                               stdout=out_w, stderr=err_w, cwd=cwd, env=env, pass_fds=fds)
                finally:
                    os.close(out_w)
                    os.close(err_w)
                err_echo = None if opts.ci else os.fdopen(os.dup(2), "wb", buffering=0)
                nursery.start_soon(_pump, stdout, outcome.recorder(logs / "stdout.log", echo, cap), daemon,
                                   _Lines(opts.agent, daemon))
                nursery.start_soon(_pump, stderr, outcome.recorder(logs / "stderr.log", err_echo, cap), daemon, None)
            tree = outcome.tree = ProcessTree(proc.pid)
            try:
                async with trio.open_nursery() as watchers:
                    _start_watchers(watchers, session, tree, opts, outcome, handover, mnt)
                    with _raw_terminal(use_pty):
                        code = await wait_exit(proc)
                    outcome.status = 128 - code if code < 0 else code
                    watchers.cancel_scope.cancel()
            finally:
                if proc.returncode is None:  # the guard failed or was cancelled: the agent goes first
                    with trio.CancelScope(shield=True):
                        await tree.terminate(grace=1.0)
                        await wait_exit(proc)
            state = daemon.breaker.state
            if outcome.tripped is None and state.terminal and outcome.stop_on_terminal:
                outcome.tripped = state  # the agent ended before the watcher could stop it
            if use_pty:
                nursery.cancel_scope.cancel()  # the stdin forwarder never ends by itself


def _filter_socket(bwrap: str | None, streams: contextlib.ExitStack
                   ) -> tuple[tuple[socket.socket, socket.socket] | None, tuple[int, ...]]:
    """The guard's and the sandbox's ends of the socket that brings the sandbox's seccomp
    filter (sandbox.launch.seccomp), in every isolated run, and the fds to pass the sandbox."""
    if bwrap is None:
        return None, ()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    streams.callback(theirs.close)
    streams.callback(ours.close)
    return (ours, theirs), (theirs.fileno(),)


def _start_watchers(watchers: trio.Nursery, session: Session, tree: ProcessTree, opts: RunOptions,
                    outcome: _Outcome, handover: tuple[socket.socket, socket.socket] | None, mnt: Path) -> None:
    """The tasks that live as long as the agent: the breaker's watcher, the signal handler,
    the guard's end of the sandbox's filter (connects judged, removals watched) and the binder
    of generated trees made during the run."""
    watchers.start_soon(_watch, session, tree, opts, outcome)
    watchers.start_soon(_on_signals, tree, outcome)
    if outcome.binder is not None:
        watchers.start_soon(outcome.binder.serve, tree)
    if handover is not None:
        handover[1].close()  # the sandbox's end, held by its entry step now: EOF if it ends first
        fuse = mount_device(os.path.join(os.path.realpath(mnt.parent), mnt.name))  # no stat through the mount
        named, abstract = outcome.sockets
        judge = SocketJudge(agent_socket=str(session.daemon.agent_path), named=named, abstract=abstract,
                            network=opts.manifest.sandbox.network, private_devs=[fuse] if fuse is not None else [],
                            emit=session.events.emit, say=lambda text: _say(printable(text)))
        removals = None if outcome.binder is None else functools.partial(outcome.binder.serve_removals, tree)
        watchers.start_soon(serve_filter, handover[0], judge, removals)


def _give(fd: int, user: str | None) -> None:
    """The agent's end of its output, owned by the agent's *user* (when another): so that it may
    open it again by name, as /dev/stdout (an agent may log there, as its table entry says)."""
    if user is not None:
        pw = pwd.getpwnam(user)
        os.fchown(fd, pw.pw_uid, pw.pw_gid)


def _openpty(user: str | None) -> tuple[int, int]:
    """A pty for the agent: (master, slave), the slave owned by *user* (see :func:`_give`)."""
    master, slave = os.openpty()
    _give(slave, user)
    return master, slave


def _pipe(streams: contextlib.ExitStack, user: str | None = None) -> tuple[trio.lowlevel.FdStream, int]:
    """A pipe from a child: our end as a stream (closed with *streams*), the child's end as an fd
    (owned by *user*, see :func:`_give`)."""
    ours, theirs = os.pipe()
    _give(theirs, user)
    stream = trio.lowlevel.FdStream(ours)
    streams.callback(stream.close)
    return stream, theirs


class _Lines:
    """Splits the agent's stdout into lines for its output parser, which feeds the breaker."""

    def __init__(self, agent: str, daemon: Daemon) -> None:
        cls = AGENTS[agent].parser_class() if agent in AGENTS else None
        self.parser = cls() if cls is not None else None
        self.daemon = daemon
        self._buf = b""

    def feed(self, chunk: bytes) -> None:
        if self.parser is None:
            return
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            self._send(self.parser.feed(line))
        if len(self._buf) > 16 << 20:  # no newline in 16 MiB: not a JSON stream
            self._buf = b""

    def close(self) -> None:
        if self.parser is not None:
            if self._buf:
                self._send(self.parser.feed(self._buf))
            self._send(self.parser.finish())

    def _send(self, events: list[Event]) -> None:
        for event in events:
            for message in to_messages(event):
                self.daemon.feed(message)


async def _pump(stream: trio.abc.ReceiveStream, recorder: Recorder, daemon: Daemon, lines: _Lines | None) -> None:
    try:
        async for chunk in stream:
            recorder.feed(bytes(chunk))
            daemon.breaker.activity()
            if lines is not None:
                lines.feed(bytes(chunk))
    finally:
        recorder.close()
        if lines is not None:
            lines.close()


async def _pump_fd(fd: int, recorder: Recorder, daemon: Daemon, lines: _Lines) -> None:
    stream = trio.lowlevel.FdStream(fd)
    try:
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except (OSError, trio.BrokenResourceError):  # EIO: the pty's other end is gone
                break
            if not chunk:
                break
            recorder.feed(chunk)
            daemon.breaker.activity()
            lines.feed(chunk)
    finally:
        recorder.close()
        lines.close()
        await stream.aclose()


async def _forward_stdin(master: int) -> None:
    source = trio.lowlevel.FdStream(os.dup(0))
    sink = trio.lowlevel.FdStream(os.dup(master))
    async with source, sink:
        async for chunk in source:
            await sink.send_all(chunk)


def _copy_winsize(src: int, dst: int) -> None:
    with contextlib.suppress(OSError):
        termios.tcsetwinsize(dst, termios.tcgetwinsize(src))


@contextlib.contextmanager
def _raw_terminal(active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


async def _watch(session: Session, tree: ProcessTree, opts: RunOptions, outcome: _Outcome) -> None:
    """Freeze the tree on a terminal trip (or stop it in CI); thaw it on approve.

    Woken by the breaker's effects, the state read afresh each time. A terminal trip
    freezes the tree at once, inside the request that tripped, before the agent gets its
    answer; this task then stops it or tells the human what to do."""
    send, changes = trio.open_memory_channel[Effects](math.inf)  # a few per trip or approve

    def on_effects(effects: Effects) -> None:
        if Effect.FREEZE in effects:
            tree.freeze()
        if effects & {Effect.FREEZE, Effect.HALT, Effect.RESUME}:
            send.send_nowait(effects)

    unwatch = session.watch(on_effects)
    try:
        await _follow(session.breaker, tree, opts, outcome, changes)
    finally:
        unwatch()


async def _follow(breaker: Breaker, tree: ProcessTree, opts: RunOptions, outcome: _Outcome,
                  changes: trio.MemoryReceiveChannel[Effects]) -> None:
    announced = False
    while True:
        state = breaker.state
        if state is State.OPEN_STOPPED or (state.terminal and outcome.stop_on_terminal):
            outcome.tripped = state
            _say(f"breaker {state.value}: stopping the agent")
            await tree.terminate()
            return
        if state.terminal and not announced:
            tree.freeze()
            announced = True
            _say(f"breaker {state.value}: the agent is frozen. Look at {opts.run_dir}/STATE.md, then "
                 f"'guard approve --run-dir {opts.run_dir}' or 'guard stop --run-dir {opts.run_dir}'")
        elif not state.terminal and tree.frozen:
            tree.thaw()
            announced = False
            _say("approved: the agent resumes")
        await changes.receive()


async def _on_signals(tree: ProcessTree, outcome: _Outcome) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            outcome.interrupted = signum
            _say(f"{signal.Signals(signum).name}: ending the agent's process tree")
            await tree.terminate()
            return


#: Notes on guard exec's stage the summary shows (the rest are counted).
_LEFT_SHOWN = 8


def _summary(opts: RunOptions, breaker: Breaker, accounting: WriteAccounting, events: EventLog,
             outcome: _Outcome, status: int) -> None:
    if outcome.console is not None:
        outcome.console.close()  # what it held back, before the summary
    snap = breaker.snapshot()
    files = [printable(f) for f in heapq.nsmallest(8, accounting.files)]  # names escaped: any bytes, no controls
    more = ", ..." if len(accounting.files) > 8 else ""
    said = [f"{t['rule']}" + (f" on {printable(t['path'])}" if t.get("path") else "") + f" at step {t['step']}"
            for t in snap["trips"]]
    if snap["omitted"]["trips"]:  # the ledger keeps the first and the most recent (record.ledger_max_items)
        said.insert(opts.manifest.record.ledger_max_items // 2,
                    f"... {snap['omitted']['trips']} more in events.jsonl ...")
    trips = ", ".join(said)
    dropped = sum(events.dropped.values())
    lines = [
        "run summary",
        f"  exit status: {status}" + (f" (stopped: {outcome.tripped.value})" if outcome.tripped else ""),
        f"  files mutated: {len(accounting.files)}" + (f" ({', '.join(files)}{more})" if files else ""),
        # The counts ledger.json, guard report and the CI summary show too (guardfs.events.tally_kind).
        f"  denials: {events.tally['denials']}; trips: {events.tally['trips']}" + (f" ({trips})" if trips else ""),
        *([f"  events dropped by the event log's caps: {dropped} "
           f"({', '.join(f'{op} {n}' for op, n in sorted(events.dropped.items()))}); every denial counted, "
           "every trip and violation kept"]
          if dropped else []),
        f"  tokens: {snap['tokens']['total']} in {snap['steps']} steps" if snap["steps"] else
        # Said, not left to a silent 0: without steps the token rules had nothing to judge.
        "  tokens: no steps reported, so token_surge and token_velocity judged nothing (an agent's steps come "
        "from its machine-readable output, its hooks, guard feed or the client library: the README's block for "
        "your agent says which flag asks for its output)",
        f"  run directory: {opts.run_dir} (stdout.log, stderr.log, events.jsonl, ledger.json, run.json, STATE.md; "
        "guard report --run-dir makes a page of it)",
        *(f"  output capped: {r.describe()}" for r in outcome.recorders if r.dropped),
    ]
    if outcome.left:  # the agent's names, escaped by guardfs.harvest; the first few, and how many
        shown = outcome.left[:_LEFT_SHOWN] + ([f"... {len(outcome.left) - _LEFT_SHOWN} more"]
                                              if len(outcome.left) > _LEFT_SHOWN else [])
        lines.append("  guard exec's stage (written by the agent; only regular files are kept, each cut at "
                     "log_max_bytes): " + "; ".join(shown))
    if outcome.failure is not None:
        after = outcome.failure.get("after_agent")
        lines.insert(1, f"  GUARD FAILED: internal error ({outcome.failure['error']}); " + (
            "the agent was stopped" if after is None else f"after the agent had ended with status {after}")
            + f"; traceback in {outcome.failure['traceback']}")
    if opts.ci:
        logs = [opts.run_dir / "stdout.log", opts.run_dir / "stderr.log"]
        what = f"agent exited with status {outcome.status}" if outcome.tripped is None else \
            f"agent stopped by the breaker ({outcome.tripped.value})"
        if outcome.failure is not None:
            what = f"the guard failed (internal error, traceback in {outcome.failure['traceback']}); " + (
                "agent stopped" if "after_agent" not in outcome.failure else
                f"after the agent had ended with status {outcome.failure['after_agent']}")
        print(digest(what, logs, failed=status != 0), flush=True)
        _github(opts.run_dir, status)
    _say("\n".join(lines))


def _github(run_dir: Path, status: int) -> None:
    """GitHub Actions' conventions for a --ci run: annotations and the job summary."""
    if os.environ.get("GITHUB_ACTIONS") != "true":
        return
    from sandbox.report import ReportError, load_run, write_github

    try:
        write_github(load_run(run_dir), status, sys.stdout)
    except (ReportError, OSError) as err:  # the run's own outcome stands; say what is missing
        _say(f"no GitHub annotations or job summary: {err}")
