"""The scope manifest: what a task may touch, validated strictly.

A manifest is TOML with the sections ``[task]``, ``[paths]``, ``[limits]``, ``[breaker]``,
``[sandbox]`` and ``[record]``. Every field is described where it is declared. Unknown
keys, wrong types and bad patterns are errors that name the file, the key and the reason;
an invalid manifest is never replaced by defaults.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import pathspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)
from pydantic_core import ErrorDetails

from guardfs.errors import ManifestError
from guardfs.rules import RULES, Rule, default_recoverable

__all__ = [
    "DEFAULT_GENERATED", "DEFAULT_HOME_SECRETS", "DEFAULT_MANIFEST", "RULES", "BreakerSettings", "Limits", "Manifest",
    "Paths", "Record", "Rule", "Task",
    "is_outside_secret",
    "load_manifest",
    "outside_secrets",
    "parse_manifest",
]

# Paths no pattern should match unless it matches nearly everything: a random name at the
# root, with an extension, and one directory down.
_BROAD_PROBES = ("zq7x9", "zq7x9.k3w", "zq7x9/yk3w2.k3w", "zq7x9/yk3w2/")


def _check_pattern(pattern: str) -> str:
    if not pattern.strip():
        raise ValueError("an empty pattern matches nothing; remove it")
    if "\0" in pattern or "\n" in pattern:
        raise ValueError(f"{pattern!r} contains a NUL or newline character")
    body = pattern[1:] if pattern.startswith("!") else pattern
    parts = [p for p in body.split("/") if p]
    if ".." in parts:
        raise ValueError(f"{pattern!r} escapes the workspace root with '..'; patterns are relative to it")
    if "." in parts:
        raise ValueError(f"{pattern!r} has a '.' component; write the path without './'")
    try:
        spec = pathspec.GitIgnoreSpec.from_lines([pattern])
    except Exception as err:  # pathspec raises several types for a bad pattern
        raise ValueError(f"{pattern!r} is not a valid gitignore-style pattern: {err}") from err
    if getattr(spec.patterns[0], "include", None) is None:
        raise ValueError(
            f"{pattern!r} is not a valid gitignore-style pattern: it matches nothing "
            "(a '#' comment, or an unclosed '[')"
        )
    return pattern


def _refuse_broad(pattern: str, consequence: str) -> str:
    """*pattern*, unless it would match nearly every file: then a ValueError saying
    *consequence* ("it would ...; what to do instead")."""
    spec = pathspec.GitIgnoreSpec.from_lines([pattern])
    if not pattern.startswith("!") and any(spec.match_file(p) for p in _BROAD_PROBES):
        raise ValueError(f"{pattern!r} is over-broad: {consequence}")
    return pattern


def _check_not_broad(pattern: str) -> str:
    return _refuse_broad(pattern, (
        "it would forbid nearly every file in the workspace; name the files or directories to "
        "protect, or use a read-only profile (paths.allowed = []) to forbid writes everywhere"))


def _check_generated_not_broad(pattern: str) -> str:
    return _refuse_broad(pattern, (
        "it would make nearly every file generated output, which no limit counts and no "
        "rollback restores; name the cache or build directories instead"))


def _check_protected_not_broad(pattern: str) -> str:
    parts = [p for p in pattern.lstrip("!").split("/") if p]
    if parts and parts[0] == ".git":
        raise ValueError(f"{pattern!r} names git's internals, which paths.protected does not govern; set "
                         "paths.git_internals = \"read-only\" to make them read-only")
    return _refuse_broad(pattern, (
        "it would make nearly every file read-only; for a read-only workspace leave paths.allowed "
        "empty, and name the files or directories that must never be written"))


def is_outside_secret(entry: str) -> bool:
    """Whether a ``[paths] secret`` entry names a path outside the workspace (``~/...`` or
    absolute) rather than a workspace pattern."""
    return entry.startswith(("~/", "/"))


def _check_secret(entry: str) -> str:
    if not is_outside_secret(entry):
        return _check_not_broad(_check_pattern(entry))
    if any(c in entry for c in "*?[]\\\0\n"):
        raise ValueError(f"{entry!r}: a secret outside the workspace (starting with '~/' or '/') is a literal "
                         "path, not a pattern; name each file or directory")
    parts = [p for p in entry.removeprefix("~/").split("/") if p]
    if ".." in parts or "." in parts:
        raise ValueError(f"{entry!r} has a '.' or '..' component; write the path it means")
    if not parts:
        whole = "home" if entry.startswith("~") else "filesystem"
        raise ValueError(f"{entry!r} is over-broad: it would hide the whole {whole}; "
                         "name the credential files or directories")
    return entry


Pattern = Annotated[str, AfterValidator(_check_pattern)]
ForbiddenPattern = Annotated[str, AfterValidator(_check_pattern), AfterValidator(_check_not_broad)]
SecretEntry = Annotated[str, AfterValidator(_check_secret)]
ProtectedPattern = Annotated[str, AfterValidator(_check_pattern), AfterValidator(_check_protected_not_broad)]
GeneratedPattern = Annotated[str, AfterValidator(_check_pattern), AfterValidator(_check_generated_not_broad)]

#: The caches and build outputs of common tooling, the default of ``[paths] generated``
#: (docs/reference.md lists them by ecosystem). Go keeps its build and module caches outside the
#: workspace (GOCACHE, GOMODCACHE under $HOME), so it adds nothing here.
DEFAULT_GENERATED: tuple[str, ...] = (
    # Python: bytecode, tool caches, test and coverage output, environments, packaging output
    "__pycache__/", "*.py[co]", ".pytest_cache/", "pytest-cache-files-*/", ".mypy_cache/", ".dmypy.json",
    ".ruff_cache/", ".hypothesis/", ".benchmarks/", ".coverage", ".coverage.*", "htmlcov/", ".tox/",
    ".nox/", ".venv/", ".eggs/", "*.egg-info/", ".pytype/", ".pyre/",
    # Node: installed packages and tool caches
    "node_modules/", ".npm/", ".eslintcache", ".parcel-cache/", ".next/", ".nuxt/", ".turbo/",
    "*.tsbuildinfo",
    # Rust (cargo) and Java (Maven: target/; Gradle: build/, .gradle/); build/ and dist/ of any tool
    "target/", ".gradle/", "*.class", "build/", "dist/",
)


#: Where ``guard init`` writes the manifest and where ``guard run`` and ``guard check`` look
#: for it without ``--manifest``: this file at the workspace's top level (read-only to the agent).
DEFAULT_MANIFEST = "guard.toml"

#: The usual credential stores under the agent's home, relative to it: masked in every sandbox,
#: whether or not ``guard run --user`` is given and whatever the manifest says (docs/reference.md
#: lists them). ``[paths] secret`` entries starting with ``~/`` or ``/`` add to them.
DEFAULT_HOME_SECRETS: tuple[str, ...] = (
    ".ssh", ".gnupg", ".password-store", ".aws", ".azure", ".config/gcloud", ".kube", ".docker/config.json",
    ".netrc", ".git-credentials", ".config/gh/hosts.yml", ".npmrc", ".yarnrc.yml", ".pypirc",
    ".cargo/credentials", ".cargo/credentials.toml", ".gem/credentials", ".m2/settings-security.xml",
    ".terraform.d/credentials.tfrc.json", ".vault-token", ".boto", ".s3cfg", ".config/hub",
)


def outside_secrets(paths: Paths, home: str) -> list[str]:
    """The absolute paths outside the workspace that the sandbox masks for an agent whose home is
    *home*: :data:`DEFAULT_HOME_SECRETS`, then the manifest's own ``~/`` and absolute secrets
    (``~`` is *home*), each once, in that order."""
    out = [os.path.join(home, name) for name in DEFAULT_HOME_SECRETS]
    for entry in paths.secret:
        if is_outside_secret(entry):
            full = os.path.join(home, entry[2:]) if entry.startswith("~/") else entry
            out.append(os.path.normpath(full))
    return list(dict.fromkeys(out))


def _unlimited(value: object) -> object:
    if isinstance(value, str):
        if value != "unlimited":
            raise ValueError(f'expected a positive integer or "unlimited", got {value!r}')
        return None
    return value


# A positive limit, or the string "unlimited" (TOML has no null).
Limit = Annotated[Annotated[int, Field(ge=1)] | None, BeforeValidator(_unlimited)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Task(_Strict):
    """What the agent was asked to do; quoted back to it in corrective feedback."""

    id: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")] = Field(
        description="Short identifier of the task: letters, digits, '.', '_' and '-'."
    )
    goal: Annotated[str, Field(min_length=1, max_length=4000)] = Field(
        description="One or two sentences stating the task's goal, in the agent's own terms."
    )


class Paths(_Strict):
    """Which paths the agent may write, which it may only read, and which it may not even read.

    Patterns are gitignore-style (pathspec ``GitIgnoreSpec``), relative to the workspace
    root; a leading '/' anchors a pattern to the root, a trailing '/' matches a directory
    and everything below it. Precedence: the guard's built-in protections first, then
    ``secret`` (and ``forbidden``), then ``protected``, then ``generated``, then ``allowed``;
    a path matched by none is out of scope (readable, not writable). A pattern that can match
    at any depth ('**/migrations/', '*.pem') does not reach into a generated tree ('.venv/',
    'node_modules/') unless it names that tree ('.venv/**/x').
    """

    allowed: list[Pattern] = Field(
        default_factory=list,
        description="Where writes may land. Empty (the default) means a read-only workspace.",
    )
    secret: list[SecretEntry] = Field(
        default_factory=list,
        description=(
            "Paths that can be neither read nor written (keys, .env files, credentials); wins over "
            "every other key. An entry starting with '~/' or '/' is a literal path outside the "
            "workspace ('~' is the agent's home), hidden in the sandbox in addition to the usual "
            "credential stores (docs/reference.md lists them); any other entry is a workspace pattern. Git may "
            "not track a secret (see forbidden_in_git). Over-broad patterns such as '*' or '**' are "
            "refused."
        ),
    )
    forbidden: list[ForbiddenPattern] = Field(
        default_factory=list,
        description=(
            "The former name of 'secret', kept working with the same meaning for workspace "
            "patterns: the guard treats the union of both as secrets, and a refusal names the key "
            "its pattern came from."
        ),
    )
    protected: list[ProtectedPattern] = Field(
        default_factory=list,
        description=(
            "Paths that can be read but never written, even inside 'allowed' or 'generated' (CI "
            "workflows, migrations, lockfiles): a write is refused with EROFS and counts as a "
            "refused write. Git may track them. The manifest itself (guard.toml at the workspace "
            "root) is always protected. 'secret' wins over it."
        ),
    )
    generated: list[GeneratedPattern] = Field(
        default_factory=lambda: list(DEFAULT_GENERATED),
        description=(
            "Caches and build output that tools write (bytecode, test and type-checker caches, "
            "installed packages, build directories). Writes there never count toward max_files or "
            "max_rewrites, are not kept for rollback, and never trip the breaker. Inside 'allowed' "
            "they land in the workspace (but Python bytecode, which goes to the scratch layer in scope "
            "too; a literal directory that exists when guard run starts, "
            "such as '.venv/', is bound natively: see [sandbox] native_generated); outside it they "
            "land in the run's scratch layer, which the agent sees and the workspace never does "
            "(without a run directory, as under guard mount without --run-dir, they are refused "
            "with EROFS: a denial, never a trip). 'secret', "
            "'protected' and the built-in protections win over it. Setting it replaces the default list "
            "(docs/reference.md lists it); [] turns it off."
        ),
    )
    generated_from_gitignore: bool = Field(
        default=False,
        description=(
            "Also treat what the repository's own root .gitignore ignores as generated, as it "
            "reads when the guard starts (later edits of .gitignore change nothing). 'secret' and "
            "'protected' still win."
        ),
    )
    git_internals: Literal["writable", "read-only"] = Field(
        default="writable",
        description=(
            "Whether git's own files under .git/ (index, objects, refs, locks, stash) may be "
            "written so that git add/commit/stash/checkout work. They never count toward "
            "the limits. .git/hooks/ and an existing .git/config are read-only either way."
        ),
    )
    forbidden_in_git: Literal["refuse", "hide-git", "warn"] = Field(
        default="refuse",
        description=(
            "What guard does when git's stores hold a secret at start (in any commit, the index, a "
            "stash, a reflog or an unreachable object of any repository in the workspace; protected "
            "paths may be tracked): "
            "its content is then readable through git's object store (git show HEAD:.env) "
            "whatever the mount refuses. 'refuse' (the default): do not start, naming them. "
            "'hide-git': run with .git/ forbidden to the agent (git does not work in the "
            "workspace). 'warn': run, and say at start that their contents are readable "
            "through git. When git tracks no secret, every mode runs unchanged."
        ),
    )

    @property
    def secret_patterns(self) -> list[tuple[str, str]]:
        """The workspace secrets as (manifest key, pattern): ``secret``'s workspace patterns,
        then ``forbidden``'s; the ``~/`` and absolute entries are :func:`outside_secrets`."""
        return ([("paths.secret", p) for p in self.secret if not is_outside_secret(p)]
                + [("paths.forbidden", p) for p in self.forbidden])

    @property
    def workspace_secrets(self) -> list[str]:
        """The patterns of :attr:`secret_patterns`, for whoever needs no key."""
        return [p for _key, p in self.secret_patterns]


class Limits(_Strict):
    """The breaker's thresholds. A limit is a positive integer or "unlimited"."""

    max_files: Limit = Field(
        default=20,
        description="Blast radius: distinct files (not directories) the agent may mutate.",
    )
    max_rewrites: Limit = Field(
        default=3,
        description=(
            "Oscillation: how often the same (file, symbol) - or for non-Python files the "
            "same changed region - may be rewritten; one more is refused. A return to an "
            "earlier content counts as a rewrite too."
        ),
    )
    max_returns: Limit = Field(
        default=1,
        description=(
            "Oscillation: how many times a file may return to an earlier content of its own "
            "(a revert: A->B->A is one) before the next return is refused; with 1, A->B->A is "
            "allowed and A->B->A->B trips. A file deleted and made again starts a new history; "
            "a content made by truncation alone (truncate, ftruncate, O_TRUNC) is no version; "
            "git putting back a version it holds (stash, checkout, reset) is exempt once per version."
        ),
    )
    window_steps: Annotated[int, Field(ge=1)] = Field(
        default=5, description="Token surge: the sliding window, in agent steps."
    )
    max_window_tokens: Limit = Field(
        default=60000, description="Token surge: tokens allowed within the window."
    )
    max_tokens_without_progress: Limit = Field(
        default=80000,
        description="Token velocity: tokens spent with no file change and no passing test.",
    )
    max_consecutive_failures: Limit = Field(
        default=3, description="Non-zero tool exits in a row before the breaker trips."
    )
    max_identical_calls: Limit = Field(
        default=3,
        description="Identical tool calls (same tool and arguments): warn at the 2nd, trip here.",
    )
    stagnation_similarity: Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        default=0.85,
        description="Stagnation: similarity of consecutive tool inputs above this, with failures.",
    )
    idle_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=300.0, description="Seconds with no socket traffic and no output before tripping."
    )
    max_steps: Limit = Field(default=None, description="Optional turn budget; unlimited by default.")


class BreakerSettings(_Strict):
    """How the circuit breaker recovers from a trip (the ``[breaker]`` section)."""

    # strict=False lets the TOML string name its Rule (strict mode wants an instance);
    # a name not in the enum is still refused, with the list of names.
    recoverable: list[Annotated[Rule, Field(strict=False)]] = Field(
        default_factory=default_recoverable,
        description=(
            "Rules whose first trip is recoverable: the offending operation is refused and "
            "the agent gets corrective feedback (HALF_OPEN_REANCHOR); a second violation is "
            "terminal. Any other rule's trip is terminal at once. forbidden_path recovers "
            "once per run: its second trip is terminal even after the breaker closed. "
            "Default: all but idle_transport and step_budget."
        ),
    )
    rollback_on_consecutive_failures: bool = Field(
        default=False,
        description=(
            "When the consecutive_failures breaker trips, also roll the workspace back to the "
            "last checkpoint (the run's start, the last passing test, or guard checkpoint)."
        ),
    )
    on_terminal: Literal["auto", "freeze", "stop"] = Field(
        default="auto",
        description=(
            "What a terminal trip does to the agent: 'freeze' its process tree until a human "
            "runs guard approve or guard stop, or 'stop' it (exit 75). 'auto' (the default) "
            "freezes only when someone can approve: the guard's stderr is a terminal and CI "
            "is not set; otherwise it stops. --ci always stops."
        ),
    )


def _check_writable(path: str) -> str:
    full = os.path.expanduser(path)
    if not os.path.isabs(full):
        raise ValueError(f"{path!r} must be an absolute path (or start with ~)")
    if os.path.normpath(full) == "/" or ".." in full.split("/"):
        raise ValueError(f"{path!r} is over-broad or escapes with '..'; name the directory the agent needs")
    return path


def _check_unix_socket(entry: str) -> str:
    if entry.startswith("@"):
        if len(entry) < 2 or len(entry.encode()) > 107:
            raise ValueError(f"{entry!r}: an abstract socket's name follows the '@' (at most 107 bytes)")
        return entry
    full = os.path.expanduser(entry)
    if not os.path.isabs(full) or ".." in full.split("/"):
        raise ValueError(f"{entry!r} must be an absolute path (or start with ~), without '..', "
                         "or '@name' for an abstract socket")
    return entry


def _check_lane(path: str) -> str:
    parts = path.strip("/").split("/")
    if path.startswith("/") or not path.strip("/"):
        raise ValueError(f"{path!r} must be a directory relative to the workspace root, like 'node_modules'")
    if any(c in path for c in "*?[\\!"):
        raise ValueError(f"{path!r}: fast lanes are literal directory paths, not patterns")
    if ".." in parts or "." in parts or "" in parts:
        raise ValueError(f"{path!r} must be a plain relative path (no '.', '..' or '//')")
    if parts[0] in (".git", ".guard"):
        raise ValueError(f"{path!r}: {parts[0]}/ cannot be a fast lane (git and the guard write there)")
    return path.strip("/")


def _check_env_name(name: str) -> str:
    body = name[:-1] if name.endswith("*") else name
    if not body or not all(c.isalnum() or c == "_" for c in body) or body[0].isdigit():
        raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_'; "
                         "a trailing '*' for a prefix)")
    return name


class SandboxSettings(_Strict):
    """What the agent may write or read outside the workspace when ``guard run`` isolates it,
    and which subtrees it reads natively (fast lanes)."""

    writable: list[Annotated[str, AfterValidator(_check_writable)]] = Field(
        default_factory=list,
        description=(
            "Extra directories (absolute, or starting with ~) the agent may write, such as its "
            "own configuration directory. Everything else outside the workspace and a private "
            "/tmp is read-only. Paths that do not exist are skipped."
        ),
    )
    readable: list[Annotated[str, AfterValidator(_check_writable)]] = Field(
        default_factory=list,
        description=(
            "Extra paths (absolute, or starting with ~, the agent's home) the agent may read, "
            "read-only, where the sandbox hides them: the homes (/root, /home) and /tmp are empty "
            "inside, but for the agent's own installation (found on PATH and shown by itself) and "
            "the state its adapter names. For what a generic agent needs beyond that, like a "
            "'~/.config/myagent' directory. Credential stores stay masked inside them. Paths that "
            "do not exist are skipped."
        ),
    )
    fast_lanes: list[Annotated[str, AfterValidator(_check_lane)]] = Field(
        default_factory=list,
        description=(
            "Heavy, read-mostly directories of the workspace (e.g. 'node_modules', '.venv') that "
            "guard run binds natively read-only into the sandbox, so reading them never crosses "
            "FUSE. A lane is made only where no paths.forbidden pattern can match beneath it, now "
            "or later (one matching at any depth, like '.env*', leaves no lanes; an anchored one "
            "keeps its way behind the mount). The agent cannot write there at all, and "
            "neither its reads nor its refused writes there reach the breaker."
        ),
    )
    out_of_scope_fast_lanes: bool = Field(
        default=False,
        description=(
            "Also bind natively read-only every directory that lies wholly outside paths.allowed "
            "(needs allowed patterns anchored at a literal directory, like 'src/checkout/**'). "
            "Faster reads; but a write attempted there is refused by the kernel and never reaches "
            "the breaker, so scope_spill does not see it."
        ),
    )

    native_generated: bool = Field(
        default=True,
        description=(
            "Bind each literal directory of paths.generated that exists inside paths.allowed at the "
            "start (and, with a root guard, each one made during the run) natively and writable into "
            "the sandbox: installs and builds there run at native "
            "speed and never reach the breaker (they would not count anyway). Forbidden paths "
            "inside are masked. false: everything goes through the mount."
        ),
    )

    # ----- what the agent's process gets from the host ------------------------------------
    env: list[Annotated[str, AfterValidator(_check_env_name)]] = Field(
        default_factory=list,
        description=(
            "Environment variables an agent of another user (guard run --user) receives from "
            "the guard's environment, beyond PATH, HOME, USER, LOGNAME, LANG, LANGUAGE, LC_*, "
            "TERM, COLORTERM and TZ: typically its API variables, like 'ANTHROPIC_API_KEY'. A "
            "trailing '*' names a prefix ('ANTHROPIC_*'). Nothing else of the guard's (root's) "
            "environment reaches it."
        ),
    )
    network: Literal["host", "none"] = Field(
        default="host",
        description=(
            "'host' (default): the agent shares the host's network, as it must to reach its "
            "model: it can connect to anything the host can over TCP and UDP, the host's "
            "127.0.0.1 listeners included (never to the host's unix sockets, abstract or not, "
            "but those unix_sockets names). 'none': a network namespace of its own with "
            "loopback only (for agents with a local model, or steps that need no network)."
        ),
    )

    unix_sockets: list[Annotated[str, AfterValidator(_check_unix_socket)]] = Field(
        default_factory=list,
        description=(
            "Unix sockets of the host the agent may connect to, in either network mode (an "
            "ssh-agent's, say): paths (absolute, or starting with ~, the agent's home), each of "
            "which must exist and be a socket when the run starts (it is shown in the sandbox at "
            "the same path), or '@name' for an abstract socket (reachable only in 'host' mode). "
            "Every other socket of the host is refused (EACCES, recorded); the guard's agent socket "
            "and sockets the agent makes itself (under /tmp, in the workspace) always work."
        ),
    )

    # ----- what a run may record on the host's disk ---------------------------------
    log_max_bytes: Annotated[int, Field(ge=4096, le=1 << 40)] = Field(
        default=64 << 20,
        description=(
            "The most each recorded log keeps, in bytes: the agent's stdout.log and stderr.log "
            "and each guard exec log. Over it, a log keeps its first half and its last half, with "
            "one marker line between them saying how many bytes were left out; the run summary "
            "says so. Default 64 MiB."
        ),
    )
    checkpoint_max_bytes: Annotated[int, Field(ge=0, le=1 << 50)] = Field(
        default=1 << 30,
        description=(
            "The most the pre-images of all the run's restore points together (RUN_DIR/checkpoint/) "
            "may take, in bytes of file data (holes of sparse files cost nothing). A file whose copy "
            "would pass it is recorded as not restorable: an event says so when it happens, and "
            "guard rollback names it and leaves it as it is. Default 1 GiB; 0 keeps no file copies."
        ),
    )


class Record(_Strict):
    """How much the guard records about a run: bounds on what the agent can make it write.

    The agent controls how many events, notes and ledger entries it causes; these caps keep
    the run directory bounded however long or hostile the session. What a cap leaves out
    is counted and said where it was left out; denials, trips and breaker changes are
    never dropped from the event log.
    """

    events_max_bytes: Annotated[int, Field(ge=4096)] = Field(
        default=64 * 1024 * 1024,
        description=(
            "Size of events.jsonl beyond which events are dropped (counted, and the count "
            "written as one 'dropped' line). Denials, trips and breaker changes are still "
            "written past it. Default 64 MiB."
        ),
    )
    events_per_second: Annotated[float, Field(gt=0)] = Field(
        default=1000.0,
        description=(
            "Sustained rate of events written; faster events are dropped and counted (a token "
            "bucket refilled at this rate). Denials, trips and breaker changes are never dropped."
        ),
    )
    events_burst: Annotated[int, Field(ge=1)] = Field(
        default=10000,
        description="Events that may be written at once above events_per_second (the bucket's size).",
    )
    max_notes: Annotated[int, Field(ge=1)] = Field(
        default=100,
        description="Notes the ledger keeps (the most recent); older ones are dropped and counted.",
    )
    max_note_chars: Annotated[int, Field(ge=16)] = Field(
        default=1000,
        description="Characters of one note kept; a longer note is cut, with a marker saying so.",
    )
    ledger_max_items: Annotated[int, Field(ge=2)] = Field(
        default=100,
        description=(
            "Entries of each list in ledger.json and STATE.md (trips, files, notes, checkpoints, "
            "a file's symbols); beyond it the first and the most recent are shown and the number "
            "left out is said."
        ),
    )
    ledger_min_interval_s: Annotated[float, Field(ge=0.0, le=60.0)] = Field(
        default=0.25,
        description=(
            "Least time between two rewrites of ledger.json and STATE.md in the run directory; "
            "changes in between are coalesced into the next rewrite, and the final state is "
            "always written when the run ends. (.guard/STATE.md in the mount is always current.)"
        ),
    )


class Manifest(_Strict):
    """A task's scope: the ``[task]``, ``[paths]``, ``[limits]``, ``[breaker]``, ``[sandbox]``
    and ``[record]`` sections."""

    task: Task = Field(description="The task being governed.")
    paths: Paths = Field(default_factory=Paths, description="Scope of reads and writes.")
    limits: Limits = Field(default_factory=Limits, description="Breaker thresholds.")
    breaker: BreakerSettings = Field(default_factory=BreakerSettings, description="Recovery from trips.")
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description="Isolation of guard run.")
    record: Record = Field(default_factory=Record, description="Bounds on the event log, notes and ledger.")

    @property
    def read_only(self) -> bool:
        """True when the manifest allows no write outside git's internals."""
        return not self.paths.allowed


def _key(loc: tuple[int | str, ...]) -> str:
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif not re.fullmatch(r"function-after\[.*\]|int|none|str", part):
            key += f".{part}" if key else part
    return key


def _reason(err: ErrorDetails) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key (a typo? 'guard schema' lists every key)"
    if kind == "missing":
        return "required key is missing"
    msg: str = err["msg"]
    return msg.removeprefix("Value error, ")


def parse_manifest(text: str, source: str = "<manifest>") -> Manifest:
    """Parse and validate manifest TOML; raise ManifestError naming each problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ManifestError(source, [("", f"not valid TOML: {err}")]) from err
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        problems: dict[str, str] = {}
        for e in err.errors():
            problems.setdefault(_key(e["loc"]), _reason(e))
        raise ManifestError(source, list(problems.items())) from err


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest file; raise ManifestError (naming the file) if it is unusable."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ManifestError(str(path), [("", f"cannot read: {err}")]) from err
    return parse_manifest(text, str(path))
