"""The basetemps pytest is about to remove, removed first with guardfs.harvest.remove_tree.

A failed run can leave a tree deeper than Python's stack (an agent's ``mkdir -p`` of 2,000
levels, tests/helpers.py's ``dir_chain``) in its basetemp. pytest removes it later, at the
end of a session three runs on (it keeps the last three ``pytest-of-<user>/pytest-N``), or at
the start of the next run with that ``--basetemp``, with the recursive ``shutil.rmtree``:
that fails, leaves an unclosed scandir iterator, and the ResourceWarning, an error under
``filterwarnings = error``, makes a session whose every test passed exit 1. So before pytest
makes its basetemp, the main process (never an xdist worker: the workers' basetemps are inside
the controller's) removes what pytest would: the given ``--basetemp``, or the numbered
basetemps it prunes and the ``garbage-*`` a failed removal left, by pytest's own rules (a
basetemp whose lock is live belongs to a running session and is left alone).

tests/conftest.py calls :func:`pytest_configure`; ``-p tests.basetemp`` loads it alone
(tests/test_conftest_basetemp.py runs an inner pytest so).
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _pytest.pathlib import LOCK_TIMEOUT, cleanup_candidates, ensure_deletable

from guardfs.harvest import remove_tree

__all__ = ["old_basetemps", "pytest_configure"]

_PREFIX = "pytest-"


def old_basetemps(config: pytest.Config, now: float) -> list[Path]:
    """What this session's pytest removes of earlier sessions' basetemps, by its rules as of
    *now*: the given ``--basetemp`` (removed when the session makes its own), else the numbered
    ones its cleanup prunes once it has made the next one and the ``garbage-*`` left behind,
    each with no live lock."""
    given = config.option.basetemp
    if given:
        path = Path(given)
        return [path] if os.path.lexists(path) else []
    root = Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()).resolve() / _root_name()
    if not root.is_dir() or root.is_symlink():
        return []
    keep = 0 if config.getini("tmp_path_retention_policy") == "none" else int(config.getini("tmp_path_retention_count"))
    # The session's own basetemp, made later, is one past the highest: pytest then prunes up to
    # (that one - keep), which is (the highest now - (keep - 1)).
    candidates = [*cleanup_candidates(root, _PREFIX, keep - 1), *root.glob("garbage-*")]
    return [path for path in candidates if ensure_deletable(path, now - LOCK_TIMEOUT)]


def _root_name() -> str:
    try:
        user = getpass.getuser()
    except (ImportError, KeyError, OSError):
        user = "unknown"
    return f"pytest-of-{user}"


def pytest_configure(config: pytest.Config) -> None:
    """In the main process, remove :func:`old_basetemps` (any depth, read-only directories
    too); what cannot be removed is said on stderr (pytest then fails on it as before)."""
    if hasattr(config, "workerinput"):
        return
    for path in old_basetemps(config, time.time()):
        for problem in remove_tree(path):
            sys.stderr.write(f"tests/basetemp.py: {problem} (an earlier session's basetemp, not removed)\n")
