"""The compiled policy: its forbidden/allowed matching agrees with real git, and the
built-in protections hold whatever the manifest says."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from guardfs.manifest import parse_manifest
from guardfs.policy import GIT_CHECKED_RULE, GIT_GUARDED_RULE, PathPolicy, Scope

from .helpers import git_env, require
from .test_run import guard_run

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


# ----- secret, protected and generated trees (issue 20) ----------------------------------

CLASSES = PathPolicy(parse_manifest(
    '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["**"]\n'
    'secret = [".env*", "**/*.pem", "~/.ssh", "/etc/passwd", ".venv/**/named.pem"]\n'
    'forbidden = ["keys/", "!.env.example"]\n'
    'protected = [".github/workflows/", "**/migrations/", "package-lock.json", "!.github/workflows/scratch.yml", '
    '"dist/"]\n'
))
SITE = ".venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    ("path", "is_dir", "scope", "key", "pattern"),
    [
        # A refusal names the key its pattern came from; secret and forbidden are one class,
        # and a negation in one narrows only its own patterns.
        (".env", False, Scope.FORBIDDEN, "paths.secret", ".env*"),
        (".env.example", False, Scope.FORBIDDEN, "paths.secret", ".env*"),
        ("keys/id_rsa", False, Scope.FORBIDDEN, "paths.forbidden", "keys/"),
        ("certs/site.pem", False, Scope.FORBIDDEN, "paths.secret", "**/*.pem"),
        # Outside-workspace secrets are not workspace patterns.
        ("etc/passwd", False, Scope.ALLOWED, "paths.allowed", "**"),
        ("~/.ssh", True, Scope.ALLOWED, "paths.allowed", "**"),
        # Protected: readable, never written, inside allowed; git may track it.
        (".github/workflows/ci.yml", False, Scope.PROTECTED, "paths.protected", ".github/workflows/"),
        (".github/workflows", True, Scope.PROTECTED, "paths.protected", ".github/workflows/"),
        # A negation re-includes a file below a matched directory, as pathspec reads it (git
        # would keep it matched: test_a_negation_below_a_matched_directory_is_read_as_pathspec_does).
        (".github/workflows/scratch.yml", False, Scope.ALLOWED, "paths.allowed", "**"),
        ("app/migrations/0001_initial.py", False, Scope.PROTECTED, "paths.protected", "**/migrations/"),
        ("app/migrations", True, Scope.PROTECTED, "paths.protected", "**/migrations/"),
        ("package-lock.json", False, Scope.PROTECTED, "paths.protected", "package-lock.json"),
        # Protected wins over generated output that would land in the workspace.
        ("dist/app.js", False, Scope.PROTECTED, "paths.protected", "dist/"),
        ("dist", True, Scope.PROTECTED, "paths.protected", "dist/"),
        ("web/package-lock.json", False, Scope.PROTECTED, "paths.protected", "package-lock.json"),
        # The bytecode of a protected package goes to the run's scratch layer (never the
        # workspace): a test run importing the migrations trips nothing.
        ("app/migrations/__pycache__/0001_initial.cpython-311.pyc", False, Scope.GENERATED_OUTSIDE,
         "paths.generated", "*.py[co]"),
        ("app/migrations/__pycache__", True, Scope.GENERATED_OUTSIDE, "paths.generated", "__pycache__/"),
        # A manifest is read-only, whatever allowed says, in any directory (a later run's
        # workspace may be any), but for a generated tree's (tools', never a workspace).
        ("guard.toml", False, Scope.PROTECTED, "built-in: a manifest (guard.toml, in any directory) is read-only",
         None),
        ("sub/guard.toml", False, Scope.PROTECTED, "built-in: a manifest (guard.toml, in any directory) is read-only",
         None),
        ("sub/guard.toml.bak", False, Scope.ALLOWED, "paths.allowed", "**"),
        ("node_modules/x/guard.toml", False, Scope.GENERATED, "paths.generated", "node_modules/"),
        # A pattern matching at any depth stops at a generated tree...
        (f"{SITE}/django/db/migrations", True, Scope.GENERATED, "paths.generated", ".venv/"),
        (f"{SITE}/django/db/migrations/__init__.py", False, Scope.GENERATED, "paths.generated", ".venv/"),
        (f"{SITE}/certifi/cacert.pem", False, Scope.GENERATED, "paths.generated", ".venv/"),
        (f"{SITE}/pkg/.env", False, Scope.GENERATED, "paths.generated", ".venv/"),
        ("node_modules/x/package-lock.json", False, Scope.GENERATED, "paths.generated", "node_modules/"),
        ("web/node_modules/x/migrations/1.js", False, Scope.GENERATED, "paths.generated", "node_modules/"),
        # ...unless it names the tree, or matches the tree as a whole ('**' does: the venv is in scope).
        (".venv/lib/named.pem", False, Scope.FORBIDDEN, "paths.secret", ".venv/**/named.pem"),
        (".venv", True, Scope.GENERATED, "paths.generated", ".venv/"),
        ("keys/build/id_rsa", False, Scope.FORBIDDEN, "paths.forbidden", "keys/"),
        (".env.d/build/x", False, Scope.FORBIDDEN, "paths.secret", ".env*"),
    ],
)
def test_classes_truth_table(path: str, is_dir: bool, scope: Scope, key: str, pattern: str | None) -> None:
    where = CLASSES.classify(path, is_dir)
    assert (where.scope, where.key, where.pattern) == (scope, key, pattern)


def test_a_protected_manifest_of_its_own_is_protected_at_the_root_only() -> None:
    policy = PathPolicy(parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["guard.toml", "**"]\n'))
    assert policy.classify("guard.toml", False).scope is Scope.PROTECTED
    secret = PathPolicy(parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nsecret = ["*.toml"]\n'))
    assert secret.classify("guard.toml", False).scope is Scope.FORBIDDEN  # a manifest can only narrow


SAVE = "paths.allowed (an atomic save's temporary)"
FILES = PathPolicy(parse_manifest(
    '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/attr/validators.py", "setup.cfg", "docs/"]\n'
    'secret = [".env*"]\nprotected = ["docs/conf.py"]\n'))


@pytest.mark.parametrize(
    ("path", "scope", "key", "pattern"),
    [
        # Claude Code's Write and Edit save through NAME.tmp.<pid>.<random> beside the file.
        ("src/attr/validators.py.tmp.2.ecec68ffaafd", Scope.ALLOWED, SAVE, "src/attr/validators.py"),
        ("setup.cfg.tmp.41.1700000000", Scope.ALLOWED, SAVE, "setup.cfg"),
        # Beside the file only, and of an allowed file only.
        ("src/validators.py.tmp.2.ecec", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("src/attr/_make.py.tmp.2.ecec", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        # Not a temporary's temporary, nor another name that merely starts like one.
        ("setup.cfg.tmp.1.tmp.2", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("setup.cfg.tmp.", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("setup.cfg.bak", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        # A secret's or a protected file's temporary stays what it was.
        (".env.tmp.1.a", Scope.FORBIDDEN, "paths.secret", ".env*"),
        ("docs/conf.py.tmp.1.a", Scope.ALLOWED, "paths.allowed", "docs/"),
        # sed -i's sedXXXXXX: beside a file allowed by its path only (setup.cfg matches at any depth).
        ("src/attr/sedSHg9OE", Scope.ALLOWED, SAVE, "src/attr/validators.py"),
        ("src/sedSHg9OE", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("sedSHg9OE", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("src/attr/sedSHg9OEx", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
        ("src/attr/sed-Hg9OE", Scope.OUT_OF_SCOPE, "not in paths.allowed", None),
    ],
)
def test_an_atomic_saves_temporary_beside_an_allowed_file_is_allowed(
        path: str, scope: Scope, key: str, pattern: str | None) -> None:
    """With a file allowed by name (`guard init --allow src/attr/validators.py`), the agent's
    editor must be able to save it: its temporary beside it is in scope (found with the real
    Claude Code CLI, whose every Edit of such a file tripped scope_spill on the temporary)."""
    where = FILES.classify(path, False)
    assert (where.scope, where.key, where.pattern) == (scope, key, pattern)


def test_a_directory_named_like_a_save_temporary_is_not_one() -> None:
    assert FILES.classify("setup.cfg.tmp.1.a", True).scope is Scope.OUT_OF_SCOPE
    assert FILES.classify("src/attr/sedSHg9OE", True).scope is Scope.OUT_OF_SCOPE


def test_allowed_stops_at_a_generated_tree_it_does_not_cover() -> None:
    """'**/*.py' reaches into .venv/ only through its wildcard: site-packages stay out of
    scope (the run's scratch layer), while 'src/' covers its own src/node_modules/."""
    policy = PathPolicy(parse_manifest(
        '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["**/*.py", "src/"]\n'))
    assert policy.classify("app/models.py", False).scope is Scope.ALLOWED
    assert policy.classify(f"{SITE}/six.py", False).scope is Scope.GENERATED_OUTSIDE
    assert policy.classify("src/node_modules/a/index.js", False).scope is Scope.GENERATED
    assert policy.reaching(f"{SITE}/six.py", False) == [("paths.allowed", "**/*.py", ".venv")]
    assert policy.reaching("src/node_modules/a/index.js", False) == []


def test_the_tree_memo_is_bounded_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    import guardfs.policy as policy_module

    monkeypatch.setattr(policy_module, "_MEMO_MAX", 4)
    policy = PathPolicy(parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nsecret = ["**/*.pem"]\n'))
    for _ in range(3):
        for directory, root in [(".venv", ".venv"), (".venv/lib/x", ".venv"), ("a/node_modules/b", "a/node_modules"),
                                ("src", None), ("src/build/x", "src/build"), ("target", "target")]:
            assert policy.generated_tree(directory) == root
            assert len(policy._trees) <= 4
        assert policy.secret(".venv/lib/x/cacert.pem", False) is None
        assert policy.secret("certs/x.pem", False) is not None


CLASS_PATHS = [
    ".github/workflows/ci.yml", ".github/workflows/sub/x.yml", ".github/dependabot.yml", "app/migrations/0001.py",
    "app/migrations/sub/x.py", "app/models.py", "README.md", "a/b/c.pem", "x.pem", ".env", ".env.local",
    "docs/.env", "docs/keep.md", "migrations.py",
]


@pytest.mark.parametrize(("key", "patterns"), [
    ("allowed", ["**", "!.github/workflows/", "!**/migrations/"]),  # the footgun: the negations keep nothing out
    ("allowed", ["app/", "docs/", "!docs/keep.md", "*.md"]),
    ("secret", [".env*", "**/*.pem", "!docs/.env"]),
    ("protected", [".github/workflows/", "**/migrations/", "!app/migrations/"]),
])
def test_each_class_matches_as_git_ignores(tmp_path: Path, key: str, patterns: list[str]) -> None:
    """git check-ignore, fed the same patterns, is the ground truth outside generated trees."""
    require("git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("\n".join(patterns) + "\n")
    for rel in CLASS_PATHS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    proc = subprocess.run(["git", "-C", str(tmp_path), "check-ignore", "--no-index", "--stdin"],
                          input="\n".join(CLASS_PATHS) + "\n", capture_output=True, text=True)
    listed = ", ".join(f'"{p}"' for p in patterns)
    policy = PathPolicy(parse_manifest(f'[task]\nid = "t"\ngoal = "g"\n[paths]\n{key} = [{listed}]\n'))
    scope = {"allowed": Scope.ALLOWED, "secret": Scope.FORBIDDEN, "protected": Scope.PROTECTED}[key]
    ours = {rel for rel in CLASS_PATHS if policy.classify(rel, False).scope is scope}
    assert ours == set(proc.stdout.split())


def test_a_negation_below_a_matched_directory_is_read_as_pathspec_does(tmp_path: Path) -> None:
    """Where git and pathspec part: git never re-includes a file whose parent directory an
    earlier pattern matched; pathspec (the guard's matcher) does. The guard follows pathspec,
    which is what the manifest says in words ('all of migrations/ but sub/'), and guard check
    shows the compiled verdicts; this test notices if either side changes."""
    require("git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    patterns = ["**/migrations/", "!app/migrations/sub/"]
    (tmp_path / ".gitignore").write_text("\n".join(patterns) + "\n")
    (tmp_path / "app/migrations/sub").mkdir(parents=True)
    (tmp_path / "app/migrations/sub/x.py").write_text("x")
    proc = subprocess.run(["git", "-C", str(tmp_path), "check-ignore", "--no-index", "app/migrations/sub/x.py"],
                          capture_output=True, text=True)
    assert proc.returncode == 0  # git: still ignored
    policy = PathPolicy(parse_manifest('[task]\nid = "t"\ngoal = "g"\n[paths]\nprotected = '
                                       '["**/migrations/", "!app/migrations/sub/"]\n'))
    assert policy.classify("app/migrations/sub/x.py", False).scope is Scope.OUT_OF_SCOPE
    assert policy.classify("app/migrations/0001.py", False).scope is Scope.PROTECTED


# ----- a real guard run --------------------------------------------------------------------

CLASSES_RUN = """
    import errno, glob, json, os, subprocess
    out = {}
    def attempt(name, fn):
        try:
            out[name] = fn()
        except OSError as err:
            out[name] = errno.errorcode[err.errno]
    def append(path, text="# agent\\n"):
        with open(path, "a") as f:
            return f.write(text)
    def read(path):
        with open(path) as f:
            return f.read()
    attempt("read ci", lambda: read(".github/workflows/ci.yml"))
    attempt("write ci", lambda: append(".github/workflows/ci.yml"))
    attempt("progress 1", lambda: append("app/a.py"))  # back in scope: the breaker closes
    attempt("read migration", lambda: read("app/migrations/0001_initial.py"))
    attempt("write migration", lambda: append("app/migrations/0001_initial.py"))
    attempt("progress 2", lambda: append("app/b.py"))
    attempt("write manifest", lambda: append("guard.toml"))
    attempt("progress 3", lambda: append("app/c.py"))
    attempt("read env", lambda: read(".env"))
    attempt("progress 4", lambda: append("app/d.py"))
    site = glob.glob(".venv/lib/python3*/site-packages")[0]
    test = subprocess.run([".venv/bin/python", "-c",
                           "import django.db.migrations.operations as o, django.db.migrations as m; "
                           "print('IMPORTED', m.__file__)"], capture_output=True, text=True)
    out["import"] = test.stdout + test.stderr
    attempt("write venv migration", lambda: append(f"{site}/django/db/migrations/guard_probe.py", "X = 1\\n"))
    attempt("read certifi", lambda: len(read(f"{site}/pip/_vendor/certifi/cacert.pem")) > 0)
    attempt("git log", lambda: subprocess.run(["git", "log", "--format=%s"], capture_output=True, text=True,
                                               check=True).stdout)
    home = os.path.expanduser("~")
    attempt("outside secret", lambda: read(f"{home}/.config/acme/token"))
    attempt("outside neighbour", lambda: read(f"{home}/.config/acme/public"))
    print(json.dumps(out))
"""


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("native", [False, True], ids=["venv-through-the-mount", "venv-native"])
def test_a_protected_tracked_workflow_starts_reads_and_refuses_writes_under_guard_run(
    tmp_path: Path, native: bool,
) -> None:
    """guard run --ci in a repository that tracks its CI workflow and its migrations, with a
    venv holding Django: the run starts (no exit 65: only secrets are checked against git),
    the protected files read and refuse writes (EROFS, a scope_spill each, recovered), the
    manifest is read-only, and '**/migrations/' leaves Django's own migrations importable and
    writable as generated output; '**/*.pem' leaves pip's CA bundle readable. The same
    through the mount (the policy judges every venv path) and with the venv bound natively
    (nothing masked in it that the policy would serve)."""
    require("git")
    ws, home = tmp_path / "ws", tmp_path / "home"
    home.mkdir()
    env = git_env(home)
    for rel, text in {".github/workflows/ci.yml": "on: push\n", "app/migrations/0001_initial.py": "ops = []\n",
                      "app/migrations/__init__.py": "", "app/models.py": "X = 1\n", ".gitignore": ".venv/\n.env\n",
                      ".env": "SECRET=1\n"}.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    (ws / "guard.toml").write_text(
        '[task]\nid = "tags"\ngoal = "Fix the tagging helper in app/"\n[paths]\nallowed = ["**"]\n'
        'secret = [".env*", "**/*.pem", "~/.config/acme/token"]\nprotected = [".github/workflows/", "**/migrations/"]\n'
        f'[sandbox]\nnative_generated = {"true" if native else "false"}\nwritable = ["{home}"]\n')
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(argv, cwd=ws, env=env, check=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(ws / ".venv")], check=True)
    pip = subprocess.run([str(ws / ".venv/bin/pip"), "install", "-q", "django"], capture_output=True, text=True,
                         env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if pip.returncode != 0:
        pytest.skip(f"Django cannot be installed from here: {pip.stderr[-300:]}")
    (home / ".config/acme").mkdir(parents=True)
    (home / ".config/acme/token").write_text("TOKEN-VALUE\n")
    (home / ".config/acme/public").write_text("PUBLIC\n")
    run_dir = tmp_path / "run"
    proc = guard_run(ws / "guard.toml", ws, run_dir, CLASSES_RUN, "--ci", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "git tracks" not in proc.stderr
    trees = [line for line in proc.stderr.splitlines() if "generated trees (written natively" in line]
    if native:  # '**/*.pem' does not reach into .venv/: pip's CA bundle is not masked
        assert len(trees) == 1 and ".venv" in trees[0] and "masked" not in trees[0], proc.stderr
    else:
        assert trees == [], proc.stderr
    out = json.loads((run_dir / "stdout.log").read_text().splitlines()[-1])
    assert out["read ci"] == "on: push\n" and out["read migration"] == "ops = []\n"
    assert out["write ci"] == "EROFS" and out["write migration"] == "EROFS" and out["write manifest"] == "EROFS"
    assert all(isinstance(out[f"progress {i}"], int) for i in (1, 2, 3, 4)), out
    assert out["read env"] == "EACCES"
    assert "IMPORTED" in out["import"] and "/django/db/migrations/" in out["import"], out["import"]
    assert out["write venv migration"] == 6 and out["read certifi"] is True, out
    assert out["git log"] == "init\n"
    # A secret outside the workspace is hidden in the sandbox (guardfs.manifest.outside_secrets).
    assert out["outside neighbour"] == "PUBLIC\n" and "TOKEN-VALUE" not in str(out["outside secret"]), out
    assert (ws / ".github/workflows/ci.yml").read_text() == "on: push\n"
    assert (ws / "app/migrations/0001_initial.py").read_text() == "ops = []\n"
    assert list((ws / ".venv/lib").glob("python3*/site-packages/django/db/migrations/guard_probe.py"))
    ledger = json.loads((run_dir / "ledger.json").read_text())
    trips = [(t["rule"], t.get("reason", "")) for t in ledger["trips"]]
    assert [rule for rule, _ in trips] == ["scope_spill"] * 3 + ["forbidden_path"], trips
    for (_, reason), path in zip(trips, (".github/workflows/ci.yml", "app/migrations/0001_initial.py", "guard.toml",
                                         ".env"), strict=True):
        assert path in reason, trips
    assert "paths.protected '.github/workflows/'" in trips[0][1] and "paths.secret '.env*'" in trips[3][1], trips
