"""The Session, one shape for every guarded run: each rollback recorded once, the hook and
the mount agreeing on every built-in protection, and no other place wiring a run by hand.
Real mounts, real sockets."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from sandbox.breaker.client import GuardClient

from .helpers import FIX_TAX
from .mounts import Guarded, guarded_mount

ROOT = Path(__file__).resolve().parent.parent


def rollbacks(g: Guarded) -> list[dict[str, object]]:
    """The run-level rollback events (per-path ones name their path)."""
    return [e for e in g.events() if e["op"] == "rollback" and e["path"] == ""]


@pytest.mark.mount
def test_one_rollback_one_event(tmp_path: Path) -> None:
    """A rollback the breaker asks for, and one the operator asks for, each write exactly
    one ``rollback`` event, with the number of paths it restored."""
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    manifest = FIX_TAX + "[limits]\nmax_consecutive_failures = 3\n[breaker]\nrollback_on_consecutive_failures = true\n"
    with guarded_mount(tmp_path, manifest, run_dir=tmp_path / "run", checkpoints=True) as g:
        assert g.daemon is not None
        for name in ("a.py", "b.py", "c.py"):
            (g.mnt / "src/checkout" / name).write_text("x = 1\n")
        with GuardClient(g.daemon.agent_path) as agent:
            for i in range(3):
                reply = agent.tool_result("Bash", 1, f"make step{i}")
        assert reply["trip"]["rule"] == "consecutive_failures"
        assert sorted(p.name for p in (g.backing / "src/checkout").iterdir()) == []
        assert [e["paths"] for e in rollbacks(g)] == [3]

        with GuardClient(g.daemon.control_path) as operator:
            assert operator.approve()["allow"]
            (g.mnt / "src/checkout/d.py").write_text("y = 2\n")
            assert operator.request({"type": "rollback"})["restored"] == 1
        assert not (g.backing / "src/checkout/d.py").exists()
        assert [e["paths"] for e in rollbacks(g)] == [3, 1]


def _both_answers(g: Guarded, path: str) -> tuple[bool, bool]:
    """(may the hook write *path*, did a write through the mount succeed); the breaker is
    approved back to CLOSED after each, so every path is judged from the same state."""
    assert g.daemon is not None
    with GuardClient(g.daemon.agent_path) as agent, GuardClient(g.daemon.control_path) as operator:
        hook = agent.check("Write", [path])["allow"]
        operator.approve()
        refused = 0
        try:
            with open(g.mnt / path, "a") as f:
                f.write("x\n")
        except OSError as err:
            refused = err.errno or -1
        assert refused in (0, errno.EROFS, errno.EACCES), (path, refused)  # a refusal, not a missing file
        operator.approve()
        mount = refused == 0
    return hook, mount


#: Every built-in protection, and paths on either side of it, with the expected answer.
BUILT_INS = {
    ".git/config": False,  # existed at the start: read-only
    ".git/hooks/pre-commit": False,  # hooks are read-only
    ".git/hooks/pre-commit.sample": True,  # git init's templates
    ".git/HEAD": False,  # git state: only git's lock-file rename, judged for what it changes
    ".git/refs/heads/main": False,
    ".git/refs/heads/main.lock": True,  # the rest of git's internals are writable
    ".git/COMMIT_EDITMSG": True,
    ".guard/notes": False,  # the guard's own directory
    ".guard/STATE.md": False,
    ".env": False,  # paths.forbidden
    "README.md": False,  # out of scope
    "src/checkout/tax.py": True,  # in scope
}


@pytest.mark.mount
def test_hook_check_and_mount_agree_on_every_built_in_protection(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    for d in ("src/checkout", ".git/hooks", ".git/refs/heads"):
        (backing / d).mkdir(parents=True)
    (backing / ".git/config").write_text("[core]\n")
    with guarded_mount(tmp_path, FIX_TAX, run_dir=tmp_path / "run") as g:
        answers = {path: _both_answers(g, path) for path in BUILT_INS}
    assert answers == {path: (want, want) for path, want in BUILT_INS.items()}


@pytest.mark.mount
def test_hook_check_and_mount_agree_on_a_git_config_the_agent_creates(tmp_path: Path) -> None:
    """A repository the agent creates during the run may configure itself, through git
    (issue 12: a lock file renamed over the config, checked); a direct write is refused by both."""
    (tmp_path / "backing/.git/hooks").mkdir(parents=True)
    with guarded_mount(tmp_path, FIX_TAX, run_dir=tmp_path / "run") as g:
        assert _both_answers(g, ".git/config") == (False, False)
        assert not (g.backing / ".git/config").exists()
        assert _both_answers(g, ".git/hooks/post-checkout") == (False, False)


def test_only_the_session_builds_guardfs_and_the_daemon() -> None:
    """Outside tests of GuardFS itself (test_gate, test_bounds_disk), every guarded run is built by
    sandbox.session."""
    builders = re.compile(r"\b(GuardFS|Daemon)\(")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("sandbox", "bench", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.name not in ("session.py", "test_bounds_disk.py", "test_gate.py", "test_session.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if builders.search(line) and not line.lstrip().startswith(("class ", "#", '"'))
    ]
    assert found == []
