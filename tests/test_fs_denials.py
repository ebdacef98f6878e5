"""Every denial through real syscalls and commands; the backing tree stays byte-for-byte."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .helpers import snapshot
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(src: Path, dst: Path, flags: int) -> None:
    """renameat2(2), which Python does not expose."""
    if _libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(src))


def _populate(backing: Path) -> None:
    files = {
        ".env": "SECRET=1\n",
        "README.md": "readme\n",
        "src/auth/root_keys.ts": "KEY\n",
        "src/auth/session.ts": "session\n",
        "src/checkout/tax.py": "def rate():\n    return 0.2\n",
        "src/checkout/.env.local": "LOCAL_SECRET\n",
        "src/checkout/db/migrations/001.sql": "create table t;\n",
        "docs/guide.md": "guide\n",
        ".github/workflows/ci.yml": "on: push\n",
    }
    for rel, text in files.items():
        p = backing / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    os.setxattr(backing / "README.md", "user.note", b"kept")


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Guarded]:
    """A populated workspace under the checkout manifest."""
    (tmp_path / "backing").mkdir()
    _populate(tmp_path / "backing")
    with guarded_mount(tmp_path) as g:
        yield g


def refused(action: Callable[[], object], expected: int) -> None:
    """*action* must fail with *expected* errno."""
    with pytest.raises(OSError) as info:
        action()
    assert info.value.errno == expected, f"expected {errno.errorcode[expected]}, got {info.value!r}"


# ----- forbidden paths: neither read nor written ------------------------------------------


def test_forbidden_reads_are_refused(workspace: Guarded) -> None:
    m = workspace.mnt
    before = snapshot(workspace.backing)
    refused((m / ".env").read_text, errno.EACCES)
    refused(lambda: os.stat(m / "src/auth/root_keys.ts"), errno.EACCES)
    refused((m / "src/checkout/.env.local").read_bytes, errno.EACCES)
    refused(lambda: os.listdir(m / "src/checkout/db/migrations"), errno.EACCES)
    refused((m / ".github/workflows/ci.yml").read_text, errno.EACCES)
    # Not listed: readdirplus would hand the kernel their attributes, and names can leak.
    assert ".env" not in os.listdir(m)
    assert "root_keys.ts" not in os.listdir(m / "src/auth")
    assert "session.ts" in os.listdir(m / "src/auth")
    proc = subprocess.run(["cat", str(m / ".env")], capture_output=True, text=True)
    assert proc.returncode == 1 and "Permission denied" in proc.stderr
    assert snapshot(workspace.backing) == before
    rules = {(e["path"], e["pattern"]) for e in workspace.denials()}
    assert (".env", ".env*") in rules
    assert ("src/auth/root_keys.ts", "src/auth/root_keys.ts") in rules


def test_forbidden_through_symlinks_links_and_renames(workspace: Guarded) -> None:
    m, b = workspace.mnt, workspace.backing
    code = m / "src/checkout"
    # A symlink inside the mount is resolved by the kernel, through guardfs's lookup.
    os.symlink("../../.env", code / "env-link")
    os.symlink(str(m / "src/auth/root_keys.ts"), code / "abs-link")
    before = snapshot(b)
    refused((code / "env-link").read_text, errno.EACCES)
    refused((code / "abs-link").read_text, errno.EACCES)
    # Hard link and rename of a forbidden file into scope need its name: refused.
    refused(lambda: os.link(m / ".env", code / "env-copy"), errno.EACCES)
    refused(lambda: os.rename(m / ".env", code / "env-moved"), errno.EACCES)
    refused(lambda: os.rename(m / "src/auth/root_keys.ts", code / "keys.ts"), errno.EACCES)
    # Its parent carries it: moving the directory is refused too.
    refused(lambda: os.rename(code / "db", code / "db2"), errno.EACCES)
    refused(lambda: os.rename(m / "src/auth", code / "auth"), errno.EROFS)
    # Names in scope that a forbidden pattern covers cannot be made either.
    refused(lambda: (code / ".env").write_text("x"), errno.EACCES)
    refused(lambda: os.rename(code / "tax.py", code / ".env.prod"), errno.EACCES)
    assert snapshot(b) == before


def test_symlink_planted_in_the_backing_tree_is_never_followed(workspace: Guarded) -> None:
    """A symlink in the real tree (absolute, relative, as a swapped parent) cannot lead
    the server out of the workspace."""
    b, m = workspace.backing, workspace.mnt
    outside = b.parent / "outside"
    outside.mkdir()
    (outside / "secret").write_text("outside secret\n")
    os.symlink(str(outside), b / "src/checkout/out-abs")
    os.symlink("../../../outside", b / "src/checkout/out-rel")
    for name in ("out-abs", "out-rel"):
        # The kernel resolves the link in the agent's view: the target is not in the mount.
        link = m / "src/checkout" / name
        assert os.readlink(link) in (str(outside), "../../../outside")
    # Swap a directory the server already knows for a symlink behind its back: the server
    # resolves paths with openat2(RESOLVE_NO_SYMLINKS) and refuses instead of following.
    (m / "src/checkout/sub").mkdir()
    (m / "src/checkout/sub/f.txt").write_text("in scope\n")
    os.rename(b / "src/checkout/sub", b / "src/checkout/sub-real")
    os.symlink(str(outside), b / "src/checkout/sub")
    with pytest.raises(OSError), open(m / "src/checkout/sub/f.txt", "a") as f:
        f.write("escape")
    with pytest.raises(OSError):
        (m / "src/checkout/sub/secret").write_text("escape")
    assert (outside / "secret").read_text() == "outside secret\n"
    assert not (outside / "f.txt").exists()


# ----- mutations outside paths.allowed: EROFS, nothing reaches the disk -----------------


def _out_of_scope_mutations(m: Path) -> list[tuple[str, Callable[[], object]]]:
    readme, docs = m / "README.md", m / "docs"
    return [
        ("open O_WRONLY", lambda: os.close(os.open(readme, os.O_WRONLY))),
        ("open O_TRUNC", lambda: os.close(os.open(readme, os.O_WRONLY | os.O_TRUNC))),
        ("open O_APPEND", lambda: os.close(os.open(readme, os.O_WRONLY | os.O_APPEND))),
        ("open O_RDWR", lambda: os.close(os.open(readme, os.O_RDWR))),
        ("creat", lambda: os.close(os.open(m / "new.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))),
        ("truncate", lambda: os.truncate(readme, 0)),
        ("unlink", lambda: os.unlink(readme)),
        ("rmdir", lambda: os.rmdir(m / "docs")),
        ("mkdir", lambda: os.mkdir(m / "newdir")),
        ("mkfifo", lambda: os.mkfifo(m / "fifo")),
        ("rename out of scope", lambda: os.rename(m / "src/checkout/tax.py", docs / "tax.py")),
        ("rename into scope", lambda: os.rename(docs / "guide.md", m / "src/checkout/guide.md")),
        ("rename within out-of-scope", lambda: os.rename(readme, m / "README.txt")),
        ("rename noreplace", lambda: renameat2(m / "src/checkout/tax.py", docs / "x", RENAME_NOREPLACE)),
        ("rename exchange", lambda: renameat2(m / "src/checkout/tax.py", readme, RENAME_EXCHANGE)),
        ("link into scope", lambda: os.link(readme, m / "src/checkout/readme-link")),
        ("link out of scope", lambda: os.link(m / "src/checkout/tax.py", docs / "tax-link")),
        ("symlink", lambda: os.symlink("README.md", m / "readme-link")),
        ("chmod", lambda: os.chmod(readme, 0o600)),
        ("chown", lambda: os.chown(readme, 1234, 1234)),
        ("utimes", lambda: os.utime(readme, (0, 0))),
        ("setxattr", lambda: os.setxattr(readme, "user.evil", b"1")),
        ("removexattr", lambda: os.removexattr(readme, "user.note")),
    ]


def test_every_mutation_outside_scope_is_refused(workspace: Guarded) -> None:
    m, b = workspace.mnt, workspace.backing
    before = snapshot(b)
    cases = _out_of_scope_mutations(m)
    for label, action in cases:
        with pytest.raises(OSError) as info:
            action()
        assert info.value.errno == errno.EROFS, f"{label}: {info.value!r}"
        assert snapshot(b) == before, f"{label} changed the backing directory"
    # Each refusal left an event naming the rule.
    denials = workspace.denials()
    assert len(denials) >= len(cases)
    assert all(d["errno"] == "EROFS" and d["reason"] for d in denials)
    # Reading out of scope is fine.
    assert (m / "README.md").read_text() == "readme\n"
    assert os.getxattr(m / "README.md", "user.note") == b"kept"


def test_shell_tools_meet_read_only_errors(workspace: Guarded) -> None:
    m = workspace.mnt
    before = snapshot(workspace.backing)
    for cmd in (f"echo x >> {m}/README.md", f"rm -rf {m}/docs", f"touch {m}/docs/new.md",
                f"sed -i s/readme/gone/ {m}/README.md", f"cp {m}/README.md {m}/docs/copy.md"):
        proc = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
        assert proc.returncode != 0, cmd
        assert "Read-only file system" in proc.stderr, (cmd, proc.stderr)
    assert snapshot(workspace.backing) == before


def test_in_scope_rename_exchange_and_noreplace(workspace: Guarded) -> None:
    code = workspace.mnt / "src/checkout"
    (code / "a.txt").write_text("A")
    (code / "b.txt").write_text("B")
    renameat2(code / "a.txt", code / "b.txt", RENAME_EXCHANGE)
    assert (workspace.backing / "src/checkout/a.txt").read_text() == "B"
    assert (code / "b.txt").read_text() == "A"
    refused(lambda: renameat2(code / "a.txt", code / "b.txt", RENAME_NOREPLACE), errno.EEXIST)
    renameat2(code / "a.txt", code / "c.txt", RENAME_NOREPLACE)
    assert (workspace.backing / "src/checkout/c.txt").read_text() == "B"


def test_read_only_profile_refuses_every_write(tmp_path: Path) -> None:
    manifest = (Path(__file__).parent.parent / "manifests/review-read-only.toml").read_text()
    (tmp_path / "backing").mkdir()
    _populate(tmp_path / "backing")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path / "backing", check=True)
    with guarded_mount(tmp_path, manifest) as g:
        before = snapshot(g.backing)
        refused(lambda: (g.mnt / "src/checkout/tax.py").write_text("x"), errno.EROFS)
        refused(lambda: (g.mnt / ".git/index.lock").write_text("x"), errno.EROFS)
        refused(lambda: os.mkdir(g.mnt / "src/checkout/new"), errno.EROFS)
        assert (g.mnt / "src/checkout/tax.py").read_text().startswith("def rate")
        assert snapshot(g.backing) == before


def test_chmod_through_the_mount_never_sets_set_user_id(workspace: Guarded) -> None:
    """A setuid program the agent leaves in the workspace would run as its owner (root, for a
    root agent) for the next local user: a chmod adding S_ISUID, or S_ISGID to a file, is
    refused (EPERM, nothing changed); S_ISGID on a directory is group inheritance and stays."""
    program = workspace.mnt / "src/checkout/tool"
    program.write_text("#!/bin/sh\n")
    os.chmod(program, 0o755)  # noqa: S103 - a program
    refused(lambda: os.chmod(program, 0o6755), errno.EPERM)  # noqa: S103 - what a hostile agent asks for
    assert oct(os.stat(workspace.backing / "src/checkout/tool").st_mode & 0o7777) == oct(0o755)
    shared = workspace.mnt / "src/checkout/shared"
    shared.mkdir()
    refused(lambda: os.chmod(shared, 0o6775), errno.EPERM)  # noqa: S103 - set-user-ID on a directory
    os.chmod(shared, 0o2775)  # noqa: S103 - a shared directory
    assert oct(os.stat(workspace.backing / "src/checkout/shared").st_mode & 0o7777) == oct(0o2775)
