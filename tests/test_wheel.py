"""The package as users install it: a wheel built from this checkout, installed into a fresh
virtualenv outside the checkout, and run from there (no editable install, no source tree on
the path)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed: returns its bin directory."""
    work = tmp_path_factory.mktemp("wheel")
    # From a copy without the editable install's leftovers: a stale guardfs.egg-info/SOURCES.txt
    # makes setuptools ship what the configuration itself would leave out.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    dist = work / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("guardfs-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr
    return venv / "bin"


def _outside_checkout(bin_dir: Path, home: Path) -> dict[str, str]:
    """An environment in which nothing of the checkout can be imported by accident."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", HOME=str(home), XDG_CACHE_HOME=str(home / "cache"),
               XDG_STATE_HOME=str(home / "state"))
    return env


def test_wheel_holds_every_subpackage_and_the_hook_source(installed: Path) -> None:
    (wheel,) = (installed.parent.parent / "dist").glob("guardfs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(ROOT)) for top in ("guardfs", "sandbox") for p in (ROOT / top).rglob("*.py")}
    assert sources <= names, sorted(sources - names)
    assert {"sandbox/agents/guard_hook.c", "guardfs/py.typed", "sandbox/py.typed"} <= names


@pytest.mark.mount
def test_guard_demo_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    proc = subprocess.run([str(installed / "guard"), "demo"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_outside_checkout(installed, tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo passed" in proc.stdout


def test_guard_hook_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    """With no guard to ask, the installed hook fails closed on a write and lets a read go."""
    env = {**_outside_checkout(installed, tmp_path), "GUARD_SOCKET": str(tmp_path / "absent.sock")}
    write = {"hook_event_name": "PreToolUse", "tool_name": "Write", "cwd": str(tmp_path),
             "tool_input": {"file_path": "src/a.py", "content": "x"}}
    read = {**write, "tool_name": "Read", "tool_input": {"file_path": "src/a.py"}}
    refused = subprocess.run([str(installed / "guard"), "hook", "claude"], input=json.dumps(write),
                             capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "cannot reach the guard" in refused.stderr
    allowed = subprocess.run([str(installed / "guard"), "hook", "claude"], input=json.dumps(read),
                             capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert allowed.returncode == 0, allowed.stderr


def test_hook_helper_is_built_into_the_users_cache(installed: Path, tmp_path: Path) -> None:
    """The compiled helper lands in XDG_CACHE_HOME, never in the installed package."""
    code = "from sandbox.agents.hooks import compiled_helper; h = compiled_helper(); print(h or '')"
    proc = subprocess.run([str(installed / "python"), "-c", code], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=_outside_checkout(installed, tmp_path))
    assert proc.returncode == 0, proc.stderr
    helper = proc.stdout.strip()
    if not helper:
        pytest.skip("no C compiler on this machine: agents get the Python hook")
    assert Path(helper).is_relative_to(tmp_path / "cache"), helper
    where = "import os, sandbox; print(os.path.dirname(sandbox.__file__))"
    site = subprocess.run([str(installed / "python"), "-c", where], capture_output=True, text=True, check=True,
                          timeout=60, cwd=tmp_path, env=_outside_checkout(installed, tmp_path))
    assert Path(site.stdout.strip()).is_relative_to(installed.parent), site.stdout  # the wheel's, not the checkout's
    assert not list(Path(site.stdout.strip()).rglob("guard-hook-*"))
