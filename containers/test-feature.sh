#!/bin/bash
# The devcontainer Feature (features/src/guardfs) in a user's repository, for real: a small
# Python project with its own Dockerfile and .devcontainer/devcontainer.json adding the
# Feature, `devcontainer up --docker-path podman`, then checks through `devcontainer exec`
# (the developer, non-root `vscode`) and `podman exec -u root`. As root, on Debian 12.
#
#   containers/test-feature.sh
#
# stdout: one line per check, "CHECK name ok" or "CHECK name FAIL detail" (tests/test_feature.py
# asserts on them); everything else goes to stderr.
#
# guardfs is not on the index here: the Feature installs a wheel built from a clean clone of
# this checkout, copied into the Feature's folder (its `source` option). The base image, the
# devcontainer CLI and podman's configuration are test-image.sh's (containers/podman-lib.sh).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GUARDFS_CONTAINER_CACHE:-$REPO/.cache/containers}
PYTHON=${PYTHON:-python3}  # builds the wheel (pip, with the host's own index settings)
# shellcheck source=containers/podman-lib.sh
. "$REPO/containers/podman-lib.sh"
say() { printf 'test-feature: %s\n' "$*" >&2; }
check() {  # check NAME STATUS DETAIL
    if [ "$2" -eq 0 ]; then echo "CHECK $1 ok"; else echo "CHECK $1 FAIL $3"; fi
}
oneline() { tail -c "${2:-600}" <<<"$1" | tr '\n' ' '; }

[ "$(id -u)" -eq 0 ] || { say "run as root (apt-get, podman with /dev/fuse)"; exit 77; }
mkdir -p "$CACHE"
TMP=$(mktemp -d /var/tmp/guardfs-feature.XXXXXX)
chmod 0755 "$TMP"
# The images this run's `devcontainer up` builds: named after the workspace folder
# (vsc-sample-project-HASH, its -uid variant), the CLI's Features content image, and the
# untagged ones its build leaves (the user's Dockerfile stage); those not there before the run
# are this run's and removed with its container.
ours='localhost/(vsc-sample-project-|dev_container_feature_content_temp)'
images_before= dangling_before=
cleanup() {
    # GUARDFS_FEATURE_KEEP=1: leave the container and its images for a look (podman rm -f, rmi).
    if [ "${GUARDFS_FEATURE_KEEP:-0}" = 1 ]; then say "kept: container ${DC_ID:-none}, workspace $TMP"; return; fi
    [ -n "${DC_ID:-}" ] && podman rm -f "$DC_ID" >/dev/null 2>&1
    podman images --format '{{.Repository}}:{{.Tag}}' | grep -E "^$ours" | grep -vxF -f <(printf '%s\n' "$images_before") \
        | xargs -r podman rmi >/dev/null 2>&1 || true
    podman images --filter dangling=true --format '{{.ID}}' | grep -vxF -f <(printf '%s\n' "$dangling_before") \
        | xargs -r podman rmi >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT

podman_packages npm
podman_config
base_image
cli=$(devcontainer_cli)
images_before=$(podman images --format '{{.Repository}}:{{.Tag}}' | grep -E "^$ours" || true)
dangling_before=$(podman images --filter dangling=true --format '{{.ID}}')

# ---- the wheel, from the committed tree ---------------------------------------------------------
git clone --quiet "$REPO" "$TMP/src"
say "$(date +%T) building the wheel"
"$PYTHON" -m pip wheel --quiet --no-deps --disable-pip-version-check -w "$TMP/dist" "$TMP/src" >&2
wheel=$(cd "$TMP/dist" && ls guardfs-*.whl)

# ---- the user's repository ------------------------------------------------------------------------
# The project dir's name is lower case: the CLI names its image after it.
ws=$TMP/sample-project
mkdir -p "$ws/app" "$ws/tests" "$ws/.devcontainer"
printf '"""A small application."""\n' > "$ws/app/__init__.py"
printf 'def total(prices):\n    return sum(prices)\n' > "$ws/app/cart.py"
printf 'from app.cart import total\n\ndef test_total():\n    assert total([1, 2]) == 3\n' > "$ws/tests/test_cart.py"
printf '# sample\n' > "$ws/README.md"
cat > "$ws/guard.toml" <<'TOML'
[task]
id = "cart-fix"
goal = "Fix the cart total in app/"
[paths]
allowed = ["app/"]
TOML
# The user's own Dockerfile: their base and their user. The CA and pip lines stand for what a
# user behind a TLS-inspecting proxy already has there: the Feature's install runs in an image
# built FROM this one and sees its certificates and environment.
{
    echo 'ARG BASE=debian:12'
    echo 'FROM ${BASE}'
    echo 'RUN useradd --create-home --shell /bin/bash --uid 1000 vscode'
} > "$ws/.devcontainer/Dockerfile"
extra_ca "$TMP/extra_ca.pem"
if [ -s "$TMP/extra_ca.pem" ]; then
    cp "$TMP/extra_ca.pem" "$ws/.devcontainer/extra-ca.crt"
    { echo 'COPY extra-ca.crt /usr/local/share/ca-certificates/extra-ca.crt'
      echo 'RUN update-ca-certificates >/dev/null'; } >> "$ws/.devcontainer/Dockerfile"
fi
while IFS='=' read -r key value; do
    [ -n "$value" ] && echo "ENV $key=\"$value\"" >> "$ws/.devcontainer/Dockerfile"
done < <(pip_index_env)
# The Feature as a local copy in .devcontainer/ ("./guardfs"), with the wheel beside install.sh.
cp -r "$REPO/features/src/guardfs" "$ws/.devcontainer/guardfs"
cp "$TMP/dist/$wheel" "$ws/.devcontainer/guardfs/"
cat > "$ws/.devcontainer/devcontainer.json" <<EOF
{
  "name": "sample project",
  "build": { "dockerfile": "Dockerfile", "args": { "BASE": "$BASE_IMAGE" } },
  "features": { "./guardfs": { "source": "$wheel" } },
  "remoteUser": "vscode",
  "runArgs": [
    // The one thing a Feature cannot declare (the spec has no devices): the FUSE device.
    "--device=/dev/fuse",
    // Rootful podman only (this test): the CLI adds --userns=keep-id for a non-root
    // remoteUser, which rootful podman refuses; the last --userns wins.
    "--userns=host"
  ]
}
EOF
git -C "$ws" init --quiet
git -C "$ws" add -A
git -C "$ws" -c user.name=dev -c user.email=dev@example.com commit --quiet -m "sample project"
# The developer owns the checkout (uid 1000: vscode in the container; the CLI maps a non-root
# host user onto remoteUser the same way).
chown -R 1000:1000 "$ws"

# ---- devcontainer up --------------------------------------------------------------------------
dc=(--docker-path podman --workspace-folder "$ws")
say "$(date +%T) devcontainer up"
start=$SECONDS
if up=$(timeout 900 "$cli" up "${dc[@]}" --log-level info 2> "$TMP/up.err"); then
    DC_ID=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["containerId"])' <<<"$up")
    check feature-up 0 ""
else
    check feature-up 1 "$(oneline "$(cat "$TMP/up.err")" 1500) $up"
    exit 1
fi
say "$(date +%T) up in $((SECONDS - start)) s"
folder=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["remoteWorkspaceFolder"])' <<<"$up")
dx() { timeout 300 "$cli" exec "${dc[@]}" "$@"; }
set +e  # from here on a step that fails is a FAIL line, and the checks after it still run

# What the Feature declared reached the container.
caps=$(podman container inspect --format '{{.HostConfig.CapAdd}} {{.HostConfig.SecurityOpt}}' "$DC_ID")
out=$(dx sh -c 'test -c /dev/fuse && exec 3<>/dev/fuse && echo opened' 2>&1) && [ "$out" = opened ]
check feature-dev-fuse $? "$out"
grep -q SYS_ADMIN <<<"$caps"; check feature-cap-sys-admin $? "$caps"

# ---- the developer: vscode, not guarded -----------------------------------------------------
out=$(dx id -un 2>&1); [ "$out" = vscode ]; check feature-dev-user $? "$out"
out=$(dx guard --version 2>&1); check feature-guard-on-path $? "$out"
# The build packages came and went in the Feature's step (keepBuildDeps defaults to false).
out=$(dx sh -c 'command -v gcc; dpkg-query -W -f="\${Status} \${Package}\n" libfuse3-dev python3-dev 2>/dev/null | grep " installed "' 2>&1)
[ -z "$out" ]; check feature-build-deps-removed $? "still there: $out"
out=$(dx sh -c "grep -c ' fuse' /proc/self/mounts || true" 2>&1); [ "$out" = 0 ]
check feature-workspace-not-mounted $? "fuse mounts: $out"
# Outside any agent's scope (guard.toml allows app/ only): written directly, read back.
out=$(dx sh -c 'cd "$1" && echo "dev edit" >> README.md && mkdir -p docs && echo notes > docs/notes.md && cat docs/notes.md' sh "$folder" 2>&1)
[ "$out" = notes ] && [ "$(cat "$ws/docs/notes.md")" = notes ] && [ "$(tail -1 "$ws/README.md")" = "dev edit" ]
check feature-dev-writes-anywhere $? "$out"

# ---- an agent under guard run, as vscode and as root ---------------------------------------
# First write outside app/ refused (recoverable trip, feedback), the second trips: exit 75.
agent='echo fixed > app/fix.txt && echo in-scope-ok
if echo agent > README.md 2>/dev/null; then echo out-1-written; else echo out-1-refused; fi
echo agent > setup.cfg 2>/dev/null; echo after-second'
agent_check() {  # agent_check NAME GUARD-RUN-OPTIONS EXEC-PREFIX...
    local name=$1 options=$2 status run_dir log; shift 2
    # shellcheck disable=SC2016  # expanded by the container's shell
    "$@" sh -c 'cd "$1" && rm -f app/fix.txt && exec guard run --ci $3 --manifest guard.toml -- sh -c "$2"' \
        sh "$folder" "$agent" "$options" > "$TMP/$name.out" 2> "$TMP/$name.err" < /dev/null && status=0 || status=$?
    run_dir=$(sed -n 's/^guard: run directory //p' "$TMP/$name.err" | head -1)
    log=$("$@" cat "$run_dir/stdout.log" 2>/dev/null || true)
    local detail="status $status; log: $(oneline "$log" 300); stderr: $(oneline "$(cat "$TMP/$name.err")" 600)"
    grep -qx in-scope-ok <<<"$log" && [ "$(cat "$ws/app/fix.txt" 2>/dev/null)" = fixed ]
    check "$name-in-scope-write" $? "$detail"
    grep -qx out-1-refused <<<"$log" && [ "$(tail -1 "$ws/README.md")" = "dev edit" ]
    check "$name-out-of-scope-refused" $? "$detail"
    [ "$status" -eq 75 ] && [ ! -e "$ws/setup.cfg" ]; check "$name-exit-75-on-second" $? "$detail"
    if [ -n "$run_dir" ]; then "$@" rm -rf "$run_dir"; fi
}
agent_check feature-agent-vscode "" dx
# As root the agent runs as the workspace's owner: a root agent would hold no capability in
# its sandbox and could not write vscode's files (EACCES, not the guard's refusal).
agent_check feature-agent-root "--user vscode" timeout 300 podman exec -u root "$DC_ID"
# After both runs the developer still writes where the agents were refused.
out=$(dx sh -c 'cd "$1" && echo "dev again" >> README.md && tail -1 README.md' sh "$folder" 2>&1)
[ "$out" = "dev again" ] && [ "$(tail -1 "$ws/README.md")" = "dev again" ]
check feature-dev-writes-after-agent $? "$out"
say "$(date +%T) checks done"
