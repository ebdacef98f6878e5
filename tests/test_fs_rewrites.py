"""Nothing the agent writes is lost: rewrites through O_TRUNC and truncate, through a real mount.

A truncation followed by writes in the same session is one rewrite from the old content to
the new one, and any refused rewrite leaves the file byte for byte as it was. What is no
content of the agent's (a size set by truncate alone, what a file held before the agent
deleted it) is never a version a file can return to; one return is a revert, a second a flip
(``limits.max_returns``), here and inside a real ``guard run --ci``.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from guardfs.signature import content_hash
from sandbox.breaker.client import GuardClient

from .helpers import snapshot, wait_for
from .mounts import Guarded, guarded_mount
from .test_real_tools import Run

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


def _shell_run(g: Guarded, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], cwd=g.mnt, capture_output=True, text=True, check=False)


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


def _refusals(g: Guarded) -> list[object]:
    """The rules of the operations refused (a trip's own event aside)."""
    return [d["rule"] for d in g.denials() if d["op"] != "trip"]


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
        assert len(rewrites) == 3 and not any(e.get("returns") for e in rewrites)
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
def test_a_revert_lands_and_a_flip_is_refused_and_the_file_kept(tmp_path: Path, way: str) -> None:
    """A → B → A lands (one revert, counted as a rewrite); A → B → A → B is refused as a flip,
    and the file stays A, byte for byte."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        assert WAYS[way](g, B) == 0
        assert WAYS[way](g, A) == 0  # the revert
        assert (g.backing / TAX).read_text(encoding="utf-8") == A and not _trips(g)
        before = snapshot(g.backing)
        assert WAYS[way](g, B) == errno.EDQUOT
        assert snapshot(g.backing) == before
        assert (g.mnt / TAX).read_text(encoding="utf-8") == A  # the kernel's view was reloaded
        assert os.stat(g.mnt / TAX).st_size == len(A)
        assert [t["rule"] for t in _trips(g)] == ["oscillation"]
        assert _refusals(g) == ["limits.max_returns"]
        rec = g.fs.accounting.files[TAX]
        assert (rec.rewrites, rec.returns) == (2, 1)  # the refused rewrite counted nothing


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


def _resized(g: Guarded) -> list[dict[str, object]]:
    """The rewrite events so far (a size-only change is one, committed at release)."""
    return [e for e in g.events() if e["op"] == "rewrite"]


def test_truncate_alone_commits_at_close_as_no_version(tmp_path: Path) -> None:
    """`: > file` empties the file: committed when the file is closed, as a size-only change:
    no version of the file, no rewrite of a unit."""
    _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST) as g:
        assert subprocess.run(["sh", "-c", f": > {TAX}"], cwd=g.mnt, check=False).returncode == 0
        assert (g.backing / TAX).read_bytes() == b""
        # release is asynchronous: read the record once the kernel has sent it.
        wait_for(lambda: len(_resized(g)) == 1, "the commit")
        rec = g.fs.accounting.files[TAX]
        assert (rec.rewrites, len(rec.hashes), rec.symbols) == (0, 1, {})
        with open(g.mnt / TAX, "a", encoding="utf-8") as f:
            f.write(B)
        assert (g.backing / TAX).read_text(encoding="utf-8") == B
        wait_for(lambda: len(_resized(g)) == 2, "the commit")
        assert g.fs.accounting.files[TAX].rewrites == 1 and not g.denials()


def _coreutils_truncate(path: Path, size: int) -> None:
    """truncate -s SIZE: open (creating it), ftruncate through the descriptor, close."""
    subprocess.run(["truncate", "-s", str(size), path], check=True)


TRUNCATES: dict[str, Callable[[Path, int], None]] = {
    "coreutils truncate": _coreutils_truncate, "os.truncate (truncate(2))": os.truncate,
}


@pytest.mark.parametrize("way", TRUNCATES)
def test_truncate_sizes_back_and_forth_are_no_returns(tmp_path: Path, way: str) -> None:
    """truncate -s 123 g; truncate -s 0 g; truncate -s 123 g, and again: sizes, no contents."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        g_path = g.mnt / "src/checkout/g"
        g_path.touch()  # truncate(2) needs the file; coreutils' truncate would make it
        for size in (123, 0, 123, 0, 123, 7):
            TRUNCATES[way](g_path, size)
            assert (g.backing / "src/checkout/g").read_bytes() == b"\0" * size
        for size in (0, 40, 0, 40):  # and of a source file written before
            TRUNCATES[way](g.mnt / TAX, size)
        assert not g.denials() and not _trips(g)


def test_ftruncate_through_the_handle_back_and_forth(tmp_path: Path) -> None:
    """ftruncate on one descriptor, and on one each time (pjdfstest's ftruncate/00)."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        path = g.mnt / "src/checkout/h"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            for size in (1234567, 567, 1234567, 0, 567):
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
        for size in (123, 0, 123, 0, 123):
            fd = os.open(path, os.O_RDWR)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        assert os.stat(path).st_size == 123
        assert not g.denials() and not _trips(g)


def test_deleted_and_made_again_starts_a_new_history(tmp_path: Path) -> None:
    """echo x > f; rm f; echo x > f, over and over: no return, no trip; a flip after it still trips."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run) as g:
        f = "src/checkout/f.txt"
        for _ in range(4):
            assert _shell_run(g, f"echo x > {f} && rm {f} && echo x > {f} && rm {f}").returncode == 0
        assert not g.denials() and not _trips(g)
        done = _shell_run(g, f"echo x > {f} && echo y > {f} && echo x > {f} && echo y > {f}")
        assert done.returncode != 0 and "error" in done.stderr, done.stderr  # dash: "I/O error", whatever the errno
        assert _refusals(g) == ["limits.max_returns"] and g.denials()[-1]["errno"] == "EDQUOT"
        assert (g.backing / f).read_text() == "x\n"


# ----- inside a real guard run --ci (a shell agent, the default limits) ---------------------------

FTRUNCATE = (
    'python3 -c "import os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); '
    '[os.ftruncate(fd, int(n)) for n in sys.argv[2:]]; os.close(fd)" '
)
ORDINARY = {
    "deleted and made again": "echo x > f && rm f && echo x > f",
    "truncate sizes": "truncate -s 123 g && truncate -s 0 g && truncate -s 123 g",
    "ftruncate sizes, one descriptor": FTRUNCATE + "h 123 0 123 0 123",
    "ftruncate sizes, a descriptor each": " && ".join(FTRUNCATE + f"h {n}" for n in (123, 0, 123)),
    # The agent's own patch, then its revert, with its editor: sed -i (an atomic save by
    # rename) and an in-place rewrite.
    "a revert with sed -i": "sed -i 's/round(x, 2)/round(x, 3)/' tax.py && sed -i 's/round(x, 3)/round(x, 2)/' tax.py",
    "a revert in place": "cp tax.py /tmp/orig && echo '# try' >> tax.py && cat /tmp/orig > tax.py",
}


@pytest.mark.root
@pytest.mark.parametrize("work", ORDINARY)
def test_ordinary_work_never_trips_in_a_guard_run(tmp_path: Path, work: str) -> None:
    run = Run(tmp_path)
    result = run(f"cd src/checkout && {ORDINARY[work]} && echo DONE")
    assert (result.returncode, run.trips()) == (0, []), (result.stderr[-2000:], run.log()[-2000:])
    assert "DONE" in run.log()
    assert run.git("show", "HEAD:src/checkout/tax.py") == (run.ws / "src/checkout/tax.py").read_text()


SED_FLIP = "sed -i 's/round(x, {})/round(x, {})/' src/checkout/tax.py; "


@pytest.mark.root
@pytest.mark.parametrize(("max_returns", "trips"), [(1, ["oscillation"]), (2, [])])
def test_a_flip_trips_a_guard_run_by_max_returns(tmp_path: Path, max_returns: int, trips: list[str]) -> None:
    """A → B → A → B with sed -i: the second return trips with max_returns = 1, not with 2."""
    run = Run(tmp_path, f"[limits]\nmax_returns = {max_returns}\n")
    result = run(SED_FLIP.format(2, 3) + SED_FLIP.format(3, 2) + SED_FLIP.format(2, 3) + "echo DONE")
    assert [t["rule"] for t in run.trips()] == trips, run.log()[-2000:]
    assert result.returncode == 0 and "DONE" in run.log()  # recoverable: the run goes on
    landed = (run.ws / "src/checkout/tax.py").read_text()
    assert landed == f"def total(x):\n    return round(x, {2 if trips else 3})\n"
    if trips:
        assert "return 2 (max_returns=1)" in run.trips()[0]["reason"]


@pytest.mark.root
def test_delete_and_recreate_then_flip_loops_still_trip(tmp_path: Path) -> None:
    """Deleting between flips hides none: each new history may revert once, and every
    rewrite still counts toward max_rewrites, so the loop trips in its second round."""
    run = Run(tmp_path)
    result = run("cd src/checkout && for i in 1 2 3 4 5 6; do { rm -f f && echo A > f && echo B > f && echo A > f; } "
                 "|| { echo REFUSED $i; break; }; done; echo DONE")
    assert [t["rule"] for t in run.trips()] == ["oscillation"], run.log()[-2000:]
    assert "max_rewrites=3" in run.trips()[0]["reason"]
    assert "DONE" in run.log() and result.returncode == 0
    refused = [line for line in run.log().splitlines() if line.startswith("REFUSED")]
    assert refused == ["REFUSED 2"], run.log()[-2000:]
    # And a flip right after a re-creation trips by max_returns.
    run2 = Run(tmp_path / "flip")
    run2("cd src/checkout && echo A > f && rm f && echo A > f && echo B > f && echo A > f && echo B > f")
    assert [t["rule"] for t in run2.trips()] == ["oscillation"]
    assert "max_returns=1" in run2.trips()[0]["reason"]


def test_a_rollback_puts_back_a_version_that_is_no_return(tmp_path: Path) -> None:
    """After the guard rolls B back to A, A is the current version: writing A again changes
    nothing, and B is the file's first return (allowed), the flip back to A its second."""
    run = _workspace(tmp_path)
    with guarded_mount(tmp_path, MANIFEST, run_dir=run, checkpoints=True) as g:
        assert g.daemon is not None
        assert _python_open_w(g, B) == 0
        (g.mnt / "src/checkout/new.py").write_text(B)  # made after the start: a rollback removes it
        with GuardClient(g.daemon.control_path) as operator:
            assert operator.request({"type": "rollback", "to": "start"})["restored"] == 2
        assert (g.mnt / TAX).read_text(encoding="utf-8") == A and not (g.backing / "src/checkout/new.py").exists()
        assert g.fs.accounting.files["src/checkout/new.py"].hashes == []  # made again, it starts anew
        rec = g.fs.accounting.files[TAX]
        assert rec.hashes[-1] == content_hash(A.encode()) and rec.returns == 0
        assert _python_open_w(g, A) == 0  # what the file holds: no return
        wait_for(lambda: [e.get("returns") for e in _resized(g)][-1:] == [None], "the commit")
        assert _python_open_w(g, B) == 0 and g.fs.accounting.files[TAX].returns == 1
        assert _python_open_w(g, A) == errno.EDQUOT
        assert _refusals(g) == ["limits.max_returns"]
