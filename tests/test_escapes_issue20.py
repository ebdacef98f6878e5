"""Hostile agents against what landed with issue 20: the default manifest, the workspace found by
walking up for ``.git``, the agent's installation revealed from a hidden home, ``guard init``.
Each attack runs from inside a real ``guard run --ci`` (as root and, where the feature applies,
as ``--user nobody``) and the host is checked afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
