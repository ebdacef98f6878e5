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
BASE_IMAGE=localhost/guardfs-debian:12
IMAGE=localhost/guardfs:test
DEVCONTAINER_CLI_VERSION=0.89.0
# What every container here needs: /dev/fuse and CAP_SYS_ADMIN to mount the guard, and /proc
# unmasked so that bubblewrap (as a non-root agent) can mount a fresh /proc in its sandbox.
RUN_OPTS=(--network host --device /dev/fuse --cap-add SYS_ADMIN --security-opt systempaths=unconfined)

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

# ---- 1. packages -------------------------------------------------------------------------
want=(podman runc mmdebstrap)
[ "$DEVCONTAINER" = 1 ] && ! command -v npm >/dev/null && want+=(npm)
missing=()
for pkg in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    stamp "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# ---- 2. podman's configuration, for this script only ------------------------------------------
hard_nofile=$(ulimit -Hn); hard_nproc=$(ulimit -Hu)
nofile=20000; nproc=32768
[ "$hard_nofile" != unlimited ] && [ "$hard_nofile" -lt "$nofile" ] && nofile=$hard_nofile
[ "$hard_nproc" != unlimited ] && [ "$hard_nproc" -lt "$nproc" ] && nproc=$hard_nproc
cat > "$CACHE/containers.conf" <<EOF
# Written by containers/test-image.sh; used through CONTAINERS_CONF by that script only.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF=$CACHE/containers.conf

# ---- 3. the base image ----------------------------------------------------------------------
if ! podman image exists "$BASE_IMAGE"; then
    sources=()
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && grep -Eq 'debian-archive-keyring|[/.]debian\.org' "$f" && sources+=("$f")
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        grep -E '^deb .*[/.]debian\.org' "$f" > "$TMP/$(basename "$f").list" && sources+=("$TMP/$(basename "$f").list")
    done
    stamp "building $BASE_IMAGE with mmdebstrap from ${sources[*]:-the default Debian mirror}"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$TMP/base.tar" "${sources[@]}" >&2
    podman import --quiet --change 'CMD ["/bin/bash"]' "$TMP/base.tar" "$BASE_IMAGE" >&2
    rm -f "$TMP/base.tar"
fi

# ---- 4. the project's image, from a clean clone --------------------------------------------
git clone --quiet "$REPO" "$TMP/src"
build=(--build-arg "BASE=$BASE_IMAGE")
# The host's extra CA certificates (a TLS-inspecting proxy's), for pip in the build only.
find /usr/local/share/ca-certificates -name '*.crt' -type f -exec cat {} + > "$TMP/extra_ca.pem" 2>/dev/null || true
[ -s "$TMP/extra_ca.pem" ] && build+=(--secret "id=extra_ca,src=$TMP/extra_ca.pem")
# pip's index settings: the network ones (http/https) from PIP_* or pip's config files; local
# file:// indexes and find-links of the host do not exist in the build.
python3 - > "$TMP/pip.env" <<'PY'
import configparser, os
keys = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL", "timeout": "PIP_DEFAULT_TIMEOUT",
        "default-timeout": "PIP_DEFAULT_TIMEOUT"}
found = {}
home = os.path.expanduser("~")
for path in ("/etc/xdg/pip/pip.conf", "/etc/pip.conf", f"{home}/.pip/pip.conf", f"{home}/.config/pip/pip.conf"):
    cp = configparser.ConfigParser()
    cp.read(path)
    for key, env in keys.items():
        if cp.has_option("global", key):
            found[env] = cp.get("global", key)
for env in set(keys.values()):
    if os.environ.get(env):
        found[env] = os.environ[env]
for env, value in sorted(found.items()):
    if env != "PIP_DEFAULT_TIMEOUT":
        value = " ".join(u for u in value.split() if u.startswith(("http://", "https://")))
    print(f"{env}={value}")
PY
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
cli_dir=$CACHE/devcontainers-cli-$DEVCONTAINER_CLI_VERSION
cli=$cli_dir/node_modules/.bin/devcontainer
if [ ! -x "$cli" ]; then
    stamp "installing @devcontainers/cli@$DEVCONTAINER_CLI_VERSION into $cli_dir"
    npm install --silent --no-audit --no-fund --prefix "$cli_dir" "@devcontainers/cli@$DEVCONTAINER_CLI_VERSION" >&2
fi
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
