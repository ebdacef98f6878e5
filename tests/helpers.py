"""Small helpers shared by tests: bounded waits and backing-tree snapshots."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guardfs.rules import default_recoverable
from sandbox.breaker import Breaker, State

__all__ = ["FIX_TAX", "FORBIDDEN_TERMINAL", "git_env", "require", "snapshot", "state_of", "wait_for"]

#: The scope most end-to-end tests use: writes in src/checkout/ only, .env* forbidden.
FIX_TAX = """
[task]
id = "fix-tax"
goal = "Fix the tax rounding helper in src/checkout/"
[paths]
allowed = ["src/checkout/"]
forbidden = [".env*"]
"""

#: ``[breaker]`` making a first forbidden read terminal (the default before issue 14), for
#: tests about what a terminal trip does: every other rule keeps its default.
FORBIDDEN_TERMINAL = "[breaker]\nrecoverable = [{}]\n".format(
    ", ".join(f'"{rule}"' for rule in default_recoverable() if rule != "forbidden_path"))



def state_of(breaker: Breaker) -> State:
    """The breaker's state (a call, so that type checkers do not narrow it across events)."""
    return breaker.state


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait until *condition* holds, polling with a bound; fail naming *what*."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def snapshot(root: Path) -> dict[str, tuple[int, bytes, float]]:
    """Every entry below *root*: mode, content (or link target) and mtime, byte for byte."""
    out: dict[str, tuple[int, bytes, float]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(p).encode()
            elif stat.S_ISREG(st.st_mode):
                data = Path(p).read_bytes()
            else:
                data = b""
            xattrs = b"".join(
                n.encode() + b"=" + os.getxattr(p, n, follow_symlinks=False)
                for n in sorted(os.listxattr(p, follow_symlinks=False))
            )
            out[rel] = (st.st_mode, data + b"\0" + xattrs, st.st_mtime)
    return out


def git_env(home: Path) -> dict[str, str]:
    """An environment in which git needs no user configuration."""
    env = dict(os.environ)
    env.update(
        HOME=str(home), GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="Agent", GIT_AUTHOR_EMAIL="agent@example.invalid",
        GIT_COMMITTER_NAME="Agent", GIT_COMMITTER_EMAIL="agent@example.invalid",
    )
    return env


def require(tool: str) -> str:
    """The path of *tool*, or skip naming it."""
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path


#: Where the pinned agent CLIs are installed (from the npm registry, or PyPI), once per checkout.
CLI_CACHE = Path(__file__).resolve().parent.parent / ".cache"


def _pinned(cache_name: str, version: str, binary: Path, install: Callable[[], str | None]) -> Path:
    """*binary* of a pinned CLI under ``.cache/``: installed by *install* on first use (it returns
    None, or the installer's words when it failed: then the test is skipped with them), one install
    at a time (pytest-xdist workers and ./dev.sh's early fetch may want it at once), its version checked."""
    CLI_CACHE.mkdir(exist_ok=True)
    with open(CLI_CACHE / f"{cache_name}-{version}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            failed = install()
            if failed is not None or not binary.exists():
                pytest.skip(failed or f"the install left no {binary}")
    found = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120)
    assert version in found.stdout, found.stderr
    return binary


def npm_cli(package: str, version: str, command: str, cache_name: str) -> Path:
    """The agent CLI *package* at *version* (its *command*), installed from the npm registry into
    ``.cache/<cache_name>-<version>`` on first use; skipped, with npm's words, where it cannot be."""
    prefix = CLI_CACHE / f"{cache_name}-{version}"

    def install() -> str | None:
        if shutil.which("npm") is None:
            return f"npm is not installed: cannot fetch {package}"
        prefix.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix), f"{package}@{version}"],
            capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            return f"the npm registry is unreachable or refused the install: {proc.stderr.strip()[-300:]}"
        return None

    return _pinned(cache_name, version, prefix / "node_modules/.bin" / command, install)


def pip_cli(package: str, version: str, command: str, cache_name: str) -> Path:
    """The agent CLI *package* at *version* (its *command*), installed from PyPI into a venv of its
    own at ``.cache/<cache_name>-<version>`` on first use; skipped, with pip's words, where it cannot be."""
    prefix = CLI_CACHE / f"{cache_name}-{version}"

    def install() -> str | None:
        # A venv left half-made by an interrupted install is made again, not patched.
        shutil.rmtree(prefix, ignore_errors=True)
        # The system's Python, not this venv's: the CLI's venv must not depend on ours.
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(prefix)], check=True, capture_output=True, timeout=300)
        proc = subprocess.run(
            [str(prefix / "bin/pip"), "install", "-q", "--disable-pip-version-check", f"{package}=={version}"],
            capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            shutil.rmtree(prefix, ignore_errors=True)
            return f"PyPI is unreachable or refused the install: {proc.stderr.strip()[-300:]}"
        return None

    return _pinned(cache_name, version, prefix / "bin" / command, install)


def fetch_pinned_clis() -> None:
    """Install every pinned agent CLI the tests run, at once (``./dev.sh test`` starts this in the
    background before ruff, mypy and the no-FUSE pass, so that the downloads overlap them); says
    on stderr what could not be fetched (the tests then try again, and skip with npm's or pip's words)."""
    from concurrent.futures import ThreadPoolExecutor

    from .test_claude_code import CLAUDE_CLI
    from .test_real_aider import AIDER_CLI
    from .test_real_codex import CODEX_CLI
    from .test_real_gemini import GEMINI_CLI
    from .test_wheel import BUILD_CLI, PIPX_CLI

    def fetch(cli: tuple[Callable[[str, str, str, str], Path], tuple[str, str, str, str]]) -> None:
        install, args = cli
        try:
            install(*args)
        except pytest.skip.Exception as skipped:
            print(f"fetching {args[0]}@{args[1]}: {skipped.msg}", file=sys.stderr)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(fetch, [(npm_cli, CLAUDE_CLI), (npm_cli, CODEX_CLI), (npm_cli, GEMINI_CLI),
                              (pip_cli, AIDER_CLI), (pip_cli, BUILD_CLI), (pip_cli, PIPX_CLI)]))


def reports(log: Path) -> list[dict[str, Any]]:
    """The JSON objects a hostile agent script printed, one a line, in *log* (its stdout.log)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def run_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every event of the run whose directory is *run_dir*."""
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


#: django-taggit, the third-party repository of a new user's first hour (tests/test_first_hour.py).
TAGGIT_VERSION = "5.0.1"
#: What its own test suite needs (its tox.ini: Django 4.2 and Django REST framework).
TAGGIT_TEST_REQUIREMENTS = ("Django>=4.2,<5", "djangorestframework")


def taggit_sources() -> tuple[Path, Path]:
    """django-taggit's sdist and a wheelhouse of what its test suite needs, downloaded from PyPI
    into ``.cache/taggit-<version>/`` on first use (later runs are offline); skipped, with pip's
    words, where PyPI cannot be reached."""
    import sys

    cache = CLI_CACHE / f"taggit-{TAGGIT_VERSION}"
    wheelhouse = cache / "wheelhouse"
    CLI_CACHE.mkdir(exist_ok=True)
    with open(CLI_CACHE / f"taggit-{TAGGIT_VERSION}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "complete").exists():
            for args in (["--no-deps", "--no-binary", ":all:", f"django-taggit=={TAGGIT_VERSION}", "-d", str(cache)],
                         ["--only-binary", ":all:", *TAGGIT_TEST_REQUIREMENTS, "-d", str(wheelhouse)]):
                proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *args],
                                      capture_output=True, text=True, timeout=900)
                if proc.returncode != 0:
                    pytest.skip(f"PyPI is unreachable or refused the download: {proc.stderr.strip()[-300:]}")
            (cache / "complete").touch()
    return next(cache.glob("django*taggit-*.tar.gz")), wheelhouse


def npm_tarballs(specs: list[str], cache_name: str) -> list[Path]:
    """The npm packages *specs* (``name@version``) as tarballs in ``.cache/<cache_name>/``, packed
    from the npm registry (or npm's own cache) on first use, for tests that install them the
    way a user does (``npm install -g``); skipped, with npm's words, where they cannot be."""
    folder = CLI_CACHE / cache_name
    CLI_CACHE.mkdir(exist_ok=True)
    with open(CLI_CACHE / f"{cache_name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "complete").exists():
            if shutil.which("npm") is None:
                pytest.skip(f"npm is not installed: cannot fetch {', '.join(specs)}")
            folder.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(folder), *specs],
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                pytest.skip(f"the npm registry is unreachable or refused the download: {proc.stderr.strip()[-300:]}")
            names = [packed["filename"] for packed in json.loads(proc.stdout)]
            (folder / "complete").write_text("\n".join(names) + "\n")
    return [folder / name for name in (folder / "complete").read_text().split()]


#: A breaker daemon of a session (no mount) on the real clock, in its own process: serves until its stdin closes.
_DAEMON = """
import sys, trio
from pathlib import Path
from guardfs.events import EventLog
from guardfs.manifest import parse_manifest
from sandbox.session import Session

async def main(run, ws, manifest):
    events = EventLog(Path(run) / "events.jsonl")
    with Session(parse_manifest(manifest), ws, events, run_dir=Path(run)) as session:
        async with trio.open_nursery() as nursery:
            await nursery.start(session.daemon.run)
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)
            nursery.cancel_scope.cancel()
    events.close()

trio.run(main, *sys.argv[1:])
"""


@contextlib.contextmanager
def breaker_daemon(run_dir: Path, workspace: Path, manifest: str) -> Iterator[Path]:
    """A real breaker daemon serving *run_dir*'s agent.sock and control.sock (for clients that are
    processes of their own: hooks, the container's relay); yields *run_dir* once both listen.
    Keep *run_dir* short: a socket's path holds 108 bytes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _DAEMON, str(run_dir), str(workspace), manifest],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "ready\n", "the breaker daemon did not start"
        yield run_dir
    finally:
        proc.stdin.close()
        proc.stdout.close()
        code = proc.wait(timeout=30)
    assert code == 0, f"the breaker daemon exited {code}"


def dir_chain(top: Path, depth: int, name: str = "d") -> int:
    """*depth* directories *name* in a chain below *top*, each made by a relative step (the
    whole path may be far past PATH_MAX, as an agent can leave one); an fd of the deepest,
    the caller's to close."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            down = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = down
    except BaseException:
        os.close(fd)
        raise
    return fd


def assert_container_checks(result: subprocess.CompletedProcess[str], expected: list[str]) -> None:
    """A container script's ``CHECK name ok|FAIL detail`` lines (containers/test-image.sh,
    test-feature.sh): every expected check reported, each ok, and the script's exit 0."""
    checks: dict[str, str] = {}
    for line in result.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = [*line.split(" ", 2), ""][:3]
            checks[name] = verdict
    failed = {name: verdict for name, verdict in checks.items() if verdict != "ok"}
    missing = [name for name in expected if name not in checks]
    assert not failed and not missing, (failed, missing, result.stderr[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]
