"""Generated territory (``[paths] generated``): caches, builds and installs never trip the breaker.

The tools run for real through ``guard run --ci`` in a repository whose manifest allows only
``src/checkout/`` (tests.test_real_tools.Run), under the default limits. Each must exit with
its own status, trip nothing, count no file of its generated output toward ``max_files``, and
write nothing outside ``src/checkout/`` on the real workspace: generated output out of scope
lands in the run's scratch layer (guardfs.scratch), which the agent sees and the host does not.
The policy, the manifest and rollback are checked directly first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from guardfs.backing import Backing
from guardfs.checkpoint import PreImages, last_rollback
from guardfs.errors import ManifestError
from guardfs.manifest import DEFAULT_GENERATED, parse_manifest
from guardfs.policy import PathPolicy, Scope, read_gitignore

from .helpers import require
from .mounts import Guarded, guarded_mount
from .test_real_tools import Run

TOML = '[task]\nid = "t"\ngoal = "g"\n[paths]\nallowed = ["src/checkout/"]\nforbidden = [".env*"]\n'


# ----- the policy and the manifest --------------------------------------------------------------


@pytest.mark.parametrize(("path", "is_dir", "scope"), [
    ("src/checkout/__pycache__/tax.cpython-311.pyc", False, Scope.GENERATED_OUTSIDE),  # bytecode: scratch
    ("src/checkout/tax.pyc", False, Scope.GENERATED_OUTSIDE),
    ("src/checkout/.venv/lib/python3.11/site-packages/x.py", False, Scope.GENERATED),
    ("src/checkout/node_modules", True, Scope.GENERATED),
    ("src/checkout/tax.py", False, Scope.ALLOWED),
    (".pytest_cache/v/cache/nodeids", False, Scope.GENERATED_OUTSIDE),
    ("pytest-cache-files-ab12cd", True, Scope.GENERATED_OUTSIDE),
    ("lib/__pycache__", True, Scope.GENERATED_OUTSIDE),
    (".benchmarks", True, Scope.GENERATED_OUTSIDE),
    (".coverage", False, Scope.GENERATED_OUTSIDE),
    ("target/debug/app", False, Scope.GENERATED_OUTSIDE),
    ("README.md", False, Scope.OUT_OF_SCOPE),
    ("src/checkout/.env.local", False, Scope.FORBIDDEN),  # forbidden wins
])
def test_default_generated_patterns(path: str, is_dir: bool, scope: Scope) -> None:
    assert PathPolicy(parse_manifest(TOML)).classify(path, is_dir).scope is scope


def test_generated_never_reaches_a_repository_s_hooks() -> None:
    """A nested repository inside generated output keeps its built-in protections."""
    where = PathPolicy(parse_manifest(TOML)).classify("src/checkout/node_modules/pkg/.git/hooks/pre-commit", False)
    assert where.scope is Scope.PROTECTED


def test_generated_from_gitignore_reads_the_repository_s_gitignore(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("# caches\n*.log\n!keep.log\nout/\n.env\n")
    manifest = parse_manifest(TOML + "generated = []\ngenerated_from_gitignore = true\n")
    policy = PathPolicy(manifest, gitignore=read_gitignore(tmp_path))
    assert policy.classify("src/checkout/run.log", False).scope is Scope.GENERATED
    assert policy.classify("out/a.bin", False).scope is Scope.GENERATED_OUTSIDE
    where = policy.classify("src/checkout/keep.log", False)
    assert where.scope is Scope.ALLOWED
    assert policy.classify(".env", False).scope is Scope.FORBIDDEN  # forbidden still wins
    assert policy.classify("src/checkout/__pycache__/x.pyc", False).scope is Scope.ALLOWED  # defaults off
    off = PathPolicy(parse_manifest(TOML + "generated = []\n"), gitignore=read_gitignore(tmp_path))
    assert off.classify("src/checkout/run.log", False).scope is Scope.ALLOWED


def test_a_symlinked_gitignore_is_not_read(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("SECRET=1\n")
    (tmp_path / ".gitignore").symlink_to(".env")
    assert read_gitignore(tmp_path) == []


@pytest.mark.parametrize("pattern", ["*", "**", "*.*", "**/*"])
def test_over_broad_generated_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(ManifestError, match="over-broad"):
        parse_manifest(TOML + f"generated = [{pattern!r}]\n")


def test_the_defaults_are_listed_in_the_reference() -> None:
    reference = (Path(__file__).parent.parent / "docs/reference.md").read_text()
    missing = [p for p in DEFAULT_GENERATED if f"`{p}`" not in reference]
    assert missing == []


def test_rollback_says_generated_output_is_not_restored(tmp_path: Path) -> None:
    ws, store = tmp_path / "ws", tmp_path / "store"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("old\n")
    policy = PathPolicy(parse_manifest(TOML))
    backing = Backing(str(ws))
    pre = PreImages(backing, store, generated=policy.generated)
    try:
        import trio

        async def change() -> None:
            await pre.keep("src/checkout/tax.py", "src/checkout/.venv", "src/checkout/.venv/bin",
                           "src/checkout/.venv/bin/python")
        trio.run(change)
        (ws / "src/checkout/tax.py").write_text("new\n")
        (ws / "src/checkout/.venv/bin").mkdir(parents=True)
        (ws / "src/checkout/.venv/bin/python").write_text("#!\n")
        assert pre.rollback() == ["src/checkout/tax.py"]
    finally:
        pre.close()
        backing.close()
    assert (ws / "src/checkout/tax.py").read_text() == "old\n"
    assert (ws / "src/checkout/.venv/bin/python").exists()  # left as it is
    done = last_rollback(store)
    assert done is not None and done.generated == ["src/checkout/.venv"]


@pytest.mark.mount
def test_without_a_run_directory_generated_output_out_of_scope_is_refused_quietly(tmp_path: Path) -> None:
    """``guard mount`` without a run directory has no scratch layer: EROFS and an event; in
    scope the output lands, uncounted, under limits of one file and one rewrite."""
    with guarded_mount(tmp_path, TOML + "[limits]\nmax_files = 1\nmax_rewrites = 1\n") as guarded:
        _refused_quietly(guarded)


def _refused_quietly(guarded: Guarded) -> None:
    with pytest.raises(OSError) as err:
        (guarded.mnt / ".pytest_cache").mkdir()
    assert err.value.errno == errno.EROFS
    assert not (guarded.backing / ".pytest_cache").exists()
    (guarded.mnt / "src/checkout/.tox").mkdir(parents=True)
    (guarded.mnt / "src/checkout/.tox/tax").write_bytes(b"code")
    (guarded.mnt / "src/checkout/.tox/cart").write_bytes(b"code")  # past max_files
    for _ in range(3):  # past max_rewrites: never counted, never refused
        (guarded.mnt / "src/checkout/.tox/tax").write_bytes(b"more code")
    assert (guarded.backing / "src/checkout/.tox/tax").read_bytes() == b"more code"
    assert guarded.session.accounting.distinct == 0
    with pytest.raises(OSError) as err:  # Python bytecode is out of the workspace even in scope
        (guarded.mnt / "src/checkout/__pycache__").mkdir()
    assert err.value.errno == errno.EROFS
    events = [json.loads(line) for line in guarded.events_path.read_text().splitlines()]
    assert [(e["op"], e["path"], e["rule"]) for e in events if e.get("decision") == "deny"] == [
        ("mkdir", ".pytest_cache", "paths.generated"), ("mkdir", "src/checkout/__pycache__", "paths.generated")]


# ----- real tools under guard run --ci ----------------------------------------------------------


def _outside(ws: Path) -> dict[str, tuple[int, int, str]]:
    """Everything on the real workspace outside src/checkout/: mode, size and content hash."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(ws):
        rel = os.path.relpath(dirpath, ws)
        if rel == "src/checkout" or rel.startswith("src/checkout/"):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest = ""
            if os.path.isfile(path) and not os.path.islink(path):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            out[os.path.relpath(path, ws)] = (st.st_mode, st.st_size if digest else 0, digest)
    return out


class Tools(Run):
    """A Run (default limits) that remembers the workspace outside the scope before it runs."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        (self.ws / "lib").mkdir()
        (self.ws / "lib/helper.py").write_text("VALUE = 42\n")
        # A stale cache beside the out-of-scope module (one of it for that very module): it
        # must stay as it was on the host.
        (self.ws / "lib/__pycache__").mkdir()
        (self.ws / "lib/__pycache__/old.cpython-311.pyc").write_bytes(b"stale")
        (self.ws / "lib/__pycache__/helper.cpython-311.pyc").write_bytes(b"stale")
        self.before: dict[str, tuple[int, int, str]] = {}
        # Bytecode is what this file is about: write it, whatever the caller's environment says.
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)

    def __call__(self, script: str) -> subprocess.CompletedProcess[str]:
        self.before = _outside(self.ws)
        return super().__call__(script)

    def counted(self) -> dict[str, Any]:
        """The files the breaker counted toward max_files, from the ledger."""
        files: dict[str, Any] = json.loads((self.run_dir / "ledger.json").read_text())["files"]
        return files

    def denials(self) -> list[dict[str, Any]]:
        """Every refusal the mount recorded, from the event log."""
        events = [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]
        return [e for e in events if e.get("decision") == "deny"]

    def check(self, result: subprocess.CompletedProcess[str], status: int) -> None:
        """The tool's own status, no trip, nothing outside the scope changed."""
        assert result.returncode == status, (result.stderr[-2000:], self.log()[-3000:])
        assert f"STATUS={status}" in self.log(), self.log()[-3000:]
        assert self.trips() == [], self.log()[-2000:]
        assert _outside(self.ws) == self.before


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_pytest_with_its_cache_from_the_repository_root(tmp_path: Path) -> None:
    run = Tools(tmp_path)
    py = sys.executable
    # The second run reads the cache the first wrote (--lf), and the agent sees it listed.
    result = run(f"{py} -m pytest -q src/checkout && ls -a && cat .pytest_cache/v/cache/nodeids && "
                 f"{py} -m pytest -q --lf src/checkout; echo STATUS=$?")
    run.check(result, 0)
    log = run.log()
    assert log.count("1 passed") == 2 and "PytestCacheWarning" not in log, log[-3000:]
    assert ".pytest_cache\n" in log and '"src/checkout/test_tax.py::test_total"' in log
    assert not (run.ws / ".pytest_cache").exists() and not list(run.ws.glob("pytest-cache-files-*"))
    assert not (run.ws / "src/checkout/__pycache__").exists()  # bytecode, in scope too: in scratch
    assert run.counted()["distinct"] == 0
    assert run.denials() == []


@pytest.mark.root
@pytest.mark.mount
def test_importing_an_out_of_scope_module(tmp_path: Path) -> None:
    run = Tools(tmp_path)
    # The second import loads the bytecode the first wrote (python -v says where from).
    script = "PYTHONPATH=lib /usr/bin/python3 -c 'import helper; print(\"VALUE\", helper.VALUE)'"
    result = run(f"{script} && ls lib/__pycache__ && {script.replace('-c', '-v -c')} 2>&1 | grep 'helper'"
                 "; echo STATUS=$?")
    run.check(result, 0)
    log = run.log()
    assert "VALUE 42" in log and "helper.cpython-311.pyc\nold.cpython-311.pyc" in log, log[-3000:]
    assert "matches" in log and "lib/__pycache__/helper.cpython-311.pyc" in log, log[-3000:]
    # On the host: the stale files, untouched.
    assert {p.name: p.read_bytes() for p in (run.ws / "lib/__pycache__").iterdir()} == {
        "helper.cpython-311.pyc": b"stale", "old.cpython-311.pyc": b"stale"}
    assert run.counted()["distinct"] == 0
    assert run.denials() == []


@pytest.mark.root
@pytest.mark.mount
def test_the_scratch_layer_s_edges(tmp_path: Path) -> None:
    """Generated output already in the workspace is read-only (refused quietly); moving out of
    the scratch layer is EXDEV, so mv copies; removing a scratch tree makes it go away (one
    with a glob name: a literal one is bound natively, tests/test_native_scratch.py)."""
    run = Tools(tmp_path)
    result = run("echo junk > lib/__pycache__/old.cpython-311.pyc; echo WRITE=$?; "
                 "rm lib/__pycache__/old.cpython-311.pyc; echo RM=$?; "
                 "mkdir -p pytest-cache-files-x/x && echo data > pytest-cache-files-x/x/f && "
                 "mv pytest-cache-files-x/x/f src/checkout/f; "
                 "echo MV=$?; cat src/checkout/f; ls -A pytest-cache-files-x/x; echo LISTED; "
                 "rm -r pytest-cache-files-x; echo RMTREE=$?; ls -A; echo STATUS=0")
    run.check(result, 0)
    log = run.log()
    for line in ("WRITE=2", "RM=1", "MV=0\ndata\nLISTED", "RMTREE=0",  # dash exits 2 when a redirection fails
                 "cannot create lib/__pycache__/old.cpython-311.pyc: Read-only file system"):
        assert line in log, log[-3000:]
    assert "pytest-cache-files-x" not in log.split("RMTREE=0")[1]
    assert (run.ws / "src/checkout/f").read_text() == "data\n"
    assert set(run.counted()["list"]) == {"src/checkout/f"}
    denied = {(e["op"], e["rule"], e["errno"]) for e in run.denials()}
    assert denied == {("open", "paths.generated", "EROFS"), ("unlink", "paths.generated", "EROFS"),
                      ("rename", "paths.generated", "EXDEV")}, run.denials()


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_mypy_and_ruff_with_their_caches(tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent
    mypy, ruff = bindir / "mypy", bindir / "ruff"
    if not (mypy.exists() and ruff.exists()):
        pytest.skip("mypy and ruff come with the test extra ('.[test]')")
    run = Tools(tmp_path)
    # From the root (their caches out of scope), then from inside the scope (caches land there),
    # then a type error: mypy's own status 1 is what guard run exits with.
    result = run(f"{mypy} --strict src/checkout/tax.py; {ruff} check --no-fix src/checkout && {mypy} src/checkout"
                 f" && cd src/checkout && {mypy} tax.py && {ruff} check . && {mypy} tax.py && cd ../.. && "
                 "printf 'X: int = \"s\"\\n' > src/checkout/bad.py && "
                 f"{mypy} src/checkout/bad.py; s=$?; echo STATUS=$s; exit $s")
    run.check(result, 1)
    log = run.log()
    assert "Success: no issues found" in log and "All checks passed!" in log
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in log
    assert (run.ws / "src/checkout/.mypy_cache").is_dir() and (run.ws / "src/checkout/.ruff_cache").is_dir()
    assert not (run.ws / ".mypy_cache").exists() and not (run.ws / ".ruff_cache").exists()
    assert set(run.counted()["list"]) == {"src/checkout/bad.py"}


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_pip_install_into_a_venv_in_scope_under_the_default_limits(tmp_path: Path) -> None:
    run = Tools(tmp_path)
    result = run("/usr/bin/python3 -m venv src/checkout/.venv && src/checkout/.venv/bin/pip install -q iniconfig"
                 ' && src/checkout/.venv/bin/python -c "import iniconfig; print(\'IMPORTED\', iniconfig.__name__)"'
                 "; echo STATUS=$?")
    if "No matching distribution" in run.log() or "Could not find a version" in run.log():
        pytest.skip(f"no package index reachable from here: {run.log()[-300:]}")
    run.check(result, 0)
    assert "IMPORTED iniconfig" in run.log()
    assert list((run.ws / "src/checkout/.venv/lib").glob("python3*/site-packages/iniconfig/__init__.py"))
    assert run.counted()["distinct"] == 0


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_npm_install_of_a_local_package_in_scope(tmp_path: Path) -> None:
    npm = require("npm")
    run = Tools(tmp_path)
    pkg = tmp_path / "hello-js"
    pkg.mkdir()
    (pkg / "package.json").write_text('{"name": "hello-js", "version": "1.0.0", "main": "index.js"}\n')
    (pkg / "index.js").write_text("module.exports = () => 'HELLO FROM NPM';\n")
    subprocess.run([npm, "pack", "--silent", "--pack-destination", str(run.ws / "src/checkout")], cwd=pkg,
                   env=run.env, check=True, capture_output=True)
    (run.ws / "src/checkout/package.json").write_text(
        '{"name": "checkout", "version": "0.0.1", "dependencies": {"hello-js": "file:hello-js-1.0.0.tgz"}}\n')
    result = run(f"cd src/checkout && {npm} install --offline --no-audit --no-fund --loglevel=error && "
                 "node -e \"console.log(require('hello-js')())\"; echo STATUS=$?")
    run.check(result, 0)
    assert "HELLO FROM NPM" in run.log()
    assert (run.ws / "src/checkout/node_modules/hello-js/index.js").exists()
    # package-lock.json is the project's own file, written by npm: counted; node_modules/ never.
    assert set(run.counted()["list"]) <= {"src/checkout/package-lock.json"}


@pytest.mark.root
@pytest.mark.mount
def test_staging_bytecode_held_in_scratch_is_refused_and_says_the_way_out(tmp_path: Path) -> None:
    """In a repository without a .gitignore for bytecode, `git add -A` would record files that
    exist only in the run's scratch layer (and a host checkout would then write them): the index
    update is refused quietly, saying why; staging the sources alone works."""
    run = Tools(tmp_path)
    result = run("cd src/checkout && /usr/bin/python3 -c 'import tax' && cd ../.. && echo '# e' >> src/checkout/tax.py"
                 " && { git add -A src/checkout; echo ADD=$?; } && git add src/checkout/tax.py"
                 " && git commit -qm tidy; echo STATUS=$?")
    assert result.returncode == 0 and "STATUS=0" in run.log(), run.log()[-2000:]
    assert "ADD=128" in run.log() and run.trips() == [], run.log()[-2000:]
    [denial] = run.denials()
    assert denial["target"] == ".git/index" and "generated output" in denial["reason"], denial
    assert run.git("show", "--name-only", "--format=", "HEAD").split() == ["src/checkout/tax.py"]
    assert not (run.ws / "src/checkout/__pycache__").exists()  # bytecode stayed in scratch
