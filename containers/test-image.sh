#!/bin/bash
# Build the guardfs image with podman and check, for real, inside it and inside the
# devcontainer, that guard confines an agent. As root, on Debian 12; idempotent.
#
#   containers/test-image.sh [--no-devcontainer]
#
# stdout: one line per check, "CHECK name ok" or "CHECK name FAIL detail" (the pytest
# tests/test_container.py asserts on them); everything else goes to stderr.
#
# What it does:
#  1. installs podman, runc and mmdebstrap with apt-get when missing (npm too, for step 6);
#  2. writes a containers.conf of its own (CONTAINERS_CONF; the user's global config is not
#     touched): runc (crun refuses this kernel's hybrid cgroup layout), cgroupfs, ulimits at
#     or below the host's hard limits;
#  3. builds a Debian 12 base image with mmdebstrap from Debian's archive as the host's apt
#     sources name it and imports it (localhost/guardfs-debian:12; kept: skipped when present);
#  4. builds the project's image from a clean `git clone` of this checkout (committed files
#     only: no .venv, no .cache), with the host's extra CA certificates as a build secret and
#     pip's network index settings as build arguments;
#  5. in `podman run`: guard demo passes, and `guard run --user agent` confines the agent;
#  6. `devcontainer up` (@devcontainers/cli from npm, pinned, under .cache/) with
#     --docker-path podman, and the developer's and an agent's checks via `devcontainer exec`.
set -euo pipefail

DEVCONTAINER=1
[ "${1:-}" = --no-devcontainer ] && DEVCONTAINER=0
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${GUARDFS_CONTAINER_CACHE:-$REPO/.cache/containers}
IMAGE=localhost/guardfs:test
# What every container here needs: /dev/fuse and CAP_SYS_ADMIN to mount the guard, and /proc
# unmasked so that bubblewrap (as a non-root agent) can mount a fresh /proc in its sandbox.
RUN_OPTS=(--network host --device /dev/fuse --cap-add SYS_ADMIN --security-opt systempaths=unconfined)

# shellcheck source=containers/podman-lib.sh
. "$REPO/containers/podman-lib.sh"  # BASE_IMAGE, the devcontainer CLI, podman's configuration
say() { printf 'test-image: %s\n' "$*" >&2; }
check() {  # check NAME STATUS DETAIL
    if [ "$2" -eq 0 ]; then echo "CHECK $1 ok"; else echo "CHECK $1 FAIL $3"; fi
}
stamp() { say "$(date +%T) $*"; }

[ "$(id -u)" -eq 0 ] || { say "run as root (apt-get, podman with /dev/fuse)"; exit 77; }
mkdir -p "$CACHE"
TMP=$(mktemp -d /var/tmp/guardfs-container.XXXXXX)
cleanup() {
    if [ -n "${DC_ID:-}" ]; then
        local image
        image=$(podman container inspect --format '{{.ImageName}}' "$DC_ID" 2>/dev/null || true)
        podman rm -f "$DC_ID" >/dev/null 2>&1 || true
        # The CLI's image for this workspace (the user's uid baked in): the workspace was this
        # run's alone, so is the image; kept, one more would pile up in podman's store each run.
        case "$image" in localhost/vsc-*-uid*) podman rmi "$image" >/dev/null 2>&1 || true ;; esac
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

# ---- 1-3. packages, podman's configuration, the base image (shared: podman-lib.sh) -----------
podman_packages "$([ "$DEVCONTAINER" = 1 ] && echo npm)"
podman_config
base_image

# ---- 4. the project's image, from a clean clone --------------------------------------------
git clone --quiet "$REPO" "$TMP/src"
build=(--build-arg "BASE=$BASE_IMAGE")
# The host's extra CA certificates (a TLS-inspecting proxy's), for pip in the build only.
extra_ca "$TMP/extra_ca.pem"
[ -s "$TMP/extra_ca.pem" ] && build+=(--secret "id=extra_ca,src=$TMP/extra_ca.pem")
# pip's index settings: the network ones (http/https) from PIP_* or pip's config files; local
# file:// indexes and find-links of the host do not exist in the build.
pip_index_env > "$TMP/pip.env"
while IFS='=' read -r key value; do
    [ -n "$value" ] && build+=(--build-arg "$key=$value")
done < "$TMP/pip.env"
stamp "building $IMAGE"
start=$SECONDS
previous=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
if podman build --quiet --network host -f "$TMP/src/containers/Dockerfile" -t "$IMAGE" "${build[@]}" "$TMP/src" > "$TMP/build.log" 2>&1; then
    check image-build 0 ""
    # The image this tag named before, now untagged: ours, and of no use to anyone.
    if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]; then
        podman rmi "$previous" >/dev/null 2>&1 || true
    fi
else
    check image-build 1 "$(tail -c 800 "$TMP/build.log" | tr '\n' ' ')"
    exit 1
fi
stamp "built in $((SECONDS - start)) s"

# ---- 5. inside podman run ---------------------------------------------------------------------
out=$(timeout 300 podman run --rm "${RUN_OPTS[@]}" -e GUARD_WORKSPACE=off "$IMAGE" guard demo 2>&1) && rc=0 || rc=$?
check podman-guard-demo "$rc" "exit $rc: $(tail -c 600 <<<"$out" | tr '\n' ' ')"
stamp "guard demo: exit $rc"
timeout 300 podman run --rm "${RUN_OPTS[@]}" -e GUARD_WORKSPACE=off "$IMAGE" \
    /opt/guardfs/containers/check-agent.sh podman root 2> "$TMP/agent.err" \
    || check podman-check-agent 1 "$(tail -c 600 "$TMP/agent.err" | tr '\n' ' ')"
stamp "podman checks done"

# ---- 6. the devcontainer -------------------------------------------------------------------
[ "$DEVCONTAINER" = 1 ] || exit 0
cli=$(devcontainer_cli)
# A workspace as a developer has it: a clone owned by the container's `dev` (uid 1000).
git clone --quiet "$REPO" "$TMP/ws"
chown -R 1000:1000 "$TMP/ws"
# The repository's devcontainer.json with the image just built instead of a second build
# (the build needs the secret and the base image above, which devcontainer.json cannot pass).
mkdir "$TMP/config"  # the CLI wants the file named devcontainer.json
python3 - "$TMP/ws/containers/devcontainer.json" "$IMAGE" > "$TMP/config/devcontainer.json" <<'PY'
import json, re, sys
text = open(sys.argv[1], encoding="utf-8").read()
config = json.loads(re.sub(r"^\s*//.*$", "", text, flags=re.M))
config.pop("build")
config["image"] = sys.argv[2]
json.dump(config, sys.stdout, indent=2)
PY
dc=("$cli" --docker-path podman --workspace-folder "$TMP/ws" --config "$TMP/config/devcontainer.json")
stamp "devcontainer up"
if up=$(timeout 300 "${dc[0]}" up "${dc[@]:1}" --log-level info 2> "$TMP/up.err"); then
    DC_ID=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["containerId"])' <<<"$up")
    check devcontainer-up 0 ""
else
    check devcontainer-up 1 "$(tail -c 800 "$TMP/up.err" | tr '\n' ' ') $up"
    exit 1
fi
timeout 300 "${dc[0]}" exec "${dc[@]:1}" /opt/guardfs/containers/check-dev.sh 2> "$TMP/dev.err" \
    || check devcontainer-check-dev 1 "$(tail -c 600 "$TMP/dev.err" | tr '\n' ' ')"
timeout 300 "${dc[0]}" exec "${dc[@]:1}" env GUARD_CHECK_BACKING=/var/lib/guardfs/real \
    /opt/guardfs/containers/check-agent.sh devcontainer user 2> "$TMP/agent.err" \
    || check devcontainer-check-agent 1 "$(tail -c 600 "$TMP/agent.err" | tr '\n' ' ')"
stamp "devcontainer checks done"
