"""The GitHub Action (action.yml) run on this machine as the runner runs a composite action.

Each ``run:`` step is executed in order with ``bash --noprofile --norc -eo pipefail`` (the
runner's ``shell: bash``), its ``env:``, ``if:`` and ``working-directory:`` evaluated, and the
runner's files (GITHUB_OUTPUT, GITHUB_ENV, GITHUB_PATH, GITHUB_STEP_SUMMARY) read back as the
runner reads them. Only a step that ``uses:`` a remote action (the upload) is not run: its
``with:`` is checked instead, and the tarball it would upload is opened. The install is real
(apt-get for what is missing, a virtualenv built from a copy of this checkout, kept in
``.cache/`` as a self-hosted runner's tool cache keeps it), and so is the guarded run.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from guardfs.harvest import remove_tree

from .helpers import CLI_CACHE, FIX_TAX, FORBIDDEN_TERMINAL

ROOT = Path(__file__).resolve().parent.parent
ACTION = ROOT / "action.yml"
#: Where the install step keeps its virtualenv under the runner's tool cache.
TOOL_CACHE = CLI_CACHE / "action-tool-cache"
VENV = TOOL_CACHE / "guardfs-venv"

# Reports steps with tokens, writes in scope, then out of scope twice in a row: the second
# violation stops the run (exit 75), as in tests/test_report.py.
AGENT = """
import os, sys
from sandbox.breaker.client import GuardClient
def spill(name):
    try:
        with open(name, "a") as f:
            f.write("spill\\n")
    except OSError:
        pass
# The runner's files are the step's: a line in GITHUB_ENV or GITHUB_PATH would run code in
# every later step, outside the guard. The sandbox's read-only host refuses them.
for name in ("GITHUB_ENV", "GITHUB_PATH", "GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"):
    try:
        with open(os.environ[name], "a") as f:
            f.write("forged=by the agent\\n")
        print(name, "WRITTEN", flush=True)
    except OSError as err:
        print(name, "refused", err.errno, flush=True)
with GuardClient(os.environ["GUARD_SOCKET"]) as guard:
    guard.request({"type": "step", "tokens_in": 1000, "tokens_out": 100})
    with open("tax.py", "a") as f:  # the agent starts in working-directory: src/checkout
        f.write("# " + sys.argv[1] + "\\n")
    spill("../../README.md")
    guard.request({"type": "step", "tokens_in": 2000, "tokens_out": 100})
    with open("tax.py", "a") as f:
        f.write("# and tested\\n")
    spill("../../notes.md")
    spill("../../README.md")
"""

_EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")
_TOKEN = re.compile(r"\s*(?:(?P<str>'[^']*')|(?P<op>==|!=|&&|\|\||!|\(|\))|(?P<fn>always\(\)|success\(\)|failure\(\))"
                    r"|(?P<ref>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*))")


def _lookup(ref: str, contexts: dict[str, Any]) -> str:
    value: Any = contexts
    for part in ref.split("."):
        if not isinstance(value, dict):
            pytest.fail(f"action.yml: {ref} does not name a value")
        value = value.get(part, "")
    assert isinstance(value, str | int), f"action.yml: {ref} is not a plain value"
    return str(value)


def _substitute(text: str, contexts: dict[str, Any]) -> str:
    """``${{ a.b }}`` in *text* replaced: only plain references, so that a test that does not
    understand an expression fails instead of guessing (and keeps the action's expressions plain)."""
    def one(match: re.Match[str]) -> str:
        if not re.fullmatch(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+", match.group(1)):
            pytest.fail(f"action.yml: this test does not evaluate ${{{{ {match.group(1)} }}}}")
        return _lookup(match.group(1), contexts)
    return _EXPR.sub(one, text)


def _condition(text: str, contexts: dict[str, Any], failed: bool) -> bool:
    """A step's ``if:``: references, string literals, ==, !=, &&, ||, !, parentheses and the
    status functions, as GitHub reads them (a string compared case-insensitively)."""
    text = _EXPR.sub(lambda m: m.group(1), text.strip())
    out, pos, status_checked = [], 0, False
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        assert match, f"action.yml: this test does not evaluate if: {text}"
        pos = match.end()
        if match["str"] is not None:
            out.append(repr(match["str"][1:-1].lower()))
        elif match["op"] is not None:
            out.append({"&&": " and ", "||": " or ", "!": " not "}.get(match["op"], match["op"]))
        elif match["fn"] is not None:
            status_checked = True
            out.append({"always()": "True", "success()": repr(not failed), "failure()": repr(failed)}[match["fn"]])
        else:
            out.append(repr(_lookup(match["ref"], contexts).lower()))
    value = bool(eval("".join(out), {"__builtins__": {}}))  # noqa: S307 - built above from known tokens only
    # Without a status function GitHub adds success(): nothing runs after a failure.
    return value if status_checked else value and not failed


def _runner_file(path: Path) -> dict[str, str]:
    """GITHUB_OUTPUT's or GITHUB_ENV's ``name=value`` and ``name<<DELIMITER`` lines."""
    values: dict[str, str] = {}
    lines = iter(path.read_text().splitlines()) if path.exists() else iter([])
    for line in lines:
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delimiter = line.split("<<", 1)
            body = []
            for inner in lines:
                if inner == delimiter:
                    break
                body.append(inner)
            else:
                pytest.fail(f"{path}: {name} has no closing {delimiter}")
            values[name] = "\n".join(body)
        elif line:
            name, value = line.split("=", 1)
            values[name] = value
    return values


@dataclass
class Ran:
    """One step as the runner ran it (or, for a remote action, would have)."""

    name: str
    skipped: bool
    status: int = 0
    stdout: str = ""
    stderr: str = ""
    uses: str = ""
    with_: dict[str, str] = field(default_factory=dict)


@dataclass
class ActionRun:
    """What a run of the whole action left: its steps, its outputs, the runner's files."""

    steps: list[Ran]
    outputs: dict[str, str]
    failed: bool
    path: list[str]  #: what the steps added to PATH through GITHUB_PATH
    env: dict[str, str]  #: the job's environment after the steps (GITHUB_ENV's lines applied)

    def step(self, name: str) -> Ran:
        (found,) = [s for s in self.steps if s.name == name]
        return found


def run_action(inputs: dict[str, str], env: dict[str, str], workspace: Path, action_path: Path,
               between: dict[str, Any] | None = None) -> ActionRun:
    """Run action.yml's steps as the runner does; *between* maps a step's id to a callable run
    after it with the step's outputs (a fault the guard itself would never let happen, injected
    for the next step)."""
    action = yaml.safe_load(ACTION.read_text())
    given = {name: str(spec.get("default", "")) for name, spec in action["inputs"].items()}
    unknown = set(inputs) - set(given)
    assert not unknown, f"not inputs of action.yml: {unknown}"
    for name, spec in action["inputs"].items():
        assert name in inputs or not spec.get("required"), f"input {name} is required"
    given.update(inputs)
    runner = Path(env["RUNNER_TEMP"])
    contexts: dict[str, Any] = {
        "inputs": given, "steps": {}, "runner": {"temp": str(runner)}, "strategy": {"job-index": "0"},
        "github": {"action_path": str(action_path), "workspace": str(workspace)},
    }
    job_env = dict(env)
    path: list[str] = []
    ran: list[Ran] = []
    failed = False
    for index, step in enumerate(action["runs"]["steps"]):
        name = step["name"]
        if not _condition(str(step.get("if", "success()")), contexts, failed):
            ran.append(Ran(name, skipped=True))
            if "id" in step:
                contexts["steps"][step["id"]] = {"outputs": {}, "outcome": "skipped"}
            continue
        if "uses" in step:  # a remote action: what it would be given, not run here
            assert re.fullmatch(r"[\w-]+/[\w-]+@[0-9a-f]{40}", step["uses"]), f"{step['uses']} is not pinned by commit"
            ran.append(Ran(name, skipped=True, uses=step["uses"],
                           with_={k: _substitute(str(v), contexts) for k, v in step.get("with", {}).items()}))
            continue
        assert step.get("shell") == "bash", f"step {name}: a composite step names its shell"
        files = {key: runner / f"_runner_file_{index}_{key}" for key in ("GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_PATH")}
        script = runner / f"_step_{index}.sh"
        script.write_text(step["run"])
        step_env = {**job_env, **{k: str(v) for k, v in files.items()},
                    "PATH": ":".join([*reversed(path), job_env["PATH"]])}
        step_env.update({k: _substitute(str(v), contexts) for k, v in step.get("env", {}).items()})
        cwd = workspace / _substitute(str(step.get("working-directory", ".")), contexts)
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=cwd,
                              env=step_env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        ran.append(Ran(name, skipped=False, status=proc.returncode, stdout=proc.stdout, stderr=proc.stderr))
        failed = failed or proc.returncode != 0
        if "id" in step:
            contexts["steps"][step["id"]] = {"outputs": _runner_file(files["GITHUB_OUTPUT"]),
                                             "outcome": "failure" if proc.returncode else "success"}
        job_env.update(_runner_file(files["GITHUB_ENV"]))
        if files["GITHUB_PATH"].exists():
            path += files["GITHUB_PATH"].read_text().splitlines()
        if between and step.get("id") in between:
            between[step["id"]](contexts["steps"][step["id"]]["outputs"])
    outputs = {name: _substitute(str(spec["value"]), contexts) for name, spec in action["outputs"].items()}
    return ActionRun(ran, outputs, failed, path, job_env)


@pytest.fixture(scope="module")
def action_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout as the runner fetches an action: its files, no .git, no venv, no build output."""
    copy = tmp_path_factory.mktemp("action") / "guardfs"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.so", "_build", "runs"))
    return copy


def _sample_repository(tmp: Path) -> Path:
    """A user's repository (git init-ed) with its guard.toml at the top."""
    ws = tmp / "repo"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "README.md").write_text("readme\n")
    (ws / "guard.toml").write_text(FIX_TAX + FORBIDDEN_TERMINAL)
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    return ws


def _runner_env(tmp: Path, workspace: Path, action_path: Path, **extra: str) -> dict[str, str]:
    runner = tmp / "runner-temp"
    runner.mkdir()
    home = tmp / "home"
    home.mkdir()
    (tmp / "summary.md").write_text("# an earlier step's summary\n")
    return {
        # Nothing of this checkout or its venv: guard comes from what the install step put on GITHUB_PATH.
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        "CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_JOB": "agent", "GITHUB_RUN_ID": "4242",
        "GITHUB_RUN_ATTEMPT": "1", "GITHUB_WORKSPACE": str(workspace), "GITHUB_ACTION_PATH": str(action_path),
        "GITHUB_STEP_SUMMARY": str(tmp / "summary.md"), "RUNNER_TEMP": str(runner),
        # A self-hosted runner's tool cache, kept between test runs: the venv is made once.
        "RUNNER_TOOL_CACHE": str(TOOL_CACHE),
        "PIP_CACHE_DIR": str(CLI_CACHE / "pip"), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        **extra,
    }


def _run_locked(inputs: dict[str, str], env: dict[str, str], workspace: Path, action_path: Path,
                between: dict[str, Any] | None = None) -> ActionRun:
    """One action run at a time on this machine: the tool cache's venv is shared."""
    CLI_CACHE.mkdir(exist_ok=True)
    with open(CLI_CACHE / "action-tool-cache.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return run_action(inputs, env, workspace, action_path, between)


@dataclass
class Guarded:
    """One run of the whole action on a sample repository."""

    result: ActionRun
    env: dict[str, str]
    workspace: Path
    secret: Path
    run_dir: Path


@pytest.fixture(scope="module")
def guarded(action_path: Path) -> Iterator[Guarded]:
    """The action run with a scripted agent that writes in and out of scope, in
    working-directory src/checkout, the run directory uploaded.

    The runner's directories are on the host's disk, as GitHub's /home/runner/work is, not
    under /tmp, where pytest's base temp usually is: the sandbox has a /tmp of its own, in
    which the agent would find no script and would write the runner's files unrefused."""
    tmp = Path(tempfile.mkdtemp(prefix="guardfs-action-", dir="/var/tmp"))
    try:
        yield _guarded(action_path, tmp)
    finally:
        remove_tree(tmp)


def _guarded(action_path: Path, tmp: Path) -> Guarded:
    ws = _sample_repository(tmp)
    agent = tmp / "agent.py"
    agent.write_text(textwrap.dedent(AGENT))
    secret = tmp / "runner-credentials"
    secret.write_text("ghs_runner_token_not_for_upload\n")
    env = _runner_env(tmp, ws, action_path, AGENT_SCRIPT=str(agent), AGENT_PYTHON=str(VENV / "bin/python"))
    run_dir: list[Path] = []

    def plant_links(outputs: dict[str, str]) -> None:
        # The guard keeps the agent out of its run directory (mode 000, outside the sandbox):
        # the links a hostile agent that got there would leave are planted here instead.
        found = Path(outputs["run-dir"])
        run_dir.append(found)
        (found / "shadow").symlink_to("/etc/shadow")
        (found / "credentials").symlink_to(secret)
        (found / "up").symlink_to("..")
        os.mkfifo(found / "pipe")  # read, it would hang the archive

    # The agent's Python is the one guardfs is installed in, for its client library (GuardClient).
    result = _run_locked({"command": '"$AGENT_PYTHON" "$AGENT_SCRIPT" "fixed the rounding"',
                          "working-directory": "src/checkout", "retention-days": "3"},
                         env, ws, action_path, between={"run": plant_links})
    return Guarded(result, env, ws, secret, run_dir[0])


@pytest.mark.slow  # the first install builds a virtualenv (pyfuse3 compiled); later ones reuse it
@pytest.mark.root
@pytest.mark.mount
def test_the_action_guards_the_agent_and_uploads_the_run_directory_as_a_tarball(guarded: Guarded) -> None:
    result, env, ws, secret = guarded.result, guarded.env, guarded.workspace, guarded.secret
    install, run, archive, upload = result.steps
    assert install.status == 0 and not install.skipped, install.stdout + install.stderr
    assert result.outputs["guard"] == str(VENV / "bin/guard")
    assert result.path == []  # guard is an output: nothing is put on the job's PATH
    stdout = (guarded.run_dir / "stdout.log").read_text()
    for name in ("GITHUB_ENV", "GITHUB_PATH", "GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"):
        assert f"{name} refused 30" in stdout, stdout  # EROFS
    # The guarded run: stopped by the breaker, annotations on the log, the job summary appended.
    assert run.status == 75, run.stdout + run.stderr
    assert result.failed
    assert run.stdout.count("::error file=") >= 2
    assert re.search(r"^::error file=README\.md,line=1,title=guard%3A scope_spill trip::", run.stdout, re.M), run.stdout
    summary = Path(env["GITHUB_STEP_SUMMARY"]).read_text()
    assert "forged" not in summary and not any(v.startswith("by the agent") for v in result.outputs.values())
    assert result.path == [] and "forged" not in result.env
    assert summary.startswith("# an earlier step's summary\n### guard: fix-tax\n")
    assert "| exit status | 75 |" in summary and "uploaded as artifact `guard-run-agent-0-1`" in summary
    assert (ws / "src/checkout/tax.py").read_text().endswith("# fixed the rounding\n# and tested\n")
    assert (ws / "README.md").read_text() == "readme\n" and not (ws / "notes.md").exists()
    assert result.outputs["exit-status"] == "75"
    assert result.outputs["tripped-rule"] == "scope_spill"
    assert result.outputs["breaker"] == "OPEN_SCOPE_SPILL"
    assert result.outputs["run-dir"] == str(guarded.run_dir)
    assert guarded.run_dir.parent == Path(env["RUNNER_TEMP"])
    # After the failure: the archive and the upload still run (always()), and only those.
    assert archive.status == 0 and not archive.skipped, archive.stdout + archive.stderr
    assert upload.uses.startswith("actions/upload-artifact@")
    tarball = Path(result.outputs["archive"])
    assert upload.with_ == {"name": "guard-run-agent-0-1", "path": str(tarball), "if-no-files-found": "error",
                            "retention-days": "3"}
    assert result.outputs["artifact-name"] == "guard-run-agent-0-1"
    with tarfile.open(tarball) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        assert {"ledger.json", "events.jsonl", "stdout.log", "stderr.log", "STATE.md"} <= set(members)
        for name, target in (("shadow", "/etc/shadow"), ("credentials", str(secret)), ("up", "..")):
            assert members[name].issym() and members[name].linkname == target, name
        assert members["pipe"].isfifo()
        events = tar.extractfile(members["events.jsonl"])
        assert events is not None and b"scope_spill" in events.read()
    raw = subprocess.run(["gzip", "-dc", str(tarball)], capture_output=True, check=True).stdout
    assert b"ghs_runner_token_not_for_upload" not in raw
    assert b"root:" not in raw  # /etc/shadow's first line


@pytest.mark.slow  # the first install builds a virtualenv (pyfuse3 compiled); later ones reuse it
@pytest.mark.root
@pytest.mark.mount
def test_a_second_run_installs_nothing_and_a_command_that_would_run_code_outside_is_refused(
        action_path: Path, guarded: Guarded, tmp_path: Path) -> None:
    ws = _sample_repository(tmp_path)
    env = _runner_env(tmp_path, ws, action_path, TASK="a[$(touch $WITNESS)]")
    witness = tmp_path / "ran-outside-the-guard"
    env["WITNESS"] = str(witness)
    # Each would run code outside the guard: the right side of a pipe, a command substitution,
    # the arithmetic of ${NAME:offset} evaluating the task's text (a[$(...)] runs the command).
    refused = {"true | touch $WITNESS": "must be one command line",
               "echo $(touch $WITNESS)": "may expand only $NAME and ${NAME}",
               "echo ${HOME:TASK}": "may expand only $NAME and ${NAME}"}
    for command, words in refused.items():
        # Not uploaded: the archive and the upload are skipped.
        result = _run_locked({"command": command, "upload": "false"}, env, ws, action_path)
        install, run, archive, upload = result.steps
        assert install.status == 0, install.stdout + install.stderr
        # The tool cache's venv is this checkout's: the run of *guarded* (or an earlier session) made it.
        assert "already installed from" in install.stdout and "installing" not in install.stdout, install.stdout
        assert run.status == 64, command
        assert f"::error title=guardfs::the command input {words}" in run.stdout, run.stdout + run.stderr
        assert not witness.exists(), command
        assert archive.skipped and upload.skipped
        assert result.outputs["exit-status"] == "64" and result.outputs["tripped-rule"] == ""
    result = _run_locked({"command": "true", "upload": "yes"}, env, ws, action_path)
    assert result.step("Run the agent under guard").status == 64
    assert "::error title=guardfs::the upload input is true or false" in result.step("Run the agent under guard").stdout
    # The check itself: the same task, named as a variable, is passed as the agent's own text.
    task_echo = 'printf "%s\\n" "$TASK"'
    result = _run_locked({"command": f"bash -c '{task_echo}'", "upload": "false", "run-dir": str(tmp_path / "run")},
                         env, ws, action_path)
    assert result.step("Run the agent under guard").status == 0, result.steps
    assert (tmp_path / "run/stdout.log").read_text() == "a[$(touch $WITNESS)]\n"
    assert not witness.exists()
