"""Nothing the agent writes is lost: rewrites through O_TRUNC and truncate, through a real mount.

A truncation followed by writes in the same session is one rewrite from the old content to
the new one, and any refused rewrite leaves the file byte for byte as it was.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import snapshot
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


MANIFEST = (Path(__file__).parent.parent / "manifests/checkout-bugfix.toml").read_text(encoding="utf-8")
TAX = "src/checkout/tax.py"
A = "def total(x):\n    return x\n"
B = "x = 1\n"


def _workspace(tmp_path: Path, content: str = A) -> Path:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    (tmp_path / "backing" / TAX).write_text(content, encoding="utf-8")
    run = tmp_path / "run"
    run.mkdir()
    return run


def _shell_redirect(g: Guarded, text: str) -> subprocess.CompletedProcess[str]:
    """The shell's `>`: open with O_TRUNC, dup2 onto stdout, close, write, close."""
    return subprocess.run(
        ["sh", "-c", f'printf %s "$1" > {TAX}', "sh", text], cwd=g.mnt, capture_output=True, text=True, check=False,
    )


def _python_open_w(g: Guarded, text: str) -> int:
    try:
        (g.mnt / TAX).write_text(text, encoding="utf-8")
    except OSError as err:
        return err.errno or 0
    return 0


def _truncate_then_write(g: Guarded, text: str) -> int:
    fd = os.open(g.mnt / TAX, os.O_WRONLY)
    try:
        os.truncate(fd, 0)
        os.write(fd, text.encode())
    except OSError as err:
        return err.errno or 0
    finally:
        os.close(fd)
    return 0


def _shell(g: Guarded, text: str) -> int:
    done = _shell_redirect(g, text)
    if done.returncode == 0:
        return 0
    # dash says "I/O error" whatever the errno: the guard's event names it.
    assert "error" in done.stderr, done.stderr
    return int(getattr(errno, g.denials()[-1]["errno"]))


WAYS: dict[str, Callable[[Guarded, str], int]] = {
    "shell >": _shell, "python open('w')": _python_open_w, "os.truncate + write": _truncate_then_write,
}


def _trips(g: Guarded) -> list[dict[str, object]]:
    return [e for e in g.events() if e["op"] == "trip"]


def test_shell_redirect_twice_keeps_the_content(tmp_path: Path) -> None:
    """The exact report: `echo "x = 1" > tax.py` twice left the file at 0 bytes."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        for _ in range(3):
            done = subprocess.run(
                ["sh", "-c", f'echo "x = 1" > {TAX}'], cwd=g.mnt, capture_output=True, text=True, check=False,
            )
            assert (done.returncode, done.stderr) == (0, "")
            assert (g.backing / TAX).read_bytes() == b"x = 1\n"
        assert not g.denials() and not _trips(g)
        rewrites = [e for e in g.events() if e["op"] == "rewrite"]
        assert len(rewrites) == 3 and not any(e.get("cycle") for e in rewrites)
        # The truncation in between is not a version: the history is A, B.
        assert len(g.fs.accounting.files[TAX].hashes) == 2


@pytest.mark.parametrize("way", WAYS)
def test_same_content_is_a_no_op(tmp_path: Path, way: str) -> None:
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        for _ in range(3):
            assert WAYS[way](g, B) == 0
            assert (g.backing / TAX).read_text(encoding="utf-8") == B
        assert not g.denials() and not _trips(g)


@pytest.mark.parametrize("way", WAYS)
def test_previous_content_is_refused_and_the_file_kept(tmp_path: Path, way: str) -> None:
    """A → B → A: refused as a content cycle, and the file stays B, byte for byte."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        assert WAYS[way](g, B) == 0
        before = snapshot(g.backing)
        assert WAYS[way](g, A) == errno.EDQUOT
        assert snapshot(g.backing) == before
        assert (g.mnt / TAX).read_text(encoding="utf-8") == B  # the kernel's view was reloaded
        assert os.stat(g.mnt / TAX).st_size == len(B)
        assert [t["rule"] for t in _trips(g)] == ["oscillation"]
        assert g.fs.accounting.files[TAX].rewrites == 1  # the refused rewrite counted nothing


def test_write_after_truncate_refused_by_a_trip_restores(tmp_path: Path) -> None:
    """The breaker trips between O_TRUNC and the write: the write is refused and undone."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        before = snapshot(g.backing)
        fd = os.open(g.mnt / TAX, os.O_WRONLY | os.O_TRUNC)
        try:
            assert (g.backing / TAX).read_bytes() == b""
            for _ in range(2):  # out of scope: a scope-spill trip, then a halt
                with pytest.raises(OSError) as info:
                    (g.mnt / "README.md").write_text("x\n")
                assert info.value.errno == errno.EROFS
            assert g.daemon is not None and g.daemon.breaker.state.terminal
            with pytest.raises(OSError) as info:
                os.write(fd, B.encode())
            assert info.value.errno == errno.EDQUOT
        finally:
            os.close(fd)
        assert snapshot(g.backing) == before
        assert (g.mnt / TAX).read_text(encoding="utf-8") == A
        assert [t["rule"] for t in _trips(g)] == ["scope_spill", "scope_spill"]


def test_rewrite_limit_after_truncate_restores(tmp_path: Path) -> None:
    """limits.max_rewrites refuses the write that follows `>`'s truncation: the file is kept."""
    run = _workspace(tmp_path)
    manifest = MANIFEST.replace("max_rewrites = 3", "max_rewrites = 2")
    with guarded_mount(tmp_path, manifest) as g:
        for body in ("x + 1", "abs(x)"):
            assert _shell_redirect(g, A.replace("x\n", body + "\n")).returncode == 0
        before = snapshot(g.backing)
        assert _shell(g, A.replace("x\n", "round(x)\n")) == errno.EDQUOT
        assert snapshot(g.backing) == before
        assert [d["rule"] for d in g.denials()] == ["limits.max_rewrites"]
    assert run.is_dir()


def test_blast_radius_refuses_o_trunc_before_it_truncates(tmp_path: Path) -> None:
    """The 7th distinct file, reached by `>` on an existing file, is refused at open."""
    _workspace(tmp_path)
    (tmp_path / "backing/src/checkout/seventh.py").write_text(A, encoding="utf-8")
    with guarded_mount(tmp_path, MANIFEST) as g:
        for i in range(5):
            (g.mnt / f"src/checkout/f{i}.py").write_text(B)
        assert _shell_redirect(g, B).returncode == 0  # tax.py: the 6th
        before = snapshot(g.backing)
        done = subprocess.run(
            ["sh", "-c", "echo y > src/checkout/seventh.py"], cwd=g.mnt, capture_output=True, text=True, check=False,
        )
        assert done.returncode != 0 and "Disk quota exceeded" in done.stderr
        assert snapshot(g.backing) == before
        assert [d["rule"] for d in g.denials()] == ["limits.max_files"]
        assert g.fs.accounting.distinct == 6


def test_out_of_scope_o_trunc_leaves_the_file(tmp_path: Path) -> None:
    _workspace(tmp_path)
    (tmp_path / "backing/README.md").write_text("read me\n", encoding="utf-8")
    with guarded_mount(tmp_path, MANIFEST) as g:
        before = snapshot(g.backing)
        done = subprocess.run(["sh", "-c", "echo y > README.md"], cwd=g.mnt, capture_output=True, text=True,
                              check=False)
        assert done.returncode != 0
        assert snapshot(g.backing) == before


def test_truncate_alone_commits_at_close(tmp_path: Path) -> None:
    """`: > file` empties the file: one rewrite to empty, committed when the file is closed."""
    _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST) as g:
        assert subprocess.run(["sh", "-c", f": > {TAX}"], cwd=g.mnt, check=False).returncode == 0
        assert (g.backing / TAX).read_bytes() == b""
        # release is asynchronous: read the count once the kernel has sent it.
        from .helpers import wait_for

        wait_for(lambda: TAX in g.fs.accounting.files and g.fs.accounting.files[TAX].rewrites == 1, "the commit")
        with open(g.mnt / TAX, "a", encoding="utf-8") as f:
            f.write(B)
        assert (g.backing / TAX).read_text(encoding="utf-8") == B
