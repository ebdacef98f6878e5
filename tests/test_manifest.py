"""Manifests: the shipped examples are valid; every kind of invalid one is refused by
``guard check`` with exit 65 and a message naming the file, the key and the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from guardfs.errors import ManifestError
from guardfs.manifest import DEFAULT_HOME_SECRETS, load_manifest, outside_secrets, parse_manifest

MANIFESTS = Path(__file__).parent.parent / "manifests"
HEAD = '[task]\nid = "t"\ngoal = "g"\n'


def guard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``guard`` command line as a user would."""
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.mark.parametrize("path", sorted(MANIFESTS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_manifests_are_valid(path: Path, tmp_path: Path) -> None:
    proc = guard("-v", "check", "--workspace", str(tmp_path), str(path))
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(path)
    assert f"{path}: valid; {len(manifest.paths.allowed)} allowed" in proc.stdout
    assert manifest.task.id in proc.stdout  # -v: the compiled policy
    assert "precedence: built-in protections > paths.secret (and paths.forbidden) > paths.protected" in proc.stdout


def test_shipped_profiles_say_what_they_promise() -> None:
    checkout = load_manifest(MANIFESTS / "checkout-bugfix.toml")
    assert checkout.paths.allowed == ["src/checkout/", "tests/checkout/"]
    assert {".env*", "src/auth/root_keys.ts"} <= set(checkout.paths.secret)
    assert {".github/workflows/", "**/migrations/"} <= set(checkout.paths.protected)
    assert checkout.limits.max_files == 6
    assert load_manifest(MANIFESTS / "codemod-repo-wide.toml").limits.max_files is None
    review = load_manifest(MANIFESTS / "review-read-only.toml")
    assert review.read_only and review.paths.git_internals == "read-only"


INVALID = {
    "unknown key": (HEAD + "[limits]\nmax_filez = 3\n", "limits.max_filez", "unknown key"),
    "unknown section": (HEAD + "[extras]\nx = 1\n", "extras", "unknown key"),
    "wrong type": (HEAD + "[limits]\nmax_files = \"six\"\n", "limits.max_files", 'positive integer or "unlimited"'),
    "bool for int": (HEAD + "[limits]\nwindow_steps = true\n", "limits.window_steps", "valid integer"),
    "negative limit": (HEAD + "[limits]\nmax_rewrites = 0\n", "limits.max_rewrites", "greater than or equal to 1"),
    "list expected": (HEAD + "[paths]\nallowed = \"src/\"\n", "paths.allowed", "valid list"),
    "over-broad forbidden": (HEAD + "[paths]\nforbidden = [\"**\"]\n", "paths.forbidden[0]", "over-broad"),
    "over-broad star": (HEAD + "[paths]\nforbidden = [\".env\", \"*\"]\n", "paths.forbidden[1]", "over-broad"),
    "escapes root": (HEAD + "[paths]\nallowed = [\"../other/\"]\n", "paths.allowed[0]", "escapes the workspace root"),
    "dot component": (HEAD + "[paths]\nallowed = [\"./src/\"]\n", "paths.allowed[0]", "without './'"),
    "empty pattern": (HEAD + "[paths]\nforbidden = [\"  \"]\n", "paths.forbidden[0]", "empty pattern"),
    "bad range": (HEAD + "[paths]\nforbidden = [\"[z-a].py\"]\n", "paths.forbidden[0]", "not a valid gitignore"),
    "unclosed bracket": (HEAD + "[paths]\nallowed = [\"src/[\"]\n", "paths.allowed[0]", "matches nothing"),
    "comment pattern": (HEAD + "[paths]\nforbidden = [\"# secrets\"]\n", "paths.forbidden[0]", "matches nothing"),
    "trailing backslash": (HEAD + "[paths]\nforbidden = [\"x\\\\\"]\n", "paths.forbidden[0]", "not a valid gitignore"),
    "missing goal": ('[task]\nid = "t"\n', "task.goal", "required key is missing"),
    "missing task": ("[paths]\nallowed = []\n", "task", "required key is missing"),
    "bad id": ('[task]\nid = "no spaces allowed"\ngoal = "g"\n', "task.id", "should match pattern"),
    "bad git setting": (HEAD + '[paths]\ngit_internals = "maybe"\n', "paths.git_internals", "or 'read-only'"),
    "not toml": ("[task\nid=", "", "not valid TOML"),
    "over-broad secret": (HEAD + "[paths]\nsecret = [\"**\"]\n", "paths.secret[0]", "over-broad"),
    "glob outside": (HEAD + "[paths]\nsecret = [\"~/.ssh/*\"]\n", "paths.secret[0]", "is a literal path"),
    "dotdot outside": (HEAD + "[paths]\nsecret = [\"/etc/../root\"]\n", "paths.secret[0]", "'..' component"),
    "whole home": (HEAD + "[paths]\nsecret = [\"~/\"]\n", "paths.secret[0]", "whole home"),
    "whole root": (HEAD + "[paths]\nsecret = [\"/\"]\n", "paths.secret[0]", "whole filesystem"),
    "over-broad protected": (HEAD + "[paths]\nprotected = [\"*\"]\n", "paths.protected[0]", "read-only workspace"),
    "protected git": (HEAD + "[paths]\nprotected = [\".git/hooks/\"]\n", "paths.protected[0]", "git_internals"),
    "protected escapes": (HEAD + "[paths]\nprotected = [\"../x\"]\n", "paths.protected[0]", "escapes"),
}


@pytest.mark.parametrize("case", sorted(INVALID), ids=str)
def test_invalid_manifest_is_refused_with_its_reason(case: str, tmp_path: Path) -> None:
    text, key, reason = INVALID[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    proc = guard("check", "--workspace", str(tmp_path), str(path))
    assert proc.returncode == 65, proc.stderr
    assert proc.stdout == ""  # never a compiled policy from defaults
    line = next((ln for ln in proc.stderr.splitlines() if reason in ln), None)
    assert line is not None, proc.stderr
    assert str(path) in line
    assert f": {key}:" in line if key else True


def test_unreadable_and_missing_files_are_named(tmp_path: Path) -> None:
    proc = guard("check", str(tmp_path / "absent.toml"), cwd=tmp_path)
    assert proc.returncode == 65 and "absent.toml: cannot read" in proc.stderr
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    proc = guard("check", str(binary), cwd=tmp_path)
    assert proc.returncode == 65 and "binary.toml: cannot read" in proc.stderr


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(HEAD + '[paths]\nforbidden = ["**"]\nallowed = ["../x"]\n[limits]\nnope = 1\n', "m.toml")
    keys = [k for k, _ in info.value.problems]
    assert keys == ["paths.allowed[0]", "paths.forbidden[0]", "limits.nope"] or set(keys) == {
        "paths.allowed[0]", "paths.forbidden[0]", "limits.nope"}


def test_manifest_is_frozen() -> None:
    manifest = parse_manifest(HEAD)
    with pytest.raises(ValueError, match="frozen"):
        manifest.task.goal = "something else"


def test_check_usage_errors_exit_64(tmp_path: Path) -> None:
    assert guard("check", cwd=tmp_path).returncode == 64  # no guard.toml here (tests/test_lint.py)
    assert guard("frobnicate").returncode == 64
    proc = guard("check", "--help")
    assert proc.returncode == 0 and "guard schema" in proc.stdout
    assert "max_files" in guard("schema").stdout


def test_secret_and_forbidden_are_one_class_named_by_their_keys() -> None:
    paths = parse_manifest(HEAD + '[paths]\nsecret = [".env*", "~/.config/acme/token", "/etc/acme.key"]\n'
                           'forbidden = ["**/*.pem"]\n').paths
    assert paths.secret_patterns == [("paths.secret", ".env*"), ("paths.forbidden", "**/*.pem")]
    assert paths.workspace_secrets == [".env*", "**/*.pem"]


def test_outside_secrets_follow_the_defaults_expanded_against_the_agents_home() -> None:
    secrets = '".env", "~/.config/acme/token/", "/etc/acme.key", "~/.ssh"'
    paths = parse_manifest(HEAD + f"[paths]\nsecret = [{secrets}]\n").paths
    out = outside_secrets(paths, "/home/agent")
    defaults = [f"/home/agent/{name}" for name in DEFAULT_HOME_SECRETS]
    assert out[:len(defaults)] == defaults  # ~/.ssh is a default already: named once
    assert out[len(defaults):] == ["/home/agent/.config/acme/token", "/etc/acme.key"]
    assert outside_secrets(parse_manifest(HEAD).paths, "/root") == [f"/root/{n}" for n in DEFAULT_HOME_SECRETS]


def test_protected_is_a_list_of_patterns() -> None:
    paths = parse_manifest(HEAD + '[paths]\nprotected = [".github/workflows/", "**/migrations/"]\n').paths
    assert paths.protected == [".github/workflows/", "**/migrations/"]
    assert parse_manifest(HEAD).paths.protected == []
