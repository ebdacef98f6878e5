"""``guard init`` as a new user runs it: on a real repository, then ``guard run`` without --manifest."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from guardfs.errors import Exit
from guardfs.manifest import DEFAULT_GENERATED, load_manifest
from guardfs.policy import PathPolicy, Scope
from sandbox.init import survey, task_id

from .helpers import git_env


def guard(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def _commit(repo: Path) -> None:
    env = git_env(repo.parent)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "import"], cwd=repo, check=True, env=env)


def third_party(tmp_path: Path) -> Path:
    """A repository as a user has one: a CI workflow and the app's migrations tracked, a
    lockfile, a virtualenv and an untracked .env (ignored, as usual)."""
    repo = tmp_path / "django-app"
    for d in (".github/workflows", "app/migrations", "src/checkout", "tests/checkout"):
        (repo / d).mkdir(parents=True)
    (repo / ".github/workflows/ci.yml").write_text("on: push\njobs: {}\n")
    (repo / "app/migrations/__init__.py").write_text("")
    (repo / "app/migrations/0001_initial.py").write_text("operations = []\n")
    (repo / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (repo / "tests/checkout/test_tax.py").write_text("")
    (repo / "package-lock.json").write_text("{}\n")
    (repo / "package.json").write_text('{"name": "app"}\n')
    (repo / "pyproject.toml").write_text('[project]\nname = "app"\n')
    (repo / ".gitignore").write_text(".env\n.venv/\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _commit(repo)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    # What Django ships inside the virtualenv: a migrations package no pattern may reach.
    (repo / ".venv/lib/django/db/migrations").mkdir(parents=True)
    (repo / ".venv/lib/django/db/migrations/__init__.py").write_text("")
    (repo / ".env").write_text("SECRET_KEY=s3cr3t\n")
    return repo


@pytest.mark.root
@pytest.mark.mount
def test_init_then_run_without_a_manifest(tmp_path: Path) -> None:
    repo = third_party(tmp_path)
    proc = guard(repo / "app", "init", "--allow", "src/checkout/", "--allow", "tests/checkout/", "fix the rounding bug")
    assert proc.returncode == 0, proc.stderr
    manifest = repo / "guard.toml"  # at the top level, from a subdirectory
    assert proc.stdout == (f"wrote {manifest}: writes to src/checkout/, tests/checkout/; 1 secret and 3 protected "
                           "pattern(s). Next: guard run -- <agent>\n")
    assert proc.stderr == ""
    parsed = load_manifest(manifest)
    assert parsed.task.id == "fix-the-rounding-bug" and parsed.task.goal == "fix the rounding bug"
    assert parsed.paths.allowed == ["src/checkout/", "tests/checkout/"]
    assert parsed.paths.secret == [".env*"]
    assert parsed.paths.protected == [".github/workflows/", "**/migrations/", "package-lock.json"]
    assert parsed.paths.generated == list(DEFAULT_GENERATED)  # .venv/ and node_modules/ are in it: not set
    assert "generated = [" not in manifest.read_text()
    assert "# Found here: .env." in manifest.read_text()
    policy = PathPolicy(parsed)
    assert policy.classify(".env", False).scope is Scope.FORBIDDEN
    assert policy.classify("app/migrations/0001_initial.py", False).scope is Scope.PROTECTED
    assert policy.classify(".venv/lib/django/db/migrations/__init__.py", False).scope is not Scope.PROTECTED
    checked = guard(repo, "check", "guard.toml")
    assert checked.returncode == 0, checked.stderr

    agent = ("echo '# fixed' >> ../src/checkout/tax.py && echo edited; "
             "echo x >> ../.github/workflows/ci.yml || echo protected-refused; "
             "test -r ../.venv/lib/django/db/migrations/__init__.py && echo venv-readable")
    run_dir = tmp_path / "run"
    ran = guard(repo / "app", "run", "--ci", "--run-dir", str(run_dir), "--", "sh", "-c", agent)
    assert ran.returncode == 0, ran.stderr  # it started: no 65 for a tracked workflow or migration
    log = (run_dir / "stdout.log").read_text()
    assert "edited" in log and "protected-refused" in log and "venv-readable" in log, log
    assert (repo / "src/checkout/tax.py").read_text().endswith("# fixed\n")
    assert (repo / ".github/workflows/ci.yml").read_text() == "on: push\njobs: {}\n"


def test_init_never_replaces_a_manifest_without_force(tmp_path: Path) -> None:
    repo = third_party(tmp_path)
    assert guard(repo, "init", "--allow", "src/", "first goal").returncode == 0
    first = (repo / "guard.toml").read_text()
    again = guard(repo, "init", "--allow", "src/", "second goal")
    assert again.returncode == Exit.USAGE
    assert again.stderr == (f"guard init: {repo / 'guard.toml'} already exists; edit it (guard check validates it), "
                            "or pass --force to replace it\n")
    assert (repo / "guard.toml").read_text() == first
    forced = guard(repo, "init", "--force", "--allow", "src/", "second goal")
    assert forced.returncode == 0, forced.stderr
    assert tomllib.loads((repo / "guard.toml").read_text())["task"]["goal"] == "second goal"


def test_allow_patterns_are_checked(tmp_path: Path) -> None:
    repo = third_party(tmp_path)
    absolute = guard(repo, "init", "--allow", str(repo / "src"), "goal")
    assert absolute.returncode == Exit.USAGE
    assert absolute.stderr.startswith(f"guard init: --allow {repo / 'src'}: patterns are relative to the "
                                      f"repository's top level {repo}, not absolute"), absolute.stderr
    up = guard(repo, "init", "--allow", "src/../../elsewhere/", "goal")
    assert up.returncode == Exit.USAGE and "escapes the repository with '..'" in up.stderr, up.stderr
    assert not (repo / "guard.toml").exists()
    nothing = guard(repo, "init", "--allow", "./lib/checkout/", "--allow", "src/", "goal")
    assert nothing.returncode == 0, nothing.stderr
    assert nothing.stderr.startswith("guard init: warning: paths.allowed 'lib/checkout/': matches nothing in the "
                                     "workspace\n  fix: "), nothing.stderr  # guard check's own lint
    assert nothing.stderr.count("lib/checkout") == 1, nothing.stderr  # said once
    assert load_manifest(repo / "guard.toml").paths.allowed == ["lib/checkout/", "src/"]


def test_task_id_from_the_goal_or_given(tmp_path: Path) -> None:
    assert task_id("Fix the rounding bug in src/checkout/tax.py!") == "fix-the-rounding-bug-in-src-checkout-tax"
    assert task_id("Überarbeite die Steuer") == "berarbeite-die-steuer"
    assert task_id("???") == "task"
    repo = third_party(tmp_path)
    bad = guard(repo, "init", "--id", "no spaces", "goal")
    assert bad.returncode == Exit.DATAERR
    assert "task.id" in bad.stderr and not (repo / "guard.toml").exists(), bad.stderr
    given = guard(repo, "init", "--id", "TAX-7", 'a "quoted"\ngoal with a \\ backslash')
    assert given.returncode == 0, given.stderr
    task = load_manifest(repo / "guard.toml").task
    assert (task.id, task.goal) == ("TAX-7", 'a "quoted"\ngoal with a \\ backslash')


@pytest.mark.root
@pytest.mark.mount
def test_secrets_git_tracks_are_left_out_and_said(tmp_path: Path) -> None:
    """A tracked template (.env.example) is no secret; a tracked key cannot be one (its content is in
    the history, and guard run would refuse to start): protected instead, with a warning."""
    repo = third_party(tmp_path)
    (repo / ".env.example").write_text("SECRET_KEY=\n")
    (repo / "tests/fixtures").mkdir()
    (repo / "tests/fixtures/server.key").write_text("-----BEGIN PRIVATE KEY-----\n")
    (repo / "deploy.pem").write_text("untracked\n")
    _commit(repo)  # deploy.pem too
    (repo / "local.pem").write_text("untracked\n")
    proc = guard(repo, "init", "--allow", "src/", "goal")
    assert proc.returncode == 0, proc.stderr
    paths = load_manifest(repo / "guard.toml").paths
    assert paths.secret == [".env*", "!/.env.example", "*.pem", "!/deploy.pem", "*.key", "!tests/fixtures/server.key"]
    assert paths.protected[:2] == ["/deploy.pem", "tests/fixtures/server.key"]
    warnings = proc.stderr.splitlines()
    assert len(warnings) == 2, warnings
    assert warnings[1].startswith("guard init: warning: git tracks tests/fixtures/server.key, which looks like a "
                                  "secret (private keys): its content is in the repository's history"), warnings
    policy = PathPolicy(load_manifest(repo / "guard.toml"))
    assert policy.classify("local.pem", False).scope is Scope.FORBIDDEN
    assert policy.classify("deploy.pem", False).scope is Scope.PROTECTED
    ran = guard(repo, "run", "--ci", "--run-dir", str(tmp_path / "run"), "--", "true")
    assert ran.returncode == 0, ran.stderr  # no "git tracks forbidden path(s)": 65


def test_a_virtualenv_called_env_is_generated_not_secret(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "setup.py").write_text("")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".env")], check=True)
    (repo / ".env.local").write_text("TOKEN=1\n")
    (repo / "Gemfile").write_text("")
    proc = guard(repo, "init", "goal")
    assert proc.returncode == 0, proc.stderr
    paths = load_manifest(repo / "guard.toml").paths
    assert paths.allowed == []  # no --allow: a read-only task
    assert paths.secret == ["/.env.local"]  # named, not '.env*', which would hide the virtualenv
    assert paths.generated == [*DEFAULT_GENERATED, "vendor/bundle/", ".bundle/", "/.env/"]
    policy = PathPolicy(load_manifest(repo / "guard.toml"))
    assert policy.classify(".env/bin/python", False).key == "paths.generated"  # not paths.secret


def test_the_walk_skips_git_and_generated_trees(tmp_path: Path) -> None:
    for d in ("node_modules/dep", ".git/objects", "src", "build", "env2/lib"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("node_modules/dep/key.pem", ".git/objects/x.key", "build/out.key", "src/app.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "env2/pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "env2/lib/cert.pem").write_text("")
    found = survey(tmp_path)
    assert sorted(found.files) == ["src/app.py"]
    assert found.venvs == ["env2/"]
    assert not found.truncated
    few = survey(tmp_path, limit=3)
    assert few.truncated and len(few.files) + len(few.dirs) <= 3


def test_init_outside_a_repository_writes_in_the_current_directory(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    (plain / "src").mkdir(parents=True)
    (plain / "id_rsa").write_text("key\n")
    proc = guard(plain, "init", "--allow", "src/", "tidy up")
    assert proc.returncode == 0, proc.stderr
    assert load_manifest(plain / "guard.toml").paths.secret == ["id_rsa*"]
    assert sorted(os.listdir(plain)) == ["guard.toml", "id_rsa", "src"]
