"""One guarded run, built in one place: manifest → policy → accounting → breaker → GuardFS → daemon.

``guard run``, ``guard mount`` (with or without ``--run-dir``), the test fixtures and the
benchmarks all build their run here; nothing else wires these parts by hand. The Session
also carries out what the breaker decides: its replies say which :class:`Effect` must
happen (a checkpoint, a rollback, freezing, halting or resuming the agent), and
:meth:`Session.carry_out` does the first two itself and tells its listeners (the
launcher) about the rest.

Without a run directory the Session is a plain guarded mount: the manifest's limits, no
breaker and no sockets.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from guardfs.accounting import WriteAccounting
from guardfs.decision import Request, Verdict
from guardfs.errors import GuardError
from guardfs.events import EventLog, printable
from guardfs.fs import GuardFS
from guardfs.githistory import WorkspaceScan, check_workspace
from guardfs.gitscope import ForbiddenInGitError, GitScope
from guardfs.links import StartWalk, walk_workspace
from guardfs.manifest import Manifest
from guardfs.policy import PathPolicy, Scope, read_gitignore
from sandbox.breaker import Breaker, Effect, Effects
from sandbox.breaker.daemon import Daemon
from sandbox.breaker.ledger import render_state

__all__ = ["Session", "git_config_exists"]

log = logging.getLogger(__name__)


def git_config_exists(workspace: str | os.PathLike[str]) -> bool:
    """Whether *workspace* has a ``.git/config`` now (anything there but "no such file"
    counts as yes: the answer makes it read-only, the safe side)."""
    try:
        os.lstat(os.path.join(workspace, ".git", "config"))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


class Session:
    """A guarded run of *workspace* under *manifest*, its events going to *events*.

    With *run_dir*, a breaker judges every request and a daemon serves it on the run
    directory's sockets; *mountpoint* is where the agent sees the workspace (hook paths are
    relative to it; default: the workspace itself, as in ``guard run``). *checkpoints* keeps
    pre-images in ``run_dir/checkpoint`` for rollback. *on_stop* runs once the reply to an
    operator's ``stop`` went out (``guard mount`` ends its mount there). *now* is the
    breaker's clock. *agent_files* and *agent_caches*: the agent's own files in the workspace
    (:class:`~guardfs.policy.PathPolicy`; from the agents' table, ``own_files`` and ``own_caches``).
    *git_cache*: where the check of git's history keeps what it found, by the store's state
    (guardfs.githistory; None: not kept).

    Call :meth:`prepare` before serving (it claims the run directory) and :meth:`close`
    after the mount is gone; or use the Session as a context manager.
    """

    def __init__(
        self,
        manifest: Manifest,
        workspace: str | os.PathLike[str],
        events: EventLog,
        *,
        run_dir: Path | None = None,
        mountpoint: str | os.PathLike[str] | None = None,
        agent_path: Path | None = None,
        checkpoints: bool = False,
        cache_timeout: float = 60.0,
        xattrs: bool = False,
        now: Callable[[], float] = time.time,
        on_stop: Callable[[], None] | None = None,
        agent_files: Sequence[str] = (),
        agent_caches: Sequence[str] = (),
        git_cache: Path | None = None,
    ) -> None:
        if checkpoints and run_dir is None:
            raise ValueError("checkpoints are kept in the run directory: give run_dir")
        self.manifest = manifest
        self.events = events
        self.run_dir = run_dir
        gitignore = read_gitignore(workspace) if manifest.paths.generated_from_gitignore else ()
        self.policy = PathPolicy(manifest, git_config_existed=git_config_exists(workspace), git_state_locked=True,
                                 gitignore=gitignore, agent_files=agent_files, agent_caches=agent_caches)
        #: What ``guard run`` says at start (the forbidden paths git tracks, under "warn"/"hide-git").
        self.notices: list[str] = []
        #: Git directories outside the workspace the sandbox must mask ("hide-git").
        self.git_masks: list[str] = []
        self.git_history = WorkspaceScan()
        # The one walk of the workspace at start (guardfs.links): the other names of forbidden
        # files, and for the check of git's history where each .git is and which files are secrets.
        walked = walk_workspace(workspace, self.policy)
        self.gitscope = self._git_scope(manifest, workspace, git_cache, walked)
        #: Inode → verdict of the forbidden files with other names, under the run's policy ("hide-git"
        #: forbids git's files too): the mount judges them by inode, and run's planners of lanes and
        #: native trees take the same list rather than walking the workspace again.
        self.forbidden_links = walked.links_for(self.policy)
        self.accounting = WriteAccounting(committed=self.gitscope.committed_version)
        self._breaker: Breaker | None = None
        if run_dir is not None:
            self._breaker = Breaker(manifest, self.accounting, now=now, emit=events.emit, policy=self.policy)
        self.fs = GuardFS(
            os.fspath(workspace), manifest, events,
            decider=self if self._breaker is not None else None,
            cache_timeout=cache_timeout,
            state_text=self.state_text if self._breaker is not None else None,
            accounting=self.accounting,
            checkpoint_dir=run_dir / "checkpoint" if checkpoints and run_dir is not None else None,
            xattrs=xattrs,
            policy=self.policy,
            gitscope=self.gitscope,
            # Generated output out of scope (caches, bytecode) lands here, never in the workspace.
            scratch_dir=run_dir / "scratch" if run_dir is not None else None,
            links=self.forbidden_links,
        )
        self._daemon: Daemon | None = None
        if self._breaker is not None and run_dir is not None:
            self._daemon = Daemon(
                self._breaker, run_dir, os.fspath(mountpoint if mountpoint is not None else workspace), events,
                on_effects=self.carry_out, on_rollback=self.rollback if checkpoints else None,
                on_stop=on_stop, agent_path=agent_path,
            )
        self._listeners: list[Callable[[Effects], None]] = []
        self._prepared = False

    def _git_scope(self, manifest: Manifest, workspace: str | os.PathLike[str],
                   git_cache: Path | None, walked: StartWalk) -> GitScope:
        """The workspace's git state at the start, and what ``paths.forbidden_in_git`` makes
        of the secrets git holds anywhere (raises ForbiddenInGitError under "refuse"): every
        repository's whole store and every index (guardfs.githistory, the check guard check
        makes: HEAD's tree is walked as every commit's is, the index is read as every index
        is). Only secrets: git may track protected paths (they are readable anyway)."""
        policy = self.policy
        history = check_workspace(
            os.fspath(workspace), lambda p: policy.classify(p.rstrip("/"), p.endswith("/")).scope is Scope.FORBIDDEN,
            manifest.paths.workspace_secrets, cache_dir=git_cache, walked=walked)
        self.git_history = history
        if history.scans:
            cached = sum(1 for scan in history.scans if scan.cached)
            self.notices.append(
                f"git history checked for secrets: {len(history.scans)} repositor"
                f"{'y' if len(history.scans) == 1 else 'ies'}, {sum(x.objects for x in history.scans)} objects, "
                f"{sum(x.seconds for x in history.scans):.1f} s"
                + (f" ({cached} from the cache of {git_cache})" if cached else ""))
        where: dict[str, list[str]] = {}
        for repo, found in history.found:
            where.setdefault(found.path, []).extend(
                w if repo.prefix == "" else f"{w} in {repo.label}" for w in found.where)
        inside, outside = history.git_dirs(os.fspath(workspace))
        if inside:  # read-only (guardfs.policy); forbidden under "hide-git" below
            self.policy = self._policy_with(manifest, hide_git=False, git_dirs=inside)
        if not where and history.problem is None:
            return GitScope(workspace, self.policy)
        tracked = sorted(where)
        mode = manifest.paths.forbidden_in_git
        shown = ", ".join(tracked[:20]) + (f" and {len(tracked) - 20} more" if len(tracked) > 20 else "")
        rules = ", ".join(sorted({self.policy.classify(p, False).describe() for p in tracked}))
        lives = "; ".join(f"{p}: {', '.join(dict.fromkeys(where[p]))}" for p in tracked[:10])
        modes = ('set [paths] forbidden_in_git = "hide-git" (git unusable in the run) or "warn" (run with them '
                 "readable through git)")
        way_out = ("remove them from git's history (`git filter-repo --invert-paths --path <path>`; for a "
                   "reflog, stash or unreachable object `git stash clear`, then `git reflog expire "
                   f"--expire-unreachable=now --all && git gc --prune=now`), or {modes}")
        if mode == "refuse":
            if not where:
                raise ForbiddenInGitError(
                    f"{history.problem}: a secret in it would be readable through git whatever the mount "
                    f"refuses. Remove what it holds that you do not need, or {modes}")
            raise ForbiddenInGitError(
                f"git holds secret path(s) {shown} ({rules}), where: {lives}. Their contents are readable "
                "through git (git show <commit>:<path>) whatever the mount refuses. If they must only never "
                "be written (CI workflows, migrations), move their patterns to [paths] protected, which git "
                f"may track; if they are secrets, {way_out}")
        said = f"git holds secret path(s) {shown}" if where else (
            f"git's history was not checked ({history.problem}), so it may hold secrets")
        if mode == "hide-git":
            self.policy = self._policy_with(manifest, hide_git=True, git_dirs=inside, masked=outside)
            self.git_masks = outside
            self.notices.append(f"{said}: every git directory is forbidden to the agent "
                                "in this run (paths.forbidden_in_git = \"hide-git\"); git does not work here")
        else:
            self.notices.append(f"WARNING: {said}: their contents ARE readable "
                                "through git's object store in this run (paths.forbidden_in_git = \"warn\")")
        return GitScope(workspace, self.policy)

    def _policy_with(self, manifest: Manifest, *, hide_git: bool, git_dirs: list[str],
                     masked: list[str] | None = None) -> PathPolicy:
        """The run's policy, rebuilt with *hide_git*, the separate *git_dirs* and the *masked*
        git directories outside the workspace."""
        old = self.policy
        return PathPolicy(manifest, git_config_existed=old.git_config_existed, hide_git=hide_git,
                          git_state_locked=True, gitignore=old.gitignore, agent_files=old.agent_files,
                          agent_caches=old.agent_caches, git_dirs=git_dirs, started_ns=old.started_ns,
                          masked_git_dirs=masked or ())

    @property
    def guarded(self) -> bool:
        """Whether a breaker and a daemon serve this run (it has a run directory)."""
        return self._daemon is not None

    @property
    def breaker(self) -> Breaker:
        """The run's breaker (only with a run directory)."""
        if self._breaker is None:
            raise RuntimeError("this session has no run directory, hence no breaker")
        return self._breaker

    @property
    def daemon(self) -> Daemon:
        """The run's daemon (only with a run directory)."""
        if self._daemon is None:
            raise RuntimeError("this session has no run directory, hence no daemon")
        return self._daemon

    # ----- life cycle ------------------------------------------------------------------

    def prepare(self) -> None:
        """Claim the run directory (raises :class:`~sandbox.breaker.daemon.RunDirBusy` if another
        guard serves it) and write the first ledger."""
        if self._daemon is not None:
            self._daemon.prepare()
        self._prepared = True

    def close(self) -> None:
        """Close the filesystem's descriptors; remove the sockets and write the last ledger
        (only if :meth:`prepare` claimed the run directory: never another guard's)."""
        self.fs.close()
        self.gitscope.close()
        if self._daemon is not None and self._prepared:
            self._daemon.cleanup()
        self._prepared = False

    def __enter__(self) -> Session:
        try:
            self.prepare()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ----- what GuardFS asks (guardfs's Decider protocol) ------------------------------

    def decide(self, request: Request, policy: Verdict) -> Verdict:
        """The breaker's verdict; a trip's effects are carried out before the answer
        goes back (a terminal trip freezes the agent inside the request that tripped)."""
        verdict, effects = self.breaker.judge(request, policy)
        if effects:
            self.carry_out(effects)
        return verdict

    def committed(self, request: Request) -> None:
        """An allowed mutation landed; the breaker may trip on it (a content cycle)."""
        effects = self.breaker.commit(request)
        if effects:
            self.carry_out(effects)

    def state_text(self) -> str:
        """``.guard/STATE.md`` as of now: bounded, every name escaped (always valid UTF-8)."""
        return render_state(self.daemon.snapshot() if self._daemon is not None else self.breaker.snapshot())

    # ----- effects ---------------------------------------------------------------------

    def watch(self, listener: Callable[[Effects], None]) -> Callable[[], None]:
        """Call *listener* with every set of effects, synchronously, from inside the request
        or message that decided them; returns the function that stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def carry_out(self, effects: Effects) -> None:
        """Do what the breaker decided: checkpoint and rollback here, the rest by the listeners."""
        if Effect.CHECKPOINT in effects and self.fs.preimages is not None:
            # A restore point added; none is ever dropped for it (an agent's report may be false).
            points = self.breaker.checkpoints
            self.fs.preimages.checkpoint(str(points[-1]["label"]) if points else "")
        if Effect.ROLLBACK in effects:
            if self.fs.preimages is None:
                log.warning("the breaker asked for a rollback, but this guard keeps no pre-images")
            else:
                try:
                    self._rollback("last", "breaker")
                except (GuardError, OSError) as err:  # a tampered store, or its disk failed: the run goes on
                    log.error("the breaker asked for a rollback, and it was refused: %s", err)
                    self.breaker.rolled_back("breaker", "last", 0, {"": f"the rollback was refused: {err}"}, {})
        for listener in list(self._listeners):
            listener(effects)

    def rollback(self, to: str = "last") -> int:
        """Restore the workspace to restore point *to* (``start``, ``last`` or a label);
        returns how many paths changed. GuardFS records the one ``rollback`` event. Raises
        :class:`~guardfs.checkpoint.CheckpointError`, changing nothing, for an unknown
        point or a tampered store. Call from the event loop, outside any request.

        What the rollback could not put back (named with the reason) and what it moved aside
        go to the ledger and the console; the rest is restored, and the run goes on."""
        return self._rollback(to, "operator")

    def _rollback(self, to: str, by: str) -> int:
        restored = len(self.fs.rollback(to))
        assert self.fs.preimages is not None  # fs.rollback refuses a guard without them
        done = self.fs.preimages.last_rollback
        failed, aside = (done.failed, done.moved_aside) if done is not None else ({}, {})
        for path, why in failed.items():
            log.error("rollback (asked by the %s) did NOT restore %s: %s", by, printable(path), printable(why))
        if failed:
            log.error("rollback left %d path(s) as they were; every restore point is kept: clear the way and "
                      "run guard rollback --run-dir %s --to %s", len(failed), self.run_dir, to)
        for path, where in aside.items():
            log.warning("rollback moved %s aside to %s (it held bytes no restore point keeps)", printable(path),
                        where)
        self.breaker.rolled_back(by, to, restored, failed, aside)
        return restored
