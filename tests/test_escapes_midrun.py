"""Hostile agents against generated trees bound natively during the run (sandbox.launch.inject).

Once a tree the agent made is bound, the sandbox reaches the same real directory two ways:
natively (the bind), and through the mount, by a descriptor of the directory opened before the
bind. What the mount moves into that directory is then read and written natively, unseen.
Each attack runs from inside a real ``guard run --ci``; the host is checked afterwards.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from .helpers import FIX_TAX
from .hostile import ATTEMPT, WAIT_MOUNTED, hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]


def _guard_run(tmp_path: Path, ws: Path, user: str | None, script: str, manifest: str,
               ) -> tuple[dict[str, Any], list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """The hostile *script* under ``guard run --ci``, able to wait for a tree's bind."""
    return hostile_run(tmp_path, ws, user, script, manifest, prelude=ATTEMPT + WAIT_MOUNTED)



# ----- a forbidden file carried into the tree -----------------------------------------------------

CARRY = r'''
os.mkdir("src/checkout/build")
held = os.open("src/checkout/build", os.O_RDONLY | os.O_DIRECTORY)  # through the mount, kept across the bind
# Before the bind: the binder judges the tree's contents, then binds it, a moment later.
attempt("carry before", lambda: os.rename("src/checkout/early", "src/checkout/build/early"))
attempt("bound", lambda: wait_mounted("src/checkout/build"))
# After it: natively the move crosses mounts (EXDEV); through the held descriptor it reaches the mount.
attempt("carry natively", lambda: os.rename("src/checkout/late", "src/checkout/build/late"))
attempt("carry after", lambda: os.rename("src/checkout/late", "late", dst_dir_fd=held))
attempt("read early", lambda: open("src/checkout/build/early/env_hl").read())
attempt("read late", lambda: open("src/checkout/build/late/env_hl").read())
'''


@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_directory_holding_a_hard_link_of_a_forbidden_file_is_not_carried_into_a_bound_tree(
        tmp_path: Path, user: str | None) -> None:
    """Hard links of ``.env`` made before the run, in two in-scope directories: the mount
    refuses each by inode, but a rename of its directory is judged by path. Moved into a
    generated tree made during the run, before its bind or through a descriptor held across
    it, the link would be read natively."""
    ws = hostile_workspace(tmp_path)
    for name in ("early", "late"):
        (ws / "src/checkout" / name).mkdir()
        os.link(ws / ".env", ws / "src/checkout" / name / "env_hl")
    seen, events, proc = _guard_run(tmp_path, ws, user, CARRY, FIX_TAX)
    assert seen.get("bound") is True, (seen, proc.stderr[-2000:])
    assert seen["carry natively"] == "EXDEV", seen
    assert seen["carry before"] == seen["carry after"] == "EXDEV", seen
    assert seen["read early"] == seen["read late"] == "ENOENT", seen
    assert "hunter2" not in (tmp_path / "run/stdout.log").read_text()
    assert sorted(os.listdir(ws / "src/checkout/build")) == []
    refused = [e for e in events if e["op"] == "rename" and e["decision"] == "deny"]
    assert [e["errno"] for e in refused] == ["EXDEV", "EXDEV"], refused
    assert "src/checkout/build" in refused[0]["reason"], refused


# ----- counted files written natively -------------------------------------------------------------

COUNTED = FIX_TAX.replace('allowed = ["src/checkout/"]', 'allowed = ["src/"]') + """\
generated = ["src/checkout/out/"]
[limits]
max_files = 1
"""

NATIVE_WRITES = r'''
root = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
os.mkdir("src/checkout/out")
held = os.open("src/checkout/out", os.O_RDONLY | os.O_DIRECTORY)
attempt("bound", lambda: wait_mounted("src/checkout/out"))
# A counted file linked into the tree, then rewritten natively through the new name.
attempt("link in", lambda: os.link("src/checkout/tax.py", "tax.py", dst_dir_fd=held))
attempt("rewrite", lambda: open("src/checkout/out/tax.py", "w").write("PWNED = 1\n"))
# A file made natively, linked out into counted territory.
open("src/checkout/out/made.py", "w").write("NATIVE = 1\n")
attempt("link out", lambda: os.link("made.py", "src/checkout/made.py", src_dir_fd=held))
# A directory of the tree moved out under a process standing in it natively.
os.mkdir("src/checkout/out/sub")
os.chdir("src/checkout/out/sub")
attempt("move out", lambda: os.rename("sub", "src/checkout/sub", src_dir_fd=held, dst_dir_fd=root))
attempt("write moved", lambda: open("a.py", "w").write("A = 1\n"))
os.chdir(root)
# The tree's parent renamed: the anchored pattern no longer names it; the bind goes along.
attempt("move parent", lambda: os.rename("src/checkout", "src/moved"))
attempt("write under moved", lambda: open("src/moved/out/b.py", "w").write("B = 1\n"))
'''


def test_counted_territory_is_never_written_natively_through_a_bound_tree(tmp_path: Path) -> None:
    """The mount, through a descriptor held across the bind, links a counted file into the tree
    or one of the tree's out of it, moves a directory of the tree out, or renames the tree's
    parent: each would let native writes (uncounted, unseen, not rolled back) land in counted
    territory, past max_files = 1."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = _guard_run(tmp_path, ws, None, NATIVE_WRITES, COUNTED)
    assert seen.get("bound") is True, (seen, proc.stderr[-2000:])
    assert seen["link in"] == seen["link out"] == seen["move out"] == "EXDEV", seen
    assert seen["move parent"] == "EBUSY", seen
    assert seen["rewrite"] == 10 and seen["write moved"] == 6, seen  # inside the tree: the agent's own
    assert seen["write under moved"] == "ENOENT", seen
    assert (ws / "src/checkout/tax.py").read_text() == "def total(x):\n    return x\n"
    assert sorted(p.name for p in (ws / "src/checkout").iterdir()) == ["out", "tax.py"]
    assert sorted(os.listdir(ws / "src/checkout/out")) == ["made.py", "sub", "tax.py"]
    assert (ws / "src/checkout/out/sub/a.py").read_text() == "A = 1\n"
    assert not (ws / "src/moved").exists()
    assert [e["errno"] for e in events if e["decision"] == "deny"] == ["EXDEV", "EXDEV", "EXDEV", "EBUSY"], events
    assert [e for e in events if e["op"] == "trip"] == []


# ----- resource exhaustion through the guard ------------------------------------------------------

MANY = r'''
n = 70
for i in range(n):
    os.makedirs(f"src/checkout/t{i}/build")
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    bound = sum("/src/checkout/t" in line.split()[4] for line in open("/proc/self/mountinfo"))
    if bound >= 64:
        break
    time.sleep(0.05)
attempt("bound", lambda: bound)
for i in range(n):  # removed and made again: each is a mkdir of a candidate's name
    os.rmdir(f"src/checkout/t{i}/build") if not mounted(f"src/checkout/t{i}/build") else None
    os.makedirs(f"src/checkout/t{i}/build", exist_ok=True)
'''


def test_the_agent_cannot_make_the_guard_judge_and_fork_without_end(tmp_path: Path) -> None:
    """Each generated directory made during the run may cost the guard a helper process and a
    line: seventy trees, then the unbound ones removed and made again. At most MAX_TREES (64)
    are ever judged; the rest is said once."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = _guard_run(tmp_path, ws, None, MANY, FIX_TAX)
    assert seen.get("bound") == 64, (seen, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if "generated tree" in line]
    assert len([line for line in lines if "written natively from now on" in line]) == 64, lines
    others = [line for line in lines if "written natively from now on" not in line]
    assert len(others) == 1 and "64 were judged for a native bind in this run" in others[0], lines
    assert len([e for e in events if e["op"] == "native"]) == 64


# ----- programs the host may run ------------------------------------------------------------------

SETID = r'''
import shutil
os.mkdir("src/checkout/build")
attempt("bound", lambda: wait_mounted("src/checkout/build"))
for tree in ("src/checkout/build", "src/checkout/.venv"):  # made during the run; there at the start
    shutil.copy("/usr/bin/id", f"{tree}/id")
    attempt(f"{tree} setuid", lambda: os.chmod(f"{tree}/id", 0o6755))
    os.mkdir(f"{tree}/shared")
    attempt(f"{tree} setgid dir", lambda: os.chmod(f"{tree}/shared", 0o2755))
'''


def test_a_set_user_id_program_left_in_a_native_tree_is_not_left_on_the_host(tmp_path: Path) -> None:
    """A root agent owns what it writes natively and may chmod it set-user-ID (no capability
    needed): a root program the next local user would run. The mount never lets that mode
    through; the native trees are swept when the agent has ended."""
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/.venv").mkdir()
    seen, events, proc = _guard_run(tmp_path, ws, None, SETID, FIX_TAX)
    assert seen.get("bound") is True and seen["src/checkout/.venv setuid"] is None, (seen, proc.stderr[-2000:])
    for tree in ("src/checkout/build", "src/checkout/.venv"):
        assert oct((ws / tree / "id").stat().st_mode & 0o7777) == oct(0o755), tree
        assert (ws / tree / "shared").stat().st_mode & 0o7777 == 0o2755  # group inheritance, as the mount allows
    assert "set-user-ID" in proc.stderr and "src/checkout/build/id" in proc.stderr, proc.stderr[-2000:]
    assert sorted(e["path"] for e in events if e["op"] == "chmod") == ["src/checkout/.venv/id",
                                                                        "src/checkout/build/id"]


# ----- the namespace the bind lands in ------------------------------------------------------------

NESTED = r'''
import subprocess
# A user and mount namespace of the agent's own (no capability needed), where it makes the tree;
# it looks at its own mounts once the sandbox's has the bind.
inner = subprocess.Popen(["unshare", "-U", "-m", "--propagation", "unchanged", "sh", "-c",
                          'readlink /proc/self/ns/mnt; mkdir src/checkout/build; read go; '
                          'grep -c " $PWD/src/checkout/build " /proc/self/mountinfo'],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
attempt("bound outside", lambda: wait_mounted("src/checkout/build"))
attempt("inner", lambda: inner.communicate("go\n")[0].split())
attempt("outer ns", lambda: os.readlink("/proc/self/ns/mnt"))
'''


def test_a_tree_made_from_a_namespace_of_the_agents_own_is_bound_in_the_sandboxs(tmp_path: Path) -> None:
    """The helper enters the first namespace of the agent's process tree that is not the
    guard's, breadth-first: the sandbox's, whatever namespaces the agent makes below it."""
    ws = hostile_workspace(tmp_path)
    seen, _, proc = _guard_run(tmp_path, ws, None, NESTED, FIX_TAX)
    inner_ns, inner_mounts = seen["inner"]
    assert inner_ns != seen["outer ns"] and inner_mounts == "0", (seen, proc.stderr[-2000:])
    assert seen["bound outside"] is True, seen


# ----- directory removals handed to the guard -----------------------------------------------------

REMOVALS = r'''
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
def rmdir_at(address):
    if libc.rmdir(ctypes.c_void_p(address)) != 0:
        raise OSError(ctypes.get_errno(), "rmdir")
    return 0
os.mkdir("src/checkout/build")
attempt("bound", lambda: wait_mounted("src/checkout/build"))
# The removal's path lives in a page of a file of the guard's own mount, not read yet: reading
# it, the guard faults into the mount it serves itself.
with open("src/checkout/tax.py", "wb") as f:
    f.write(b"src/checkout/build\0")
held = open("src/checkout/tax.py", "r+b")
page = mmap.mmap(held.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
attempt("removed by a mapped path", lambda: rmdir_at(ctypes.addressof(ctypes.c_char.from_buffer(page))))
attempt("gone", lambda: not os.path.exists("src/checkout/build"))
# A path the guard cannot read at all: the removal goes on, and the kernel answers as it would.
attempt("unreadable path", lambda: rmdir_at(8))
# Nothing of the filter is the agent's: neither its listener nor the socket that brought it.
attempt("descriptors", lambda: [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")])
'''


@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_removal_whose_path_the_guard_must_read_through_its_own_mount(tmp_path: Path, user: str | None) -> None:
    """Every directory removal waits for the guard, which reads its path from the agent's
    memory (sandbox.launch.seccomp). A path in a page of a file of the mount would deadlock a
    guard reading it on the loop that serves the mount; one it cannot read must not stop the
    removal. The emptied tree is given back to the mount and removed."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = _guard_run(tmp_path, ws, user, REMOVALS, FIX_TAX)
    assert seen.get("bound") is True, (seen, proc.stderr[-2000:])
    assert seen["removed by a mapped path"] == 0, seen
    assert seen["gone"] is True
    assert seen["unreadable path"] == "EFAULT"
    assert not [fd for fd in seen["descriptors"] if fd.startswith("socket:") or "seccomp" in fd], seen
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (ws / "src/checkout/build").exists()
    assert [e["path"] for e in events if e["op"] == "native" and e.get("unbound")] == ["src/checkout/build"]
    assert [e for e in events if e["decision"] == "deny"] == []


DECOY = r'''
os.mkdir("src/checkout/build")
attempt("bound", lambda: wait_mounted("src/checkout/build"))
held = os.open("src/checkout/build", os.O_RDONLY | os.O_DIRECTORY)  # native: the bind's root
# A removal that names the empty tree by its last component, elsewhere: the guard cannot tell
# and gives the tree back to the mount, which the held descriptor still reaches natively.
attempt("decoy", lambda: os.rmdir("build", dir_fd=os.open("/tmp", os.O_RDONLY)))
attempt("unbound", lambda: not mounted("src/checkout/build"))
attempt("carry", lambda: os.rename("src/checkout/late", "src/checkout/build/late"))
attempt("read", lambda: os.read(os.open("late/env_hl", os.O_RDONLY, dir_fd=held), 100).decode())
os.close(held)
attempt("removed", lambda: os.rmdir("src/checkout/build"))  # now by the mount: the pin goes with it
attempt("made again", lambda: os.mkdir("src/checkout/build"))
attempt("bound again", lambda: wait_mounted("src/checkout/build"))
'''


@pytest.mark.parametrize("user", [None, "nobody"])
def test_a_tree_given_back_to_the_mount_by_a_decoy_removal_stays_pinned(tmp_path: Path, user: str | None) -> None:
    """Found by the hostile pass over removals: a tree unbound because a removal's path may
    name it is still reached natively by a descriptor opened through the bind. Unpinned, the
    mount let a directory holding a pre-run hard link of .env be moved in, read natively.
    It stays pinned (EXDEV) until the mount removes it."""
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/late").mkdir()
    os.link(ws / ".env", ws / "src/checkout/late/env_hl")
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
    seen, events, proc = _guard_run(tmp_path, ws, user, DECOY, FIX_TAX)
    assert seen.get("bound") is True, (seen, proc.stderr[-2000:])
    assert (seen["decoy"], seen["unbound"]) == ("ENOENT", True), seen
    assert seen["carry"] == "EXDEV", seen
    assert seen["read"] == "ENOENT", seen
    assert (seen["removed"], seen["made again"], seen["bound again"]) == (None, None, True), seen
    assert (ws / "src/checkout/late/env_hl").exists()  # nothing moved
    assert [e["errno"] for e in events if e["decision"] == "deny"] == ["EXDEV"], events


SETID_RACE = r'''
import threading
won = None
for round_ in range(40):
    if not os.path.isdir("src/checkout/build"):
        os.mkdir("src/checkout/build")
    if not wait_mounted("src/checkout/build"):
        break
    def writer(delay=0.002 * round_):  # natively, while the guard unbinds the tree it found empty
        time.sleep(delay)
        try:
            fd = os.open("src/checkout/build/suid", os.O_WRONLY | os.O_CREAT, 0o755)
            os.write(fd, b"#!/bin/sh\nid\n")
            os.fchmod(fd, 0o6755)
            os.close(fd)
        except OSError:
            pass
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        os.rmdir("src/checkout/build")
    except OSError:
        pass
    thread.join()
    there = os.path.exists("src/checkout/build/suid")
    if there and not mounted("src/checkout/build"):
        won = round_  # written natively, then the tree given back to the mount
        break
    if there:
        os.unlink("src/checkout/build/suid")
attempt("won", lambda: won)
'''


def test_a_set_id_file_written_as_a_tree_is_given_back_is_still_swept(tmp_path: Path) -> None:
    """Found by the hostile pass: a file written natively between the guard's emptiness check
    and its unbind stays in a tree no longer bound; the set-ID sweep at the end looked only at
    bound trees, and a root program was left on the host. Released trees are swept too."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = _guard_run(tmp_path, ws, None, SETID_RACE, FIX_TAX)
    assert "won" in seen, (seen, proc.stderr[-2000:])
    left = ws / "src/checkout/build/suid"
    if seen["won"] is not None:  # the race was won this time (the hostile pass won it on the 2nd round)
        assert left.exists()
        assert {e["path"] for e in events if e["op"] == "chmod"} >= {"src/checkout/build/suid"}
    for path in ws.rglob("*"):
        assert not path.lstat().st_mode & 0o6000 or path.is_dir(), path
