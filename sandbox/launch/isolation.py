"""Isolation of the agent: the bubblewrap command line and the guard's private mount namespace.

Inside the sandbox the agent sees the host read-only, a private /tmp, a fresh /proc of
its own PID namespace (the guard is invisible there), the guarded mount at the workspace's
own path (covering the real directory), and the agent socket at ``/tmp/guard/agent.sock``.
The run directory (control socket, ledger, logs) is covered by an empty tmpfs; only its
``exec/`` directory is bound writable at ``/tmp/guard/exec``, where ``guard exec`` keeps its
logs, so they land on the host and outlive the run. As root, every capability is
dropped. The last step, :mod:`sandbox.launch.enter`, adds Landlock (writes only beneath the
workspace, /tmp, /dev and declared extras), no_new_privs and the guard's seccomp filter (the
host's unix sockets out of reach: :mod:`sandbox.launch.sockets`).

What only root (or another user) may read on the host stays unreadable even to a root agent,
whose uid 0 without capabilities still owns root's files: /root, /home (but an agent user's
own home), the guard's run trees and every other live run's directory are covered by empty
tmpfs, and every file and directory under /etc that others may not read (/etc/shadow, host
keys, ...) by an unreadable stand-in; a root guard's run directory is mode 000 wherever and
whenever it is made, which uid 0 without capabilities cannot enter (:mod:`sandbox.launch.runs`).
The agent stays root (tools and images that expect it keep working); these masks are what make
root's secrets not its own. See :func:`host_secrets`. Into those empty trees come back, read-only,
the agent's own installation (:mod:`sandbox.launch.install`) and nothing else of the home; and
over every bind, last, the credential stores the sandbox would still show (an agent user's home
bound back, a home outside the covered trees, a writable directory) are masked
(:func:`visible_secrets`).
With ``[sandbox] network = "none"`` the agent also gets a network namespace of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from guardfs.errors import UnavailableError
from sandbox.launch.install import Installation
from sandbox.launch.landlock import LandlockUnavailable, abi_version

__all__ = [
    "MAX_ETC_MASKS", "NAMESPACES", "SANDBOX_RUN_DIR", "HostMasks", "Isolation", "IsolationUnavailable",
    "bind_read_only", "bwrap_argv", "clear_ambient_capabilities", "host_secrets", "mount_tmpfs",
    "private_mount_namespace", "probe", "reachable_by",
    "system_entry", "try_sandbox", "unbind", "visible_secrets",
]

#: Where the agent finds the guard inside the sandbox (GUARD_RUN_DIR).
SANDBOX_RUN_DIR = "/tmp/guard"
#: Trees covered by an empty tmpfs in every sandbox: root's and the users' homes (an agent
#: of another user gets its own home back), and where guard keeps runs of other users' agents.
HIDDEN_TREES = ("/root", "/home", "/var/lib/guardfs")
#: More unreadable entries under /etc than this and /etc's scan stops masking files one by
#: one (each mask is a mount): the run is refused rather than started half-masked.
MAX_ETC_MASKS = 256

_CLONE_NEWNS = 0x00020000
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


class IsolationUnavailable(UnavailableError):
    """What is missing for isolation, in words a user can act on."""

    machine = True


@dataclass(frozen=True)
class Isolation:
    """What this machine offers."""

    bwrap: str
    landlock_abi: int


#: The namespaces of every sandbox (bwrap_argv), which probe() makes once before a run.
NAMESPACES = ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")


def clear_ambient_capabilities() -> None:
    """Not root: empty this process's ambient capability set, so that nothing it starts from now
    on (bubblewrap above all) inherits a capability. Podman gives a container whose own user is
    not root CAP_SYS_ADMIN as an ambient capability; bubblewrap, not setuid and not root, then
    refuses to start ("Unexpected capabilities but not setuid"). Done in the guard itself (not
    between fork and exec: the guard forks from threads); its own sets keep what they have, and
    it needs none of them: unprivileged, it mounts through fusermount3. Root is left alone."""
    if os.geteuid() == 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:  # EINVAL: a kernel before 4.3
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise OSError(err, f"prctl(PR_CAP_AMBIENT_CLEAR_ALL): {os.strerror(err)}")


def try_sandbox(bwrap: str, user: str | None = None) -> str | None:
    """Start bubblewrap as a run starts it (the namespaces, the read-only host, a fresh /dev,
    /proc and /tmp; as *user*, through setpriv, like ``guard run --user``) running ``true``:
    None when it could, else bubblewrap's own words (no user namespace, no mount namespace).
    First the ambient capabilities go (:func:`clear_ambient_capabilities`): every run and
    ``guard doctor`` try the sandbox before they start bubblewrap for real."""
    clear_ambient_capabilities()
    prefix = []
    if user is not None:
        pw = pwd.getpwnam(user)
        prefix = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
    drop = ["--cap-drop", "ALL"] if os.geteuid() == 0 and user is None else []
    argv = [*prefix, bwrap, "--die-with-parent", *NAMESPACES, "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc", "--tmpfs", "/tmp", *drop, "--", "true"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, errors="replace", timeout=30, check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{bwrap} could not be run: {err}"
    if proc.returncode == 0:
        return None
    said = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
    return f"{bwrap} cannot make the sandbox here ({said})"


def probe(user: str | None = None) -> Isolation:
    """Check that bubblewrap (for *user*, an agent of another user) and Landlock work here;
    raise IsolationUnavailable saying why not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable("bubblewrap is not installed (apt-get install bubblewrap)")
    try:
        abi = abi_version()
    except LandlockUnavailable as err:
        raise IsolationUnavailable(f"{err.strerror} (a kernel >= 5.13 with lsm=landlock is needed)") from err
    failed = try_sandbox(bwrap, user)
    if failed is not None:
        raise IsolationUnavailable(failed)
    return Isolation(bwrap, abi)


def private_mount_namespace() -> bool:
    """Give this (still single-threaded) process a mount namespace of its own, as root.

    The guarded mount then exists only in here: when the guard and the agent are gone,
    even by SIGKILL, the kernel tears the namespace down with the mount in it; nothing is
    left mounted on the host. Returns False (and changes nothing) when not root.

    The copy is a *slave* of the host's mounts, not private: what the host unmounts
    during a run goes away in here too (a private copy kept every mount of the host
    alive, a FUSE server's included, for as long as the run lasted), while nothing
    mounted in here (the guarded mount, the sandbox's binds) propagates out.
    """
    if os.geteuid() != 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"making / a slave of the host's mounts: {os.strerror(err)}")
    return True


def bind_read_only(source: str, target: str) -> None:
    """Bind *source* at *target*, read-only, in this process's (private) mount namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    for src, flags in ((source.encode(), _MS_BIND), (None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY)):
        if libc.mount(src, target.encode(), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"binding {source} at {target}: {os.strerror(err)}")


def mount_tmpfs(target: str, mode: int) -> None:
    """Mount an empty tmpfs of *mode* at *target*, in this process's (private) mount namespace:
    what is created in it exists for this guard and its sandbox only, never on the host."""
    libc = ctypes.CDLL(None, use_errno=True)
    options = f"mode={mode:o},size=64m".encode()
    if libc.mount(b"guardfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting a private tmpfs at {target}: {os.strerror(err)}")


@dataclass(frozen=True)
class HostMasks:
    """What of the host the sandbox covers: directories (empty tmpfs), files (an unreadable
    stand-in) and directories bound back read-only on top (an agent user's own home)."""

    dirs: tuple[str, ...]
    files: tuple[str, ...]
    reveal: tuple[str, ...] = ()


def host_secrets(own_home: str | None = None, other_runs: Sequence[str] = ()) -> HostMasks:
    """The host's trees an agent must not read, whatever its uid: :data:`HIDDEN_TREES`, the
    *other_runs* directories, and what under /etc others may not read. *own_home* (an agent
    user's home) is bound back. Raises IsolationUnavailable past :data:`MAX_ETC_MASKS`."""
    dirs = [d for d in (*HIDDEN_TREES, *other_runs) if os.path.isdir(d)]
    dirs = [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk("/etc"):
        keep = []
        for name in dirnames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode):
                    if st.st_mode & 0o005 != 0o005:
                        dirs.append(path)
                    else:
                        keep.append(name)
        dirnames[:] = keep
        for name in filenames:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                    files.append(path)
        if len(files) + len(dirs) > MAX_ETC_MASKS:
            raise IsolationUnavailable(f"more than {MAX_ETC_MASKS} files under /etc that other users may not "
                                       "read; the sandbox masks each one and would need too many mounts")
    reveal = (own_home,) if own_home and any(own_home.startswith(d.rstrip("/") + "/") for d in dirs) \
        and os.path.isdir(own_home) else ()
    return HostMasks(tuple(dirs), tuple(files), reveal)


def _under(path: str, trees: Iterable[str]) -> bool:
    """Whether *path* is one of *trees* or lies below one."""
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in trees)


def visible_secrets(paths: Iterable[str], covered: Sequence[str], shown: Sequence[str], workspace: str) -> list[str]:
    """Those of *paths* (credential stores: :func:`guardfs.manifest.outside_secrets`) that exist
    and that the sandbox would show, whole or in part: outside every *covered* tree (an empty
    tmpfs: the homes, /tmp), inside one of the *shown* trees bound back (an agent user's home, a
    writable or readable directory, an installation), or holding one (``[sandbox] readable``
    naming a file in ``~/.aws``, or a symlink resolving there). Those are the ones to mask;
    inside the workspace the mount and the manifest decide. A store that is a symlink (or lies
    below one, a home that is a link) is judged, and masked, where it leads as well: the sandbox
    shows that too (``~/.ssh`` -> ``/data/keys``, under a covered home, is read at ``/data/keys``)."""
    out = []
    for path in dict.fromkeys(q for p in paths for q in (os.path.normpath(p), os.path.realpath(p))):
        if os.path.lexists(path) and not _under(path, [workspace]) and (
                not _under(path, covered) or _under(path, shown) or any(_under(t, [path]) for t in shown)):
            out.append(path)
    return out


def reachable_by(path: str, uid: int, gids: Collection[int]) -> bool:
    """Whether a process of *uid* (with groups *gids*) may look *path* up: search permission,
    by the mode bits, on every directory above it. A directory with an access ACL counts as
    reachable (its mode bits do not tell)."""
    parts = path.strip("/").split("/")
    for i in range(len(parts)):
        directory = "/" + "/".join(parts[:i])
        try:
            st = os.stat(directory)
            if "system.posix_acl_access" in os.listxattr(directory):
                continue
        except OSError:
            return False
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid in gids else 0o001
        if not st.st_mode & bit:
            return False
    return True


def unbind(target: str) -> None:
    """Detach whatever is mounted at *target* (nothing if nothing is)."""
    ctypes.CDLL(None, use_errno=True).umount2(target.encode(), _MNT_DETACH)


def _traversable_by_all(path: str) -> bool:
    """Whether every directory down to *path* lets any user through (o+x)."""
    parts = path.strip("/").split("/")
    return all(os.stat("/" + "/".join(parts[:i])).st_mode & 0o001 for i in range(len(parts) + 1))


def _keep_visible(covered: Sequence[str], other_user: bool = False) -> list[str]:
    """Read-only binds for what the sandbox's own entry step needs (this Python, its
    packages, guard itself) where a fresh tmpfs covers it (a venv under /tmp, say). For an
    agent of another user (whose bubblewrap resolves the sources as that user), only what
    that user can reach."""
    import sandbox

    needed = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))}
    out: list[str] = []
    for path in sorted(needed):
        real = os.path.realpath(path)
        if any(real == c or real.startswith(c.rstrip("/") + "/") for c in covered) and (
                not other_user or _traversable_by_all(real)):
            out += ["--ro-bind", real, real]
    return out


def _installed(installed: Installation, covered: Sequence[str], shown: Sequence[str],
               reachable: Callable[[str], bool]) -> list[str]:
    """bubblewrap arguments showing an agent's installation (:mod:`sandbox.launch.install`)
    where a tmpfs covers it: each symlink recreated as it is (first: a tree bound later may
    hold it), then each tree bound read-only. What the sandbox shows anyway is left as it is,
    and what the agent's user cannot *reach* is left out (its bubblewrap could not bind it)."""
    def needed(path: str) -> bool:
        try:
            return _under(path, covered) and not _under(path, shown) and reachable(path)
        except OSError:  # gone, or not ours to reach
            return False

    trees = [t for t in installed.trees if needed(t) and os.path.exists(t)]
    out: list[str] = []
    for path, target in installed.links:
        if needed(path) and not _under(path, trees):
            out += ["--symlink", target, path]
    for tree in trees:
        out += ["--ro-bind", tree, tree]
    return out


def _masked(secrets: Sequence[str], mask_file: str | None) -> list[str]:
    """bubblewrap arguments masking each credential store (:func:`visible_secrets`): a directory
    by an empty mode-000 tmpfs, a file by *mask_file* (an empty mode-000 file); a read of either
    is refused with EACCES, whatever the agent's uid (a root agent has no capabilities)."""
    out: list[str] = []
    for path in secrets:
        if os.path.isdir(path):
            out += ["--perms", "0000", "--tmpfs", path]
        elif mask_file is not None:
            out += ["--ro-bind", mask_file, path]
    return out


def system_entry() -> list[str]:
    """Run sandbox.launch.enter with the system's python3, for an agent user who cannot reach this
    interpreter (a virtualenv under /root, say): it needs the standard library only."""
    import sandbox

    root = os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    code = f"import sys; sys.path.insert(0, {root!r}); from sandbox.launch.enter import main; sys.exit(main())"
    return [python, "-c", code]


def bwrap_argv(
    *,
    bwrap: str,
    mountpoint: str,
    workspace: str,
    run_dir: str,
    agent_socket: str,
    cwd: str,
    command: Sequence[str],
    writable: Sequence[str] = (),
    pty: bool = False,
    entry: Sequence[str] | None = None,
    files: Sequence[tuple[str, str]] = (),
    over_workspace: Sequence[str] = (),
    exec_logs: str | None = None,
    masks: HostMasks | None = None,
    mask_file: str | None = None,
    network: str = "host",
    filter_fd: int | None = None,
    removals: bool = False,
    installed: Installation | None = None,
    secrets: Sequence[str] = (),
    sockets: Sequence[str] = (),
) -> list[str]:
    """The full command line that starts *command* isolated, in *cwd*.

    *entry* is how to run :mod:`sandbox.launch.enter` (default: this interpreter, ``-m``); *files*
    are (source, destination) pairs bound read-only (an agent's settings for this run);
    *over_workspace* are bubblewrap arguments applied right after the mount is bound at the
    workspace (the fast lanes); *exec_logs* is the host directory bound
    writable at ``GUARD_RUN_DIR/exec`` for ``guard exec``'s logs (the agent's user must be
    able to write it); *masks* are the host's trees and files the agent must not read
    (:func:`host_secrets`), files covered by *mask_file*, an empty mode-000 file;
    *network* "none" gives the agent a network namespace of its own (loopback only);
    *filter_fd* is a socket (inherited) over which the sandbox's entry step hands the guard
    its seccomp filter (:mod:`sandbox.launch.seccomp`), which notifies directory removals too
    with *removals*; *sockets* are the host's unix sockets ``[sandbox] unix_sockets`` names,
    shown read-only at their path where a tmpfs covers them; *installed* is what of the
    agent's installation (and ``[sandbox] readable``) a tmpfs covers and must be shown read-only;
    *secrets* are the credential stores to mask (:func:`visible_secrets`), masked last, over
    every bind.
    """
    hidden = list(masks.dirs) if masks else []
    cover: list[str] = []
    for path in hidden:
        cover += ["--tmpfs", path]
    if masks and mask_file is not None:
        for path in masks.files:
            cover += ["--ro-bind", mask_file, path]
    for path in masks.reveal if masks else ():
        cover += ["--ro-bind", path, path]
    other_user = entry is not None
    if installed is not None:
        cover += _installed(installed, ["/tmp", *hidden], [*(masks.reveal if masks else ()), workspace],
                            _traversable_by_all if other_user else os.path.exists)
    argv = [
        bwrap,
        "--die-with-parent",
        *NAMESPACES,
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        *cover,
        *_keep_visible(["/tmp", *hidden], other_user=other_user),
        "--bind", mountpoint, workspace,
        *over_workspace,
        "--tmpfs", run_dir,
        "--dir", SANDBOX_RUN_DIR,
        "--bind", agent_socket, f"{SANDBOX_RUN_DIR}/agent.sock",
    ]
    if exec_logs is not None:
        argv += ["--bind", exec_logs, f"{SANDBOX_RUN_DIR}/exec"]
    for source, dest in files:
        argv += ["--ro-bind", source, dest]
    for path in writable:
        argv += ["--bind", path, path]
    for path in sockets:
        if _under(path, ["/tmp", *hidden]) and not _under(path, masks.reveal if masks else ()):
            argv += ["--ro-bind", path, path]  # a connect needs no write access to the mount
    argv += _masked(secrets, mask_file)
    if network == "none":
        argv.append("--unshare-net")  # a namespace of its own: loopback only, abstract sockets included
    if os.geteuid() == 0:
        argv += ["--cap-drop", "ALL"]
    if not pty:
        argv.append("--new-session")  # no TIOCSTI into the guard's terminal
    argv += [
        "--chdir", cwd,
        "--setenv", "GUARD_SOCKET", f"{SANDBOX_RUN_DIR}/agent.sock",
        "--setenv", "GUARD_RUN_DIR", SANDBOX_RUN_DIR,
        "--setenv", "GUARD_WORKSPACE", workspace,
        "--",
        *(entry or [sys.executable, "-m", "sandbox.launch.enter"]),
        "--write", workspace, "--write", "/tmp", "--write", "/dev",
        *(f"--write={p}" for p in writable),
        *([f"--filter={filter_fd}"] if filter_fd is not None else []),
        *(["--removals"] if removals else []),
        "--", *command,
    ]
    return argv
