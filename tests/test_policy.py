"""The compiled policy: its forbidden/allowed matching agrees with real git, and the
built-in protections hold whatever the manifest says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from guardfs.manifest import parse_manifest
from guardfs.policy import GIT_CHECKED_RULE, GIT_GUARDED_RULE, PathPolicy, Scope

from .helpers import require

PATTERNS = [".env*", "src/auth/root_keys.ts", ".github/workflows/", "**/migrations/", "*.pem",
            "/build", "docs/**/*.png", "!docs/keep.png", "secret?.txt", "[Tt]mp/"]
PATHS = [
    (".env", False), (".env.local", False), ("src/.env", False), ("src/auth/root_keys.ts", False),
    ("src/auth/session.ts", False), (".github/workflows/ci.yml", False), (".github/workflows", True),
    (".github/dependabot.yml", False), ("db/migrations/001.sql", False), ("migrations", True),
    ("a/b/migrations/x.py", False), ("migrations.py", False), ("cert.pem", False), ("a/b/c.pem", False),
    ("build", True), ("build/out.o", False), ("src/build", True), ("docs/img/a.png", False),
    ("docs/a.png", False), ("docs/keep.png", False), ("secret1.txt", False), ("secret12.txt", False),
    ("tmp/x", False), ("Tmp/y", False), ("TMP/z", False), ("README.md", False),
]


def test_forbidden_matching_agrees_with_git(tmp_path: Path) -> None:
    """git check-ignore, fed the same patterns, is the ground truth."""
    require("git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("\n".join(PATTERNS) + "\n")
    for rel, is_dir in PATHS:
        p = tmp_path / rel
        if is_dir:
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("x")
    proc = subprocess.run(
        ["git", "-C", str(tmp_path), "check-ignore", "--stdin"],
        input="\n".join(rel for rel, _ in PATHS) + "\n", capture_output=True, text=True,
    )
    git_ignored = set(proc.stdout.split())
    manifest = parse_manifest(
        '[task]\nid = "t"\ngoal = "g"\n[paths]\nforbidden = [' + ", ".join(f'"{p}"' for p in PATTERNS) + "]\n"
    )
    policy = PathPolicy(manifest)
    ours = {rel for rel, is_dir in PATHS if policy.classify(rel, is_dir).scope is Scope.FORBIDDEN}
    assert ours == git_ignored


POLICY = PathPolicy(parse_manifest(
    '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/checkout/", "**"]\n'
    'forbidden = [".env*", "!.env.example"]\n'
))


ANCHOR = "built-in: a repository's .git and hooks directories are never renamed, replaced or linked"
REDIRECT = "built-in: git files that point git elsewhere are read-only"
BARE = ("built-in: a HEAD outside a .git directory would make a bare repository, whose config and hooks the guard "
        "cannot tell by name; make repositories with git init (a .git directory)")
NESTED = "built-in: a nested repository's git internals (writable, not counted)"


@pytest.mark.parametrize(
    ("path", "is_dir", "scope", "key"),
    [
        (".git/hooks/pre-commit", False, Scope.PROTECTED, "built-in: .git/hooks/ is read-only"),
        (".git/hooks/pre-commit.sample", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        # issue 12: the hooks directory is an anchor (mkdir/rmdir only), not a git internal
        (".git/hooks", True, Scope.GIT_ANCHOR, ANCHOR),
        (".git", True, Scope.GIT_ANCHOR, ANCHOR),
        (".git", False, Scope.GIT_CHECKED, GIT_CHECKED_RULE),  # a gitfile: judged on what it names
        ("src/wt/.git", False, Scope.GIT_CHECKED, GIT_CHECKED_RULE),
        ("src/bare/HEAD", False, Scope.PROTECTED, BARE),
        ("src/HEAD", True, Scope.ALLOWED, "paths.allowed"),
        ("src/sub/.git/HEAD", False, Scope.GIT_INTERNAL, NESTED),
        ("src/sub/.git/index", False, Scope.GIT_INTERNAL, NESTED),
        ("src/sub/.git", True, Scope.GIT_ANCHOR, ANCHOR),
        ("src/sub/.git/hooks", False, Scope.GIT_ANCHOR, ANCHOR),
        ("src/sub/.git/hooks/post-checkout", False, Scope.PROTECTED, "built-in: .git/hooks/ is read-only"),
        ("src/sub/.git/hooks/post-checkout.sample", False, Scope.GIT_INTERNAL, NESTED),
        (".git/modules/m/hooks/pre-commit", False, Scope.PROTECTED, "built-in: .git/hooks/ is read-only"),
        (".git/commondir", False, Scope.PROTECTED, REDIRECT),
        (".git/worktrees/w/commondir", False, Scope.GIT_CHECKED, GIT_CHECKED_RULE),
        (".git/worktrees/w/gitdir", False, Scope.GIT_CHECKED, GIT_CHECKED_RULE),
        (".git/modules/m/commondir", False, Scope.PROTECTED, REDIRECT),
        (".git/info/attributes", False, Scope.PROTECTED, REDIRECT),
        ("src/sub/.git/objects/info/alternates", False, Scope.PROTECTED, REDIRECT),
        (".git/info/exclude", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        ("src/sub/.git/config", False, Scope.GIT_GUARDED, GIT_GUARDED_RULE),
        (".git/worktrees/w/config.worktree", False, Scope.GIT_GUARDED, GIT_GUARDED_RULE),
        (".git/modules/config", True, Scope.GIT_INTERNAL, "built-in: git internals"),
        (".git/refs/heads/config", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        (".git/refs/heads/hooks/x", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        ("src/x.github/config", False, Scope.ALLOWED, "paths.allowed"),
        (".git/config", False, Scope.GIT_CONFIG, "built-in: .git/config is read-only if it existed when the guard started"),  # noqa: E501
        (".git/index.lock", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        (".git/refs/stash", False, Scope.GIT_INTERNAL, "built-in: git internals"),
        (".guard/STATE.md", False, Scope.PROTECTED, "built-in: the guard's own files"),
        (".env", False, Scope.FORBIDDEN, "paths.forbidden"),
        (".env.example", False, Scope.ALLOWED, "paths.allowed"),
        ("src/checkout/tax.py", False, Scope.ALLOWED, "paths.allowed"),
        ("", True, Scope.OUT_OF_SCOPE, "workspace root"),
    ],
)
def test_built_ins_win_over_an_allow_everything_manifest(path: str, is_dir: bool, scope: Scope, key: str) -> None:
    where = POLICY.classify(path, is_dir)
    assert (where.scope, where.key) == (scope, key)


def test_decisions_name_their_pattern() -> None:
    policy = PathPolicy(parse_manifest(
        '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/checkout/", "!src/checkout/vendor/"]\n'
        'forbidden = ["**/migrations/"]\n'
    ))
    assert policy.classify("src/checkout/db/migrations", True).describe() == "paths.forbidden '**/migrations/'"
    assert policy.classify("src/checkout/a.py", False).describe() == "paths.allowed 'src/checkout/'"
    vendored = policy.classify("src/checkout/vendor/x.py", False)
    assert vendored.scope is Scope.OUT_OF_SCOPE and vendored.pattern == "!src/checkout/vendor/"
    assert policy.classify("src", True).scope is Scope.ALLOWED  # a parent of an allowed directory
    assert policy.classify("src/other.py", False).scope is Scope.OUT_OF_SCOPE
    read_only = PathPolicy(parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\ngit_internals = "read-only"\n'))
    assert read_only.classify(".git/index", False).scope is Scope.PROTECTED


def test_memoized_verdicts_are_the_verdicts_and_the_memo_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import guardfs.policy as policy_module

    monkeypatch.setattr(policy_module, "_MEMO_MAX", 8)
    policy = PathPolicy(parse_manifest(
        '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/checkout/"]\nforbidden = [".env*", "**/migrations/"]\n'
    ))
    paths = [*PATHS, ("src/checkout/a.py", False), ("src/checkout/migrations", True), ("src/checkout", True)]
    for rounds in range(3):  # first from the patterns, then from the memo (and cleared on the way)
        for path, is_dir in paths:
            assert policy.classify(path, is_dir) == policy._classify(path, is_dir), (path, is_dir, rounds)
            assert len(policy._memo) <= 8
    # A name met as a directory and as a file is judged for each: the trailing slash matters.
    assert policy.classify("src/checkout/migrations", True).scope is Scope.FORBIDDEN
    assert policy.classify("src/checkout/migrations", False).scope is Scope.ALLOWED
