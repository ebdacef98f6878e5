"""``guard check``'s lints: a valid manifest that does not do what its author meant.

Validation (guardfs.manifest) refuses what cannot be used; a lint warns about what can be
used but is almost certainly a mistake, judged against the workspace as it is:

- a pattern that matches nothing in the tree (a typo, or a path that moved);
- a negation that takes nothing out, because another pattern still matches the paths it
  names (``allowed = ["**", "!.github/workflows/"]``: gitignore semantics keep the workflow
  files matched by ``**``; the class for "never written" is ``protected``);
- an ``allowed`` pattern whose every path is also secret or protected (it allows no write);
- a pattern that matches paths inside a generated tree but does not reach in (guardfs.policy:
  one matching at any depth stops at ``.venv/``, ``node_modules/`` unless it names the tree);
- secrets that git tracks, with what each ``forbidden_in_git`` mode does about them;
- a ``secret`` starting with '/' (a path outside the workspace) that the workspace holds
  instead (under ``forbidden`` a leading '/' anchored to the workspace root).

Every :class:`Lint` names the manifest key, the pattern, the problem and the fix. The
module is pure but for reading the workspace (a bounded walk, and git's index and HEAD).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pathspec

from guardfs.events import printable
from guardfs.manifest import Manifest
from guardfs.policy import GUARD_DIR, Classification, PathPolicy, Scope, pattern_applies

__all__ = ["MAX_ENTRIES", "Lint", "lint"]

#: Entries of the workspace looked at, at most (a tree beyond it is said to be checked in part).
MAX_ENTRIES = 200_000
# A name no pattern names, for a directory's contents when the tree holds none.
_PROBE = "zq7x9.k3w"


@dataclass(frozen=True, slots=True)
class Lint:
    """One warning: the manifest key and pattern it is about, what is wrong, what to do."""

    key: str
    pattern: str | None
    problem: str
    fix: str

    def __str__(self) -> str:
        # The problem and the fix quote the workspace's file names, which the agent may have made
        # (a previous run): escaped, so that none writes an escape sequence or a line of its own.
        where = f"{self.key} {self.pattern!r}" if self.pattern is not None else self.key
        return f"{where}: {printable(self.problem)}\n  fix: {printable(self.fix)}"


@dataclass(frozen=True, slots=True)
class _Entry:
    path: str
    is_dir: bool
    tree: str | None  # the generated tree it lies strictly inside

    @property
    def probe(self) -> str:
        return self.path + "/" if self.is_dir else self.path


def lint(manifest: Manifest, workspace: str | os.PathLike[str], git_cache: Path | None = None) -> list[Lint]:
    """The warnings about *manifest* for the workspace at *workspace*, most serious first;
    *git_cache* is where ``guard run`` keeps its check of git's stores (shared: a check here
    spares the run its walk, and the other way round)."""
    root = Path(workspace)
    policy = PathPolicy(manifest)
    entries, complete = _walk(root, policy)
    keyed = _patterns(manifest)
    out = _tracked_secrets(manifest, root, policy, git_cache)
    out += _absolute_secrets(manifest, root)
    out += _void_allowed(manifest, policy, entries)
    out += _idle_negations(keyed, entries)
    reaching = _reaching(keyed, entries)
    out += reaching
    if complete:  # a pattern that only reaches into a generated tree is said so above
        out += _unmatched([kp for kp in keyed if not any((r.key, r.pattern) == kp for r in reaching)], entries)
    else:
        out.append(Lint("workspace", None, f"more than {MAX_ENTRIES} entries: only the first were looked at, and "
                        "no pattern was called unmatched", "nothing, unless a warning above looks wrong"))
    return out


def _patterns(manifest: Manifest) -> list[tuple[str, str]]:
    """(key, pattern) of every workspace pattern the lints look at."""
    paths = manifest.paths
    return [("paths.allowed", p) for p in paths.allowed] + paths.secret_patterns + [
        ("paths.protected", p) for p in paths.protected]


def _walk(root: Path, policy: PathPolicy) -> tuple[list[_Entry], bool]:
    """Every path of the workspace but git's and the guard's own, at most MAX_ENTRIES;
    and whether that was all of them."""
    out: list[_Entry] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(root / rel if rel else root) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError:
            continue  # unreadable: what the guard cannot read, no lint can judge
        tree = policy.generated_tree(rel) if rel else None
        for entry in found:
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.name == ".git" or path == GUARD_DIR:
                continue
            is_dir = entry.is_dir(follow_symlinks=False)
            out.append(_Entry(path, is_dir, tree))
            if len(out) >= MAX_ENTRIES:
                return out, False
            if is_dir:
                stack.append(path)
    return out, True


def _unmatched(keyed: list[tuple[str, str]], entries: list[_Entry]) -> list[Lint]:
    out = []
    for key, pattern in keyed:
        if pattern.startswith("!"):
            continue  # a negation is judged by _idle_negations
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
        if not any(pattern_applies(spec, e.probe, e.tree) for e in entries):
            fix = ("correct the pattern (relative to the workspace root; a trailing '/' names a directory), "
                   "or remove it")
            if key == "paths.allowed":
                fix += "; a path the agent is to create may stay (its writes are allowed once it exists)"
            else:
                fix += "; a path that may appear during the run may stay"
            out.append(Lint(key, pattern, "matches nothing in the workspace", fix))
    return out


def _idle_negations(keyed: list[tuple[str, str]], entries: list[_Entry]) -> list[Lint]:
    """Negations that take nothing out: every path they name is still matched by the key."""
    out = []
    for key in dict.fromkeys(k for k, _ in keyed):
        patterns = [p for k, p in keyed if k == key]
        spec = pathspec.GitIgnoreSpec.from_lines(patterns)
        for index, pattern in enumerate(patterns):
            if not pattern.startswith("!"):
                continue
            named = pathspec.GitIgnoreSpec.from_lines([pattern[1:]])
            probes = [e.probe for e in entries if e.tree is None and named.match_file(e.probe)]
            probes += [_synthetic(pattern[1:])]
            # What it names, and what lies inside a directory it names: the files are what counts.
            probes += [p + _PROBE for p in probes if p.endswith("/")]
            named_probes = [p for p in probes if named.match_file(p)]
            kept = [(p, hit.index) for p in named_probes
                    if (hit := spec.check_file(p)).include and hit.index is not None and hit.index != index]
            if not named_probes or len(kept) < len(named_probes):
                continue  # it takes something out
            shown = next((p for p, _ in kept if _PROBE not in p and not p.endswith("/")),
                         next((p for p, _ in kept if _PROBE not in p), kept[0][0].replace(_PROBE, "<any file>")))
            winner = patterns[kept[0][1]]
            out.append(Lint(key, pattern, (
                f"takes nothing out: {winner!r} still matches what it names (e.g. {shown}); with gitignore "
                "semantics a pattern that matches a file wins over a negated directory, and a negation only "
                "undoes the patterns before it"), _negation_fix(key, pattern)))
    return out


def _negation_fix(key: str, pattern: str) -> str:
    body = pattern[1:]
    contents = body + "**" if body.endswith("/") else body
    if key == "paths.allowed":
        return (f"to keep the agent from writing there, list {body!r} under [paths] protected (readable, never "
                f"written, even inside allowed); or negate its contents too: '!{contents}', after every pattern "
                "that matches them")
    return f"negate its contents: '!{contents}', after every pattern that matches them"


def _synthetic(pattern: str) -> str:
    """A path *pattern* names, made up by filling its wildcards (for a tree that holds none)."""
    anchored = pattern.lstrip("/")
    parts = [part.replace("**", "zq7x9").replace("*", "zq7x9").replace("?", "z") for part in anchored.split("/")]
    return "/".join(parts)


def _void_allowed(manifest: Manifest, policy: PathPolicy, entries: list[_Entry]) -> list[Lint]:
    """Allowed patterns whose every path is secret or protected: they allow no write."""
    out = []
    secret = {p for _k, p in manifest.paths.secret_patterns}
    protected = set(manifest.paths.protected)
    for pattern in manifest.paths.allowed:
        if pattern.startswith("!"):
            continue
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
        if pattern in secret or pattern in protected:
            wins = "secret" if pattern in secret else "protected"
            verdicts = []
        else:
            verdicts = _voided(spec, policy, entries)
            if not verdicts:
                continue
            wins = "secret" if all(v.scope is Scope.FORBIDDEN for v in verdicts) else "protected"
        which = next((v.describe() for v in verdicts if v.key.startswith("paths.")), f"paths.{wins} {pattern!r}")
        what = "neither read nor written" if wins == "secret" else "read but never written"
        out.append(Lint("paths.allowed", pattern, (
            f"everything it matches is also {wins} ({which}), which wins: it allows no write, and those "
            f"paths are {what}"), (
            f"remove it from allowed if they are {wins}; otherwise take them out of paths.{wins}")))
    return out


def _voided(spec: pathspec.GitIgnoreSpec, policy: PathPolicy, entries: list[_Entry]) -> list[Classification]:
    """The verdicts of what the allowed *spec* matches (files, or directories when it matches
    no file: a directory's own verdict says little), when every one is secret or protected;
    [] as soon as one is not (or when it matches nothing)."""
    verdicts: list[Classification] = []
    for want_dir in (False, True):
        for e in entries:
            if e.is_dir is want_dir and pattern_applies(spec, e.probe, e.tree):
                where = policy.classify(e.path, e.is_dir)
                if where.scope not in (Scope.FORBIDDEN, Scope.PROTECTED):
                    return []
                verdicts.append(where)
        if verdicts:
            return verdicts
    return verdicts


def _reaching(keyed: list[tuple[str, str]], entries: list[_Entry]) -> list[Lint]:
    """Patterns that match paths in a generated tree but stop at it (guardfs.policy)."""
    out = []
    for key, pattern in keyed:
        if pattern.startswith("!"):
            continue
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
        trees: dict[str, list[str]] = {}
        for e in entries:
            if e.tree is not None and pattern_applies(spec, e.probe, e.tree) is False:
                trees.setdefault(e.tree, []).append(e.path)
        for tree, paths in trees.items():
            named = f"{tree}/**/{pattern.removeprefix('**/').lstrip('/')}"
            effect = {"paths.allowed": "writable as in-scope source (they stay generated output)",
                      "paths.protected": "read-only (they stay writable generated output)"}.get(
                key, "secret (they stay readable)")
            out.append(Lint(key, pattern, (
                f"matches {len(paths)} path(s) inside the generated tree {tree}/ (e.g. {paths[0]}) but does not "
                f"reach in: a pattern matching at any depth stops at a generated tree, so they are not {effect}"),
                f"nothing, if that is what you meant (a venv's own migrations/, a package's test certificates); "
                f"to reach in, name the tree: {named!r}"))
    return out


def _absolute_secrets(manifest: Manifest, root: Path) -> list[Lint]:
    """Secrets starting with '/' that the workspace holds relative to its root: under
    ``forbidden`` a leading '/' anchors a pattern to the workspace; under ``secret`` it names
    a path outside it, so one moved from ``forbidden`` would no longer hide the workspace's."""
    out = []
    for entry in manifest.paths.secret:
        if not entry.startswith("/"):
            continue
        inside = entry.strip("/")
        if os.path.lexists(root / inside) and not os.path.lexists(entry):
            out.append(Lint("paths.secret", entry, (
                f"names {entry} outside the workspace (a secret starting with '/' is an absolute path), which "
                f"does not exist, while the workspace holds {inside}, which stays readable"), (
                f"to hide the workspace's, write {inside!r} (anchored at the workspace root: '{inside}' with a "
                "'/' inside it, or under paths.forbidden, where a leading '/' anchors to the workspace)")))
    return out


def _tracked_secrets(manifest: Manifest, root: Path, policy: PathPolicy, git_cache: Path | None) -> list[Lint]:
    """Secrets git holds anywhere (HEAD, the index, and every repository's whole store: the
    check ``guard run`` makes at start, guardfs.githistory), with what each forbidden_in_git
    mode would do about them."""
    from guardfs.githistory import check_workspace

    where: dict[str, list[str]] = {}
    history = check_workspace(
        os.fspath(root), lambda p: policy.classify(p.rstrip("/"), p.endswith("/")).scope is Scope.FORBIDDEN,
        manifest.paths.workspace_secrets, cache_dir=git_cache)
    for repo, found in history.found:
        where.setdefault(found.path, []).extend(w if repo.prefix == "" else f"{w} in {repo.label}" for w in found.where)
    tracked = sorted(where)
    out: list[Lint] = []
    if history.problem is not None:
        out.append(Lint("paths.forbidden_in_git", None, (
            f"{history.problem}; guard run fails closed: {manifest.paths.forbidden_in_git!r} then refuses the start "
            "or hides git"), "remove what the stores hold that you do not need (git gc --prune=now), or run with "
                            'forbidden_in_git = "hide-git"'))
    by_rule: dict[tuple[str, str | None], list[str]] = {}
    for path in tracked:
        verdict = policy.classify(path, False)
        by_rule.setdefault((verdict.key, verdict.pattern), []).append(path)
    mode = manifest.paths.forbidden_in_git
    modes = {
        "refuse": "guard run does not start (exit 65)",
        "hide-git": "guard run hides every git directory from the agent (git does not work in the run)",
        "warn": "guard run starts and warns that their contents are readable through git",
    }
    said = "; ".join(f"{'[now] ' if m == mode else ''}{m!r}: {what}" for m, what in modes.items())
    for (key, pattern), paths in by_rule.items():
        shown = ", ".join(f"{p} ({', '.join(dict.fromkeys(where[p]))})" for p in paths[:5]) + (
            f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        out.append(Lint(key, pattern, (
            f"git holds {len(paths)} secret path(s): {shown}; git show <commit>:<path> would print them "
            f"whatever the mount refuses. forbidden_in_git = {said}"), (
            "if they must only never be written (CI workflows, migrations, lockfiles), move the pattern to "
            "[paths] protected, which git may track; if they are secrets, remove them from git (git rm --cached, "
            "and from history) or choose a forbidden_in_git mode")))
    return out

