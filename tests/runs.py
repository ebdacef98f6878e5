"""Real guarded runs for the report's tests: a committed workspace, ``guard run`` of a shell
agent, ``guard report``, and the links of a written page."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from .helpers import FIX_TAX

__all__ = ["CHROMIUM_FLAGS", "chromium", "committed_workspace", "guard", "guard_sh", "hrefs", "numstat",
           "resolve_href"]

#: Headless Chromium that touches no network and keeps its profile where it is told.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def committed_workspace(tmp: Path, manifest_text: str = FIX_TAX) -> tuple[Path, Path]:
    """The fix-tax repository, its start committed (git is the diff stat's ground truth), and a
    manifest beside it: (workspace, manifest)."""
    ws = tmp / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "src/checkout/old.py").write_text("a = 1\nb = 2\nc = 3\n")
    (ws / "README.md").write_text("readme\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "start"]):
        subprocess.run(argv, cwd=ws, check=True, env=env, capture_output=True)
    manifest = tmp / "guard.toml"
    manifest.write_text(manifest_text)
    return ws, manifest


def guard_sh(manifest: Path, ws: Path, run_dir: Path, script: str, *flags: str,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``guard run`` of ``sh -c SCRIPT`` (a shell agent: no steps, no hook) from the workspace."""
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--manifest", str(manifest), "--run-dir", str(run_dir), *flags,
         "--", "sh", "-c", script],
        cwd=ws, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def guard(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``guard ARGS`` (this checkout's)."""
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def numstat(ws: Path) -> dict[str, tuple[int | None, int | None]]:
    """git's own count of what changed since the commit: {path: (added, deleted)}, None for a binary file's."""
    subprocess.run(["git", "add", "-A"], cwd=ws, check=True)
    out = subprocess.run(["git", "diff", "--cached", "--numstat", "--no-renames"], cwd=ws, check=True,
                         capture_output=True, text=True).stdout
    counts: dict[str, tuple[int | None, int | None]] = {}
    for line in out.splitlines():
        added, deleted, path = line.split("\t")
        counts[path] = (None, None) if added == "-" else (int(added), int(deleted))
    return counts


def hrefs(page: str) -> list[str]:
    """The page's links, in order (the renderers quote attributes with ')."""
    return re.findall(r"href='([^']*)'", page)


def resolve_href(href: str, page: Path) -> Path:
    """The file a link of the page at *page* points at, as a browser resolves it."""
    url = urllib.parse.urlsplit(href)
    if url.scheme == "file":
        return Path(urllib.parse.unquote(url.path))
    assert not url.scheme, href
    return Path(os.path.normpath(page.parent / urllib.parse.unquote(url.path)))


def chromium() -> str:
    """Chromium's path; a failure (not a skip) without it: ./dev.sh installs it."""
    found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is not installed: ./dev.sh installs it (Debian package chromium)")
    return found
