"""Hostile agents against what landed with issues 13 and 14: the scratch layer, native
generated trees, trip on intent, git's own restores. Each attack runs from inside a real
``guard run --ci`` (as root and as ``--user nobody``) and the host is checked afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import FIX_TAX, FORBIDDEN_TERMINAL
from .hostile import SECRET, hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]


# ----- native generated trees ---------------------------------------------------------------------


@pytest.mark.parametrize("user", USERS)
def test_a_hard_link_of_a_forbidden_file_inside_a_native_tree_is_masked(tmp_path: Path, user: str | None) -> None:
    """A hard link of ``.env`` made on the host before the run, inside an in-scope ``.venv/``
    that is bound natively: the mount refuses it by inode, the bind must not show it."""
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/.venv").mkdir()
    os.link(ws / ".env", ws / "src/checkout/.venv/env_hl")
    seen, _, proc = hostile_run(tmp_path, ws, user, '''
        attempt("native", lambda: any(l.split()[4].endswith("/src/checkout/.venv")
                                      for l in open("/proc/self/mountinfo")))
        attempt("read", lambda: open("src/checkout/.venv/env_hl").read())
    ''')
    assert seen.get("native") is True, (seen, proc.stderr[-2000:])
    assert seen["read"] == "EACCES", seen
    assert "hunter2" not in (tmp_path / "run/stdout.log").read_text()


# ----- trip on intent -----------------------------------------------------------------------------

# An i386 system call (int 0x80) from the 64-bit agent: its number means another call in the
# x86_64 table that /proc/<tid>/syscall is read with (i386 301, unlinkat, is x86_64's
# fanotify_mark, a metadata call).
I386 = r'''
import ctypes, mmap, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
def i386(nr, dirfd, name):
    mem = libc.mmap(None, 4096, 7, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40, -1, 0)  # MAP_32BIT
    ctypes.memmove(mem + 2048, name + b"\0", len(name) + 1)
    code = (b"\x53\xb8" + struct.pack("<i", nr) + b"\xbb" + struct.pack("<i", dirfd) + b"\xb9"
            + struct.pack("<I", mem + 2048) + b"\x31\xd2\xcd\x80\x5b\xc3")  # push rbx ... int 0x80; pop rbx; ret
    ctypes.memmove(mem, code, len(code))
    got = ctypes.CFUNCTYPE(ctypes.c_long)(mem)()
    if got < 0:
        raise OSError(-got, "i386 call")
    return got
for i in range(3):
    attempt(f"unlinkat{i}", lambda: i386(301, -100, b".env"))
attempt("stat", lambda: os.stat(".env"))
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 ABI of x86_64")
@pytest.mark.parametrize("user", USERS)
def test_an_i386_unlink_of_a_forbidden_file_is_refused_before_the_mount(tmp_path: Path, user: str | None) -> None:
    ws = hostile_workspace(tmp_path)
    """The guard's seccomp filter answers every system call of another ABI with ENOSYS (issue 21:
    a 32-bit socketcall would pass a filter written for the 64-bit numbers), so the i386 unlink
    never reaches the mount, three times over (before, read as x86_64's fanotify_mark, it reached
    it unjudged as a removal: see the mount's intent for the 64-bit calls)."""
    seen, events, proc = hostile_run(tmp_path, ws, user, I386, FIX_TAX + FORBIDDEN_TERMINAL)
    assert [seen.get(f"unlinkat{i}") for i in range(3)] == ["ENOSYS"] * 3, (seen, proc.stderr[-2000:])
    assert not [e for e in events if e["path"] == ".env" and e["op"] != "lookup"], events
    assert proc.returncode == 0 and "stat" in seen, (seen, proc.stderr[-2000:])
    assert (ws / ".env").read_text() == SECRET


# ----- Codex's CODEX_HOME copy --------------------------------------------------------------------


def test_codex_home_copy_reads_nothing_of_root_s_for_another_user(tmp_path: Path) -> None:
    """With --user, the guard (root) copies the agent user's auth.json and config.toml into
    the run's CODEX_HOME: a symlink there to /etc/shadow must not hand root's file to the agent."""
    ws = tmp_path / "ws"
    ws.mkdir()
    home = tmp_path / "codexhome"
    home.mkdir()
    (home / "auth.json").symlink_to("/etc/shadow")
    (home / "config.toml").write_text('model = "m"\n')
    agent = ws / "agent.sh"  # Codex's arguments go after the first word: a script that ignores them
    agent.write_text('#!/bin/sh\necho "AUTH=$(head -c 5 "$CODEX_HOME/auth.json" 2>&1)"\n'
                     'echo "CONFIG=$(cat "$CODEX_HOME/config.toml")"\n')
    agent.chmod(0o755)
    tmp_path.chmod(0o755)
    subprocess.run(["chown", "-hR", "65534:65534", str(ws), str(home)], check=True)
    (tmp_path / "manifest.toml").write_text(FIX_TAX + '[sandbox]\nenv = ["CODEX_HOME"]\n')
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--user", "nobody", "--agent", "codex", "--manifest",
         str(tmp_path / "manifest.toml"), "--run-dir", str(tmp_path / "run"), "--", str(agent)],
        cwd=ws, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        env={**os.environ, "CODEX_HOME": str(home)},
    )
    out = (tmp_path / "run/stdout.log").read_text()
    assert proc.returncode == 0 and 'CONFIG=model = "m"' in out, (out, proc.stderr[-2000:])
    assert "AUTH=root:" not in out and "root:" not in out, out
    assert "auth.json: not copied" in proc.stderr and "owned by uid 0" in proc.stderr, proc.stderr[-2000:]


# ----- bytecode in scope --------------------------------------------------------------------------

PLANT = r'''
import py_compile, sys
open("/tmp/evil.py", "w").write("print('PWNED')\ndef total(x):\n    return x\n")
unchecked = py_compile.PycInvalidationMode.UNCHECKED_HASH  # never compared with the source
for cfile in (f"src/checkout/__pycache__/tax.{sys.implementation.cache_tag}.pyc", "src/checkout/cart.pyc"):
    attempt(cfile, lambda: py_compile.compile("/tmp/evil.py", cfile=cfile, invalidation_mode=unchecked, doraise=True))
'''


@pytest.mark.parametrize("user", USERS)
def test_bytecode_planted_in_scope_never_reaches_the_host(tmp_path: Path, user: str | None) -> None:
    """An unchecked-hash .pyc for an in-scope module (in its existing __pycache__, which the
    default list would bind natively) and a sourceless one: the host's Python would run them
    in place of the source, uncounted, unseen by git diff, kept by rollback."""
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/__pycache__").mkdir()
    seen, events, proc = hostile_run(tmp_path, ws, user, PLANT)
    assert proc.returncode == 0 and len(seen) == 2, (seen, proc.stderr[-2000:])
    assert [e for e in events if e["op"] == "trip"] == []
    assert sorted(p.name for p in (ws / "src/checkout").rglob("*")) == ["__pycache__", "tax.py"]
    host = subprocess.run([sys.executable, "-c", "import tax, cart"], cwd=ws / "src/checkout",
                          capture_output=True, text=True, check=False)
    assert "PWNED" not in host.stdout and "No module named 'cart'" in host.stderr, host


# ----- git's own restores -------------------------------------------------------------------------

FLIP = r'''
import subprocess
def git(*args):
    return subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", *args], capture_output=True,
                          text=True).returncode
f = "src/checkout/tax.py"
ids = []
for digits in (2, 3):
    open(f, "w").write(f"def total(x):\n    return round(x, {digits})\n")
    git("commit", "-qm", str(digits), "--", f)
    ids.append(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
for i in range(6):  # the real git binary writes each version back, in turn
    attempt(f"flip{i}", lambda: (git("checkout", ids[0], "--", f), git("checkout", ids[1], "--", f)))
'''


@pytest.mark.parametrize("user", USERS)
def test_git_cannot_flip_a_file_between_versions_freely(tmp_path: Path, user: str | None) -> None:
    """Git's writes back to a version it holds are no oscillation of the agent's, once per
    version: checking out one commit, then another, in a loop, is."""
    ws = hostile_workspace(tmp_path)
    who = ["-c", "user.email=a@b", "-c", "user.name=a"]
    for args in (["init", "-q"], ["add", "src"], [*who, "commit", "-qm", "start"]):
        subprocess.run(["git", *args], cwd=ws, check=True)
    seen, events, proc = hostile_run(tmp_path, ws, user, FLIP, FIX_TAX + '[limits]\nmax_files = "unlimited"\n')
    assert seen.get("flip0") == [0, 0], (seen, proc.stderr[-2000:])
    assert "oscillation" in [e["rule"] for e in events if e["op"] == "trip"], seen
