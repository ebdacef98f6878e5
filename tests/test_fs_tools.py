"""Real tools inside a guarded workspace: git, venv + pip, compileall, pytest, editors."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .helpers import git_env, require
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command, failing the test with its output when it fails."""
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_git_workflow(guarded: Guarded, tmp_path: Path) -> None:
    require("git")
    env = git_env(tmp_path)
    mnt = guarded.mnt
    run(["git", "init", "-q", "-b", "main"], mnt, env)
    # git init wrote its sample hooks and config through the mount, allowed as git internals.
    assert (guarded.backing / ".git/config").is_file()
    assert list((guarded.backing / ".git/hooks").glob("*.sample"))
    code = mnt / "src/checkout"
    code.mkdir(parents=True)
    (code / "tax.py").write_text("def rate():\n    return 0.2\n")
    run(["git", "add", "-A"], mnt, env)
    run(["git", "commit", "-q", "-m", "first"], mnt, env)
    assert run(["git", "status", "--porcelain"], mnt, env) == ""
    (code / "tax.py").write_text("def rate():\n    return 0.25\n")
    assert "M src/checkout/tax.py" in run(["git", "status", "--porcelain"], mnt, env)
    run(["git", "stash"], mnt, env)
    assert (code / "tax.py").read_text() == "def rate():\n    return 0.2\n"
    run(["git", "stash", "pop"], mnt, env)
    assert "0.25" in (code / "tax.py").read_text()
    run(["git", "checkout", "-q", "-b", "fix"], mnt, env)
    run(["git", "commit", "-q", "-am", "fix"], mnt, env)
    run(["git", "checkout", "-q", "main"], mnt, env)
    assert "0.2\n" in (guarded.backing / "src/checkout/tax.py").read_text()
    assert run(["git", "log", "--oneline", "fix"], mnt, env).count("\n") == 2
    # git's internals never count toward the blast radius.
    assert all(not p.startswith(".git/") for p in guarded.fs.accounting.files)
    assert not guarded.denials()


def test_git_hooks_and_existing_config_are_read_only(tmp_path: Path) -> None:
    require("git")
    env = git_env(tmp_path)
    (tmp_path / "backing").mkdir()
    run(["git", "init", "-q"], tmp_path / "backing", env)  # a repository that was there before
    with guarded_mount(tmp_path) as g:
        hook = g.mnt / ".git/hooks/pre-commit"
        proc = subprocess.run(["sh", "-c", f"echo 'exit 0' > {hook}"], capture_output=True, text=True)
        assert proc.returncode != 0 and "Read-only file system" in proc.stderr
        sample = g.mnt / ".git/hooks/pre-commit.sample"
        assert subprocess.run(["mv", str(sample), str(hook)], capture_output=True).returncode != 0
        assert subprocess.run(["ln", str(sample), str(hook)], capture_output=True).returncode != 0
        assert subprocess.run(["ln", "-s", "pre-commit.sample", str(hook)], capture_output=True).returncode != 0
        proc = subprocess.run(["git", "config", "core.hooksPath", "/tmp"], cwd=g.mnt, env=env,
                              capture_output=True, text=True)
        assert proc.returncode != 0
        assert not (g.backing / ".git/hooks/pre-commit").exists()
        assert "hooksPath" not in (g.backing / ".git/config").read_text()
        rules = {e["rule"] for e in g.denials()}
        assert "built-in: .git/hooks/ is read-only" in rules
        assert "built-in: .git/config is read-only if it existed when the guard started" in rules


def _wheel(dest: Path) -> Path:
    """A minimal pure-Python wheel for a package 'tinypkg' (no build backend needed)."""
    files = {
        "tinypkg/__init__.py": b"def hello():\n    return 'hello from tinypkg'\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: guardfs-tests\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    path = dest / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_venv_and_pip_install(guarded: Guarded) -> None:
    work = guarded.mnt / "work"
    work.mkdir()
    wheel = _wheel(work)
    venv = work / "venv"
    run([sys.executable, "-m", "venv", str(venv)], work)
    py = venv / "bin/python"
    run([str(py), "-m", "pip", "install", "-q", "--no-index", str(wheel)], work)
    out = run([str(py), "-c", "import tinypkg; print(tinypkg.hello())"], work)
    assert out.strip() == "hello from tinypkg"
    assert (guarded.backing / "work/venv/bin/python").is_symlink()
    assert list((guarded.backing / "work/venv/lib").glob("python3*/site-packages/tinypkg/__init__.py"))
    # Bytecode is refused quietly without a run directory's scratch layer (pip goes on without it).
    assert all(d["rule"] == "paths.generated" and "__pycache__" in d["path"].split("/")
               for d in guarded.denials()), guarded.denials()


def test_compileall_and_pytest_inside_the_mount(guarded: Guarded) -> None:
    tests = guarded.mnt / "tests/checkout"
    tests.mkdir(parents=True)
    code = guarded.mnt / "src/checkout"
    code.mkdir(parents=True)
    (code / "tax.py").write_text("def total(x):\n    return max(0, round(x, 2))\n")
    (tests / "test_tax.py").write_text(
        "import sys\nsys.path.insert(0, 'src/checkout')\nfrom tax import total\n\n"
        "def test_total():\n    assert total(-1) == 0\n    assert total(1.234) == 1.23\n"
    )
    # Bytecode never lands in the workspace, in scope or not: without a run directory's scratch
    # layer it is refused quietly (compileall says so and fails; imports go on without it).
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", "src", "tests"], cwd=guarded.mnt,
                              capture_output=True, text=True, timeout=300)
    assert compiled.returncode == 1 and "Read-only file system" in compiled.stdout + compiled.stderr, compiled
    assert not (guarded.backing / "src/checkout/__pycache__").exists()
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/checkout"], guarded.mnt)
    assert "1 passed" in out


def test_editor_atomic_save_is_one_rewrite(guarded: Guarded) -> None:
    code = guarded.mnt / "src/checkout"
    code.mkdir(parents=True)
    target = code / "tax.py"
    target.write_text("def rate():\n    return 0.2\n")
    distinct = guarded.fs.accounting.distinct
    # What editors and agents do: write a temporary next to the file, then rename onto it.
    tmp = code / "tax.py.tmp.4242.1700000000"
    with open(tmp, "w") as f:
        f.write("def rate():\n    return 0.21\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, target)
    record = guarded.fs.accounting.files["src/checkout/tax.py"]
    assert record.rewrites == 2  # the creating write, then the atomic save
    assert record.symbols["rate"] == 2
    assert guarded.fs.accounting.distinct == distinct  # the temporary did not count
    assert "src/checkout/tax.py.tmp.4242.1700000000" not in guarded.fs.accounting.files
    # The same with sed -i, which writes sedXXXXXX and renames it.
    run(["sed", "-i", "s/0.21/0.22/", "tax.py"], code)
    assert guarded.fs.accounting.files["src/checkout/tax.py"].symbols["rate"] == 3
    assert guarded.fs.accounting.distinct == distinct
    assert target.read_text() == "def rate():\n    return 0.22\n"


def test_atomic_save_of_a_file_allowed_by_name(tmp_path: Path) -> None:
    """`guard init --allow src/checkout/tax.py`: Claude Code's Edit saves through
    tax.py.tmp.<pid>.<random> beside the file, sed -i through sedXXXXXX; each save lands as a
    rewrite of the file, with no denial."""
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    (tmp_path / "backing/src/checkout/tax.py").write_text("def rate():\n    return 0.2\n")
    manifest = '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/checkout/tax.py"]\n'
    with guarded_mount(tmp_path, manifest) as g:
        code = g.mnt / "src/checkout"
        tmp = code / "tax.py.tmp.2.ecec68ffaafd"
        tmp.write_text("def rate():\n    return 0.21\n")
        os.rename(tmp, code / "tax.py")
        assert (g.backing / "src/checkout/tax.py").read_text() == "def rate():\n    return 0.21\n"
        assert list(g.fs.accounting.files) == ["src/checkout/tax.py"]
        assert g.fs.accounting.files["src/checkout/tax.py"].rewrites == 1
        # sed -i saves through sedXXXXXX beside the file, renamed over it.
        run(["sed", "-i", "s/0.21/0.22/", "tax.py"], code)
        assert (g.backing / "src/checkout/tax.py").read_text() == "def rate():\n    return 0.22\n"
        assert list(g.fs.accounting.files) == ["src/checkout/tax.py"]
        assert g.denials() == []
        # Any other new name beside it is still out of scope.
        with pytest.raises(OSError) as err:
            (code / "other.py").write_text("x = 1\n")
        assert err.value.errno == errno.EROFS
    assert sorted(p.name for p in (tmp_path / "backing/src/checkout").iterdir()) == ["tax.py"]


def test_data_round_trips_through_the_mount(tmp_path: Path) -> None:
    with guarded_mount(tmp_path) as g:
        work = g.mnt / "work"
        work.mkdir()
        blob = os.urandom(3 * 1024 * 1024 + 17)
        (work / "blob").write_bytes(blob)
        with open(work / "blob", "r+b") as f:
            f.seek(1000)
            f.write(b"patched")
        expected = blob[:1000] + b"patched" + blob[1007:]
        assert (g.backing / "work/blob").read_bytes() == expected
        assert (work / "blob").read_bytes() == expected
        with open(work / "log", "a") as f:
            f.write("one\n")
        with open(work / "log", "a") as f:
            f.write("two\n")
        assert (work / "log").read_text() == "one\ntwo\n"
        os.truncate(work / "blob", 10)
        assert (g.backing / "work/blob").stat().st_size == 10
        os.mkfifo(work / "fifo")
        assert (g.backing / "work/fifo").is_fifo()
        st = os.stat(work / "blob")
        assert st.st_size == 10 and st.st_ino == os.stat(g.backing / "work/blob").st_ino
