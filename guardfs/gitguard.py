"""Git policed as git: what under a repository makes git run something, by what it is.

A human who later runs git in the workspace runs, outside any sandbox, whatever the
repository tells git to run: its hooks, and the programs its configuration names
(``core.fsmonitor``, ``core.hooksPath``, ``!`` aliases, filter drivers, includes of
configuration from elsewhere...). So every repository inside the workspace, at any depth,
is policed by the role of each name in it, not by the name ``.git/hooks`` alone:

- the ``.git`` directory and its ``hooks`` directory are *anchors*: made by ``mkdir``
  (``git init``) and removable when empty, never renamed, replaced, linked or made a
  symlink, and never carried by a directory that moves (so no prepared tree can be
  moved into their place);
- hooks (other than git's own ``*.sample`` templates), ``commondir``,
  ``info/attributes`` and ``objects/info/alternates`` are read-only;
- ``config`` and ``config.worktree`` that existed when the guard started are read-only;
  those of a repository made during the run are written only the way git writes them (a
  lock file renamed over them), and that rename is refused when the new configuration
  sets anything that executes (:func:`config_problems`, which parses with git itself);
- a gitfile (a ``.git`` that is a file) and a linked worktree's ``gitdir`` and ``commondir``
  point git at another git directory: git writes them in place, and each write is judged on
  the content it leaves (guardfs.rename.check_git_link): a gitfile may name only a policed
  git directory inside the workspace (a ``.git``, or ``.git/worktrees/<id>``,
  ``.git/modules/<name>``), a ``commondir`` only its own repository;
- a file named ``HEAD`` outside any ``.git`` directory would make its directory a bare
  repository, whose config and hooks no name gives away: it is refused.

Pure functions of paths and bytes; the filesystem calls them (see guardfs.fs).
"""

from __future__ import annotations

import enum
import fnmatch
import os
import shutil
import subprocess
from collections.abc import Callable

__all__ = [
    "GITFILE_PREFIX",
    "MAX_CONFIG_BYTES",
    "GitConfigError",
    "GitRole",
    "config_problems",
    "git_binary_ids",
    "git_role",
    "gitdir_target_ok",
    "is_git_process",
    "link_value",
    "parse_config",
]


#: A repository's configuration larger than this is refused unread (git's own are < 4 KiB).
MAX_CONFIG_BYTES = 1 << 20

# Below a git directory, names under these are git's data (refs may be named `hooks` or
# `config`): no role of their own, except the alternates files under objects/info/.
_DATA = frozenset({"refs", "logs", "objects"})
_ALTERNATES = (["objects", "info", "alternates"], ["objects", "info", "http-alternates"])
_CONFIG_NAMES = frozenset({"config", "config.worktree"})

# Keys (section.name, lowercase as git lists them; a subsection is ignored) whose value
# names a program git runs, or configuration/a work tree elsewhere.
_EXEC_KEYS = frozenset({
    "core.hookspath", "core.fsmonitor", "core.pager", "core.editor", "core.sshcommand",
    "core.askpass", "core.gitproxy", "core.worktree", "core.attributesfile",
    "core.alternaterefscommand", "sequence.editor", "interactive.difffilter", "diff.external",
    "diff.textconv", "diff.command", "merge.driver", "gpg.program", "remote.uploadpack",
    "remote.receivepack", "remote.vcs", "sendemail.smtpserver", "imap.tunnel", "web.browser",
    "man.viewer", "uploadpack.packobjectshook", "protocol.allow",
})
# Whole sections that only exist to name programs or to read more configuration.
_EXEC_SECTIONS = frozenset({"include", "includeif", "filter", "pager", "credential", "protocol"})
# Variable names that name a program (or its path) whatever the section.
_EXEC_NAME_GLOBS = ("*cmd", "*command", "*program", "*helper", "*driver", "*tunnel", "*hook",
                    "*editor", "*textconv", "path")
# Values that are commands only when they start with "!" (a shell command).
_BANG_KEYS = frozenset({"alias", "submodule.update"})
# Sections where a variable named `path` is data, not a program.
_PATH_IS_DATA = frozenset({"submodule"})


class GitConfigError(ValueError):
    """A configuration git itself cannot parse."""


def _split(path: str) -> list[str] | None:
    """The components after the innermost ``.git`` component of *path*, or None."""
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == ".git":
            return parts[i + 1:]
    return None


class GitRole(enum.Enum):
    """What a name inside a repository's git directory is, where it matters."""

    ANCHOR = "anchor"  # the .git directory or its hooks directory
    HOOK = "hook"  # a file under hooks/ that git would run
    REDIRECT = "redirect"  # commondir, info/attributes, objects/info/alternates
    CONFIG = "config"  # config or config.worktree
    LINK = "link"  # a linked worktree's gitdir or commondir: written by git, judged by content
    BARE = "bare"  # a HEAD outside any .git directory: it would make a bare repository


#: What a gitfile (a ``.git`` that is a file: a linked worktree's, a submodule's) says.
GITFILE_PREFIX = b"gitdir: "
#: Where a gitfile may point, below a ``.git`` directory: a linked worktree's or a
#: submodule's git directory (whose config, hooks and commondir are policed by name).
_LINK_DIRS = frozenset({"worktrees", "modules"})
_NOT_A_GITDIR = _DATA | {"hooks", "info"}


def link_value(data: bytes) -> str:
    """The path a gitfile (after ``gitdir: ``), a worktree's ``gitdir`` or its ``commondir``
    holds, as git reads it: trailing CR/LF dropped, cut at a NUL."""
    value = data.rstrip(b"\r\n").split(b"\0", 1)[0]
    return os.fsdecode(value)


def gitdir_target_ok(rel: str) -> bool:
    """Whether the workspace-relative directory *rel* is one a gitfile may name: a ``.git``
    directory, or a linked worktree's or submodule's git directory below one."""
    parts = rel.split("/")
    if ".git" not in parts:
        return False
    below = parts[len(parts) - 1 - parts[::-1].index(".git") + 1:]
    if not below:
        return True
    return below[0] in _LINK_DIRS and len(below) >= 2 and not any(p in _NOT_A_GITDIR for p in below)


def git_role(path: str) -> tuple[GitRole, str] | None:
    """The role of *path* (workspace-relative, '/'-separated) in the innermost repository
    it lies in, with the name that makes it so; None for everything else (git's data,
    its sample hooks, files outside any ``.git``)."""
    split = _split(path)
    if split is None:
        if path.rpartition("/")[2] == "HEAD":
            return GitRole.BARE, "HEAD"
        return None
    rel = split
    if not rel:
        return GitRole.ANCHOR, ".git"
    data = next((i for i, part in enumerate(rel) if part in _DATA), len(rel))
    hooks = next((i for i, part in enumerate(rel[:data]) if part == "hooks"), None)
    if hooks is not None:
        below = rel[hooks + 1:]
        if not below:
            return GitRole.ANCHOR, "hooks"
        if len(below) == 1 and below[0].endswith(".sample"):
            return None  # git init's templates: git never runs a *.sample hook
        return GitRole.HOOK, "hooks/"
    tail = rel[data:]
    if tail in _ALTERNATES:
        return GitRole.REDIRECT, "/".join(tail)
    if data < len(rel):
        return None
    if len(rel) >= 3 and rel[-3] == "worktrees" and rel[-1] in ("gitdir", "commondir"):
        return GitRole.LINK, rel[-1]
    if rel[-1] == "commondir":
        return GitRole.REDIRECT, "commondir"
    if rel[-2:] == ["info", "attributes"]:
        return GitRole.REDIRECT, "info/attributes"
    if rel[-1] in _CONFIG_NAMES:
        return GitRole.CONFIG, rel[-1]
    return None


def git_binary_ids() -> frozenset[tuple[int, int]]:
    """(device, inode) of the git binaries on this machine (git runs its subcommands from
    either): the sandbox sees the same files, read-only, so a process whose executable is
    one of them is git, whatever it calls itself."""
    ids = set()
    for path in (shutil.which("git"), "/usr/bin/git", "/usr/lib/git-core/git", "/usr/libexec/git-core/git"):
        if path:
            try:
                st = os.stat(path)
            except OSError:
                continue
            ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


def is_git_process(pid: int, ids: frozenset[tuple[int, int]]) -> bool:
    """Whether process *pid* runs one of the git binaries *ids*."""
    try:
        st = os.stat(f"/proc/{pid}/exe")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in ids


def parse_config(data: bytes) -> list[tuple[str, str | None]]:
    """The (key, value) pairs of a git configuration, as git itself reads it.

    ``git config --file - --list -z`` parses; includes are listed, not followed (so an
    include is seen as the key it is). Raises :class:`GitConfigError` with git's message
    when git cannot parse it.
    """
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/nonexistent", "LC_ALL": "C",
           "GIT_CEILING_DIRECTORIES": "/"}
    proc = subprocess.run(["git", "config", "--file", "-", "--list", "-z"], input=data, env=env,
                          cwd="/", capture_output=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise GitConfigError(proc.stderr.decode(errors="replace").strip() or f"git exited {proc.returncode}")
    out: list[tuple[str, str | None]] = []
    for item in proc.stdout.decode(errors="surrogateescape").split("\0"):
        if item:
            key, sep, value = item.partition("\n")
            out.append((key, value if sep else None))
    return out


def _executes(key: str, value: str | None) -> bool:
    section, _, rest = key.partition(".")
    name = rest.rpartition(".")[2]
    sub = rest.rpartition(".")[0]
    short = f"{section}.{name}"
    if section in _EXEC_SECTIONS or short in _EXEC_KEYS:
        return True
    if name == "path" and section in _PATH_IS_DATA:
        return False
    if any(fnmatch.fnmatchcase(name, g) for g in _EXEC_NAME_GLOBS):
        return True
    if (section in _BANG_KEYS or short in _BANG_KEYS) and value is not None and value.lstrip().startswith("!"):
        return True
    # ext:: runs a command as a transport, wherever a URL may stand.
    return sub.lower().startswith("ext::") or (value is not None and value.lower().lstrip().startswith("ext::"))


def config_problems(data: bytes, worktree_ok: Callable[[str], bool] | None = None) -> list[str]:
    """The keys of the configuration *data* that would make git run a program, or read
    configuration from elsewhere; a configuration git cannot parse is one problem.
    ``core.worktree`` (a submodule's git directory names its work tree) is no problem where
    *worktree_ok* accepts its value."""
    try:
        entries = parse_config(data)
    except GitConfigError as err:
        return [f"unparsable configuration ({err})"]
    return sorted({key for key, value in entries if _executes(key, value) and not (
        key == "core.worktree" and value is not None and worktree_ok is not None and worktree_ok(value))})
