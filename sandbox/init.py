"""``guard init``: a commented manifest for one task, from what the repository holds.

It walks the tree once (never into ``.git`` or a generated tree: a virtualenv, node_modules),
and writes ``guard.toml`` at the repository's top level with:

- ``[task]``: the goal as given, an id derived from it;
- ``[paths] allowed``: the ``--allow`` patterns, each checked against the tree;
- ``secret``: the key, credential and ``.env`` patterns that match something here. A match
  git tracks cannot be kept secret (its content is in the history, and ``guard run`` would
  refuse to start): a template (``.env.example``) is left out by a negation, anything else is
  left out and made protected instead, and said;
- ``protected``: CI workflows, migrations and lockfiles, where present;
- ``generated`` only when the ecosystems found need more than the default list (a
  virtualenv under another name, Ruby's ``vendor/bundle``...); otherwise a comment says
  what the default covers.

The text is validated by the code ``guard check`` uses before it is written; an existing
manifest is never replaced without ``--force``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

from guardfs.errors import CantCreateError, UsageError
from guardfs.events import printable
from guardfs.lint import lint
from guardfs.manifest import DEFAULT_GENERATED, DEFAULT_MANIFEST, parse_manifest
from sandbox.exitcodes import Exit

__all__ = ["SECRET_PATTERNS", "InitOptions", "Survey", "init", "render", "survey", "task_id"]

#: Key, credential and environment files, each with what it is (the comment in the manifest).
SECRET_PATTERNS: tuple[tuple[str, str], ...] = (
    (".env*", "dotenv files"),
    ("*.pem", "PEM keys and certificates"),
    ("*.key", "private keys"),
    ("id_rsa*", "SSH keys"),
    ("id_dsa*", "SSH keys"),
    ("id_ecdsa*", "SSH keys"),
    ("id_ed25519*", "SSH keys"),
    ("*.p12", "PKCS#12 key stores"),
    ("*.pfx", "PKCS#12 key stores"),
    ("*.jks", "Java key stores"),
    ("*.keystore", "key stores"),
    ("credentials*.json", "cloud credentials"),
    ("service-account*.json", "cloud credentials"),
    ("*.tfvars", "Terraform variables"),
    (".npmrc", "npm tokens"),
    (".pypirc", "PyPI tokens"),
    (".netrc", "login tokens"),
    (".git-credentials", "git credentials"),
)

# A tracked match whose name says it holds no secret: an example to copy from.
_TEMPLATE = re.compile(r"(example|sample|template|dist|defaults?)", re.IGNORECASE)

#: CI configuration: (pattern, what it is, the path whose presence calls for it).
_CI = (
    (".github/workflows/", "GitHub Actions workflows", ".github/workflows"),
    (".gitlab-ci.yml", "GitLab CI", ".gitlab-ci.yml"),
    (".circleci/", "CircleCI", ".circleci"),
    (".travis.yml", "Travis CI", ".travis.yml"),
    ("azure-pipelines.yml", "Azure Pipelines", "azure-pipelines.yml"),
    ("Jenkinsfile", "Jenkins", "Jenkinsfile"),
    (".buildkite/", "Buildkite", ".buildkite"),
)

#: Lockfiles, protected wherever they are.
_LOCKFILES = ("package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "bun.lockb", "poetry.lock",
              "uv.lock", "Pipfile.lock", "pdm.lock", "Cargo.lock", "go.sum", "Gemfile.lock", "composer.lock",
              "mix.lock", "flake.lock")

#: Ecosystems by a file that marks them: (name, marker names, generated trees they add).
#: What the default list of [paths] generated already covers is named, not repeated.
_ECOSYSTEMS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("Python", ("pyproject.toml", "setup.py", "setup.cfg", "requirements.txt", "Pipfile"),
     (".venv/", "__pycache__/", ".pytest_cache/", ".tox/")),
    ("Node", ("package.json",), ("node_modules/", ".next/")),
    ("Rust", ("Cargo.toml",), ("target/",)),
    ("Java", ("pom.xml", "build.gradle", "build.gradle.kts"), ("target/", "build/", ".gradle/")),
    ("Go", ("go.mod",), ()),  # its caches live outside the workspace
    ("Ruby", ("Gemfile",), ("vendor/bundle/", ".bundle/")),
    ("PHP", ("composer.json",), ("vendor/",)),
    ("Elixir", ("mix.exs",), ("_build/", "deps/")),
    ("Dart", ("pubspec.yaml",), (".dart_tool/",)),
    ("Terraform", ("main.tf",), (".terraform/",)),
)

_DEFAULT_GENERATED = pathspec.GitIgnoreSpec.from_lines(DEFAULT_GENERATED)
# Directories the walk never enters: git's, and every literal directory of the default list.
_SKIP = {".git", *(p.rstrip("/") for p in DEFAULT_GENERATED if p.endswith("/") and not any(c in p for c in "*?["))}
# A walk that has seen this many entries stops, and says so: guard init must stay fast.
_MAX_ENTRIES = 500_000
_GLOB_CHARS = re.compile(r"[*?\[\]\\!#]|^\s|\s$")


@dataclass
class Survey:
    """What the walk of a repository found (paths relative to its top level, '/'-separated)."""

    files: list[str] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)  # each with a trailing '/'
    venvs: list[str] = field(default_factory=list)  # virtualenvs (pyvenv.cfg), whatever their name
    markers: set[str] = field(default_factory=set)  # base names of the ecosystems' marker files
    truncated: bool = False


def survey(root: Path, limit: int = _MAX_ENTRIES) -> Survey:
    """Walk *root* once, never into ``.git``, a generated tree or a symlink."""
    found = Survey()
    markers = {m for _name, names, _trees in _ECOSYSTEMS for m in names}
    stack = [""]
    seen = 0
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(root / rel if rel else root) as listing:
                entries = list(listing)
        except OSError:
            continue  # unreadable: nothing to learn from it
        names = {e.name for e in entries}
        if rel and "pyvenv.cfg" in names:
            found.venvs.append(rel + "/")
            continue
        for entry in entries:
            seen += 1
            if seen > limit:
                found.truncated = True
                return found
            path = f"{rel}/{entry.name}" if rel else entry.name
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                found.dirs.append(path + "/")
                if entry.name not in _SKIP:
                    stack.append(path)
            else:
                found.files.append(path)
                if entry.name in markers:
                    found.markers.add(entry.name)
    return found


def tracked_files(root: Path) -> tuple[set[str], str | None]:
    """The paths git tracks in *root* (its index), and why none could be listed (or None)."""
    if not (root / ".git").exists():
        return set(), None
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=120,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return set(), str(err)
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        return set(), said[-1] if said else f"git ls-files exited {proc.returncode}"
    return {os.fsdecode(p) for p in proc.stdout.split(b"\0") if p}, None


def task_id(goal: str) -> str:
    """A task id from *goal*: its words, lowercased and joined by '-', at most 40 characters."""
    words = re.findall(r"[a-z0-9]+", goal.lower())
    slug = ""
    for word in words:
        if len(slug) + len(word) + 1 > 40:
            break
        slug = f"{slug}-{word}" if slug else word
    return slug or (words[0][:40] if words else "task")


def _anchored(path: str) -> str:
    """A pattern that names exactly *path* (a file, or a directory with its trailing '/')."""
    return path if "/" in path.rstrip("/") else "/" + path


def _toml(text: str) -> str:
    """*text* as a TOML basic string (JSON's escapes are TOML's). JSON leaves DEL and the C1
    controls as they are: TOML refuses DEL, and a terminal showing the file may obey C1's CSI."""
    return _C1.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False))


_C1 = re.compile("[\x7f-\x9f]")


def _named(path: str) -> bool:
    """Whether *path* can be named in a pattern and in TOML as it is."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not _GLOB_CHARS.search(path)


@dataclass
class _Entry:
    pattern: str
    comment: str = ""


@dataclass
class _Plan:
    """What the manifest will say, and what guard init says about it."""

    secret: list[_Entry] = field(default_factory=list)
    secret_found: list[str] = field(default_factory=list)
    secret_absent: list[str] = field(default_factory=list)
    protected: list[_Entry] = field(default_factory=list)
    generated_extra: list[_Entry] = field(default_factory=list)
    covered: list[str] = field(default_factory=list)  # "Python (.venv/, __pycache__/)"
    warnings: list[str] = field(default_factory=list)


def _by_name(paths: Iterable[str]) -> dict[str, list[str]]:
    """*paths* by their last component (a directory's without its trailing '/')."""
    out: dict[str, list[str]] = {}
    for path in paths:
        out.setdefault(path.rstrip("/").rsplit("/", 1)[-1], []).append(path)
    return out


def _plan_secrets(plan: _Plan, found: Survey, tracked: set[str]) -> None:
    # Every secret pattern has no '/': it matches a name, wherever it is. Matching each distinct
    # name once keeps this fast on a tree of a million files.
    files, dirs = _by_name(found.files), _by_name(found.dirs)
    for pattern, what in SECRET_PATTERNS:
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
        matches = sorted(p for name, paths in files.items() if spec.match_file(name) for p in paths)
        if not matches:
            plan.secret_absent.append(pattern)
            continue
        if any(spec.match_file(name + "/") for name in dirs):
            # A directory it would hide whole (a virtualenv called .env): the files it found, by name.
            plan.secret += [_Entry(_anchored(f), what) for f in matches if f not in tracked and _named(f)]
        else:
            plan.secret.append(_Entry(pattern, what))
        for path in matches:
            if path not in tracked:
                plan.secret_found.append(path)
            else:
                _tracked_secret(plan, path, pattern, what)


def _tracked_secret(plan: _Plan, path: str, pattern: str, what: str) -> None:
    """*path*, which *pattern* makes secret, is tracked by git: its content is in the history,
    so it is left out of the secrets (guard run would refuse to start), said and protected
    unless its name says it is a template."""
    shown = printable(path)  # in the warnings: a name anyone may have made, escapes and all
    if not _named(path):
        plan.warnings.append(f"git tracks '{shown}', which {pattern} makes secret; guard run will refuse to start "
                             "until it is untracked (its name cannot be written as an exception)")
        return
    exception = "!" + _anchored(path)
    if any(e.pattern == exception for e in plan.secret):
        return
    template = bool(_TEMPLATE.search(path.rsplit("/", 1)[-1]))
    plan.secret.append(_Entry(exception, "tracked by git: " + ("a template, not a secret" if template
                                                                else "protected instead, see below")))
    if template:
        return
    plan.protected.append(_Entry(_anchored(path), f"tracked by git, so it cannot be secret ({what})"))
    plan.warnings.append(
        f"git tracks {shown}, which looks like a secret ({what}): its content is in the repository's history "
        f"(git show HEAD:{shown}), so it cannot be kept secret; it is protected (read-only) instead. If it is "
        f"a real secret, remove it from git's history, then drop the '{printable(exception)}' line")


def _plan_protected(plan: _Plan, root: Path, found: Survey) -> None:
    for pattern, what, present in _CI:
        if (root / present).exists():
            plan.protected.append(_Entry(pattern, what))
    if any(d.rstrip("/").rsplit("/", 1)[-1] == "migrations" for d in found.dirs):
        plan.protected.append(_Entry("**/migrations/", "database migrations (not those in generated trees)"))
    names = {f.rsplit("/", 1)[-1] for f in found.files}
    for lockfile in _LOCKFILES:
        if lockfile in names:
            plan.protected.append(_Entry(lockfile, "lockfile"))


def _plan_generated(plan: _Plan, found: Survey) -> None:
    for name, markers, trees in _ECOSYSTEMS:
        if not found.markers & set(markers):
            continue
        extra = [t for t in trees if not _DEFAULT_GENERATED.match_file(t)]
        covered = [t for t in trees if _DEFAULT_GENERATED.match_file(t)]
        if covered:
            plan.covered.append(f"{name} ({', '.join(covered)})")
        plan.generated_extra += [_Entry(t, name) for t in extra]
    for venv in found.venvs:
        if not _DEFAULT_GENERATED.match_file(venv) and _named(venv):
            plan.generated_extra.append(_Entry(_anchored(venv), "a Python virtualenv"))


def _check_allow(patterns: Sequence[str], root: Path) -> list[str]:
    """The --allow patterns as the manifest writes them; an absolute path or a '..' is a usage
    error. (One that matches nothing is guard check's warning, said after the manifest is made.)"""
    out = []
    for given in patterns:
        pattern = given.removeprefix("./")
        if os.path.isabs(given) or given.startswith("~"):
            raise UsageError(f"--allow {given}: patterns are relative to the repository's top level {root}, not "
                             "absolute; give e.g. --allow src/checkout/")
        if ".." in pattern.split("/"):
            raise UsageError(f"--allow {given} escapes the repository with '..'; patterns are relative to its top "
                             f"level {root}")
        out.append(pattern)
    return out


def _array(key: str, entries: Iterable[_Entry]) -> list[str]:
    rows = list(entries)
    if not rows:
        return [f"{key} = []"]
    width = max(len(_toml(e.pattern)) for e in rows) + 1
    lines = [f"{key} = ["]
    for e in rows:
        item = f"{_toml(e.pattern)},"
        lines.append(f"    {item:<{width}}  # {e.comment}" if e.comment else f"    {item}")
    return [*lines, "]"]


def _comment(text: str) -> list[str]:
    """*text* as comment lines of at most 100 characters."""
    return textwrap.wrap(text, 98, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False,
                         break_long_words=False)


def _packed(key: str, patterns: Sequence[str], extra: Sequence[_Entry]) -> list[str]:
    """An array of *patterns* several to a line, then *extra* one to a line with its comment."""
    items = [f"{_toml(p)}," for p in patterns]
    lines = [f"{key} = ["]
    lines += ["    " + row for row in textwrap.wrap(" ".join(items), 96, break_on_hyphens=False,
                                                    break_long_words=False)]
    return [*lines, *_array(key, extra)[1:]]


def _list(paths: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def render(goal: str, ident: str, allowed: Sequence[str], plan: _Plan) -> str:
    """The manifest's text."""
    lines = [
        f"# {DEFAULT_MANIFEST}: the scope of one agent task, obeyed by `guard run -- <agent>` (written by",
        "# guard init). Edit it freely; `guard check` validates it. Paths are gitignore-style patterns,",
        "# relative to this directory; the agent may read this file, never write it.",
        "",
        "[task]",
        "# What the agent was asked to do: quoted back to it whenever the guard refuses something.",
        f"id = {_toml(ident)}",
        f"goal = {_toml(goal)}",
        "",
        "[paths]",
        "# Where the agent may write. Everything else it may read, not write (a write is refused).",
        *_array("allowed", (_Entry(p) for p in allowed)),
        "",
        "# Never read, never written, even inside `allowed`: keys, credentials, .env files.",
    ]
    if plan.secret_found:
        # Their names are anyone's (an agent's, an earlier run's): escaped, or a control character
        # would make the comment invalid TOML, and guard init refuse to write the manifest.
        lines += _comment(f"Found here: {_list([printable(p) for p in plan.secret_found])}.")
    lines.append("# Git may not track a secret (guard run refuses to start): see forbidden_in_git.")
    lines += _array("secret", plan.secret)
    if plan.secret_absent:
        lines += _comment(f"Not found here; add them if they appear: {', '.join(plan.secret_absent)}.")
    lines += [
        "",
        "# Readable, never written, even inside `allowed`: CI workflows, migrations, lockfiles.",
        *_array("protected", plan.protected),
        "",
        "# Caches, build output, installed packages: what tools write there is never counted,",
        "# never tripped on, never kept for rollback.",
    ]
    if plan.covered:
        lines += _comment(f"The default list has the trees of the ecosystems found here: {'; '.join(plan.covered)}.")
    if plan.generated_extra:
        lines.append("# The default list, then what this repository adds (setting it replaces the default):")
        lines += _packed("generated", DEFAULT_GENERATED, plan.generated_extra)
    else:
        lines.append("# Not set: the default list applies (guard check -v shows it; setting it replaces it).")
    lines += [
        "",
        "# [limits] (max_files = 20, max_rewrites = 3, ...), [breaker], [sandbox] and [record] keep",
        "# their defaults: guard schema lists every key.",
    ]
    return "\n".join(lines) + "\n"


def _validate(text: str, source: str, root: Path, plan: _Plan) -> list[str]:
    """Refuse what guard check refuses (ManifestError, 65, naming the key); return its lints,
    but for those about what guard init chose knowing it: a protected pattern of its own that
    stops at a generated tree (Django's migrations inside .venv/ stay writable). A secret one
    is said: what it leaves readable there may be a copy of the secret (a build's dist/.env)."""
    manifest = parse_manifest(text, source)
    ours = {("paths.protected", e.pattern) for e in plan.protected}
    return [str(w) for w in lint(manifest, root)
            if not ((w.key, w.pattern) in ours and "generated tree" in w.problem)]


@dataclass
class InitOptions:
    """What ``guard init`` was asked to do."""

    goal: str
    allow: list[str]
    cwd: Path
    ident: str | None = None
    force: bool = False
    workspace: str | None = None


def init(opts: InitOptions) -> int:
    """Write the manifest; returns the exit status."""
    from sandbox.launch.workspace import workspace_for

    root = workspace_for(opts.cwd, opts.workspace)
    if not root.is_dir():
        raise UsageError(f"workspace {root} is not a directory; give the repository with --workspace DIR")
    target = root / DEFAULT_MANIFEST
    if os.path.lexists(target) and not opts.force:
        raise UsageError(f"{target} already exists; edit it (guard check validates it), or pass --force to "
                         "replace it")
    if not opts.goal.strip():
        raise UsageError('the goal is empty; say what the agent is to do: guard init --allow DIR "fix the bug"')
    allowed = _check_allow(opts.allow, root)
    found = survey(root)
    warnings: list[str] = []
    tracked, untracked_why = tracked_files(root)
    if untracked_why is not None:
        warnings.append(f"cannot ask git which files it tracks ({untracked_why}); every secret found is "
                        "written as a secret")
    plan = _Plan()
    _plan_secrets(plan, found, tracked)
    _plan_protected(plan, root, found)
    _plan_generated(plan, found)
    if found.truncated:
        warnings.append(f"the tree has more than {_MAX_ENTRIES} entries: only the first were looked at; check the "
                        "secret and protected lists by hand")
    text = render(opts.goal.strip(), opts.ident or task_id(opts.goal), allowed, plan)
    warnings += _validate(text, str(target), root, plan)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if opts.force else os.O_EXCL)
        with open(target, "w", encoding="utf-8", opener=lambda p, _f: os.open(p, flags, 0o644)) as out:
            out.write(text)
    except OSError as err:
        raise CantCreateError(f"cannot write {target}: {err.strerror or err}; run guard init where you may "
                              "write, or give --workspace DIR") from err
    for warning in [*plan.warnings, *warnings]:
        print(f"guard init: warning: {warning}", file=sys.stderr)
    secrets = sum(not e.pattern.startswith("!") for e in plan.secret)
    scope = ", ".join(allowed) if allowed else "nothing (read-only)"
    print(f"wrote {target}: writes to {scope}; {secrets} secret and {len(plan.protected)} protected pattern(s). "
          "Next: guard run -- <agent>")
    return Exit.OK
