"""Hostile agents against what landed with issue 20: the default manifest (a later run's, planted),
the agent's installation revealed from a hidden home, the guard's notices naming the agent's
files, ``guard init`` in a repository the agent touched, oscillation's new history rules, the
credential stores' masks. Each attack runs from inside a real ``guard run --ci`` (as root and,
where the feature applies, as ``--user nobody``) and the host is checked afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import FIX_TAX
from .hostile import hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]

#: A manifest the agent would like a later run to obey.
ALLOW_ALL = "[task]\nid = 'x'\ngoal = 'anything'\n[paths]\nallowed = ['**']\n"


# ----- the default manifest -----------------------------------------------------------------------


@pytest.mark.parametrize("user", USERS)
def test_a_manifest_planted_in_a_subdirectory_is_refused(tmp_path: Path, user: str | None) -> None:
    """Any directory can be a later run's workspace (a repository the agent makes with ``git init``,
    a directory outside every repository) and its ``guard.toml`` that run's manifest: the agent's
    ``src/checkout/guard.toml`` and a nested repository there would make a human's next
    ``cd src/checkout && guard run -- agent`` obey a manifest the agent wrote (it was written)."""
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, f'''
        import subprocess
        attempt("git_init", lambda: subprocess.run(["git", "init", "-q", "src/checkout"]).returncode)
        attempt("write", lambda: open("src/checkout/guard.toml", "w").write({ALLOW_ALL!r}))
        open("src/checkout/evil", "w").write({ALLOW_ALL!r})  # an in-scope step: the breaker closes
        attempt("rename", lambda: os.rename("src/checkout/evil", "src/checkout/guard.toml"))
        os.mkdir("src/checkout/d")
        attempt("in_dir", lambda: open("src/checkout/d/guard.toml", "w").write({ALLOW_ALL!r}))
    ''')
    assert seen == {"git_init": 0, "write": "EROFS", "rename": "EROFS", "in_dir": "EROFS"}, (seen, proc.stderr)
    assert not (ws / "src/checkout/guard.toml").exists() and not (ws / "src/checkout/d/guard.toml").exists()
    later = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--", "true"], cwd=ws / "src/checkout",
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert later.returncode == 64 and "no guard.toml in the workspace" in later.stderr, later.stderr


# ----- the agent's installation -------------------------------------------------------------------


@pytest.fixture
def deep_home() -> Iterator[Path]:
    """A home two levels under /home (``/home/<group>/<user>``, as many sites lay them out)."""
    top = Path(tempfile.mkdtemp(prefix="guardfs-h20-", dir="/home"))
    try:
        home = top / "u"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh/id_rsa").write_text("PRIVATE KEY\n")
        (home / "notes.txt").write_text("private notes\n")
        yield home
    finally:
        shutil.rmtree(top)


def test_an_agent_in_the_homes_own_bin_reveals_no_more_than_itself(tmp_path: Path, deep_home: Path) -> None:
    """``~/bin/agent`` beside a ``~/lib`` (``n`` with N_PREFIX=~, ``make install PREFIX=~``) made the
    home a prefix installation, bound whole into the sandbox: ``~/notes.txt`` was read."""
    (deep_home / "lib").mkdir()
    agent = deep_home / "bin/agent"
    agent.parent.mkdir()
    agent.write_text("#!/usr/bin/python3\nimport sys\nfor p in sys.argv[1:]:\n"
                     "    try:\n        print(open(p).read(), end='')\n    except OSError as e:\n"
                     "        print(p, type(e).__name__)\n")
    agent.chmod(0o755)
    ws = hostile_workspace(tmp_path)
    (tmp_path / "manifest.toml").write_text(FIX_TAX)
    env = {**os.environ, "HOME": str(deep_home), "PATH": f"{agent.parent}:{os.environ['PATH']}"}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(tmp_path / "manifest.toml"),
         "--run-dir", str(run_dir), "--", "agent", str(deep_home / "notes.txt"), str(deep_home / "lib")],
        cwd=ws, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    out = (run_dir / "stdout.log").read_text()
    assert "private notes" not in out
    assert out == f"{deep_home / 'notes.txt'} FileNotFoundError\n{deep_home / 'lib'} FileNotFoundError\n", out


# ----- the guard's console ------------------------------------------------------------------------

#: A directory name that, printed raw, retitles the human's terminal and forges a line of the guard.
FORGED = "a\x1b]2;owned\x07\nguard: run summary (forged)\nb"


@pytest.mark.parametrize("user", USERS)
def test_a_generated_tree_named_with_escapes_is_said_escaped(tmp_path: Path, user: str | None) -> None:
    """A ``node_modules`` the agent made is bound natively by the next run, which says it on the
    guard's stderr by its path: escapes and a newline in a directory above it reached the human's
    terminal raw (a retitled window, a forged line of the guard); so did a set-user-ID file's."""
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, f'''
        attempt("mkdir", lambda: os.makedirs("src/checkout/" + {FORGED!r} + "/node_modules"))
        attempt("write", lambda: open("src/checkout/" + {FORGED!r} + "/node_modules/x", "w").write("x"))
        attempt("chmod", lambda: os.chmod("src/checkout/" + {FORGED!r} + "/node_modules/x", 0o4755))
    ''')
    # Natively once the tree is bound (swept at the end), refused by the mount before that.
    assert seen in ({"mkdir": None, "write": 1, "chmod": c} for c in (None, "EPERM")), (seen, proc.stderr)
    (tmp_path / "next").mkdir()
    _, _, proc = hostile_run(tmp_path / "next", ws, user, f'''
        attempt("chmod", lambda: os.chmod("src/checkout/" + {FORGED!r} + "/node_modules/x", 0o4755))
    ''')
    assert "generated trees (written natively" in proc.stderr, proc.stderr  # said, so the test can fail
    assert "\x1b" not in proc.stderr and "\nguard: run summary (forged)" not in proc.stderr, proc.stderr


# ----- guard init in a repository the agent touched -----------------------------------------------

#: A file name ending as a key's would (``*.pem``, ``id_rsa*``), and escapes before it.
KEY_NAME = "k\x1b]2;owned\x07\rguard: forged"


@pytest.mark.parametrize("user", USERS)
def test_guard_init_after_the_agent_named_keys_with_escapes(tmp_path: Path, user: str | None) -> None:
    """The agent leaves keys named with escapes in scope, one of them added to git; the human then
    runs ``guard init`` there. The names were written raw into the manifest's comment (invalid TOML:
    guard init refused to write it) and into its warnings (the human's terminal retitled, a line
    forged by a carriage return)."""
    ws = hostile_workspace(tmp_path)
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    seen, _, proc = hostile_run(tmp_path, ws, user, f'''
        import subprocess
        attempt("pem", lambda: open("src/checkout/" + {KEY_NAME!r} + ".pem", "w").write("x"))
        attempt("key", lambda: open("src/checkout/id_rsa" + {KEY_NAME!r}, "w").write("x"))
        attempt("del", lambda: open("src/checkout/id_rsa_\x7f", "w").write("x"))  # a name patterns can hold
        attempt("add", lambda: subprocess.run(["git", "add", "src/checkout/id_rsa" + {KEY_NAME!r},
                                               "src/checkout/id_rsa_\x7f"]).returncode)
    ''')
    assert seen == {"pem": 1, "key": 1, "del": 1, "add": 0}, (seen, proc.stderr)
    init = subprocess.run([sys.executable, "-m", "sandbox", "init", "--allow", "src/checkout/", "fix the tax"],
                          cwd=ws, capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    assert "src/checkout/id_rsak" in init.stderr, init.stderr  # warned, so the test can fail
    for text in (init.stdout, init.stderr, (ws / "guard.toml").read_text()):
        assert "\x1b" not in text and "\r" not in text and "\x7f" not in text, text
    check = subprocess.run([sys.executable, "-m", "sandbox", "check"], cwd=ws, capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0 and "\x1b" not in check.stdout + check.stderr, check.stdout + check.stderr


# ----- oscillation's new history rules ------------------------------------------------------------


@pytest.mark.parametrize("user", USERS)
def test_deleting_between_flips_does_not_launder_an_oscillation(tmp_path: Path, user: str | None) -> None:
    """A deleted file starts a new history (no return to what it held), but its counts toward
    max_rewrites stay: the agent flipping ``tax.py`` between two versions with an ``rm`` before
    each write (``rm f && cat > f``) was never counted at all, each write a "creation", and
    flipped it 24 times without a trip. Its rewrites count: the fourth trips (max_rewrites 3)."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = hostile_run(tmp_path, ws, user, '''
        def flip(version):
            with open("src/checkout/tax.py", "w") as f:
                f.write(f"def total(x):\\n    return round(x, {version})\\n")
            os.unlink("src/checkout/tax.py")
            return version
        for i in range(24):
            attempt(f"flip{i}", lambda: flip(i % 2))
    ''')
    told = [name for name, got in seen.items() if got == "EDQUOT"]
    assert told and told[0] == "flip3", (seen, proc.stderr)
    assert [e["rule"] for e in events if e["op"] == "trip"][:1] == ["oscillation"], events


# ----- credential stores --------------------------------------------------------------------------

READER = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        print(p, open(p).read(), end='')\n"
          "    except OSError as e:\n        print(p, type(e).__name__)\n")


def test_a_readable_path_into_a_credential_store_stays_masked(tmp_path: Path, deep_home: Path) -> None:
    """``[sandbox] readable`` naming a file inside a credential store, directly or through a symlink
    (one left in a directory the agent may write, a state directory, for the next run to follow):
    its real path was bound, inside the store, and the store's mask was left out (it masked a
    store only when the store lay inside a shown tree, not a shown tree inside the store)."""
    (deep_home / ".aws").mkdir()
    (deep_home / ".aws/credentials").write_text("AWS KEY\n")
    (deep_home / ".config/agent").mkdir(parents=True)
    (deep_home / ".config/agent/token").symlink_to("../../.aws/credentials")
    ws = hostile_workspace(tmp_path)
    (tmp_path / "manifest.toml").write_text(
        FIX_TAX + '[sandbox]\nreadable = ["~/.config/agent/token", "~/.ssh/id_rsa"]\n')
    env = {**os.environ, "HOME": str(deep_home)}
    run_dir = tmp_path / "run"
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(tmp_path / "manifest.toml"),
         "--run-dir", str(run_dir), "--", python3, "-c", READER, str(deep_home / ".config/agent/token"),
         str(deep_home / ".aws/credentials"), str(deep_home / ".ssh/id_rsa")],
        cwd=ws, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    out = (run_dir / "stdout.log").read_text()
    assert "AWS KEY" not in out and "PRIVATE KEY" not in out, out
    assert f"{deep_home / '.aws'}, {deep_home / '.ssh'}" in proc.stderr or \
        f"{deep_home / '.ssh'}, {deep_home / '.aws'}" in proc.stderr, proc.stderr  # said masked


def test_a_credential_store_that_is_a_symlink_is_masked_where_it_leads(tmp_path: Path, deep_home: Path) -> None:
    """``~/.ssh`` a symlink to a directory the sandbox shows (keys kept on another disk, a home
    that is itself a link, as /home -> /var/home): ``~/.ssh`` lay under the covered /home, so
    nothing was masked, and the keys were read where the link leads."""
    keys = Path(tempfile.mkdtemp(prefix="guardfs-h20-keys-", dir="/var/tmp"))
    try:
        shutil.rmtree(deep_home / ".ssh")
        (keys / "id_rsa").write_text("PRIVATE KEY\n")
        (deep_home / ".ssh").symlink_to(keys)
        ws = hostile_workspace(tmp_path)
        (tmp_path / "manifest.toml").write_text(FIX_TAX)
        run_dir = tmp_path / "run"
        python3 = shutil.which("python3", path="/usr/bin:/bin")
        assert python3 is not None
        proc = subprocess.run(
            [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(tmp_path / "manifest.toml"),
             "--run-dir", str(run_dir), "--", python3, "-c", READER, str(keys / "id_rsa")],
            cwd=ws, env={**os.environ, "HOME": str(deep_home)}, capture_output=True, text=True, timeout=180,
            stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        out = (run_dir / "stdout.log").read_text()
        assert out == f"{keys / 'id_rsa'} PermissionError\n", out
        assert (keys / "id_rsa").read_text() == "PRIVATE KEY\n"
    finally:
        shutil.rmtree(keys)


def test_guard_init_says_a_secret_copied_into_a_build_tree_stays_readable(tmp_path: Path) -> None:
    """A build that copies ``.env`` into ``dist/`` (a generated tree, which ``.env*`` does not reach
    into): guard check warned that ``dist/.env`` stays readable, guard init dropped that warning as
    one about its own choice (it means the migrations of a venv), and the agent read the copy."""
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "dist").mkdir()
    (repo / "src/app.py").write_text("x = 1\n")
    for env in (".env", "dist/.env"):
        (repo / env).write_text("SECRET=hunter2\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    init = subprocess.run([sys.executable, "-m", "sandbox", "init", "--allow", "src/", "fix it"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stderr
    assert "guard init: warning: paths.secret '.env*': matches 1 path(s) inside the generated tree dist/ " \
           "(e.g. dist/.env)" in init.stderr and "'dist/**/.env*'" in init.stderr, init.stderr
