"""``guard check``'s lints (guardfs.lint), one per footgun of issue 20, judged against real
workspaces and real git; and the verb itself: one line on success, the compiled policy with
-v, --strict, the default manifest, and the schema generated from the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from guardfs.lint import Lint, lint
from guardfs.manifest import Manifest, parse_manifest
from guardfs.policy import PathPolicy, Scope
from guardfs.schema import sections

from .helpers import git_env, require

HEAD = '[task]\nid = "t"\ngoal = "Fix the tagging helper"\n[paths]\n'
SITE = ".venv/lib/python3.11/site-packages"


def repository(root: Path, *, track: tuple[str, ...] = ()) -> Path:
    """A committed repository as a new user has one: a CI workflow and migrations tracked,
    a venv holding Django's own migrations and a CA bundle (ignored), an untracked .env;
    *track* names more files to commit."""
    require("git")
    files = {
        ".github/workflows/ci.yml": "on: push\n", "app/migrations/0001_initial.py": "ops = []\n",
        "app/migrations/__init__.py": "", "app/models.py": "class Tag:\n    pass\n", ".gitignore": ".venv/\n.env\n",
        f"{SITE}/django/db/migrations/__init__.py": "", f"{SITE}/certifi/cacert.pem": "-----BEGIN CERT\n",
        ".env": "SECRET=1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    env = git_env(root)
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
    for rel in track:
        subprocess.run(["git", "-C", str(root), "add", "-f", rel], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "commit", "-qm", "init"], check=True, env=env)
    return root


def warnings(text: str, root: Path) -> list[Lint]:
    return lint(parse_manifest(HEAD + text), root)


def about(found: list[Lint], key: str, pattern: str) -> Lint:
    hits = [w for w in found if (w.key, w.pattern) == (key, pattern)]
    assert len(hits) == 1, found
    return hits[0]


def test_a_manifest_that_does_what_it_says_has_no_warnings(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    assert warnings('allowed = ["app/"]\nsecret = [".env*", "certifi/*.pem", "~/.config/acme"]\n'
                    'protected = [".github/workflows/", "app/migrations/"]\n', ws) == [
        Lint("paths.secret", "certifi/*.pem", "matches nothing in the workspace",
             "correct the pattern (relative to the workspace root; a trailing '/' names a directory), or remove "
             "it; a path that may appear during the run may stay")]  # anchored: it does not look into .venv/


def test_a_pattern_that_matches_nothing(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    found = warnings('allowed = ["app/", "src/checkout/"]\nsecret = [".env*", "config/master.key"]\n', ws)
    assert [(w.key, w.pattern) for w in found] == [("paths.allowed", "src/checkout/"),
                                                    ("paths.secret", "config/master.key")]
    assert all("matches nothing in the workspace" in w.problem and "correct the pattern" in w.fix for w in found)


def test_a_negation_that_leaves_a_directorys_contents_in(tmp_path: Path) -> None:
    """The issue's manifest: with gitignore semantics '**' keeps matching the files below the
    negated directories, so the run could write ci.yml and the migration. The lint says so and
    points to protected; the policy agrees that the files are allowed."""
    ws = repository(tmp_path)
    text = 'allowed = ["**", "!.github/workflows/", "!**/migrations/"]\n'
    found = warnings(text, ws)
    policy = PathPolicy(parse_manifest(HEAD + text))
    assert policy.classify(".github/workflows/ci.yml", False).scope is Scope.ALLOWED  # what the lint warns of
    for negation, example in (("!.github/workflows/", ".github/workflows/ci.yml"),
                              ("!**/migrations/", "app/migrations/")):
        warning = about(found, "paths.allowed", negation)
        assert "takes nothing out: '**' still matches" in warning.problem and example in warning.problem
        assert f"list {negation[1:]!r} under [paths] protected" in warning.fix
    # Both ways out the fix names work.
    fixed = 'allowed = ["**", "!.github/workflows/**", "!**/migrations/**"]\n'
    assert not [w for w in warnings(fixed, ws) if "takes nothing out" in w.problem]
    policy = PathPolicy(parse_manifest(HEAD + fixed))
    assert policy.classify(".github/workflows/ci.yml", False).scope is Scope.OUT_OF_SCOPE
    assert policy.classify("app/migrations/0001_initial.py", False).scope is Scope.OUT_OF_SCOPE
    protected = PathPolicy(parse_manifest(HEAD + 'allowed = ["**"]\nprotected = [".github/workflows/"]\n'))
    assert protected.classify(".github/workflows/ci.yml", False).scope is Scope.PROTECTED
    # The same holds for a secret's negation that a later pattern undoes.
    found = warnings('allowed = ["app/"]\nsecret = ["!.env.example", ".env*"]\n', ws)
    assert "'.env*' still matches" in about(found, "paths.secret", "!.env.example").problem
    assert "negate its contents" in about(found, "paths.secret", "!.env.example").fix


def test_a_negation_that_takes_something_out_is_no_warning(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    assert warnings('allowed = ["app/", "!app/migrations/"]\nsecret = [".env*"]\n', ws) == []


@pytest.mark.parametrize(("text", "wins"), [
    ('allowed = [".env*"]\nsecret = [".env*"]\n', "secret"),  # allowed equal to forbidden
    ('allowed = [".env*"]\nforbidden = [".env*"]\n', "secret"),
    ('allowed = [".github/"]\nprotected = [".github/workflows/"]\n', "protected"),
])
def test_an_allowed_pattern_that_secret_or_protected_voids(tmp_path: Path, text: str, wins: str) -> None:
    ws = repository(tmp_path)
    allowed = text.split('"')[1]
    warning = about(warnings(text, ws), "paths.allowed", allowed)
    assert f"everything it matches is also {wins}" in warning.problem and "it allows no write" in warning.problem
    assert f"remove it from allowed if they are {wins}" in warning.fix


def test_an_allowed_pattern_with_protected_paths_inside_is_what_protected_is_for(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    assert warnings('allowed = ["**"]\nsecret = [".env*"]\nprotected = [".github/workflows/", "app/migrations/"]\n',
                    ws) == []


def test_a_pattern_that_would_have_reached_into_a_generated_tree(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    found = warnings('allowed = ["app/"]\nsecret = [".env*", "**/*.pem"]\nprotected = ["**/migrations/"]\n', ws)
    pem = about(found, "paths.secret", "**/*.pem")
    assert f"inside the generated tree .venv/ (e.g. {SITE}/certifi/cacert.pem)" in pem.problem
    assert "they are not secret" in pem.problem and "'.venv/**/*.pem'" in pem.fix
    migrations = about(found, "paths.protected", "**/migrations/")
    assert f"{SITE}/django/db/migrations" in migrations.problem and "not read-only" in migrations.problem
    assert "'.venv/**/migrations/'" in migrations.fix
    assert len(found) == 2  # '**/*.pem' matches nothing else, and is not called unmatched as well
    # The fix it names reaches in.
    named = PathPolicy(parse_manifest(HEAD + 'secret = [".venv/**/*.pem"]\n'))
    assert named.classify(f"{SITE}/certifi/cacert.pem", False).scope is Scope.FORBIDDEN


def test_a_secret_only_in_gits_history_is_said_as_guard_run_refuses_it(tmp_path: Path) -> None:
    """guard check sees what guard run's start check sees: a secret committed once and removed
    from the index since (git rm --cached) lives in an earlier commit, named with its ref."""
    ws = repository(tmp_path, track=(".env",))
    env = git_env(ws)
    subprocess.run(["git", "-C", str(ws), "rm", "-q", "--cached", ".env"], check=True, env=env)
    subprocess.run(["git", "-C", str(ws), "commit", "-qm", "untrack"], check=True, env=env)
    found = lint(parse_manifest(HEAD + 'allowed = ["app/"]\nsecret = [".env*"]\n'), ws, git_cache=tmp_path / "cache")
    warning = about(found, "paths.secret", ".env*")
    assert "git holds 1 secret path(s): .env (commit " in warning.problem and "~1)" in warning.problem
    assert "[now] 'refuse'" in warning.problem
    assert list((tmp_path / "cache").iterdir()), "the check is cached where guard run looks"


@pytest.mark.parametrize("mode", ["refuse", "hide-git", "warn"])
def test_secrets_tracked_by_git_with_what_each_mode_does(tmp_path: Path, mode: str) -> None:
    ws = repository(tmp_path, track=(".env",))
    found = warnings(f'allowed = ["app/"]\nforbidden = [".env*", ".github/workflows/"]\nforbidden_in_git = "{mode}"\n',
                     ws)
    for pattern, path in ((".env*", ".env"), (".github/workflows/", ".github/workflows/ci.yml")):
        warning = about(found, "paths.forbidden", pattern)
        assert f"git holds 1 secret path(s): {path} (the index, commit " in warning.problem
        assert f"[now] {mode!r}" in warning.problem
        for other, effect in (("refuse", "does not start"), ("hide-git", "hides every git directory"),
                              ("warn", "starts and warns")):
            assert f"{other!r}: guard run {effect}" in warning.problem
        assert "move the pattern to [paths] protected" in warning.fix
    # Protected paths may be tracked: the .env warning stays, the workflow's goes.
    kept = warnings('allowed = ["app/"]\nsecret = [".env*"]\nprotected = [".github/workflows/"]\n', ws)
    assert [(w.key, w.pattern) for w in kept] == [("paths.secret", ".env*")]


# ----- the verb --------------------------------------------------------------------------


def guard(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


def test_check_success_is_one_line_and_verbose_prints_the_compiled_policy(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    (ws / "guard.toml").write_text(HEAD + 'allowed = ["app/", "app/models.py"]\nsecret = [".env*", "~/.config/x"]\n'
                                          'protected = [".github/workflows/", "app/migrations/"]\n')
    proc = guard("check", cwd=ws / "app/migrations")  # from a subdirectory: the repository's guard.toml
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{ws}/guard.toml: valid; 2 allowed, 1 secret (and 1 outside the workspace), 2 protected pattern(s); "
        "0 warning(s)"]
    verbose = guard("-v", "check", cwd=ws)
    assert verbose.returncode == 0, verbose.stderr
    text = verbose.stdout
    assert "precedence: built-in protections > paths.secret (and paths.forbidden) > paths.protected" in text
    assert "written to the run's scratch" in text and "refused quietly" not in text
    assert "protected (readable, never written; EROFS" in text and "  .github/workflows/" in text
    assert "guard.toml           read-only, in any directory (a later run started there reads it)" in text
    assert "  ~/.config/x" in text


def test_check_warns_with_the_fix_and_strict_refuses(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    manifest = tmp_path / "elsewhere.toml"
    manifest.write_text(HEAD + 'allowed = ["**", "!.github/workflows/"]\nsecret = [".env*"]\n')
    proc = guard("check", str(manifest), cwd=ws)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("warning: paths.allowed '!.github/workflows/': takes nothing out")
    assert lines[1].startswith("  fix: to keep the agent from writing there, list '.github/workflows/' under")
    assert lines[-1].endswith("; 1 warning(s)")
    strict = guard("check", "--strict", str(manifest), cwd=ws)
    assert strict.returncode == 65 and strict.stdout.splitlines()[-1].endswith("1 warning(s) (--strict: refused)")
    # --workspace names the tree to lint against: an empty one has no workflows to name.
    (tmp_path / "empty").mkdir()
    other = guard("check", "--workspace", str(tmp_path / "empty"), str(manifest), cwd=ws)
    assert "'.env*': matches nothing" in other.stdout


def test_check_without_a_manifest_says_to_run_guard_init(tmp_path: Path) -> None:
    ws = repository(tmp_path)
    proc = guard("check", cwd=ws / "app")
    assert proc.returncode == 64
    assert f"no manifest: {ws}/guard.toml does not exist" in proc.stderr and "guard init --allow" in proc.stderr
    assert proc.stdout == ""


def test_schema_lists_every_key_of_every_section_from_the_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "sandbox", "schema"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    models = sections()
    for name, model in models.items():
        assert f"\n[{name}]" in proc.stdout
        block = proc.stdout.split(f"\n[{name}]", 1)[1].split("\n[", 1)[0]
        for key, field in model.model_fields.items():
            line = next((ln for ln in block.splitlines() if ln.startswith(f"  {key} = ")), None)
            assert line is not None, (name, key)
            assert " # " in line  # its type
            first = " ".join((field.description or "").split()[:4])
            assert first in " ".join(block.split()), (name, key)  # its description
    assert '  max_files = 20    # positive integer, or "unlimited"' in proc.stdout
    assert '  forbidden_in_git = "refuse"    # one of "refuse", "hide-git", "warn"' in proc.stdout
    one = subprocess.run([sys.executable, "-m", "sandbox", "schema", "limits"], capture_output=True, text=True,
                         timeout=60)
    assert "[limits]" in one.stdout and "[paths]" not in one.stdout


def test_check_help_names_every_section_and_the_schema(tmp_path: Path) -> None:
    from sandbox.cli import _SECTION_NAMES

    assert tuple(Manifest.model_fields) == _SECTION_NAMES  # the help's list cannot drift from the model
    proc = guard("check", "--help", cwd=tmp_path)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert all(f"[{name}]" in text for name in _SECTION_NAMES) and "guard schema" in text
    assert "--strict" in text and "guard.toml" in text


def test_an_absolute_secret_that_meant_the_workspaces_own_path(tmp_path: Path) -> None:
    """Under forbidden a leading '/' anchors to the workspace root; under secret it names a
    path outside. One moved from forbidden to secret would stop hiding the workspace's file."""
    ws = repository(tmp_path)
    (ws / "config").mkdir()
    (ws / "config/master.key").write_text("KEY\n")
    found = warnings('allowed = ["app/"]\nsecret = [".env*", "/config/master.key"]\n', ws)
    warning = about(found, "paths.secret", "/config/master.key")
    assert "the workspace holds config/master.key, which stays readable" in warning.problem
    assert "write 'config/master.key'" in warning.fix
    policy = PathPolicy(parse_manifest(HEAD + 'secret = ["config/master.key"]\n'))
    assert policy.classify("config/master.key", False).scope is Scope.FORBIDDEN  # the fix hides it
    assert not [w for w in warnings('allowed = ["app/"]\nforbidden = ["/config/master.key"]\n', ws)
                if "outside the workspace" in w.problem]
