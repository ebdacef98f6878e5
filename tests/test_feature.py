"""The devcontainer Feature in a user's repository, built and run for real (containers/test-feature.sh).

test_feature_in_a_user_repository is marked ``container``: a sample Python project with its
own Dockerfile and ``.devcontainer/devcontainer.json`` adding features/src/guardfs,
``devcontainer up --docker-path podman``, and checks through ``devcontainer exec`` (the
developer is not guarded; an agent under ``guard run`` is, as ``vscode`` and as root). It shares
the base image, the devcontainer CLI and podman's configuration with tests/test_container.py
(containers/podman-lib.sh); one image build, a few minutes, root.

The other tests read the Feature's files: the metadata against the Features spec's fields and
install.sh's refusals of bad options, run for real (before it touches the system).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import assert_container_checks

ROOT = Path(__file__).resolve().parent.parent
FEATURE = ROOT / "features/src/guardfs"

#: Every check the script must report, by name: a check that silently went missing fails.
EXPECTED = [
    "feature-up", "feature-dev-fuse", "feature-cap-sys-admin", "feature-dev-user", "feature-guard-on-path",
    "feature-build-deps-removed",
    "feature-workspace-not-mounted", "feature-dev-writes-anywhere", "feature-dev-writes-after-agent",
] + [
    f"feature-agent-{who}-{what}" for who in ("vscode", "root")
    for what in ("in-scope-write", "out-of-scope-refused", "exit-75-on-second")
]


@pytest.mark.container
@pytest.mark.root
@pytest.mark.mount
@pytest.mark.slow
def test_feature_in_a_user_repository() -> None:
    result = subprocess.run(["bash", str(ROOT / "containers/test-feature.sh")], capture_output=True, text=True,
                            timeout=1500, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHON": sys.executable})
    assert_container_checks(result, EXPECTED)


def test_feature_metadata() -> None:
    """The fields the devcontainer CLI reads, with the options install.sh reads."""
    meta = json.loads((FEATURE / "devcontainer-feature.json").read_text())
    assert meta["id"] == FEATURE.name  # the CLI requires the folder to be named after the id
    assert set(meta["options"]) == {"version", "source", "keepBuildDeps"}
    install = (FEATURE / "install.sh").read_text()
    for option in meta["options"]:
        assert f"{option.upper()}=${{{option.upper()}:-" in install, option  # the CLI's upper-cased name
    assert meta["options"]["version"]["default"] == "latest"
    assert (meta["options"]["keepBuildDeps"]["type"], meta["options"]["keepBuildDeps"]["default"]) == ("boolean", False)
    assert meta["capAdd"] == ["SYS_ADMIN"]
    assert set(meta["securityOpt"]) == {"systempaths=unconfined", "apparmor=unconfined", "seccomp=unconfined"}
    # Nothing at container start: no entrypoint, no mount over the workspace, not privileged.
    assert not {"entrypoint", "mounts", "privileged"} & set(meta)
    assert os.access(FEATURE / "install.sh", os.X_OK)


@pytest.mark.parametrize(("env", "message"), [
    ({"KEEPBUILDDEPS": "yes"}, "keepBuildDeps is 'yes': give true or false"),
    ({"SOURCE": "missing.whl"}, "source 'missing.whl' is not a file"),
    ({"SOURCE": "https://example.org/guardfs.txt"}, "neither a wheel (.whl) nor an sdist"),
    ({"VERSION": "1.0; rm -rf /"}, "version '1.0; rm -rf /' is not a version"),
])
def test_install_refuses_bad_options(env: dict[str, str], message: str) -> None:
    """A bad option stops install.sh with what to give instead, before apt-get or pip run.

    As root the checks come before anything is installed; as another user install.sh stops at
    its first line (root), which is checked below instead.
    """
    result = subprocess.run(["bash", str(FEATURE / "install.sh")], capture_output=True, text=True, timeout=30,
                            stdin=subprocess.DEVNULL, env={"PATH": os.environ["PATH"], **env})
    assert result.returncode == 1
    if os.geteuid() != 0:
        assert "install.sh runs as root" in result.stderr
    else:
        assert message in result.stderr, result.stderr
