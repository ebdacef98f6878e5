"""containers/k8s/: the Job and the agent-sandbox resources are what their API servers accept,
and the pod they describe runs ``guard run``.

Validation needs no network and no cluster: kubernetes-validate carries the Kubernetes object
schemas; agent-sandbox's CRD schemas are vendored under containers/k8s/schemas/ and checked
strictly, as the API server's strict field validation would (an unknown field is an error).
Each validator is also shown a broken copy, so that a check that cannot fail is caught.

The pod is then reproduced on this machine with the kernel's own means, exactly as the
manifests state it: a user namespace of its own (``hostUsers: false``) in which the guard is
root, new mount, PID, IPC and UTS namespaces with an unmasked /proc (``procMount: Unmasked``),
a /dev holding the runtime's default devices plus /dev/fuse (what a device plugin adds) and no
other, exactly the capabilities the securityContext adds as the bounding, permitted and
effective sets (nothing inheritable or ambient), no seccomp filter (``Unconfined``) and
no_new_privs off (``allowPrivilegeEscalation: true``). No AppArmor profile is applied here
(``Unconfined``). In it, ``guard run --user`` a scripted agent: in-scope writes land, an
out-of-scope write is refused, a forbidden read stops the run (75). Each capability is then
removed in turn and the run must fail: the manifests' set is the minimal one. Without the
device, ``guard run`` and ``guard doctor`` say what is missing.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # check-jsonschema's own (a test extra); no stubs here
import pytest
import yaml

from .helpers import FIX_TAX, FORBIDDEN_TERMINAL

K8S = Path(__file__).resolve().parent.parent / "containers" / "k8s"
SCHEMAS = K8S / "schemas"
BIN = Path(sys.executable).parent
#: The oldest Kubernetes the manifests are written for (hostUsers with procMount: Unmasked) and
#: the newest kubernetes-validate knows (its default).
KUBERNETES_VERSIONS = ("1.33.0", None)
#: Extended resources that FUSE device plugins register for /dev/fuse (containers/k8s/README.md).
FUSE_RESOURCES = {"squat.ai/fuse", "smarter-devices/fuse", "nextflow.io/fuse", "github.com/fuse", "hdls.me/fuse"}
AGENT_SANDBOX_GROUPS = ("agents.x-k8s.io/", "extensions.agents.x-k8s.io/")


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is missing: install the test extras (pip install -e '.[test]')")
    return str(path)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _kubernetes_validate(path: Path, version: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [_tool("kubernetes-validate"), "--strict", *(("-k", version) if version else ()), str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _write_all(path: Path, docs: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


# --- the Job against the Kubernetes schemas -------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_job_matches_the_kubernetes_schemas(version: str | None, tmp_path: Path) -> None:
    result = _kubernetes_validate(K8S / "job.yaml", version)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if " passed " in line]
    assert len(passed) == len(_documents(K8S / "job.yaml")) == 3, result.stdout
    broken = tmp_path / "job.yaml"
    broken.write_text((K8S / "job.yaml").read_text().replace("restartPolicy:", "restartPolicyy:"))
    assert _kubernetes_validate(broken, version).returncode != 0


# --- the agent-sandbox resources against the vendored CRD schemas ----------------------------

def _strict(schema: Any) -> Any:
    """*schema* with unknown fields refused wherever the CRD lists an object's fields.

    The API server prunes or (with strict field validation, kubectl's default) refuses a field
    a structural schema does not list; JSON Schema allows it unless told: this tells it.
    """
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in strict and "additionalProperties" not in strict
            and not strict.get("x-kubernetes-preserve-unknown-fields")):
        strict["additionalProperties"] = False
    return strict


@functools.cache
def _crd_validator(name: str) -> Any:
    return jsonschema.Draft7Validator(_strict(json.loads((SCHEMAS / name).read_text())))


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    """What agent-sandbox's v1beta1 schema for *doc*'s kind, made strict, finds wrong in it."""
    if doc.get("apiVersion") not in ("extensions.agents.x-k8s.io/v1beta1", "agents.x-k8s.io/v1beta1"):
        return [f"apiVersion {doc.get('apiVersion')!r}: the vendored schemas are v1beta1"]
    name = f"{str(doc.get('kind')).lower()}-v1beta1.json"
    if not (SCHEMAS / name).exists():
        return [f"kind {doc.get('kind')!r}: no vendored schema ({name})"]
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
            for error in _crd_validator(name).iter_errors(doc)]


def _sandbox_docs() -> list[dict[str, Any]]:
    return _documents(K8S / "sandbox-template.yaml")


def test_sandbox_resources_match_agent_sandboxs_crd_schemas() -> None:
    docs = _sandbox_docs()
    ours = [d for d in docs if d["apiVersion"].startswith(AGENT_SANDBOX_GROUPS)]
    assert sorted(d["kind"] for d in ours) == ["SandboxClaim", "SandboxTemplate", "SandboxWarmPool"]
    for doc in ours:
        assert _crd_errors(doc) == [], doc["kind"]


@pytest.mark.parametrize(("what", "kind", "breaks"), [
    ("a misspelt field deep in the pod template", "SandboxTemplate",
     lambda d: d["spec"]["podTemplate"]["spec"]["containers"][0]["securityContext"].update(procMunt="Unmasked")),
    ("an unknown top-level spec field", "SandboxTemplate", lambda d: d["spec"].update(podTemplat={})),
    ("a value outside the enum", "SandboxTemplate", lambda d: d["spec"].update(envVarsInjectionPolicy="Always")),
    ("a claim without its required warmPoolRef", "SandboxClaim", lambda d: d["spec"].pop("warmPoolRef")),
    ("a string where an integer goes", "SandboxWarmPool", lambda d: d["spec"].update(replicas="none")),
    ("a kind with no schema", "SandboxClaim", lambda d: d.update(kind="SandboxClam")),
])
def test_a_broken_sandbox_resource_is_refused(what: str, kind: str, breaks: Any) -> None:
    doc = copy.deepcopy(_one(_sandbox_docs(), kind))
    assert _crd_errors(doc) == []
    breaks(doc)
    assert _crd_errors(doc), what


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_sandbox_pod_template_and_configmap_match_the_kubernetes_schemas(version: str | None, tmp_path: Path) -> None:
    """The CRD embeds PodSpec without Kubernetes' own checks: the pod template as a Pod."""
    docs = _sandbox_docs()
    template = _one(docs, "SandboxTemplate")["spec"]["podTemplate"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "guarded-agent", **template["metadata"]},
           "spec": template["spec"]}
    core = [d for d in docs if not d["apiVersion"].startswith(AGENT_SANDBOX_GROUPS)]
    assert [d["kind"] for d in core] == ["ConfigMap"]
    result = _kubernetes_validate(_write_all(tmp_path / "core.yaml", [*core, pod]), version)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed ") == 2, result.stdout
    broken = copy.deepcopy(pod)
    broken["spec"]["containers"][0]["resources"]["limitz"] = broken["spec"]["containers"][0]["resources"]["limits"]
    assert _kubernetes_validate(_write_all(tmp_path / "broken.yaml", [broken]), version).returncode != 0


def test_vendored_schemas_say_where_they_come_from() -> None:
    """Each schema names its CRD file and the agent-sandbox commit; the license travels with them."""
    assert "Apache License" in (SCHEMAS / "LICENSE").read_text()
    names = sorted(p.name for p in SCHEMAS.glob("*.json"))
    assert names == ["sandboxclaim-v1beta1.json", "sandboxtemplate-v1beta1.json", "sandboxwarmpool-v1beta1.json"]
    for name in names:
        comment = json.loads((SCHEMAS / name).read_text())["$comment"]
        assert re.search(r"kubernetes-sigs/agent-sandbox k8s/crds/\S+\.yaml at [0-9a-f]{40}\b", comment), name


# --- what the pods ask for ------------------------------------------------------------------

def _agent(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (agent,) = pod_spec["containers"]
    assert agent["name"] == "agent"
    return agent  # type: ignore[no-any-return]


def _job_pod() -> dict[str, Any]:
    return _one(_documents(K8S / "job.yaml"), "Job")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _sandbox_pod() -> dict[str, Any]:
    return _one(_sandbox_docs(), "SandboxTemplate")["spec"]["podTemplate"]["spec"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("pod", [_job_pod, _sandbox_pod], ids=["job", "sandbox-template"])
def test_the_pod_runs_one_guarded_agent_with_what_guard_needs(pod: Any) -> None:
    spec = pod()
    agent = _agent(spec)
    command = " ".join(agent["command"] + agent["args"])
    assert command.count("guard run --ci") == 1 and "--user agent" in command
    assert "--manifest /etc/guardfs/task/guard.toml" in command  # from the ConfigMap, read-only
    assert "events.jsonl" in command  # the run directory leaves the pod on stdout, as JSON lines
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/etc/guardfs/task"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "configMap" in volumes[mounts["/etc/guardfs/task"]["name"]]
    assert volumes[mounts["/runs"]["name"]]["persistentVolumeClaim"]["claimName"] == "guard-runs"
    assert spec["restartPolicy"] == "Never" and spec["hostUsers"] is False
    assert spec["automountServiceAccountToken"] is False
    fuse = [name for name in agent["resources"]["limits"] if name in FUSE_RESOURCES]
    assert fuse and agent["resources"]["limits"][fuse[0]] == "1"
    assert not any("hostPath" in v for v in spec["volumes"])  # the devices cgroup would refuse it
    context = agent["securityContext"]
    assert context["capabilities"]["drop"] == ["ALL"] and context["privileged"] is False
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is True
    assert context["procMount"] == "Unmasked"
    assert context["seccompProfile"] == {"type": "Unconfined"} and context["appArmorProfile"] == {"type": "Unconfined"}


def test_a_tripped_job_is_not_retried() -> None:
    job = _one(_documents(K8S / "job.yaml"), "Job")
    assert job["spec"]["backoffLimit"] == 0  # exit 75 is the answer, not a failure to retry


def test_the_sandbox_template_grants_what_the_job_grants() -> None:
    assert _agent(_sandbox_pod())["securityContext"] == _agent(_job_pod())["securityContext"]
    assert _agent(_sandbox_pod())["resources"] == _agent(_job_pod())["resources"]
    assert _sandbox_pod()["hostUsers"] == _job_pod()["hostUsers"]


# --- the pod's security context, reproduced -------------------------------------------------

#: The capabilities the manifests add to the agent container (tested above to be the same).
POD_CAPS: list[str] = _agent(_job_pod())["securityContext"]["capabilities"]["add"]
#: What an OCI runtime puts in a container's /dev (runc's defaults), and what the plugin adds.
RUNTIME_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
#: The container's "runtime": run as root inside the new namespaces, it builds /dev from bind
#: mounts (mknod is no use in a user namespace: the nodes would not open), moves it over /dev,
#: and starts the command with exactly the given capabilities (bounding = permitted = effective
#: for root; nothing inheritable or ambient), no seccomp filter, no_new_privs unset.
POD_RUNTIME = r"""
set -eu
devices=$1; caps=$2; shift 2
stage=$(mktemp -d /tmp/guardfs-pod-dev.XXXXXX)
mount -t tmpfs -o mode=0755,nosuid tmpfs "$stage"
for d in $devices; do : > "$stage/$d"; mount --bind "/dev/$d" "$stage/$d"; done
mkdir "$stage/pts" "$stage/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$stage/pts"
ln -s pts/ptmx "$stage/ptmx"
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$stage/shm"
ln -s /proc/self/fd "$stage/fd"
for i in 0:stdin 1:stdout 2:stderr; do ln -s "/proc/self/fd/${i%%:*}" "$stage/${i#*:}"; done
mount --move "$stage" /dev
rmdir "$stage"
echo "$POD_READY" >&2
exec setpriv --inh-caps=-all --ambient-caps=-all --bounding-set="$caps" -- "$@"
"""
#: In the new user namespace: says so on stdout, waits on stdin for its uid and gid maps (dash
#: redirects only fds 0-9: no extra pipes), then enters the other namespaces, stdin /dev/null.
USERNS_THEN_POD = ('echo userns; read -r _; exec </dev/null; exec unshare --mount --pid --ipc --uts --fork '
                   '--kill-child --mount-proc --propagation private -- sh -c "$0" pod "$@"')
#: What the runtime says on stderr once the pod is made, just before it starts the command.
POD_READY = "pod: ready"
#: The pod's uids 0..65535 (kubelet maps them to a range of the node's; here onto the same
#: numbers, so that the test's files keep their owners).
ID_MAP = "0 0 65536\n"


def _setpriv_caps(caps: list[str]) -> str:
    return ",".join(["-all", *(f"+{cap.lower()}" for cap in caps)])


def in_pod(command: list[str], *, caps: list[str], fuse: bool, cwd: Path,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run *command* as root of a pod made as the manifests say, with *caps* and (or not) /dev/fuse."""
    devices = " ".join([*RUNTIME_DEVICES, *(("fuse",) if fuse else ())])
    proc = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", USERNS_THEN_POD, POD_RUNTIME, devices, _setpriv_caps(caps), *command],
        cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "POD_READY": POD_READY},
    )
    assert proc.stdin is not None and proc.stdout is not None
    if proc.stdout.readline() == "userns\n":  # else unshare failed: its stderr says why
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{proc.pid}/{name}", "w", encoding="ascii") as f:
                f.write(ID_MAP)
        proc.stdin.write("go\n")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # unshare --kill-child: the pod's first process, and its PID namespace, go too
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _cap_mask(caps: list[str]) -> int:
    names = subprocess.run(["setpriv", "--list-caps"], capture_output=True, text=True, check=True).stdout.split()
    return sum(1 << names.index(cap.lower()) for cap in caps)


#: The agent: ordinary edits in scope, one write out of scope, then a forbidden read (terminal
#: under FORBIDDEN_TERMINAL) while ignoring SIGTERM: only the guard can end it, by SIGKILL.
AGENT = (
    "id -u; cd src/checkout && mkdir d && echo a > d/f && chmod 755 d/f && touch -d 2001-01-01 d/f "
    "&& mv d/f d/g && ln -s g d/l && rm d/l && echo edits-ok; cd ../..; "
    "echo '# by the agent' >> src/checkout/tax.py && echo in-scope-ok; "
    "echo x > README.md && echo out-of-scope-WRITTEN || echo out-of-scope-refused; "
    "trap '' TERM; cat .env; sleep 60; echo survived"
)
AGENT_USER = "nobody"  # the image's `agent` (uid 1001); here a non-root user every Debian has
AGENT_LINES = ["65534", "edits-ok", "in-scope-ok", "out-of-scope-refused"]


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory the agent's user can reach, as /workspace is in the pod (pytest's tmp_path
    sits under a mode 700 tree: bubblewrap, as the agent's user, could not bind the workspace)."""
    base = Path(tempfile.mkdtemp(prefix="guardfs-k8s-"))
    try:
        os.chmod(base, 0o755)  # noqa: S103 - the agent's user must reach the workspace
        yield base
    finally:
        shutil.rmtree(base)


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    ws = tmp_path / "ws"
    (ws / "src/checkout").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("def total(x):\n    return x\n")
    (ws / "README.md").write_text("readme\n")
    (ws / ".env").write_text("SECRET=1\n")
    subprocess.run(["git", "init", "-q"], cwd=ws, check=True)
    subprocess.run(["chown", "-R", "65534:65534", str(ws)], check=True)  # as the checkout init container does
    manifest = tmp_path / "guard.toml"  # outside the workspace, as the ConfigMap's
    manifest.write_text(FIX_TAX + FORBIDDEN_TERMINAL)
    return ws, manifest


def _guard_run(tmp_path: Path, caps: list[str], fuse: bool = True) -> tuple[subprocess.CompletedProcess[str], Path]:
    ws, manifest = _workspace(tmp_path)
    run_dir = tmp_path / "run"
    result = in_pod([sys.executable, "-m", "sandbox", "run", "--ci", "--user", AGENT_USER, "--manifest", str(manifest),
                     "--run-dir", str(run_dir), "--", "sh", "-c", AGENT], caps=caps, fuse=fuse, cwd=ws)
    return result, ws


def _agent_lines(tmp_path: Path) -> list[str]:
    log = tmp_path / "run/stdout.log"
    return log.read_text().splitlines() if log.exists() else []


def _worked(result: subprocess.CompletedProcess[str], ws: Path, tmp_path: Path) -> bool:
    return (result.returncode == 75 and _agent_lines(tmp_path) == AGENT_LINES
            and (ws / "src/checkout/tax.py").read_text().endswith("# by the agent\n")
            and (ws / "README.md").read_text() == "readme\n")


@pytest.mark.root
@pytest.mark.mount  # it binds the host's /dev/fuse into the pod
def test_the_reproduced_pod_is_the_one_the_manifests_describe(tmp_path: Path) -> None:
    """The harness itself: what a process in it has, read from the kernel."""
    probe = ("import json, os; print(open('/proc/self/status').read()); "
             "print('DEV', json.dumps(sorted(os.listdir('/dev')))); print('USERNS', os.readlink('/proc/self/ns/user'))")
    result = in_pod([sys.executable, "-c", probe], caps=POD_CAPS, fuse=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    status = dict(line.split(":\t", 1) for line in result.stdout.splitlines() if ":\t" in line)
    assert status["Uid"].split()[1] == "0"  # runAsUser: 0
    for field in ("CapPrm", "CapEff", "CapBnd"):
        assert int(status[field], 16) == _cap_mask(POD_CAPS), (field, status[field])
    assert int(status["CapInh"], 16) == 0 and int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"].strip() == "0"  # allowPrivilegeEscalation: true
    assert status["Seccomp"].strip() == "0"  # seccompProfile: Unconfined
    dev = re.search(r"^DEV (.*)$", result.stdout, re.M)
    assert dev is not None
    devices = {"fuse", *RUNTIME_DEVICES, "pts", "shm", "ptmx", "fd", "stdin", "stdout", "stderr"}
    assert json.loads(dev.group(1)) == sorted(devices)
    assert f"USERNS {os.readlink('/proc/self/ns/user')}" not in result.stdout  # hostUsers: false
    assert "PPid:\t0" in result.stdout  # the first process of a PID namespace of its own


@pytest.mark.root
@pytest.mark.mount
def test_guard_run_works_in_the_pods_security_context(reachable: Path) -> None:
    tmp_path = reachable
    result, ws = _guard_run(tmp_path, POD_CAPS)
    assert result.returncode == 75, result.stderr  # the forbidden read stopped the run: tripped
    assert _agent_lines(tmp_path) == AGENT_LINES, result.stderr  # and the agent never said "survived"
    assert (ws / "src/checkout/tax.py").read_text().endswith("# by the agent\n")
    assert (ws / "src/checkout/tax.py").stat().st_uid == 65534
    assert (ws / "src/checkout/d/g").stat().st_mode & 0o777 == 0o755
    assert (ws / "README.md").read_text() == "readme\n"
    assert "TRIP forbidden_path on .env" in result.stderr
    assert "Traceback" not in result.stderr
    ledger = json.loads((tmp_path / "run/ledger.json").read_text())
    assert ledger, "the guard wrote its ledger into the run directory"


@pytest.mark.root
@pytest.mark.mount
@pytest.mark.parametrize("dropped", POD_CAPS)
def test_each_capability_the_manifests_add_is_needed(dropped: str, reachable: Path) -> None:
    """Drop one and ``guard run`` fails: the manifests ask for no capability guard does not use."""
    result, ws = _guard_run(reachable, [cap for cap in POD_CAPS if cap != dropped])
    assert POD_READY in result.stderr, result.stderr  # the pod was made: what failed is guard's
    assert not _worked(result, ws, reachable), (
        f"guard run works without {dropped}: remove it from containers/k8s/job.yaml and sandbox-template.yaml")


DOCTOR_SENTENCE = "Run `guard doctor` to see what this machine lacks and how to fix it."


@pytest.mark.root
@pytest.mark.mount  # the host's /dev/fuse is what the pod is built without (and the pass without it has no unshare)
def test_without_the_device_guard_says_what_is_missing(reachable: Path) -> None:
    """No device plugin resource, no /dev/fuse: the run does not start and says where to look."""
    result, ws = _guard_run(reachable, POD_CAPS, fuse=False)
    assert result.returncode == 69, result.stderr
    assert DOCTOR_SENTENCE in result.stderr, result.stderr
    assert not (reachable / "run/stdout.log").exists()  # the agent never started
    doctor = in_pod([sys.executable, "-m", "sandbox", "doctor"], caps=POD_CAPS, fuse=False, cwd=ws)
    assert doctor.returncode == 69, doctor.stdout + doctor.stderr
    assert any(line.startswith("MISSING /dev/fuse:") for line in doctor.stdout.splitlines()), doctor.stdout
