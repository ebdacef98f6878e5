"""Where the agent is installed, and what of that installation the sandbox must show.

The sandbox covers the homes (``/root``, ``/home``) and ``/tmp`` with empty tmpfs, and agents
live there: Claude Code's native installer (``~/.local/bin/claude`` → ``~/.local/share/claude/
versions/X``), npm user prefixes (``~/.npm-global/bin/x`` → ``../lib/node_modules/pkg/cli.js``,
``#!/usr/bin/env node``), nvm (``~/.nvm/versions/node/vX/bin/{node,npm,x}``), pipx
(``~/.local/bin/aider`` → ``~/.local/pipx/venvs/aider-chat/bin/aider``, a shebang naming the
venv's python). ``guard run`` resolves the command on the host's ``PATH`` before it starts
anything (:func:`resolve_command`), and :func:`installation` says what the sandbox binds back,
read-only: every symlink on the way, recreated as it is, and the tree the executable runs from
(:func:`package_root`), for the executable and for its script's interpreter. Nothing else of
the home comes back.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from guardfs.errors import UsageError

__all__ = ["Installation", "installation", "package_root", "resolve_command", "reveal"]

#: How many interpreters deep a script's shebang is followed (a script run by a script...).
_MAX_DEPTH = 4
#: As the kernel's own bound on symlinks met in one resolution.
_MAX_LINKS = 40


@dataclass(frozen=True)
class Installation:
    """What makes an installed command run: the symlinks met on the way to it, each (its path,
    its target as written), and the real trees (directories or files) it runs from."""

    links: tuple[tuple[str, str], ...] = ()
    trees: tuple[str, ...] = ()

    def __or__(self, other: Installation) -> Installation:
        links = dict(self.links)
        links.update(other.links)
        return Installation(tuple(links.items()), _outermost([*self.trees, *other.trees]))


def resolve_command(name: str, search_path: str, cwd: str) -> str:
    """The absolute path of the command *name* as an exec on *search_path* (in *cwd*) would find
    it. Raises UsageError naming PATH when there is none."""
    if "/" in name:
        path = os.path.normpath(os.path.join(cwd, name))
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UsageError(f"cannot run {name}: {path} is not an executable file; give the agent's path, "
                             "or its name to find on PATH")
        return path
    found = shutil.which(name, path=search_path)
    if found is None:
        raise UsageError(f"cannot run {name}: not found on PATH ({search_path}); install it, add its "
                         "directory to PATH, or give its path")
    return os.path.abspath(found)


def _resolve(path: str, links: list[tuple[str, str]]) -> str:
    """The real path of the absolute *path*, adding to *links* each symlink met on the way (its
    path, whose parent is real, and its target)."""
    todo = [p for p in path.split("/") if p]
    done = "/"
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            done = os.path.dirname(done)
            continue
        candidate = os.path.join(done, name)
        if not os.path.islink(candidate):
            done = candidate
            continue
        if len(links) >= _MAX_LINKS:
            raise OSError(errno.ELOOP, f"too many symlinks resolving {path}")
        target = os.readlink(candidate)
        links.append((candidate, target))
        if target.startswith("/"):
            done = "/"
        todo = [p for p in target.split("/") if p] + todo
    return done


def _shared_prefix(prefix: str) -> bool:
    """Whether *prefix* holds far more than one installation: a home, ``~/.local``, ``/``."""
    return (prefix in ("/", "/usr", "/root") or os.path.dirname(prefix) == "/home"
            or os.path.basename(prefix) == ".local")


def package_root(real: str) -> str:
    """The tree the real executable *real* runs from: a Python venv (the directory with
    ``pyvenv.cfg``), an npm package (below ``lib/node_modules`` of a prefix, the package; a
    project's ``node_modules``, all of it, dependencies being its siblings), a native installer's
    ``versions`` directory, a version manager's shim (the manager's tree: the one with
    ``versions`` or ``installs``), a prefix installation (``PREFIX/bin/x`` beside ``PREFIX/lib``, as
    nvm's node and pyenv's python are, unless the prefix is a home or ``~/.local``); else the
    file alone."""
    folder = os.path.dirname(real)
    for venv in (folder, os.path.dirname(folder)):
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            return venv
    parts = real.split("/")
    if "node_modules" in parts:
        first = parts.index("node_modules")
        modules = "/".join(parts[:first + 1])
        if parts[first - 1] != "lib" or first + 2 >= len(parts):
            return modules
        package = parts[first + 1]
        return "/".join(parts[:first + (3 if package.startswith("@") else 2)])
    if os.path.basename(folder) == "versions":
        return folder
    if os.path.basename(folder) == "shims":  # pyenv, rbenv, nodenv, asdf: a shim runs the manager
        for manager in _ancestors(os.path.dirname(folder)):
            if any(os.path.isdir(os.path.join(manager, d)) for d in ("versions", "installs")):
                return manager if not _shared_prefix(manager) else real
        return os.path.dirname(folder)
    prefix = os.path.dirname(folder)
    if os.path.basename(folder) == "bin" and os.path.isdir(os.path.join(prefix, "lib")) and not _shared_prefix(prefix):
        return prefix
    return real


def _ancestors(path: str) -> list[str]:
    """*path* and the directories above it, up to (not including) ``/``."""
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _interpreter(real: str, search_path: str, by_name_only: bool = False) -> str | None:
    """The interpreter a script's ``#!`` line names, resolved (``env NAME`` on *search_path*);
    *by_name_only*: only one named that way."""
    try:
        with open(real, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) != "env":
        return words[0] if os.path.isabs(words[0]) and not by_name_only else None
    name = next((w for w in words[1:] if not w.startswith("-") and "=" not in w), None)
    return shutil.which(name, path=search_path) if name else None


def _venv_base(venv: str) -> str | None:
    """A venv's base interpreter's directory (``home`` in its ``pyvenv.cfg``)."""
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() == "home" and os.path.isabs(value.strip()):
                    return value.strip()
    except OSError:
        return None
    return None


def installation(executable: str, search_path: str, workspace: str = "", depth: int = 0) -> Installation:
    """What the sandbox must show for the absolute *executable* to run as on the host: its
    symlinks, its :func:`package_root`, a venv's base interpreter, and the same for the
    interpreter of a script (its ``#!`` line).

    A file of the *workspace* is the agent's to write: the mount shows it, and of what it names
    only an interpreter found by ``env NAME`` on *search_path* (the user's) is shown, never a
    path its ``#!`` line or a symlink of its own would lead to."""
    links: list[tuple[str, str]] = []
    real = _resolve(executable, links)
    hops = [*(path for path, _ in links), real]
    first = next((i for i, hop in enumerate(hops) if workspace and _inside(hop, workspace)), None)
    if first is not None:  # the rest of the way is the agent's: a link of its own leads nowhere
        interpreter = _interpreter(real, search_path, by_name_only=True) if first == len(links) else None
        found = Installation(tuple(links[:first]))
        if interpreter is not None and depth < _MAX_DEPTH:
            found |= installation(interpreter, search_path, workspace, depth + 1)
        return found
    root = package_root(real)
    found = Installation(tuple(links), (root,))
    if root != real and os.path.isfile(os.path.join(root, "pyvenv.cfg")) and (base := _venv_base(root)):
        found |= installation(os.path.join(base, "python3"), search_path, workspace, _MAX_DEPTH)
    interpreter = _interpreter(real, search_path)
    if interpreter is not None and depth < _MAX_DEPTH and os.path.exists(interpreter):
        found |= installation(interpreter, search_path, workspace, depth + 1)
    return found


def reveal(paths: Iterable[str]) -> Installation:
    """What the sandbox must show for each of *paths* (absolute; those that exist) to read as on
    the host: the symlinks on the way, and the real path."""
    found = Installation()
    for path in paths:
        links: list[tuple[str, str]] = []
        real = _resolve(path, links)
        if os.path.exists(real):
            found |= Installation(tuple(links), (real,))
    return found


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _outermost(trees: Iterable[str]) -> tuple[str, ...]:
    """*trees* without those inside another, sorted."""
    out: list[str] = []
    for tree in sorted(set(trees)):
        if not any(_inside(tree, kept) for kept in out):
            out.append(tree)
    return tuple(out)
