"""Real tools in a narrowly scoped repository, through ``guard run --ci``, as a user runs them.

Scope: ``src/checkout/`` only. git (status, add, commit), a venv with pip install in scope,
and pytest work, from inside the scope or from the root: what the tools generate (pytest's
cache at the root, a venv under the default ``max_files``) is generated territory
(``[paths] generated``, see tests/test_generated.py), and ``git stash`` putting back the
committed version is git's revert, not the agent's oscillation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .helpers import git_env

# Each test runs guard run for real: root (as CI) and a FUSE mount.
pytestmark = [pytest.mark.root, pytest.mark.mount]


UNLIMITED = '[limits]\nmax_files = "unlimited"\nmax_rewrites = "unlimited"\n'


class Run:
    """One ``guard run --ci`` of a shell script in a fresh, committed repository."""

    def __init__(self, tmp_path: Path, limits: str = "") -> None:
        self.ws, self.home, self.run_dir = tmp_path / "ws", tmp_path / "home", tmp_path / "run"
        (self.ws / "src/checkout").mkdir(parents=True)
        self.home.mkdir()
        (self.ws / "src/checkout/tax.py").write_text("def total(x):\n    return round(x, 2)\n")
        (self.ws / "src/checkout/test_tax.py").write_text(
            "from tax import total\n\n\ndef test_total():\n    assert total(1.234) == 1.23\n")
        (self.ws / "README.md").write_text("readme\n")
        self.env = {**git_env(self.home), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
            subprocess.run(argv, cwd=self.ws, env=self.env, check=True)
        self.manifest = tmp_path / "guard.toml"
        self.manifest.write_text(
            '[task]\nid = "fix-tax"\ngoal = "Fix the tax rounding helper in src/checkout/"\n'
            '[paths]\nallowed = ["src/checkout/"]\nforbidden = [".env*"]\n'
            f'{limits}[sandbox]\nwritable = ["{self.home}"]\n'
        )

    def __call__(self, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(self.manifest), "--run-dir",
             str(self.run_dir), "--", "sh", "-c", script],
            cwd=self.ws, env=self.env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )

    def log(self) -> str:
        """What the tools printed, both streams."""
        return (self.run_dir / "stdout.log").read_text() + (self.run_dir / "stderr.log").read_text()

    def trips(self) -> list[dict[str, Any]]:
        """The breaker's trips, from the ledger."""
        trips: list[dict[str, Any]] = json.loads((self.run_dir / "ledger.json").read_text())["trips"]
        return trips

    def git(self, *args: str) -> str:
        """git on the host, after the run."""
        return subprocess.run(["git", *args], cwd=self.ws, env=self.env, capture_output=True, text=True,
                              check=True).stdout


def test_git_status_add_commit(tmp_path: Path) -> None:
    run = Run(tmp_path)
    result = run('echo "# cents" >> src/checkout/tax.py && git status --short && git add src/checkout/tax.py'
                 ' && git commit -qm "round to cents" && git status --short && echo COMMITTED')
    assert result.returncode == 0, (result.stderr, run.log())
    assert " M src/checkout/tax.py" in run.log() and "COMMITTED" in run.log()
    assert run.git("log", "--format=%s") == "round to cents\ninit\n"
    assert run.git("show", "HEAD:src/checkout/tax.py").endswith("# cents\n")
    assert run.git("status", "--porcelain") == ""
    assert run.trips() == []


def test_pip_install_into_a_venv_in_scope(tmp_path: Path) -> None:
    run = Run(tmp_path, UNLIMITED)
    result = run("/usr/bin/python3 -m venv src/checkout/.venv && src/checkout/.venv/bin/pip install -q iniconfig"
                 ' && src/checkout/.venv/bin/python -c "import iniconfig; print(\'IMPORTED\', iniconfig.__name__)"')
    if "No matching distribution" in run.log() or "Could not find a version" in run.log():
        pytest.skip(f"no package index reachable from here: {run.log()[-300:]}")
    assert result.returncode == 0, (result.stderr, run.log()[-3000:])
    assert "IMPORTED iniconfig" in run.log()
    assert list((run.ws / "src/checkout/.venv/lib").glob("python3*/site-packages/iniconfig/__init__.py"))
    assert run.trips() == []


def test_pytest_from_inside_the_scope_keeps_its_cache_there(tmp_path: Path) -> None:
    """With its cache inside the scope, pytest runs as often as the agent likes."""
    run = Run(tmp_path)
    py = sys.executable  # this interpreter has pytest
    result = run(f"cd src/checkout && for i in 1 2 3; do {py} -m pytest -q --rootdir=. -o cache_dir=.pytest_cache"
                 " test_tax.py || exit 9; done; touch test_tax.py; {py} -m pytest -q --lf test_tax.py".replace(
                     "{py}", py))
    assert result.returncode == 0, (result.stderr, run.log()[-3000:])
    assert run.log().count("1 passed") == 4
    assert (run.ws / "src/checkout/.pytest_cache/v/cache/nodeids").exists()
    assert run.trips() == []


# ----- generated territory and git's own restores: what tripped before -------------------------


def test_plain_pytest_twice_from_the_root(tmp_path: Path) -> None:
    """pytest's cache at the repository root is generated output out of scope: it lands in the
    run's scratch layer, so neither run trips and the host's workspace never sees it."""
    run = Run(tmp_path)
    result = run(f"{sys.executable} -m pytest -q src/checkout && {sys.executable} -m pytest -q src/checkout")
    assert [t["rule"] for t in run.trips()] == [], run.log()[-2000:]  # before: scope_spill, scope_spill
    assert result.returncode == 0, (result.stderr, run.log()[-2000:])
    assert run.log().count("1 passed") == 2
    assert not (run.ws / ".pytest_cache").exists()


def test_a_venv_in_scope_under_the_default_limits(tmp_path: Path) -> None:
    """A venv's ~2,400 files are generated output: none counts toward max_files (default 20)."""
    run = Run(tmp_path)
    result = run("/usr/bin/python3 -m venv src/checkout/.venv && echo VENV-MADE")
    assert [t["rule"] for t in run.trips()] == [], run.log()[-2000:]  # before: blast_radius
    assert result.returncode == 0 and "VENV-MADE" in run.log(), run.log()[-2000:]
    assert (run.ws / "src/checkout/.venv/bin/pip").exists()


def test_git_stash_and_pop(tmp_path: Path) -> None:
    """git stash puts back the committed version (A->B->A): a revert by git, no oscillation."""
    run = Run(tmp_path)
    result = run('echo "# wip" >> src/checkout/tax.py && git stash -q && git stash pop -q && echo POPPED')
    assert [t["rule"] for t in run.trips()] == [], run.log()[-2000:]
    assert result.returncode == 0 and "POPPED" in run.log(), run.log()[-2000:]
    assert (run.ws / "src/checkout/tax.py").read_text().endswith("# wip\n")
    assert run.git("stash", "list") == ""
