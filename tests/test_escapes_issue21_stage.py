"""Hostile agents against what the guard carries out of the sandbox (issue 21, item 2): guard
exec's stage (``/tmp/guard/exec`` inside, copied into ``RUN_DIR/exec`` after the run), the
scratch layer and the native trees swept after the run, and ``guard report`` over what landed.
Each attack runs from inside a real ``guard run --ci``, as root and as ``--user nobody``, and
the host (the run directory, the workspace, the guard's exit and summary) is checked afterwards.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardfs.harvest import remove_tree

from .helpers import FIX_TAX, dir_chain
from .hostile import SECRET, hostile_run, hostile_workspace

pytestmark = [pytest.mark.root, pytest.mark.mount]

USERS = [None, "nobody"]

#: The cap of each log in these runs: what the exec stage may land per file.
CAP = 1 << 20
CAPPED = FIX_TAX + f"[sandbox]\nlog_max_bytes = {CAP}\n"

#: What the agent leaves in guard exec's stage: links to a workspace secret and to /etc/shadow,
#: a 2 GiB sparse file, a FIFO, a socket, a directory, hard links of host files (refused by the
#: kernel: the stage is a mount of its own), and one real guard exec log beside them.
STAGE = r'''
import socket, subprocess
ex = os.environ["GUARD_RUN_DIR"] + "/exec"
ws = os.getcwd()
attempt("env link", lambda: os.symlink(ws + "/.env", ex + "/env.out.log"))
attempt("shadow link", lambda: os.symlink("/etc/shadow", ex + "/shadow.out.log"))
attempt("dir link", lambda: os.symlink("/etc", ex + "/etc.log"))
def sparse():
    with open(ex + "/big.out.log", "wb") as f:
        f.write(b"head\n")
        f.truncate(2 << 30)
        f.seek((2 << 30) - 5)
        f.write(b"tail\n")
attempt("sparse", sparse)
attempt("fifo", lambda: os.mkfifo(ex + "/p.out.log"))
def listen():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(ex + "/s.out.log")
attempt("socket", listen)
def directory():
    os.mkdir(ex + "/d.log")
    open(ex + "/d.log/inner.log", "w").write("inner\n")
attempt("directory", directory)
attempt("link etc", lambda: os.link("/etc/passwd", ex + "/passwd.out.log"))
attempt("link ws", lambda: os.link(ws + "/src/checkout/tax.py", ex + "/tax.out.log"))
attempt("plain", lambda: open(ex + "/plain.out.log", "w").write("plain line\n"))
if os.getuid() == 0:  # nobody does not reach this checkout's guard; its log is a plain file like the one above
    attempt("exec", lambda: subprocess.run(["guard", "exec", "--", "echo", "kept line"],
                                           capture_output=True).returncode)
sys.exit(3)
'''


def _chain(top: Path, depth: int) -> None:
    """*depth* directories in a chain below *top*, made by relative steps."""
    os.close(dir_chain(top, depth, "a"))


def _everything(root: Path) -> list[tuple[Path, os.stat_result]]:
    """Every entry below *root*, by lstat (nothing followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            out.append((path, path.lstat()))
    return out


def _shadow() -> bytes:
    """A line of /etc/shadow that is no empty one: what a copy of the file would hold."""
    lines = [ln for ln in Path("/etc/shadow").read_bytes().splitlines() if ln.strip()]
    return max(lines, key=len) if lines else b"\0no shadow\0"


@pytest.mark.parametrize("user", USERS)
def test_what_the_agent_leaves_in_the_exec_stage_is_hostile_input(tmp_path: Path, user: str | None) -> None:
    """``shutil.move`` as root carried the stage to the host as it was: a link to ``.env`` or
    ``/etc/shadow`` became one in the run directory (readable there, uploaded as a CI artifact),
    a 2 GiB sparse file was written out whole, and a FIFO crashed the guard (exit 70, no
    summary, no ledger entry, the stage left). Now only regular files are copied, by their
    data and cut at the cap; the rest is named in the summary, and the guard exits with the
    agent's status."""
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, STAGE, CAPPED)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert seen["link etc"] == seen["link ws"] == "EXDEV", seen  # the stage is a mount of its own
    assert all(seen[k] is None for k in ("env link", "shadow link", "sparse", "fifo", "socket", "directory")), seen
    assert seen["plain"] == 11 and seen.get("exec", 0) == 0, seen
    run = tmp_path / "run"
    entries = _everything(run)
    # Nothing but regular files and the guard's own directories; no secret in any of them.
    odd = [str(p) for p, st in entries if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))]
    assert odd == [], odd
    shadow = _shadow()
    for path, st in entries:
        if stat.S_ISREG(st.st_mode):
            data = path.read_bytes()
            assert SECRET.strip().encode() not in data and shadow not in data, path
    exec_dir = run / "exec"
    kept = {p.name: p.lstat() for p in exec_dir.iterdir()}
    assert not {"env.out.log", "shadow.out.log", "etc.log", "p.out.log", "s.out.log", "d.log"} & set(kept), kept
    assert not (run / "exec.left").exists()
    # The sparse file: cut at the cap, by its data (no hole written out).
    big = kept["big.out.log"]
    assert big.st_size <= CAP + 4096 and big.st_blocks * 512 <= 64 << 10, big
    assert (exec_dir / "big.out.log").read_bytes().startswith(b"head\n")
    assert sum(st.st_blocks * 512 for st in kept.values()) <= 2 * CAP, kept
    # guard exec's own log, and a plain file, kept.
    assert (exec_dir / "plain.out.log").read_bytes() == b"plain line\n"
    if user is None:
        assert any((exec_dir / name).read_bytes() == b"kept line\n" for name in kept), kept
    # The summary names what was left out and cut.
    summary = proc.stderr[proc.stderr.rindex("run summary"):]
    for said in ("env.out.log: a symbolic link (not followed)", "shadow.out.log: a symbolic link",
                 "p.out.log: a FIFO", "s.out.log: a socket", "d.log: a directory",
                 f"big.out.log: {2 << 30} bytes, cut to its first {CAP + 4096}"):
        assert said in summary, (said, summary)
    assert "exit status: 3" in summary and "GUARD FAILED" not in proc.stderr, summary
    assert "guard_failure" not in json.loads((run / "ledger.json").read_text())
    # guard report over it: works, lists the logs it kept, no link, no target's size.
    report = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", str(run), "--html", "-"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    logs = report.stdout[report.stdout.index("<h2 id=logs>"):]  # (the header shows the agent's command)
    assert "big.out.log" in logs and "env.out.log" not in logs, logs[-2000:]
    assert "shadow" not in logs and f"{2 << 30:,}" not in report.stdout
    assert f"{os.lstat('/etc/shadow').st_size:,} bytes" not in report.stdout


def test_guard_report_follows_no_link_a_run_directory_holds(tmp_path: Path) -> None:
    """A run directory an older guard filled with the agent's links (or copied from elsewhere):
    ``guard report`` listed ``exec/env.out.log`` with the size of what it pointed at. Now it
    judges each entry by lstat: a link, a FIFO, a directory named ``*.log`` are not listed, and
    a log named with any bytes is listed escaped."""
    run = tmp_path / "run"
    (run / "exec").mkdir(parents=True)
    (run / "ledger.json").write_text('{"state": "CLOSED", "task": {"id": "t", "goal": "g"}}')
    (run / "stdout.log").write_text("out\n")
    os.symlink("/etc/shadow", run / "exec/shadow.out.log")
    os.symlink("/etc/shadow", run / "stderr.log")
    os.mkfifo(run / "exec/p.out.log")
    (run / "exec/d.log").mkdir()
    (run / "exec" / os.fsdecode(b"odd\xff\n.out.log")).write_text("x\n")
    report = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", str(run), "--html", "-"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    page = report.stdout
    assert "stdout.log" in page and "odd\\xff\\n.out.log" in page and "odd%FF%0A.out.log" in page, page[-2000:]
    assert "shadow" not in page and "stderr.log" not in page and "p.out.log" not in page and "d.log" not in page
    (run / "exec").rename(run / "exec.real")
    os.symlink(run / "exec.real", run / "exec")  # the directory itself a link: not listed either
    report = subprocess.run([sys.executable, "-m", "sandbox", "report", "--run-dir", str(run), "--html", "-"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and "odd" not in report.stdout, report.stderr


#: A tree deeper than Python's stack in the scratch layer (generated output out of scope, made
#: through the mount), made unlistable at its top: shutil.rmtree raised RecursionError when the
#: guard closed the layer, after the agent had ended.
DEEP_SCRATCH = r'''
os.mkdir(".pytest_cache")
os.chdir(".pytest_cache")
for _ in range(1300):
    os.mkdir("a")
    os.chdir("a")
open("f", "w").write("deep\n")
os.symlink("/etc/shadow", "shadow")
os.chdir(os.environ["GUARD_WORKSPACE"])
attempt("deep", lambda: os.path.exists(".pytest_cache/" + "a/" * 1300 + "f"))
attempt("chmod", lambda: os.chmod(".pytest_cache/a", 0))
sys.exit(3)
'''


@pytest.fixture
def deep(tmp_path: Path) -> Iterator[Path]:
    """*tmp_path*, removed with guardfs.harvest afterwards: pytest's own removal recurses, and the
    trees these tests leave are deeper than Python's stack."""
    yield tmp_path
    assert remove_tree(tmp_path) == []


@pytest.mark.parametrize("user", USERS)
def test_a_deep_tree_in_the_scratch_layer_leaves_nothing_and_fails_nothing(deep: Path, user: str | None) -> None:
    """Before: the guard crashed after the agent had ended, with a traceback and exit 70."""
    tmp_path = deep
    ws = hostile_workspace(tmp_path)
    seen, _, proc = hostile_run(tmp_path, ws, user, DEEP_SCRATCH)
    assert seen == {"deep": True, "chmod": None}, (seen, proc.stderr[-3000:])
    assert proc.returncode == 3 and "GUARD FAILED" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "run/scratch").exists()
    assert not (ws / ".pytest_cache").exists()


#: A tree deeper than Python's stack, and longer than PATH_MAX, in a native generated tree, a
#: set-user-ID program at its bottom: os.walk raised RecursionError after the run (a traceback,
#: exit 70, the stage left) and at the next run's start (its masks), and a walk by path could
#: not reach past PATH_MAX at all.
DEEP_NATIVE = r'''
import shutil
os.chdir("src/checkout/.venv")
for _ in range(2200):
    os.mkdir("a")
    os.chdir("a")
shutil.copy("/usr/bin/id", "id")
attempt("setuid", lambda: os.chmod("id", 0o6755))
sys.exit(3)
'''


@pytest.mark.parametrize("user", USERS)
def test_a_set_user_id_program_deep_in_a_native_tree_is_swept(deep: Path, user: str | None) -> None:
    """Before: RecursionError in the sweep after the run (a traceback, exit 70, the stage left);
    and a sweep by path could not have reached the program past PATH_MAX."""
    tmp_path = deep
    ws = hostile_workspace(tmp_path)
    (ws / "src/checkout/.venv").mkdir()
    seen, events, proc = hostile_run(tmp_path, ws, user, DEEP_NATIVE)
    assert seen == {"setuid": None}, (seen, proc.stderr[-3000:])
    assert proc.returncode == 3 and "GUARD FAILED" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    # The program, found by descending from a held fd (its path is longer than PATH_MAX).
    fd = os.open(ws / "src/checkout/.venv", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(2200):
            down = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = down
        mode = os.stat("id", dir_fd=fd, follow_symlinks=False).st_mode
    finally:
        os.close(fd)
    assert mode & 0o7777 == 0o755, oct(mode)
    assert [e for e in events if e["op"] == "chmod" and e["path"].endswith("/id")], events[-5:]
    assert "set-user-ID/set-group-ID removed" in proc.stderr
    # Such a tree stays (generated output of the task): the next run's start walks it for masks.
    # (Past PATH_MAX, guardfs.links's walk at start still fails: said in the lead's report.)
    assert remove_tree(ws / "src/checkout/.venv/a") == []
    _chain(ws / "src/checkout/.venv", 1300)
    flags = ["--user", user] if user is not None else []
    again = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", *flags, "--manifest",
                            str(tmp_path / "manifest.toml"), "--run-dir", str(tmp_path / "run2"), "--", "true"],
                           cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]


#: The agent's last words, which a failed run's digest prints to the CI log: workflow commands
#: (``::stop-commands::`` silences every annotation after it, the guard's own included) and a
#: terminal escape sequence.
COMMANDS = r'''
print("::stop-commands::tok", flush=True)
print("  ::error file=README.md,line=1::forged error", flush=True)
print("##[error]forged too", flush=True)
print("\x1b]0;owned\x07 error in the title", flush=True)
sys.exit(1)
'''


@pytest.mark.parametrize("user", USERS)
def test_the_agents_output_in_the_ci_digest_is_no_workflow_command(tmp_path: Path, user: str | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest of a failed run printed the agent's last lines as they were, and under GitHub
    Actions a line starting with ``::`` is a command to the runner."""
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "summary.md"))
    ws = hostile_workspace(tmp_path)
    _, _, proc = hostile_run(tmp_path, ws, user, COMMANDS)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "forged error" in proc.stdout and "owned" in proc.stdout, proc.stdout  # shown, as text
    for line in proc.stdout.splitlines():
        assert not line.lstrip().startswith(("::stop-commands", "::error file=README.md", "##[")), line
    assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout, proc.stdout


#: The guard with a defect injected where it copies guard exec's stage: what a defect that still
#: escapes there does (no agent-made shape produces one any more, so it is injected).
FAULTY_HARVEST = """
import sys
import sandbox.launch.run as run
def harvest(*args, **kwargs):
    raise RuntimeError("injected fault")
run.harvest = harvest
from sandbox.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("user", USERS)
def test_a_defect_after_the_agent_is_a_recorded_failure(tmp_path: Path, user: str | None) -> None:
    """Before, an exception there was a traceback and exit 70 alone: no summary, no guard_failure
    in the ledger or STATE.md. Now it is the guard's recorded failure, saying that it came after
    the agent had ended, and with which status."""
    ws = hostile_workspace(tmp_path)
    _, _, proc = hostile_run(tmp_path, ws, user, 'open(os.environ["GUARD_RUN_DIR"] + "/exec/a.log", "w")\nsys.exit(3)',
                             guard=("-c", FAULTY_HARVEST))
    run = tmp_path / "run"
    assert proc.returncode == 70, proc.stderr[-3000:]
    assert "RuntimeError: injected fault" in (run / "guard-error.log").read_text()
    assert "GUARD FAILED: internal error (RuntimeError); after the agent had ended with status 3" in proc.stderr
    assert "run summary" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "after the agent had ended with status 3" in proc.stdout  # the --ci digest
    failure = json.loads((run / "ledger.json").read_text())["guard_failure"]
    assert failure["error"] == "RuntimeError" and failure["after_agent"] == "3", failure
    state = (run / "STATE.md").read_text()
    assert "after the agent had ended (status 3)" in state and "stopped the agent" not in state, state[:400]


#: What an agent leaves in the state directory of its own the guard gives it (Codex's CODEX_HOME,
#: a copy of the user's login): a tree deeper than Python's stack, a link to /etc/shadow, a
#: directory of mode 000. shutil.rmtree raised RecursionError when the run removed it.
STATE_DIR = r'''
import os
home = os.environ["CODEX_HOME"]
os.chdir(home)
for _ in range(1300):
    os.mkdir("a")
    os.chdir("a")
os.symlink("/etc/shadow", "shadow")
os.chdir(home)
os.chmod("a", 0)
print("left", flush=True)
raise SystemExit(3)
'''


@pytest.mark.parametrize("user", USERS)
def test_what_the_agent_leaves_in_its_state_directory_fails_nothing(deep: Path, user: str | None) -> None:
    tmp_path = deep
    ws = hostile_workspace(tmp_path)
    (ws / "hostile.py").write_text(STATE_DIR)
    agent = ws / "agent.sh"  # codex's flags come after the command's name: a script that ignores them
    agent.write_text(f"#!/bin/sh\nexec /usr/bin/python3 {ws / 'hostile.py'}\n")
    agent.chmod(0o755)
    (tmp_path / "manifest.toml").write_text(FIX_TAX)
    flags = []
    if user is not None:
        subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)
        flags = ["--user", user]
    proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--agent", "codex", *flags, "--manifest",
                           str(tmp_path / "manifest.toml"), "--run-dir", str(tmp_path / "run"), "--", str(agent)],
                          cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert "left" in (tmp_path / "run/stdout.log").read_text(), proc.stderr[-3000:]
    assert proc.returncode == 3 and "Traceback" not in proc.stderr and "GUARD FAILED" not in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "run/agent-state").exists()


def test_logs_written_straight_into_the_run_directory_are_judged_the_same(tmp_path: Path) -> None:
    """Without a stage of the guard's (an unprivileged guard's, or --no-isolation), the agent's
    side writes RUN_DIR/exec itself: it is moved aside and copied back by the same rules."""
    ws = hostile_workspace(tmp_path)
    (tmp_path / "manifest.toml").write_text(CAPPED)
    script = ('ex=$GUARD_RUN_DIR/exec; mkdir -p $ex; ln -s "$PWD/.env" $ex/env.out.log; mkfifo $ex/p.out.log; '
              'truncate -s 2G $ex/big.out.log; echo kept > $ex/ok.out.log; exit 4')
    proc = subprocess.run([sys.executable, "-m", "sandbox", "run", "--ci", "--no-isolation", "--manifest",
                           str(tmp_path / "manifest.toml"), "--run-dir", str(tmp_path / "run"),
                           "--", "sh", "-c", script],
                          cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 4, proc.stderr[-3000:]
    exec_dir = tmp_path / "run/exec"
    assert sorted(p.name for p in exec_dir.iterdir()) == ["big.out.log", "ok.out.log"]
    assert (exec_dir / "ok.out.log").read_text() == "kept\n" and (exec_dir / "big.out.log").stat().st_blocks == 0
    assert (exec_dir / "big.out.log").stat().st_size == CAP + 4096
    assert not (tmp_path / "run/exec.left").exists()
    assert "env.out.log: a symbolic link (not followed)" in proc.stderr and "p.out.log: a FIFO" in proc.stderr
