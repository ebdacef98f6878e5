"""Agents installed where users install them, runs started where users start them, and the
credential stores of the agent's home (issue 20, findings 1 and 4): real guard runs, real homes.

Each home is a new directory under /home (as a real user's is: under a tree the sandbox covers),
or, for the masks, under /var/tmp (a home the sandbox does not cover) and a real user's home
made with useradd for --user. Each is removed at the end.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guardfs.errors import ManifestError
from guardfs.manifest import parse_manifest
from sandbox.launch.install import installation
from sandbox.launch.workspace import workspace_for

from .helpers import FIX_TAX, git_env, require

#: What the agent reports: every path it sees under $HOME, and what reading each argument gave.
PROBE_PY = r"""#!/usr/bin/python3
import errno, json, os, sys
home = os.environ["HOME"]
seen = [os.path.relpath(os.path.join(d, n), home) for d, dirs, files in os.walk(home) for n in dirs + files]
def read(path):
    try:
        with open(os.path.expanduser(path)) as f:
            return ["ok", f.read()]
    except OSError as err:
        return [errno.errorcode[err.errno], None]
print(json.dumps({"seen": sorted(seen), "reads": {p: read(p) for p in sys.argv[1:]}, "cwd": os.getcwd()}))
"""

#: The same in node, for an npm package: its walk lives in a module of the package.
PROBE_JS = """#!/usr/bin/env node
const fs = require("fs");
const path = require("path");
const { walk } = require("./lib/walk.js");
const home = process.env.HOME;
const reads = {};
for (const p of process.argv.slice(2)) {
  try { reads[p] = ["ok", fs.readFileSync(p.replace(/^~/, home), "utf8")]; }
  catch (err) { reads[p] = [err.code, null]; }
}
const child = require("child_process").execFileSync("node", ["-p", "process.execPath"]).toString().trim();
console.log(JSON.stringify({ seen: walk(home, home).sort(), reads, cwd: process.cwd(), node: child }));
"""

WALK_JS = """const fs = require("fs");
const path = require("path");
function walk(dir, home) {
  let out = [];
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    const full = path.join(dir, e.name);
    out.push(path.relative(home, full));
    if (e.isDirectory()) out = out.concat(walk(full, home));
  }
  return out;
}
module.exports = { walk };
"""

#: What every home holds beside the agent: none of it may show in the sandbox.
HOME_FILES = {"notes.txt": "private notes\n", ".ssh/id_rsa": "PRIVATE KEY\n", ".aws/credentials": "AWS KEY\n",
              ".local/bin/other-tool": "#!/bin/sh\n", ".local/share/other/data": "data\n",
              ".config/myagent/conf": "agent conf\n", ".config/other/conf": "other conf\n"}


@pytest.fixture
def home() -> Iterator[Path]:
    """A home directory under /home, holding HOME_FILES."""
    path = Path(tempfile.mkdtemp(prefix="guardfs-home-", dir="/home"))
    try:
        for name, text in HOME_FILES.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_text(text)
        yield path
    finally:
        shutil.rmtree(path)


def _repository(tmp_path: Path, extra: str = "") -> tuple[Path, Path]:
    """A git repository with a secret .env and an in-scope file, and a manifest for it."""
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / ".env").write_text("SECRET=hunter2\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    manifest = tmp_path / "guard.toml"
    manifest.write_text(FIX_TAX + extra)
    return ws, manifest


def _guard_run(manifest: Path, cwd: Path, run_dir: Path, command: list[str], env: dict[str, str],
               *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbox", "run", "--ci", "--manifest", str(manifest), "--run-dir", str(run_dir),
         *flags, "--", *command],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )


def _report(run_dir: Path, result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = (run_dir / "stdout.log").read_text().splitlines()
    assert lines, (result.returncode, result.stderr, (run_dir / "stderr.log").read_text())
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _install(layout: str, home: Path) -> tuple[Path, set[str]]:
    """The agent installed in *home* as *layout* has it; the PATH directory it is found in, and
    what of the home the sandbox must show for it."""
    bindir = home / ".local/bin"
    if layout == "script":  # a script copied into ~/.local/bin
        _executable(bindir / "agent", PROBE_PY)
        return bindir, {".local", ".local/bin", ".local/bin/agent"}
    if layout == "native":  # Claude Code's native installer: ~/.local/bin/x -> ~/.local/share/x/versions/V
        _executable(home / ".local/share/agent/versions/1.2.3", PROBE_PY)
        (bindir / "agent").symlink_to("../share/agent/versions/1.2.3")
        return bindir, {".local", ".local/bin", ".local/bin/agent", ".local/share", ".local/share/agent",
                        ".local/share/agent/versions", ".local/share/agent/versions/1.2.3"}
    if layout == "pipx":  # pipx: ~/.local/bin/x -> a venv's console script, its shebang the venv's python
        venv = home / ".local/pipx/venvs/agent"
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
        _executable(venv / "bin/agent", PROBE_PY.replace("#!/usr/bin/python3", f"#!{venv}/bin/python", 1))
        (bindir / "agent").symlink_to(venv / "bin/agent")
        shown = {".local", ".local/bin", ".local/bin/agent", ".local/pipx", ".local/pipx/venvs"}
        return bindir, shown | {str(p.relative_to(home)) for p in [venv, *venv.rglob("*")]}
    if layout == "nvm":  # nvm: node and the package under ~/.nvm/versions/node/vX, its bin/ on PATH
        prefix = home / ".nvm/versions/node/v20.0.0"
        (prefix / "bin").mkdir(parents=True)
        shutil.copy2(os.path.realpath(require("node")), prefix / "bin/node")
        _npm_install(home, prefix)
        shown = {".nvm", ".nvm/versions", ".nvm/versions/node"}
        return prefix / "bin", shown | {str(p.relative_to(home)) for p in [prefix, *prefix.rglob("*")]}
    # An npm user prefix: npm install -g --prefix ~/.npm-global.
    _npm_install(home, home / ".npm-global")
    tree = home / ".npm-global/lib/node_modules/agent"
    shown = {".npm-global", ".npm-global/bin", ".npm-global/bin/agent", ".npm-global/lib",
             ".npm-global/lib/node_modules"}
    return home / ".npm-global/bin", shown | {str(p.relative_to(home)) for p in [tree, *tree.rglob("*")]}


def _npm_install(home: Path, prefix: Path) -> None:
    """``npm install -g --prefix PREFIX`` of a tiny local package, offline (its probe a node launcher)."""
    require("npm")
    package = home.parent / f"{home.name}-pkg"
    try:
        _executable(package / "cli.js", PROBE_JS)
        (package / "lib").mkdir()
        (package / "lib/walk.js").write_text(WALK_JS)
        (package / "package.json").write_text(json.dumps({"name": "agent", "version": "1.0.0",
                                                          "bin": {"agent": "cli.js"}}))
        packed = subprocess.run(["npm", "pack", "--silent"], cwd=package, capture_output=True, text=True, check=True)
        subprocess.run(["npm", "install", "-g", "--offline", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        str(package / packed.stdout.strip())],
                       check=True, capture_output=True, env={**os.environ, "HOME": str(home)})
    finally:
        shutil.rmtree(package)
    shutil.rmtree(home / ".npm", ignore_errors=True)  # npm's own cache: not part of the installation


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("layout", ["script", "native", "pipx", "npm", "nvm"])
def test_an_agent_installed_in_its_home_runs_and_sees_nothing_else_of_it(
        tmp_path: Path, home: Path, layout: str) -> None:
    """``guard run -- agent`` with the agent where installers put it, in a home under /home: it runs
    (it failed with 127 before), sees its own installation, ``[sandbox] readable`` and nothing else of
    the home: no other file of ~/.local/bin, no notes, no keys."""
    ws, manifest = _repository(tmp_path, '[sandbox]\nreadable = ["~/.config/myagent/conf"]\n')
    bindir, shown = _install(layout, home)
    env = {**os.environ, "HOME": str(home), "PATH": f"{bindir}:{os.environ['PATH']}"}
    run_dir = tmp_path / "run"
    result = _guard_run(manifest, ws, run_dir, ["agent", "~/notes.txt", "~/.ssh/id_rsa", "~/.config/myagent/conf"],
                        env)
    assert result.returncode == 0, result.stderr
    report = _report(run_dir, result)
    readable = {".config", ".config/myagent", ".config/myagent/conf"}
    assert set(report["seen"]) == shown | readable, report["seen"]
    assert report["reads"] == {"~/notes.txt": ["ENOENT", None], "~/.ssh/id_rsa": ["ENOENT", None],
                               "~/.config/myagent/conf": ["ok", "agent conf\n"]}
    assert report["cwd"] == str(ws)
    if layout in ("npm", "nvm"):  # the agent's own child commands resolve on its PATH, as on the host
        assert report["node"] == (str(bindir / "node") if layout == "nvm" else os.path.realpath(require("node")))
    assert (home / ".local/bin/other-tool").exists()  # the host's home is as it was


@pytest.mark.root
@pytest.mark.mount
def test_a_command_not_on_path_is_refused_before_anything_starts(tmp_path: Path) -> None:
    ws, manifest = _repository(tmp_path)
    run_dir = tmp_path / "run"
    result = _guard_run(manifest, ws, run_dir, ["no-such-agent-zq7x9"], {**os.environ, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 64, result.stderr
    assert "cannot run no-such-agent-zq7x9: not found on PATH (/usr/bin:/bin" in result.stderr
    assert not run_dir.exists()  # refused before the run directory, the mount and the sandbox
    # For an agent of another user, a directory of root's on PATH is not searched: hidden inside.
    root_only = Path(tempfile.mkdtemp(prefix="guardfs-bin-", dir="/root"))
    try:
        _executable(root_only / "root-only-agent", "#!/bin/sh\n")
        result = _guard_run(manifest, ws, run_dir, ["root-only-agent"],
                            {**os.environ, "PATH": f"{root_only}:/usr/bin:/bin"}, "--user", "nobody")
    finally:
        shutil.rmtree(root_only)
    assert result.returncode == 64, result.stderr
    assert "cannot run root-only-agent: not found on PATH (/usr/bin:/bin" in result.stderr
    assert not run_dir.exists()


@pytest.mark.root
@pytest.mark.mount
def test_a_run_from_a_subdirectory_guards_the_whole_repository(tmp_path: Path) -> None:
    """From ``src/`` of a repository the workspace is its top level: ``../.env`` is the repository's
    secret (refused), the manifest's ``src/checkout/`` matches (the edit lands), and the agent starts
    in ``src/`` inside the mount."""
    ws, manifest = _repository(tmp_path)
    run_dir = tmp_path / "run"
    script = "pwd; cat ../.env; echo '# rounded' >> checkout/tax.py && echo edited"
    result = _guard_run(manifest, ws / "src", run_dir, ["sh", "-c", script], dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert f"guard: workspace {ws} (the agent starts in src/)" in result.stderr
    assert (run_dir / "stdout.log").read_text().splitlines() == [str(ws / "src"), "edited"]
    assert "../.env: Permission denied" in (run_dir / "stderr.log").read_text()
    assert (ws / "src/checkout/tax.py").read_text().endswith("# rounded\n")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["path"] == ".env" and e["decision"] == "deny" for e in events)


def test_the_workspace_is_found_as_git_finds_the_top_level(tmp_path: Path) -> None:
    """Checked against git itself: a subdirectory, a linked worktree (a .git file), a directory
    outside any repository; --workspace overrides."""
    git = require("git")
    repo = tmp_path / "repo"
    (repo / "a/b").mkdir(parents=True)
    (repo / "a/b/f").write_text("x\n")
    worktree = ["worktree", "add", "-q", str(tmp_path / "wt")]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "x"], worktree):
        subprocess.run([git, *argv], cwd=repo, env=git_env(tmp_path), check=True)
    (tmp_path / "plain/sub").mkdir(parents=True)
    for cwd in (repo / "a/b", repo, tmp_path / "wt/a/b"):
        top = subprocess.run([git, "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                             check=True).stdout.strip()
        assert workspace_for(cwd, None) == Path(top)
    assert workspace_for(tmp_path / "wt/a", None) == tmp_path / "wt"  # the worktree's .git is a file
    assert workspace_for(tmp_path / "plain/sub", None) == tmp_path / "plain/sub"
    assert workspace_for(repo / "a/b", str(repo / "a")) == repo / "a"


def test_installation_of_a_version_managers_node_and_a_venv_in_a_home(tmp_path: Path) -> None:
    """The layouts no test installs for real (nvm's node, a venv whose base python is pyenv's):
    what the sandbox is told to show, from the same files on disk."""
    nvm = tmp_path / ".nvm/versions/node/v20.1.0"
    node = _executable(nvm / "bin/node", "")  # stands for the ELF binary
    (nvm / "lib/node_modules/cli/bin").mkdir(parents=True)
    _executable(nvm / "lib/node_modules/cli/bin/cli.js", "#!/usr/bin/env node\n")
    (nvm / "bin/cli").symlink_to("../lib/node_modules/cli/bin/cli.js")
    found = installation(str(nvm / "bin/cli"), f"{nvm / 'bin'}:/usr/bin")
    assert found.links == ((str(nvm / "bin/cli"), "../lib/node_modules/cli/bin/cli.js"),)
    assert found.trees == (str(nvm),)  # the package lies inside node's own prefix, which is shown whole
    assert node.exists()
    pyenv = tmp_path / ".pyenv/versions/3.11.7"
    _executable(pyenv / "bin/python3", "")
    (pyenv / "lib").mkdir()
    venv = tmp_path / "venv"
    _executable(venv / "bin/tool", f"#!{venv}/bin/python\n")
    (venv / "bin/python").symlink_to(pyenv / "bin/python3")
    (venv / "pyvenv.cfg").write_text(f"home = {pyenv / 'bin'}\n")
    found = installation(str(venv / "bin/tool"), "/usr/bin")
    assert found.trees == (str(pyenv), str(venv))


@pytest.fixture
def agent_user() -> Iterator[pwd.struct_passwd]:
    """A real user with a home under /home made by useradd, removed with it at the end."""
    require("useradd")
    name = f"gfs{os.getpid() % 100000}"
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)


def _credential_home(home: Path, owner: pwd.struct_passwd | None = None) -> None:
    for name in ("notes.txt", ".ssh/id_rsa", ".aws/credentials"):
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(HOME_FILES[name])
        if owner is not None:
            for path in ((home / name).parent, home / name):
                os.chown(path, owner.pw_uid, owner.pw_gid)


READS = ["~/notes.txt", "~/.ssh/id_rsa", "~/.aws/credentials"]
MASKED = {"~/notes.txt": ["ok", "private notes\n"], "~/.ssh/id_rsa": ["EACCES", None],
          "~/.aws/credentials": ["EACCES", None]}


@pytest.mark.root
@pytest.mark.mount
def test_credential_stores_are_masked_in_a_home_the_sandbox_shows(tmp_path: Path) -> None:
    """A root agent whose HOME lies outside the trees the sandbox covers (/var/tmp here): its home
    reads as on the host, but ~/.ssh and ~/.aws are masked (EACCES), and the console says so."""
    home = Path(tempfile.mkdtemp(prefix="guardfs-home-", dir="/var/tmp"))
    try:
        _credential_home(home)
        (home / ".config").mkdir()
        (home / ".config/tokens.json").write_text("{}\n")
        ws, manifest = _repository(tmp_path, 'secret = ["~/.config/tokens.json"]\n')  # the manifest's own, in [paths]
        probe = _executable(tmp_path / "probe", PROBE_PY)
        run_dir = tmp_path / "run"
        result = _guard_run(manifest, ws, run_dir, [str(probe), *READS, "~/.config/tokens.json"],
                            {**os.environ, "HOME": str(home)})
        assert result.returncode == 0, result.stderr
        assert _report(run_dir, result)["reads"] == {**MASKED, "~/.config/tokens.json": ["EACCES", None]}
        assert f"credential stores masked (a read is refused with EACCES; outside the mount, so not counted): " \
               f"{home}/.ssh, {home}/.aws, {home}/.config/tokens.json" in result.stderr
    finally:
        shutil.rmtree(home)


@pytest.mark.root
@pytest.mark.mount
def test_credential_stores_are_masked_for_an_agent_of_another_user(
        tmp_path: Path, agent_user: pwd.struct_passwd) -> None:
    """``--user``: the agent user's home is bound back read-only, its credential stores are not."""
    home = Path(agent_user.pw_dir)
    _credential_home(home, agent_user)
    ws, manifest = _repository(tmp_path)
    subprocess.run(["chown", "-R", f"{agent_user.pw_uid}:{agent_user.pw_gid}", str(ws)], check=True)
    probe = _executable(home / ".local/bin/agent", PROBE_PY)  # installed in the agent user's own home
    os.chown(probe, agent_user.pw_uid, agent_user.pw_gid)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PATH": f"{probe.parent}:{os.environ['PATH']}"}
    result = _guard_run(manifest, ws, run_dir, ["agent", *READS], env, "--user", agent_user.pw_name)
    assert result.returncode == 0, result.stderr
    assert _report(run_dir, result)["reads"] == MASKED



def test_a_workspace_file_shows_only_an_interpreter_found_on_path(tmp_path: Path) -> None:
    """The agent may write the workspace: a script there that names a hidden file in its ``#!``
    line, or a symlink there into a hidden tree, reveals nothing; ``#!/usr/bin/env NAME`` shows
    NAME's installation as found on the user's PATH."""
    ws, hidden = tmp_path / "ws", tmp_path / "home/.local/share/tool/versions"
    tool = _executable(hidden / "1.0", "")
    _executable(ws / "by-path", f"#!{tool}\n")
    (ws / "link").symlink_to(tool)
    _executable(ws / "by-name", "#!/usr/bin/env tool\n")
    (tmp_path / "home/bin").mkdir()
    (tmp_path / "home/bin/tool").symlink_to(tool)
    search = f"{tmp_path / 'home/bin'}:/usr/bin"
    assert installation(str(ws / "by-path"), search, str(ws)).trees == ()
    assert installation(str(ws / "link"), search, str(ws)).trees == ()
    assert installation(str(ws / "by-name"), search, str(ws)).trees == (str(hidden),)


@pytest.mark.parametrize(("entry", "reason"), [
    ("config/myagent", "must be an absolute path (or start with ~)"),
    ("/", "is over-broad"),
    ("~/../other", "escapes with '..'"),
])
def test_sandbox_readable_is_refused_as_writable_is(entry: str, reason: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(FIX_TAX + f'[sandbox]\nreadable = ["{entry}"]\n')
    assert "sandbox.readable" in str(info.value) and reason in str(info.value), str(info.value)
