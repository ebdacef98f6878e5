"""The package as users install it: the sdist and the wheel built from a copy of this checkout
(the wheel from the sdist, as PyPA's build does it), each installed with pipx and into a fresh
virtualenv outside the checkout, and run from there (no editable install, no source tree on the
path): guard doctor, guard demo, guard init in a new repository and a guard run of a scripted agent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from .helpers import git_env, pip_cli, run_events

ROOT = Path(__file__).resolve().parent.parent
#: PyPA's build frontend (pyproject-build), fetched into .cache/ as the agent CLIs are.
BUILD_CLI = ("build", "1.2.2.post1", "pyproject-build", "build")
#: pipx as Debian 12 packages it (apt-get install pipx: 1.1.0), fetched into .cache/.
PIPX_CLI = ("pipx", "1.1.0", "pipx", "pipx")
#: The Python a user's pipx and venv get on Debian or Ubuntu: the system's (it needs python3-dev to
#: build pyfuse3, which has no wheels); this interpreter where there is none.
USER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
#: How each install is made: by which installer, from which file. Each file and each installer
#: once (the other two pairings add minutes to CI and nothing the two do not reach: pipx 1.1.0
#: builds an sdist twice).
INSTALLS = ["pipx-sdist", "venv-wheel"]


def _clean_env(**more: str) -> dict[str, str]:
    """This environment without anything that would point back to the checkout or its venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(more)
    return env


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The sdist and the wheel, built once for the module: (sdist, wheel)."""
    work = tmp_path_factory.mktemp("dists")
    # From a copy without the editable install's leftovers: a stale guardfs.egg-info/SOURCES.txt
    # makes setuptools ship what the configuration itself would leave out.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    build = pip_cli(*BUILD_CLI)
    dist = work / "dist"
    built = subprocess.run([str(build), "--outdir", str(dist), str(source)], capture_output=True, text=True,
                           timeout=600, cwd=work, env=_clean_env())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr  # SPDX license, no deprecation
    (sdist,) = dist.glob("guardfs-*.tar.gz")
    (wheel,) = dist.glob("guardfs-*.whl")
    return sdist, wheel


def _venv_install(work: Path, target: Path) -> Path:
    venv = work / "venv"
    subprocess.run([USER_PYTHON, "-m", "venv", str(venv)], check=True, timeout=120, cwd=work, env=_clean_env())
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", str(target)],
                         capture_output=True, text=True, timeout=900, cwd=work, env=_clean_env())
    assert pip.returncode == 0, pip.stderr[-3000:]
    return venv / "bin"


def _pipx_install(work: Path, target: Path, shared: Path) -> Path:
    pipx = pip_cli(*PIPX_CLI)
    # pipx's own pip, setuptools and wheel (PIPX_SHARED_LIBS) made once for the module's installs.
    env = _clean_env(PIPX_HOME=str(work / "pipx"), PIPX_BIN_DIR=str(work / "bin"), PIPX_SHARED_LIBS=str(shared))
    proc = subprocess.run([str(pipx), "install", "--python", USER_PYTHON, str(target)], capture_output=True,
                          text=True, timeout=900, cwd=work, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (work / "bin/guard").exists(), proc.stdout
    return work / "bin"


@pytest.fixture(scope="module")
def installed(dists: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed: returns its bin directory."""
    return _venv_install(tmp_path_factory.mktemp("venv-wheel"), dists[1])


@pytest.fixture(scope="module", params=INSTALLS)
def install(request: pytest.FixtureRequest, dists: tuple[Path, Path], installed: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each way a user installs guard: the bin directory its ``guard`` is in."""
    how, what = str(request.param).split("-")
    if (how, what) == ("venv", "wheel"):
        return installed
    target = dists[0] if what == "sdist" else dists[1]
    work = tmp_path_factory.mktemp(str(request.param))
    if how == "venv":
        return _venv_install(work, target)
    return _pipx_install(work, target, tmp_path_factory.getbasetemp() / "pipx-shared")


def _outside_checkout(bin_dir: Path, home: Path) -> dict[str, str]:
    """An environment in which nothing of the checkout can be imported by accident."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", HOME=str(home), XDG_CACHE_HOME=str(home / "cache"),
               XDG_STATE_HOME=str(home / "state"))
    return env


def test_wheel_holds_every_subpackage_and_the_hook_source(dists: tuple[Path, Path]) -> None:
    names = set(zipfile.ZipFile(dists[1]).namelist())
    sources = {str(p.relative_to(ROOT)) for top in ("guardfs", "sandbox") for p in (ROOT / top).rglob("*.py")}
    assert sources <= names, sorted(sources - names)
    assert {"sandbox/agents/guard_hook.c", "guardfs/py.typed", "sandbox/py.typed"} <= names
    assert "guardfs/_fusereply.abi3.so" in names  # the C module, for the stable ABI


def test_one_wheel_for_every_supported_python(dists: tuple[Path, Path]) -> None:
    """The C module is built against the limited API of the oldest Python requires-python admits:
    the wheel's tag is cpXY-abi3 for that Python (pip installs it on every later one)."""
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert floor.startswith(">=3."), floor
    tag = "cp3" + floor.removeprefix(">=3.")
    name = dists[1].name
    assert name.startswith(f"guardfs-0.1.0-{tag}-abi3-linux_"), name
    with zipfile.ZipFile(dists[1]) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/WHEEL"))
        assert f"Tag: {tag}-abi3-linux_" in wheel.read(meta).decode()
        info = wheel.read(meta.replace("/WHEEL", "/METADATA")).decode()
    assert "License-Expression: Apache-2.0" in info and f"Requires-Python: {floor}" in info


def test_the_sdist_holds_what_a_build_from_it_needs(dists: tuple[Path, Path]) -> None:
    """(The wheel above was built from this sdist, by build: this names what it must carry.)"""
    with tarfile.open(dists[0]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "setup.py", "README.md", "guardfs/_fusereply.c", "guardfs/_fusereply.pyi",
            "sandbox/agents/guard_hook.c", "sandbox/doctor.py", "guardfs/device.py"} <= names, sorted(names)


# The scripted agent: one write in scope (src/), one out of it (docs/), each said on stdout.
_AGENT = ("echo 'RATE = 0.2' > src/tax.py && echo in-scope: written || echo in-scope: refused; "
          "echo drift > docs/notes.md && echo out-of-scope: written || echo out-of-scope: refused")


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_from_the_install_alone(install: Path, tmp_path: Path) -> None:
    """guard doctor, guard demo, guard init in a new repository and guard run of a scripted
    agent, from the installed guard alone (cwd outside the checkout, no PYTHONPATH)."""
    env = _outside_checkout(install, tmp_path)
    guard = str(install / "guard")
    doctor = subprocess.run([guard, "doctor"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    # One line per check, in the order of the installed guard's own JSON (not this checkout's list).
    as_json = subprocess.run([guard, "doctor", "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env=env)
    expected = [c["name"] for c in json.loads(as_json.stdout)]
    lines = doctor.stdout.splitlines()
    assert [line.split(":", 1)[0].split(None, 1)[1] for line in lines] == expected, doctor.stdout
    assert doctor.stdout.startswith("ok      /dev/fuse: ") and "MISSING" not in doctor.stdout, doctor.stdout
    demo = subprocess.run([guard, "demo"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "demo passed" in demo.stdout
    repo = tmp_path / "shop"
    (repo / "src").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "src/tax.py").write_text("RATE = 0.1\n")
    (repo / "docs/notes.md").write_text("notes\n")
    git = {**env, **git_env(tmp_path)}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "shop"]):
        subprocess.run(["git", *argv], cwd=repo, check=True, env=git)
    init = subprocess.run([guard, "init", "--allow", "src/", "Raise the tax rate"], capture_output=True, text=True,
                          timeout=120, cwd=repo, env=env)
    assert init.returncode == 0, init.stdout + init.stderr
    assert (repo / "guard.toml").is_file()
    run_dir = tmp_path / "run"
    run = subprocess.run([guard, "run", "--ci", "--run-dir", str(run_dir), "--", "sh", "-c", _AGENT],
                         capture_output=True, text=True, timeout=300, cwd=repo, env=env, stdin=subprocess.DEVNULL)
    log = (run_dir / "stdout.log").read_text()
    assert "in-scope: written" in log and "out-of-scope: refused" in log, (log, run.stderr)
    assert (repo / "src/tax.py").read_text() == "RATE = 0.2\n"  # landed in the real workspace
    assert (repo / "docs/notes.md").read_text() == "notes\n"  # untouched
    denied = {e["path"] for e in run_events(run_dir) if e["decision"] == "deny"}
    assert "docs/notes.md" in denied and "src/tax.py" not in denied, denied


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
