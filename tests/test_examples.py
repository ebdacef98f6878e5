"""The CI and cluster examples in containers/ are valid for the tools that will read them.

The schemas come from PyPI packages (check-jsonschema's vendored GitHub workflow, GitLab CI
and Compose schemas; kubernetes-validate's Kubernetes object schemas): no network at test
time. Each validator is also shown a broken copy, so that a test that cannot fail is caught.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

CONTAINERS = Path(__file__).resolve().parent.parent / "containers"
BIN = Path(sys.executable).parent


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


@pytest.mark.parametrize(("name", "schema"), [
    ("github-workflow.yml", "vendor.github-workflows"),
    ("gitlab-ci.yml", "vendor.gitlab-ci"),
    ("compose.yaml", "vendor.compose-spec"),
])
def test_example_matches_its_schema(name: str, schema: str, tmp_path: Path) -> None:
    result = _schema(schema, CONTAINERS / name)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / name
    broken.write_text((CONTAINERS / name).read_text() + "\nnot_a_known_key_0: 1\n")  # not in the schema
    assert _schema(schema, broken).returncode != 0


def test_github_workflow_guards_the_agent_and_uploads_the_run_directory() -> None:
    workflow = _load("github-workflow.yml")
    job = workflow["jobs"]["agent"]
    assert job["env"]["GUARD_ARTIFACT"]
    steps = job["steps"]
    guarded = [s for s in steps if "guard run --ci" in s.get("run", "")]
    assert len(guarded) == 1
    run_dir = "$GUARD_RUN"
    assert f'--run-dir "{run_dir}"' in guarded[0]["run"]
    upload = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert len(upload) == 1 and steps.index(upload[0]) > steps.index(guarded[0])
    assert upload[0]["if"] == "always()"  # a tripped run (exit 75) is the one to look at
    assert upload[0]["with"]["name"] == "${{ env.GUARD_ARTIFACT }}"
    assert upload[0]["with"]["path"] == "${{ env.GUARD_RUN }}"


def test_gitlab_job_keeps_the_run_directory_as_an_artifact() -> None:
    job = _load("gitlab-ci.yml")["guarded-agent"]
    assert any("guard run --ci" in line for line in job["script"])
    assert job["artifacts"]["when"] == "always"
    assert "guard-run/" in job["artifacts"]["paths"]


def test_tools_are_installed() -> None:
    """The validators are test extras, not looked up on PATH (a missing one fails, never skips)."""
    for name in ("check-jsonschema", "kubernetes-validate"):
        assert shutil.which(name, path=str(BIN)), name
