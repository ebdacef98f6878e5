"""Hostile agents against set-ID bits (issue 21, item 3): no route through the mount leaves a
set-user-ID or set-group-ID file in the workspace. Each attack runs from inside a real
``guard run --ci``, as root and as ``--user nobody``, at umask 0 and 022, and the host's
workspace is checked afterwards. The native trees' sweep at the end is shown by
``tests/test_escapes_midrun.py::test_a_set_user_id_program_left_in_a_native_tree_is_not_left_on_the_host``
and ``test_a_set_id_file_written_as_a_tree_is_given_back_is_still_swept``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from .hostile import hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]
SET_ID = stat.S_ISUID | stat.S_ISGID

#: Every route the agent has to a set-ID node in scope; each reports the mode it then sees.
ROUTES = r'''
import shutil, stat, subprocess
os.umask(UMASK)
def mode(p):
    return oct(stat.S_IMODE(os.lstat(p).st_mode))
d = "src/checkout/"
attempt("mknod", lambda: (os.mknod(d + "m1", 0o106755), mode(d + "m1"))[1])
attempt("open", lambda: (os.close(os.open(d + "o1", os.O_CREAT | os.O_WRONLY, 0o4755)), mode(d + "o1"))[1])
attempt("open_sgid", lambda: (os.close(os.open(d + "o2", os.O_CREAT | os.O_WRONLY, 0o2755)), mode(d + "o2"))[1])
attempt("chmod_suid", lambda: os.chmod(d + "o1", 0o4755))
attempt("chmod_sgid", lambda: os.chmod(d + "o1", 0o2755))
attempt("fchmod", lambda: os.fchmod(os.open(d + "o1", os.O_RDONLY), 0o6755))
attempt("chmod_plain", lambda: (os.chmod(d + "o1", 0o750), mode(d + "o1"))[1])
attempt("mkdir", lambda: (os.mkdir(d + "shared", 0o2775), mode(d + "shared"))[1])
attempt("chmod_dir_sgid", lambda: (os.chmod(d + "shared", 0o2775), mode(d + "shared"))[1])
attempt("chmod_dir_suid", lambda: os.chmod(d + "shared", 0o4775))
attempt("inherited", lambda: (os.mkdir(d + "shared/sub"), mode(d + "shared/sub"))[1])
attempt("in_sgid_dir", lambda: (os.close(os.open(d + "shared/f", os.O_CREAT | os.O_WRONLY, 0o6755)),
                                mode(d + "shared/f"))[1])
# Made set-ID natively in the sandbox's /tmp, then brought in: rename cannot cross, copies can try.
open("/tmp/prog", "w").write("#!/bin/sh\nid\n")
os.chmod("/tmp/prog", 0o6755)
attempt("tmp_mode", lambda: mode("/tmp/prog"))
attempt("rename_in", lambda: os.rename("/tmp/prog", d + "renamed"))
attempt("cp_p", lambda: subprocess.run(["cp", "-p", "/tmp/prog", d + "copied"], capture_output=True).returncode)
attempt("cp_p_mode", lambda: mode(d + "copied"))
attempt("install", lambda: subprocess.run(["install", "-m", "4755", "/tmp/prog", d + "installed"],
                                          capture_output=True).returncode)
attempt("link", lambda: (os.link(d + "o2", d + "o2.link"), mode(d + "o2.link"))[1])
# Out of scope, generated: the run's scratch layer (never the host), by the same rules.
attempt("scratch_open", lambda: (os.mkdir("src/__pycache__"),
                                 os.close(os.open("src/__pycache__/x.pyc", os.O_CREAT | os.O_WRONLY, 0o4755)),
                                 mode("src/__pycache__/x.pyc"))[2])
attempt("scratch_chmod", lambda: os.chmod("src/__pycache__/x.pyc", 0o4755))
'''


def set_id_files(ws: Path) -> list[str]:
    """Every non-directory under *ws* carrying a set-ID bit, and every directory set-user-ID."""
    found = []
    for top, dirs, files in os.walk(ws):
        for name in dirs + files:
            st = os.lstat(os.path.join(top, name))
            bad = st.st_mode & (stat.S_ISUID if stat.S_ISDIR(st.st_mode) else SET_ID)
            if bad:
                found.append(f"{os.path.relpath(os.path.join(top, name), ws)} {oct(st.st_mode)}")
    return found


@pytest.mark.parametrize("umask", [0, 0o022])
@pytest.mark.parametrize("user", USERS)
def test_no_set_id_bit_reaches_the_workspace_by_any_route(tmp_path: Path, user: str | None, umask: int) -> None:
    """``os.mknod(p, 0o106755)`` as a root agent left ``-rwsr-sr-x root root`` on the host, and
    under umask 0 ``open(O_CREAT, 0o4755)`` a root-owned 4755 file: the guard has CAP_FSETID, so
    the backing kept what was asked. A chmod adding a set-ID bit was dropped silently. Now a new
    file never carries one, a chmod asking for one is refused (EPERM, an event), and set-group-ID
    stays on directories only (group inheritance)."""
    ws = hostile_workspace(tmp_path)
    seen, events, proc = hostile_run(tmp_path, ws, user, ROUTES.replace("UMASK", oct(umask)))
    exec_bits = oct(0o755 & ~umask)
    assert seen["tmp_mode"] == "0o6755", (seen, proc.stderr[-2000:])  # the kernel allowed it natively
    expected = {
        "mknod": exec_bits, "open": exec_bits, "open_sgid": exec_bits,
        "chmod_suid": "EPERM", "chmod_sgid": "EPERM", "fchmod": "EPERM", "chmod_plain": "0o750",
        "mkdir": oct(0o775 & ~umask), "chmod_dir_sgid": "0o2775", "chmod_dir_suid": "EPERM",
        "inherited": oct(0o2000 | (0o777 & ~umask)), "in_sgid_dir": exec_bits,
        "rename_in": "EXDEV", "cp_p": 1, "cp_p_mode": "0o700", "install": 1, "link": exec_bits,
        "scratch_open": exec_bits, "scratch_chmod": "EPERM",
    }
    assert {k: seen.get(k) for k in expected} == expected, (seen, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set_id_files(ws) == []
    assert (ws / "src/checkout/shared").stat().st_mode & 0o7777 == 0o2775  # what the agent was allowed
    refusals = [e for e in events if e.get("rule") == "set-id"]
    assert {e["path"] for e in refusals} >= {"src/checkout/o1", "src/checkout/shared", "src/checkout/copied"}, refusals
    assert all(e["decision"] == "deny" and e["errno"] == "EPERM" and "set-group-ID only on a directory" in e["reason"]
               for e in refusals), refusals
    assert not [e for e in events if e["op"] == "trip"], "a set-ID refusal is no trip"


#: A human's set-ID program in scope before the run: rewriting it must not keep the bits.
REWRITE = r'''
import stat
d = "src/checkout/"
attempt("keep", lambda: (os.chmod(d + "tool", 0o4755), oct(stat.S_IMODE(os.stat(d + "tool").st_mode)))[1])
attempt("rewrite", lambda: (open(d + "tool", "w").write("#!/bin/sh\necho mine\n"),
                            oct(stat.S_IMODE(os.stat(d + "tool").st_mode)))[1])
attempt("again", lambda: os.chmod(d + "tool", 0o4755))
'''


def test_rewriting_a_set_id_program_takes_its_bits_off(tmp_path: Path) -> None:
    """A root agent (CAP_FSETID) writing a human's set-user-ID root program in scope kept its
    bits: the agent's code would have run as root for the next local user. Opening it for writing
    takes them off, as the kernel does for a writer without CAP_FSETID; a chmod that only keeps
    what the file has (``chmod u+x``) still works before that. (As ``--user``, the agent has no
    CAP_FSETID: the kernel takes the bits off a file it writes, and the chown of the workspace
    to that user took them off already.)"""
    ws = hostile_workspace(tmp_path)
    tool = ws / "src/checkout/tool"
    tool.write_text("#!/bin/sh\nid\n")
    os.chmod(tool, 0o4755)  # noqa: S103 - the human's set-user-ID program
    seen, _, proc = hostile_run(tmp_path, ws, None, REWRITE)
    assert seen == {"keep": "0o4755", "rewrite": "0o755", "again": "EPERM"}, (seen, proc.stderr[-2000:])
    assert tool.read_text() == "#!/bin/sh\necho mine\n"
    assert set_id_files(ws) == []
